//! Every launcher checks its buffers before anything is queued: a buffer
//! one value short of what the problem reads or writes, or a row stride
//! shorter than a row, is a shape error from the tuned entry point and
//! from the explicit-configuration one, and the same problem with whole
//! buffers runs.

use bastile_cubecl::attention::{
    self, AttentionForwardBuffers, AttentionProblem, BlockSoftmaxBuffers, HeadLayout, QueryBlock,
};
use bastile_cubecl::cross_entropy::{
    self, CrossEntropyBuffers, CrossEntropyMode, CrossEntropyProblem, RowScale,
};
use bastile_cubecl::geglu::{self, GegluForwardBuffers, GegluProblem};
use bastile_cubecl::rms_norm::{self, ForwardBuffers, RmsNormCast, RmsNormProblem};
use bastile_cubecl::rope::{self, HeadStrides, HeadTensor, RopeBuffers, RopePairing, RopeProblem};
use bastile_cubecl::rows::Rows;
use bastile_cubecl::swiglu::{self, GluPair, SwiGluForwardBuffers, SwiGluProblem};
use bastile_cubecl::testing::*;
use bastile_cubecl::{FloatDtype, KernelError};
use cubecl::prelude::*;
use cubecl::server::Handle;

const F32: FloatDtype = FloatDtype::F32;

/// A shape error naming `what`.
fn refused(result: Result<(), KernelError>, what: &str) {
    match result {
        Err(KernelError::Shape(e)) => assert!(e.contains(what), "{what}: {e}"),
        other => panic!("{what}: expected a shape error, got {other:?}"),
    }
}

struct Buffers;

impl RuntimeTest for Buffers {
    fn run<R: Runtime>(&self, device: &R::Device, _runtime: &str, _dtypes: &[FloatDtype]) {
        let client = R::client(device);
        let values = |n: usize| upload(&client, F32, &vec![0.5; n]);
        let rows = |n: usize, hidden: usize| Rows::dense(values(n * hidden), hidden);
        let (n, hidden) = (5, 64);

        // RMSNorm: x one value short; then a stride shorter than a row.
        let problem = RmsNormProblem {
            rows: n,
            hidden,
            eps: 1e-6,
            cast: RmsNormCast::Llama,
            dtype: F32,
            stride_multiple: hidden,
        };
        let whole = ForwardBuffers {
            x: rows(n, hidden),
            gamma: values(hidden),
            out: rows(n, hidden),
            rstd: values(n),
        };
        rms_norm::forward(&client, device, &problem, &whole).unwrap();
        let short = ForwardBuffers {
            x: Rows::dense(values(n * hidden - 1), hidden),
            ..whole.clone()
        };
        refused(
            rms_norm::forward(&client, device, &problem, &short),
            "RMSNorm x",
        );
        let config = rms_norm::candidates(&client, &problem)[0];
        refused(
            rms_norm::forward_with(&client, &problem, &short, &config),
            "RMSNorm x",
        );
        let narrow = ForwardBuffers {
            out: Rows {
                handle: values(n * hidden),
                stride: hidden - 1,
            },
            ..whole.clone()
        };
        refused(
            rms_norm::forward(&client, device, &problem, &narrow),
            "RMSNorm out",
        );
        let no_rstd = ForwardBuffers {
            rstd: values(n - 1),
            ..whole
        };
        refused(
            rms_norm::forward(&client, device, &problem, &no_rstd),
            "RMSNorm rstd",
        );

        // SwiGLU and GEGLU: an output one row short.
        let problem = SwiGluProblem {
            rows: n,
            inter: hidden,
            dtype: F32,
            stride_multiple: hidden,
        };
        let whole = SwiGluForwardBuffers {
            input: GluPair::Packed(rows(n, 2 * hidden)),
            out: rows(n, hidden),
        };
        swiglu::forward(&client, device, &problem, &whole).unwrap();
        let short = SwiGluForwardBuffers {
            out: rows(n - 1, hidden),
            ..whole.clone()
        };
        refused(
            swiglu::forward(&client, device, &problem, &short),
            "SwiGLU out",
        );
        let separate = SwiGluForwardBuffers {
            input: GluPair::Separate {
                gate: rows(n, hidden),
                up: rows(n - 1, hidden),
            },
            ..whole
        };
        refused(
            swiglu::forward(&client, device, &problem, &separate),
            "SwiGLU input up",
        );
        let problem = GegluProblem {
            rows: n,
            inter: hidden,
            alpha: 1.702,
            limit: 7.0,
            dtype: F32,
            stride_multiple: hidden,
        };
        let whole = GegluForwardBuffers {
            input: rows(n, 2 * hidden),
            out: rows(n, hidden),
        };
        geglu::forward(&client, device, &problem, &whole).unwrap();
        let short = GegluForwardBuffers {
            input: rows(n, 2 * hidden - 1),
            ..whole
        };
        refused(
            geglu::forward(&client, device, &problem, &short),
            "GEGLU input",
        );

        // RoPE: a cos table one row short.
        let (batch, seq, heads, d) = (2, 7, 2, 64);
        let head = |heads: usize| HeadTensor {
            handle: values(batch * heads * seq * d),
            strides: HeadStrides::bhsd(heads, seq, d),
        };
        let problem = RopeProblem {
            batch,
            seq,
            q_heads: heads,
            k_heads: heads,
            head_dim: d,
            dtype: F32,
            pairing: RopePairing::Half,
            inverse: false,
            offset: 0,
            table_rows: seq,
            table_batched: false,
            stride_multiple: d,
        };
        let whole = RopeBuffers {
            q: head(heads),
            k: head(heads),
            q_out: head(heads),
            k_out: head(heads),
            cos: values(seq * d / 2),
            sin: values(seq * d / 2),
        };
        rope::rope(&client, device, &problem, &whole).unwrap();
        let short = RopeBuffers {
            cos: values((seq - 1) * d / 2),
            ..whole.clone()
        };
        refused(
            rope::rope(&client, device, &problem, &short),
            "RoPE cos table",
        );
        let few_heads = RopeBuffers {
            k_out: head(heads - 1),
            ..whole
        };
        refused(
            rope::rope(&client, device, &problem, &few_heads),
            "RoPE k out",
        );

        // Cross-entropy: labels one short.
        let labels =
            |n: usize| -> Handle { upload_i32(&client, &(0..n as i32).collect::<Vec<_>>()) };
        let problem = CrossEntropyProblem {
            rows: n,
            vocab: hidden,
            slice: None,
            dtype: F32,
            stride_multiple: hidden,
            ignore_index: -100,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: None,
            scale: 1.0,
            mode: CrossEntropyMode::StatsAndGrad,
            row_scale: RowScale::None,
        };
        let whole = CrossEntropyBuffers {
            logits: rows(n, hidden),
            labels: labels(n),
            grad: Some(rows(n, hidden)),
            losses: values(n),
            lse: values(n),
            row_scale: None,
        };
        cross_entropy::run(&client, device, &problem, &whole).unwrap();
        // The gradient-only mode writes no losses: a stand-in will do.
        let grad_only = CrossEntropyProblem {
            mode: CrossEntropyMode::Grad,
            ..problem
        };
        let no_losses = CrossEntropyBuffers {
            losses: values(1),
            ..whole.clone()
        };
        cross_entropy::run(&client, device, &grad_only, &no_losses).unwrap();
        let short = CrossEntropyBuffers {
            labels: labels(n - 1),
            ..whole
        };
        refused(
            cross_entropy::run(&client, device, &problem, &short),
            "cross-entropy labels",
        );

        // Attention: a key buffer one value short; a block past the keys.
        let problem = AttentionProblem {
            batch: 1,
            heads: 2,
            kv_heads: 1,
            seq_q: 9,
            seq_k: 9,
            head_dim: d,
            scale: 0.125,
            causal: true,
            window: None,
            sinks: false,
            key_lengths: false,
            documents: false,
            dtype: F32,
        };
        let layout = |heads: usize, len: usize| HeadLayout::dense(values(len), heads, 9, d);
        let whole = AttentionForwardBuffers {
            q: layout(2, 2 * 9 * d),
            k: layout(1, 9 * d),
            v: layout(1, 9 * d),
            out: layout(2, 2 * 9 * d),
            lse: values(2 * 9),
            sinks: None,
            key_lengths: None,
            doc_starts: None,
        };
        attention::forward(&client, device, &problem, &whole).unwrap();
        let short = AttentionForwardBuffers {
            k: layout(1, 9 * d - 1),
            ..whole.clone()
        };
        refused(
            attention::forward(&client, device, &problem, &short),
            "attention key",
        );
        let short_lse = AttentionForwardBuffers {
            lse: values(2 * 9 - 1),
            ..whole
        };
        refused(
            attention::forward(&client, device, &problem, &short_lse),
            "attention lse",
        );
        let block = QueryBlock {
            q0: 4,
            rows: 4,
            k_lo: 2,
            keys: 8,
        };
        let buffers = BlockSoftmaxBuffers {
            scores: values(2 * 4 * 8),
            probs: values(2 * 4 * 8),
            lse: values(2 * 9),
            sinks: None,
            key_lengths: None,
            doc_starts: None,
        };
        refused(
            attention::block_softmax(&client, &problem, &block, &buffers),
            "does not lie within",
        );
    }
}

#[test]
fn launchers_refuse_buffers_that_do_not_hold_the_problem() {
    for_each_runtime(&Buffers);
}
