//! Hugging Face checkpoints: `from_hf_dir` reads `config.json` and
//! `model.safetensors` (or the shards of `model.safetensors.index.json`)
//! through burn-store, transposing linear weights and mapping norm weights
//! to `gamma`; `save_hf_dir` writes them back in HF's layout and names.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn_store::{
    ApplyError, ApplyResult, BurnToPyTorchAdapter, ModuleSnapshot, PyTorchToBurnAdapter,
    SafetensorsStore,
};
use serde_json::Value;

use crate::ModelError;
use crate::config::HfConfig;
use crate::model::CausalLm;

const WEIGHTS: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// The safetensors files of a checkpoint directory.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let single = dir.join(WEIGHTS);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join(INDEX);
    if !index.is_file() {
        return Err(ModelError::io(
            dir,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("neither {WEIGHTS} nor {INDEX} is there"),
            ),
        ));
    }
    let json: Value = crate::error::read_json(&index)?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| ModelError::Json {
            path: index.clone(),
            message: "no `weight_map` object".into(),
        })?;
    let files: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
    files
        .into_iter()
        .map(|f| {
            let p = dir.join(f);
            if p.is_file() {
                Ok(p)
            } else {
                Err(ModelError::io(
                    &p,
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!("shard listed in {INDEX} is missing"),
                    ),
                ))
            }
        })
        .collect()
}

/// A store reading HF names into Burn's module tree.
fn reader(file: &Path) -> SafetensorsStore {
    SafetensorsStore::from_file(file)
        .with_from_adapter(PyTorchToBurnAdapter)
        .with_key_remapping(r"^(.*norm)\.weight$", "${1}.gamma")
        .skip_enum_variants(true)
        .allow_partial(true)
}

/// Checks the safetensors header before handing the file to burn-store, so
/// a corrupt or truncated file is an error naming the file.
pub(crate) fn check_header(file: &Path) -> Result<(), ModelError> {
    use std::io::Read;
    let bad = |message: String| ModelError::Safetensors {
        path: file.into(),
        message,
    };
    let mut f = std::fs::File::open(file).map_err(|e| ModelError::io(file, e))?;
    let size = f.metadata().map_err(|e| ModelError::io(file, e))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| bad(format!("too short for a safetensors file ({size} bytes)")))?;
    let n = u64::from_le_bytes(len);
    if n == 0 || n > size.saturating_sub(8) || n > 100 << 20 {
        return Err(bad(format!(
            "corrupt safetensors header: it claims {n} bytes in a {size}-byte file"
        )));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .map_err(|e| bad(format!("reading the header: {e}")))?;
    serde_json::from_slice::<Value>(&header)
        .map_err(|e| bad(format!("corrupt safetensors header: {e}")))?;
    Ok(())
}

/// Applies the tensors of `store`, which reads the safetensors file
/// `file`, to `model`; a file that cannot be read is an error naming it.
pub(crate) fn load_file_into<B: Backend>(
    model: &mut CausalLm<B>,
    store: &mut SafetensorsStore,
    file: &Path,
) -> Result<ApplyResult, ModelError> {
    model.load_from(store).map_err(|e| ModelError::Safetensors {
        path: file.into(),
        message: e.to_string(),
    })
}

/// The problems of applying a checkpoint's tensors to a model (shape
/// mismatches, missing and unexpected tensors), all in one error naming
/// the checkpoint directory; `name` turns a module path into the name the
/// checkpoint's format gives it.
pub(crate) fn report_problems(
    errors: &[ApplyError],
    missing: &[String],
    unused: &[String],
    dir: &Path,
    name: &dyn Fn(&str) -> String,
) -> Result<(), ModelError> {
    let names = |paths: &[String]| paths.iter().map(|p| name(p)).collect::<Vec<_>>().join(", ");
    let mut problems = Vec::new();
    for e in errors {
        problems.push(match e {
            ApplyError::ShapeMismatch {
                path,
                expected,
                found,
            } => format!(
                "`{}` has shape {:?} in the checkpoint but the model has {:?}",
                name(path),
                found.as_slice(),
                expected.as_slice()
            ),
            other => other.to_string(),
        });
    }
    if !missing.is_empty() {
        problems.push(format!("missing tensors: {}", names(missing)));
    }
    if !unused.is_empty() {
        problems.push(format!("unexpected tensors: {}", names(unused)));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ModelError::Weights(format!(
            "{} ({})",
            problems.join("; "),
            dir.display()
        )))
    }
}

impl<B: Backend> CausalLm<B> {
    /// Loads a Hugging Face checkpoint directory (`config.json` and
    /// `model.safetensors` or sharded `model.safetensors.index.json`, f32
    /// or bf16; parameters keep the checkpoint's dtype).
    ///
    /// Errors on a missing or unreadable file, a corrupt header, an
    /// unsupported `model_type` or config, a tensor whose shape differs
    /// from the config's (naming the tensor and both shapes), and on every
    /// missing or unexpected tensor (all named).
    pub fn from_hf_dir(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self, ModelError> {
        let dir = dir.as_ref();
        let hf = HfConfig::from_file(&dir.join("config.json"))?;
        let mut model = Self::init(&hf, device)?;
        let files = weight_files(dir)?;
        let mut applied = BTreeSet::new();
        let mut missing = BTreeSet::new();
        let mut unused = BTreeSet::new();
        let mut errors = Vec::new();
        for file in &files {
            check_header(file)?;
            let result = load_file_into(&mut model, &mut reader(file), file)?;
            applied.extend(result.applied);
            missing.extend(result.missing.into_iter().map(|(path, _)| path));
            unused.extend(result.unused);
            errors.extend(result.errors);
        }
        let tied = model.lm_head.is_none();
        let missing: Vec<_> = missing.difference(&applied).cloned().collect();
        // A tied checkpoint may still carry the head (HF sometimes saves it).
        let unused: Vec<_> = unused
            .into_iter()
            .filter(|u| !(tied && u == "lm_head.weight"))
            .collect();
        report_problems(&errors, &missing, &unused, dir, &|path| path.into())?;
        Ok(model)
    }

    /// Writes the model's `config.json` into `dir` (created if needed), with
    /// HF's `architectures` and `torch_dtype` filled in; every checkpoint
    /// format of the model shares it.
    pub fn save_config(&self, dir: impl AsRef<Path>) -> Result<(), ModelError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let mut hf = self.hf_config.clone();
        hf.extra.insert(
            "architectures".into(),
            Value::from(vec![self.config.architecture.hf_class()]),
        );
        let dtype = match self.head_weight().dtype() {
            burn::tensor::DType::BF16 => "bfloat16",
            burn::tensor::DType::F16 => "float16",
            _ => "float32",
        };
        hf.extra.insert("torch_dtype".into(), Value::from(dtype));
        let config = dir.join("config.json");
        let text = serde_json::to_string_pretty(&hf).expect("a config serializes");
        std::fs::write(&config, text).map_err(|e| ModelError::io(&config, e))
    }

    /// Writes `config.json` and `model.safetensors` that HF transformers
    /// loads (`AutoModelForCausalLM.from_pretrained(dir)`), replacing a
    /// checkpoint already there.
    /// A model with LoRA adapters is refused: merge them first
    /// ([`CausalLm::merge_lora`]) or save them alone
    /// ([`CausalLm::save_adapter_dir`]).
    pub fn save_hf_dir(&self, dir: impl AsRef<Path>) -> Result<(), ModelError> {
        let dir = dir.as_ref();
        if self.lora.is_some() {
            return Err(ModelError::Config(
                "the model has LoRA adapters: merge them into the weights (merge_lora) for an \
                 HF checkpoint, or save them alone in PEFT's format (save_adapter_dir)"
                    .into(),
            ));
        }
        self.save_config(dir)?;
        let file = dir.join(WEIGHTS);
        let mut store = SafetensorsStore::from_file(&file)
            .with_to_adapter(BurnToPyTorchAdapter)
            .with_key_remapping(r"^(.*norm)\.gamma$", "${1}.weight")
            .skip_enum_variants(true)
            // Saving again into the same directory replaces the checkpoint,
            // as it replaces config.json.
            .overwrite(true)
            .metadata("format", "pt");
        self.save_into(&mut store)
            .map_err(|e| ModelError::Safetensors {
                path: file.clone(),
                message: e.to_string(),
            })
    }
}
