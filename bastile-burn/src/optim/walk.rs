//! How the optimizer walks a module: [`Take`] moves every parameter with
//! a gradient out of it for the step, [`Put`] puts them back updated, and
//! [`Gather`] merges a multi-device step's gradients.

use core::any::Any;

use burn::module::{ModuleMapper, ModuleVisitor, Param, ParamId, ParamMapper};
use burn::optim::{GradientsParams, MultiGradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorPrimitive};
// Burn implements `Record` for hashbrown's map.
use hashbrown::HashMap;

/// What a parameter goes back to its module with, besides its new value.
pub(super) struct TakenParam {
    pub(super) id: ParamId,
    require_grad: bool,
    /// The parameter's `ParamMapper<Tensor<B, D>>`, for its rank `D`.
    mapper: Box<dyn Any + Send>,
}

/// A parameter out of its module for the step, with its gradient, both in
/// the parameter's shape (reshaping them would cost an op each).
pub(super) struct Taken<B: AutodiffBackend> {
    pub(super) param: TakenParam,
    pub(super) weights: FloatTensor<B::InnerBackend>,
    pub(super) grad: FloatTensor<B::InnerBackend>,
}

/// Takes every float parameter that has a gradient out of the module (a
/// placeholder that must not be read stands in until [`Put`]), with its
/// gradient, in the module's order, which fixes the order the norm sums
/// them in.
pub(super) struct Take<'a, B: AutodiffBackend> {
    pub(super) grads: &'a mut GradientsParams,
    pub(super) taken: Vec<Taken<B>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Take<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let dims = tensor.dims();
        let device = tensor.device();
        let weights = tensor.inner().into_primitive().tensor();
        let grad = grad.to_device(&device).into_primitive().tensor();
        self.taken.push(Taken {
            param: TakenParam {
                id,
                require_grad,
                mapper: Box::new(mapper),
            },
            weights,
            grad,
        });
        Param::uninitialized(
            id,
            |_, _| unreachable!("a parameter read while the optimizer step holds it"),
            device,
            require_grad,
            Shape::new(dims),
        )
    }
}

/// Puts every parameter [`Take`] took back into its module, updated.
pub(super) struct Put<B: AutodiffBackend> {
    pub(super) back: HashMap<ParamId, (TakenParam, FloatTensor<B::InnerBackend>)>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Put<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        // The placeholder is never read: only its id matters.
        let Some((taken, weights)) = self.back.remove(&param.id) else {
            return param;
        };
        let mapper = *taken
            .mapper
            .downcast::<ParamMapper<Tensor<B, D>>>()
            .expect("a parameter keeps its rank through the step");
        // The update gives each parameter back in its own shape.
        let weights = Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(weights));
        let mut tensor = Tensor::from_inner(weights);
        if taken.require_grad {
            tensor = tensor.require_grad();
        }
        Param::from_mapped_value(taken.id, tensor, mapper)
    }
}

/// Moves every gradient of a multi-device step into one set, each summed on
/// the device Burn assigns its parameter.
pub(super) struct Gather<'a> {
    pub(super) multi: &'a mut MultiGradientsParams,
    pub(super) into: GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some((g, _)) = self.multi.remove::<B::InnerBackend, D>(param.id) {
            self.into.register::<B::InnerBackend, D>(param.id, g);
        }
    }
}
