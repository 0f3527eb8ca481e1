//! Text ↔ token ids: a Hugging Face `tokenizer.json` (through the
//! `tokenizers` crate) or the built-in byte-level tokenizer of the tiny
//! preset (the 256 bytes, then a few special tokens).

use std::path::{Path, PathBuf};

use crate::CliError;

/// The byte tokenizer's special tokens, numbered from 256 in this order.
pub const BYTE_SPECIALS: &[&str] = &[
    "<|bos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|pad|>",
];

/// The file that marks a model directory as using the byte tokenizer.
pub const BYTE_MARKER: &str = "bastile-byte-tokenizer.json";

pub enum Tokenizer {
    Byte,
    Hf(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// The tokenizer of a model directory: its `tokenizer.json`, or the
    /// byte tokenizer where the directory says so; `None` when it has
    /// neither.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, CliError> {
        let json = dir.join("tokenizer.json");
        if json.is_file() {
            return Self::from_file(&json).map(Some);
        }
        Ok(dir.join(BYTE_MARKER).is_file().then_some(Self::Byte))
    }

    pub fn from_file(path: &Path) -> Result<Self, CliError> {
        if !path.is_file() {
            return Err(CliError::io(path, "no such tokenizer file"));
        }
        tokenizers::Tokenizer::from_file(path)
            .map(|t| Self::Hf(Box::new(t)))
            .map_err(|e| CliError::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// Ids of `text` as plain text (no special tokens added around it;
    /// special-token strings inside it are still recognized by an HF
    /// tokenizer).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, CliError> {
        match self {
            Self::Byte => Ok(text.bytes().map(u32::from).collect()),
            Self::Hf(t) => t
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| CliError::Tokenizer(format!("encoding {text:?}: {e}"))),
        }
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, CliError> {
        match self {
            Self::Byte => {
                let bytes: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Self::Hf(t) => t
                .decode(ids, true)
                .map_err(|e| CliError::Tokenizer(format!("decoding: {e}"))),
        }
    }

    /// The id of a special token, `None` when the tokenizer lacks it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match self {
            Self::Byte => BYTE_SPECIALS
                .iter()
                .position(|s| *s == token)
                .map(|i| 256 + i as u32),
            Self::Hf(t) => t.token_to_id(token),
        }
    }

    /// Tokens the tokenizer can produce (special tokens included).
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Byte => 256 + BYTE_SPECIALS.len(),
            Self::Hf(t) => t.get_vocab_size(true),
        }
    }

    /// The id batches are padded with (masked from the loss, and after
    /// every real token, so causal attention never reads it).
    pub fn pad_id(&self) -> u32 {
        match self {
            Self::Byte => self.token_id("<|pad|>").expect("a byte special"),
            Self::Hf(t) => t.get_padding().map(|p| p.pad_id).unwrap_or(0),
        }
    }

    /// Fails unless every id the tokenizer produces has a row in a model
    /// of `vocab` tokens (models may have more rows than the tokenizer
    /// uses, never fewer).
    pub fn check_fits(&self, vocab: usize) -> Result<(), CliError> {
        let n = self.vocab_size();
        if n > vocab {
            return Err(CliError::Tokenizer(format!(
                "the tokenizer has {n} tokens but the model's vocab_size is {vocab}: \
                 they do not belong together"
            )));
        }
        Ok(())
    }

    /// Writes what a model directory needs to find this tokenizer again:
    /// the byte marker, or the HF tokenizer files of `source` (copied).
    pub fn save_beside(&self, source: Option<&Path>, dir: &Path) -> Result<(), CliError> {
        match self {
            Self::Byte => {
                let path = dir.join(BYTE_MARKER);
                let text = serde_json::json!({ "type": "byte", "specials": BYTE_SPECIALS });
                std::fs::write(&path, text.to_string()).map_err(|e| CliError::io(&path, e))
            }
            Self::Hf(t) => {
                for name in TOKENIZER_FILES {
                    if let Some(src) = source.map(|s| s.join(name)).filter(|p| p.is_file()) {
                        let to = dir.join(name);
                        std::fs::copy(&src, &to).map_err(|e| CliError::io(&to, e))?;
                    }
                }
                let path: PathBuf = dir.join("tokenizer.json");
                if !path.is_file() {
                    t.save(&path, false)
                        .map_err(|e| CliError::io(&path, e.to_string()))?;
                }
                Ok(())
            }
        }
    }
}

/// The files HF keeps beside a checkpoint for its tokenizer and chat
/// format.
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
];
