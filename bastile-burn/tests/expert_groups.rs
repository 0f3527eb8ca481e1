//! Token-expert assignments grouped by expert (`bastile::group_by_expert`):
//! on `Autodiff<Bastile<B>>` (two kernels, only the counts read back)
//! and on `B` (the host composite) against a host grouping written here:
//! the capacity, the counts and the three index vectors exactly, with
//! experts receiving no token, one token and every token, odd sizes and
//! capacity steps. Choices outside the experts, an expert chosen twice by
//! one token and a bad top-k or step are descriptive errors.

use crate::common::*;
use bastile::ops::expert_groups::ExpertOrder;
use bastile::ops::reduce::StorageQuery;
use bastile::{Bastile, BastileBackend, BastileError, group_by_expert};
use bastile_cubecl::testing::Rng;
use burn::backend::Autodiff;
use burn::tensor::{DType, Int, Tensor, TensorData};

/// `tokens` rows of `top_k` distinct experts: random, except that token
/// 0 alone takes expert `experts - 1` (one token; where there are more
/// experts than `top_k`) and, with `skewed`,
/// every token takes expert 0 first (every token) and the rest among the
/// next `top_k` experts (the others take none).
fn choices(rng: &mut Rng, tokens: usize, top_k: usize, experts: usize, skewed: bool) -> Vec<i64> {
    let mut chosen = Vec::with_capacity(tokens * top_k);
    let one_token = !skewed && experts > top_k;
    for t in 0..tokens {
        let mut row: Vec<i64> = Vec::with_capacity(top_k);
        if skewed {
            row.push(0);
        }
        let (first, pool) = match (skewed, one_token) {
            (true, _) => (1, top_k),
            (false, true) => (0, experts - 1),
            (false, false) => (0, experts),
        };
        while row.len() < top_k {
            let e = first + (rng.uniform() * pool as f64).min(pool as f64 - 1.0) as i64;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        if t == 0 && one_token {
            row[0] = experts as i64 - 1;
        }
        chosen.extend(row);
    }
    chosen
}

/// The grouping as the routed experts read it: `(capacity, counts,
/// token_of_row, slot_of_row, row_of_slot)`.
type Grouping = (usize, Vec<usize>, Vec<i64>, Vec<i64>, Vec<i64>);

fn expected(chosen: &[i64], tokens: usize, top_k: usize, experts: usize, step: usize) -> Grouping {
    let mut counts = vec![0usize; experts];
    chosen.iter().for_each(|&e| counts[e as usize] += 1);
    let largest = counts.iter().copied().max().unwrap_or(0).max(1);
    let capacity = largest.next_multiple_of(step).min(tokens).max(largest);
    let slots = chosen.len();
    let mut token_of_row = vec![0i64; experts * capacity];
    let mut slot_of_row = vec![slots as i64; experts * capacity];
    let mut row_of_slot = vec![0i64; slots];
    let mut filled = vec![0usize; experts];
    for (slot, &e) in chosen.iter().enumerate() {
        let row = e as usize * capacity + filled[e as usize];
        filled[e as usize] += 1;
        token_of_row[row] = (slot / top_k) as i64;
        slot_of_row[row] = slot as i64;
        row_of_slot[slot] = row as i64;
    }
    (capacity, counts, token_of_row, slot_of_row, row_of_slot)
}

fn ints<X: burn::tensor::backend::Backend>(t: Tensor<X, 1, Int>) -> Vec<i64> {
    t.into_data().iter::<i64>().collect()
}

fn run<X: BastileBackend>(
    chosen: &[i64],
    [tokens, top_k, experts, step]: [usize; 4],
    device: &X::Device,
) -> Result<Grouping, BastileError> {
    let chosen =
        Tensor::<X, 2, Int>::from_data(TensorData::new(chosen.to_vec(), [tokens, top_k]), device);
    let g = group_by_expert(chosen, experts, step)?;
    Ok((
        g.capacity,
        g.counts,
        ints(g.token_of_row),
        ints(g.slot_of_row),
        ints(g.row_of_slot),
    ))
}

backend_test! {
    fn expert_groups_match_a_host_grouping<B>(device, name, _dtypes) {
        let query = StorageQuery { dtype: DType::I32 };
        assert!(bastile::fused::is_fused::<Bastile<B>, _>(
            &ExpertOrder { experts: 4, per_expert: 1 },
            device,
            &query
        ));
        let mut rng = Rng::fresh();
        // [tokens, top_k, experts, capacity step], skewed
        let cases = [
            ([1usize, 1, 1, 64], false),
            ([7, 2, 5, 4], false),
            ([1000, 4, 32, 64], false),
            ([300, 4, 16, 1], true),
        ];
        for (sizes, skewed) in cases {
            let [tokens, top_k, experts, step] = sizes;
            let chosen = choices(&mut rng, tokens, top_k, experts, skewed);
            let want = expected(&chosen, tokens, top_k, experts, step);
            let what = format!("{name} [tokens, top_k, experts, step] = {sizes:?}, skewed {skewed}");
            let fused = run::<Autodiff<Bastile<B>>>(&chosen, sizes, device).unwrap();
            assert_eq!(fused, want, "fused: {what}");
            if checks_composite(name) {
                let composite = run::<B>(&chosen, sizes, device).unwrap();
                assert_eq!(composite, want, "composite: {what}");
            }
        }

        // A choice outside the experts and an expert chosen twice by one
        // token: the counts read back tell.
        let outside = run::<Bastile<B>>(&[0, 1, 2, 4], [2, 2, 4, 1], device).unwrap_err();
        assert!(
            matches!(&outside, BastileError::Shape(m) if m.contains("outside 0..4: 1 of 4")),
            "{outside}"
        );
        let twice = run::<Bastile<B>>(&[1, 1, 1, 1], [2, 2, 4, 1], device).unwrap_err();
        assert!(
            matches!(&twice, BastileError::Shape(m) if m.contains("expert 1 was chosen 4 times by 2 tokens")),
            "{twice}"
        );
    }
}

#[test]
fn group_by_expert_rejects_a_bad_top_k_or_step() {
    type B = Bastile<burn::backend::NdArray>;
    let device = Default::default();
    let err = run::<B>(&[0, 1, 2], [1, 3, 2, 1], &device).unwrap_err();
    assert!(
        matches!(&err, BastileError::Shape(m) if m.contains("1 <= top_k <= 2")),
        "{err}"
    );
    let err = run::<B>(&[0, 1], [1, 2, 2, 0], &device).unwrap_err();
    assert!(
        matches!(&err, BastileError::Config(m) if m.contains("step")),
        "{err}"
    );
}
