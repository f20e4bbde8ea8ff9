//! The UCX wrapper against real UCX: puts, active messages, deadlines, keys and faults.
//!
//! One test binary for this crate's integration tests (each file below is a module), so
//! they link once; run one file's tests with `cargo test -p <crate> --test suite <file>::`.

mod am_roundtrip;
mod cancel_safety;
mod common;
mod garbage_address;
mod ownership;
mod peer_failure;
mod put_allocated;
mod put_deadline;
mod put_registered;
mod rkey_fuzz;
mod rkey_range;
mod shm_owner;
mod wakeup;
