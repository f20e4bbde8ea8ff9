//! kvferry-transfer: the transfer agent an engine embeds — one [`agent::Agent`] per rank, in
//! the engine's process, moving a request's KV cache from prefill ranks to decode ranks with
//! UCX RMA writes, planned by the bound planner and validated before a byte moves.
//!
//! ```text
//!  prefill engine ──send──► Agent (prefill)  ◄── side channel ──  Agent (decode)     ◄──expect── decode engine
//!  (source slots hold the KV)  plan_transfer per piece              one claim per writer rank
//!                              rank thread: put × n, flush ══UCX RMA══► (into the engine's pools)
//!  poll(): Sent ◄──────────────────────── Completion ──────────────────► poll(): Received
//! ```
//!
//! - [`agent`]: the per-rank agent: side channel (authenticated, bounded), requests, events,
//!   cancel, leases, timeouts, peer failure.
//! - [`memory`]: the pools a rank's peers write, registered from the engine's memory (or
//!   allocated by UCX for a host that lets kvferry own it); host or CUDA (module `cuda`, feature `cuda`).
//! - [`rank`]: one UCX worker and progress thread per rank, executing write jobs.
//! - [`transport`]: UCX transports and devices; [`conn`]: one connection's writer.
//! - [`copy`]: the bench's memcpy baseline over buffers shaped like the pools.
//! - [`bounce`]: bounce transfers — a receiver's arena, a sender's staging buffer, the gather
//!   thread.
//!
//! This crate never allocates slots, fills or checks pool contents, or exits the process:
//! the caller owns which slots a request uses and what they hold, and hears through the
//! request's terminal event when kvferry is done with them. Faults are injected in tests
//! through [`rank::WriteHook`], never through production fields.

#![deny(missing_docs)]

pub mod agent;
pub mod bounce;
pub mod budget;
pub mod conn;
pub mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
mod integrity;
pub mod logging;
pub mod memory;
pub mod metrics;
pub mod outcome;
pub mod rank;
mod sync;
pub mod transport;

pub use kvferry_protocol::Role;
pub use memory::MemoryKind;
pub use transport::{Transport, TransportSpec, Transports};

pub use outcome::{BenchStats, PairFragments, PoolFragment, RequestStats, Stages};
