//! GPT-OSS's mixture-of-experts layer alone (GPT-OSS-20B's width: hidden
//! and intermediate 2880, 32 experts, top-4; 8192 tokens), forward +
//! backward through `Autodiff<Bastile<B>>`: the routed path (the model's
//! default) against the time of the grouped products it runs, and the
//! dense path for reference.
//!
//! The grouped products are the experts' `gate_up` and `down` over the
//! same groups the layer forms (every group padded to the largest one,
//! `capacity` rows), forward and both gradients, on the same engine: six
//! batched products, the floor the rest of the layer (router, top-k,
//! the grouping and its read of the group sizes, gathers, GEGLU, biases,
//! weighting) adds to.

use bastile::{Bastile, BastileBackend, group_by_expert, router_top_k};
use bastile_models::ExpertRouting;
use bastile_models::moe::{CAPACITY_STEP, Experts, Moe};
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Param};
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor};

use crate::Args;
use crate::report::{MoeRow, Report};
use crate::timing::median_seconds;

/// The layer's sizes.
struct Sizes {
    tokens: usize,
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
}

/// GPT-OSS's GEGLU clamp.
const LIMIT: f64 = 7.0;

fn normal<X: Backend, const D: usize>(
    shape: [usize; D],
    std: f64,
    dtype: DType,
    device: &X::Device,
) -> Tensor<X, D> {
    Tensor::<X, D>::random(shape, Distribution::Normal(0.0, std), device).cast(dtype)
}

/// A layer of random weights (HF's initializer range, 0.02) in `dtype`.
fn layer<X: Backend>(
    s: &Sizes,
    routing: ExpertRouting,
    dtype: DType,
    device: &X::Device,
) -> Moe<X> {
    let param = |t: Tensor<X, 2>| Param::from_tensor(t);
    let param3 = |t: Tensor<X, 3>| Param::from_tensor(t);
    let (e, h, i) = (s.experts, s.hidden, s.inter);
    Moe {
        router: Linear {
            weight: param(normal([h, e], 0.02, dtype, device)),
            bias: Some(Param::from_tensor(normal([e], 0.02, dtype, device))),
        },
        experts: Experts {
            gate_up_proj: param3(normal([e, h, 2 * i], 0.02, dtype, device)),
            gate_up_proj_bias: param(normal([e, 2 * i], 0.02, dtype, device)),
            down_proj: param3(normal([e, i, h], 0.02, dtype, device)),
            down_proj_bias: param(normal([e, h], 0.02, dtype, device)),
        },
        top_k: s.top_k,
        limit: LIMIT,
        routing,
    }
}

/// The rows the routed path pads every expert's group to for `x`.
fn capacity<B: BastileBackend>(moe: &Moe<B>, x: Tensor<B, 2>, experts: usize) -> usize {
    let logits = moe.router.forward(x);
    let (_, chosen) = router_top_k(logits, moe.top_k).expect("valid top-k");
    group_by_expert(chosen, experts, CAPACITY_STEP)
        .expect("the router's choices")
        .capacity
}

/// The six batched products of the routed layer over groups of `capacity`
/// rows: `gate_up` and `down` forward, and for each the input's and the
/// weight's gradient.
fn grouped_products<X: Backend>(
    s: &Sizes,
    capacity: usize,
    dtype: DType,
    samples: usize,
    device: &X::Device,
) -> f64 {
    let (e, h, i) = (s.experts, s.hidden, s.inter);
    let groups = normal::<X, 3>([e, capacity, h], 1.0, dtype, device);
    let gate_up = normal::<X, 3>([e, h, 2 * i], 0.02, dtype, device);
    let act = normal::<X, 3>([e, capacity, i], 1.0, dtype, device);
    let down = normal::<X, 3>([e, i, h], 0.02, dtype, device);
    let d_out = normal::<X, 3>([e, capacity, h], 1.0, dtype, device);
    let d_gate_up = normal::<X, 3>([e, capacity, 2 * i], 1.0, dtype, device);
    median_seconds(
        samples,
        5,
        |_| {
            [
                groups.clone().matmul(gate_up.clone()),
                act.clone().matmul(down.clone()),
                d_out.clone().matmul(down.clone().swap_dims(1, 2)),
                act.clone().swap_dims(1, 2).matmul(d_out.clone()),
                d_gate_up.clone().matmul(gate_up.clone().swap_dims(1, 2)),
                groups.clone().swap_dims(1, 2).matmul(d_gate_up.clone()),
            ]
        },
        || X::sync(device).expect("device sync"),
    )
}

pub fn bench<B>(device: &B::Device, args: &Args, report: &mut Report)
where
    B: bastile::ops::KernelBackend + BastileBackend,
{
    type A<B> = Autodiff<Bastile<B>>;
    let (s, dtype) = if args.tiny {
        let s = Sizes {
            tokens: 256,
            hidden: 64,
            inter: 64,
            experts: 8,
            top_k: 2,
        };
        (s, DType::F32)
    } else {
        let s = Sizes {
            tokens: 8192,
            hidden: 2880,
            inter: 2880,
            experts: 32,
            top_k: 4,
        };
        (s, DType::BF16)
    };
    let shape = format!(
        "{} tokens, {}×{} ({} experts, top-{})",
        s.tokens, s.hidden, s.inter, s.experts, s.top_k
    );
    let dname = format!("{dtype:?}").to_lowercase();
    // The layer's input as a model's layers pass it, `[batch, seq, hidden]`
    // (a 2-D input viewed as 3-D would be copied: its rows are padded).
    let x = normal::<Bastile<B>, 3>([1, s.tokens, s.hidden], 1.0, dtype, device);
    let dy = normal::<Bastile<B>, 3>([1, s.tokens, s.hidden], 1.0, dtype, device);
    // Useful flops: each token's `top_k` rows through `gate_up` (`h × 2i`)
    // and `down` (`i × h`), forward and two gradients.
    let useful_flops = 18.0 * (s.tokens * s.top_k * s.hidden * s.inter) as f64;
    let iters = if args.tiny { 2 } else { 5 };
    // Dense first: a kernel trace of the run ends with the routed layer.
    for routing in [ExpertRouting::Dense, ExpertRouting::Routed] {
        let moe = layer::<A<B>>(&s, routing, dtype, device);
        let t = median_seconds(
            args.samples,
            iters,
            |_| {
                let x = Tensor::<A<B>, 3>::from_inner(x.clone()).require_grad();
                let y = moe.forward(x.clone()).expect("valid layer");
                let grads = (y * Tensor::from_inner(dy.clone())).sum().backward();
                x.grad(&grads)
            },
            || <Bastile<B> as Backend>::sync(device).expect("device sync"),
        );
        let (capacity, gemm_ms) = match routing {
            ExpertRouting::Routed => {
                let rows = x.clone().reshape([s.tokens, s.hidden]);
                let capacity = capacity(&moe.valid(), rows, s.experts);
                let t = grouped_products::<Bastile<B>>(&s, capacity, dtype, args.samples, device);
                (Some(capacity), Some(t * 1e3))
            }
            ExpertRouting::Dense => (None, None),
        };
        let row = MoeRow {
            shape: shape.clone(),
            dtype: dname.clone(),
            routing: format!("{routing:?}").to_lowercase(),
            layer_ms: t * 1e3,
            useful_tflops: useful_flops / t / 1e12,
            capacity,
            mean_group: (s.tokens * s.top_k) as f64 / s.experts as f64,
            grouped_products_ms: gemm_ms,
        };
        crate::progress::log(row.line());
        report.moe.push(row);
    }
}
