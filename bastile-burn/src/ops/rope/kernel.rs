//! RoPE's kernel launch on `CubeBackend`: q and k in one launch, any outer
//! strides.

use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::launch::gcd;
use bastile_cubecl::rope::{self, HeadStrides, HeadTensor, RopeBuffers, RopeProblem};

use super::{Rope, RopeOptions};
use crate::fused::cube::{empty_like, offset_elems};
use crate::fused::{kernel, kernel_dtype};
use crate::launch_failure::launch;

// Inputs `[cos, sin, q]` or `[cos, sin, q, k]`.
kernel!(Rope, "bastile_rope", |op, mut floats, _| {
    let k = if floats.len() == 4 {
        floats.pop()
    } else {
        None
    };
    let q = floats.pop().expect("q");
    let sin = floats.pop().expect("sin");
    let cos = floats.pop().expect("cos");
    let (q, k) = rope(q, k, cos, sin, op.options);
    std::iter::once(q).chain(k).collect()
});

/// The tensor with a unit-stride last dimension, and its outer strides in
/// the kernel's (batch, head, seq) order.
fn heads<R: CubeRuntime>(t: CubeTensor<R>, options: &RopeOptions) -> (CubeTensor<R>, HeadTensor) {
    let t = if t.meta.strides()[3] == 1 || t.shape()[3] == 1 {
        t
    } else {
        into_contiguous(t)
    };
    let s = t.meta.strides();
    let (h, q) = options.layout.head_seq_axes();
    let head = HeadTensor {
        handle: t.handle.clone(),
        strides: HeadStrides {
            batch: s[0],
            head: s[h],
            seq: s[q],
        },
    };
    (t, head)
}

fn strides_gcd(g: usize, t: &HeadTensor, offset: usize) -> usize {
    [t.strides.batch, t.strides.head, t.strides.seq, offset]
        .into_iter()
        .fold(g, gcd)
}

fn rope<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: Option<CubeTensor<R>>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    options: RopeOptions,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let dims = |t: &CubeTensor<R>| {
        let s = t.shape();
        options.layout.dims([s[0], s[1], s[2], s[3]])
    };
    let (batch, q_heads, seq, head_dim) = dims(&q);
    let (q, q_in) = heads(q, &options);
    let q_out = empty_like(&q, q.shape(), q.dtype);
    let (q_out, q_out_h) = heads(q_out, &options);
    let mut g = head_dim / 2;
    g = strides_gcd(g, &q_in, offset_elems(&q));
    g = strides_gcd(g, &q_out_h, offset_elems(&q_out));

    let (k_heads, k_in, k_out, k_out_h, _k_keep) = match k {
        Some(k) => {
            let (_, kh, _, _) = dims(&k);
            let (k, k_in) = heads(k, &options);
            let out = empty_like(&k, k.shape(), k.dtype);
            let (out, out_h) = heads(out, &options);
            g = strides_gcd(g, &k_in, offset_elems(&k));
            g = strides_gcd(g, &out_h, offset_elems(&out));
            (kh, k_in, Some(out), out_h, Some(k))
        }
        None => {
            // No k: zero k rows, so these stand-ins are never touched.
            let dummy = |t: &CubeTensor<R>| HeadTensor {
                handle: t.client.empty(16),
                strides: HeadStrides::bhsd(0, seq, head_dim),
            };
            (0, dummy(&q), None, dummy(&q), None)
        }
    };

    let cos = into_contiguous(cos);
    let sin = into_contiguous(sin);
    g = [offset_elems(&cos), offset_elems(&sin)]
        .into_iter()
        .fold(g, gcd);
    let t = cos.shape();
    let problem = RopeProblem {
        batch,
        seq,
        q_heads,
        k_heads,
        head_dim,
        dtype: kernel_dtype(q.dtype).expect("validated dtype"),
        pairing: options.pairing,
        inverse: options.inverse,
        offset: options.offset,
        table_rows: t[1],
        table_batched: t[0] > 1,
        stride_multiple: g,
    };
    let buffers = RopeBuffers {
        q: q_in,
        k: k_in,
        q_out: q_out_h,
        k_out: k_out_h,
        cos: cos.handle.clone(),
        sin: sin.handle.clone(),
    };
    launch("RoPE", || {
        rope::rope(&q.client, &q.device, &problem, &buffers)
    });
    (q_out, k_out)
}
