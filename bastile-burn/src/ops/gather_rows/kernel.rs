//! The row gather's backward kernel launch on `CubeBackend`.

use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::gather::{self, GatherSumBuffers, GatherSumProblem};

use super::GatherRowsBack;
use crate::fused::cube::{as_rows, contiguous_i32, empty_like, rows_cols, stride_multiple};
use crate::fused::{kernel, kernel_dtype};
use crate::launch_failure::launch;

kernel!(
    GatherRowsBack,
    "bastile_gather_rows_back",
    |_, mut floats, mut ints| {
        let dout = floats.pop().expect("the output gradient");
        vec![gather_back(dout, ints.pop().expect("the sources"))]
    }
);

/// For every row of `sources` (`[rows, copies]`), the sum of the rows of
/// `dout` its entries name (an entry equal to `dout`'s row count names
/// none).
fn gather_back<R: CubeRuntime>(dout: CubeTensor<R>, sources: CubeTensor<R>) -> CubeTensor<R> {
    let [rows, copies] = [sources.shape()[0], sources.shape()[1]];
    let sources = contiguous_i32(sources);
    let (dout, dout_rows) = as_rows(dout);
    let (src_rows, hidden) = rows_cols(&dout.shape());
    let (dx, dx_rows) = as_rows(empty_like(&dout, Shape::new([rows, hidden]), dout.dtype));
    let problem = GatherSumProblem {
        rows,
        copies,
        src_rows,
        hidden,
        dtype: kernel_dtype(dout.dtype).expect("validated dtype"),
        stride_multiple: stride_multiple(hidden, &[&dout_rows, &dx_rows]),
    };
    let buffers = GatherSumBuffers {
        src: dout_rows,
        index: sources.handle.clone(),
        out: dx_rows,
    };
    launch("gathered rows' gradient", || {
        gather::gather_sum(&dout.client, &problem, &buffers)
    });
    dx
}
