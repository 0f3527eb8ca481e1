//! `bastile generate`: replies to prompts from one or more models (a base
//! model and its finetuned checkpoint side by side), greedy or with
//! temperature and top-p sampling. Each new token runs the model over the
//! whole sequence (no key/value cache): meant for comparing answers, not
//! for serving.

use std::path::PathBuf;

use bastile::BastileBackend;
use bastile_models::CausalLm;
use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::chat::{self, ChatFormat, Message};
use crate::device::{DeviceKind, RunInfo, Task, dispatch};
use crate::source::ModelSource;
use crate::tokenizer::Tokenizer;
use crate::{CliError, DTypeArg};

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Preset names or model directories; each answers every prompt.
    pub models: Vec<String>,
    pub tokenizer: Option<PathBuf>,
    pub chat_format: Option<ChatFormat>,
    pub prompts: Vec<String>,
    pub max_new_tokens: usize,
    /// 0 picks the most likely token (greedy).
    pub temperature: f64,
    pub top_p: f64,
    pub seed: u64,
    pub dtype: DTypeArg,
    /// A LoRA adapter directory added to every model.
    pub adapter: Option<PathBuf>,
}

/// One model's reply to one prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    pub model: String,
    pub prompt: String,
    pub text: String,
    pub tokens: Vec<u32>,
}

pub struct Generate(pub GenerateOptions);

/// `bastile generate`: every model's reply to every prompt, on the backend
/// `device` and `bastile` select (see [`dispatch`]). Not generic, so the
/// generation code is compiled once, here, rather than again in each caller.
pub fn run(
    device: DeviceKind,
    bastile: bool,
    options: GenerateOptions,
) -> Result<Vec<Reply>, CliError> {
    dispatch(device, bastile, Generate(options))
}

impl Task for Generate {
    type Output = Vec<Reply>;

    fn models(&self) -> Vec<String> {
        self.0.models.clone()
    }

    fn run<B>(self, device: B::Device, info: RunInfo) -> Result<Vec<Reply>, CliError>
    where
        B: AutodiffBackend + BastileBackend,
        B::InnerBackend: BastileBackend,
    {
        let o = self.0;
        if o.models.is_empty() || o.prompts.is_empty() {
            return Err(CliError::Usage(
                "generate needs at least one --model and one --prompt".into(),
            ));
        }
        if !(o.temperature >= 0.0 && o.top_p > 0.0 && o.top_p <= 1.0) {
            return Err(CliError::Usage(format!(
                "need --temperature >= 0 and 0 < --top-p <= 1, got {} and {}",
                o.temperature, o.top_p
            )));
        }
        let dtype = o.dtype.resolve(&info)?;
        let mut replies = Vec::new();
        for name in &o.models {
            let source = ModelSource::parse(name)?;
            let tokenizer = source.tokenizer(o.tokenizer.as_deref())?;
            // Inference needs no gradients: the inner backend runs it.
            let mut model: CausalLm<B::InnerBackend> =
                source.load::<B>(&device)?.valid().with_dtype(dtype)?;
            if let Some(dir) = &o.adapter {
                model = model.load_adapter_dir(dir, None, &device)?;
            }
            tokenizer.check_fits(model.config.vocab_size)?;
            let format = o
                .chat_format
                .unwrap_or_else(|| ChatFormat::for_model(model.config.architecture, &tokenizer));
            let mut rng = StdRng::seed_from_u64(o.seed);
            for prompt in &o.prompts {
                let tokens = reply(&model, &tokenizer, format, prompt, &o, &mut rng, info)?;
                replies.push(Reply {
                    model: name.clone(),
                    prompt: prompt.clone(),
                    text: tokenizer.decode(&tokens)?,
                    tokens,
                });
            }
        }
        Ok(replies)
    }
}

fn reply<B: Backend + BastileBackend>(
    model: &CausalLm<B>,
    tokenizer: &Tokenizer,
    format: ChatFormat,
    prompt: &str,
    o: &GenerateOptions,
    rng: &mut StdRng,
    info: RunInfo,
) -> Result<Vec<u32>, CliError> {
    let (mut ids, _) = chat::encode(format, tokenizer, &[Message::new("user", prompt)], true)?;
    let stops = chat::stop_ids(format, tokenizer);
    let device = model.head_weight().device();
    let mut out = Vec::new();
    while out.len() < o.max_new_tokens && ids.len() < model.config.max_positions {
        // Padded on the right to a length bucket: position n - 1 attends
        // only to what precedes it, so the padding changes nothing there.
        let n = ids.len();
        let len = n
            .next_multiple_of(info.pad_multiple())
            .min(model.config.max_positions);
        let mut input: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
        input.resize(len, i64::from(tokenizer.pad_id()));
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(input, [1, len]), &device);
        let last = model.logits(input)?.narrow(1, n - 1, 1).reshape([-1]);
        let logits = last
            .cast(burn::tensor::DType::F32)
            .into_data()
            .to_vec::<f32>()
            .expect("f32 logits");
        let next = pick(&logits, o.temperature, o.top_p, rng);
        if stops.contains(&next) {
            break;
        }
        ids.push(next);
        out.push(next);
    }
    Ok(out)
}

/// The next token: the arg-max at temperature 0, else a draw from the
/// smallest set of most likely tokens whose probability reaches `top_p`.
pub fn pick(logits: &[f32], temperature: f64, top_p: f64, rng: &mut impl Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &l)| {
                if l > best.1 { (i, l) } else { best }
            })
            .0 as u32
    };
    if temperature == 0.0 {
        return argmax();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, ((l as f64 - max) / temperature).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut kept = 0.0;
    let mut cut = probs.len();
    for (n, p) in probs.iter().enumerate() {
        kept += p.1 / total;
        if kept >= top_p {
            cut = n + 1;
            break;
        }
    }
    let nucleus = &probs[..cut];
    let mass: f64 = nucleus.iter().map(|p| p.1).sum();
    let mut u = rng.random::<f64>() * mass;
    for &(i, p) in nucleus {
        if u < p {
            return i as u32;
        }
        u -= p;
    }
    nucleus[cut - 1].0 as u32
}
