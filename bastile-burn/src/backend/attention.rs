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
use crate::kernels::KernelBackend;
use crate::ops::attention::{AttentionSpec, scale_or_default};

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
    };
    let dims = [query.shape(), key.shape()];
    // Shapes, dtype, the patch switch and the size threshold are the fused
    // op's own predicate; what Burn's call adds is checked here.
    let plain = mask.is_none()
        && attn_bias.is_none()
        && options.softcap.is_none()
        && key.shape() == value.shape();
    let device = B::float_device(&query);
    if plain && Bastile::<B>::attention_fused(&device, &dims, query.dtype(), &spec) {
        B::attention_forward_kernel(query, key, value, None, None, spec).0
    } else {
        B::attention(query, key, value, mask, attn_bias, options)
    }
}
