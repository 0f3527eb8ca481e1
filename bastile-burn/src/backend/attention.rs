//! Burn's `ModuleOps::attention` on `Bastile<B>`: the fused forward kernel
//! for what it covers (no explicit mask or bias, no softcap, the key and
//! value head dims equal, a score matrix past
//! [`crate::ops::attention::set_fused_from`]'s size), `B`'s attention
//! otherwise. Training goes through
//! [`crate::attention`], whose autodiff node saves only the output and the
//! log-sum-exp (`Autodiff<B>` implements `ModuleOps::attention` itself,
//! with the composite graph).

use burn::tensor::TensorMetadata;
use burn::tensor::ops::{AttentionModuleOptions, BoolTensor, FloatTensor};

use super::Bastile;
use crate::BastileBackend;
use crate::fused::{FusedOp, KernelBackend, is_fused};
use crate::ops::attention::{Attention, AttentionSpec, AttentionTensors, scale_or_default};

pub(super) fn module_attention<B: KernelBackend>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    mask: Option<BoolTensor<B>>,
    attn_bias: Option<FloatTensor<B>>,
    options: AttentionModuleOptions,
) -> FloatTensor<B> {
    let head_dim = query.shape()[query.shape().num_dims() - 1];
    let spec = AttentionSpec {
        scale: scale_or_default(options.scale, head_dim),
        causal: options.is_causal,
        window: None,
        documents: false,
    };
    // Shapes, dtype, the patch switch and the size threshold are the fused
    // op's own plan; what Burn's call adds is checked here.
    let plain = mask.is_none()
        && attn_bias.is_none()
        && options.softcap.is_none()
        && key.shape() == value.shape();
    let op = Attention { spec };
    let input = AttentionTensors {
        q: query,
        k: key,
        v: value,
        sinks: None,
        key_lengths: None,
        doc_starts: None,
    };
    let (device, problem) = op.problem::<B>(&input);
    if plain && is_fused::<Bastile<B>, _>(&op, &device, &problem) {
        Bastile::<B>::run(&op, input).0
    } else {
        let AttentionTensors {
            q: query,
            k: key,
            v: value,
            ..
        } = input;
        B::attention(query, key, value, mask, attn_bias, options)
    }
}
