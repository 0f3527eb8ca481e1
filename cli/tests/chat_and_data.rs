//! Chat rendering, data-set parsing, truncation and sampling: the parts of
//! `bastile finetune` / `generate` that decide what the model is trained
//! on and what it says.

use std::path::Path;

use bastile_cli::CliError;
use bastile_cli::batches::{Batcher, Sampler, pack, pack_rows, packed_rows, pad};
use bastile_cli::chat::{self, ChatFormat, IGNORE, Message};
use bastile_cli::data;
use bastile_cli::generate::pick;
use bastile_cli::tokenizer::Tokenizer;
use rand::SeedableRng;
use rand::rngs::StdRng;

fn bytes(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

#[test]
fn byte_format_trains_on_the_reply_and_its_end_only() {
    let t = Tokenizer::Byte;
    let id = |s| t.token_id(s).unwrap();
    let messages = [Message::new("user", "hi"), Message::new("assistant", "yo")];
    let (ids, labels) = chat::encode(ChatFormat::Byte, &t, &messages, false).unwrap();
    let mut want = vec![id("<|bos|>"), id("<|user|>")];
    want.extend(bytes("hi"));
    want.extend([id("<|end|>"), id("<|assistant|>")]);
    let prompt_len = want.len();
    want.extend(bytes("yo"));
    want.push(id("<|end|>"));
    assert_eq!(ids, want);
    let mut want_labels = vec![IGNORE; prompt_len];
    want_labels.extend(want[prompt_len..].iter().map(|&i| i as i64));
    assert_eq!(labels, want_labels);
    // The generation prompt ends in the reply's header, nothing trained.
    let (prompt, labels) = chat::encode(ChatFormat::Byte, &t, &messages[..1], true).unwrap();
    assert_eq!(prompt, want[..prompt_len]);
    assert!(labels.iter().all(|&l| l == IGNORE));
    assert_eq!(chat::stop_ids(ChatFormat::Byte, &t), vec![id("<|end|>")]);
}

/// A word-level HF tokenizer with ChatML's special tokens, written as a
/// `tokenizer.json` and loaded back.
fn chatml_tokenizer(dir: &Path) -> Tokenizer {
    let words = [
        "<unk>",
        "user",
        "assistant",
        "system",
        "hello",
        "there",
        "general",
        "kenobi",
    ];
    let vocab: serde_json::Map<String, serde_json::Value> = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), i.into()))
        .collect();
    let specials = ["<|im_start|>", "<|im_end|>"];
    let added: Vec<_> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({"id": words.len() + i, "content": s, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    Tokenizer::from_file(&path).unwrap()
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("bastile-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn chatml_masks_everything_but_the_assistant_reply() {
    let dir = temp_dir("chatml");
    let t = chatml_tokenizer(&dir);
    let (start, end) = (
        t.token_id("<|im_start|>").unwrap(),
        t.token_id("<|im_end|>").unwrap(),
    );
    let messages = [
        Message::new("user", "hello there"),
        Message::new("assistant", "general kenobi"),
    ];
    let (ids, labels) = chat::encode(ChatFormat::Chatml, &t, &messages, false).unwrap();
    let trained: Vec<u32> = ids
        .iter()
        .zip(&labels)
        .filter(|(_, l)| **l != IGNORE)
        .map(|(&i, &l)| {
            assert_eq!(i as i64, l, "a trained label is its own token");
            i
        })
        .collect();
    let reply = t.encode("general kenobi").unwrap();
    assert_eq!(trained[..trained.len() - 1], reply[..]);
    assert_eq!(*trained.last().unwrap(), end);
    assert_eq!(ids.iter().filter(|&&i| i == start).count(), 2);
    assert_eq!(t.decode(&trained).unwrap().trim(), "general kenobi");
    // The tokenizer lacks Llama 3's header tokens: a clear error.
    let e = chat::encode(ChatFormat::Llama3, &t, &messages, false).unwrap_err();
    assert!(e.to_string().contains("<|begin_of_text|>"), "{e}");
    // Saved beside a model, it is found again.
    let out = dir.join("model");
    std::fs::create_dir_all(&out).unwrap();
    t.save_beside(Some(&dir), &out).unwrap();
    let again = Tokenizer::from_dir(&out).unwrap().unwrap();
    assert_eq!(
        again.encode("hello there").unwrap(),
        t.encode("hello there").unwrap()
    );
}

fn parse(text: &str) -> Result<Vec<Vec<Message>>, CliError> {
    data::parse(text, Path::new("train.jsonl"))
}

#[test]
fn data_sets_parse_both_styles_and_report_bad_lines() {
    let ok = parse(concat!(
        "{\"instruction\": \"Add\", \"input\": \"1 2\", \"output\": \"3\", \"category\": \"math\"}\n",
        "\n",
        "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"},",
        " {\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n",
    ))
    .unwrap();
    assert_eq!(
        ok,
        vec![
            vec![
                Message::new("user", "Add\n\n1 2"),
                Message::new("assistant", "3")
            ],
            vec![
                Message::new("system", "be brief"),
                Message::new("user", "hi"),
                Message::new("assistant", "yo")
            ],
        ]
    );
    let cases = [
        (
            "{\"instruction\": \"a\", \"output\": \"b\"}\n{oops\n",
            ":2: invalid JSON",
        ),
        (
            "\n\n{\"instruction\": \"a\"}\n",
            ":3: invalid instruction example",
        ),
        ("{\"prompt\": \"a\"}\n", ":1: expected an object"),
        (
            "{\"messages\": [{\"role\": \"bot\", \"content\": \"x\"}]}\n",
            ":1: unknown role `bot`",
        ),
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n",
            ":1: no non-empty assistant message",
        ),
        ("\n  \n", "no examples"),
    ];
    for (text, want) in cases {
        let e = parse(text).unwrap_err().to_string();
        assert!(e.contains(want), "{text:?}: {e}");
        assert!(e.starts_with("train.jsonl"), "{e}");
    }
    let e = data::load(Path::new("/nonexistent/train.jsonl")).unwrap_err();
    assert!(matches!(e, CliError::Io { .. }), "{e:?}");
}

#[test]
fn long_examples_are_truncated_and_empty_ones_dropped() {
    let t = Tokenizer::Byte;
    let conversations = vec![
        vec![
            Message::new("user", "hi"),
            Message::new("assistant", "a long reply"),
        ],
        vec![
            Message::new("user", "a very long prompt indeed"),
            Message::new("assistant", "x"),
        ],
        vec![Message::new("user", "q"), Message::new("assistant", "r")],
    ];
    // Prompts: <bos><user>hi<end><assistant> = 6 tokens.
    let set = data::tokenize(&conversations, ChatFormat::Byte, &t, 9).unwrap();
    assert_eq!((set.truncated, set.dropped), (2, 1));
    assert_eq!(set.examples.len(), 2);
    assert_eq!(set.examples[0].ids.len(), 9);
    assert_eq!(set.examples[0].labels[6..], [97, 32, 108]); // "a l"
    assert_eq!(set.examples[1].ids.len(), 7); // q's example fits whole
}

#[test]
fn batches_pad_on_the_right_and_epochs_cover_every_example() {
    let a = data::Example {
        ids: vec![1, 2, 3],
        labels: vec![IGNORE, 2, 3],
    };
    let b = data::Example {
        ids: vec![4],
        labels: vec![4],
    };
    let p = pad(&[&a, &b], 9, 1);
    assert_eq!(p.shape, [2, 3]);
    assert_eq!(p.ids, vec![1, 2, 3, 4, 9, 9]);
    assert_eq!(p.labels, vec![IGNORE, 2, 3, 4, IGNORE, IGNORE]);
    assert_eq!(p.tokens, 4);
    // Length buckets: 3 tokens padded to 4.
    let p = pad(&[&a, &b], 9, 4);
    assert_eq!(p.shape, [2, 4]);
    assert_eq!(p.ids, vec![1, 2, 3, 9, 4, 9, 9, 9]);
    assert_eq!(
        p.labels,
        vec![IGNORE, 2, 3, IGNORE, 4, IGNORE, IGNORE, IGNORE]
    );
    assert_eq!(p.tokens, 4);
    let mut s = Sampler::new(5, 1);
    for _ in 0..3 {
        let mut epoch: Vec<usize> = s.by_ref().take(5).collect();
        epoch.sort();
        assert_eq!(epoch, vec![0, 1, 2, 3, 4]);
    }
}

#[test]
fn packing_fills_rows_with_whole_examples_each_its_own_document() {
    let example = |n: u32| data::Example {
        ids: (1..=n).collect(),
        labels: (1..=n).map(i64::from).collect(),
    };
    // Lengths 3, 4, 2, 5, 1 into two rows of 8: [3, 4] (2 does not fit),
    // [2, 5, 1]; nothing is left.
    let examples: Vec<data::Example> = [3, 4, 2, 5, 1].map(example).into();
    let length = |i: usize| examples[i].ids.len();
    let mut order = (0..5).peekable();
    assert_eq!(
        pack_rows(&mut order, length, 2, 8),
        vec![vec![0, 1], vec![2, 3, 4]]
    );
    assert!(order.peek().is_none());
    // One row at a time: the example that fits no row left stays first.
    let mut order = (0..5).peekable();
    assert_eq!(pack_rows(&mut order, length, 1, 8), vec![vec![0, 1]]);
    assert_eq!(order.peek(), Some(&2));
    assert_eq!(pack_rows(&mut order, length, 1, 8), vec![vec![2, 3, 4]]);
    assert!(pack_rows(&mut order, length, 1, 8).is_empty());
    assert_eq!(packed_rows(&[3, 4, 2, 5, 1], 8), 2);
    assert_eq!(packed_rows(&[8, 8, 1], 8), 3);

    // Positions restart with each example, whose first label is ignored;
    // the padding (to the longest row, rounded up to 4) is one more
    // document of ignored labels.
    let rows = vec![vec![&examples[0], &examples[1]], vec![&examples[4]]];
    let p = pack(&rows, 9, 4);
    assert_eq!(p.shape, [2, 8]);
    assert_eq!(p.ids, vec![1, 2, 3, 1, 2, 3, 4, 9, 1, 9, 9, 9, 9, 9, 9, 9]);
    let i = IGNORE;
    assert_eq!(
        p.labels,
        vec![i, 2, 3, i, 2, 3, 4, i, i, i, i, i, i, i, i, i]
    );
    assert_eq!(
        p.positions,
        Some(vec![0, 1, 2, 0, 1, 2, 3, 0, 0, 0, 1, 2, 3, 4, 5, 6])
    );
    assert_eq!(p.tokens, 8);

    // The batcher draws from the sampler until its rows are full, and
    // says how many examples it took; without packing it pads a batch of
    // examples.
    let batcher = Batcher {
        packing: true,
        rows: 2,
        row_len: 8,
        pad_id: 9,
        multiple: 1,
    };
    let mut order = (0..5).peekable();
    let (batch, taken) = batcher.next(&mut order, &examples).unwrap();
    assert_eq!((batch.shape, taken, batch.tokens), ([2, 8], 5, 15));
    assert!(batcher.next(&mut order, &examples).is_none());
    let padded = Batcher {
        packing: false,
        ..batcher
    };
    let mut order = (0..5).peekable();
    let (batch, taken) = padded.next(&mut order, &examples).unwrap();
    assert_eq!((batch.shape, taken, batch.positions), ([2, 4], 2, None));
}

#[test]
fn tokenizer_and_model_vocabularies_must_fit() {
    let e = Tokenizer::Byte.check_fits(200).unwrap_err().to_string();
    assert!(
        e.contains("262 tokens") && e.contains("vocab_size is 200"),
        "{e}"
    );
    Tokenizer::Byte.check_fits(264).unwrap();
}

#[test]
fn sampling_is_greedy_at_zero_and_follows_the_nucleus() {
    let mut rng = StdRng::seed_from_u64(7);
    let logits = [0.0f32, 2.0, 1.0, -1.0];
    assert_eq!(pick(&logits, 0.0, 0.9, &mut rng), 1);
    // p ≈ [0.087, 0.644, 0.237, 0.032]: top_p 0.6 keeps only token 1.
    for _ in 0..200 {
        assert_eq!(pick(&logits, 1.0, 0.6, &mut rng), 1);
    }
    // top_p 0.85 keeps tokens 1 and 2, in the ratio e^2 : e^1.
    let mut counts = [0usize; 4];
    let n = 40_000;
    for _ in 0..n {
        counts[pick(&logits, 1.0, 0.85, &mut rng) as usize] += 1;
    }
    assert_eq!(counts[0] + counts[3], 0, "{counts:?}");
    let share = counts[1] as f64 / n as f64;
    let want = 1.0 / (1.0 + (-1.0f64).exp());
    assert!((share - want).abs() < 0.01, "{share} vs {want}");
}
