//! `--replot`: one report from results files written earlier (this
//! program's JSON, the Python scripts' JSON or JSON lines), printed as
//! Markdown and written with its charts to `--out`: runs measured in
//! separate processes or on another machine end up in one table and one
//! chart.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::Args;
use crate::report::Report;

pub fn run(args: &Args) -> Result<(), String> {
    let mut report = Report::new("", "", false, f64::NAN);
    for path in &args.replot {
        merge_file(&mut report, path)?;
    }
    println!("{}", report.markdown());
    if let Some(out) = &args.out {
        for file in report.write(out)? {
            eprintln!("written: {}", file.display());
        }
    }
    Ok(())
}

fn merge_file(report: &mut Report, path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let at = |e: String| format!("{}: {e}", path.display());
    match serde_json::from_str::<Value>(&text) {
        Ok(value) => merge_value(report, value).map_err(at),
        // JSON lines: one row a line.
        Err(_) => {
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let value = serde_json::from_str::<Value>(line)
                    .map_err(|e| at(format!("line {}: {e}", i + 1)))?;
                merge_value(report, value).map_err(|e| at(format!("line {}: {e}", i + 1)))?;
            }
            Ok(())
        }
    }
}

/// A whole report (or a script's `{"attention": [...]}`), or one row, told
/// apart by its fields.
pub fn merge_value(report: &mut Report, value: Value) -> Result<(), String> {
    let Value::Object(map) = value else {
        return Err("expected a JSON object".into());
    };
    let text = |k: &str| map.get(k).and_then(Value::as_str).map(str::to_owned);
    if report.device.is_empty()
        && let Some(device) = text("device")
    {
        report.device = device;
    }
    if let Some(runtime) = text("runtime") {
        report.runtime = runtime;
        report.tiny |= map.get("tiny").and_then(Value::as_bool).unwrap_or(false);
        if let Some(copy) = map.get("copy_gb_per_s").and_then(Value::as_f64) {
            report.copy_gb_per_s = copy;
        }
    }
    // A report holds its tables as lists; a training row's `attention`
    // names the attention that ran.
    let tables = [
        "rows",
        "train",
        "attention",
        "matmul",
        "moe",
        "flce",
        "notes",
    ];
    if tables
        .iter()
        .any(|k| map.get(*k).is_some_and(Value::is_array))
    {
        let list = |k: &str| match map.get(k) {
            Some(Value::Array(items)) => items.clone(),
            _ => Vec::new(),
        };
        report.rows.extend(rows(list("rows"))?);
        report.train.extend(rows(list("train"))?);
        report.attention.extend(rows(list("attention"))?);
        report.matmul.extend(rows(list("matmul"))?);
        report.moe.extend(rows(list("moe"))?);
        report.flce.extend(rows(list("flce"))?);
        report.notes.extend(rows::<String>(list("notes"))?);
        return Ok(());
    }
    let one = Value::Object(map.clone());
    let has = |k: &str| map.contains_key(k);
    if has("note") {
        report.notes.extend(text("note"));
    } else if has("tokens_per_s") {
        report.train.extend(rows(vec![one])?);
    } else if has("fwd_ms") {
        report.attention.extend(rows(vec![one])?);
    } else if has("inputs_mib") {
        report.flce.extend(rows(vec![one])?);
    } else if has("layer_ms") {
        report.moe.extend(rows(vec![one])?);
    } else if has("tflops") {
        report.matmul.extend(rows(vec![one])?);
    } else {
        return Err(format!(
            "not a result row: {}",
            map.keys().cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(())
}

fn rows<T: DeserializeOwned>(items: Vec<Value>) -> Result<Vec<T>, String> {
    items
        .into_iter()
        .map(|v| serde_json::from_value(v).map_err(|e| e.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_and_script_rows_merge_into_one_report() {
        let mut report = Report::new("", "", false, f64::NAN);
        let ours = serde_json::json!({
            "runtime": "cuda", "device": "H100", "tiny": false, "copy_gb_per_s": null,
            "train": [{"model": "m", "batch": 1, "seq": 2048, "dtype": "bf16",
                       "implementation": "bastile", "ms_per_step": 100.0,
                       "tokens_per_s": 20480.0, "peak_mib": 900.0, "error": null}]
        });
        merge_value(&mut report, ours).unwrap();
        let torch = serde_json::json!({"model": "m", "batch": 1, "seq": 2048, "dtype": "bf16",
            "implementation": "HF + Liger-Kernel", "ms_per_step": null, "tokens_per_s": null,
            "peak_mib": null, "error": "out of memory", "device": "other"});
        merge_value(&mut report, torch).unwrap();
        let peft = serde_json::json!({"model": "m", "batch": 1, "seq": 2048, "dtype": "bf16",
            "implementation": "HF transformers + PEFT, LoRA r16", "attention": "sdpa",
            "ms_per_step": 150.0, "tokens_per_s": 13653.3, "peak_mib": 800.0, "error": null});
        merge_value(&mut report, peft).unwrap();
        let sdpa = serde_json::json!({"attention": [{"shape": "s", "seq": 8, "dtype": "bf16",
            "implementation": "torch sdpa", "fwd_ms": 1.0, "fwd_tflops": 2.0,
            "fwd_bwd_ms": 3.0, "fwd_bwd_tflops": 4.0, "peak_mib": 5.0}]});
        merge_value(&mut report, sdpa).unwrap();
        let moe = serde_json::json!({"moe": [{"shape": "s", "dtype": "bf16",
            "routing": "routed", "layer_ms": 12.0, "useful_tflops": 400.0, "capacity": 1152,
            "mean_group": 1024.0, "grouped_products_ms": 8.0}]});
        merge_value(&mut report, moe).unwrap();
        assert_eq!(report.moe[0].over_products(), Some(1.5));
        assert!(
            report
                .markdown()
                .contains("| 12.000 | 400.0 | 8.000 | 1.50× | 1152 (1024) |"),
            "{}",
            report.markdown()
        );
        assert_eq!(
            (report.runtime.as_str(), report.device.as_str()),
            ("cuda", "H100")
        );
        assert!(report.copy_gb_per_s.is_nan());
        assert_eq!(report.train.len(), 3);
        assert_eq!(report.train[1].error.as_deref(), Some("out of memory"));
        assert_eq!(report.train[2].ms_per_step, Some(150.0));
        assert_eq!(report.attention[0].fwd_bwd_ms, 3.0);
        let err = merge_value(&mut report, serde_json::json!({"x": 1})).unwrap_err();
        assert!(err.contains("not a result row: x"), "{err}");
    }
}
