//! Reductions shared by the row-wise kernels: the sum (or maximum) over the
//! units that share one row, and the column sum that finishes a two-stage parameter
//! gradient.

use cubecl::prelude::*;

use crate::{FloatDtype, KernelError, launch};

/// How the units that share a row combine their partial sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum RowReduce {
    /// Plane (warp) shuffles, then one shared-memory slot per plane.
    Plane,
    /// A shared-memory tree over all units of the row.
    Shared,
}

/// Shared-memory words [`row_sum()`] needs for `rows_per_cube` rows of
/// `units_per_row` units.
pub fn row_sum_scratch(
    reduce: RowReduce,
    units_per_row: u32,
    rows_per_cube: u32,
    plane_min: u32,
) -> usize {
    let per_row = match reduce {
        RowReduce::Plane => units_per_row.div_ceil(plane_min),
        RowReduce::Shared => units_per_row,
    };
    (per_row * rows_per_cube) as usize
}

/// How the units of a cube that holds one row combine their sums on a
/// client, with the scratch words [`row_sum()`] needs for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CubeRowSum {
    pub reduce: RowReduce,
    pub slots: u32,
}

/// The reduction for one row of `units` units per cube: plane shuffles
/// where the runtime has them and `units` is a multiple of the plane size,
/// else a shared-memory tree; an error when the cube does not fit.
pub fn cube_row_sum<R: Runtime>(
    client: &ComputeClient<R>,
    units: u32,
) -> Result<CubeRowSum, KernelError> {
    let planes = launch::plane_sizes(client);
    let reduce = if planes.ops && units.is_multiple_of(planes.max) {
        RowReduce::Plane
    } else {
        RowReduce::Shared
    };
    let slots = row_sum_scratch(reduce, units, 1, planes.min);
    launch::check_cube_fits(client, units, slots * 4)?;
    Ok(CubeRowSum {
        reduce,
        slots: slots as u32,
    })
}

/// Sums `value` over the `units_per_row` units along X that share the row
/// slot `UNIT_POS_Y`. Every unit of the cube must call it: it synchronizes
/// the cube. `scratch` holds [`row_sum_scratch`] words.
///
/// With [`RowReduce::Plane`], `units_per_row` must be a multiple of the
/// plane size, so that no plane straddles two rows; the number of planes per
/// row is computed from `PLANE_DIM` at run time, never assumed.
#[cube]
pub fn row_sum(
    value: f32,
    scratch: &mut SharedMemory<f32>,
    #[comptime] units_per_row: u32,
    #[comptime] slots_per_row: u32,
    #[comptime] reduce: RowReduce,
) -> f32 {
    row_combine(value, scratch, units_per_row, slots_per_row, reduce, false)
}

/// The maximum of `value` over the units that share a row; the same
/// contract as [`row_sum()`].
#[cube]
pub fn row_max(
    value: f32,
    scratch: &mut SharedMemory<f32>,
    #[comptime] units_per_row: u32,
    #[comptime] slots_per_row: u32,
    #[comptime] reduce: RowReduce,
) -> f32 {
    row_combine(value, scratch, units_per_row, slots_per_row, reduce, true)
}

/// Sum of the lanes of a vector.
#[cube]
pub fn lane_sum<N: Size>(v: Vector<f32, N>) -> f32 {
    let mut total = 0.0f32;
    #[unroll]
    for i in 0..v.size() {
        total += v[i];
    }
    total
}

/// `a + b`, or `max(a, b)` when `max`.
#[cube]
fn combine(a: f32, b: f32, #[comptime] max: bool) -> f32 {
    if comptime![max] {
        f32::max(a, b)
    } else {
        a + b
    }
}

#[cube]
fn row_combine(
    value: f32,
    scratch: &mut SharedMemory<f32>,
    #[comptime] units_per_row: u32,
    #[comptime] slots_per_row: u32,
    #[comptime] reduce: RowReduce,
    #[comptime] max: bool,
) -> f32 {
    let slot = UNIT_POS_Y as usize * slots_per_row as usize;
    let x = UNIT_POS_X as usize;
    let mut total = comptime![if max { f32::MIN } else { 0.0f32 }].runtime();
    if comptime![reduce == RowReduce::Plane] {
        let plane_total = if comptime![max] {
            plane_max(value)
        } else {
            plane_sum(value)
        };
        let plane_dim = PLANE_DIM as usize;
        if UNIT_POS_PLANE == 0 {
            scratch[slot + x / plane_dim] = plane_total;
        }
        sync_cube();
        let planes = units_per_row as usize / plane_dim;
        for p in 0..planes {
            total = combine(total, scratch[slot + p], max);
        }
    } else {
        scratch[slot + x] = value;
        sync_cube();
        let mut stride = comptime![(units_per_row / 2) as usize].runtime();
        while stride > 0 {
            if x < stride {
                let other = scratch[slot + x + stride];
                scratch[slot + x] = combine(scratch[slot + x], other, max);
            }
            sync_cube();
            stride /= 2;
        }
        total = scratch[slot];
    }
    // The scratch is reused by the next call: nobody may overwrite it before
    // every unit has read its total.
    sync_cube();
    total
}

/// Units per cube of [`column_sum`]: enough row lanes to keep many loads
/// in flight when the columns are few.
const COLUMN_SUM_UNITS: usize = 256;

/// Sums the rows of an f32 `[rows, cols]` matrix of partials into `cols`
/// values cast to `F`: the second stage of a parameter-gradient reduction,
/// deterministic and in f32 whatever the output dtype.
///
/// A cube holds `CUBE_DIM_X` neighbouring column vectors (a row's loads
/// are one segment) and `CUBE_DIM_Y` row lanes, a power of two; lane `l`
/// sums rows `l`, `l + CUBE_DIM_Y`, ..., then a shared-memory tree adds the
/// lanes in a fixed order. The lanes are what keeps loads in flight: the
/// partials have a few hundred rows (a few per multiprocessor) and the
/// columns can be few, e.g. 256 vectors for a 1024-wide gradient, 32 for a
/// 128-wide one.
#[cube(launch_unchecked)]
fn column_sum_kernel<F: Float, N: Size>(
    partials: &Tensor<Vector<f32, N>>,
    output: &mut Tensor<Vector<F, N>>,
    rows: usize,
    col_vecs: usize,
    #[comptime] units: usize,
    #[define(F)] _dtype: StorageType,
) {
    let width = CUBE_DIM_X as usize;
    let lanes = CUBE_DIM_Y as usize;
    let x = UNIT_POS_X as usize;
    let lane = UNIT_POS_Y as usize;
    let col = CUBE_POS * width + x;
    let mut acc = Vector::<f32, N>::new(0.0);
    if col < col_vecs {
        let mut r = lane;
        while r < rows {
            acc += partials[r * col_vecs + col];
            r += lanes;
        }
    }
    let mut lane_sums = SharedMemory::<Vector<f32, N>>::new(units);
    let slot = lane * width + x;
    lane_sums[slot] = acc;
    sync_cube();
    let mut stride = lanes / 2;
    while stride > 0 {
        if lane < stride {
            let other = lane_sums[slot + stride * width];
            lane_sums[slot] += other;
        }
        sync_cube();
        stride /= 2;
    }
    if lane == 0 && col < col_vecs {
        output[col] = Vector::cast_from(lane_sums[x]);
    }
}

/// Launches the column sum of `partials` (f32, `[rows, cols]`, contiguous)
/// into `output` (`cols` elements of `dtype`).
pub fn column_sum<R: Runtime>(
    client: &ComputeClient<R>,
    partials: &cubecl::server::Handle,
    output: &cubecl::server::Handle,
    rows: usize,
    cols: usize,
    dtype: FloatDtype,
) -> Result<(), KernelError> {
    let vec = launch::vector_size(client, FloatDtype::F32, cols)
        .min(launch::vector_size(client, dtype, cols));
    let col_vecs = cols / vec;
    let max_units = COLUMN_SUM_UNITS
        .min(client.properties().hardware.max_units_per_cube as usize)
        .max(1);
    // Powers of two: the lanes' tree halves them. Eight neighbouring f32
    // vectors are one 128-byte line of a row; the rest of the cube goes
    // to lanes, so a 1024-wide gradient gets 32 cubes of 32 lanes.
    let max_units = 1 << max_units.ilog2();
    let width = col_vecs.next_power_of_two().clamp(1, 8).min(max_units);
    let lanes = (max_units / width).min(rows.next_power_of_two()).max(1);
    let units = width * lanes;
    launch::check_cube_fits(client, units as u32, units * vec * 4)?;
    let cubes = col_vecs.div_ceil(width);
    let count = launch::cube_count(client, cubes)?;
    unsafe {
        column_sum_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_2d(width as u32, lanes as u32),
            vec,
            TensorArg::from_raw_parts(partials.clone(), [cols, 1].into(), [rows, cols].into()),
            launch::flat_arg(output, cols),
            rows,
            col_vecs,
            units,
            dtype.storage(),
        )
    }
    Ok(())
}
