//! `Fusion<B>`: each fused op is recorded as a custom op in the fusion
//! stream; when the stream runs, the op launches `B`'s kernel on the
//! resolved handles. The surrounding element-wise ops keep fusing around it.

use core::marker::PhantomData;

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use super::KernelBackend;
use crate::RmsNormCast;

#[derive(Clone, Debug)]
struct RmsNormForwardOp<B> {
    desc: CustomOpIr,
    eps: f64,
    cast: RmsNormCast,
    _b: PhantomData<B>,
}

impl<B: FusionBackend + KernelBackend> Operation<B::FusionRuntime> for RmsNormForwardOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let ([x, gamma], [y, rstd]) = self.desc.as_fixed();
        let x = handles.get_float_tensor::<B>(x);
        let gamma = handles.get_float_tensor::<B>(gamma);
        let (out, r) = B::rms_norm_forward_kernel(x, gamma, self.eps, self.cast);
        handles.register_float_tensor::<B>(&y.id, out);
        handles.register_float_tensor::<B>(&rstd.id, r);
    }
}

#[derive(Clone, Debug)]
struct RmsNormBackwardOp<B> {
    desc: CustomOpIr,
    cast: RmsNormCast,
    _b: PhantomData<B>,
}

impl<B: FusionBackend + KernelBackend> Operation<B::FusionRuntime> for RmsNormBackwardOp<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let ([x, gamma, rstd, dy], [dx, dgamma]) = self.desc.as_fixed();
        let x = handles.get_float_tensor::<B>(x);
        let gamma = handles.get_float_tensor::<B>(gamma);
        let rstd = handles.get_float_tensor::<B>(rstd);
        let dy = handles.get_float_tensor::<B>(dy);
        let (gx, gg) = B::rms_norm_backward_kernel(x, gamma, rstd, dy, self.cast);
        handles.register_float_tensor::<B>(&dx.id, gx);
        handles.register_float_tensor::<B>(&dgamma.id, gg);
    }
}

impl<B: FusionBackend + KernelBackend> KernelBackend for Fusion<B> {
    fn rms_norm_supported(device: &Device<Self>, hidden: usize, dtype: DType) -> bool {
        B::rms_norm_supported(device, hidden, dtype)
    }

    fn rms_norm_forward_kernel(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let client = x.client.clone();
        let rows = x.shape.num_elements() / x.shape.last().copied().unwrap_or(1).max(1);
        let streams = OperationStreams::with_inputs([&x, &gamma]);
        let y = TensorIr::uninit(client.create_empty_handle(), x.shape.clone(), x.dtype);
        let rstd = TensorIr::uninit(client.create_empty_handle(), Shape::new([rows]), DType::F32);
        let desc = CustomOpIr::new(
            "bastile_rms_norm_forward",
            &[x.into_ir(), gamma.into_ir()],
            &[y, rstd],
        );
        let [y, rstd] = client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                RmsNormForwardOp::<B> {
                    desc,
                    eps,
                    cast,
                    _b: PhantomData,
                },
            )
            .try_into()
            .expect("the custom op declares two outputs");
        (y, rstd)
    }

    fn rms_norm_backward_kernel(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        cast: RmsNormCast,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let client = x.client.clone();
        let streams = OperationStreams::with_inputs([&x, &gamma, &rstd, &dy]);
        let dx = TensorIr::uninit(client.create_empty_handle(), x.shape.clone(), x.dtype);
        let dgamma = TensorIr::uninit(
            client.create_empty_handle(),
            gamma.shape.clone(),
            gamma.dtype,
        );
        let desc = CustomOpIr::new(
            "bastile_rms_norm_backward",
            &[x.into_ir(), gamma.into_ir(), rstd.into_ir(), dy.into_ir()],
            &[dx, dgamma],
        );
        let [dx, dgamma] = client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                RmsNormBackwardOp::<B> {
                    desc,
                    cast,
                    _b: PhantomData,
                },
            )
            .try_into()
            .expect("the custom op declares two outputs");
        (dx, dgamma)
    }
}
