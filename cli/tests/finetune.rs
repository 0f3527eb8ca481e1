//! `bastile finetune` end to end on the tiny preset and the embedded data
//! set: the loss falls from the untrained level, checkpoints and the HF
//! export load back and answer alike, the learned style shows in the
//! replies, a resumed run repeats the losses of the run that never
//! stopped, bad options fail before training, on a GPU runtime the fused
//! kernels follow the baseline's losses, and `bastile warmup` runs one step
//! per length and refuses what it cannot run.

use std::path::{Path, PathBuf};

use bastile::WeightGradSum;
use bastile_cli::device::{DeviceKind, routes_experts};
use bastile_cli::finetune::{self, Finetune, FinetuneOptions, FinetuneReport};
use bastile_cli::generate::{self, GenerateOptions};
use bastile_cli::warmup::{self, WarmupOptions};
use bastile_cli::{CliError, DTypeArg};
use bastile_cubecl::FloatDtype;
use bastile_cubecl::testing::{from_bytes, rel_l2, runtime_selected};
use bastile_models::{Checkpointing, ExpertRouting, LoraConfig, OptimizerKind};
use safetensors::SafeTensors;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bastile-ft-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn options(output: PathBuf, steps: usize) -> FinetuneOptions {
    FinetuneOptions {
        model: "bastile-tiny".into(),
        tokenizer: None,
        data: None,
        eval_data: None,
        eval_fraction: None,
        eval_every: None,
        chat_format: None,
        output,
        max_seq: None,
        batch_size: 8,
        packing: true,
        pad_to_multiple: None,
        grad_accum: 1,
        epochs: None,
        steps: Some(steps),
        learning_rate: None,
        warmup_steps: None,
        weight_decay: 0.0,
        max_grad_norm: Some(1.0),
        optimizer: OptimizerKind::Fused,
        master_weights: false,
        loss_weight_grad_sum: WeightGradSum::default(),
        save_every: None,
        keep_last: None,
        skip_nonfinite: false,
        resume: None,
        dtype: DTypeArg::Auto,
        seed: 3,
        progress: false,
        log_every: 20,
        lora: None,
        merge_lora: false,
        devices: 1,
        checkpointing: Checkpointing::Off,
        expert_routing: None,
        router_aux_loss: None,
        step_graphs: false,
    }
}

/// Runs draw their initial weights from the backend's process-wide random
/// generator, which each seeds; generation and model loading draw from it
/// too (they build a model, adapters included, before reading its
/// weights). One at a time, so that no test's weights depend on another
/// test's draws.
static ONE_RUN_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the process-wide generator for the caller until dropped.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_RUN_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn finetune(
    device: DeviceKind,
    bastile: bool,
    o: FinetuneOptions,
) -> Result<FinetuneReport, CliError> {
    let _alone = alone();
    finetune::run(device, bastile, o)
}

/// Each step's loss equals the other run's, bit for bit.
fn same_losses(what: &str, a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.to_bits() == y.to_bits(),
            "{what}, step {}: {x} vs {y}",
            step + 1
        );
    }
}

/// Two runs ended with the same weights: each f32 tensor of their final
/// `file`s (safetensors) equals the other's bit for bit (a mismatch reports
/// its relative L2 distance).
fn same_weights(what: &str, a: &Path, b: &Path, file: &str) {
    let (bytes_a, bytes_b) = (
        std::fs::read(a.join(file)).unwrap(),
        std::fs::read(b.join(file)).unwrap(),
    );
    let (a, b) = (
        SafeTensors::deserialize(&bytes_a).unwrap(),
        SafeTensors::deserialize(&bytes_b).unwrap(),
    );
    let (mut names, mut names_b) = (a.names(), b.names());
    names.sort();
    names_b.sort();
    assert_eq!(names, names_b, "{what}: {file}");
    let values = |t: &safetensors::tensor::TensorView<'_>| -> Vec<f64> {
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{what}: {file}");
        from_bytes(FloatDtype::F32, t.data())
    };
    for name in names {
        let (x, y) = (
            values(&a.tensor(name).unwrap()),
            values(&b.tensor(name).unwrap()),
        );
        assert!(
            x.iter().zip(&y).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{what}: {name} is {:.2e} (relative L2) from the uninterrupted run's",
            rel_l2(&x, &y)
        );
    }
}

fn greedy(models: Vec<String>, prompt: &str) -> Vec<String> {
    greedy_with(models, None, prompt)
}

fn greedy_with(models: Vec<String>, adapter: Option<PathBuf>, prompt: &str) -> Vec<String> {
    let o = GenerateOptions {
        models,
        tokenizer: None,
        chat_format: None,
        prompts: vec![prompt.into()],
        max_new_tokens: 24,
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        dtype: DTypeArg::Auto,
        adapter,
    };
    let _alone = alone();
    generate::run(DeviceKind::Cpu, false, o)
        .unwrap()
        .into_iter()
        .map(|r| r.text)
        .collect()
}

#[test]
fn the_tiny_default_learns_the_embedded_style_on_the_cpu() {
    let out = temp_dir("cpu");
    let mut o = options(out.clone(), 120);
    o.save_every = Some(60);
    let report = finetune(DeviceKind::Cpu, true, o).unwrap();
    let l = &report.losses;
    assert_eq!(l.len(), 120);
    // Untrained, the model is near uniform over its 264 tokens.
    let uniform = (264f64).ln();
    assert!(
        (l[0] - uniform).abs() < 0.15 * uniform,
        "first loss {}",
        l[0]
    );
    let tail: f64 = l[110..].iter().sum::<f64>() / 10.0;
    assert!(tail < 0.4 * l[0], "loss {} -> {tail}", l[0]);
    assert_eq!(report.checkpoints, vec![out.join("checkpoint-60")]);
    assert!(report.tokens > 120 * 8 * 20, "{} tokens", report.tokens);
    // The HF export has learned the style; the untrained preset, asked
    // beside it, has not.
    let final_dir = report.final_dir.to_string_lossy().into_owned();
    let replies = greedy(
        vec![final_dir.clone(), "bastile-tiny".into()],
        "What is Rust?",
    );
    assert!(replies[0].starts_with("Ahoy!"), "{replies:?}");
    assert!(!replies[1].starts_with("Ahoy!"), "{replies:?}");
    // Training goes on from the export and from the Burn-record
    // checkpoint with their trained weights (a step at learning rate 0
    // measures the loss where they stand).
    let again = temp_dir("reload");
    for (from, bound) in [
        (final_dir, tail * 1.5 + 0.1),
        (
            out.join("checkpoint-60").to_string_lossy().into_owned(),
            0.6 * l[0],
        ),
    ] {
        let mut more = options(again.clone(), 1);
        more.model = from.clone();
        more.learning_rate = Some(0.0);
        let next = finetune(DeviceKind::Cpu, false, more).unwrap();
        assert!(
            next.losses[0] < bound,
            "{from}: {} (first {}, tail {tail})",
            next.losses[0],
            l[0]
        );
    }
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&again);
}

/// A run resumed from its checkpoint at step 3 takes steps 4 to 7 with
/// the losses of the run that never stopped (f32, on the CPU): weights,
/// optimizer moments and step, schedule and data position all come back.
/// Gradient accumulation and an epoch boundary (32 examples, 12 a step)
/// fall inside the resumed part. Both end with the same weights.
#[test]
fn a_resumed_run_repeats_the_uninterrupted_losses() {
    for optimizer in [OptimizerKind::Fused, OptimizerKind::Burn] {
        let out = temp_dir(&format!("whole-{optimizer:?}"));
        let mut o = options(out.clone(), 7);
        o.batch_size = 6;
        o.grad_accum = 2;
        o.optimizer = optimizer;
        o.save_every = Some(3);
        o.keep_last = Some(1);
        let whole = finetune(DeviceKind::Cpu, true, o.clone()).unwrap();
        // Checkpoints at 3 and 6; only the latest is kept.
        assert_eq!(whole.checkpoints, vec![out.join("checkpoint-6")]);
        assert!(!out.join("checkpoint-3").exists());

        // Stopped after step 3 (a run of 7 steps that saved at 3), then
        // resumed.
        let first = temp_dir(&format!("first-{optimizer:?}"));
        let mut stopped = o.clone();
        stopped.output = first.clone();
        stopped.keep_last = None;
        let cut = finetune(DeviceKind::Cpu, true, stopped).unwrap();
        let resumed_out = temp_dir(&format!("resumed-{optimizer:?}"));
        let mut resumed = o.clone();
        resumed.output = resumed_out.clone();
        resumed.model = "not read when resuming".into();
        resumed.resume = Some(first.join("checkpoint-3"));
        // The backend is chosen by the checkpoint's model, not by `model`.
        let mut named_experts = resumed.clone();
        named_experts.model = "gpt-oss-20b-4l".into();
        assert!(!routes_experts(&Finetune(named_experts.clone())));
        named_experts.resume = None;
        assert!(routes_experts(&Finetune(named_experts)));
        let rest = finetune(DeviceKind::Cpu, true, resumed).unwrap();
        same_losses("before the stop", &cut.losses[..3], &whole.losses[..3]);
        same_losses(&format!("{optimizer:?}"), &rest.losses, &whole.losses);
        same_weights(
            &format!("{optimizer:?}"),
            &rest.final_dir,
            &whole.final_dir,
            "model.safetensors",
        );
        assert_eq!(rest.tokens, whole.tokens, "{optimizer:?}");

        // A setting that would change the run is refused before training.
        let mut other = o.clone();
        other.output = resumed_out.clone();
        other.resume = Some(first.join("checkpoint-3"));
        other.batch_size = 4;
        other.seed = 5;
        other.packing = false;
        let e = finetune(DeviceKind::Cpu, true, other)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--batch-size 4 (the checkpoint has 6)")
                && e.contains("--seed 5 (the checkpoint has 3)")
                && e.contains("packing off (the checkpoint has rows of"),
            "{e}"
        );
        let mut other = o.clone();
        other.output = resumed_out.clone();
        other.resume = Some(first.join("checkpoint-3"));
        other.steps = Some(9);
        other.loss_weight_grad_sum = WeightGradSum::Exact;
        let e = finetune(DeviceKind::Cpu, true, other)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--steps 9 (the checkpoint has 7)")
                && e.contains("--loss-weight-grad-sum exact (the checkpoint has chunks)"),
            "{e}"
        );
        let mut other = o.clone();
        other.output = resumed_out.clone();
        other.resume = Some(first.clone());
        let e = finetune(DeviceKind::Cpu, true, other)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--resume takes a checkpoint-N directory"), "{e}");
        for dir in [out, first, resumed_out] {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// LoRA on the CPU: adapters of rank 16 on a frozen base (the tiny
/// preset's random weights, exported as an HF checkpoint) lower the loss; checkpoints and final/ hold only the adapters, in PEFT's format,
/// naming their base; a run resumed from a checkpoint repeats the
/// uninterrupted losses (the optimizer state applies to the reloaded
/// adapters); the final adapters and the merged HF export both train on
/// from where the run ended; LoRA options that differ from the
/// checkpoint's are refused.
#[test]
fn lora_adapters_learn_on_a_frozen_base_and_resume() {
    let base_out = temp_dir("lora-base");
    let mut o = options(base_out.clone(), 1);
    o.learning_rate = Some(0.0);
    let base = finetune(DeviceKind::Cpu, false, o).unwrap().final_dir;
    let base_name = std::fs::canonicalize(&base).unwrap();

    let out = temp_dir("lora");
    let mut o = options(out.clone(), 40);
    o.model = base.to_string_lossy().into_owned();
    o.learning_rate = Some(3e-3);
    o.lora = Some(LoraConfig::new(16).with_alpha(32.0));
    o.merge_lora = true;
    o.save_every = Some(20);
    let whole = finetune(DeviceKind::Cpu, true, o.clone()).unwrap();
    let l = &whole.losses;
    let tail: f64 = l[35..].iter().sum::<f64>() / 5.0;
    // The frozen random head bounds the logits (its rows are small and
    // the final norm fixes the hidden state's size): the adapters bring
    // the loss from near uniform (5.6) to about 4.7, no lower.
    assert!(tail < 0.88 * l[0], "LoRA loss {} -> {tail}", l[0]);
    for dir in [out.join("checkpoint-20"), whole.final_dir.clone()] {
        assert!(dir.join("adapter_model.safetensors").is_file(), "{dir:?}");
        assert!(!dir.join("model.safetensors").exists(), "{dir:?}");
        assert!(!dir.join("model.mpk").exists(), "{dir:?}");
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["r"], 16);
        assert_eq!(config["lora_alpha"], 32.0);
        assert_eq!(
            config["base_model_name_or_path"],
            base_name.to_str().unwrap()
        );
    }

    // Resumed at step 20: the same losses as the run that never stopped.
    let resumed_out = temp_dir("lora-resumed");
    let mut resumed = o.clone();
    resumed.output = resumed_out.clone();
    resumed.resume = Some(out.join("checkpoint-20"));
    let rest = finetune(DeviceKind::Cpu, true, resumed).unwrap();
    same_losses("resumed LoRA run", &rest.losses, l);
    same_weights(
        "resumed LoRA run",
        &rest.final_dir,
        &whole.final_dir,
        "adapter_model.safetensors",
    );
    let mut other = o.clone();
    other.output = resumed_out.clone();
    other.resume = Some(out.join("checkpoint-20"));
    other.lora = Some(LoraConfig::new(8));
    let e = finetune(DeviceKind::Cpu, true, other)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("LoRA rank 8") && e.contains("(the checkpoint has rank 16"),
        "{e}"
    );

    // The final adapters (on their base) and the merged export both stand
    // where the run ended: a step at learning rate 0 measures the loss.
    let merged = whole
        .merged_dir
        .clone()
        .expect("--merge-lora writes final-merged");
    assert!(merged.join("model.safetensors").is_file());
    let again = temp_dir("lora-again");
    for from in [whole.final_dir.clone(), merged] {
        let mut more = options(again.clone(), 1);
        more.model = from.to_string_lossy().into_owned();
        more.learning_rate = Some(0.0);
        let next = finetune(DeviceKind::Cpu, false, more).unwrap();
        assert!(
            next.losses[0] < tail * 1.3,
            "{from:?}: {} (LoRA run {} -> {tail})",
            next.losses[0],
            l[0]
        );
    }
    // `generate` answers alike from the adapter directory (its base
    // found through the adapter's config), from the base with --adapter
    // and from the merged export; the adapters change the answer.
    let name = |p: &PathBuf| p.to_string_lossy().into_owned();
    let adapted = greedy(
        vec![
            name(&whole.final_dir),
            name(whole.merged_dir.as_ref().unwrap()),
        ],
        "What is Rust?",
    );
    let with_adapter = greedy_with(
        vec![name(&base)],
        Some(whole.final_dir.clone()),
        "What is Rust?",
    );
    let plain = greedy(vec![name(&base)], "What is Rust?");
    assert_eq!(adapted[0], adapted[1]);
    assert_eq!(with_adapter[0], adapted[0]);
    assert_ne!(plain[0], adapted[0]);
    // An adapter directory trains its own adapters: --lora-rank again is
    // refused.
    let mut twice = options(again.clone(), 1);
    twice.model = whole.final_dir.to_string_lossy().into_owned();
    twice.lora = Some(LoraConfig::new(4));
    let e = finetune(DeviceKind::Cpu, false, twice)
        .unwrap_err()
        .to_string();
    assert!(e.contains("is a LoRA adapter directory"), "{e}");
    for dir in [base_out, out, resumed_out, again] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Whether every float parameter of a module is finite.
struct AllFinite(bool);

impl<B: burn::tensor::backend::Backend> burn::module::ModuleVisitor<B> for AllFinite {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<burn::Tensor<B, D>>) {
        let t = param.val();
        let bad = t.clone().is_nan().bool_or(t.is_inf()).any().into_data();
        let bad = bad.to_vec::<bool>().expect("a bool");
        self.0 &= !bad[0];
    }
}

/// A learning rate that blows the weights up makes a later step's loss or
/// gradient not finite: training stops with an error naming the step, and
/// the checkpoint before it stays (finite); with `--skip-nonfinite` the bad
/// batches are passed over until too many come in a row.
#[test]
fn a_step_that_is_not_finite_stops_or_is_skipped() {
    use burn::module::Module;
    let out = temp_dir("nonfinite");
    let mut o = options(out.clone(), 20);
    o.learning_rate = Some(1e38);
    o.max_grad_norm = None;
    o.save_every = Some(1);
    let e = finetune(DeviceKind::Cpu, false, o.clone())
        .unwrap_err()
        .to_string();
    assert!(e.contains("is not finite"), "{e}");
    let step: usize = e
        .strip_prefix("training step ")
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step named: {e}"));
    assert!(step >= 2, "{e}");
    assert!(!out.join(format!("checkpoint-{step}")).exists());
    let last = out.join(format!("checkpoint-{}", step - 1));
    let model = {
        let _alone = alone();
        bastile_cli::source::ModelSource::Dir(last.clone())
            .load::<burn::backend::NdArray>(&Default::default())
            .unwrap()
    };
    let mut finite = AllFinite(true);
    model.visit(&mut finite);
    assert!(
        finite.0,
        "{} holds a value that is not finite",
        last.display()
    );

    o.skip_nonfinite = true;
    o.output = temp_dir("nonfinite-skip");
    let e = finetune(DeviceKind::Cpu, false, o.clone())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("training step {step}: "))
            && e.contains(&format!(
                "{} steps in a row before it were not finite",
                finetune::MAX_SKIPPED_IN_A_ROW
            )),
        "{e}"
    );
    for dir in [out, o.output] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// An evaluation set held out of the data, or read from a file: its loss
/// is reported at every `--eval-every` step and at the end, and falls as
/// the model learns; naming both sets is refused. One example per row
/// (`--no-packing`), as the other runs pack.
#[test]
fn the_evaluation_loss_is_reported_and_falls() {
    let out = temp_dir("eval");
    let mut o = options(out.clone(), 30);
    o.packing = false;
    o.eval_fraction = Some(0.25);
    o.eval_every = Some(12);
    let report = finetune(DeviceKind::Cpu, false, o).unwrap();
    let steps: Vec<usize> = report.eval_losses.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, vec![12, 24, 30]);
    let first = report.eval_losses[0].1;
    let last = report.eval_losses[2].1;
    let uniform = (264f64).ln();
    assert!(
        first < 0.7 * uniform && last < 0.95 * first,
        "{:?}",
        report.eval_losses
    );

    let file = std::env::temp_dir().join(format!("bastile-ft-eval-{}.jsonl", std::process::id()));
    let lines: Vec<&str> = include_str!("../data/tiny.jsonl").lines().take(3).collect();
    std::fs::write(&file, lines.join("\n")).unwrap();
    let mut o = options(temp_dir("eval-file"), 2);
    o.eval_data = Some(file.clone());
    let report = finetune(DeviceKind::Cpu, false, o.clone()).unwrap();
    assert_eq!(report.eval_losses.len(), 1);
    assert_eq!(report.eval_losses[0].0, 2);
    assert!(report.eval_losses[0].1.is_finite());

    o.eval_fraction = Some(0.5);
    let e = finetune(DeviceKind::Cpu, false, o).unwrap_err().to_string();
    assert!(e.contains("pass one"), "{e}");
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_file(&file);
}

#[test]
fn bad_options_fail_before_training() {
    let file = std::env::temp_dir().join(format!("bastile-ft-file-{}", std::process::id()));
    std::fs::write(&file, b"").unwrap();
    let e = finetune(DeviceKind::Cpu, false, options(file.join("out"), 1)).unwrap_err();
    assert!(matches!(e, CliError::Io { .. }), "{e:?}");
    let mut o = options(temp_dir("bad"), 1);
    o.batch_size = 0;
    let e = finetune(DeviceKind::Cpu, false, o).unwrap_err().to_string();
    assert!(e.contains("--batch-size must be at least 1"), "{e}");
    let mut o = options(temp_dir("bad"), 1);
    o.model = "qwen3-0.6b".into();
    let e = finetune(DeviceKind::Cpu, false, o).unwrap_err().to_string();
    assert!(e.contains("pass --tokenizer"), "{e}");
    let mut o = options(temp_dir("bad"), 1);
    o.model = "no-such-model".into();
    let e = finetune(DeviceKind::Cpu, false, o).unwrap_err().to_string();
    assert!(e.contains("neither a model directory nor a preset"), "{e}");
    let mut o = options(temp_dir("bad"), 1);
    o.devices = 0;
    let e = finetune(DeviceKind::Cpu, false, o).unwrap_err().to_string();
    assert!(e.contains("--devices must be at least 1"), "{e}");
    let mut o = options(temp_dir("bad"), 1);
    o.devices = 2;
    let e = finetune(DeviceKind::Cpu, false, o).unwrap_err().to_string();
    assert!(
        e.contains("--devices 2 trains on several CUDA GPUs (--device cuda)"),
        "{e}"
    );
    let mut o = options(temp_dir("bad"), 1);
    o.checkpointing = Checkpointing::ALL;
    o.lora = Some(LoraConfig::new(4).with_dropout(0.1));
    let e = finetune(DeviceKind::Cpu, false, o).unwrap_err().to_string();
    assert!(
        e.contains("activation checkpointing (every layer) cannot be combined with LoRA dropout"),
        "{e}"
    );
    let mut o = options(temp_dir("bad"), 1);
    o.expert_routing = Some(ExpertRouting::Dense);
    let e = finetune(DeviceKind::Cpu, false, o).unwrap_err().to_string();
    assert!(e.contains("needs a mixture-of-experts model"), "{e}");
    let mut o = options(temp_dir("bad"), 1);
    o.router_aux_loss = Some(0.01);
    let e = finetune(DeviceKind::Cpu, false, o).unwrap_err().to_string();
    assert!(
        e.contains(
            "a router load-balancing loss (coefficient 0.01) needs a mixture-of-experts model"
        ),
        "{e}"
    );
    let mut o = options(temp_dir("bad"), 1);
    o.dtype = DTypeArg::Bf16;
    let e = finetune(DeviceKind::Cpu, false, o).unwrap_err().to_string();
    assert!(e.contains("needs --device cuda"), "{e}");
    let data = std::env::temp_dir().join(format!("bastile-ft-data-{}.jsonl", std::process::id()));
    std::fs::write(
        &data,
        "{\"instruction\": \"a\", \"output\": \"b\"}\nnot json\n",
    )
    .unwrap();
    let mut o = options(temp_dir("bad"), 1);
    o.data = Some(data.clone());
    let e = finetune(DeviceKind::Cpu, false, o).unwrap_err().to_string();
    assert!(
        e.contains(&format!("{}:2: invalid JSON", data.display())),
        "{e}"
    );
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&data);
}

#[test]
fn the_command_line_reports_errors_with_a_failing_status() {
    let bastile = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_bastile"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let stderr = bastile(&[
        "finetune", "--device", "cpu", "--model", "nowhere", "--steps", "1",
    ]);
    assert!(
        stderr.contains("error: `nowhere` is neither a model directory nor a preset"),
        "{stderr}"
    );
    let stderr = bastile(&[
        "finetune",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--checkpointing",
        "0",
    ]);
    assert!(
        stderr.contains(
            "error: --checkpointing 0: checkpoint every N-th layer needs N of at least 1"
        ),
        "{stderr}"
    );
}

/// Activation checkpointing recomputes what the plain run keeps: the
/// same losses (f32, within 1e-6), every layer or every other.
#[test]
fn checkpointed_runs_repeat_the_plain_losses() {
    let run = |checkpointing| {
        let mut o = options(temp_dir("ckpt"), 4);
        o.checkpointing = checkpointing;
        finetune(DeviceKind::Cpu, true, o).unwrap().losses
    };
    let plain = run(Checkpointing::Off);
    for checkpointing in [
        Checkpointing::ALL,
        Checkpointing::Every(std::num::NonZeroUsize::new(2).unwrap()),
    ] {
        let losses = run(checkpointing);
        assert_eq!(losses.len(), plain.len());
        for (step, (a, b)) in losses.iter().zip(&plain).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "{checkpointing}, step {}: {a} vs {b}",
                step + 1
            );
        }
    }
}

/// With fused kernels on a GPU runtime, the tiny model's losses follow
/// the baseline's (f32).
#[test]
fn fused_kernels_follow_the_baseline_on_vulkan() {
    if !runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        return;
    }
    let run = |bastile| {
        finetune(DeviceKind::Vulkan, bastile, options(temp_dir("vk"), 6))
            .unwrap()
            .losses
    };
    let (base, fused) = (run(false), run(true));
    for (i, (a, b)) in base.iter().zip(&fused).enumerate() {
        assert!((a - b).abs() <= 1e-4 * a.abs(), "step {i}: {a} vs {b}");
    }
    assert!(fused[5] < fused[0], "{fused:?}");
}

fn warmup_options(lengths: Vec<usize>) -> WarmupOptions {
    WarmupOptions {
        model: "bastile-tiny".into(),
        lengths,
        batch_size: 2,
        packing: true,
        dtype: DTypeArg::Auto,
        optimizer: OptimizerKind::Fused,
        master_weights: false,
        loss_weight_grad_sum: WeightGradSum::default(),
        tune: false,
        seed: 7,
        progress: false,
    }
}

#[test]
fn warmup_runs_one_step_per_length_packed_or_padded() {
    let _alone = alone();
    for packing in [true, false] {
        let o = WarmupOptions {
            packing,
            ..warmup_options(vec![16, 48])
        };
        let report = warmup::run(DeviceKind::Cpu, true, o).unwrap();
        let lengths: Vec<usize> = report.steps.iter().map(|&(len, _)| len).collect();
        assert_eq!(lengths, [16, 48], "packing {packing}");
        assert!(report.steps.iter().all(|&(_, s)| s > 0.0), "{report:?}");
    }
}

#[test]
fn warmup_refuses_what_it_cannot_run() {
    // Every refusal comes before the generator is seeded: no turn to wait.
    let cases: [(Vec<usize>, usize, &str); 4] = [
        (vec![], 2, "--seq"),
        (vec![16, 0], 2, "--seq"),
        (vec![16], 0, "--batch-size"),
        (vec![1 << 24], 2, "longer than the model's context"),
    ];
    for (lengths, batch_size, expected) in cases {
        let o = WarmupOptions {
            batch_size,
            ..warmup_options(lengths.clone())
        };
        let e = warmup::run(DeviceKind::Cpu, true, o).unwrap_err();
        assert!(
            matches!(e, CliError::Usage(_)) && e.to_string().contains(expected),
            "{lengths:?}, batch {batch_size}: {e}"
        );
    }
    let o = WarmupOptions {
        model: "no-such-model".into(),
        ..warmup_options(vec![16])
    };
    let e = warmup::run(DeviceKind::Cpu, true, o).unwrap_err();
    assert!(
        e.to_string()
            .contains("neither a model directory nor a preset"),
        "{e}"
    );
}
