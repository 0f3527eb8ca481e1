//! Burn's collective operations (feature `distributed`): `Bastile<B>` hands
//! each one to `B`, whose primitives it shares. On CUDA that is CubeCL's
//! NCCL all-reduce on a communication stream the compute stream waits for,
//! so the fused kernels and the cuBLASLt products (on the compute stream)
//! stay ordered with it.

use burn_backend::DeviceId;
use burn_backend::distributed::{
    CollectiveTensor, DistributedBackend, DistributedConfig, DistributedParams, ReduceOperation,
    TensorRef,
};
use burn_backend::tensor::FloatTensor;

use super::Bastile;
use crate::fused::KernelBackend;

impl<B: KernelBackend + DistributedBackend> DistributedBackend for Bastile<B> {
    fn start_communication_server(devices: &[B::Device], config: DistributedConfig) {
        B::start_communication_server(devices, config);
    }

    fn close_communication_server(device: &B::Device) {
        B::close_communication_server(device);
    }

    fn register_sync_parameters(device: &B::Device, distributed_params: Vec<DistributedParams>) {
        B::register_sync_parameters(device, distributed_params);
    }

    fn submit_sync_collective(device: &B::Device) {
        B::submit_sync_collective(device);
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, distributed_params: DistributedParams) {
        B::submit_gradient_sync(TensorRef(tensor.0), distributed_params);
    }

    fn all_reduce(
        tensor: FloatTensor<Self>,
        op: ReduceOperation,
        device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        let reduced = B::all_reduce(tensor, op, device_ids);
        // SAFETY: the handle is wrapped, unread, in a collective tensor of
        // the same primitive; whoever resolves it syncs as `B` would.
        CollectiveTensor::new(unsafe { reduced.assume_resolved() })
    }

    fn sync_collective(device: &B::Device) {
        B::sync_collective(device);
    }
}
