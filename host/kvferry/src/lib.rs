//! kvferry: move a request's KV cache from a prefill rank to a decode rank, the bytes chosen
//! by a model-specific planner loaded at run time. This crate is the one an engine names: the
//! C API, the Python package and the examples are built on it alone.
//!
//! - [`agent`]: one agent per rank over the engine's own KV memory — [`agent::PrefillAgent`],
//!   [`agent::DecodeAgent`], or [`agent::Agent`] when the role is a run-time value — with its
//!   requests ([`agent::SendChunk`], [`agent::Expect`]), events and errors.
//! - [`config`]: the versioned configuration every binding reads, JSON or TOML, with the environment
//!   filling what it leaves out ([`config::load`], [`config::load_file`]).
//! - [`planning`]: kvferry's plans for an engine that moves bytes with another transfer layer
//!   ([`planning::PairPlanner`]).
//! - [`registry`]: the planners found in plugin directories, and binding one.
//! - [`metrics`] and [`logging`]: the Prometheus text and the one logging setup.
//! - [`abi`]: the planner ABI's types (rank descriptions, page tables, slot tables).
//! - [`ucx`]: the UCX types kvferry's calls and errors name.

#![deny(missing_docs)]

pub mod config;
mod install;
pub mod planning;

pub use install::{default_plugin_dirs, installed_planners, library_file};
pub use kvferry_transfer::{MemoryKind, Role, Transport, TransportSpec, Transports};
pub use kvferry_transfer::{logging, metrics};
/// Which UCX library this process loaded, and from where (what `kvferry doctor` reports).
pub use kvferry_ucx::library as ucx_library;

/// Whether this process can load the CUDA driver (`libcuda`), as VRAM pools need: what
/// `kvferry doctor` reports.
#[cfg(feature = "cuda")]
pub fn cuda_driver_present() -> bool {
    kvferry_transfer::cuda_driver_present()
}

/// The configuration version [`config::load`] reads (`"version": 1`).
pub const CONFIG_VERSION: u32 = 1;

/// The per-rank agent (see [`kvferry_transfer::agent`]), and every type its calls, events
/// and errors name.
pub mod agent {
    pub use kvferry_platform::HostBudget;
    #[cfg(feature = "cuda")]
    pub use kvferry_transfer::CudaError;
    /// The type of [`AgentConfig::harness`](kvferry_transfer::agent::AgentConfig::harness),
    /// which the test harness sets.
    #[doc(hidden)]
    pub use kvferry_transfer::agent::HarnessOptions;
    pub use kvferry_transfer::agent::{
        Agent, AgentConfig, AgentMetadata, AgentStats, BounceConfig, BounceMode, CallError,
        DecodeAgent, Event, ExecConfig, Expect, FAILURE_KINDS, FailureKind, Integrity,
        LATENCY_BUCKETS, LoadSecretError, PeerIdentity, PoolKey, PrefillAgent, RankDescriptor,
        Secret, SecretError, SendChunk, StartError, WireError, load_secret,
    };
    pub use kvferry_transfer::{BindError, MemoryError, RequestStats, SpawnError, Stages};
}

/// Planners in plugin directories, and binding one to a deployment.
pub mod registry {
    pub use kvferry_loader::{
        BindError, BoundPlanner, Candidate, CandidateRefusal, LoadError, PLANNER_ENV,
        PLUGIN_DIR_ENV, PlannerInfo, Registry, SkippedFile, plugin_dirs, select_planner_id,
    };
}

/// The UCX types that kvferry's calls and errors name: UCX's errors ([`ucx::Error`], in
/// [`agent::StartError`] and [`agent::MemoryError`]) and the contexts and error modes a
/// [`Transport`] makes.
pub mod ucx {
    pub use kvferry_ucx::{
        Context, ContextBuilder, Error, ErrorMode, KeyFormatError, KeyLayout, MemoryType,
        MemoryTypes, Op, Status,
    };
}

/// The planner ABI ([`kvferry_planner_abi`]): what a rank advertises, its page table, a
/// request's slot tables, and the planner interface itself.
pub mod abi {
    pub use kvferry_planner_abi::*;
}

/// Installs kvferry's logger to stderr once per process: `KVFERRY_LOG`, or `RUST_LOG`,
/// chooses what it logs, warnings by default ([`logging`]).
pub fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        logging::init_stderr("warn");
    });
}
