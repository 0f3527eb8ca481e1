//! Token-expert assignments grouped by expert, on the host: what
//! [`crate::expert_groups`] writes, element for element.

/// Every expert's assignments in slot order, `experts × per_expert` (the
/// first `per_expert` of each, then `chosen.len()` for none), and their
/// counts. A value of `chosen` outside `0..experts` belongs to no expert.
pub fn expert_order(chosen: &[i32], experts: usize, per_expert: usize) -> (Vec<i32>, Vec<i32>) {
    let slots = chosen.len();
    let mut counts = vec![0i32; experts];
    let mut order = vec![slots as i32; experts * per_expert];
    for (slot, &expert) in chosen.iter().enumerate() {
        if expert < 0 || expert as usize >= experts {
            continue;
        }
        let e = expert as usize;
        let at = counts[e] as usize;
        if at < per_expert {
            order[e * per_expert + at] = slot as i32;
        }
        counts[e] += 1;
    }
    (counts, order)
}

/// The groups padded to `capacity` rows: `(token_of_row, slot_of_row,
/// row_of_slot)`. Row `e · capacity + i` holds expert `e`'s `i`-th
/// assignment (its token `slot / top_k`), or is padding (token 0, slot
/// `slots`); an assignment past its group's capacity gets no row (-1).
pub fn expert_rows(
    order: &[i32],
    counts: &[i32],
    slots: usize,
    per_expert: usize,
    capacity: usize,
    top_k: usize,
) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let experts = counts.len();
    let rows = experts * capacity;
    let mut token_of_row = vec![0i32; rows];
    let mut slot_of_row = vec![slots as i32; rows];
    let mut row_of_slot = vec![-1i32; slots];
    for (e, &count) in counts.iter().enumerate() {
        let filled = (count.max(0) as usize).min(per_expert).min(capacity);
        for i in 0..filled {
            let slot = order[e * per_expert + i];
            if slot < 0 || slot as usize >= slots {
                continue;
            }
            let row = e * capacity + i;
            token_of_row[row] = slot / top_k as i32;
            slot_of_row[row] = slot;
            row_of_slot[slot as usize] = row as i32;
        }
    }
    (token_of_row, slot_of_row, row_of_slot)
}
