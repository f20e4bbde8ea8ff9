//! kvferry-transfer: the transceiver — moves a request's KV cache between two processes with
//! UCX RMA writes, planned by the bound planner and validated before a byte moves.
//!
//! ```text
//!  engine / CLI ──add_request──► ContextServer                GenerationServer ◄──expect── engine / CLI
//!  (source slots hold the KV)     │                  ◄──RequestData───┤ one per (receiver, target)
//!                                 │ plan_transfer per piece           │
//!                                 │ rank thread: put × n, flush ═════►│ (UCX RMA into its pools)
//!                                 │                  ───Completion───►│ after the flush
//!                                 │ release → slots free callback     │ all is_last Ok → on_done
//! ```
//!
//! - [`instance`]: one process holding every rank of an instance: UCX context, pools in host
//!   or CUDA memory ([`memory`]) laid out by the caller's page tables, planners, one progress
//!   thread per rank ([`rank`]).
//! - [`sender`] / [`receiver`]: the two sides of the protocol ([`kvferry_protocol`]);
//!   [`server`] accepts peer connections for a context instance; [`conn`] runs one
//!   connection's writer.
//!
//! This crate never allocates slots, fills or checks pool contents, or exits the process:
//! the caller owns which slots a request uses and what they hold, and hears when kvferry is
//! done with them (the `on_free` and `on_done` callbacks). Faults are injected in tests
//! through [`rank::WriteHook`], never through production fields.

#![deny(missing_docs)]

pub mod agent;
pub mod budget;
pub mod conn;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod instance;
pub mod memory;
pub mod outcome;
pub mod rank;
pub mod receiver;
pub mod sender;
pub mod server;
mod stash;

pub use instance::{
    Instance, InstanceConfig, PreparedInstance, Transport, TransportSpec, Transports,
};
pub use kvferry_protocol::{InstanceInfo, PeerMessage, Role};
pub use memory::MemoryKind;
pub use receiver::{Expect, GenerationServer, RequestError};
pub use sender::{ContextServer, SourceRequest};
pub use server::{PeerListener, ServeError};

pub use outcome::{BenchStats, OnFree, PairFragments, PoolFragment, RequestStats};
