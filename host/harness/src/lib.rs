//! kvferry-harness: the test and benchmark harness around the transfer library, which it
//! drives as an engine would and beneath (`kvferry_transfer::harness`): `serve` (an instance
//! of a model, its slots, prefill and checks driven over a control protocol), `demo` and
//! `bench` (a pair of `serve` processes driven end to end), and the clients the tests share.
//! The `kvferry` command line reaches it as `kvferry serve`, `demo` and `bench`; no engine
//! links it.
//!
//! ```text
//!   plugin dir ──► kvferry-loader ──► bound planner ──► kvferry-transfer (UCX puts)
//!                                                         ▲
//!   kvferry demo/bench ══control══► kvferry serve ────────┘  (+ kvferry-testkit: fill, check)
//! ```

#![deny(missing_docs)]

pub mod bench;
pub mod client;
pub mod control;
pub mod demo;
pub mod drive;
pub mod grid;
pub mod metrics_http;
pub mod overlap;
pub mod serve;
pub mod slots;
pub mod verify;

pub use client::{Client, ClientError};
/// What this process may still allocate (`serve` checks its host pools against it).
pub use kvferry_platform::HostBudget;
