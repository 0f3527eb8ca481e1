//! Instruction data sets in JSONL, one example a line: either
//! `{"instruction": …, "input"?: …, "output": …}` (Alpaca style) or
//! `{"messages": [{"role": …, "content": …}, …]}` (chat style). Blank
//! lines are skipped; any other bad line is an error naming its number.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::CliError;
use crate::chat::{self, ChatFormat, IGNORE, Message};
use crate::tokenizer::Tokenizer;

/// The data set shipped with the command: a tiny model learns it in a
/// minute on a CPU (answers in a fixed, recognizable style).
pub const EMBEDDED: &str = include_str!("../data/tiny.jsonl");

const ROLES: &[&str] = &["system", "user", "assistant", "developer"];

/// Other fields (ids, categories, …) are ignored, as data sets carry them.
#[derive(Deserialize)]
struct Alpaca {
    instruction: String,
    #[serde(default)]
    input: String,
    output: String,
}

#[derive(Deserialize)]
struct Chat {
    messages: Vec<Message>,
}

/// The conversations of a JSONL text; `path` names it in errors.
pub fn parse(text: &str, path: &Path) -> Result<Vec<Vec<Message>>, CliError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let bad = |message: String| CliError::Data {
            path: path.into(),
            line: i + 1,
            message,
        };
        if line.trim().is_empty() {
            continue;
        }
        let value: Value =
            serde_json::from_str(line).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let messages = if value.get("messages").is_some() {
            let chat: Chat = serde_json::from_value(value)
                .map_err(|e| bad(format!("invalid `messages`: {e}")))?;
            chat.messages
        } else if value.get("instruction").is_some() {
            let a: Alpaca = serde_json::from_value(value)
                .map_err(|e| bad(format!("invalid instruction example: {e}")))?;
            let prompt = if a.input.is_empty() {
                a.instruction
            } else {
                format!("{}\n\n{}", a.instruction, a.input)
            };
            vec![
                Message::new("user", &prompt),
                Message::new("assistant", &a.output),
            ]
        } else {
            return Err(bad(
                "expected an object with `messages` or with `instruction` and `output`".into(),
            ));
        };
        if let Some(m) = messages.iter().find(|m| !ROLES.contains(&m.role.as_str())) {
            return Err(bad(format!(
                "unknown role `{}` (expected one of {})",
                m.role,
                ROLES.join(", ")
            )));
        }
        if !messages
            .iter()
            .any(|m| m.role == "assistant" && !m.content.is_empty())
        {
            return Err(bad("no non-empty assistant message to train on".into()));
        }
        out.push(messages);
    }
    if out.is_empty() {
        return Err(CliError::Data {
            path: path.into(),
            line: 0,
            message: "the data set has no examples".into(),
        });
    }
    Ok(out)
}

/// Reads and parses a JSONL file.
pub fn load(path: &Path) -> Result<Vec<Vec<Message>>, CliError> {
    let text = std::fs::read_to_string(path).map_err(|e| CliError::io(path, e))?;
    parse(&text, path)
}

/// One tokenized example.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Example {
    pub ids: Vec<u32>,
    pub labels: Vec<i64>,
}

/// Tokenized examples and what had to be changed to fit the context.
#[derive(Debug, Default)]
pub struct Tokenized {
    pub examples: Vec<Example>,
    /// Examples cut to `max_len` tokens.
    pub truncated: usize,
    /// Examples with nothing left to train on after the cut (dropped).
    pub dropped: usize,
}

/// Every conversation in `format`, cut to `max_len` tokens.
pub fn tokenize(
    conversations: &[Vec<Message>],
    format: ChatFormat,
    tokenizer: &Tokenizer,
    max_len: usize,
) -> Result<Tokenized, CliError> {
    let mut out = Tokenized::default();
    for messages in conversations {
        let (mut ids, mut labels) = chat::encode(format, tokenizer, messages, false)?;
        if ids.len() > max_len {
            ids.truncate(max_len);
            labels.truncate(max_len);
            out.truncated += 1;
        }
        // The loss predicts labels[t + 1] from position t: position 0's
        // label never counts.
        if labels.iter().skip(1).all(|&l| l == IGNORE) {
            out.dropped += 1;
            continue;
        }
        out.examples.push(Example { ids, labels });
    }
    Ok(out)
}
