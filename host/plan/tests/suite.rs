//! Plan validation, compression and bounce planning at every boundary.
//!
//! One test binary for this crate's integration tests (each file below is a module), so
//! they link once; run one file's tests with `cargo test -p <crate> --test suite <file>::`.

mod bounce;
mod plan_boundaries;
mod plan_compressed;
mod plan_validate;
