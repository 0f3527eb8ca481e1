//! Where a model comes from: a named preset (random weights), a Hugging
//! Face checkpoint directory, a checkpoint this command wrote (Burn
//! record + `config.json`), or a LoRA adapter directory in PEFT's format
//! (its base model named by `base_model_name_or_path`); and the tokenizer
//! that goes with it.

use std::path::{Path, PathBuf};

use bastile_models::lora::{ADAPTER_CONFIG, read_adapter_config};
use bastile_models::{CausalLm, HfConfig, presets};
use burn::module::Module;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::Backend;

use crate::CliError;
use crate::tokenizer::Tokenizer;

/// The Burn record of a checkpoint directory (`.mpk` is added by Burn).
pub const RECORD: &str = "model";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    Preset(String),
    Dir(PathBuf),
}

impl ModelSource {
    /// A directory when one exists at `name`, else a preset name.
    pub fn parse(name: &str) -> Result<Self, CliError> {
        let path = Path::new(name);
        if path.is_dir() {
            return Ok(Self::Dir(path.into()));
        }
        if presets::NAMES.iter().any(|n| n.eq_ignore_ascii_case(name)) {
            return Ok(Self::Preset(name.to_ascii_lowercase()));
        }
        Err(CliError::Usage(format!(
            "`{name}` is neither a model directory nor a preset (presets: {})",
            presets::NAMES.join(", ")
        )))
    }

    pub fn dir(&self) -> Option<&Path> {
        match self {
            Self::Dir(d) => Some(d),
            Self::Preset(_) => None,
        }
    }

    /// How a LoRA adapter names this model as its base: the preset name,
    /// or the directory's absolute path.
    pub fn name(&self) -> String {
        match self {
            Self::Preset(p) => p.clone(),
            Self::Dir(d) => std::fs::canonicalize(d)
                .unwrap_or_else(|_| d.clone())
                .display()
                .to_string(),
        }
    }

    pub fn is_tiny(&self) -> bool {
        matches!(self, Self::Preset(p) if p == presets::TINY)
    }

    /// The model: a preset initialized at random (seed the backend
    /// first for reproducible runs), an HF checkpoint, a Burn record, or
    /// an adapter directory's base model with its adapters.
    pub fn load<B: Backend>(&self, device: &B::Device) -> Result<CausalLm<B>, CliError> {
        match self {
            Self::Preset(name) => Ok(CausalLm::init(&presets::preset(name)?, device)?),
            Self::Dir(dir) => {
                let record = dir.join(format!("{RECORD}.mpk"));
                if dir.join("model.safetensors").is_file()
                    || dir.join("model.safetensors.index.json").is_file()
                {
                    Ok(CausalLm::from_hf_dir(dir, device)?)
                } else if dir.join(ADAPTER_CONFIG).is_file() {
                    let base = adapter_base(dir)?.load::<B>(device)?;
                    Ok(base.load_adapter_dir(dir, None, device)?)
                } else if record.is_file() {
                    let config = HfConfig::from_file(&dir.join("config.json"))?;
                    CausalLm::init(&config, device)?
                        .load_file(dir.join(RECORD), &recorder(), device)
                        .map_err(|e| CliError::io(&record, e))
                } else {
                    Err(CliError::io(
                        dir,
                        "no model.safetensors, model.safetensors.index.json, model.mpk or \
                         adapter_config.json here",
                    ))
                }
            }
        }
    }

    /// The model's configuration alone, no weights read: a preset's, a
    /// directory's `config.json`, or an adapter directory's base model's.
    pub fn config(&self) -> Result<HfConfig, CliError> {
        match self {
            Self::Preset(name) => Ok(presets::preset(name)?),
            Self::Dir(dir) if dir.join(ADAPTER_CONFIG).is_file() => adapter_base(dir)?.config(),
            Self::Dir(dir) => Ok(HfConfig::from_file(&dir.join("config.json"))?),
        }
    }

    /// The tokenizer: `explicit` when given, else the directory's, else
    /// the byte tokenizer for the tiny preset.
    pub fn tokenizer(&self, explicit: Option<&Path>) -> Result<Tokenizer, CliError> {
        if let Some(path) = explicit {
            return Tokenizer::from_file(path);
        }
        match self {
            // An adapter directory without a tokenizer uses its base's.
            Self::Dir(dir) if dir.join(ADAPTER_CONFIG).is_file() => match Tokenizer::from_dir(dir)?
            {
                Some(t) => Ok(t),
                None => adapter_base(dir)?.tokenizer(None),
            },
            Self::Dir(dir) => Tokenizer::from_dir(dir)?.ok_or_else(|| {
                CliError::Tokenizer(format!(
                    "{} has no tokenizer.json: pass --tokenizer",
                    dir.display()
                ))
            }),
            Self::Preset(_) if self.is_tiny() => Ok(Tokenizer::Byte),
            Self::Preset(name) => Err(CliError::Tokenizer(format!(
                "the preset `{name}` comes without a tokenizer: pass --tokenizer \
                 path/to/tokenizer.json (from the model's Hugging Face repository)"
            ))),
        }
    }
}

/// The PEFT config file of a LoRA adapter directory.
/// Whether `name` is a LoRA adapter directory.
pub fn is_adapter_dir(name: &str) -> bool {
    Path::new(name).join(ADAPTER_CONFIG).is_file()
}

/// The base model an adapter directory names (`base_model_name_or_path`).
fn adapter_base(dir: &Path) -> Result<ModelSource, CliError> {
    let path = dir.join(ADAPTER_CONFIG);
    let base = read_adapter_config(dir)?.base_model.ok_or_else(|| {
        CliError::io(
            &path,
            "names no base model (base_model_name_or_path): pass --model BASE --adapter DIR",
        )
    })?;
    ModelSource::parse(&base).map_err(|e| {
        CliError::io(
            &path,
            format!(
                "its base model: {e}; pass the base model's directory with --model BASE \
                 --adapter DIR"
            ),
        )
    })
}

/// The recorder of checkpoints (f32 values, named fields).
pub fn recorder() -> NamedMpkFileRecorder<FullPrecisionSettings> {
    NamedMpkFileRecorder::new()
}
