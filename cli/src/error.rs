//! The command's error type: every user mistake names the file, the line
//! or the option at fault and what was expected.

use std::path::PathBuf;

use bastile_models::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A file or directory that cannot be read or written.
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    /// A data-set line that is not a valid example.
    #[error("{path}:{line}: {message}")]
    Data {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// A tokenizer that cannot be loaded or does not fit the model.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Options that do not fit together or the machine.
    #[error("{0}")]
    Usage(String),
    /// Loading, saving or running the model.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The GPU ran out of memory during a step.
    #[error(
        "{}, training step {step} on micro-batches of {rows} x {length} tokens; a shorter \
         --max-seq, a smaller --batch-size or --checkpointing needs less memory",
        bastile::launch_failure::out_of_memory_message(*bytes)
    )]
    OutOfMemory {
        step: usize,
        rows: usize,
        length: usize,
        /// What the failed allocation asked for.
        bytes: u64,
    },
}

impl CliError {
    pub fn io(path: impl Into<PathBuf>, e: impl std::fmt::Display) -> Self {
        Self::Io {
            path: path.into(),
            message: e.to_string(),
        }
    }
}

impl From<bastile::BastileError> for CliError {
    fn from(e: bastile::BastileError) -> Self {
        Self::Model(e.into())
    }
}
