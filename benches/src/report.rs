//! Benchmark results: a Markdown table for people, JSON for tools.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    pub op: String,
    pub shape: String,
    pub dtype: String,
    pub pass: String,
    pub implementation: String,
    pub ms: f64,
    /// Minimal bytes: each input read once, each output written once.
    pub bytes: u64,
    pub gb_per_s: f64,
    /// Not a number (written as `null`) when the copy bandwidth was not
    /// measured.
    #[serde(deserialize_with = "nan_if_null")]
    pub pct_of_copy: f64,
}

/// JSON has no NaN: serde_json writes it as `null`, read back here.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl Row {
    /// The row's values as printed, in table column order.
    fn cells(&self) -> [String; 8] {
        [
            self.op.clone(),
            self.shape.clone(),
            self.dtype.clone(),
            self.pass.clone(),
            self.implementation.clone(),
            format!("{:.4}", self.ms),
            format!("{:.1}", self.gb_per_s),
            format!("{:.1}%", self.pct_of_copy),
        ]
    }
}

/// One fused linear cross-entropy measurement (forward + backward).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FlceRow {
    pub shape: String,
    pub dtype: String,
    pub implementation: String,
    /// Tokens per chunk (`None`: chosen automatically).
    pub chunk: Option<usize>,
    pub ms: f64,
    /// The three matmuls' flops over the time.
    pub tflops: f64,
    /// Reserved device memory after one call from a clean pool.
    pub peak_mib: f64,
    /// Reserved device memory holding the inputs, before the call.
    pub inputs_mib: f64,
}

/// One matmul measurement.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MatmulRow {
    pub shape: String,
    pub dtype: String,
    pub implementation: String,
    pub ms: f64,
    pub tflops: f64,
}

/// One mixture-of-experts layer measurement (forward + backward).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MoeRow {
    pub shape: String,
    pub dtype: String,
    /// `routed` or `dense`.
    pub routing: String,
    pub layer_ms: f64,
    /// The flops of each token's chosen experts alone (forward and both
    /// gradients of `gate_up` and `down`) per second of the layer.
    pub useful_tflops: f64,
    /// Rows every expert's group is padded to (routed only).
    pub capacity: Option<usize>,
    /// Token-expert assignments per expert.
    pub mean_group: f64,
    /// The routed layer's six grouped products alone, same groups.
    pub grouped_products_ms: Option<f64>,
}

impl MoeRow {
    /// The layer's time over its grouped products' time.
    pub fn over_products(&self) -> Option<f64> {
        self.grouped_products_ms.map(|g| self.layer_ms / g)
    }

    /// The progress line.
    pub fn line(&self) -> String {
        let products = match (self.grouped_products_ms, self.over_products()) {
            (Some(g), Some(r)) => format!(
                ", grouped products {g:.3} ms ({r:.2}×), capacity {} for {:.0} a group",
                self.capacity.unwrap_or(0),
                self.mean_group
            ),
            _ => String::new(),
        };
        format!(
            "moe {} {} {}: layer {:.3} ms ({:.1} useful TFLOP/s){products}",
            self.shape, self.dtype, self.routing, self.layer_ms, self.useful_tflops
        )
    }
}

/// One attention measurement; a failed one (Burn out of memory at long
/// sequences) has `error` set and not-a-number values.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AttentionRow {
    pub shape: String,
    pub seq: usize,
    pub dtype: String,
    pub implementation: String,
    #[serde(deserialize_with = "nan_if_null")]
    pub fwd_ms: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub fwd_tflops: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub fwd_bwd_ms: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub fwd_bwd_tflops: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub peak_mib: f64,
    #[serde(default)]
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub runtime: String,
    pub device: String,
    /// Small shapes for the software Vulkan driver: not performance numbers.
    pub tiny: bool,
    pub copy_gb_per_s: f64,
    pub rows: Vec<Row>,
    pub flce: Vec<FlceRow>,
    pub matmul: Vec<MatmulRow>,
    pub moe: Vec<MoeRow>,
    pub attention: Vec<AttentionRow>,
    pub train: Vec<crate::train::TrainRow>,
    /// What did not run, or ran only in part, and why.
    pub notes: Vec<String>,
}

impl Report {
    pub fn new(runtime: &str, device: &str, tiny: bool, copy_gb_per_s: f64) -> Self {
        Self {
            runtime: runtime.into(),
            device: device.into(),
            tiny,
            copy_gb_per_s,
            rows: Vec::new(),
            flce: Vec::new(),
            matmul: Vec::new(),
            moe: Vec::new(),
            attention: Vec::new(),
            train: Vec::new(),
            notes: Vec::new(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        op: &str,
        shape: &str,
        dtype: &str,
        pass: &str,
        implementation: &str,
        seconds: f64,
        bytes: u64,
    ) {
        let gb_per_s = bytes as f64 / seconds / 1e9;
        let row = Row {
            op: op.into(),
            shape: shape.into(),
            dtype: dtype.into(),
            pass: pass.into(),
            implementation: implementation.into(),
            ms: seconds * 1e3,
            bytes,
            gb_per_s,
            pct_of_copy: 100.0 * gb_per_s / self.copy_gb_per_s,
        };
        let [op, shape, dtype, pass, implementation, ms, gbs, pct] = row.cells();
        crate::progress::log(format!(
            "{op:<9} {shape:<12} {dtype:<5} {pass:<22} {implementation:<10} {ms:>9} ms {gbs:>8} GB/s {pct:>6}"
        ));
        self.rows.push(row);
    }

    pub fn markdown(&self) -> String {
        let mut s = format!(
            "Device: {} ({}){}",
            self.device,
            self.runtime,
            if self.tiny {
                ", tiny shapes: functional run, not performance numbers"
            } else {
                ""
            },
        );
        if self.rows.is_empty() {
            s += ".\n";
        } else {
            s += &self.kernel_markdown();
        }
        if !self.flce.is_empty() {
            s += &self.flce_markdown();
        }
        if !self.matmul.is_empty() {
            s += &self.matmul_markdown();
        }
        if !self.moe.is_empty() {
            s += &self.moe_markdown();
        }
        if !self.attention.is_empty() {
            s += &self.attention_markdown();
        }
        if !self.train.is_empty() {
            s += &self.train_markdown();
        }
        if !self.notes.is_empty() {
            s += "\nNotes:\n\n";
            for note in &self.notes {
                s += &format!("* {note}\n");
            }
        }
        s
    }

    /// Attention forward and forward+backward per sequence length.
    fn attention_markdown(&self) -> String {
        let mut s = String::from(
            "\nAttention (causal TFLOP/s; backward counted as 2.5 forwards; peak: reserved after one forward+backward):\n\n",
        );
        s += "| shape | seq | dtype | implementation | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | peak MiB |\n";
        s += "|---|---:|---|---|---:|---:|---:|---:|---:|\n";
        for r in &self.attention {
            if let Some(e) = &r.error {
                s += &format!(
                    "| {} | {} | {} | {} | {e} | | | | |\n",
                    r.shape, r.seq, r.dtype, r.implementation
                );
                continue;
            }
            s += &format!(
                "| {} | {} | {} | {} | {:.3} | {:.1} | {:.3} | {:.1} | {:.0} |\n",
                r.shape,
                r.seq,
                r.dtype,
                r.implementation,
                r.fwd_ms,
                r.fwd_tflops,
                r.fwd_bwd_ms,
                r.fwd_bwd_tflops,
                r.peak_mib
            );
        }
        s
    }

    /// The row of `implementation` measured at `r`'s model, batch, length
    /// and dtype.
    fn row_at(
        &self,
        r: &crate::train::TrainRow,
        implementation: &str,
    ) -> Option<&crate::train::TrainRow> {
        self.train
            .iter()
            .find(|o| same_config(o, r) && o.implementation == implementation)
    }

    /// The training table: per row the step time, tokens/s against the
    /// other implementations at the same shape, the first step's time,
    /// memory in use and reserved, and the host's share of a step.
    fn train_markdown(&self) -> String {
        let mut s = String::from(
            "\nTraining step (random weights, AdamW, one micro-batch; ms/step: median of the timed steps, the fastest and the slowest in brackets; × HF, × Liger, × compile, × burn: tokens/s against HF transformers (its default attention), HF + Liger-Kernel, HF under torch.compile and Burn at the same shape; in use: peak bytes in use during a step (PyTorch's max_memory_allocated; CubeCL's bytes in use, sampled); reserved: the allocator's pool; first step: wall time of step 0, compilation and tuning included; start: from the process's start to the end of step 0, cold with empty caches (compiled kernels, the driver's, autotune results), warm with the caches a cold run left; host: time to queue a step):\n\n",
        );
        s += "| model | batch | seq | dtype | implementation | ms/step | tokens/s | × HF | × Liger | × compile | × burn | in use MiB | reserved MiB | first step s | start s, cold / warm | host ms |\n";
        s += "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
        let mut rows: Vec<&crate::train::TrainRow> = self.train.iter().collect();
        rows.sort_by(|a, b| (&a.model, a.batch, a.seq).cmp(&(&b.model, b.batch, b.seq)));
        for r in rows {
            let vs = |peer: &str| {
                let name = peer_name(&r.implementation, peer);
                let other = self.row_at(r, &name);
                match (r.ms_per_step, other.and_then(|o| o.ms_per_step)) {
                    (Some(a), Some(b)) if r.implementation != name => format!("{:.2}×", b / a),
                    _ => String::new(),
                }
            };
            let ms = step_ms(r);
            s += &format!(
                "| {} | {} | {} | {} | {} | {ms} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                r.model,
                r.batch,
                r.seq,
                r.dtype,
                r.implementation,
                fixed(r.tokens_per_s, 0),
                vs(crate::pytorch::HF),
                vs(crate::pytorch::LIGER),
                vs(crate::pytorch::COMPILE),
                vs("burn"),
                fixed(r.in_use_mib, 0),
                fixed(r.peak_mib, 0),
                fixed(r.first_step_s, 1),
                starts(r),
                fixed(r.host_ms, 1),
            );
        }
        s += &self.longest_markdown();
        s += &self.memory_markdown();
        s += &self.scaling_markdown();
        s
    }

    /// Where the memory of each row with a breakdown goes.
    fn memory_markdown(&self) -> String {
        let mut rows: Vec<_> = self
            .train
            .iter()
            .filter_map(|r| r.memory.map(|m| (r, m)))
            .collect();
        if rows.is_empty() {
            return String::new();
        }
        rows.sort_by(|(a, _), (b, _)| (&a.model, a.batch, a.seq).cmp(&(&b.model, b.batch, b.seq)));
        let mut s = String::from(
            "
Memory breakdown (MiB of CubeCL's bytes in use, one forward and backward pass after the timed steps, each phase read after a device sync; kept by the forward pass: the activations the graph saves, and the fused loss's gradients; pass peak: the most in use during the pass beyond what is in use between steps, sampled; pool beyond use: reserved − the step's peak in use):

| model | batch | seq | implementation | parameters | optimizer state | kept by the forward pass | gradients | pass peak | step peak in use | pool beyond use |
|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|
",
        );
        for (r, m) in rows {
            let pool = r.peak_mib.zip(r.in_use_mib).map(|(p, u)| p - u);
            s += &format!(
                "| {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} |\n",
                r.model,
                r.batch,
                r.seq,
                r.implementation,
                m.parameters_mib,
                m.optimizer_state_mib,
                m.forward_kept_mib,
                m.gradients_mib,
                m.pass_peak_mib,
                fixed(r.in_use_mib, 0),
                fixed(pool, 0),
            );
        }
        s
    }

    /// The longest sequence each implementation trained at (per model,
    /// batch and dtype), and the length where it failed, when the rows
    /// cover more than one length.
    fn longest_markdown(&self) -> String {
        let mut groups: Vec<&crate::train::TrainRow> = Vec::new();
        for r in &self.train {
            if !groups.iter().any(|g| same_run(g, r)) {
                groups.push(r);
            }
        }
        let lengths = |g: &crate::train::TrainRow| {
            let mut seqs: Vec<_> = self.train.iter().filter(|r| same_run(r, g)).collect();
            seqs.sort_by_key(|r| r.seq);
            seqs
        };
        if groups.iter().all(|g| lengths(g).len() < 2) {
            return String::new();
        }
        let mut s = String::from(
            "
Longest sequence trained (per implementation; the first length that failed, and why):

| model | batch | dtype | implementation | longest seq | failed at |
|---|---:|---|---|---:|---|
",
        );
        groups.sort_by(|a, b| {
            (&a.model, a.batch, &a.implementation).cmp(&(&b.model, b.batch, &b.implementation))
        });
        for g in groups {
            let rows = lengths(g);
            let longest = rows.iter().rev().find(|r| r.ms_per_step.is_some());
            let failed = rows.iter().find_map(|r| {
                r.error
                    .as_deref()
                    .map(|e| format!("{} ({})", r.seq, crate::train::failure_label(e)))
            });
            s += &format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                g.model,
                g.batch,
                g.dtype,
                g.implementation,
                longest.map_or("none".into(), |r| r.seq.to_string()),
                failed.unwrap_or_default(),
            );
        }
        s
    }

    /// Data-parallel rows against the one-GPU row of the same
    /// configuration: tokens/s and scaling efficiency (tokens/s over
    /// GPUs × the one-GPU tokens/s).
    fn scaling_markdown(&self) -> String {
        let mut rows: Vec<&crate::train::TrainRow> =
            self.train.iter().filter(|r| r.devices > 1).collect();
        if rows.is_empty() {
            return String::new();
        }
        rows.sort_by(|a, b| {
            (&a.model, a.batch, a.seq, a.devices).cmp(&(&b.model, b.batch, b.seq, b.devices))
        });
        let mut s = String::from(
            "\nData-parallel scaling (one worker per GPU, each with its own micro-batch of batch × seq tokens; gradients summed through NCCL; efficiency: tokens/s ÷ (GPUs × the one-GPU tokens/s of the same run)):\n\n| model | batch | seq per GPU | dtype | implementation | GPUs | ms/step | tokens/s | one GPU tokens/s | efficiency |\n|---|---:|---:|---|---|---:|---:|---:|---:|---:|\n",
        );
        for r in rows {
            let suffix = format!(", {} GPUs", r.devices);
            let single_name = r.implementation.strip_suffix(&suffix).unwrap_or_default();
            let single = self.row_at(r, single_name).filter(|o| o.devices == 1);
            let one = single.and_then(|o| o.tokens_per_s);
            let efficiency = match (r.tokens_per_s, one) {
                (Some(n), Some(one)) => format!("{:.1}%", 100.0 * n / (r.devices as f64 * one)),
                _ => String::new(),
            };
            let ms = step_ms(r);
            s += &format!(
                "| {} | {} | {} | {} | {} | {} | {ms} | {} | {} | {efficiency} |\n",
                r.model,
                r.batch,
                r.seq,
                r.dtype,
                single_name,
                r.devices,
                fixed(r.tokens_per_s, 0),
                fixed(one, 0),
            );
        }
        s
    }

    /// The per-op bandwidth table.
    fn kernel_markdown(&self) -> String {
        let mut s = format!(
            "; measured copy bandwidth {:.1} GB/s (read + write).\n\n",
            self.copy_gb_per_s
        );
        s += "| op | shape | dtype | pass | implementation | ms | GB/s | % of copy | speedup |\n";
        s += "|---|---|---|---|---|---:|---:|---:|---:|\n";
        for row in &self.rows {
            let baseline = self.rows.iter().find(|r| {
                r.op == row.op
                    && r.shape == row.shape
                    && r.dtype == row.dtype
                    && r.pass == row.pass
                    && r.implementation == "burn"
            });
            let speedup = baseline
                .map(|b| format!("{:.2}×", b.ms / row.ms))
                .unwrap_or_default();
            s += &format!("| {} | {speedup} |\n", row.cells().join(" | "));
        }
        s
    }

    /// The matmul table, each row against Burn's own matmul.
    fn matmul_markdown(&self) -> String {
        let mut s = String::from(
            "\nMatmul:\n\n| shape (batch×M×K×N) | dtype | implementation | ms | TFLOP/s | speedup |\n|---|---|---|---:|---:|---:|\n",
        );
        for r in &self.matmul {
            let speedup = self
                .matmul
                .iter()
                .find(|o| o.shape == r.shape && o.dtype == r.dtype && o.implementation == "burn")
                .map(|b| format!("{:.2}×", b.ms / r.ms))
                .unwrap_or_default();
            s += &format!(
                "| {} | {} | {} | {:.3} | {:.1} | {speedup} |\n",
                r.shape, r.dtype, r.implementation, r.ms, r.tflops
            );
        }
        s
    }

    /// The mixture-of-experts layer table: the routed layer against its
    /// grouped products, and the dense path.
    fn moe_markdown(&self) -> String {
        let mut s = String::from(
            "\nMixture-of-experts layer, forward + backward (useful: the chosen experts' flops):\n\n\
             | shape | dtype | experts | layer ms | useful TFLOP/s | grouped products ms | layer / products | capacity (mean group) |\n\
             |---|---|---|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.moe {
            s += &format!(
                "| {} | {} | {} | {:.3} | {:.1} | {} | {} | {} |\n",
                r.shape,
                r.dtype,
                r.routing,
                r.layer_ms,
                r.useful_tflops,
                fixed(r.grouped_products_ms, 3),
                r.over_products()
                    .map_or(String::new(), |x| format!("{x:.2}×")),
                r.capacity
                    .map_or(String::new(), |c| format!("{c} ({:.0})", r.mean_group)),
            );
        }
        s
    }

    /// The fused linear cross-entropy table: time against the bare
    /// matmuls of the same engine, memory against Burn's composite.
    fn flce_markdown(&self) -> String {
        let mut s = String::from(
            "\nFused linear cross-entropy, forward + backward (peak: reserved device memory, inputs included):\n\n",
        );
        s += "| shape | dtype | implementation | chunk | ms | TFLOP/s | × bare matmuls | peak MiB | peak − inputs MiB | composite ÷ this (extra memory) |\n";
        s += "|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
        for r in &self.flce {
            let same = |name: &str| {
                self.flce
                    .iter()
                    .find(|o| o.shape == r.shape && o.dtype == r.dtype && o.implementation == name)
            };
            // Against the bare matmuls of the same matmul engine: Bastile's
            // rows against `Bastile<B>`'s (cuBLASLt on CUDA), Burn's against
            // Burn's own.
            let floor = if r.implementation.starts_with("bastile") {
                same("bare matmuls (bastile)").or_else(|| same("bare matmuls"))
            } else {
                same("bare matmuls")
            };
            let vs_bare = floor
                .map(|b| format!("{:.3}", r.ms / b.ms))
                .unwrap_or_default();
            let extra = r.peak_mib - r.inputs_mib;
            let vs_burn = same("burn")
                .map(|b| format!("{:.1}×", (b.peak_mib - b.inputs_mib) / extra.max(1.0)))
                .unwrap_or_default();
            s += &format!(
                "| {} | {} | {} | {} | {:.2} | {:.1} | {vs_bare} | {:.0} | {:.0} | {vs_burn} |\n",
                r.shape,
                r.dtype,
                r.implementation,
                r.chunk.map_or("auto".into(), |c| c.to_string()),
                r.ms,
                r.tflops,
                r.peak_mib,
                extra,
            );
        }
        s
    }

    /// Writes the JSON at `path`, the Markdown beside it and the charts
    /// (see [`crate::chart`]); returns the files written. Charts that
    /// cannot be drawn (no font on the machine) are skipped with a warning:
    /// the numbers are in the other two files.
    pub fn write(&self, path: &Path) -> Result<Vec<PathBuf>, String> {
        let io = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        }
        let json = serde_json::to_string_pretty(self).expect("serializable report");
        std::fs::write(path, json).map_err(|e| io(path, e))?;
        let md = path.with_extension("md");
        std::fs::write(&md, self.markdown()).map_err(|e| io(&md, e))?;
        let mut written = vec![path.to_path_buf(), md];
        match crate::chart::draw_all(self, path) {
            Ok(charts) => written.extend(charts),
            Err(e) => eprintln!("charts not drawn: {e}"),
        }
        Ok(written)
    }
}

/// `v` with `digits` decimals, or an empty cell.
fn fixed(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(String::new, |v| format!("{v:.digits$}"))
}

/// A training row's starts: `cold / warm`, or the one it measured.
fn starts(r: &crate::train::TrainRow) -> String {
    match (r.cold_start_s, r.start_s) {
        (Some(cold), Some(warm)) => format!("{cold:.1} / {warm:.1}"),
        (Some(cold), None) => format!("{cold:.1} / –"),
        (None, warm) => fixed(warm, 1),
    }
}

/// A training row's step time, or for a failed run why it failed.
fn step_ms(r: &crate::train::TrainRow) -> String {
    r.ms_per_step.map_or_else(
        || {
            r.error
                .as_deref()
                .map_or("", crate::train::failure_label)
                .to_string()
        },
        |v| match r.ms_range {
            Some((lo, hi)) => format!("{v:.1} ({lo:.1}–{hi:.1})"),
            None => format!("{v:.1}"),
        },
    )
}

/// The name of `peer`'s row trained as the row `implementation` names:
/// a LoRA row (", LoRA rN") compares with the peer's rows of the same rank
/// (PyTorch's through PEFT), a checkpointed row (", checkpointing every
/// …") with the peer's checkpointed rows.
fn peer_name(implementation: &str, peer: &str) -> String {
    let parts = || implementation.split(", ");
    let mut name = peer.to_string();
    if let Some(rank) = parts().find_map(|p| p.strip_prefix("LoRA r")) {
        name = match peer {
            "burn" => format!("burn, LoRA r{rank}"),
            _ => format!("{peer} + PEFT, LoRA r{rank}"),
        };
    }
    if let Some(checkpointing) = parts().find(|p| p.starts_with("checkpointing ")) {
        name = format!("{name}, {checkpointing}");
    }
    name
}

/// Whether two training rows measured the same model, batch, length and
/// dtype.
fn same_config(a: &crate::train::TrainRow, b: &crate::train::TrainRow) -> bool {
    a.model == b.model && a.batch == b.batch && a.seq == b.seq && a.dtype == b.dtype
}

/// Whether two training rows belong to one implementation's sweep over
/// lengths: the same model, batch, dtype, implementation and GPUs.
fn same_run(a: &crate::train::TrainRow, b: &crate::train::TrainRow) -> bool {
    a.model == b.model
        && a.batch == b.batch
        && a.dtype == b.dtype
        && a.implementation == b.implementation
        && a.devices == b.devices
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chart::tests::row;

    #[test]
    fn a_step_time_shows_its_range_when_measured() {
        let mut r = row("bastile", 1024, Some(47.04), None);
        assert_eq!(step_ms(&r), "47.0");
        r.ms_range = Some((44.56, 51.26));
        assert_eq!(step_ms(&r), "47.0 (44.6–51.3)");
        let failed = row("burn", 1024, None, Some("timed out after 10 s"));
        assert_eq!(step_ms(&failed), "timed out");
    }

    #[test]
    fn starts_read_cold_then_warm() {
        let mut r = crate::chart::tests::row("bastile", 1024, Some(10.0), None);
        assert_eq!(super::starts(&r), "");
        r.start_s = Some(1.25);
        assert_eq!(super::starts(&r), "1.2");
        r.cold_start_s = Some(17.04);
        assert_eq!(super::starts(&r), "17.0 / 1.2");
        r.start_s = None;
        assert_eq!(super::starts(&r), "17.0 / –");
    }

    #[test]
    fn the_longest_length_of_each_implementation_and_its_failure_are_listed() {
        let mut report = Report::new("cuda", "gpu", false, f64::NAN);
        let oom = "out of memory on the device: an allocation failed";
        report.train = vec![
            row("bastile", 1024, Some(10.0), None),
            row("burn", 1024, Some(20.0), None),
            row("bastile", 2048, Some(20.0), None),
            row("burn", 2048, None, Some(oom)),
            row("bastile", 4096, None, Some("timed out after 10 s")),
        ];
        let table = report.longest_markdown();
        assert!(
            table.contains("| m | 1 | bf16 | bastile | 2048 | 4096 (timed out) |"),
            "{table}"
        );
        assert!(
            table.contains("| m | 1 | bf16 | burn | 1024 | 2048 (out of memory) |"),
            "{table}"
        );
        // One length each: nothing to say.
        report.train.retain(|r| r.seq == 1024);
        assert_eq!(report.longest_markdown(), "");
    }

    #[test]
    fn rows_with_a_breakdown_get_a_memory_line() {
        let mut report = Report::new("cuda", "gpu", false, f64::NAN);
        let mut measured = row("bastile", 2048, Some(10.0), None);
        measured.in_use_mib = Some(6000.0);
        measured.peak_mib = Some(9000.0);
        measured.memory = Some(crate::train::MemoryBreakdown {
            parameters_mib: 1137.0,
            optimizer_state_mib: 2275.0,
            forward_kept_mib: 1500.4,
            gradients_mib: 1137.6,
            pass_peak_mib: 2400.0,
        });
        report.train = vec![measured, row("burn", 2048, Some(20.0), None)];
        let table = report.memory_markdown();
        assert!(
            table.contains(
                "| m | 1 | 2048 | bastile | 1137 | 2275 | 1500 | 1138 | 2400 | 6000 | 3000 |"
            ),
            "{table}"
        );
        assert!(!table.contains("| burn |"), "{table}");
        report.train.retain(|r| r.implementation == "burn");
        assert_eq!(report.memory_markdown(), "");
    }

    #[test]
    fn rows_compare_with_the_peer_rows_of_their_lora_rank_and_checkpointing() {
        let liger = crate::pytorch::LIGER;
        assert_eq!(peer_name("bastile", liger), liger);
        assert_eq!(
            peer_name("bastile, LoRA r8", liger),
            format!("{liger} + PEFT, LoRA r8")
        );
        assert_eq!(peer_name("bastile, LoRA r16", "burn"), "burn, LoRA r16");
        assert_eq!(
            peer_name("bastile, LoRA r8, checkpointing every layer", liger),
            format!("{liger} + PEFT, LoRA r8, checkpointing every layer")
        );
        assert_eq!(
            peer_name("bastile, checkpointing every layer", "burn"),
            "burn, checkpointing every layer"
        );
        // In the table: the checkpointed row against the checkpointed peer
        // (2×), the plain row against the plain peer (4×).
        let mut report = Report::new("cuda", "gpu", false, f64::NAN);
        let checkpointed = |name: &str| format!("{name}, checkpointing every layer");
        report.train = vec![
            row("bastile", 1024, Some(10.0), None),
            row(&checkpointed("bastile"), 1024, Some(20.0), None),
            row(liger, 1024, Some(40.0), None),
            row(&checkpointed(liger), 1024, Some(40.0), None),
        ];
        let table = report.train_markdown();
        let line = |name: &str| {
            table
                .lines()
                .find(|l| l.contains(&format!("| {name} |")))
                .unwrap_or_else(|| panic!("no row {name} in {table}"))
                .to_string()
        };
        let liger_cell = |line: String| line.split(" | ").nth(8).map(str::to_string);
        assert_eq!(liger_cell(line("bastile")).as_deref(), Some("4.00×"));
        assert_eq!(
            liger_cell(line(&checkpointed("bastile"))).as_deref(),
            Some("2.00×")
        );
    }
}
