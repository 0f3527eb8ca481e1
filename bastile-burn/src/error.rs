//! The error type of Bastile's public API.

/// A user mistake Bastile reports instead of computing something wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BastileError {
    /// Tensor shapes that do not fit together.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A dtype the op does not take, or dtypes that differ.
    #[error("dtype mismatch: {0}")]
    DType(String),
    /// Tensors on different devices.
    #[error("device mismatch: {0}")]
    Device(String),
    /// An invalid option value.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A training step that could not be recorded or replayed as a CUDA
    /// graph (see [`crate::graph`]).
    #[error("step graph: {0}")]
    Graph(String),
}
