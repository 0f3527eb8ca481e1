//! What the gated activations (SwiGLU, the GPT-OSS GEGLU) share on the
//! host: the checks of a problem's shape, the tile a launch takes, the
//! autotune key and tuners, and the tuned run. Their kernels and buffers
//! are in [`crate::swiglu`] and [`crate::geglu`].

use cubecl::prelude::*;
use cubecl::tune::{LocalTuner, local_tuner};

use crate::elementwise::{TileLaunch, items_bucket, row_tile, run_tiled_with, tile_candidates};
use crate::tune::{BenchBuffers, Launcher, Tuner};
use crate::{FloatDtype, KernelError, launch};

/// Which gated activation a launch computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Activation {
    /// `silu(gate) · up`.
    SwiGlu,
    /// GPT-OSS's clamped GEGLU over interleaved gate and up.
    GegluOss,
}

impl Activation {
    fn name(self) -> &'static str {
        match self {
            Activation::SwiGlu => "SwiGLU",
            Activation::GegluOss => "GEGLU",
        }
    }
}

/// `rows` rows of `inter` outputs, each from a gate and an up value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct GluShape {
    pub activation: Activation,
    pub rows: usize,
    pub inter: usize,
    pub dtype: FloatDtype,
    /// A number every row stride of the launch is a multiple of (bounds
    /// the vector width).
    pub stride_multiple: usize,
}

impl GluShape {
    pub(crate) fn validate(&self) -> Result<(), KernelError> {
        if self.inter == 0 || self.stride_multiple == 0 {
            return Err(KernelError::Shape(format!(
                "{} needs a positive width and stride multiple, got {self:?}",
                self.activation.name()
            )));
        }
        Ok(())
    }

    fn vector_size<R: Runtime>(&self, client: &ComputeClient<R>) -> usize {
        launch::vector_size(
            client,
            self.dtype,
            launch::gcd(self.inter, self.stride_multiple),
        )
    }

    /// The vector width and vectors per row a launch with `config` takes,
    /// or `None` when there are no rows (nothing to launch).
    pub(crate) fn tile<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        config: &TileLaunch,
    ) -> Result<Option<(usize, usize)>, KernelError> {
        self.validate()?;
        row_tile(
            client,
            self.activation.name(),
            self.rows,
            self.inter,
            self.stride_multiple,
            config,
        )
    }

    /// Every configuration worth trying on this device.
    pub(crate) fn candidates<R: Runtime>(&self, client: &ComputeClient<R>) -> Vec<TileLaunch> {
        tile_candidates(client, self.vector_size(client))
    }
}

/// The autotune key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct GluKey {
    pub activation: Activation,
    pub items_bucket: usize,
    pub row_items: usize,
    pub dtype: FloatDtype,
    pub vector_size: usize,
    /// Whether gate and up (and their gradients) come as one matrix.
    pub packed_in: bool,
    pub packed_grad: bool,
    pub backward: bool,
    /// Whether the backward writes its gradients over its input.
    pub in_place: bool,
}

impl core::fmt::Display for GluKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "{}{} items~{} row_items={} {} vec={} packed={}/{}{}",
            self.activation.name(),
            if self.backward { "_bwd" } else { "_fwd" },
            self.items_bucket,
            self.row_items,
            self.dtype,
            self.vector_size,
            self.packed_in,
            self.packed_grad,
            if self.in_place { " in place" } else { "" }
        )
    }
}

static FORWARD_TUNER: Tuner<GluKey> = local_tuner!("bastile-glu-forward");
static BACKWARD_TUNER: Tuner<GluKey> = local_tuner!("bastile-glu-backward");

/// Forgets every tuning decision taken in this process.
pub fn clear_autotune() {
    FORWARD_TUNER.clear();
    BACKWARD_TUNER.clear();
}

/// How a tuned launch lays its gate and up values out.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Packing {
    pub input: bool,
    pub grad: bool,
    /// The gradients written over the input (`grad` then equals `input`).
    pub in_place: bool,
}

/// Runs `launch` (the forward, or with `backward` the backward) with the
/// tile tuned for `shape` and `packing`, its benchmark runs on the buffers
/// `bench` makes (scratch in place of an input the launch writes over).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<R: Runtime, P, Buffers>(
    shape: GluShape,
    packing: Packing,
    backward: bool,
    launch: Launcher<R, P, Buffers, TileLaunch>,
    bench: BenchBuffers<R, P, Buffers>,
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &P,
    buffers: &Buffers,
) -> Result<(), KernelError>
where
    P: Clone + Send + Sync + 'static,
    Buffers: Clone + Send + Sync + 'static,
{
    shape.validate()?;
    let vector_size = shape.vector_size(client);
    let row_items = shape.inter / vector_size;
    let key = GluKey {
        activation: shape.activation,
        items_bucket: items_bucket(shape.rows * row_items),
        row_items,
        dtype: shape.dtype,
        vector_size,
        packed_in: packing.input,
        packed_grad: packing.grad,
        backward,
        in_place: packing.in_place,
    };
    let tuner = if backward {
        &BACKWARD_TUNER
    } else {
        &FORWARD_TUNER
    };
    run_tiled_with(
        tuner,
        key,
        vector_size,
        launch,
        bench,
        client,
        device,
        problem,
        buffers,
    )
}
