//! The error type of the model crate: every user mistake (a bad path, a
//! corrupt file, a config the models do not support, weights that do not
//! fit the config) is reported with what was expected and what was found.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (config, shard index) that does not parse.
    #[error("{path}: invalid JSON: {message}")]
    Json { path: PathBuf, message: String },
    /// A config the models cannot build.
    #[error("invalid or unsupported config: {0}")]
    Config(String),
    /// A safetensors file that cannot be read (e.g. a corrupt header).
    #[error("{path}: {message}")]
    Safetensors { path: PathBuf, message: String },
    /// Weights that do not fit the model built from the config.
    #[error("the checkpoint does not match the model: {0}")]
    Weights(String),
    /// A training step that could not be applied (a label outside the
    /// vocabulary, a loss or gradient that is not finite); it changed no
    /// parameter.
    #[error("training step {step}: {message}")]
    Step { step: usize, message: String },
    /// A training step whose loss or gradient norm is not finite; it was
    /// skipped and changed no parameter.
    #[error("training step {step}: {message}")]
    NonFinite { step: usize, message: String },
    /// An error the device reported (outside a training step, whose
    /// errors are [`ModelError::Step`]).
    #[error("{0}")]
    Device(String),
    /// A worker of a data-parallel trainer (see [`crate::parallel`]) that
    /// failed or stopped answering; the run cannot go on.
    #[error("data-parallel worker {worker}: {message}")]
    Worker { worker: usize, message: String },
    /// A tensor-level mistake reported by Bastile (shape, dtype, device).
    #[error(transparent)]
    Bastile(#[from] bastile::BastileError),
}

/// The JSON file at `path`, parsed; an unreadable or invalid file is an
/// error naming it.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(
    path: &std::path::Path,
) -> Result<T, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::Json {
        path: path.into(),
        message: e.to_string(),
    })
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// This error as data-parallel worker `worker` reports it: a step's
    /// error keeps its kind (a non-finite step stays one) and names the
    /// worker; any other becomes [`ModelError::Worker`].
    pub(crate) fn on_worker(self, worker: usize) -> Self {
        match self {
            Self::Step { step, message } => Self::Step {
                step,
                message: format!("worker {worker}: {message}"),
            },
            Self::NonFinite { step, message } => Self::NonFinite {
                step,
                message: format!("worker {worker}: {message}"),
            },
            Self::Worker { .. } => self,
            other => Self::Worker {
                worker,
                message: other.to_string(),
            },
        }
    }
}
