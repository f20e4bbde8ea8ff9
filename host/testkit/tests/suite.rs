//! The testkit: model presets, the layout builder and the byte oracle.
//!
//! One test binary for this crate's integration tests (each file below is a module), so
//! they link once; run one file's tests with `cargo test -p <crate> --test suite <file>::`.

mod builder;
mod hf_configs;
mod layout_presets;
mod oracle_scenarios;
mod oracle_tags;
