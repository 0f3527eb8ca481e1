//! Fused linear cross-entropy: forward + backward time, TFLOP/s (the three
//! matmuls: logits, d_hidden, d_weight) and peak device memory, against
//! Burn's composite (`linear` + `CrossEntropyLoss` under autodiff) and
//! against the three bare matmuls alone (Burn's own and `Bastile<B>`'s,
//! cuBLASLt on CUDA: the floor of the fused loss), in one run.

use bastile::{Bastile, BastileBackend, CrossEntropyOptions, linear_cross_entropy};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorPrimitive};

use crate::Args;
use crate::passes::tracked;
use crate::report::{FlceRow, Report};
use crate::timing::median_seconds;

/// What one configuration holds on the device.
struct Data<B: Backend> {
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    labels: Tensor<B, 1, Int>,
}

fn data<B: Backend>(n: usize, h: usize, v: usize, dtype: DType, device: &B::Device) -> Data<B> {
    let hidden = Tensor::<B, 2>::random([n, h], Distribution::Normal(0.0, 1.0), device).cast(dtype);
    let std = 1.0 / (h as f64).sqrt();
    let weight = Tensor::<B, 2>::random([v, h], Distribution::Normal(0.0, std), device).cast(dtype);
    // Every 10th token is padding (ignored), as in a packed batch.
    let labels = Tensor::<B, 1, Int>::random([n], Distribution::Uniform(0.0, v as f64), device);
    let pad = Tensor::<B, 1, Int>::arange(0..n as i64, device)
        .remainder_scalar(10)
        .equal_elem(0);
    let labels = labels.mask_fill(pad, -100);
    Data {
        hidden,
        weight,
        labels,
    }
}

/// One fwd+bwd of Bastile's fused loss; returns what must be kept.
fn fused<B: bastile::ops::KernelBackend>(
    d: &Data<B>,
    chunk: Option<usize>,
) -> Box<dyn std::any::Any> {
    type A<X> = Autodiff<Bastile<X>>;
    let h = tracked::<Bastile<B>, 2>(d.hidden.clone().into_primitive().tensor());
    let w = tracked::<Bastile<B>, 2>(d.weight.clone().into_primitive().tensor());
    let labels = Tensor::<A<B>, 1, Int>::from_primitive(d.labels.clone().into_primitive());
    let options = CrossEntropyOptions {
        chunk_size: chunk,
        ..Default::default()
    };
    let out =
        linear_cross_entropy(h.clone(), w.clone(), None, labels, options).expect("valid inputs");
    let grads = out.loss.backward();
    Box::new((h.grad(&grads), w.grad(&grads)))
}

/// One fwd+bwd of Burn's composite: `linear`, then `CrossEntropyLoss`
/// with the padding label, under autodiff.
fn composite<B: Backend>(d: &Data<B>) -> Box<dyn std::any::Any> {
    type A<X> = Autodiff<X>;
    let h = Tensor::<A<B>, 2>::from_inner(d.hidden.clone()).require_grad();
    let w = Tensor::<A<B>, 2>::from_inner(d.weight.clone()).require_grad();
    let labels = Tensor::<A<B>, 1, Int>::from_inner(d.labels.clone());
    // Burn's loss gathers by label: padding needs a valid index.
    let labels = labels.clone().mask_fill(labels.equal_elem(-100), 0);
    let logits = h.clone().matmul(w.clone().transpose());
    let loss = burn::nn::loss::CrossEntropyLossConfig::new()
        .with_pad_tokens(Some(vec![0]))
        .init::<A<B>>(&h.device())
        .forward(logits, labels);
    let grads = loss.backward();
    Box::new((h.grad(&grads), w.grad(&grads)))
}

/// The three matmuls of the loss alone, without autodiff: the floor.
fn bare<X: Backend>(hidden: Tensor<X, 2>, weight: Tensor<X, 2>) -> Box<dyn std::any::Any> {
    let logits = hidden.clone().matmul(weight.clone().transpose());
    let dh = logits.clone().matmul(weight);
    let dw = logits.transpose().matmul(hidden);
    Box::new((dh, dw))
}

/// [`bare`] on `Bastile<B>`, whose matmul is the fused loss's own.
fn bare_bastile<B: bastile::ops::KernelBackend>(d: &Data<B>) -> Box<dyn std::any::Any> {
    let lift = |t: &Tensor<B, 2>| {
        Tensor::<Bastile<B>, 2>::from_primitive(TensorPrimitive::Float(
            t.clone().into_primitive().tensor(),
        ))
    };
    bare(lift(&d.hidden), lift(&d.weight))
}

pub fn bench<R, B>(device: &B::Device, args: &Args, report: &mut Report)
where
    R: cubecl::Runtime<Device = B::Device>,
    B: bastile::ops::KernelBackend + BastileBackend,
{
    let (shapes, dtype): (&[(usize, usize, usize)], _) = if args.tiny {
        (&[(64, 32, 1000)], DType::F32)
    } else {
        (
            &[
                (8192, 4096, 151936),
                (16384, 4096, 151936),
                (8192, 1024, 151936),
            ],
            DType::BF16,
        )
    };
    let client = R::client(device);
    let reserved = || client.memory_usage().map(|u| u.bytes_reserved).unwrap_or(0);
    let sync = || B::sync(device).expect("device sync");
    let samples = args.samples.clamp(1, 5);
    type Run<B> = Box<dyn Fn(&Data<B>) -> Box<dyn std::any::Any>>;
    type Config<B> = ((usize, usize, usize), String, Option<usize>, Run<B>);
    let mut configs: Vec<Config<B>> = Vec::new();
    for (k, &shape) in shapes.iter().enumerate() {
        let mut chunks = vec![None];
        if k == 0 && !args.tiny {
            chunks.extend([Some(2048), Some(8192)]);
        }
        for c in chunks {
            configs.push((
                shape,
                "bastile".into(),
                c,
                Box::new(move |d| fused::<B>(d, c)),
            ));
        }
        configs.push((shape, "burn".into(), None, Box::new(composite::<B>)));
        configs.push((
            shape,
            "bare matmuls".into(),
            None,
            Box::new(|d| bare(d.hidden.clone(), d.weight.clone())),
        ));
        configs.push((
            shape,
            "bare matmuls (bastile)".into(),
            None,
            Box::new(bare_bastile::<B>),
        ));
    }
    for (i, (shape, name, chunk, _)) in configs.iter().enumerate() {
        crate::progress::log(format!("flce case {i}: {shape:?} {name} chunk {chunk:?}"));
    }
    for (i, ((n, h, v), name, chunk, run)) in configs.into_iter().enumerate() {
        if args.case.is_some_and(|c| c != i) {
            continue;
        }
        let flops = 3.0 * 2.0 * (n * h * v) as f64;
        // Peak memory: the pool's reserved bytes after one call, inputs
        // included (run one `--case` per process so the pool holds nothing
        // from other configurations). A first call tunes the matmuls, whose
        // benchmark buffers are released before measuring, as is the f32
        // staging of the random inputs, so `before` is what the inputs hold.
        B::memory_cleanup(device);
        sync();
        let d = data::<B>(n, h, v, dtype, device);
        drop(run(&d));
        sync();
        B::memory_cleanup(device);
        sync();
        let before = reserved();
        let kept = run(&d);
        sync();
        let peak = reserved();
        drop(kept);
        let t = median_seconds(samples, 1, |_| run(&d), sync);
        let row = FlceRow {
            shape: format!("N={n} H={h} V={v}"),
            dtype: format!("{dtype:?}").to_lowercase(),
            implementation: name,
            chunk,
            ms: t * 1e3,
            tflops: flops / t / 1e12,
            peak_mib: peak as f64 / (1u64 << 20) as f64,
            inputs_mib: before as f64 / (1u64 << 20) as f64,
        };
        crate::progress::log(format!(
            "flce {:<22} {:<14} chunk {:>6} {:>9.2} ms {:>7.1} TFLOP/s peak {:>9.0} MiB (inputs {:.0} MiB)",
            row.shape,
            row.implementation,
            row.chunk.map_or("auto".into(), |c| c.to_string()),
            row.ms,
            row.tflops,
            row.peak_mib,
            row.inputs_mib
        ));
        report.flce.push(row);
        drop(d);
    }
}
