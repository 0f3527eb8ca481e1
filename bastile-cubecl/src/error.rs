//! Errors the host-side launchers report instead of faulting in a kernel.

/// Why a kernel could not be launched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The shapes given do not describe a valid problem for this kernel.
    #[error("invalid shape: {0}")]
    Shape(String),
    /// The runtime cannot run this kernel configuration (too many units,
    /// too much shared memory, an unsupported dtype, ...).
    #[error("unsupported on this device: {0}")]
    Unsupported(String),
    /// The runtime rejected the launch.
    #[error("launch failed: {0}")]
    Launch(String),
}
