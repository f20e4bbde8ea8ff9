//! The default planner: mappers, pairing, refusals, targets, state and the byte oracle.
//!
//! One test binary for this crate's integration tests (each file below is a module), so
//! they link once; run one file's tests with `cargo test -p <crate> --test suite <file>::`.

mod common;
mod mappers;
mod oracle;
mod pairing;
mod plugin;
mod refusals;
mod state;
mod targets;
