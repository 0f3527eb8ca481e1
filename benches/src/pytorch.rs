//! `--compare-pytorch`: the scripts of `benches/python` measure, on the same
//! GPU, what this process measured (the same model configurations and
//! lengths, the same attention, matmul and loss shapes) through PyTorch,
//! and their rows join the report, so they land in the same table and
//! charts. A script that cannot run (no Python, no torch, no GPU, a model
//! it does not know) leaves a note saying why instead of rows.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde::de::DeserializeOwned;

use crate::report::Report;
use crate::{Args, progress};

/// The implementations `train_torch.py` reports, as its rows name them.
pub const HF: &str = "HF transformers";
pub const LIGER: &str = "HF + Liger-Kernel";
pub const COMPILE: &str = "HF + torch.compile";

/// Where the scripts are: `BASTILE_PYTHON_SCRIPTS`, else this crate's
/// `python/` folder.
fn scripts_dir() -> PathBuf {
    std::env::var_os("BASTILE_PYTHON_SCRIPTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/python")))
}

pub fn compare(args: &Args, report: &mut Report) {
    // (model, batch) → the lengths this process ran, in order.
    let mut trained: Vec<(String, usize, Vec<usize>)> = Vec::new();
    for r in report.train.iter().filter(|r| r.dtype == "bf16") {
        match trained
            .iter_mut()
            .find(|(m, b, _)| *m == r.model && *b == r.batch)
        {
            Some((_, _, seqs)) if !seqs.contains(&r.seq) => seqs.push(r.seq),
            Some(_) => {}
            None => trained.push((r.model.clone(), r.batch, vec![r.seq])),
        }
    }
    if !report.train.is_empty() && trained.is_empty() {
        report
            .notes
            .push("PyTorch comparison: only bf16 training runs are compared".into());
    }
    // HF checkpoints every layer or none.
    let checkpointing = args.checkpointing.is_some();
    if args.checkpointing.is_some_and(|n| n.get() > 1) && !trained.is_empty() {
        report.notes.push(
            "PyTorch comparison: HF checkpoints every layer or none, not one layer in N".into(),
        );
        trained.clear();
    }
    for (model, batch, seqs) in trained {
        let mut script_args = vec!["--model".into(), model.clone(), "--batch".into()];
        script_args.push(batch.to_string());
        script_args.push("--seq".into());
        script_args.extend(seqs.iter().map(|s| s.to_string()));
        script_args.extend(["--steps".into(), args.steps.to_string()]);
        if let Some(rank) = args.lora {
            script_args.extend(["--lora".into(), rank.to_string()]);
        }
        if checkpointing {
            script_args.push("--checkpointing".into());
        }
        let task = format!("PyTorch: train {model} batch {batch}");
        run_into(
            args,
            "train_torch.py",
            &script_args,
            &task,
            report,
            |r, row| r.train.push(row),
        );
    }
    if report.tiny {
        if !report.attention.is_empty() || !report.matmul.is_empty() || !report.flce.is_empty() {
            report
                .notes
                .push("PyTorch comparison: kernel shapes are compared on CUDA only".into());
        }
        return;
    }
    let mut seqs: Vec<String> = Vec::new();
    let mut attention_shapes: Vec<String> = Vec::new();
    for r in &report.attention {
        if !seqs.contains(&r.seq.to_string()) {
            seqs.push(r.seq.to_string());
        }
        if let Some(s) = crate::attention::torch_shape(&r.shape)
            && !attention_shapes.contains(&s)
        {
            attention_shapes.push(s);
        }
    }
    if !seqs.is_empty() && !attention_shapes.is_empty() {
        let script_args = vec![
            "--seq".into(),
            seqs.join(","),
            "--shapes".into(),
            attention_shapes.join(","),
        ];
        run_into(
            args,
            "attention_torch.py",
            &script_args,
            "PyTorch: attention",
            report,
            |r, row| r.attention.push(row),
        );
    }
    if !report.matmul.is_empty() {
        run_into(
            args,
            "matmul_torch.py",
            &[],
            "PyTorch: matmul",
            report,
            |r, row| r.matmul.push(row),
        );
    }
    let mut shapes: Vec<String> = Vec::new();
    for r in &report.flce {
        if let Some(s) = flce_shape(&r.shape).filter(|s| !shapes.contains(s)) {
            shapes.push(s);
        }
    }
    if !shapes.is_empty() {
        let script_args = vec!["--shapes".into(), shapes.join(",")];
        run_into(
            args,
            "flce_torch.py",
            &script_args,
            "PyTorch: loss",
            report,
            |r, row| r.flce.push(row),
        );
    }
}

/// `N=8192 H=4096 V=151936` as the loss script takes it: `8192x4096x151936`.
fn flce_shape(shape: &str) -> Option<String> {
    let dims: Vec<&str> = shape
        .split(' ')
        .map(|f| f.split_once('=').map(|(_, v)| v))
        .collect::<Option<_>>()?;
    (dims.len() == 3 && dims.iter().all(|d| d.parse::<usize>().is_ok())).then(|| dims.join("x"))
}

/// Runs one script and adds its rows (JSON objects, one a line on stdout)
/// with `push`; `{"note": ...}` lines and failures become notes.
fn run_into<T: DeserializeOwned>(
    args: &Args,
    script: &str,
    script_args: &[String],
    task: &str,
    report: &mut Report,
    push: impl Fn(&mut Report, T),
) {
    progress::task(task);
    match run_script(args, script, script_args, task) {
        Ok(lines) => {
            for line in lines {
                let value: serde_json::Value = match serde_json::from_str(&line) {
                    Ok(v) => v,
                    Err(e) => {
                        report
                            .notes
                            .push(format!("{script}: unreadable line ({e}): {line}"));
                        continue;
                    }
                };
                if let Some(note) = value.get("note").and_then(|n| n.as_str()) {
                    report.notes.push(format!("{script}: {note}"));
                    continue;
                }
                match serde_json::from_value::<T>(value) {
                    Ok(row) => push(report, row),
                    Err(e) => report
                        .notes
                        .push(format!("{script}: unexpected row ({e}): {line}")),
                }
            }
        }
        Err(e) => report.notes.push(format!("{script} did not run: {e}")),
    }
    progress::done();
}

/// The JSON lines a script prints on stdout; its stderr is logged.
fn run_script(
    args: &Args,
    script: &str,
    script_args: &[String],
    task: &str,
) -> Result<Vec<String>, String> {
    let path = scripts_dir().join(script);
    if !path.is_file() {
        return Err(format!(
            "{} not found (set BASTILE_PYTHON_SCRIPTS to the folder of the scripts)",
            path.display()
        ));
    }
    let mut proc = Command::new(&args.python)
        .arg(&path)
        .args(script_args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start `{}`: {e}", args.python))?;
    let stderr = proc.stderr.take().expect("piped");
    let task = task.to_string();
    let echo = std::thread::spawn(move || {
        let mut last = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            progress::child_line(&task, &line);
            if !line.trim().is_empty() {
                last = line;
            }
        }
        last
    });
    let stdout = proc.stdout.take().expect("piped");
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        if line.starts_with('{') {
            progress::log(format!("   {line}"));
            lines.push(line);
        }
    }
    let status = proc.wait().map_err(|e| e.to_string())?;
    let last = echo.join().unwrap_or_default();
    if !status.success() && lines.is_empty() {
        return Err(format!("exited with {status}: {last}"));
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_shapes_are_written_as_the_script_reads_them() {
        assert_eq!(
            flce_shape("N=8192 H=4096 V=151936").as_deref(),
            Some("8192x4096x151936")
        );
        assert_eq!(flce_shape("N=8192 H=x V=1"), None);
        assert_eq!(flce_shape("N=1 H=2"), None);
    }

    #[test]
    fn attention_shapes_are_written_as_the_script_reads_them() {
        use crate::attention::torch_shape;
        assert_eq!(
            torch_shape("b1 hq32 hkv8 d64 causal").as_deref(),
            Some("32x8x64")
        );
        assert_eq!(torch_shape("b1 hq16 hkv8 dx causal"), None);
        assert_eq!(torch_shape("hq16 hkv8 d128"), None);
    }
}
