//! The wire protocol: bounded fuzzing of frames and handshakes, and simulated sessions.
//!
//! One test binary for this crate's integration tests (each file below is a module), so
//! they link once; run one file's tests with `cargo test -p <crate> --test suite <file>::`.

mod decode_machine;
mod exec_machine;
mod fuzz;
mod joint;
mod prefill_machine;
mod seeded;
mod simulated;
