//! kvferry host: loads planners, plans and validates transfers, moves the bytes.
//!
//! ```text
//!   plugin dir ──► registry ──► bound planner ──► targets / check_peer
//!                                   │
//!   slot tables ──► describer rows ─┴─► pair ──► validate + coalesce ──► ValidatedPlan
//!                                                                           │
//!                                                  local executor / UCX put ◄┘
//! ```

#![deny(missing_docs)]

pub mod bench;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod demo;
pub mod transfer;
