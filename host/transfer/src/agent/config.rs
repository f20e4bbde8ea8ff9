//! What an agent is: [`AgentConfig`] and its defaults.

use std::time::Duration;

use kvferry_planner_abi::RankInfo;
use kvferry_protocol::Role;

use crate::transport::{Transport, TransportSpec};

#[cfg(doc)]
use super::{Agent, BounceMode, FailureKind};
use super::{BounceConfig, ExecConfig, HANDSHAKE_TIMEOUT, Secret, record};

/// Side-channel connections a prefill rank serves at once by default.
pub const MAX_CONNECTIONS: usize = 256;

/// What an agent is: its rank, its memory, its planner, its side channel, its limits.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The instance this rank belongs to.
    pub instance: String,
    /// Prefill (sends) or decode (receives).
    pub role: Role,
    /// What the rank holds, for messages (e.g. `llama-3-70b tp4`).
    pub label: String,
    /// This rank's description; its page table's pools are the engine's memory.
    pub rank: RankInfo,
    /// UCX transports and network devices (default `tcp` on `lo`; across hosts `tcp` with
    /// devices, or `auto`).
    pub transport: TransportSpec,
    /// Side-channel listen address of a prefill rank (`0.0.0.0:0`: every interface, an
    /// ephemeral port). Decode ranks do not listen.
    pub listen: String,
    /// The host to advertise in [`Agent::endpoint`] (default: the listen address, or, when
    /// that is unspecified, the first non-loopback address of an interface that is up).
    pub advertise: Option<String>,
    /// The deployment's shared secret.
    pub secret: Secret,
    /// How long a request may take from `expect` (decode) or its first claim (prefill).
    pub timeout: Duration,
    /// How long a prefill-side `send` waits for its first receiver before it fails (a
    /// receiver's [`Agent::hold`] runs it again, up to ten leases after the send).
    pub lease: Duration,
    /// How long a peer may stay silent (keep-alives flow every third of it) before it is
    /// declared gone and its requests fail.
    pub peer_timeout: Duration,
    /// How long a side-channel connection may take to be authenticated and vetted, on
    /// either side (default 5 s; hosts whose cores are oversubscribed need more).
    pub handshake_timeout: Duration,
    /// How long one planner call may take.
    pub planner_timeout: Duration,
    /// Open side-channel connections served at once (prefill ranks).
    pub max_connections: usize,
    /// The most bytes of request descriptions kept for requests not sent yet (context
    /// ranks), from all peers together.
    pub max_stashed_bytes: usize,
    /// The CUDA device of the rank's VRAM pools (cargo feature `cuda`; needed when the page
    /// table has any).
    pub cuda_device: Option<usize>,
    /// What the test and benchmark harness sets (a fault hook, plan recording): the default
    /// for an engine, and reachable only through the `harness` feature.
    #[doc(hidden)]
    pub harness: record::HarnessOptions,
    /// Bounce transfers (see [`BounceMode`]): the mode, the decode rank's arena and
    /// the prefill rank's staging buffer. Default: auto, 256 MiB arena, 2 × 8 MiB staging.
    pub bounce: BounceConfig,
    /// Decode ranks: ask every writer for a digest of each piece and check it against
    /// the bytes that landed before `Received` (a mismatch fails the request as
    /// [`FailureKind::Integrity`]). Prefill ranks compute what their receivers ask whatever
    /// this says. Host pools only. Default: off.
    pub integrity: Option<kvferry_protocol::Integrity>,
    /// A prefill rank's executor timing rules: when a window of puts left in flight to a
    /// receiver that stopped draining is given up, and how often a blocked job rechecks its
    /// receiver ([`ExecConfig`]). The defaults suit every deployment; tests shorten them.
    pub executor: ExecConfig,
}

impl AgentConfig {
    /// A configuration with the defaults: listen on `0.0.0.0:0`, 30 s request timeout,
    /// 60 s lease, 10 s peer timeout, 5 s planner deadline, 256 connections, 64 MiB stash.
    pub fn new(instance: &str, role: Role, rank: RankInfo, secret: Secret) -> Self {
        Self {
            instance: instance.to_string(),
            role,
            label: String::new(),
            rank,
            transport: Transport::Tcp.into(),
            listen: "0.0.0.0:0".into(),
            advertise: None,
            secret,
            timeout: Duration::from_secs(30),
            lease: Duration::from_secs(60),
            peer_timeout: Duration::from_secs(10),
            handshake_timeout: HANDSHAKE_TIMEOUT,
            planner_timeout: Duration::from_secs(5),
            max_connections: MAX_CONNECTIONS,
            max_stashed_bytes: 64 << 20,
            cuda_device: None,
            harness: record::HarnessOptions::default(),
            bounce: BounceConfig::default(),
            integrity: None,
            executor: ExecConfig::default(),
        }
    }
}
