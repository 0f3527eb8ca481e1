//! The expert grouping's kernel launches on `CubeBackend`.

use burn::tensor::{DType, Element, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::cast;
use burn_cubecl::tensor::CubeTensor;

use bastile_cubecl::expert_groups::{
    self, ExpertOrderBuffers, ExpertOrderProblem, ExpertRowsBuffers, ExpertRowsProblem,
};

use super::{ExpertOrder, ExpertRows};
use crate::fused::cube::{contiguous_i32, empty_like};
use crate::fused::{kernel, unpack};
use crate::launch_failure::launch;

/// A new i32 vector of `len` values on `like`'s device.
fn ints<R: CubeRuntime>(like: &CubeTensor<R>, len: usize) -> CubeTensor<R> {
    empty_like(like, Shape::new([len]), DType::I32)
}

kernel!(ExpertOrder, "bastile_expert_order", |op, _, ints_in| {
    let [chosen] = unpack(ints_in);
    let chosen = contiguous_i32(chosen);
    let counts = ints(&chosen, op.experts);
    let order = ints(&chosen, op.experts * op.per_expert);
    let problem = ExpertOrderProblem {
        slots: chosen.shape().num_elements(),
        experts: op.experts,
        per_expert: op.per_expert,
    };
    let buffers = ExpertOrderBuffers {
        chosen: chosen.handle.clone(),
        counts: counts.handle.clone(),
        order: order.handle.clone(),
    };
    launch("expert order", || {
        expert_groups::expert_order(&chosen.client, &problem, &buffers)
    });
    let dtype = <I as Element>::dtype();
    vec![cast(counts, dtype), cast(order, dtype)]
});

kernel!(ExpertRows, "bastile_expert_rows", |op, _, ints_in| {
    let [order, counts] = unpack(ints_in);
    let (order, counts) = (contiguous_i32(order), contiguous_i32(counts));
    let experts = counts.shape()[0];
    let rows = experts * op.capacity;
    let token_of_row = ints(&order, rows);
    let slot_of_row = ints(&order, rows);
    let row_of_slot = ints(&order, op.slots);
    let problem = ExpertRowsProblem {
        slots: op.slots,
        experts,
        per_expert: op.per_expert,
        capacity: op.capacity,
        top_k: op.top_k,
    };
    let buffers = ExpertRowsBuffers {
        order: order.handle.clone(),
        counts: counts.handle.clone(),
        token_of_row: token_of_row.handle.clone(),
        slot_of_row: slot_of_row.handle.clone(),
        row_of_slot: row_of_slot.handle.clone(),
    };
    launch("expert rows", || {
        expert_groups::expert_rows(&order.client, &problem, &buffers)
    });
    let dtype = <I as Element>::dtype();
    [token_of_row, slot_of_row, row_of_slot]
        .into_iter()
        .map(|t| cast(t, dtype))
        .collect()
});
