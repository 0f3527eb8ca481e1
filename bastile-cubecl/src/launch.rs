//! Launch-geometry helpers shared by every kernel: plane size, vector width,
//! grids larger than one dimension allows.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::{FloatDtype, KernelError};

/// An error when `n` of `what` do not fit the kernels' i32 indices.
pub fn check_i32(what: &str, n: usize) -> Result<(), KernelError> {
    if n > i32::MAX as usize {
        return Err(KernelError::Shape(format!(
            "{n} {what} do not fit the i32 indices"
        )));
    }
    Ok(())
}

/// `len` values of `handle` as a 1-D tensor argument (a launch declares
/// at least one element).
///
/// # Safety
///
/// `handle` holds `len` values of the kernel's element type (the kernel
/// reads none of an empty one).
pub unsafe fn flat_arg<R: Runtime>(handle: &Handle, len: usize) -> TensorArg<R> {
    unsafe { TensorArg::from_raw_parts(handle.clone(), [1].into(), [len.max(1)].into()) }
}

/// That `handle` holds `elements` values of `bytes` each: what a launch
/// reads or writes there, checked before it is queued (a kernel indexes
/// its buffers unchecked).
pub fn check_holds(
    what: &str,
    handle: &Handle,
    elements: usize,
    bytes: usize,
) -> Result<(), KernelError> {
    let needed = elements as u64 * bytes as u64;
    if handle.size_in_used() < needed {
        return Err(KernelError::Shape(format!(
            "{what}: its buffer holds {} bytes, fewer than {elements} values of {bytes} bytes",
            handle.size_in_used()
        )));
    }
    Ok(())
}

/// The plane (warp / subgroup) sizes this client may run with, read from the
/// runtime: 32 on NVIDIA GPUs, 8 on Mesa's lavapipe, a range on some Vulkan
/// devices. Kernels size their per-row unit counts as multiples of the
/// maximum, so any plane size in the range divides them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlaneSizes {
    pub min: u32,
    pub max: u32,
    /// Whether the runtime supports plane-wide reductions at all.
    pub ops: bool,
}

/// Reads the plane sizes and plane-op support of a client.
pub fn plane_sizes<R: Runtime>(client: &ComputeClient<R>) -> PlaneSizes {
    let hw = &client.properties().hardware;
    let ops = client
        .properties()
        .features
        .plane
        .contains(cubecl::ir::features::Plane::Ops);
    PlaneSizes {
        min: hw.plane_size_min.max(1),
        max: hw.plane_size_max.max(1),
        ops: ops && hw.plane_size_min >= 1,
    }
}

/// The widest vector (in elements) that divides `len`, that the runtime
/// loads efficiently for `dtype`, and that is at most 16 bytes.
pub fn vector_size<R: Runtime>(client: &ComputeClient<R>, dtype: FloatDtype, len: usize) -> usize {
    client
        .io_optimized_vector_sizes(dtype.size())
        .filter(|&v| v > 0 && len.is_multiple_of(v) && v * dtype.size() <= 16)
        .max()
        .unwrap_or(1)
}

/// A cube count for `cubes` cubes that respects the per-axis limit of the
/// device; kernels recover the linear cube index from `CUBE_POS`.
pub fn cube_count<R: Runtime>(
    client: &ComputeClient<R>,
    cubes: usize,
) -> Result<CubeCount, KernelError> {
    let (max_x, max_y, _) = client.properties().hardware.max_cube_count;
    let max_x = max_x.max(1) as usize;
    let x = cubes.clamp(1, max_x);
    let y = cubes.div_ceil(x);
    if y > max_y as usize {
        return Err(KernelError::Unsupported(format!(
            "{cubes} cubes exceed the device's grid limit"
        )));
    }
    Ok(CubeCount::Static(x as u32, y as u32, 1))
}

/// Number of streaming multiprocessors (or CPU cores) the device reports,
/// used to size persistent grids. Falls back to a modest default.
pub fn parallel_units<R: Runtime>(client: &ComputeClient<R>) -> usize {
    let hw = &client.properties().hardware;
    hw.num_streaming_multiprocessors
        .or(hw.num_cpu_cores)
        .unwrap_or(16)
        .max(1) as usize
}

/// Checks that a cube of `units` units and `shared_bytes` bytes of shared
/// memory fits the device.
pub fn check_cube_fits<R: Runtime>(
    client: &ComputeClient<R>,
    units: u32,
    shared_bytes: usize,
) -> Result<(), KernelError> {
    let hw = &client.properties().hardware;
    if units > hw.max_units_per_cube {
        return Err(KernelError::Unsupported(format!(
            "{units} units per cube exceed the device limit of {}",
            hw.max_units_per_cube
        )));
    }
    if shared_bytes > hw.max_shared_memory_size {
        return Err(KernelError::Unsupported(format!(
            "{shared_bytes} bytes of shared memory exceed the device limit of {}",
            hw.max_shared_memory_size
        )));
    }
    Ok(())
}

/// Greatest common divisor, for row strides and vector widths.
pub fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}
