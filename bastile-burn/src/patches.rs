//! The run-time switchboard: which fused ops `Bastile<B>` uses.
//!
//! A disabled op takes the composite path (plain Burn ops), under autodiff
//! too, so switching never changes results beyond rounding.

use std::sync::atomic::{AtomicU32, Ordering};

/// A fused op that can be switched on and off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    RmsNorm,
    SwiGlu,
    Geglu,
    Rope,
    CrossEntropy,
    LinearCrossEntropy,
    /// Matmul and `linear` through the vendor BLAS (cuBLASLt on CUDA).
    Matmul,
    /// Flash-style attention (forward and backward).
    Attention,
    /// A LoRA adapter's update as one autodiff node.
    Lora,
    /// A token embedding lookup whose backward pass adds into the
    /// weight's existing gradient.
    Embedding,
    /// The routed experts' row gathers, whose backward passes gather too,
    /// the router's choice, the grouping of its assignments and the
    /// combination of the experts' rows.
    Moe,
}

impl Op {
    /// Every switchable op.
    pub const ALL: [Op; 11] = [
        Op::RmsNorm,
        Op::SwiGlu,
        Op::Geglu,
        Op::Rope,
        Op::CrossEntropy,
        Op::LinearCrossEntropy,
        Op::Matmul,
        Op::Attention,
        Op::Lora,
        Op::Embedding,
        Op::Moe,
    ];

    fn bit(self) -> u32 {
        1 << (self as u32)
    }

    /// The op's name in snake case, as it is displayed.
    pub fn name(self) -> &'static str {
        match self {
            Op::RmsNorm => "rms_norm",
            Op::SwiGlu => "swiglu",
            Op::Geglu => "geglu",
            Op::Rope => "rope",
            Op::CrossEntropy => "cross_entropy",
            Op::LinearCrossEntropy => "linear_cross_entropy",
            Op::Matmul => "matmul",
            Op::Attention => "attention",
            Op::Lora => "lora",
            Op::Embedding => "embedding",
            Op::Moe => "moe",
        }
    }
}

impl core::fmt::Display for Op {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which fused ops to use. `Patches::default()` turns every op on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Patches {
    pub rms_norm: bool,
    pub swiglu: bool,
    /// GPT-OSS's clamped GEGLU.
    pub geglu: bool,
    pub rope: bool,
    /// Cross-entropy on given logits.
    pub cross_entropy: bool,
    /// Linear layer + cross-entropy without materialized logits.
    pub linear_cross_entropy: bool,
    /// Matmul, `linear` and [`crate::batched_linear`] on cuBLASLt (CUDA;
    /// elsewhere the inner backend's matmul either way).
    pub matmul: bool,
    /// Attention that never materializes the `[seq, seq]` scores.
    pub attention: bool,
    /// LoRA updates as one autodiff node each.
    pub lora: bool,
    /// Embedding lookups whose gradient is added into the weight's
    /// existing one (tied embeddings: one `[vocab, hidden]` buffer).
    pub embedding: bool,
    /// Routed experts' row gathers ([`crate::gather_rows`]) whose gradients
    /// are gathered back instead of scattered row by row, the router's
    /// top-k choice on the device ([`crate::router_top_k`]), the
    /// grouping of its assignments by expert on the device
    /// ([`crate::group_by_expert`]) and the weighted combination of the
    /// experts' rows ([`crate::combine_rows`]).
    pub moe: bool,
}

impl Default for Patches {
    fn default() -> Self {
        Self::all(true)
    }
}

impl Patches {
    /// Every op off: Burn's own composite ops everywhere.
    pub fn none() -> Self {
        Self::all(false)
    }

    fn all(on: bool) -> Self {
        Self {
            rms_norm: on,
            swiglu: on,
            geglu: on,
            rope: on,
            cross_entropy: on,
            linear_cross_entropy: on,
            matmul: on,
            attention: on,
            lora: on,
            embedding: on,
            moe: on,
        }
    }

    fn bits(self) -> u32 {
        [
            (self.rms_norm, Op::RmsNorm),
            (self.swiglu, Op::SwiGlu),
            (self.geglu, Op::Geglu),
            (self.rope, Op::Rope),
            (self.cross_entropy, Op::CrossEntropy),
            (self.linear_cross_entropy, Op::LinearCrossEntropy),
            (self.matmul, Op::Matmul),
            (self.attention, Op::Attention),
            (self.lora, Op::Lora),
            (self.embedding, Op::Embedding),
            (self.moe, Op::Moe),
        ]
        .into_iter()
        .filter(|(on, _)| *on)
        .fold(0, |bits, (_, op)| bits | op.bit())
    }
}

/// Every op starts on: choosing `Bastile<B>` is the opt-in.
static ENABLED: AtomicU32 = AtomicU32::new(u32::MAX);

/// Sets which fused ops are used from now on (calling it again changes them).
pub fn apply(patches: Patches) {
    ENABLED.store(patches.bits(), Ordering::SeqCst);
}

/// Turns every fused op off: Burn's composite ops everywhere.
pub fn reset() {
    apply(Patches::none());
}

/// The fused ops currently on.
pub fn patched_ops() -> Vec<Op> {
    Op::ALL.into_iter().filter(|op| is_enabled(*op)).collect()
}

/// Whether `op` is currently on.
pub fn is_enabled(op: Op) -> bool {
    ENABLED.load(Ordering::SeqCst) & op.bit() != 0
}
