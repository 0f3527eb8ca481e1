//! A mixture of experts' token-expert assignments grouped by expert: the
//! checked entry point, the composite reference and the ops'
//! declarations; the kernel launches in `kernel.rs`.
//!
//! Routed experts run one batched product over every expert's rows, each
//! group padded to one capacity: a shape, which the host must know, so the
//! group sizes are read back once per layer while the device waits.
//! Grouped on the host, that read is every token's choices, and the host
//! then builds three index vectors and uploads them before the device has
//! anything to do: about half a millisecond per layer at 8192 tokens. Here
//! the device groups the assignments ([`ExpertOrder`]) before the read,
//! only the counts come back, and one more launch ([`ExpertRows`]) lays
//! out the padded groups.

mod kernel;

use burn::tensor::backend::Backend;
use burn::tensor::ops::IntTensor;
use burn::tensor::{DType, Element, Int, Shape, Tensor, TensorData, TensorMetadata};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;

use bastile_cubecl::reference::expert_groups as reference;

use crate::fused::{In, KernelBackend, Out, TensorSpec, fused_op, unpack};
use crate::ops::reduce::StorageQuery;
use crate::patches::Op;
use crate::{BastileBackend, BastileError};

/// Token-expert assignments grouped by expert, every group padded to
/// `capacity` rows: row `e · capacity + i` holds expert `e`'s `i`-th
/// assignment in token order. Assignment (slot) `s` is token `s / top_k`'s
/// `s % top_k`-th choice.
#[derive(Debug, Clone)]
pub struct ExpertGroups<B: Backend> {
    /// The rows every group is padded to.
    pub capacity: usize,
    /// The assignments each expert received.
    pub counts: Vec<usize>,
    /// `[experts · capacity]`: the token each row copies, 0 for padding.
    pub token_of_row: Tensor<B, 1, Int>,
    /// `[experts · capacity]`: the assignment each row holds, `tokens ·
    /// top_k` (none) for padding.
    pub slot_of_row: Tensor<B, 1, Int>,
    /// `[tokens · top_k]`: the row of every assignment.
    pub row_of_slot: Tensor<B, 1, Int>,
}

/// The rows every group is padded to for groups of `counts` assignments
/// over `tokens` tokens: the largest group's, rounded up to a multiple of
/// `step` rows but never past `tokens` (an expert takes each token at most
/// once), and at least one. A step above one trades up to `step - 1`
/// padding rows per group for fewer distinct shapes: each new capacity is
/// a new shape for the experts' products, whose first call costs
/// milliseconds of host time (the matmul's algorithm choice and kernel
/// load).
pub fn group_capacity(counts: &[usize], tokens: usize, step: usize) -> usize {
    let largest = counts.iter().copied().max().unwrap_or(0).max(1);
    largest
        .next_multiple_of(step.max(1))
        .min(tokens)
        .max(largest)
}

/// The router's `chosen` experts grouped by expert, every group padded to
/// [`group_capacity`] with `capacity_step`. The device groups them; only
/// the `experts` counts are read back (the one wait on the device), and
/// they are checked: an error when a choice lies outside `0..experts` or a
/// token chose an expert twice.
///
/// Errors also when `top_k` (`chosen`'s columns) is not in `1..=experts`
/// or `capacity_step` is 0.
///
/// # Shapes
///
/// - `chosen`: `[tokens, top_k]`
/// - output: see [`ExpertGroups`]
pub fn group_by_expert<B: BastileBackend>(
    chosen: Tensor<B, 2, Int>,
    experts: usize,
    capacity_step: usize,
) -> Result<ExpertGroups<B>, BastileError> {
    let [tokens, top_k] = chosen.dims();
    if top_k == 0 || top_k > experts {
        return Err(BastileError::Shape(format!(
            "grouping a router's choices [tokens, top_k] = {:?} takes 1 <= top_k <= {experts} \
             experts",
            chosen.dims()
        )));
    }
    if capacity_step == 0 {
        return Err(BastileError::Config(
            "the group capacity's step must be at least one row".into(),
        ));
    }
    let slots = tokens * top_k;
    let order = ExpertOrder {
        experts,
        per_expert: tokens,
    };
    let (counts, grouped) = B::run(&order, chosen.reshape([slots]).into_primitive());
    let counts = Tensor::<B, 1, Int>::from_primitive(counts);
    let host: Vec<usize> = counts
        .clone()
        .try_into_data()
        .map_err(|e| BastileError::Device(format!("reading the expert counts back: {e}")))?
        .iter::<i64>()
        .map(|c| c as usize)
        .collect();
    let assigned: usize = host.iter().sum();
    if assigned != slots {
        return Err(BastileError::Shape(format!(
            "the router's choices name experts outside 0..{experts}: {} of {slots} do",
            slots - assigned
        )));
    }
    if let Some((expert, count)) = host.iter().enumerate().find(|&(_, &c)| c > tokens) {
        return Err(BastileError::Shape(format!(
            "expert {expert} was chosen {count} times by {tokens} tokens: a token chooses each \
             expert at most once"
        )));
    }
    let capacity = group_capacity(&host, tokens, capacity_step);
    let rows = ExpertRows {
        slots,
        per_expert: tokens,
        capacity,
        top_k,
    };
    let (token_of_row, slot_of_row, row_of_slot) =
        B::run(&rows, (grouped, counts.into_primitive()));
    Ok(ExpertGroups {
        capacity,
        counts: host,
        token_of_row: Tensor::from_primitive(token_of_row),
        slot_of_row: Tensor::from_primitive(slot_of_row),
        row_of_slot: Tensor::from_primitive(row_of_slot),
    })
}

/// The values of an int tensor as i32, read back.
fn read_i32<B: Backend>(t: IntTensor<B>) -> Vec<i32> {
    Tensor::<B, 1, Int>::from_primitive(t)
        .into_data()
        .iter::<i64>()
        .map(|v| v as i32)
        .collect()
}

/// i32 values uploaded as a 1-D int tensor.
fn upload<B: Backend>(values: Vec<i32>, device: &B::Device) -> IntTensor<B> {
    let len = values.len();
    Tensor::<B, 1, Int>::from_data(TensorData::new(values, [len]), device).into_primitive()
}

/// The shape and dtype of an op's int output of `len` values.
fn int_spec<K: KernelBackend>(len: usize) -> TensorSpec {
    TensorSpec::new(Shape::new([len]), <K::IntElem as Element>::dtype())
}

/// The assignments' experts `[slots]` to `(counts [experts], order
/// [experts · per_expert])`: every expert's assignments in slot order,
/// then `slots` (none), and their counts. A value outside `0..experts`
/// belongs to no expert. Int tensors have no gradient: on `Autodiff<B>`
/// this is `B`'s op.
#[derive(Clone, Copy, Debug)]
pub struct ExpertOrder {
    pub experts: usize,
    /// The room of each expert's list: the tokens.
    pub per_expert: usize,
}

fused_op! {
    ExpertOrder: Some(Op::Moe), I => (I, I),
    |_, chosen| -> StorageQuery {
        (B::int_device(chosen), StorageQuery { dtype: DType::I32 })
    }

    fn autodiff<B: BastileBackend, C: CheckpointStrategy>(
        &self,
        chosen: In<Self, Autodiff<B, C>>,
    ) -> Out<Self, Autodiff<B, C>> {
        B::run(self, chosen)
    }

    fn composite<B: Backend>(&self, chosen: In<Self, B>) -> Out<Self, B> {
        let device = B::int_device(&chosen);
        let (counts, order) =
            reference::expert_order(&read_i32::<B>(chosen), self.experts, self.per_expert);
        (upload::<B>(counts, &device), upload::<B>(order, &device))
    }

    fn kernels<K: KernelBackend>(&self, _: (), chosen: In<Self, K>) -> Out<Self, K> {
        let specs = vec![
            int_spec::<K>(self.experts),
            int_spec::<K>(self.experts * self.per_expert),
        ];
        let [counts, order] = unpack(K::launch_ints(self, vec![chosen], specs));
        (counts, order)
    }
}

/// `(order, counts)` from [`ExpertOrder`] to the groups padded to
/// `capacity` rows (no smaller than any count): `(token_of_row,
/// slot_of_row, row_of_slot)` as [`ExpertGroups`] holds them.
#[derive(Clone, Copy, Debug)]
pub struct ExpertRows {
    /// Token-expert assignments (tokens × top-k).
    pub slots: usize,
    /// The room of each expert's list in the order.
    pub per_expert: usize,
    pub capacity: usize,
    pub top_k: usize,
}

fused_op! {
    ExpertRows: Some(Op::Moe), (I, I) => (I, I, I),
    |_, (order, _)| -> StorageQuery {
        (B::int_device(order), StorageQuery { dtype: DType::I32 })
    }

    fn autodiff<B: BastileBackend, C: CheckpointStrategy>(
        &self,
        input: In<Self, Autodiff<B, C>>,
    ) -> Out<Self, Autodiff<B, C>> {
        B::run(self, input)
    }

    fn composite<B: Backend>(&self, (order, counts): In<Self, B>) -> Out<Self, B> {
        let device = B::int_device(&order);
        let (token_of_row, slot_of_row, row_of_slot) = reference::expert_rows(
            &read_i32::<B>(order),
            &read_i32::<B>(counts),
            self.slots,
            self.per_expert,
            self.capacity,
            self.top_k,
        );
        (
            upload::<B>(token_of_row, &device),
            upload::<B>(slot_of_row, &device),
            upload::<B>(row_of_slot, &device),
        )
    }

    fn kernels<K: KernelBackend>(&self, _: (), (order, counts): In<Self, K>) -> Out<Self, K> {
        let experts = counts.shape()[0];
        let rows = experts * self.capacity;
        let specs = vec![
            int_spec::<K>(rows),
            int_spec::<K>(rows),
            int_spec::<K>(self.slots),
        ];
        let [token_of_row, slot_of_row, row_of_slot] =
            unpack(K::launch_ints(self, vec![order, counts], specs));
        (token_of_row, slot_of_row, row_of_slot)
    }
}

#[cfg(test)]
mod tests {
    use super::group_capacity;

    #[test]
    fn capacity_is_the_largest_group_rounded_up_within_the_tokens() {
        assert_eq!(group_capacity(&[3, 70, 10], 4096, 64), 128);
        assert_eq!(group_capacity(&[64, 5], 4096, 64), 64);
        assert_eq!(group_capacity(&[530, 577, 512], 4096, 64), 640);
        assert_eq!(group_capacity(&[530, 577, 512], 4096, 1), 577);
        // Never past the tokens: an expert takes each token at most once.
        assert_eq!(group_capacity(&[3, 70, 10], 100, 64), 100);
        assert_eq!(group_capacity(&[5, 2], 5, 64), 5);
        // Without assignments, one row rounded up like any other.
        assert_eq!(group_capacity(&[0, 0], 37, 64), 37);
        assert_eq!(group_capacity(&[], 0, 64), 1);
    }
}
