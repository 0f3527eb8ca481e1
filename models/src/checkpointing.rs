//! Activation checkpointing of the decoder layers: a checkpointed layer
//! keeps only its input during the forward pass and runs again, with its
//! autodiff graph, when the backward pass reaches it. Memory then grows
//! with one `[batch, seq, hidden]` tensor per layer instead of every
//! activation of every layer, for one more forward pass of the layers.
//!
//! The backward pass runs layer by layer, last first: each layer's graph
//! is differentiated on its own, seeded with the gradient of its output,
//! and hands the gradient of its input to the layer before it. Layers that
//! are not checkpointed ([`Checkpointing::Every`] above 1) keep their graph
//! from the forward pass.

use std::num::NonZeroUsize;

use bastile::{BastileBackend, CrossEntropyOptions, CrossEntropyOutput, RopeTables};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor};
use serde::{Deserialize, Serialize};

use crate::ModelError;
use crate::model::{CausalLm, LossInput};
use crate::moe::RouterLoad;

/// Which decoder layers recompute their activations in the backward pass
/// instead of keeping them ([`CausalLm::with_checkpointing`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Checkpointing {
    /// Every layer keeps what its backward pass needs (fastest, most
    /// memory).
    #[default]
    Off,
    /// Layers 0, n, 2n, … keep only their input and run again in the
    /// backward pass; the others keep their activations. `Every(1)`
    /// checkpoints every layer (least memory).
    Every(NonZeroUsize),
}

impl Checkpointing {
    /// Every layer checkpointed.
    pub const ALL: Checkpointing = Checkpointing::Every(NonZeroUsize::MIN);

    /// Whether `layer` (counted from 0) is recomputed.
    pub fn recomputes(self, layer: usize) -> bool {
        match self {
            Checkpointing::Off => false,
            Checkpointing::Every(n) => layer.is_multiple_of(n.get()),
        }
    }
}

impl std::fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Checkpointing::Off => write!(f, "off"),
            Checkpointing::Every(n) if n.get() == 1 => write!(f, "every layer"),
            Checkpointing::Every(n) => write!(f, "one layer in {n}"),
        }
    }
}

impl<B: Backend> CausalLm<B> {
    /// The model with `checkpointing` of its layers in training
    /// ([`CausalLm::loss_and_grads`]). Refused with LoRA dropout: the
    /// recomputed layers would draw other dropout masks than the forward
    /// pass did.
    pub fn with_checkpointing(mut self, checkpointing: Checkpointing) -> Result<Self, ModelError> {
        self.checkpointing = checkpointing;
        self.check_checkpointing()?;
        Ok(self)
    }

    /// Refuses checkpointing with LoRA dropout.
    pub(crate) fn check_checkpointing(&self) -> Result<(), ModelError> {
        match &self.lora {
            Some(lora) if lora.dropout > 0.0 && self.checkpointing != Checkpointing::Off => {
                Err(ModelError::Config(format!(
                    "activation checkpointing ({}) cannot be combined with LoRA dropout ({}): a \
                     recomputed layer would draw other dropout masks than its forward pass; set \
                     the dropout to 0 or turn checkpointing off",
                    self.checkpointing, lora.dropout
                )))
            }
            _ => Ok(()),
        }
    }
}

impl<B> CausalLm<B>
where
    B: AutodiffBackend + BastileBackend,
    B::InnerBackend: BastileBackend,
{
    /// [`CausalLm::loss`] (or [`CausalLm::loss_packed`] with `positions`)
    /// divided by `divisor`, and the gradients of that quotient, with the
    /// model's [`Checkpointing`]. The returned loss is detached.
    pub fn loss_and_grads(
        &self,
        ids: Tensor<B, 2, Int>,
        labels: Tensor<B, 2, Int>,
        positions: Option<Tensor<B, 2, Int>>,
        options: CrossEntropyOptions,
        divisor: Tensor<B, 1>,
    ) -> Result<(CrossEntropyOutput<B>, GradientsParams), ModelError> {
        let mut divisor = || divisor.clone();
        self.loss_and_grads_into::<NoSink>(ids, labels, positions, options, &mut divisor, None)
    }

    /// [`CausalLm::loss_and_grads`], handing `sink` each module's
    /// gradients as soon as they are complete. With a sink the backward
    /// pass always runs segment by segment (the head and loss, each layer
    /// last first, the embeddings), recomputing the layers only as the
    /// model's [`Checkpointing`] says. `divisor` is asked for once the
    /// forward pass is queued, so a divisor still being summed over the
    /// workers need not hold the forward pass back.
    pub(crate) fn loss_and_grads_into<S: SegmentSink<B>>(
        &self,
        ids: Tensor<B, 2, Int>,
        labels: Tensor<B, 2, Int>,
        positions: Option<Tensor<B, 2, Int>>,
        options: CrossEntropyOptions,
        divisor: &mut dyn FnMut() -> Tensor<B, 1>,
        mut sink: Option<&mut S>,
    ) -> Result<(CrossEntropyOutput<B>, GradientsParams), ModelError> {
        if self.checkpointing == Checkpointing::Off && sink.is_none() {
            let mut out = self.loss_of(ids, labels, positions, options)?;
            let loss = out.loss / divisor();
            out.loss = loss.clone().detach();
            return Ok((out, GradientsParams::from_grads(loss.backward(), self)));
        }
        self.check_checkpointing()?;
        let input = self.loss_input(ids, labels, positions, options)?;
        let LossInput {
            ids,
            shifted,
            positions,
        } = input;
        let tables = self.rope_tables(&ids, positions.as_ref());

        // Forward: checkpointed layers run on the inner backend (no graph)
        // and keep their input; the others record their graph from a leaf.
        let inner_ids = ids.clone().inner();
        let inner_positions = positions.clone().map(Tensor::inner);
        let inner_tables = RopeTables {
            cos: tables.cos.clone().inner(),
            sin: tables.sin.clone().inner(),
        };
        let mut x = bastile::embedding(self.model.embed_tokens.weight.val().inner(), inner_ids)?;
        // With the router's load-balancing loss, the layers' router loads:
        // their assignments weigh every layer's router probabilities.
        let router_loads = self.router_aux_loss().is_some();
        let mut loads = Vec::new();
        let mut saved = Vec::with_capacity(self.model.layers.len());
        for (i, layer) in self.model.layers.iter().enumerate() {
            if self.checkpointing.recomputes(i) {
                let (out, load) = layer.valid().forward(
                    x.clone(),
                    &inner_tables,
                    inner_positions.as_ref(),
                    router_loads,
                )?;
                loads.extend(load);
                saved.push(Saved::Input(x));
                x = out;
            } else {
                let leaf = Tensor::from_inner(x).require_grad();
                let (out, load) =
                    layer.forward(leaf.clone(), &tables, positions.as_ref(), router_loads)?;
                loads.extend(load.clone().map(RouterLoad::inner));
                x = out.clone().inner();
                saved.push(Saved::Graph { leaf, out, load });
            }
        }

        // Backward, last segment first: the head and loss, each layer,
        // then the embeddings.
        let mut grads = GradientsParams::new();
        let leaf = Tensor::from_inner(x).require_grad();
        let mut out = self.head_loss(leaf.clone(), shifted, options)?;
        let divisor = divisor();
        // The load-balancing loss's weights, scaled as the loss is; each
        // layer's part joins the loss here and its gradient joins the
        // layer's backward pass.
        let aux_weights = match (
            self.router_aux_scale(&out, options)?,
            RouterLoad::loss_weights(&loads),
        ) {
            (Some(scale), Some(weights)) => Some(weights * (scale / divisor.clone()).inner()),
            _ => None,
        };
        let loss = out.loss / divisor;
        let reported = loss.clone().detach();
        out.loss = match aux_weights
            .clone()
            .and_then(|weights| RouterLoad::loss(&loads, weights))
        {
            Some(aux) => reported + Tensor::from_inner(aux),
            None => reported,
        };
        let mut segment = loss.backward();
        take_grads(&mut segment, &self.model.norm, &mut grads);
        match &self.lm_head {
            Some(head) => take_grads(&mut segment, head, &mut grads),
            None => take_grads(&mut segment, &self.model.embed_tokens, &mut grads),
        }
        let mut dx = input_grad(&leaf, &mut segment);
        let weight = &self.model.embed_tokens.weight;
        // Whether the sink sums the lookup's part of the embeddings'
        // gradient on its own (from every worker's ids and output
        // gradients), so that the rest of it can go now.
        let gathers = weight.val().is_require_grad()
            && sink
                .as_deref()
                .is_some_and(|s| s.gathers_lookup(self.config.vocab_size));
        if let Some(sink) = sink.as_deref_mut() {
            sink.completed(&self.model.norm, &mut grads);
            match &self.lm_head {
                Some(head) => sink.completed(head, &mut grads),
                // The tied embeddings' head part; otherwise their gradient
                // is complete only once the lookup's part joins it, after
                // the last layer.
                None if gathers => sink.completed(&self.model.embed_tokens, &mut grads),
                None => {}
            }
        }
        for (layer, saved) in self.model.layers.iter().zip(saved).rev() {
            let (leaf, out, load) = match saved {
                Saved::Input(x) => {
                    let leaf = Tensor::from_inner(x).require_grad();
                    let (out, load) = layer.forward(
                        leaf.clone(),
                        &tables,
                        positions.as_ref(),
                        aux_weights.is_some(),
                    )?;
                    (leaf, out, load)
                }
                Saved::Graph { leaf, out, load } => (leaf, out, load),
            };
            // The backward pass of `out · dx` seeds `out`'s gradient with
            // ones times `dx`: the layer's backward pass from `dx`, plus
            // its router's part of the load-balancing loss.
            let mut segment = match (load, &aux_weights) {
                (Some(load), Some(weights)) => ((out * dx).sum().cast(DType::F32)
                    + load.loss_term(Tensor::from_inner(weights.clone())))
                .backward(),
                _ => (out * dx).backward(),
            };
            take_grads(&mut segment, layer, &mut grads);
            dx = input_grad(&leaf, &mut segment);
            if let Some(sink) = sink.as_deref_mut() {
                sink.completed(layer, &mut grads);
            }
        }
        if let (true, Some(sink)) = (gathers, sink.as_deref_mut()) {
            sink.lookup(weight, ids.inner(), dx.inner());
        } else if weight.val().is_require_grad() {
            add_lookup_grad(
                &mut grads,
                weight.id,
                || weight.val().inner().zeros_like(),
                ids.inner(),
                dx.inner(),
            )?;
        }
        if let Some(sink) = sink {
            // The embeddings, and whatever no segment above named.
            sink.completed(self, &mut grads);
        }
        Ok((out, grads))
    }
}

/// Takes the gradients of a segmented backward pass as they complete
/// ([`CausalLm::loss_and_grads_into`]).
pub(crate) trait SegmentSink<B: AutodiffBackend> {
    /// The gradients of `module`'s parameters in `grads` are complete:
    /// the sink may take them out (it puts them back later).
    fn completed<M: Module<B>>(&mut self, module: &M, grads: &mut GradientsParams);

    /// Whether the sink takes the embedding lookup's part of the
    /// embeddings' gradient as the lookup's ids and output gradient
    /// ([`SegmentSink::lookup`]) for a vocabulary of `vocab`: the rest of
    /// the embeddings' gradient (a tied head's) is then handed over with
    /// the head.
    fn gathers_lookup(&self, vocab: usize) -> bool;

    /// The lookup's part of `weight`'s gradient, as the lookup's `ids`
    /// `[batch, seq]` and output gradient `dx` `[batch, seq, hidden]`: the
    /// sink adds the rows to the rest of the gradient when it puts it
    /// back.
    fn lookup(
        &mut self,
        weight: &Param<Tensor<B, 2>>,
        ids: Tensor<B::InnerBackend, 2, Int>,
        dx: Tensor<B::InnerBackend, 3>,
    );
}

/// No sink: [`CausalLm::loss_and_grads`].
pub(crate) enum NoSink {}

impl<B: AutodiffBackend> SegmentSink<B> for NoSink {
    fn completed<M: Module<B>>(&mut self, _: &M, _: &mut GradientsParams) {
        match *self {}
    }

    fn gathers_lookup(&self, _: usize) -> bool {
        match *self {}
    }

    fn lookup(
        &mut self,
        _: &Param<Tensor<B, 2>>,
        _: Tensor<B::InnerBackend, 2, Int>,
        _: Tensor<B::InnerBackend, 3>,
    ) {
        match *self {}
    }
}

/// What the forward pass keeps of one layer.
enum Saved<B: AutodiffBackend> {
    /// A checkpointed layer's input.
    Input(Tensor<B::InnerBackend, 3>),
    /// A layer run with its graph: its input (a leaf), output and router
    /// load.
    Graph {
        leaf: Tensor<B, 3>,
        out: Tensor<B, 3>,
        load: Option<RouterLoad<B>>,
    },
}

/// Adds the embedding lookup's gradient (`ids` `[batch, seq]`, output
/// gradient `dx` `[batch, seq, hidden]`) into the gradient registered
/// under `id` in `grads`: straight into the tied head's, when it is there,
/// rather than into zeros added to it afterwards.
pub(crate) fn add_lookup_grad<B: BastileBackend>(
    grads: &mut GradientsParams,
    id: burn::module::ParamId,
    zeros: impl FnOnce() -> Tensor<B, 2>,
    ids: Tensor<B, 2, Int>,
    dx: Tensor<B, 3>,
) -> Result<(), ModelError> {
    let start = grads.remove::<B, 2>(id).unwrap_or_else(zeros);
    let grad = bastile::add_embedding_grad(start, ids, dx)?;
    grads.register(id, grad);
    Ok(())
}

/// The gradient of a segment's input `leaf`, as a constant of the next
/// segment's graph.
fn input_grad<B: AutodiffBackend>(leaf: &Tensor<B, 3>, grads: &mut B::Gradients) -> Tensor<B, 3> {
    // The segment's output is a function of its input, so the gradient is
    // always there.
    Tensor::from_inner(
        leaf.grad_remove(grads)
            .expect("a segment's output depends on its input"),
    )
}

/// Moves the gradients of `module`'s parameters out of one segment's
/// `segment` gradients into `into` (each parameter is taken from one
/// segment: the tied embeddings' lookup adds to the head's gradient with
/// [`bastile::add_embedding_grad`]).
fn take_grads<B: AutodiffBackend, M: Module<B>>(
    segment: &mut B::Gradients,
    module: &M,
    into: &mut GradientsParams,
) {
    module.visit(&mut TakeGrads { segment, into });
}

struct TakeGrads<'a, B: AutodiffBackend> {
    segment: &'a mut B::Gradients,
    into: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = param.val().grad_remove(self.segment) {
            self.into.register(param.id, grad);
        }
    }
}
