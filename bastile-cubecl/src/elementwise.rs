//! Tiling shared by the element-wise row kernels (SwiGLU, GEGLU, RoPE).
//!
//! The work of a launch is a list of *items* (one vector of `vector_size`
//! elements, or whatever an op calls one step), `row_items` per row. A cube
//! of `units_per_cube` units takes `units_per_cube · items_per_unit`
//! consecutive items; unit `u` takes items `u, u + units, u + 2·units, ...`
//! of them, so every step of the cube reads one contiguous span (coalesced).
//! The row length is comptime, so the row/column split of an item index is a
//! division by a constant.

use std::sync::Arc;

use cubecl::prelude::*;

use crate::tune::{
    BenchBuffers, CandidateCache, Launcher, OpKey, Tuner, run_tuned_with, same_buffers,
};
use crate::{KernelError, launch};

/// One launch configuration of a tiled element-wise kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TileLaunch {
    pub vector_size: usize,
    pub units_per_cube: u32,
    pub items_per_unit: u32,
}

/// The comptime part of a tiled launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tile {
    /// Items per row.
    pub row_items: u32,
    pub units_per_cube: u32,
    pub items_per_unit: u32,
}

impl TileLaunch {
    /// The comptime tile for rows of `row_items` items.
    pub fn tile(&self, row_items: usize) -> Tile {
        Tile {
            row_items: row_items as u32,
            units_per_cube: self.units_per_cube,
            items_per_unit: self.items_per_unit,
        }
    }

    pub fn cube_dim(&self) -> CubeDim {
        CubeDim::new_1d(self.units_per_cube)
    }

    /// The grid covering `items` items.
    pub fn cube_count<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        items: usize,
    ) -> Result<CubeCount, KernelError> {
        let per_cube = (self.units_per_cube * self.items_per_unit) as usize;
        launch::cube_count(client, items.div_ceil(per_cube))
    }

    /// Checks the configuration against the device.
    pub fn check<R: Runtime>(&self, client: &ComputeClient<R>) -> Result<(), KernelError> {
        if self.vector_size == 0 || self.units_per_cube == 0 || self.items_per_unit == 0 {
            return Err(KernelError::Unsupported(format!(
                "{self:?} is not a valid tile"
            )));
        }
        launch::check_cube_fits(client, self.units_per_cube, 0)
    }
}

/// Checks a row-tiled launch of `rows` rows of `width` elements (every row
/// stride a multiple of `stride_multiple`) and returns its vector width and
/// items per row, or `None` when there is nothing to launch.
pub fn row_tile<R: Runtime>(
    client: &ComputeClient<R>,
    op: &str,
    rows: usize,
    width: usize,
    stride_multiple: usize,
    config: &TileLaunch,
) -> Result<Option<(usize, usize)>, KernelError> {
    config.check(client)?;
    let v = config.vector_size;
    if !width.is_multiple_of(v) || !stride_multiple.is_multiple_of(v) {
        return Err(KernelError::Unsupported(format!(
            "{op}: vector size {v} does not divide rows of {width} with strides a multiple of {stride_multiple}"
        )));
    }
    Ok((rows > 0).then_some((v, width / v)))
}

/// Every tile worth trying with vectors of `vector_size` elements, the
/// default first (256 units, two items each).
pub fn tile_candidates<R: Runtime>(
    client: &ComputeClient<R>,
    vector_size: usize,
) -> Vec<TileLaunch> {
    let mut out = Vec::new();
    for units_per_cube in [256u32, 128, 512] {
        for items_per_unit in [2u32, 1, 4] {
            let tile = TileLaunch {
                vector_size,
                units_per_cube,
                items_per_unit,
            };
            if tile.check(client).is_ok() {
                out.push(tile);
            }
        }
    }
    out
}

/// Tile lists per device and vector width: they depend on nothing else.
static TILES: CandidateCache<usize, TileLaunch> = CandidateCache::new();

/// Runs `launch` with the tile `tuner` picked for `key` among the tiles of
/// vectors of `vector_size` elements (memoized per device), tuning on first
/// use of the key.
#[allow(clippy::too_many_arguments)]
pub fn run_tiled<R: Runtime, K: OpKey, P, Buffers>(
    tuner: &'static Tuner<K>,
    key: K,
    vector_size: usize,
    launch: Launcher<R, P, Buffers, TileLaunch>,
    client: &ComputeClient<R>,
    device: &R::Device,
    problem: &P,
    buffers: &Buffers,
) -> Result<(), KernelError>
where
    P: Clone + Send + Sync + 'static,
    Buffers: Clone + Send + Sync + 'static,
{
    run_tiled_with(
        tuner,
        key,
        vector_size,
        launch,
        same_buffers,
        client,
        device,
        problem,
        buffers,
    )
}

/// [`run_tiled`] whose benchmark runs use the buffers `bench` makes (for
/// kernels that write over an input).
#[allow(clippy::too_many_arguments)]
pub fn run_tiled_with<R: Runtime, K: OpKey, P, Buffers>(
    tuner: &'static Tuner<K>,
    key: K,
    vector_size: usize,
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
    let id = cubecl::CubeTuneId::new(client, device);
    let tiles: Arc<Vec<TileLaunch>> =
        TILES.get(&id, vector_size, || tile_candidates(client, vector_size));
    run_tuned_with(
        tuner, key, launch, bench, client, &id, problem, buffers, tiles,
    )
}

/// The index of the `k`-th item of this unit.
#[cube]
pub fn tile_item(k: usize, #[comptime] tile: Tile) -> usize {
    CUBE_POS * (tile.units_per_cube * tile.items_per_unit) as usize
        + k * tile.units_per_cube as usize
        + UNIT_POS as usize
}

/// Rounds f32 values through `F` and back: what storing an intermediate in
/// the input dtype (as the eager reference does) does to it.
#[cube]
pub fn round_through<F: Float, N: Size>(v: Vector<f32, N>) -> Vector<f32, N> {
    Vector::cast_from(Vector::<F, N>::cast_from(v))
}

/// `1 / (1 + e^-x)`, lane by lane, in f32.
#[cube]
pub fn sigmoid<N: Size>(x: Vector<f32, N>) -> Vector<f32, N> {
    let one = Vector::<f32, N>::new(1.0);
    one / (one + neg(x).exp())
}

/// `−x` lane by lane (CUDA's vector types have no unary minus, so this is
/// `0 − x`).
#[cube]
pub fn neg<N: Size>(x: Vector<f32, N>) -> Vector<f32, N> {
    Vector::<f32, N>::new(0.0) - x
}

/// The size class of an element-wise problem for its autotune key: the item
/// count rounded up to a power of two.
pub fn items_bucket(items: usize) -> usize {
    items.max(1).next_power_of_two()
}
