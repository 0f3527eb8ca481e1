//! What the tests need from the machine.

use std::path::Path;
use std::process::Command;

use crate::run;

/// Whether Mesa's software Vulkan driver (lavapipe) is installed.
fn has_lavapipe() -> bool {
    ["/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d"]
        .iter()
        .any(|dir| {
            std::fs::read_dir(dir)
                .map(|entries| {
                    entries
                        .flatten()
                        .any(|e| e.file_name().to_string_lossy().starts_with("lvp_icd"))
                })
                .unwrap_or(false)
        })
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Makes sure the software Vulkan driver is there, installing it with
/// apt-get when allowed and running as root.
pub fn software_vulkan(install: bool) -> Result<(), String> {
    if has_lavapipe() {
        return Ok(());
    }
    let how = "apt-get install mesa-vulkan-drivers libvulkan1";
    if !install {
        return Err(format!(
            "Mesa's software Vulkan driver is missing: install it with `{how}`"
        ));
    }
    if !is_root() || !Path::new("/usr/bin/apt-get").exists() {
        return Err(format!(
            "Mesa's software Vulkan driver is missing and cannot be installed here: run `sudo {how}` (Debian/Ubuntu)"
        ));
    }
    eprintln!(
        "xtask: installing Mesa's software Vulkan driver (mesa-vulkan-drivers) with apt-get, for the GPU-less test run"
    );
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args([
            "install",
            "-y",
            "-qq",
            "--no-install-recommends",
            "mesa-vulkan-drivers",
            "libvulkan1",
        ])
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    if has_lavapipe() {
        Ok(())
    } else {
        Err("mesa-vulkan-drivers installed but no lavapipe ICD file found".into())
    }
}

/// Vulkan loaders complain without a runtime directory; give them one.
pub fn runtime_dir(cmd: &mut Command) {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        let dir = std::env::temp_dir().join("bastile-xdg");
        let _ = std::fs::create_dir_all(&dir);
        cmd.env("XDG_RUNTIME_DIR", dir);
    }
}

/// Whether `nvidia-smi` lists a GPU.
pub fn has_nvidia_gpu() -> bool {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("GPU"))
        .unwrap_or(false)
}
