//! Packed rows train each document as if it sat alone in its row: the
//! tiny Qwen3 and GPT-OSS checkpoints (GQA, q/k norms; sinks and sliding
//! windows) give the same summed loss and the same gradient of every
//! parameter for five documents packed three to a row as for the same
//! documents one per row, padded. On NdArray and wgpu with the composite
//! ops, and under `Bastile` with the fused kernels (wgpu, and CUDA when
//! selected).

use std::path::PathBuf;

use bastile::{BastileBackend, CrossEntropyOptions, Reduction};
use bastile_cubecl::testing::{rel_l2, runtime_selected};
use bastile_models::CausalLm;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

/// Document lengths: one of two tokens (the shortest a shifted loss
/// trains), odd lengths, one that nearly fills a row.
const DOCUMENTS: [usize; 5] = [7, 3, 14, 2, 5];
/// Rows of 16: `[7, 3]`, `[14, 2]`, `[5]`, each padded to 16.
const ROW: usize = 16;
const PAD_ID: i64 = 0;
const IGNORE: i64 = -100;

/// Each document's ids and labels (its first two labels ignored: a
/// prompt).
fn documents(vocab: i64) -> Vec<(Vec<i64>, Vec<i64>)> {
    DOCUMENTS
        .iter()
        .enumerate()
        .map(|(d, &n)| {
            let ids: Vec<i64> = (0..n as i64)
                .map(|i| (i * 131 + d as i64 * 37 + 5) % vocab)
                .collect();
            let mut labels = ids.clone();
            labels[..2.min(n - 1)].fill(IGNORE);
            (ids, labels)
        })
        .collect()
}

/// `(ids, labels, positions, [rows, seq])` with `rows` the documents of
/// each row, padded on the right to `seq`.
fn rows(
    docs: &[(Vec<i64>, Vec<i64>)],
    rows: &[&[usize]],
    seq: usize,
) -> (Vec<i64>, Vec<i64>, Vec<i64>, [usize; 2]) {
    let (mut ids, mut labels, mut positions) = (Vec::new(), Vec::new(), Vec::new());
    for row in rows {
        let mut used = 0;
        for &d in *row {
            let (i, l) = &docs[d];
            ids.extend(i);
            labels.extend(l);
            positions.extend(0..i.len() as i64);
            used += i.len();
        }
        ids.extend(std::iter::repeat_n(PAD_ID, seq - used));
        labels.extend(std::iter::repeat_n(IGNORE, seq - used));
        positions.extend(0..(seq - used) as i64);
    }
    (ids, labels, positions, [rows.len(), seq])
}

/// Every parameter's gradient (in module order).
struct Grads<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    out: Vec<Vec<f64>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Grads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let g = param
            .val()
            .grad(self.grads)
            .expect("every parameter has a gradient");
        self.out
            .push(g.into_data().convert::<f64>().to_vec::<f64>().unwrap());
    }
}

/// The summed loss and every parameter's gradient of `fixture` on the
/// documents, packed (`packed`) or one per row.
fn loss_and_grads<B>(fixture: &str, packed: bool) -> (f64, Vec<Vec<f64>>)
where
    B: AutodiffBackend + BastileBackend,
{
    let device = Default::default();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(fixture);
    let model = CausalLm::<B>::from_hf_dir(dir, &device).unwrap();
    let docs = documents(model.config.vocab_size as i64);
    let (ids, labels, positions, shape) = if packed {
        rows(&docs, &[&[0, 1], &[2, 3], &[4]], ROW)
    } else {
        let longest = DOCUMENTS.iter().max().copied().unwrap();
        rows(&docs, &[&[0], &[1], &[2], &[3], &[4]], longest)
    };
    let ints = |v: Vec<i64>| Tensor::<B, 2, Int>::from_data(TensorData::new(v, shape), &device);
    let options = CrossEntropyOptions::default().with_reduction(Reduction::Sum);
    let out = if packed {
        model.loss_packed(ints(ids), ints(labels), ints(positions), options)
    } else {
        model.loss(ints(ids), ints(labels), options)
    }
    .unwrap();
    let loss = out
        .loss
        .clone()
        .into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .unwrap()[0];
    let grads = out.loss.backward();
    let mut visitor = Grads::<B> {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut visitor);
    (loss, visitor.out)
}

/// Packed and one-per-row agree: the loss within `tol` (relative) and
/// every gradient within `tol` (relative L2).
fn check<B>(what: &str, fixture: &str, tol: f64)
where
    B: AutodiffBackend + BastileBackend,
{
    let (loss, grads) = loss_and_grads::<B>(fixture, false);
    let (packed_loss, packed_grads) = loss_and_grads::<B>(fixture, true);
    let rel = (loss - packed_loss).abs() / loss.abs();
    assert!(
        rel <= tol,
        "{what} {fixture}: packed loss {packed_loss} vs {loss} one per row ({rel:.2e})"
    );
    assert_eq!(grads.len(), packed_grads.len());
    let mut worst = 0.0f64;
    for (i, (a, b)) in grads.iter().zip(&packed_grads).enumerate() {
        assert!(
            a.iter().any(|&g| g != 0.0),
            "{what} {fixture}: parameter {i} has no gradient"
        );
        let rel = rel_l2(b, a);
        worst = worst.max(rel);
        assert!(
            rel <= tol,
            "{what} {fixture}: parameter {i}'s gradient differs by {rel:.2e} (relative L2)"
        );
    }
    eprintln!("{what} {fixture}: loss {rel:.1e}, gradients within {worst:.1e} (relative)");
}

fn packed_rows_train_each_document_alone(fixture: &str) {
    use burn::backend::{Autodiff, NdArray};
    check::<Autodiff<NdArray>>("ndarray", fixture, 1e-5);
    if runtime_selected("wgpu", cfg!(feature = "wgpu")) {
        #[cfg(feature = "wgpu")]
        {
            use burn::backend::Wgpu;
            bastile::apply(bastile::Patches::default());
            check::<Autodiff<Wgpu>>("wgpu composite", fixture, 1e-5);
            check::<Autodiff<bastile::Bastile<Wgpu>>>("wgpu fused", fixture, 1e-5);
        }
    }
    if runtime_selected("cuda", cfg!(feature = "cuda")) {
        #[cfg(feature = "cuda")]
        {
            use burn::backend::Cuda;
            bastile::apply(bastile::Patches::default());
            check::<Autodiff<bastile::Bastile<Cuda>>>("cuda fused", fixture, 1e-5);
        }
    }
}

#[test]
fn qwen3_packed_rows_train_each_document_alone() {
    packed_rows_train_each_document_alone("qwen3");
}

#[test]
fn gpt_oss_packed_rows_train_each_document_alone() {
    packed_rows_train_each_document_alone("gpt_oss");
}
