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
//! - [`logging`] and [`metrics`]: the one logging setup and the Prometheus text.
//!
//! Everything else is this crate's own: the pools a rank's peers write (`memory`, host or
//! CUDA), one UCX worker and progress thread per rank executing write jobs (`rank`), UCX
//! transports and devices (`transport`), one connection's reader and writer (`conn`), bounce
//! transfers (`bounce`), the bench's memcpy baseline (`copy`). A test and benchmark harness
//! (`kvferry-harness`, this crate's own tests) reaches the parts it drives through the
//! `harness` module, behind the `harness` feature and hidden from the docs: no engine names
//! it, and bench machinery (plan recording and replay, the memcpy baseline) is not part of
//! the agent an engine builds.
//!
//! This crate never allocates slots, fills or checks pool contents, or exits the process:
//! the caller owns which slots a request uses and what they hold, and hears through the
//! request's terminal event when kvferry is done with them. Faults are injected in tests
//! through the harness's `WriteHook`, never through production fields.

#![deny(missing_docs)]
// With the harness's items reachable, every other `pub` item must be reachable from the
// crate root too: what is not is `pub(crate)`.
#![cfg_attr(feature = "harness", warn(unreachable_pub))]

pub mod agent;
mod bounce;
mod conn;
#[cfg(feature = "harness")]
mod copy;
#[cfg(feature = "cuda")]
mod cuda;
mod integrity;
pub mod logging;
mod memory;
pub mod metrics;
mod outcome;
mod rank;
mod streaming;
mod sync;
mod transport;

#[cfg(feature = "cuda")]
pub use cuda::CudaError;
pub use kvferry_protocol::Role;
pub use memory::{BindError, MemoryError, MemoryKind};
pub use transport::{Transport, TransportSpec, Transports};

pub use outcome::{RequestStats, Stages};

pub use rank::SpawnError;

/// Whether this process can load the CUDA driver (`libcuda`), as VRAM pools need.
#[cfg(feature = "cuda")]
pub fn cuda_driver_present() -> bool {
    cuda::driver_present()
}

/// What the test and benchmark harness (`kvferry-harness`, `kvferry bench`) and this crate's
/// tests drive beneath the agent: connections, pools, rank threads, the memcpy baseline, the
/// fault hook and the bench's statistics. Not an engine's API, and not stable.
#[cfg(feature = "harness")]
#[doc(hidden)]
pub mod harness {
    pub use crate::outcome::{BenchStats, PairFragments, PoolFragment};

    /// One connection's handshake, reader and writer.
    pub mod conn {
        pub use crate::conn::{
            HANDSHAKE_TIMEOUT, Outbox, Pending, Reader, Secured, Unproven, Writer, drain,
            secure_accept, secure_dial, spawn_reader, spawn_writer,
        };
    }

    /// The bench's memcpy baseline.
    pub mod copy {
        pub use crate::copy::CopyArena;
    }

    /// A rank's pools.
    pub mod memory {
        #[cfg(feature = "cuda")]
        pub use crate::memory::check_cuda_device;
        pub use crate::memory::{CopyError, MemoryError, PoolAllocator, RankPools};
    }

    /// A rank's UCX worker thread and its write jobs.
    pub mod rank {
        pub use crate::rank::{
            PUT_WINDOW, RankThread, RemoteRank, ReplayJob, ReplayStats, WriteError, WriteHook,
            WriteJob, WriteStats,
        };
    }

    /// CUDA device pools.
    #[cfg(feature = "cuda")]
    pub mod cuda {
        pub use crate::cuda::{
            CudaDevice, CudaError, CudaPool, DeviceCopier, device_allocation_holds, device_count,
            driver_present, register_with_ucx, ucx_cuda_support,
        };
    }
}
