//! `Fusion<B>`: a kernel is recorded as a custom op of the fusion stream;
//! when the stream runs, the op launches the kernel on `B` with the resolved
//! handles. The element-wise ops around it keep fusing.

use burn::tensor::Device;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_backend::StreamId;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr, TensorStatus};

use super::kernel::split_outputs;
use super::{DeviceQuery, Kernel, KernelBackend, TensorSpec};

/// A recorded kernel: its inputs and outputs as the stream knows them.
struct Recorded<B, K> {
    desc: CustomOpIr,
    /// The first `floats` inputs are float tensors, the rest int tensors.
    floats: usize,
    /// The first `float_outputs` outputs are float tensors, the rest int
    /// tensors.
    float_outputs: usize,
    kernel: K,
    outputs: Vec<TensorSpec>,
    _backend: core::marker::PhantomData<fn() -> B>,
}

impl<B, K: Kernel> core::fmt::Debug for Recorded<B, K> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}({})", K::NAME, self.desc.id)
    }
}

impl<B: FusionBackend + KernelBackend, K: Kernel> Operation<B::FusionRuntime> for Recorded<B, K> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let (floats, ints) = self.desc.inputs.split_at(self.floats);
        let floats: Vec<FloatTensor<B>> = floats
            .iter()
            .map(|ir| handles.get_float_tensor::<B>(ir))
            .collect();
        let ints: Vec<IntTensor<B>> = ints
            .iter()
            .map(|ir| handles.get_int_tensor::<B>(ir))
            .collect();
        let (float_specs, int_specs) = self.outputs.split_at(self.float_outputs);
        let (float_outputs, int_outputs) = B::launch_split(
            &self.kernel,
            floats,
            ints,
            float_specs.to_vec(),
            int_specs.to_vec(),
        );
        let count = float_outputs.len() + int_outputs.len();
        let (float_ids, int_ids) = self.desc.outputs.split_at(self.float_outputs);
        for (ir, out) in float_ids.iter().zip(float_outputs) {
            handles.register_float_tensor::<B>(&ir.id, out);
        }
        for (ir, out) in int_ids.iter().zip(int_outputs) {
            handles.register_int_tensor::<B>(&ir.id, out);
        }
        assert_eq!(
            count,
            self.desc.outputs.len(),
            "{} returned the wrong number of outputs",
            K::NAME
        );
    }
}

impl<B: FusionBackend + KernelBackend> KernelBackend for Fusion<B> {
    fn ask<Q: DeviceQuery>(device: &Device<Self>, query: &Q) -> Option<Q::Answer> {
        B::ask(device, query)
    }

    fn launch_split<K: Kernel>(
        kernel: &K,
        floats: Vec<FloatTensor<Self>>,
        ints: Vec<IntTensor<Self>>,
        float_outputs: Vec<TensorSpec>,
        int_outputs: Vec<TensorSpec>,
    ) -> (Vec<FloatTensor<Self>>, Vec<IntTensor<Self>>) {
        let split = float_outputs.len();
        split_outputs(float_outputs, int_outputs, |outputs| {
            record::<B, K>(kernel, floats, ints, outputs, split)
        })
    }
}

/// Records `kernel` on the stream of its inputs, returning its outputs
/// (the first `float_outputs` float tensors, the rest int tensors).
fn record<B: FusionBackend + KernelBackend, K: Kernel>(
    kernel: &K,
    floats: Vec<FusionTensor<B::FusionRuntime>>,
    ints: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<TensorSpec>,
    float_outputs: usize,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let client = floats
        .iter()
        .chain(&ints)
        .next()
        .unwrap_or_else(|| panic!("{} has no input", K::NAME))
        .client
        .clone();
    let streams = OperationStreams::with_inputs(floats.iter().chain(ints.iter()));
    let output_irs: Vec<TensorIr> = outputs
        .iter()
        .map(|o| TensorIr::uninit(client.create_empty_handle(), o.shape.clone(), o.dtype))
        .collect();
    let n_floats = floats.len();
    let current = StreamId::current();
    let (inputs, from_other_streams): (Vec<TensorIr>, Vec<bool>) = floats
        .into_iter()
        .chain(ints)
        .map(|t| {
            let elsewhere = t.stream != current;
            (t.into_ir(), elsewhere)
        })
        .unzip();
    let desc = CustomOpIr::new(K::NAME, &inputs, &output_irs);
    // The stream marks an input created on another stream read-only in
    // the operation it queues (other streams may have queued reads of
    // it; the stream drops it once they ran), but executes the recorded
    // op, which reads its inputs with the statuses it was given: they
    // must be the same, or the op takes a handle other streams still
    // need.
    let mut recorded = desc.clone();
    for (input, elsewhere) in recorded.inputs.iter_mut().zip(from_other_streams) {
        if elsewhere {
            input.status = TensorStatus::ReadOnly;
        }
    }
    let outputs = client.register(
        streams,
        OperationIr::Custom(desc),
        Recorded::<B, K> {
            desc: recorded,
            floats: n_floats,
            float_outputs,
            kernel: kernel.clone(),
            outputs,
            _backend: core::marker::PhantomData,
        },
    );
    if K::DISPATCH_AT_ONCE {
        // The stream's thread runs the op now rather than when its batch
        // of queued registrations fills.
        client.flush_queue();
    }
    outputs
}
