//! CubeCL's persistent compilation cache, which programs that train on a
//! GPU turn on at start: kernels compiled by one process are kept on disk
//! and loaded by the next one on the same machine instead of compiled
//! again (on CUDA the PTX that NVRTC produced; NVRTC is most of a fresh
//! process's start, with autotuning, whose results CubeCL already keeps in
//! its own cache).
//!
//! The cache holds no device-specific check: a home directory shared by
//! machines with different GPU generations should give each its own
//! `BASTILE_KERNEL_CACHE` directory.

use std::ffi::OsString;
use std::path::PathBuf;

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
    config.compilation.cache = Some(CacheConfig::File(dir.clone()));
    let mut stored = CubeClRuntimeConfig::storage().lock();
    if stored.is_some() {
        return KernelCache::TooLate;
    }
    *stored = Some(std::sync::Arc::new(config));
    KernelCache::On(dir)
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
}
