//! Qwen3, Llama 3.x and GPT-OSS in Burn (models land here).
