//! The reductions' launches on `CubeBackend`: Burn's reduce kernels
//! (`cubek`) with one strategy per problem.

use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::reduce::{KernelReduceStrategy, reduce_dim};
use burn_cubecl::tensor::CubeTensor;
use cubek::reduce::ReduceStrategy;
use cubek::reduce::components::instructions::ReduceOperationConfig;
use cubek::reduce::launch::{RoutineStrategy, VectorizationStrategy};
use cubek::reduce::routines::BlueprintStrategy;
use cubek::reduce::routines::cube::CubeStrategy;
use cubek::reduce::routines::plane::PlaneStrategy;
use cubek::reduce::routines::unit::UnitStrategy;

use super::{IntReduceDim, ReduceDim, Reduction};
use crate::fused::cube::empty_like;
use crate::fused::{kernel, unpack};
use crate::launch_failure::failed;

kernel!(ReduceDim, "bastile_reduce_dim", |op, floats, _| {
    let [x] = unpack(floats);
    vec![reduce(x, op.reduction, op.dim)]
});

kernel!(IntReduceDim, "bastile_int_reduce_dim", |op, _, ints| {
    let [x] = unpack(ints);
    vec![reduce(x, op.reduction, op.dim)]
});

/// Reductions this short run one unit per output; longer ones one plane
/// per output, or a whole cube where there are too few outputs to fill
/// the GPU with planes.
const UNIT_LENGTH: usize = 64;
const CUBE_OUTPUTS: usize = 256;

/// The launch strategy for reducing `length` elements into each of
/// `outputs` values. Burn's tuner, timing every strategy on an H100 for
/// the reductions of Qwen3, Llama and GPT-OSS training steps, picked one
/// unit per output for reductions over the few top-k logits or experts, a
/// plane per output for rows of the hidden size, and whole cubes for the
/// reductions with at most a few hundred outputs.
pub(crate) fn strategy(length: usize, outputs: usize) -> ReduceStrategy {
    let routine = if length <= UNIT_LENGTH {
        RoutineStrategy::Unit(BlueprintStrategy::Inferred(UnitStrategy))
    } else if outputs <= CUBE_OUTPUTS {
        RoutineStrategy::Cube(BlueprintStrategy::Inferred(CubeStrategy {
            use_planes: true,
        }))
    } else {
        RoutineStrategy::Plane(BlueprintStrategy::Inferred(PlaneStrategy {
            independent: true,
        }))
    };
    ReduceStrategy {
        routine,
        vectorization: VectorizationStrategy {
            parallel_output_vectorization: false,
        },
    }
}

/// `x` (floats or ints) reduced over `dim` with the strategy for its
/// shape.
fn reduce<R: CubeRuntime>(x: CubeTensor<R>, reduction: Reduction, dim: usize) -> CubeTensor<R> {
    let shape = x.shape();
    let length = shape[dim];
    let outputs = shape.num_elements() / length.max(1);
    let config = match reduction {
        Reduction::Sum => ReduceOperationConfig::Sum,
        Reduction::Mean => ReduceOperationConfig::Mean,
        Reduction::Max => ReduceOperationConfig::Max,
        Reduction::Min => ReduceOperationConfig::Min,
    };
    let chosen = KernelReduceStrategy::Specific(strategy(length, outputs));
    match reduce_dim::<R>(x.clone(), None, dim, chosen, config) {
        Ok(y) => y,
        // A device without planes (or too small for the strategy's cube)
        // takes one unit per output, which every device runs.
        Err(_) => {
            let unit = KernelReduceStrategy::Specific(strategy(0, outputs));
            match reduce_dim::<R>(x.clone(), None, dim, unit, config) {
                Ok(y) => y,
                Err(e) => {
                    failed("reduction", e);
                    let mut dims = shape.to_vec();
                    dims[dim] = 1;
                    empty_like(&x, dims.into(), x.dtype)
                }
            }
        }
    }
}
