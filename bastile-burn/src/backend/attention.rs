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

use crate::kernels::KernelBackend;
use crate::ops::attention::{AttentionSpec, worth_fusing};
use crate::patches::{Op, is_enabled};

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
        scale: options
            .scale
            .unwrap_or_else(|| 1.0 / (head_dim as f64).sqrt()),
        causal: options.is_causal,
        window: None,
    };
    let dims = [query.shape(), key.shape()];
    let plain = mask.is_none()
        && attn_bias.is_none()
        && options.softcap.is_none()
        && key.shape() == value.shape()
        && dims[0].num_dims() == 4
        && dims[1].num_dims() == 4
        && dims[1][1] > 0
        && dims[0][1].is_multiple_of(dims[1][1]);
    if plain
        && is_enabled(Op::Attention)
        && worth_fusing(&dims)
        && B::attention_supported(&B::float_device(&query), &dims, query.dtype(), &spec)
    {
        B::attention_forward_kernel(query, key, value, None, None, spec).0
    } else {
        B::attention(query, key, value, mask, attn_bias, options)
    }
}
