//! A mixture of experts' token-expert assignments grouped by expert on the
//! device, so that only the group sizes are read back to the host.
//!
//! The assignments are the router's choices flattened: assignment (slot)
//! `s` is token `s / top_k`'s `s % top_k`-th expert. Two launches:
//!
//! - [`expert_order`]: for every expert, its assignments in slot order and
//!   their count. One cube per expert: each unit counts the expert's
//!   assignments in its own contiguous run of slots, one exclusive scan
//!   over the units places every run, and each unit writes its matches in
//!   order. The result is deterministic and stable (slot order within an
//!   expert), with no atomics.
//! - [`expert_rows`]: once the host has read the counts and chosen a
//!   capacity (the rows every group is padded to), the row of every
//!   assignment, and the token and assignment of every row: one unit per
//!   row.

use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::{KernelError, launch};

/// Units per cube.
const UNITS: u32 = 256;

/// The shape of an [`expert_order`] launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertOrderProblem {
    /// Token-expert assignments (tokens × top-k).
    pub slots: usize,
    pub experts: usize,
    /// The assignments an expert's list has room for (the tokens: an
    /// expert takes each token at most once). Counts are exact beyond it;
    /// the list keeps the first `per_expert`.
    pub per_expert: usize,
}

/// The buffers of an [`expert_order`] launch, all i32.
#[derive(Clone, Debug)]
pub struct ExpertOrderBuffers {
    /// `slots` experts, one per assignment; a value outside `0..experts`
    /// belongs to no expert.
    pub chosen: Handle,
    /// `experts` counts, written.
    pub counts: Handle,
    /// `experts × per_expert`, written: expert `e`'s assignments in slot
    /// order, then `slots` (no assignment) up to `per_expert`.
    pub order: Handle,
}

/// Writes every expert's assignments in slot order and their count.
pub fn expert_order<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &ExpertOrderProblem,
    buffers: &ExpertOrderBuffers,
) -> Result<(), KernelError> {
    let p = problem;
    launch::check_i32("assignments", p.slots)?;
    launch::check_i32("experts", p.experts)?;
    launch::check_holds("chosen experts", &buffers.chosen, p.slots, 4)?;
    launch::check_holds("expert counts", &buffers.counts, p.experts, 4)?;
    launch::check_holds("expert order", &buffers.order, p.experts * p.per_expert, 4)?;
    if p.experts == 0 {
        return Ok(());
    }
    let span = p.slots.div_ceil(UNITS as usize);
    unsafe {
        expert_order_kernel::launch_unchecked::<R>(
            client,
            launch::cube_count(client, p.experts)?,
            CubeDim::new_1d(UNITS),
            launch::flat_arg(&buffers.chosen, p.slots),
            launch::flat_arg(&buffers.counts, p.experts),
            launch::flat_arg(&buffers.order, p.experts * p.per_expert),
            p.slots,
            p.experts,
            p.per_expert,
            span,
        )
    };
    Ok(())
}

/// The shape of an [`expert_rows`] launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertRowsProblem {
    /// Token-expert assignments (tokens × top-k).
    pub slots: usize,
    pub experts: usize,
    /// The room of each expert's list in the order (as it was written).
    pub per_expert: usize,
    /// The rows every expert's group is padded to: no smaller than any
    /// count, or the assignments past it get no row.
    pub capacity: usize,
    /// Assignments per token.
    pub top_k: usize,
}

/// The buffers of an [`expert_rows`] launch, all i32.
#[derive(Clone, Debug)]
pub struct ExpertRowsBuffers {
    /// `experts × per_expert`, as [`expert_order`] wrote it.
    pub order: Handle,
    /// `experts` counts, as [`expert_order`] wrote them.
    pub counts: Handle,
    /// `experts × capacity`, written: the token each row copies (row
    /// `e · capacity + i` holds expert `e`'s `i`-th assignment), 0 for the
    /// rows past a group's count (padding).
    pub token_of_row: Handle,
    /// `experts × capacity`, written: the assignment each row holds,
    /// `slots` for the padding.
    pub slot_of_row: Handle,
    /// `slots`, written: the row of every assignment.
    pub row_of_slot: Handle,
}

/// Writes the rows of the groups padded to `capacity`: which token and
/// assignment each row holds, and each assignment's row.
pub fn expert_rows<R: Runtime>(
    client: &ComputeClient<R>,
    problem: &ExpertRowsProblem,
    buffers: &ExpertRowsBuffers,
) -> Result<(), KernelError> {
    let p = problem;
    if p.top_k == 0 {
        return Err(KernelError::Shape(
            "expert rows take a positive top-k".into(),
        ));
    }
    let rows = p.experts * p.capacity;
    launch::check_i32("assignments", p.slots)?;
    launch::check_i32("group rows", rows)?;
    let order_len = p.experts * p.per_expert;
    launch::check_holds("expert order", &buffers.order, order_len, 4)?;
    launch::check_holds("expert counts", &buffers.counts, p.experts, 4)?;
    launch::check_holds("token of each row", &buffers.token_of_row, rows, 4)?;
    launch::check_holds("assignment of each row", &buffers.slot_of_row, rows, 4)?;
    launch::check_holds("row of each assignment", &buffers.row_of_slot, p.slots, 4)?;
    if rows == 0 {
        return Ok(());
    }
    unsafe {
        expert_rows_kernel::launch_unchecked::<R>(
            client,
            launch::cube_count(client, rows.div_ceil(UNITS as usize))?,
            CubeDim::new_1d(UNITS),
            launch::flat_arg(&buffers.order, order_len),
            launch::flat_arg(&buffers.counts, p.experts),
            launch::flat_arg(&buffers.token_of_row, rows),
            launch::flat_arg(&buffers.slot_of_row, rows),
            launch::flat_arg(&buffers.row_of_slot, p.slots),
            p.slots,
            rows,
            p.per_expert,
            p.capacity,
            p.top_k,
        )
    };
    Ok(())
}

#[cube(launch_unchecked)]
fn expert_order_kernel(
    chosen: &Tensor<i32>,
    counts: &mut Tensor<i32>,
    order: &mut Tensor<i32>,
    slots: usize,
    experts: usize,
    per_expert: usize,
    span: usize,
) {
    let expert = CUBE_POS;
    // The whole cube takes the branch or skips it: the scan's barriers
    // are uniform.
    if expert < experts {
        let unit = UNIT_POS as usize;
        let wanted = i32::cast_from(expert);
        let start = usize::min(unit * span, slots);
        let end = usize::min(start + span, slots);
        let mut mine = 0u32;
        for s in start..end {
            if chosen[s] == wanted {
                mine += 1;
            }
        }
        // Inclusive scan of the units' counts (Hillis-Steele: each step
        // reads, then every unit writes after the barrier).
        let mut scan = SharedMemory::<u32>::new(UNITS as usize);
        scan[unit] = mine;
        sync_cube();
        let mut offset = 1usize;
        while offset < UNITS as usize {
            let mut add = 0u32;
            if unit >= offset {
                add = scan[unit - offset];
            }
            sync_cube();
            scan[unit] += add;
            sync_cube();
            offset *= 2;
        }
        let total = scan[UNITS as usize - 1] as usize;
        let base = expert * per_expert;
        let mut at = (scan[unit] - mine) as usize;
        for s in start..end {
            if chosen[s] == wanted {
                if at < per_expert {
                    order[base + at] = i32::cast_from(s);
                }
                at += 1;
            }
        }
        let mut rest = total + unit;
        while rest < per_expert {
            order[base + rest] = i32::cast_from(slots);
            rest += UNITS as usize;
        }
        if unit == 0 {
            counts[expert] = i32::cast_from(total);
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn expert_rows_kernel(
    order: &Tensor<i32>,
    counts: &Tensor<i32>,
    token_of_row: &mut Tensor<i32>,
    slot_of_row: &mut Tensor<i32>,
    row_of_slot: &mut Tensor<i32>,
    slots: usize,
    rows: usize,
    per_expert: usize,
    capacity: usize,
    top_k: usize,
) {
    let row = CUBE_POS * UNITS as usize + UNIT_POS as usize;
    if row < rows {
        let expert = row / capacity;
        let i = row % capacity;
        let count = usize::cast_from(i32::max(counts[expert], 0));
        let mut slot = slots;
        if i < count && i < per_expert {
            let entry = order[expert * per_expert + i];
            if entry >= 0 && usize::cast_from(entry) < slots {
                slot = usize::cast_from(entry);
            }
        }
        if slot < slots {
            token_of_row[row] = i32::cast_from(slot / top_k);
            slot_of_row[row] = i32::cast_from(slot);
            row_of_slot[slot] = i32::cast_from(row);
        } else {
            token_of_row[row] = 0;
            slot_of_row[row] = i32::cast_from(slots);
        }
    }
}
