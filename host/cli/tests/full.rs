//! The kvferry command line and its servers, the long runs: transfers across model presets,
//! deployments and transports, injected faults on either side, the benchmark's paths, and
//! `conform` over the planners — two-process transfers checked byte for byte. Not in
//! `scripts/test --fast`.
//!
//! One test binary (each file below is a module), so they link once; run one file's tests
//! with `cargo test -p kvferry-cli --test full <file>::`.

mod conform;
mod support;
mod transfer_bench;
mod transfer_faults;
mod transfer_models;
mod transfer_receiver_faults;
