//! Conversations rendered in a model family's chat format, as token ids
//! with labels: the assistant's replies (and the token that ends each)
//! are trained on, everything else is masked from the loss.

use bastile_models::Architecture;
use clap::ValueEnum;
use serde::Deserialize;

use crate::CliError;
use crate::tokenizer::Tokenizer;

/// The label of a position that does not count in the loss.
pub const IGNORE: i64 = -100;

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ChatFormat {
    /// Qwen's ChatML: `<|im_start|>role\n…<|im_end|>\n`.
    Chatml,
    /// Llama 3: `<|start_header_id|>role<|end_header_id|>\n\n…<|eot_id|>`.
    Llama3,
    /// GPT-OSS's harmony: `<|start|>role<|message|>…<|end|>`, replies on
    /// the `final` channel ending in `<|return|>`.
    Harmony,
    /// The byte tokenizer's: `<|user|>…<|end|><|assistant|>…<|end|>`.
    Byte,
}

impl ChatFormat {
    /// The format a model family is trained with.
    pub fn for_model(architecture: Architecture, tokenizer: &Tokenizer) -> Self {
        if matches!(tokenizer, Tokenizer::Byte) {
            return Self::Byte;
        }
        match architecture {
            Architecture::Qwen3 => Self::Chatml,
            Architecture::Llama => Self::Llama3,
            Architecture::GptOss => Self::Harmony,
        }
    }

    /// Tokens that end a reply when generating.
    pub fn stop_tokens(self) -> &'static [&'static str] {
        match self {
            Self::Chatml => &["<|im_end|>", "<|endoftext|>"],
            Self::Llama3 => &["<|eot_id|>", "<|end_of_text|>"],
            Self::Harmony => &["<|return|>", "<|end|>", "<|call|>"],
            Self::Byte => &["<|end|>"],
        }
    }
}

/// One piece of a rendered conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece {
    Text(String),
    Special(&'static str),
}

/// Pieces of `messages`, each with whether it is trained on; with
/// `prompt`, the header of the assistant's next reply is appended.
fn render(format: ChatFormat, messages: &[Message], prompt: bool) -> Vec<(Piece, bool)> {
    use Piece::{Special, Text};
    let mut out = Vec::new();
    let text = |s: &str| Text(s.to_string());
    match format {
        ChatFormat::Chatml => {
            for m in messages {
                let reply = m.role == "assistant";
                out.push((Special("<|im_start|>"), false));
                out.push((Text(format!("{}\n", m.role)), false));
                out.push((text(&m.content), reply));
                out.push((Special("<|im_end|>"), reply));
                out.push((text("\n"), false));
            }
            if prompt {
                out.push((Special("<|im_start|>"), false));
                out.push((text("assistant\n"), false));
            }
        }
        ChatFormat::Llama3 => {
            out.push((Special("<|begin_of_text|>"), false));
            let header = |out: &mut Vec<_>, role: &str| {
                out.push((Special("<|start_header_id|>"), false));
                out.push((text(role), false));
                out.push((Special("<|end_header_id|>"), false));
                out.push((text("\n\n"), false));
            };
            for m in messages {
                let reply = m.role == "assistant";
                header(&mut out, &m.role);
                out.push((text(&m.content), reply));
                out.push((Special("<|eot_id|>"), reply));
            }
            if prompt {
                header(&mut out, "assistant");
            }
        }
        ChatFormat::Harmony => {
            let header = |out: &mut Vec<_>, role: &str| {
                out.push((Special("<|start|>"), false));
                out.push((text(role), false));
                if role == "assistant" {
                    out.push((Special("<|channel|>"), false));
                    out.push((text("final"), false));
                }
                out.push((Special("<|message|>"), false));
            };
            for (i, m) in messages.iter().enumerate() {
                let reply = m.role == "assistant";
                header(&mut out, &m.role);
                out.push((text(&m.content), reply));
                // A conversation's last reply returns; earlier turns end.
                let last = i + 1 == messages.len();
                out.push((
                    Special(if reply && last {
                        "<|return|>"
                    } else {
                        "<|end|>"
                    }),
                    reply,
                ));
            }
            if prompt {
                header(&mut out, "assistant");
            }
        }
        ChatFormat::Byte => {
            out.push((Special("<|bos|>"), false));
            let role = |r: &str| match r {
                "system" => "<|system|>",
                "assistant" => "<|assistant|>",
                _ => "<|user|>",
            };
            for m in messages {
                let reply = m.role == "assistant";
                out.push((Special(role(&m.role)), false));
                out.push((text(&m.content), reply));
                out.push((Special("<|end|>"), reply));
            }
            if prompt {
                out.push((Special("<|assistant|>"), false));
            }
        }
    }
    out.retain(|(p, _)| !matches!(p, Text(t) if t.is_empty()));
    out
}

/// Token ids and labels (the id where trained, [`IGNORE`] elsewhere) of
/// a conversation; with `prompt`, ending in the next reply's header.
pub fn encode(
    format: ChatFormat,
    tokenizer: &Tokenizer,
    messages: &[Message],
    prompt: bool,
) -> Result<(Vec<u32>, Vec<i64>), CliError> {
    let mut ids = Vec::new();
    let mut labels = Vec::new();
    for (piece, trained) in render(format, messages, prompt) {
        let piece_ids = match piece {
            Piece::Text(t) => tokenizer.encode(&t)?,
            Piece::Special(s) => vec![special(tokenizer, format, s)?],
        };
        labels.extend(
            piece_ids
                .iter()
                .map(|&i| if trained { i64::from(i) } else { IGNORE }),
        );
        ids.extend(piece_ids);
    }
    Ok((ids, labels))
}

/// The ids generation stops at (those the tokenizer has).
pub fn stop_ids(format: ChatFormat, tokenizer: &Tokenizer) -> Vec<u32> {
    format
        .stop_tokens()
        .iter()
        .filter_map(|t| tokenizer.token_id(t))
        .collect()
}

fn special(tokenizer: &Tokenizer, format: ChatFormat, token: &str) -> Result<u32, CliError> {
    tokenizer.token_id(token).ok_or_else(|| {
        CliError::Tokenizer(format!(
            "the {format:?} chat format needs the special token `{token}`, which the \
             tokenizer does not have (pick another --chat-format, or the model's own tokenizer)"
        ))
    })
}
