//! The float dtypes the kernels are compiled for.

use cubecl::ir::{ElemType, FloatKind, StorageType};

/// A floating-point element type a Bastile kernel can be compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum FloatDtype {
    F32,
    F16,
    BF16,
}

impl FloatDtype {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            FloatDtype::F32 => 4,
            FloatDtype::F16 | FloatDtype::BF16 => 2,
        }
    }

    /// The CubeCL storage type that defines the kernels' generic float `F`.
    pub fn storage(self) -> StorageType {
        let kind = match self {
            FloatDtype::F32 => FloatKind::F32,
            FloatDtype::F16 => FloatKind::F16,
            FloatDtype::BF16 => FloatKind::BF16,
        };
        StorageType::Scalar(ElemType::Float(kind))
    }
}

impl core::fmt::Display for FloatDtype {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            FloatDtype::F32 => "f32",
            FloatDtype::F16 => "f16",
            FloatDtype::BF16 => "bf16",
        })
    }
}
