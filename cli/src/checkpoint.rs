//! Checkpoints of `bastile finetune` that a run resumes from, written so
//! that no failure leaves a partial one.
//!
//! A checkpoint directory holds the model (`config.json`, the Burn record
//! `model.mpk`, the tokenizer files), the trainer's state (`optimizer.mpk`,
//! `trainer.json`: see [`bastile_models::Trainer::save_state`]) and
//! `run.json` ([`RunState`]): how far the run got, the losses so far, and
//! what must be the same for a resumed run to continue it exactly (batch
//! shape, seed, padding, dtype and the tokenized data set's fingerprint).
//! Every directory is filled under a temporary name beside its place and
//! renamed into it once complete ([`write_dir_atomically`]).

use std::fmt::Display;
use std::path::{Path, PathBuf};

use bastile_models::TrainConfig;
use serde::{Deserialize, Serialize};

use crate::data::Example;
use crate::{CliError, WeightGradSumArg};

/// The run's progress and settings, `run.json` in a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// Optimizer steps taken.
    pub step: usize,
    /// The optimizer and schedule settings (a resumed run's defaults).
    pub config: TrainConfig,
    /// Examples the sampler has handed out (the data position).
    pub examples_drawn: usize,
    /// Tokens trained on so far (padding excluded).
    pub tokens: usize,
    /// Training seconds so far.
    pub seconds: f64,
    /// The loss of every step taken.
    pub losses: Vec<f64>,
    /// `(step, loss)` of every evaluation so far.
    #[serde(default)]
    pub eval_losses: Vec<(usize, f64)>,
    /// What a resumed run must match.
    pub settings: RunSettings,
}

/// The settings a resumed run must share with the run it continues: they
/// decide which examples each step sees and how they are laid out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunSettings {
    pub batch_size: usize,
    pub grad_accum: usize,
    pub seed: u64,
    pub pad_multiple: usize,
    /// The row length packed micro-batches fill; `None` without packing.
    #[serde(default)]
    pub packed_length: Option<usize>,
    /// The parameter dtype, as Burn names it.
    pub dtype: String,
    /// The run's LoRA options (`--lora-*`); `None` without them.
    #[serde(default)]
    pub lora: Option<String>,
    /// Examples in the tokenized data set.
    pub examples: usize,
    /// [`fingerprint`] of the tokenized data set.
    pub data: u64,
    /// GPUs training data-parallel (`--devices`).
    #[serde(default = "one_device")]
    pub devices: usize,
}

fn one_device() -> usize {
    1
}

/// The settings in which a run differs from a checkpoint's, each as
/// "NAME NOW (the checkpoint has THEN)".
#[derive(Default)]
struct Differences(Vec<String>);

impl Differences {
    fn compare(&mut self, name: &str, now: impl Display, then: impl Display) {
        let (now, then) = (now.to_string(), then.to_string());
        if now != then {
            self.0
                .push(format!("{name} {now} (the checkpoint has {then})"));
        }
    }
}

/// The file of [`RunState`] in a checkpoint.
const RUN_STATE: &str = "run.json";

impl RunState {
    /// An error naming every setting in which a run (`settings`, `config`)
    /// differs from this checkpoint's, so that resuming from `from` would
    /// not continue it.
    pub fn check_resumes(
        &self,
        settings: &RunSettings,
        config: &TrainConfig,
        from: &Path,
    ) -> Result<(), CliError> {
        let (now, then) = (settings, &self.settings);
        let mut d = Differences::default();
        d.compare("--batch-size", now.batch_size, then.batch_size);
        d.compare("--grad-accum", now.grad_accum, then.grad_accum);
        d.compare("--devices", now.devices, then.devices);
        d.compare("--seed", now.seed, then.seed);
        d.compare(
            "padding to a multiple of",
            now.pad_multiple,
            then.pad_multiple,
        );
        let packing = |s: &RunSettings| match s.packed_length {
            Some(n) => format!("rows of {n} tokens"),
            None => "off".into(),
        };
        d.compare("packing", packing(now), packing(then));
        d.compare("--dtype", &now.dtype, &then.dtype);
        let lora = |s: &RunSettings| s.lora.clone().unwrap_or_else(|| "off".into());
        d.compare("LoRA", lora(now), lora(then));
        let data =
            |s: &RunSettings| format!("{} examples, fingerprint {:016x}", s.examples, s.data);
        d.compare("the tokenized data set:", data(now), data(then));
        let (now, then) = (config, &self.config);
        d.compare("--steps", now.total_steps, then.total_steps);
        d.compare("--lr", now.learning_rate, then.learning_rate);
        d.compare("--warmup-steps", now.warmup_steps, then.warmup_steps);
        d.compare("--weight-decay", now.weight_decay, then.weight_decay);
        let norm = |c: &TrainConfig| format!("{:?}", c.max_grad_norm);
        d.compare("--max-grad-norm", norm(now), norm(then));
        let optimizer = |c: &TrainConfig| format!("{:?}", c.optimizer);
        d.compare("--optimizer", optimizer(now), optimizer(then));
        d.compare("--master-weights", now.master_weights, then.master_weights);
        let sum = |c: &TrainConfig| WeightGradSumArg::from(c.loss_weight_grad_sum).name();
        d.compare("--loss-weight-grad-sum", sum(now), sum(then));
        if d.0.is_empty() && now != then {
            d.compare(
                "the training config",
                format!("{now:?}"),
                format!("{then:?}"),
            );
        }
        if d.0.is_empty() {
            return Ok(());
        }
        Err(CliError::Usage(format!(
            "--resume {}: this run would not continue that one: {}; run with the options, data \
             and --max-seq it was started with",
            from.display(),
            d.0.join("; ")
        )))
    }

    pub fn save(&self, dir: &Path) -> Result<(), CliError> {
        let path = dir.join(RUN_STATE);
        let json = serde_json::to_string_pretty(self).expect("the run state serializes");
        std::fs::write(&path, json).map_err(|e| CliError::io(&path, e))
    }

    /// The state of the checkpoint at `dir`; an error says when `dir` is
    /// not a checkpoint this command wrote.
    pub fn load(dir: &Path) -> Result<Self, CliError> {
        let path = dir.join(RUN_STATE);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            CliError::io(
                &path,
                format!("{e} (--resume takes a checkpoint-N directory of `bastile finetune`)"),
            )
        })?;
        serde_json::from_str(&text).map_err(|e| CliError::io(&path, format!("invalid: {e}")))
    }
}

/// A 64-bit FNV-1a hash of the examples' ids and labels (and where each
/// example ends): equal data sets tokenized alike give equal values.
pub fn fingerprint(examples: &[Example]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            hash = (hash ^ u64::from(b)).wrapping_mul(PRIME);
        }
    };
    for e in examples {
        eat(&(e.ids.len() as u64).to_le_bytes());
        for id in &e.ids {
            eat(&id.to_le_bytes());
        }
        for label in &e.labels {
            eat(&label.to_le_bytes());
        }
    }
    hash
}

/// Writes the directory `dir` as a whole: `fill` writes into a fresh
/// temporary directory beside it (`.NAME.partial`), which then takes the
/// place of `dir`. If `fill` fails, or the process dies before the
/// rename, `dir` is left as it was (absent, or the previous version) and
/// only the temporary directory remains, removed by the next write.
pub fn write_dir_atomically(
    dir: &Path,
    fill: impl FnOnce(&Path) -> Result<(), CliError>,
) -> Result<(), CliError> {
    let name = dir
        .file_name()
        .ok_or_else(|| CliError::io(dir, "not a directory name"))?
        .to_string_lossy()
        .into_owned();
    let sibling = |suffix: &str| dir.with_file_name(format!(".{name}.{suffix}"));
    let partial = sibling("partial");
    let replaced = sibling("replaced");
    for stale in [&partial, &replaced] {
        if stale.exists() {
            std::fs::remove_dir_all(stale).map_err(|e| CliError::io(stale, e))?;
        }
    }
    std::fs::create_dir_all(&partial).map_err(|e| CliError::io(&partial, e))?;
    if let Err(e) = fill(&partial) {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    // A directory cannot be renamed over a non-empty one: the previous
    // version steps aside first, and comes back if the new one cannot
    // take its place.
    let had_previous = dir.exists();
    if had_previous {
        std::fs::rename(dir, &replaced).map_err(|e| CliError::io(dir, e))?;
    }
    if let Err(e) = std::fs::rename(&partial, dir) {
        if had_previous {
            let _ = std::fs::rename(&replaced, dir);
        }
        return Err(CliError::io(dir, e));
    }
    if had_previous {
        std::fs::remove_dir_all(&replaced).map_err(|e| CliError::io(&replaced, e))?;
    }
    Ok(())
}

/// The step of a `checkpoint-N` directory name.
fn checkpoint_step(name: &str) -> Option<usize> {
    let digits = name.strip_prefix("checkpoint-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Removes all but the `keep` latest `checkpoint-N` directories of
/// `output`, never `spare` (neither removed nor counted); returns the ones
/// removed, oldest first.
pub fn prune(output: &Path, keep: usize, spare: Option<&Path>) -> Result<Vec<PathBuf>, CliError> {
    let spare = spare.and_then(|p| p.canonicalize().ok());
    let entries = std::fs::read_dir(output).map_err(|e| CliError::io(output, e))?;
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| CliError::io(output, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_spare = spare.is_some() && entry.path().canonicalize().ok() == spare;
        if let Some(step) = checkpoint_step(&name)
            && entry.path().is_dir()
            && !is_spare
        {
            found.push((step, entry.path()));
        }
    }
    found.sort();
    let remove = found.len().saturating_sub(keep);
    let removed: Vec<PathBuf> = found.into_iter().take(remove).map(|(_, p)| p).collect();
    for dir in &removed {
        std::fs::remove_dir_all(dir).map_err(|e| CliError::io(dir, e))?;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bastile-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn listing(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_write_that_fails_midway_leaves_the_previous_checkpoint() {
        let root = scratch("atomic");
        let dir = root.join("checkpoint-2");
        write_dir_atomically(&dir, |d| {
            std::fs::write(d.join("model.mpk"), b"old").map_err(|e| CliError::io(d, e))
        })
        .unwrap();
        let failed = write_dir_atomically(&dir, |d| {
            std::fs::write(d.join("model.mpk"), b"new, half written").unwrap();
            Err(CliError::io(d.join("optimizer.mpk"), "disk full"))
        });
        assert!(matches!(failed, Err(CliError::Io { .. })), "{failed:?}");
        assert_eq!(std::fs::read(dir.join("model.mpk")).unwrap(), b"old");
        assert_eq!(listing(&root), vec!["checkpoint-2"]);
        // A complete write replaces it, leaving nothing else behind.
        write_dir_atomically(&dir, |d| {
            std::fs::write(d.join("model.mpk"), b"new").map_err(|e| CliError::io(d, e))
        })
        .unwrap();
        assert_eq!(std::fs::read(dir.join("model.mpk")).unwrap(), b"new");
        assert_eq!(listing(&dir), vec!["model.mpk"]);
        assert_eq!(listing(&root), vec!["checkpoint-2"]);
        // What a process killed mid-write leaves is cleared by the next.
        std::fs::create_dir_all(root.join(".checkpoint-3.partial")).unwrap();
        write_dir_atomically(&root.join("checkpoint-3"), |_| Ok(())).unwrap();
        assert_eq!(listing(&root), vec!["checkpoint-2", "checkpoint-3"]);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn pruning_keeps_the_latest_checkpoints_only() {
        let root = scratch("prune");
        for name in [
            "checkpoint-10",
            "checkpoint-2",
            "checkpoint-30",
            "checkpoint-x",
            "final",
        ] {
            std::fs::create_dir_all(root.join(name)).unwrap();
        }
        std::fs::write(root.join("checkpoint-40"), b"a file, not a checkpoint").unwrap();
        let removed = prune(&root, 2, None).unwrap();
        assert_eq!(removed, vec![root.join("checkpoint-2")]);
        assert_eq!(
            listing(&root),
            vec![
                "checkpoint-10",
                "checkpoint-30",
                "checkpoint-40",
                "checkpoint-x",
                "final"
            ]
        );
        // The spared one neither goes nor counts.
        let spared = root.join("checkpoint-10");
        let removed = prune(&root, 0, Some(&spared)).unwrap();
        assert_eq!(removed, vec![root.join("checkpoint-30")]);
        assert!(spared.is_dir());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn the_fingerprint_sees_every_token_and_boundary() {
        let ex = |ids: &[u32], labels: &[i64]| Example {
            ids: ids.to_vec(),
            labels: labels.to_vec(),
        };
        let base = fingerprint(&[ex(&[1, 2], &[-100, 2]), ex(&[3], &[3])]);
        assert_eq!(
            base,
            fingerprint(&[ex(&[1, 2], &[-100, 2]), ex(&[3], &[3])])
        );
        for other in [
            vec![ex(&[1, 2], &[-100, 2]), ex(&[4], &[3])],
            vec![ex(&[1, 2], &[1, 2]), ex(&[3], &[3])],
            vec![ex(&[1], &[-100]), ex(&[2, 3], &[2, 3])],
            vec![ex(&[3], &[3]), ex(&[1, 2], &[-100, 2])],
        ] {
            assert_ne!(base, fingerprint(&other), "{other:?}");
        }
    }
}
