//! CubeCL's persistent compilation cache, which programs that train on a
//! GPU turn on at start: kernels compiled by one process are kept on disk
//! and loaded by the next one on the same machine instead of compiled
//! again (on CUDA the PTX that NVRTC produced; NVRTC is most of a fresh
//! process's start, with autotuning, whose results CubeCL already keeps in
//! its own cache).
//!
//! A directory that cannot hold the cache (not writable, a file in it that
//! does not open) leaves it off with a warning; entries CubeCL cannot
//! decode it skips with a warning of its own.
//!
//! The cache holds no device-specific check: a home directory shared by
//! machines with different GPU generations should give each its own
//! `BASTILE_KERNEL_CACHE` directory.

use std::ffi::OsString;
use std::fs::{self, OpenOptions};
use std::path::{Path, PathBuf};

use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// The variable that moves the cache (a directory) or turns it off (`0`).
pub const KERNEL_CACHE_VAR: &str = "BASTILE_KERNEL_CACHE";

/// Where the cache lives: `$BASTILE_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/bastile/kernels`, else `~/.cache/bastile/kernels`;
/// `None` when the variable is `0` or no home directory is known.
pub fn kernel_cache_dir() -> Option<PathBuf> {
    cache_dir_from(|name| std::env::var_os(name))
}

/// [`kernel_cache_dir`] with the environment read through `env`.
fn cache_dir_from(env: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let var = |name: &str| env(name).filter(|v| !v.is_empty());
    if let Some(dir) = var(KERNEL_CACHE_VAR) {
        return (dir != "0").then(|| PathBuf::from(dir));
    }
    let base = var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| var("HOME").map(|home| PathBuf::from(home).join(".cache")))?;
    Some(base.join("bastile").join("kernels"))
}

/// What [`use_kernel_cache`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelCache {
    /// Compiled kernels are kept in this directory.
    On(PathBuf),
    /// CubeCL's own configuration (a `cubecl.toml`) already names a cache.
    Configured,
    /// Off: `BASTILE_KERNEL_CACHE=0`, or no home directory to keep it in.
    Off,
    /// The directory cannot hold the cache (it cannot be created or
    /// written, or a file in it cannot be read): CubeCL would stop the
    /// program on it, so kernels are compiled without it, with a warning.
    Unusable(PathBuf, String),
    /// CubeCL had read its configuration already (a device was used
    /// before the call), so it stays as it was.
    TooLate,
}

/// Turns CubeCL's persistent compilation cache on in [`kernel_cache_dir`],
/// keeping everything else of CubeCL's configuration (its `cubecl.toml`,
/// its environment variables). Call it before the first device is used.
pub fn use_kernel_cache() -> KernelCache {
    if CubeClRuntimeConfig::storage().lock().is_some() {
        return KernelCache::TooLate;
    }
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if config.compilation.cache.is_some() {
        return KernelCache::Configured;
    }
    let Some(dir) = kernel_cache_dir() else {
        return KernelCache::Off;
    };
    if let Err(why) = check_usable(&dir) {
        eprintln!(
            "bastile: the kernel cache in {} is not usable ({why}); kernels are compiled without it",
            dir.display()
        );
        return KernelCache::Unusable(dir, why);
    }
    config.compilation.cache = Some(CacheConfig::File(dir.clone()));
    let mut stored = CubeClRuntimeConfig::storage().lock();
    if stored.is_some() {
        return KernelCache::TooLate;
    }
    *stored = Some(std::sync::Arc::new(config));
    KernelCache::On(dir)
}

/// The directory of CubeCL's compilation cache when it is on in this
/// process (turned on by [`use_kernel_cache`] or by CubeCL's own
/// configuration); `None` when it is off or CubeCL's configuration has not
/// been read yet.
pub fn kernel_cache_active() -> Option<PathBuf> {
    let stored = CubeClRuntimeConfig::storage().lock().clone()?;
    stored.compilation.cache.as_ref().map(CacheConfig::root)
}

/// Whether CubeCL can keep its cache in `dir`: the directory can be
/// created and written, and every file already in it opens for reading
/// and appending (CubeCL stops the program when one does not; entries it
/// cannot decode it skips with a warning). Other processes may use the
/// cache meanwhile: a file that is gone by the time it is opened (their
/// lock files, their own probes) is no obstacle.
fn check_usable(dir: &Path) -> Result<(), String> {
    fs::create_dir_all(dir).map_err(|e| format!("cannot create it: {e}"))?;
    let probe = dir.join(format!(".bastile-probe-{}", std::process::id()));
    fs::write(&probe, b"probe").map_err(|e| format!("cannot write in it: {e}"))?;
    let _ = fs::remove_file(&probe);
    let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        let entries = match fs::read_dir(&next) {
            Err(e) if gone(&e) => continue,
            listed => listed.map_err(|e| format!("cannot list {}: {e}", next.display()))?,
        };
        for entry in entries {
            let path = entry
                .map_err(|e| format!("cannot list {}: {e}", next.display()))?
                .path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            match OpenOptions::new().read(true).append(true).open(&path) {
                // Gone, unless a link to nothing is still there.
                Err(e) if gone(&e) && fs::symlink_metadata(&path).is_err() => {}
                Err(e) => return Err(format!("cannot open {}: {e}", path.display())),
                Ok(_) => {}
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            vars.iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn the_cache_directory_follows_the_environment() {
        let home = [("HOME", "/home/u")];
        assert_eq!(
            cache_dir_from(env(&home)),
            Some(PathBuf::from("/home/u/.cache/bastile/kernels"))
        );
        let xdg = [("HOME", "/home/u"), ("XDG_CACHE_HOME", "/c")];
        assert_eq!(
            cache_dir_from(env(&xdg)),
            Some(PathBuf::from("/c/bastile/kernels"))
        );
        let moved = [("HOME", "/home/u"), (KERNEL_CACHE_VAR, "/k")];
        assert_eq!(cache_dir_from(env(&moved)), Some(PathBuf::from("/k")));
        let off = [("HOME", "/home/u"), (KERNEL_CACHE_VAR, "0")];
        assert_eq!(cache_dir_from(env(&off)), None);
        // An empty variable counts as unset.
        let empty = [("HOME", "/home/u"), ("XDG_CACHE_HOME", "")];
        assert_eq!(
            cache_dir_from(env(&empty)),
            Some(PathBuf::from("/home/u/.cache/bastile/kernels"))
        );
        assert_eq!(cache_dir_from(env(&[])), None);
    }

    #[cfg(unix)]
    #[test]
    fn a_directory_that_cannot_hold_the_cache_is_refused() {
        let base = std::env::temp_dir().join(format!("bastile-cache-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        // A usable directory, with a cache file in a subdirectory.
        let good = base.join("good");
        fs::create_dir_all(good.join("cuda")).unwrap();
        fs::write(good.join("cuda").join("chunk0.cbor"), b"not cbor").unwrap();
        assert_eq!(check_usable(&good), Ok(()));
        // A file where the directory should be.
        let file = base.join("file");
        fs::write(&file, b"x").unwrap();
        let why = check_usable(&file).unwrap_err();
        assert!(why.contains("cannot create it"), "{why}");
        // A cache file that cannot be opened (a link to nothing).
        let broken = base.join("broken");
        fs::create_dir_all(broken.join("cuda")).unwrap();
        std::os::unix::fs::symlink(
            base.join("nowhere"),
            broken.join("cuda").join("chunk0.cbor"),
        )
        .unwrap();
        let why = check_usable(&broken).unwrap_err();
        assert!(why.contains("chunk0.cbor"), "{why}");
        let _ = fs::remove_dir_all(&base);
    }

    #[test]
    fn files_other_processes_remove_meanwhile_are_no_obstacle() {
        let dir = std::env::temp_dir().join(format!("bastile-cache-race-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("cuda")).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Another process's lock files and probes, created and removed.
        let churn = {
            let (dir, stop) = (dir.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let lock = dir.join("cuda").join(format!("toc.lock{}", i % 4));
                    let _ = fs::write(&lock, b"x");
                    let _ = fs::remove_file(&lock);
                    i += 1;
                }
            })
        };
        let results: Vec<_> = (0..300).map(|_| check_usable(&dir)).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        churn.join().unwrap();
        let _ = fs::remove_dir_all(&dir);
        assert!(results.iter().all(Result::is_ok), "{results:?}");
    }
}
