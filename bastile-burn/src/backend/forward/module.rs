//! Burn's module, activation, quantization and transaction ops on
//! `Bastile<B>`.

#![allow(clippy::too_many_arguments)]

use burn::tensor::backend::ExecutionError;
use burn::tensor::ops::*;
use burn::tensor::quantization::{QuantScheme, QuantizationParametersPrimitive};
use burn::tensor::{
    Device, FloatDType, IntDType, Scalar, Shape, Slice, TensorData, TensorMetadata, TensorPrimitive,
};

use burn_std::BoolDType;

use super::forward_ops;
use crate::backend::convert::*;
use crate::backend::{Bastile, attention, matmul};
use crate::fused::KernelBackend;
use crate::ops::reduce::{Reduction, reduce_dim};

impl<B: KernelBackend> ModuleOps<Self> for Bastile<B> {
    fn linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        matmul::linear::<B>(x, weight, bias)
    }

    fn linear_x_backward(
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        matmul::linear_x_backward::<B>(weight, output_grad)
    }

    fn linear_weight_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        matmul::linear_weight_backward::<B>(x, output_grad)
    }

    /// One reduction over every row, with the fixed-strategy reduction
    /// kernel (Burn sums one leading dimension at a time, each tuned).
    fn linear_bias_backward(output_grad: FloatTensor<Self>) -> FloatTensor<Self> {
        let shape = output_grad.shape();
        let out = shape[shape.num_dims() - 1];
        let rows = shape.num_elements() / out.max(1);
        let rows = B::float_reshape(output_grad, Shape::new([rows, out]));
        let summed = reduce_dim::<Self>(rows, Reduction::Sum, 0);
        B::float_reshape(summed, Shape::new([out]))
    }

    fn attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: Option<BoolTensor<Self>>,
        attn_bias: Option<FloatTensor<Self>>,
        options: AttentionModuleOptions,
    ) -> FloatTensor<Self> {
        attention::module_attention::<B>(query, key, value, mask, attn_bias, options)
    }

    forward_ops! {
        fn embedding(weights: FloatTensor<Self>, indices: IntTensor<Self>) -> FloatTensor<Self>;
        fn embedding_backward(weights: FloatTensor<Self>, output_grad: FloatTensor<Self>, indices: IntTensor<Self>) -> FloatTensor<Self>;
        fn conv1d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvOptions<1>) -> FloatTensor<Self>;
        fn conv1d_x_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<1>) -> FloatTensor<Self>;
        fn conv1d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<1>) -> FloatTensor<Self>;
        fn conv1d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
        fn conv2d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvOptions<2>) -> FloatTensor<Self>;
        fn conv2d_x_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<2>) -> FloatTensor<Self>;
        fn conv2d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<2>) -> FloatTensor<Self>;
        fn conv2d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
        fn deform_conv2d(x: FloatTensor<Self>, offset: FloatTensor<Self>, weight: FloatTensor<Self>, mask: Option<FloatTensor<Self>>, bias: Option<FloatTensor<Self>>, options: DeformConvOptions<2>) -> FloatTensor<Self>;
        fn deform_conv2d_backward(x: FloatTensor<Self>, offset: FloatTensor<Self>, weight: FloatTensor<Self>, mask: Option<FloatTensor<Self>>, bias: Option<FloatTensor<Self>>, output_grad: FloatTensor<Self>, options: DeformConvOptions<2>) -> DeformConv2dBackward<Self> => deform_conv2d_backward_out;
        fn conv3d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvOptions<3>) -> FloatTensor<Self>;
        fn conv3d_x_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<3>) -> FloatTensor<Self>;
        fn conv3d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvOptions<3>) -> FloatTensor<Self>;
        fn conv3d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
        fn conv_transpose1d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvTransposeOptions<1>) -> FloatTensor<Self>;
        fn conv_transpose1d_x_backward(weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<1>) -> FloatTensor<Self>;
        fn conv_transpose1d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<1>) -> FloatTensor<Self>;
        fn conv_transpose1d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
        fn conv_transpose2d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvTransposeOptions<2>) -> FloatTensor<Self>;
        fn conv_transpose2d_x_backward(weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<2>) -> FloatTensor<Self>;
        fn conv_transpose2d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<2>) -> FloatTensor<Self>;
        fn conv_transpose2d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
        fn conv_transpose3d(x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: Option<FloatTensor<Self>>, options: ConvTransposeOptions<3>) -> FloatTensor<Self>;
        fn conv_transpose3d_x_backward(weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<3>) -> FloatTensor<Self>;
        fn conv_transpose3d_weight_backward(x: FloatTensor<Self>, weight: FloatTensor<Self>, output_grad: FloatTensor<Self>, options: ConvTransposeOptions<3>) -> FloatTensor<Self>;
        fn conv_transpose3d_bias_backward(x: FloatTensor<Self>, bias: FloatTensor<Self>, output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
        fn unfold4d(x: FloatTensor<Self>, kernel_size: [usize; 2], options: UnfoldOptions) -> FloatTensor<Self>;
        fn avg_pool1d(x: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self>;
        fn avg_pool1d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self>;
        fn avg_pool2d(x: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self>;
        fn avg_pool2d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], count_include_pad: bool, ceil_mode: bool) -> FloatTensor<Self>;
        fn adaptive_avg_pool2d(x: FloatTensor<Self>, output_size: [usize; 2]) -> FloatTensor<Self>;
        fn adaptive_avg_pool2d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
        fn adaptive_avg_pool1d(x: FloatTensor<Self>, output_size: usize) -> FloatTensor<Self>;
        fn adaptive_avg_pool1d_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
        fn max_pool1d(x: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool) -> FloatTensor<Self>;
        fn max_pool1d_with_indices(x: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool) -> MaxPool1dWithIndices<Self> => pool1d_indices_out;
        fn max_pool1d_with_indices_backward(x: FloatTensor<Self>, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool, output_grad: FloatTensor<Self>, indices: IntTensor<Self>) -> MaxPool1dBackward<Self> => pool1d_backward_out;
        fn max_pool2d(x: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2], ceil_mode: bool) -> FloatTensor<Self>;
        fn max_pool2d_with_indices(x: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2], ceil_mode: bool) -> MaxPool2dWithIndices<Self> => pool2d_indices_out;
        fn max_pool2d_with_indices_backward(x: FloatTensor<Self>, kernel_size: [usize; 2], stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2], ceil_mode: bool, output_grad: FloatTensor<Self>, indices: IntTensor<Self>) -> MaxPool2dBackward<Self> => pool2d_backward_out;
        fn interpolate(x: FloatTensor<Self>, output_size: [usize; 2], options: InterpolateOptions) -> FloatTensor<Self>;
        fn interpolate_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>, output_size: [usize; 2], options: InterpolateOptions) -> FloatTensor<Self>;
        fn layer_norm(tensor: FloatTensor<Self>, gamma: FloatTensor<Self>, beta: Option<FloatTensor<Self>>, epsilon: f64) -> FloatTensor<Self>;
        fn ctc_loss(log_probs: FloatTensor<Self>, targets: IntTensor<Self>, input_lengths: IntTensor<Self>, target_lengths: IntTensor<Self>, blank: usize) -> FloatTensor<Self>;
        fn has_ctc_loss_backward() -> bool;
        fn ctc_loss_backward(_log_probs: FloatTensor<Self>, _targets: IntTensor<Self>, _input_lengths: IntTensor<Self>, _target_lengths: IntTensor<Self>, _grad_loss: FloatTensor<Self>, _blank: usize) -> FloatTensor<Self>;
        fn rfft(signal: FloatTensor<Self>, dim: usize, n: Option<usize>) -> (FloatTensor<Self>, FloatTensor<Self>);
        fn irfft(spectrum_re: FloatTensor<Self>, spectrum_im: FloatTensor<Self>, dim: usize, n: Option<usize>) -> FloatTensor<Self>;
    }
}

impl<B: KernelBackend> ActivationOps<Self> for Bastile<B> {
    forward_ops! {
        fn leaky_relu(tensor: FloatTensor<Self>, negative_slope: Scalar) -> FloatTensor<Self>;
        fn relu(tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        fn relu_backward(output: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
        fn gelu(tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        fn prelu(tensor: FloatTensor<Self>, alpha: FloatTensor<Self>) -> FloatTensor<Self>;
        fn gelu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
        fn sigmoid(tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        fn sigmoid_backward(output: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
        fn hard_sigmoid(tensor: FloatTensor<Self>, alpha: Scalar, beta: Scalar) -> FloatTensor<Self>;
        fn log_sigmoid(tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        fn softmax(tensor: FloatTensor<Self>, dim: usize) -> FloatTensor<Self>;
        fn log_softmax(tensor: FloatTensor<Self>, dim: usize) -> FloatTensor<Self>;
        fn softmin(tensor: FloatTensor<Self>, dim: usize) -> FloatTensor<Self>;
        fn log_sigmoid_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
    }
}

impl<B: KernelBackend> QTensorOps<Self> for Bastile<B> {
    forward_ops! {
        fn q_from_data(data: TensorData, device: &Device<Self>) -> QuantizedTensor<Self>;
        fn quantize_dynamic(tensor: FloatTensor<Self>, scheme: &QuantScheme) -> QuantizedTensor<Self>;
        fn dequantize(tensor: QuantizedTensor<Self>, dtype: FloatDType) -> FloatTensor<Self>;
        fn q_device(tensor: &QuantizedTensor<Self>) -> Device<Self>;
        fn q_to_device(tensor: QuantizedTensor<Self>, device: &Device<Self>) -> QuantizedTensor<Self>;
        fn q_reshape(tensor: QuantizedTensor<Self>, shape: Shape) -> QuantizedTensor<Self>;
        fn q_into_data(tensor: QuantizedTensor<Self>) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send;
        fn q_detach(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_set_require_grad(tensor: QuantizedTensor<Self>, _require_grad: bool) -> QuantizedTensor<Self>;
        fn q_is_require_grad(_tensor: &QuantizedTensor<Self>) -> bool;
        fn q_expand(tensor: QuantizedTensor<Self>, shape: Shape) -> QuantizedTensor<Self>;
        fn q_transpose(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_swap_dims(tensor: QuantizedTensor<Self>, dim1: usize, dim2: usize) -> QuantizedTensor<Self>;
        fn q_permute(tensor: QuantizedTensor<Self>, axes: &[usize]) -> QuantizedTensor<Self>;
        fn q_flip(tensor: QuantizedTensor<Self>, axes: &[usize]) -> QuantizedTensor<Self>;
        fn q_select(tensor: QuantizedTensor<Self>, dim: usize, indices: IntTensor<Self>) -> QuantizedTensor<Self>;
        fn q_slice(tensor: QuantizedTensor<Self>, slices: &[Slice]) -> QuantizedTensor<Self>;
        fn q_gather(dim: usize, tensor: QuantizedTensor<Self>, indices: IntTensor<Self>) -> QuantizedTensor<Self>;
        fn q_repeat_dim(tensor: QuantizedTensor<Self>, dim: usize, times: usize) -> QuantizedTensor<Self>;
        fn q_add(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_add_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self> => prim_out;
        fn q_clamp_min(tensor: QuantizedTensor<Self>, min: Scalar) -> TensorPrimitive<Self> => prim_out;
        fn q_clamp_max(tensor: QuantizedTensor<Self>, max: Scalar) -> TensorPrimitive<Self> => prim_out;
        fn q_clamp(tensor: QuantizedTensor<Self>, min: Scalar, max: Scalar) -> TensorPrimitive<Self> => prim_out;
        fn q_sub(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_sub_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self> => prim_out;
        fn q_mul(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_mul_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self> => prim_out;
        fn q_div(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_div_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self> => prim_out;
        fn q_neg(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_recip(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_sum(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_sum_dim(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => prim_out;
        fn q_prod(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_prod_dim(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => prim_out;
        fn q_mean(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_mean_dim(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => prim_out;
        fn q_cumsum(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => prim_out;
        fn q_cumprod(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => prim_out;
        fn q_cummin(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => prim_out;
        fn q_cummax(tensor: QuantizedTensor<Self>, dim: usize) -> TensorPrimitive<Self> => prim_out;
        fn q_exp(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_log(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_log1p(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_powf(lhs: QuantizedTensor<Self>, rhs: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_powi(lhs: QuantizedTensor<Self>, rhs: IntTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_powi_scalar(lhs: QuantizedTensor<Self>, rhs: Scalar) -> TensorPrimitive<Self> => prim_out;
        fn q_powf_scalar(tensor: QuantizedTensor<Self>, value: Scalar) -> TensorPrimitive<Self> => prim_out;
        fn q_sqrt(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_abs(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_cos(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_sin(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_tan(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_cosh(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_sinh(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_tanh(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_erf(tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self> => prim_out;
        fn q_cat(tensors: Vec<QuantizedTensor<Self>>, dim: usize) -> QuantizedTensor<Self>;
        fn q_argmax(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> IntTensor<Self>;
        fn q_argtopk(tensor: QuantizedTensor<Self>, dim: usize, k: usize, out_dtype: IntDType) -> IntTensor<Self>;
        fn q_topk(tensor: QuantizedTensor<Self>, dim: usize, k: usize) -> QuantizedTensor<Self>;
        fn q_argmin(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> IntTensor<Self>;
        fn q_max(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_max_dim(tensor: QuantizedTensor<Self>, dim: usize) -> QuantizedTensor<Self>;
        fn q_max_dim_with_indices(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> (QuantizedTensor<Self>, IntTensor<Self>);
        fn q_min(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_min_dim(tensor: QuantizedTensor<Self>, dim: usize) -> QuantizedTensor<Self>;
        fn q_min_dim_with_indices(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: IntDType) -> (QuantizedTensor<Self>, IntTensor<Self>);
        fn q_max_abs(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        fn q_max_abs_dim(tensor: QuantizedTensor<Self>, dim: usize) -> QuantizedTensor<Self>;
        fn q_any(tensor: QuantizedTensor<Self>, out_dtype: BoolDType) -> BoolTensor<Self>;
        fn q_any_dim(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: BoolDType) -> BoolTensor<Self>;
        fn q_all(tensor: QuantizedTensor<Self>, out_dtype: BoolDType) -> BoolTensor<Self>;
        fn q_all_dim(tensor: QuantizedTensor<Self>, dim: usize, out_dtype: BoolDType) -> BoolTensor<Self>;
        fn q_sort(tensor: QuantizedTensor<Self>, dim: usize, descending: bool) -> QuantizedTensor<Self>;
        fn q_sort_with_indices(tensor: QuantizedTensor<Self>, dim: usize, descending: bool, out_dtype: IntDType) -> (QuantizedTensor<Self>, IntTensor<Self>);
        fn q_argsort(tensor: QuantizedTensor<Self>, dim: usize, descending: bool, out_dtype: IntDType) -> IntTensor<Self>;
    }

    fn quantize(
        tensor: FloatTensor<Self>,
        scheme: &QuantScheme,
        qparams: QuantizationParametersPrimitive<Self>,
    ) -> QuantizedTensor<Self> {
        B::quantize(
            tensor,
            scheme,
            QuantizationParametersPrimitive {
                scales: qparams.scales,
            },
        )
    }

    fn q_matmul(lhs: TensorPrimitive<Self>, rhs: TensorPrimitive<Self>) -> TensorPrimitive<Self> {
        prim_out::<B>(B::q_matmul(prim_in::<B>(lhs), prim_in::<B>(rhs)))
    }
}

impl<B: KernelBackend> TransactionOps<Self> for Bastile<B> {
    forward_ops! {}

    fn tr_execute(
        transaction: TransactionPrimitive<Self>,
    ) -> impl Future<Output = Result<TransactionPrimitiveData, ExecutionError>> + Send {
        // The read order lives in the transaction that Burn drains before
        // calling this, so rebuilding it from the four lists loses nothing.
        B::tr_execute(TransactionPrimitive::new(
            transaction.read_floats,
            transaction.read_qfloats,
            transaction.read_ints,
            transaction.read_bools,
        ))
    }
}
