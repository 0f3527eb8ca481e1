//! Row-strided matrices: the buffer layout every kernel takes.

use cubecl::prelude::*;
use cubecl::server::Handle;

/// A matrix of `rows × hidden` elements whose rows start `stride` elements
/// apart (`stride >= hidden`), unit stride within a row.
#[derive(Clone, Debug)]
pub struct Rows {
    pub handle: Handle,
    pub stride: usize,
}

impl Rows {
    /// Densely packed rows of `hidden` elements.
    pub fn dense(handle: Handle, hidden: usize) -> Self {
        Self {
            handle,
            stride: hidden,
        }
    }

    pub(crate) fn arg<R: Runtime>(&self, rows: usize, hidden: usize) -> TensorArg<R> {
        assert!(
            self.stride >= hidden,
            "row stride {} shorter than a row of {hidden}",
            self.stride
        );
        unsafe {
            TensorArg::from_raw_parts(
                self.handle.clone(),
                vec![self.stride, 1].into(),
                vec![rows, hidden].into(),
            )
        }
    }

    /// The stride in vectors of `vector_size` elements.
    pub(crate) fn stride_vecs(&self, vector_size: usize) -> usize {
        assert!(
            self.stride.is_multiple_of(vector_size),
            "row stride not a multiple of the vector width"
        );
        self.stride / vector_size
    }
}

/// A dense `rows × cols` matrix as a kernel argument.
pub(crate) fn tensor_arg<R: Runtime>(handle: &Handle, rows: usize, cols: usize) -> TensorArg<R> {
    Rows::dense(handle.clone(), cols).arg(rows, cols)
}
