//! The command's tests, linked into a single test binary.

mod chat_and_data;
mod finetune;
