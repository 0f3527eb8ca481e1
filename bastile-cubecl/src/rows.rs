//! Row-strided matrices: the buffer layout every kernel takes.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::{FloatDtype, KernelError, launch};

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

    /// That `rows` rows of `hidden` values of `dtype` fit: a stride at
    /// least a row, a multiple of `multiple` (what the launch's vector
    /// width assumes), and a buffer that reaches the last row's end.
    pub(crate) fn check(
        &self,
        what: &str,
        rows: usize,
        hidden: usize,
        multiple: usize,
        dtype: FloatDtype,
    ) -> Result<(), KernelError> {
        if self.stride < hidden || !self.stride.is_multiple_of(multiple.max(1)) {
            return Err(KernelError::Shape(format!(
                "{what}: a row stride of {} for rows of {hidden} (the stride must hold a row and \
                 be a multiple of {multiple})",
                self.stride
            )));
        }
        let extent = if rows == 0 {
            0
        } else {
            (rows - 1) * self.stride + hidden
        };
        launch::check_holds(what, &self.handle, extent, dtype.size())
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
