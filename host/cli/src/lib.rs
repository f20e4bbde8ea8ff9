//! kvferry-cli: the `kvferry` command line, and the test harness around the transfer library
//! it is one user of: `serve` (an instance of a model preset, its slots, prefill and checks
//! driven over a control protocol), `demo` and `bench` (a pair of `serve` processes driven
//! end to end), and the clients the tests share.
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
pub mod doctor;
pub mod drive;
pub mod metrics_http;
pub mod overlap;
pub mod progress;
pub mod serve;
pub mod slots;
pub mod verify;

pub use client::{Client, ClientError};
