//! Why an agent could not start, and why a call was refused.

use kvferry_planner_abi::PlanError;
use kvferry_protocol::Role;

use crate::memory::MemoryError;
use crate::rank::SpawnError;
use crate::transport::TransportSpec;

/// Why an agent could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration is inconsistent.
    #[error("agent config: {0}")]
    Config(String),
    /// No UCX context.
    #[error("cannot create the UCX context for {transport}{hint}")]
    Context {
        /// The transport.
        transport: TransportSpec,
        /// UCX's error.
        source: kvferry_ucx::Error,
        /// What to do about it, when kvferry can tell ([`TransportSpec::context_failure_hint`]).
        hint: String,
    },
    /// The engine's pools could not be registered.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The planner refuses this rank.
    #[error("planner {planner} refuses this rank")]
    Planner {
        /// The planner.
        planner: String,
        /// Its reason.
        source: PlanError,
    },
    /// No UCX worker.
    #[error("cannot create the UCX worker")]
    Worker(#[source] kvferry_ucx::Error),
    /// The rank thread could not start.
    #[error(transparent)]
    Spawn(#[from] SpawnError),
    /// The side channel could not listen, or no address can be advertised.
    #[error("side channel: {0}")]
    Listen(String),
    /// A thread or descriptor could not be made.
    #[error("agent resources")]
    Io(#[from] std::io::Error),
}

/// Why an agent call was refused. Nothing was taken: no event will follow.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// The call does not fit this agent's role.
    #[error("{call} is for {needed} ranks; this one is a {role} rank")]
    Role {
        /// The call.
        call: &'static str,
        /// The role it needs.
        needed: Role,
        /// This agent's.
        role: Role,
    },
    /// The request's parameters are wrong.
    #[error("request {request}: {reason}")]
    Invalid {
        /// The request.
        request: u64,
        /// What is wrong.
        reason: String,
    },
    /// The id is in use.
    #[error("request {request} already exists")]
    Duplicate {
        /// The request.
        request: u64,
    },
    /// No such request (never seen, or ended).
    #[error("request {request} is unknown or has ended")]
    Unknown {
        /// The request.
        request: u64,
    },
    /// Peer metadata that cannot be used.
    #[error("peer metadata: {0}")]
    Metadata(String),
    /// The agent is shutting down.
    #[error("the agent has stopped")]
    Stopped,
}
