//! What the kernel launches on `CubeBackend` share: laying tensors out as
//! the kernels take them (copying only when their strides do not allow it)
//! and allocating outputs.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::reshape;
use burn_cubecl::tensor::CubeTensor;
use burn_std::{Metadata, Strides};

use bastile_cubecl::launch::gcd;
use bastile_cubecl::rows::Rows;

/// `(rows, row stride)` when the tensor is a stack of unit-stride rows of
/// its last dimension, evenly spaced (CubeCL's optimized layouts pad the
/// row pitch, so the stride can exceed the row length).
pub(crate) fn row_layout(shape: &Shape, strides: &[usize]) -> Option<(usize, usize)> {
    let d = shape.num_dims();
    let hidden = shape[d - 1];
    if hidden > 1 && strides[d - 1] != 1 {
        return None;
    }
    let rows = shape.num_elements() / hidden.max(1);
    let mut pitch = None;
    let mut expected = 0;
    for i in (0..d - 1).rev().filter(|&i| shape[i] > 1) {
        match pitch {
            None => {
                pitch = Some(strides[i]);
                expected = strides[i] * shape[i];
            }
            Some(_) if strides[i] != expected => return None,
            Some(_) => expected *= shape[i],
        }
    }
    let pitch = pitch.unwrap_or(hidden);
    (pitch >= hidden).then_some((rows, pitch))
}

/// The row alignment (in elements) the kernels are promised: 16 bytes, or
/// less when `hidden` itself is not a multiple of that.
pub(crate) fn row_alignment(hidden: usize, elem_size: usize) -> usize {
    gcd(hidden, 16 / elem_size)
}

/// Where the tensor's data starts in its buffer, in elements (views made
/// by slicing start past the beginning).
pub(crate) fn offset_elems<R: CubeRuntime>(t: &CubeTensor<R>) -> usize {
    t.handle.offset_start.unwrap_or(0) as usize / t.dtype.size()
}

/// The tensor as evenly spaced, aligned rows; copied into a fresh layout
/// only when its strides or start do not allow that.
pub(crate) fn as_rows<R: CubeRuntime>(t: CubeTensor<R>) -> (CubeTensor<R>, Rows) {
    let shape = t.shape();
    let align = row_alignment(*shape.last().expect("rank >= 1"), t.dtype.size());
    let aligned = |t: &CubeTensor<R>| {
        row_layout(&t.shape(), t.meta.strides())
            .filter(|&(_, stride)| stride.is_multiple_of(align))
            .filter(|_| offset_elems(t).is_multiple_of(align))
    };
    let t = if aligned(&t).is_some() {
        t
    } else {
        into_contiguous(t)
    };
    let (_, stride) = aligned(&t).expect("a contiguous copy is aligned, evenly spaced rows");
    let rows = Rows {
        handle: t.handle.clone(),
        stride,
    };
    (t, rows)
}

/// `(rows, row length)` of a tensor seen as rows of its last dimension.
pub(crate) fn rows_cols(shape: &Shape) -> (usize, usize) {
    let cols = *shape.last().expect("validated rank >= 1");
    (shape.num_elements() / cols.max(1), cols)
}

/// The gcd of `width` and every row stride: bounds the vector width.
pub(crate) fn stride_multiple(width: usize, rows: &[&Rows]) -> usize {
    rows.iter().fold(width, |g, r| gcd(g, r.stride))
}

/// An int tensor (labels, key lengths) as contiguous i32, what the kernels
/// read.
pub(crate) fn contiguous_i32<R: CubeRuntime>(ints: CubeTensor<R>) -> CubeTensor<R> {
    let ints = if ints.dtype == DType::I32 {
        ints
    } else {
        cast(ints, DType::I32)
    };
    into_contiguous(ints)
}

/// A new contiguous tensor on `x`'s device. Contiguous rather than
/// CubeCL's default pitched layout (rows padded to up to 512 bytes: 2880
/// bf16 columns take 3072), which Burn's reshapes and the optimizer would
/// copy back to contiguous.
pub(crate) fn empty_like<R: CubeRuntime>(
    x: &CubeTensor<R>,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_contiguous_dtype(x.client.clone(), x.device.clone(), shape, dtype)
}

/// `t` with another shape and strides over the same buffer.
pub(crate) fn view<R: CubeRuntime>(
    t: &CubeTensor<R>,
    shape: &[usize],
    strides: &[usize],
) -> CubeTensor<R> {
    CubeTensor::new(
        t.client.clone(),
        t.handle.clone(),
        Metadata::new(Shape::from(shape.to_vec()), Strides::new(strides)),
        t.device.clone(),
        t.dtype,
    )
}

/// The tensor as the matrix of its last dimension's rows, `[rows, last]`:
/// a view when its rows are evenly spaced (a pitched layout included,
/// which Burn's reshape would copy), else a reshape.
pub(crate) fn rows_view<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    let shape = t.shape();
    let (rows, last) = rows_cols(&shape);
    match row_layout(&shape, t.meta.strides()) {
        Some((_, pitch)) if shape.num_dims() != 2 || pitch != t.meta.strides()[0] => {
            view(&t, &[rows, last], &[pitch, 1])
        }
        Some(_) => t,
        None => reshape(t, Shape::new([rows, last])),
    }
}
