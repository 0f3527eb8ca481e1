//! Grouping token-expert assignments by expert against the host
//! reference: random distinct choices, an expert taking every token and
//! experts taking none, values outside the experts (belonging to none), an
//! expert chosen more often than its list has room for (counted exactly,
//! listed up to the room), odd sizes, outputs poisoned so that an element
//! the kernels fail to write fails the comparison, and buffers too short
//! refused.

use bastile_cubecl::KernelError;
use bastile_cubecl::expert_groups::{
    self, ExpertOrderBuffers, ExpertOrderProblem, ExpertRowsBuffers, ExpertRowsProblem,
};
use bastile_cubecl::reference::expert_groups as reference;
use bastile_cubecl::testing::*;
use cubecl::prelude::*;

/// A value no kernel writes.
const POISON: i32 = -123_456_789;

/// How a case's choices are drawn.
#[derive(Clone, Copy, Debug)]
enum Choices {
    /// `top_k` distinct experts per token, at random.
    Distinct,
    /// Expert 0 first for every token, the rest distinct at random among
    /// the first `top_k + 1` experts: the others take none.
    Skewed,
    /// Distinct, with every fifth value outside `0..experts`.
    OutOfRange,
    /// Expert 0 for every choice: more assignments than tokens.
    Repeated,
}

fn choices(rng: &mut Rng, tokens: usize, top_k: usize, experts: usize, how: Choices) -> Vec<i32> {
    let mut chosen = Vec::with_capacity(tokens * top_k);
    for _ in 0..tokens {
        let pool = match how {
            Choices::Skewed => (top_k + 1).min(experts),
            _ => experts,
        };
        let mut row: Vec<i32> = Vec::with_capacity(top_k);
        if matches!(how, Choices::Skewed) {
            row.push(0);
        }
        while row.len() < top_k {
            let e = (rng.uniform() * pool as f64).min(pool as f64 - 1.0) as i32;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        chosen.extend(row);
    }
    match how {
        Choices::OutOfRange => {
            for (i, c) in chosen.iter_mut().enumerate() {
                if i % 5 == 2 {
                    *c = if i % 2 == 0 { -1 } else { experts as i32 };
                }
            }
        }
        Choices::Repeated => chosen.iter_mut().for_each(|c| *c = 0),
        _ => {}
    }
    chosen
}

fn check<R: Runtime>(
    client: &ComputeClient<R>,
    [tokens, top_k, experts]: [usize; 3],
    how: Choices,
    rng: &mut Rng,
) {
    let what = format!("{tokens} tokens, top-{top_k} of {experts}, {how:?}");
    let chosen = choices(rng, tokens, top_k, experts, how);
    let slots = chosen.len();
    let per_expert = tokens;
    let (counts, order) = reference::expert_order(&chosen, experts, per_expert);

    let problem = ExpertOrderProblem {
        slots,
        experts,
        per_expert,
    };
    let buffers = ExpertOrderBuffers {
        chosen: upload_i32(client, &chosen),
        counts: upload_i32(client, &vec![POISON; experts]),
        order: upload_i32(client, &vec![POISON; experts * per_expert]),
    };
    expert_groups::expert_order(client, &problem, &buffers).unwrap();
    let got_counts = download_i32(client, buffers.counts.clone());
    assert_eq!(got_counts, counts, "counts: {what}");
    assert_eq!(
        download_i32(client, buffers.order.clone()),
        order,
        "order: {what}"
    );

    // Every group fits: padded to the largest count rounded up to 4
    // rows, so most groups end in padding.
    let largest = counts.iter().copied().max().unwrap_or(0).max(1) as usize;
    let capacity = largest.next_multiple_of(4);
    let rows = experts * capacity;
    let (token_of_row, slot_of_row, row_of_slot) =
        reference::expert_rows(&order, &counts, slots, per_expert, capacity, top_k);
    let rows_problem = ExpertRowsProblem {
        slots,
        experts,
        per_expert,
        capacity,
        top_k,
    };
    // The slots outside every expert get no row: the reference's -1 is
    // what the kernel leaves there.
    let unplaced: Vec<i32> = row_of_slot
        .iter()
        .map(|&r| if r < 0 { -1 } else { POISON })
        .collect();
    let rows_buffers = ExpertRowsBuffers {
        order: buffers.order.clone(),
        counts: buffers.counts.clone(),
        token_of_row: upload_i32(client, &vec![POISON; rows]),
        slot_of_row: upload_i32(client, &vec![POISON; rows]),
        row_of_slot: upload_i32(client, &unplaced),
    };
    if matches!(how, Choices::Repeated) {
        // More assignments than an expert's list has room for: not a
        // grouping the rows can be built from.
        assert!(counts[0] as usize > per_expert, "{what}");
        return;
    }
    expert_groups::expert_rows(client, &rows_problem, &rows_buffers).unwrap();
    let read = |h: &cubecl::server::Handle| download_i32(client, h.clone());
    assert_eq!(
        read(&rows_buffers.token_of_row),
        token_of_row,
        "token of each row: {what}"
    );
    assert_eq!(
        read(&rows_buffers.slot_of_row),
        slot_of_row,
        "slot of each row: {what}"
    );
    assert_eq!(
        read(&rows_buffers.row_of_slot),
        row_of_slot,
        "row of each slot: {what}"
    );
    // The reference is a permutation of the in-range assignments onto the
    // rows: each placed slot's row holds it back.
    for (slot, &row) in row_of_slot.iter().enumerate() {
        if row >= 0 {
            assert_eq!(slot_of_row[row as usize], slot as i32, "{what}");
        }
    }

    // Buffers one value short: refused before any launch.
    let short_order = ExpertOrderBuffers {
        order: upload_i32(client, &vec![0; (experts * per_expert).max(1) - 1]),
        ..buffers
    };
    assert!(matches!(
        expert_groups::expert_order(client, &problem, &short_order),
        Err(KernelError::Shape(e)) if e.contains("expert order")
    ));
    let short_rows = ExpertRowsBuffers {
        row_of_slot: upload_i32(client, &vec![0; slots - 1]),
        ..rows_buffers
    };
    assert!(matches!(
        expert_groups::expert_rows(client, &rows_problem, &short_rows),
        Err(KernelError::Shape(e)) if e.contains("row of each assignment")
    ));
}

struct ExpertGroups;

impl RuntimeTest for ExpertGroups {
    fn run<R: Runtime>(
        &self,
        device: &R::Device,
        _runtime: &str,
        _dtypes: &[bastile_cubecl::FloatDtype],
    ) {
        let client = R::client(device);
        let mut rng = Rng::fresh();
        let cases: [([usize; 3], Choices); 7] = [
            ([1, 1, 1], Choices::Distinct),
            ([7, 2, 5], Choices::Distinct),
            ([1000, 4, 32], Choices::Distinct),
            ([4097, 4, 32], Choices::Distinct),
            ([300, 4, 16], Choices::Skewed),
            ([257, 3, 9], Choices::OutOfRange),
            ([5, 3, 4], Choices::Repeated),
        ];
        for (case, how) in cases {
            check(&client, case, how, &mut rng);
        }
    }
}

#[test]
fn expert_groups_match_reference() {
    for_each_runtime(&ExpertGroups);
}
