//! The kvferry command line and its servers, the quick part: every command's arguments and
//! errors, `doctor`, the out-of-tree template, serve's memory bounds, the controller's
//! ownership rules, one two-process transfer over tcp and shm, every byte checked, and the
//! servers' Prometheus metrics scraped during a demo.
//! The long server runs are in `tests/full.rs`.
//!
//! One test binary (each file below is a module), so they link once; run one file's tests
//! with `cargo test -p kvferry-cli --test suite <file>::`.

mod cli;
mod control_ownership;
mod doctor;
mod gpu_check;
mod metrics;
mod models;
mod registry_template;
mod serve_memory;
mod support;
mod transfer_wire;
