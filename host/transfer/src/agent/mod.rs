//! The per-rank transfer agent an engine embeds: one agent per rank, in the engine's
//! process, over the engine's own KV memory — a [`PrefillAgent`] or a [`DecodeAgent`], whose
//! calls are those of its role, or an [`Agent`] of either role for code (the C API, Python)
//! that learns the role at run time.
//!
//! ```text
//!  prefill engine rank                              decode engine rank
//!  Agent (Role::Prefill) ◀── side channel (TCP) ──  Agent (Role::Decode)
//!   listens on endpoint()     Noise NNpsk0 handshake  dials the ranks its planner targets
//!   send(id, slots, range)    Metadata both ways      expect(id, peer, slots, range)
//!     ... chunks ...          ◀──── RequestData ────
//!   plan, put × n, flush ═══════ UCX RMA ════════════▶ (into the engine's pools)
//!                             ───── Completion ─────▶
//!   poll(): Sent                                      poll(): Received
//! ```
//!
//! - **Memory**: the [`RankInfo`]'s page table names the engine's pools (base, slot bytes,
//!   stride, slot count, DRAM or VRAM). [`Agent::start`] registers them with UCX once and
//!   never allocates, fills or primes them; VRAM pools (cargo feature `cuda`) must lie inside
//!   CUDA allocations on [`AgentConfig::cuda_device`], and the rank thread binds its context.
//!   Any model a page table can describe works; no preset is involved.
//! - **Metadata**: a prefill rank's side channel listens on [`AgentConfig::listen`] and
//!   advertises [`Agent::endpoint`] (never `0.0.0.0`, nor a loopback address unless it listens
//!   on one). A decode rank reaches it either through the endpoints passed with the
//!   request ([`Expect::endpoints`]) or through [`Agent::add_peer`] with the bytes of the
//!   peer's [`Agent::local_metadata`], for engines that exchange metadata on their own
//!   channel.
//! - **Trust**: every connection runs in a Noise channel keyed by the deployment's [`Secret`]
//!   (it never travels; everything after the handshake is encrypted and authenticated, and a
//!   relay holds no key), then both sides vet each other: planner and describer
//!   ids, page tables, pool keys, then the planner's `check_peer`. A refusal is cached for
//!   that peer's identity (instance, rank, epoch), so a restarted peer is vetted anew. Every
//!   field a peer sends is range-checked before use. A request is bound to the peer that
//!   claimed it: no other peer can claim, cancel or be written it.
//! - **Requests**: one id both engines agree on. Prefill: [`Agent::send`] (chunked prefill is
//!   a sequence of sends, the last marked `is_last`; a layer-wise send carries only the views
//!   computed so far, and the rest follow). Decode: [`Agent::expect`]. Either may
//!   come first. [`Agent::poll`] returns [`Event`]s; [`Agent::wake_fd`] is readable while
//!   events wait. Exactly one terminal event per request and side, and after it kvferry
//!   never touches that request's slots again: a decode-side `Failed` or `Cancelled` comes
//!   only once every writer has reported its last piece or its connection is gone.
//! - **Time**: requests time out ([`AgentConfig::timeout`]); a `send` nobody claims within the
//!   lease (run again by its receiver's [`Agent::hold`], up to ten leases after the send)
//!   fails and frees its slots (one its receiver cancelled, even before the `send`,
//!   ends at once as [`FailureKind::CancelledByPeer`]); peers that fall silent past
//!   [`AgentConfig::peer_timeout`] (keep-alives flow when idle) fail only their requests;
//!   planner calls run off the connection threads under [`AgentConfig::planner_timeout`].

mod alarm;
mod decode;
mod dispatch;
mod events;
mod planning;
mod prefill;
mod record;
mod typed;
mod worker_proof;

pub use crate::bounce::{BounceConfig, BounceMode};
pub use decode::Expect;
pub use events::{AgentStats, Event, FAILURE_KINDS, FailureKind, LATENCY_BUCKETS};
pub use kvferry_protocol::exec::ExecConfig;
pub use kvferry_protocol::{
    AgentMetadata, Integrity, PeerIdentity, PoolKey, RankDescriptor, Secret, SecretError, WireError,
};
/// The type of [`AgentConfig::harness`], named for the harness (its fields are of use only
/// with the `harness` feature).
#[doc(hidden)]
pub use record::HarnessOptions;
pub use typed::{DecodeAgent, PrefillAgent};

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_loader::BoundPlanner;
use kvferry_planner_abi::ffi::RVec;
use kvferry_planner_abi::{PlanError, RankInfo, SlotTable, TokenRange, ViewId};
use kvferry_protocol::Role;
use kvferry_ucx::{Context, Worker};

use crate::bounce::{Arena, Staging};
use crate::memory::{MemoryError, MemoryKind, RankPools};
#[cfg(feature = "harness")]
use crate::outcome::PairFragments;
use crate::rank::{RankThread, SpawnError};
#[cfg(feature = "harness")]
use crate::rank::{ReplayStats, WriteError};
pub(crate) use crate::sync::{SLOW_LOCK, lock};
use crate::transport::{Transport, TransportSpec};

use events::Events;
use planning::Planning;

/// Side-channel connections a prefill rank serves at once by default.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a TCP connect to a peer's side channel may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub(crate) use crate::conn::HANDSHAKE_TIMEOUT;

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

/// Where [`load_secret`] looks when no file is given.
pub const SECRET_ENV: &str = "KVFERRY_SECRET";
/// A file holding the previous secret during a change of secret: [`load_secret`] accepts
/// peers that still prove it (see [`Secret::also_accepting`]).
pub const PREVIOUS_SECRET_FILE_ENV: &str = "KVFERRY_PREVIOUS_SECRET_FILE";

/// Why [`load_secret`] found no usable secret.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadSecretError {
    /// The file could not be read.
    #[error("reading the secret file {}", path.display())]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file may be read by others than its owner.
    #[error(
        "the secret file {} is readable by its group or others (mode {mode:04o}); run \
         `chmod 600 {}`",
        path.display(),
        path.display()
    )]
    Exposed {
        /// The file.
        path: std::path::PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Neither a file nor the variable.
    #[error(
        "no secret: pass a secret file or set {SECRET_ENV} (at least {} bytes, the same for \
             every agent of the deployment)",
        kvferry_protocol::agent::MIN_SECRET_LEN
    )]
    Missing,
    /// Too short, or blank.
    #[error(transparent)]
    Invalid(#[from] kvferry_protocol::SecretError),
}

/// The deployment's secret as hosts take it: the bytes of `file` (a trailing newline
/// dropped; the file must not be readable by group or others), else of the environment
/// variable [`SECRET_ENV`]. During a change of secret, the file named by
/// [`PREVIOUS_SECRET_FILE_ENV`] holds the previous one, which is then accepted from peers too.
///
/// # Errors
///
/// See [`LoadSecretError`].
pub fn load_secret(file: Option<&std::path::Path>) -> Result<Secret, LoadSecretError> {
    let bytes = match file {
        Some(path) => read_secret_file(path)?,
        None => std::env::var_os(SECRET_ENV)
            .ok_or(LoadSecretError::Missing)?
            .into_encoded_bytes(),
    };
    let secret = Secret::new(bytes)?;
    match std::env::var_os(PREVIOUS_SECRET_FILE_ENV) {
        Some(previous) if !previous.is_empty() => {
            let bytes = read_secret_file(std::path::Path::new(&previous))?;
            Ok(secret.also_accepting(Secret::new(bytes)?))
        }
        _ => Ok(secret),
    }
}

fn read_secret_file(path: &std::path::Path) -> Result<Vec<u8>, LoadSecretError> {
    use std::os::unix::fs::PermissionsExt as _;
    let read = |source| LoadSecretError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mode = std::fs::metadata(path).map_err(read)?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(LoadSecretError::Exposed {
            path: path.to_path_buf(),
            mode: mode & 0o7777,
        });
    }
    let mut b = std::fs::read(path).map_err(read)?;
    while b.last().is_some_and(|c| *c == b'\n' || *c == b'\r') {
        b.pop();
    }
    Ok(b)
}

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

/// One chunk of a prefill-side request ([`Agent::send`]), or one layer-wise part of a chunk.
///
/// Chunked prefill: each send's tokens start where the previous send's ended. Layer-wise
/// sends: a send may carry only some of this rank's views (`views`, the layers computed so
/// far), and then the next sends repeat the same tokens with views not sent yet until every
/// view went (`views: None` on such a send carries all the rest). Each part leaves as soon
/// as it is claimed and planned, while the engine computes later layers; the receiver
/// completes once every view of every chunk landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendChunk {
    /// The request id both engines agree on.
    pub request: u64,
    /// The request's slot tables on this rank (one per layer group), as of this chunk:
    /// they cover every token up to `tokens.end`.
    pub tables: Vec<SlotTable>,
    /// The tokens this chunk makes available: `start` is where the previous chunk ended
    /// (or, while views of the previous chunk are not sent yet, that chunk's tokens again).
    pub tokens: TokenRange,
    /// The prompt's length.
    pub prompt_len: u64,
    /// Whether this is the request's last send: its tokens end at the prompt's end and no
    /// view is left to send after it (recurrent state rides on the views of the sends that
    /// end at the prompt's end).
    pub is_last: bool,
    /// Only this decode instance may claim it (`None`: the first to claim it owns it).
    pub to: Option<String>,
    /// The views (of this rank's page table) this send carries: `None`, every view not sent
    /// yet for these tokens.
    pub views: Option<Vec<ViewId>>,
}

/// Bookkeeping both sides share.
pub(crate) struct Inner {
    pub(crate) config: AgentConfig,
    pub(crate) info: RankInfo,
    pub(crate) bound: BoundPlanner,
    pub(crate) planner: Arc<dyn kvferry_planner_abi::TransferPlanner>,
    /// Kept for the agent's life: the rank thread reads and peers write these.
    pub(crate) _pools: Arc<RankPools>,
    /// A decode rank's bounce arena (peers write it, so it lives as long as the pools).
    pub(crate) arena: Option<Arc<Arena>>,
    /// A prefill rank's rank thread has a staging buffer: it can bounce.
    pub(crate) bounces: bool,
    pub(crate) thread: RankThread,
    pub(crate) metadata: kvferry_protocol::AgentMetadata,
    pub(crate) events: Events,
    /// The reaper's alarm clock.
    alarm: Arc<alarm::Alarm>,
    pub(crate) planning: Planning,
    pub(crate) dispatch: dispatch::Dispatch,
    /// Scatters bounced pieces (decode ranks with an arena).
    pub(crate) scatter: Option<dispatch::Dispatch>,
    pub(crate) next_peer: AtomicU64,
    pub(crate) stopped: AtomicBool,
    pub(crate) prefill: Mutex<prefill::State>,
    pub(crate) decode: Mutex<decode::State>,
    /// Plans kept for [`Agent::replay`] ([`AgentConfig::record_plans`]).
    pub(crate) recorded: Mutex<record::Recorder>,
    /// Worker challenges this (decode) rank's worker received, by session.
    pub(crate) challenges: Arc<worker_proof::Challenges>,
    _context: Arc<Context>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("instance", &self.config.instance)
            .field("rank", &self.info.instance_rank)
            .field("role", &self.config.role)
            .finish_non_exhaustive()
    }
}

impl Inner {
    /// The planner's `targets` for peer rank `them` and DP group `dp` (which ranks this
    /// rank writes, or is written by), asked on the planner worker under its deadline; or
    /// why there is no answer. Both sides keep the answer per peer rank.
    pub(crate) fn ask_targets(&self, them: &RankInfo, dp: u32) -> Result<Vec<u32>, String> {
        let planner = Arc::clone(&self.planner);
        let (me, them) = (self.info.clone(), them.clone());
        match self.planning.call(move || planner.targets(&me, &them, dp)) {
            Ok(Ok(t)) => Ok(t.ranks.to_vec()),
            Ok(Err(e)) => Err(format!("targets failed: {}", kvferry_plan::error_chain(&e))),
            Err(h) => Err(format!(
                "planner {} did not answer targets within {} ms",
                self.bound.id(),
                h.deadline.as_millis()
            )),
        }
    }

    pub(crate) fn me(&self) -> String {
        format!("{} rank {}", self.config.instance, self.info.instance_rank)
    }

    /// Planner and describer ids, the page table and the keys of a peer's description.
    pub(crate) fn vet_shape(&self, m: &kvferry_protocol::AgentMetadata) -> Result<(), String> {
        if m.planner_id != self.bound.id() || m.describer_id != self.bound.describer_id() {
            return Err(format!(
                "it binds planner {} (describer {}), {} binds {} (describer {})",
                m.planner_id,
                m.describer_id,
                self.me(),
                self.bound.id(),
                self.bound.describer_id()
            ));
        }
        let d = &m.rank;
        if d.info.planner_id != m.planner_id || d.info.describer_id != m.describer_id {
            return Err("its rank names another planner than its metadata".into());
        }
        d.info
            .page_table
            .validate()
            .map_err(|e| format!("invalid page table: {e}"))?;
        if d.pools.len() != d.info.page_table.pools.len() {
            return Err(format!(
                "{} pool keys for {} pools",
                d.pools.len(),
                d.info.page_table.pools.len()
            ));
        }
        for (p, (key, pool)) in d
            .pools
            .iter()
            .zip(d.info.page_table.pools.iter())
            .enumerate()
        {
            if key.base != pool.base || key.len < pool.footprint() {
                return Err(format!(
                    "pool {p}: its key covers {:#x}+{} but the pool spans {:#x}+{}",
                    key.base,
                    key.len,
                    pool.base,
                    pool.footprint()
                ));
            }
            if key.rkey.is_empty() {
                return Err(format!("pool {p}: empty remote key"));
            }
        }
        if d.worker_address.is_empty() {
            return Err("empty worker address".into());
        }
        if let Some(arena) = &d.bounce {
            if m.role != Role::Decode || arena.rkey.is_empty() || arena.len == 0 {
                return Err(format!(
                    "its bounce arena ({:#x}+{}, {}-byte key) is not one a {} rank may \
                     declare",
                    arena.base,
                    arena.len,
                    arena.rkey.len(),
                    m.role
                ));
            }
        }
        Ok(())
    }

    /// The planner's `check_peer`, under the planner deadline.
    pub(crate) fn check_peer(&self, peer: &RankInfo) -> Result<(), String> {
        let planner = Arc::clone(&self.planner);
        let (me, them) = (self.info.clone(), peer.clone());
        match self.planning.call(move || planner.check_peer(&me, &them)) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!(
                "{} (planner {}) refuses it: {}",
                self.me(),
                self.bound.id(),
                kvferry_plan::error_chain(&e)
            )),
            Err(hung) => Err(format!(
                "planner {} did not answer check_peer within {} ms",
                self.bound.id(),
                hung.deadline.as_millis()
            )),
        }
    }

    fn reap(self: &Arc<Self>) {
        self.planning.watch();
        match self.config.role {
            Role::Prefill => prefill::reap(self),
            Role::Decode => decode::reap(self),
        }
    }

    /// The earliest deadline the reaper knows of (the request machine's, the planner
    /// watchdog's), and how long it may sleep without missing one made meanwhile: the
    /// machine's horizon, or a planner call's deadline when shorter.
    fn deadlines(&self) -> (Option<Instant>, Duration) {
        let (machine, horizon) = match self.config.role {
            Role::Prefill => {
                let state = lock(&self.prefill);
                (state.machine.poll_timeout(), state.machine.horizon())
            }
            Role::Decode => {
                let state = lock(&self.decode);
                (state.machine.poll_timeout(), state.machine.horizon())
            }
        };
        let next = machine
            .into_iter()
            .chain(self.planning.next_deadline())
            .min();
        (next, horizon.min(self.planning.deadline()))
    }
}

/// One rank's transfer agent (see the module docs).
#[derive(Debug)]
pub struct Agent {
    inner: Arc<Inner>,
    endpoint: Option<String>,
}

impl Agent {
    /// Starts the agent: registers the engine's pools, builds the planner for this rank,
    /// starts the rank's UCX progress thread and, for a prefill rank, the side channel.
    ///
    /// # Safety
    ///
    /// Every pool of `config.rank.page_table` is engine-owned memory of the type it names: for
    /// as long as the agent lives, each pool's `[base, base + footprint)` is one live
    /// allocation (initialised host memory for DRAM; device memory on `config.cuda_device` for
    /// VRAM), not freed, whose bytes the engine leaves alone as the protocol requires —
    /// source slots unchanged from `send` until the request's terminal event, destination
    /// slots not relied on from `expect` until its terminal event. The agent writes nowhere
    /// else.
    ///
    /// # Errors
    ///
    /// See [`StartError`].
    pub unsafe fn start(config: AgentConfig, bound: BoundPlanner) -> Result<Agent, StartError> {
        check_config(&config, &bound)?;
        let memory = memory_kind(&config.rank);
        let context =
            config
                .transport
                .context_for(memory)
                .map_err(|source| StartError::Context {
                    transport: config.transport.clone(),
                    hint: config.transport.context_failure_hint(&source),
                    source,
                })?;
        let rank = config.rank.instance_rank;
        // SAFETY: the caller's contract (this function's `# Safety`) is the one
        // `RankPools::register` needs, for the same pools and the agent's whole life.
        let pools = unsafe {
            RankPools::register(
                &context,
                rank,
                &config.rank.page_table.pools,
                config.cuda_device,
            )
        }?;
        Self::start_inner(config, bound, context, Arc::new(pools))
    }

    /// Starts the agent over pools kvferry allocated ([`crate::memory::PoolAllocator`] on
    /// `context`), for a host that lets kvferry own its KV memory — `kvferry serve` does:
    /// over shared memory only UCX-allocated pools take one-sided puts (engine memory goes
    /// through UCX's active-message emulation). `config.rank`'s page table must name them:
    /// each pool inside the region of the same index, or the start is refused.
    ///
    /// # Safety
    ///
    /// `context` is the one `pools` were allocated on and was made by
    /// `config.transport.context_for` for the pools' memory kind. The pools' memory is
    /// kvferry's and lives as long as the agent; whoever writes or reads it through raw
    /// pointers does so only as the protocol allows (see [`start`](Self::start)).
    ///
    /// # Errors
    ///
    /// See [`StartError`]; [`StartError::Config`] when the page table does not lie inside
    /// the pools.
    pub unsafe fn start_on(
        config: AgentConfig,
        bound: BoundPlanner,
        context: Arc<Context>,
        pools: Arc<RankPools>,
    ) -> Result<Agent, StartError> {
        check_config(&config, &bound)?;
        let table = &config.rank.page_table.pools;
        if table.len() != pools.len() {
            return Err(StartError::Config(format!(
                "the page table names {} pools, {} were allocated",
                table.len(),
                pools.len()
            )));
        }
        for (index, p) in table.iter().enumerate() {
            let inside = pools.region(index).is_some_and(|r| {
                let start = r.remote_addr();
                p.base >= start
                    && p.base
                        .checked_add(p.footprint())
                        .is_some_and(|end| end <= start + r.len() as u64)
            });
            if !inside {
                return Err(StartError::Config(format!(
                    "pool {index} ({:#x}+{}) does not lie inside the memory allocated for it",
                    p.base,
                    p.footprint()
                )));
            }
        }
        Self::start_inner(config, bound, context, pools)
    }

    fn start_inner(
        config: AgentConfig,
        bound: BoundPlanner,
        context: Arc<Context>,
        pools: Arc<RankPools>,
    ) -> Result<Agent, StartError> {
        let rank = config.rank.instance_rank;
        let keys = pools.keys()?;
        let mut info = config.rank.clone();
        info.planner_id = bound.id().into();
        info.describer_id = bound.describer_id().into();
        let planner = bound
            .instantiate(&info)
            .map_err(|source| StartError::Planner {
                planner: bound.id().to_string(),
                source,
            })?;
        info.planner_blob =
            RVec::from(planner.describe().map_err(|source| StartError::Planner {
                planner: bound.id().to_string(),
                source,
            })?);
        let worker = Worker::new(&context).map_err(StartError::Worker)?;
        // A decode rank's worker keeps the challenges prefill ranks send it, which the
        // rank answers on their sessions (see `worker_proof`).
        let challenges = Arc::new(worker_proof::Challenges::default());
        if config.role == Role::Decode {
            let store = Arc::clone(&challenges);
            worker
                .set_am_handler(
                    worker_proof::WORKER_CHALLENGE_AM,
                    move |_header, payload| store.record(payload),
                )
                .map_err(StartError::Worker)?;
        }
        let (arena, staging) = bounce_memory(&config, &context, &pools)?;
        let bounces = staging.is_some();
        let thread = RankThread::spawn_bouncing(
            &config.instance,
            rank,
            worker,
            Arc::clone(&pools),
            config.transport.error_mode(),
            staging,
            config.executor,
        )?;

        let (listener, endpoint) = match config.role {
            Role::Prefill => {
                let listener = TcpListener::bind(&config.listen).map_err(|e| {
                    StartError::Listen(format!("cannot listen on {}: {e}", config.listen))
                })?;
                let local = listener
                    .local_addr()
                    .map_err(|e| StartError::Listen(e.to_string()))?;
                let endpoint = advertised(local, config.advertise.as_deref())?;
                (Some(listener), Some(endpoint))
            }
            Role::Decode => (None, None),
        };
        let metadata = kvferry_protocol::AgentMetadata {
            instance: config.instance.clone(),
            role: config.role,
            epoch: random_u64()?,
            planner_id: bound.id().into(),
            describer_id: bound.describer_id().into(),
            planner_version: bound.version().into(),
            label: config.label.clone(),
            endpoint: endpoint.clone(),
            rank: RankDescriptor {
                info: info.clone(),
                worker_address: thread.address().to_vec(),
                pools: keys,
                bounce: arena.as_ref().map(|a| a.key().clone()),
            },
        };
        let label = format!("{}-r{rank}", config.instance);
        let inner = Arc::new(Inner {
            events: Events::new()?,
            alarm: Arc::new(alarm::Alarm::default()),
            planning: Planning::new(&label, config.planner_timeout)?,
            dispatch: dispatch::Dispatch::new(&label)?,
            scatter: match &arena {
                Some(_) => Some(dispatch::Dispatch::with_threads(
                    &label,
                    "scatter",
                    SCATTER_THREADS,
                )?),
                None => None,
            },
            prefill: Mutex::new(prefill::State::new(
                kvferry_protocol::prefill::PrefillConfig {
                    rank: info.instance_rank,
                    me: format!("{} rank {}", config.instance, info.instance_rank),
                    lease: config.lease,
                    timeout: config.timeout,
                    max_stashed: config.max_stashed_bytes,
                },
            )),
            decode: Mutex::new(decode::State::new(kvferry_protocol::decode::DecodeConfig {
                instance: config.instance.clone(),
                rank: info.instance_rank,
                timeout: config.timeout,
                integrity: config.integrity,
            })),
            recorded: Mutex::new(record::Recorder::default()),
            challenges,
            config,
            info,
            bound,
            planner,
            _pools: pools,
            arena,
            bounces,
            thread,
            metadata,
            next_peer: AtomicU64::new(1),
            stopped: AtomicBool::new(false),
            _context: context,
        });
        let weak = Arc::downgrade(&inner);
        let alarm = Arc::clone(&inner.alarm);
        thread::Builder::new()
            .name(format!("reap-{label}"))
            .spawn(move || {
                // It sleeps until the next deadline (alarm.rs says why none is missed) and
                // holds no strong reference while it sleeps, so dropping the agent is not
                // held up by it. Keep-alives go by the clock: on a loaded host a sleep
                // overshoots, and keep-alives counted in turns reached the peer after its
                // timeout (measured: two vLLM CPU instances on 2 cores, 10 s apart).
                let mut last_ping: Option<Instant> = None;
                let mut woke_due: Option<Instant> = None;
                while let Some(inner) = weak.upgrade() {
                    if inner.stopped.load(Ordering::Acquire) {
                        break;
                    }
                    // A reaper that wakes seconds late means this process's threads are not
                    // being scheduled (a starved host), not that a lock was held: say which.
                    let woke = Instant::now();
                    if let Some(late) = woke_due.map(|due| woke.saturating_duration_since(due)) {
                        if late >= SLOW_LOCK {
                            tracing::warn!(
                                late_ms = late.as_millis() as u64,
                                "the agent's reaper woke late: this process's threads went unscheduled"
                            );
                        }
                    }
                    inner.reap();
                    let ping_every = (inner.config.peer_timeout / 3).max(alarm::DUE_AGAIN);
                    if last_ping.is_none_or(|at| at.elapsed() >= ping_every) {
                        last_ping = Some(Instant::now());
                        match inner.config.role {
                            Role::Prefill => prefill::ping(&inner),
                            Role::Decode => decode::ping(&inner),
                        }
                    }
                    let (next, horizon) = inner.deadlines();
                    let next_ping = last_ping.map(|at| at + ping_every);
                    let next = next.into_iter().chain(next_ping).min();
                    drop(inner);
                    let until = alarm::Alarm::wake_time(Instant::now(), next, horizon);
                    woke_due = Some(until);
                    alarm.sleep_until(until);
                }
            })?;
        if let Some(listener) = listener {
            prefill::listen(&inner, listener)?;
        }
        tracing::info!(
            agent = %inner.me(),
            role = %inner.config.role,
            planner = inner.bound.id(),
            endpoint = endpoint.as_deref().map(tracing::field::display),
            pools = inner.info.page_table.pools.len(),
            "agent started"
        );
        Ok(Agent { inner, endpoint })
    }

    /// The side channel's advertised `host:port` (prefill ranks; `None` for decode ranks,
    /// which dial).
    pub fn endpoint(&self) -> Option<&str> {
        self.endpoint.as_deref()
    }

    /// This rank's metadata, for engines that exchange it on their own channel (the peer
    /// passes it to [`add_peer`](Self::add_peer)).
    ///
    /// # Errors
    ///
    /// The description does not fit in a frame.
    pub fn local_metadata(&self) -> Result<Vec<u8>, CallError> {
        self.inner
            .metadata
            .to_bytes()
            .map_err(|e| CallError::Metadata(e.to_string()))
    }

    /// Who this agent is.
    pub fn identity(&self) -> PeerIdentity {
        self.inner.metadata.identity()
    }

    /// This rank's description as peers see it (real pool addresses, the planner's blob).
    pub fn rank_info(&self) -> &RankInfo {
        &self.inner.info
    }

    /// Adds a prefill rank's metadata (bytes of its [`local_metadata`](Self::local_metadata))
    /// to this decode rank's directory; the connection is made when a request needs it.
    /// A newer epoch of the same rank replaces the old one.
    ///
    /// # Errors
    ///
    /// The bytes are not metadata, or describe a rank this one cannot use.
    pub fn add_peer(&self, metadata: &[u8]) -> Result<PeerIdentity, CallError> {
        self.need(Role::Decode, "add_peer")?;
        let m = kvferry_protocol::AgentMetadata::from_bytes(metadata)
            .map_err(|e| CallError::Metadata(kvferry_plan::error_chain(&e)))?;
        decode::add_peer(&self.inner, m)
    }

    /// Prefill side: makes (a chunk of) a request's KV cache available (see [`SendChunk`]).
    ///
    /// # Errors
    ///
    /// Invalid parameters (the request is then untouched), a request started again (from token
    /// 0) while one of its id is in flight ([`CallError::Duplicate`]), or a decode rank.
    pub fn send(&self, send: SendChunk) -> Result<(), CallError> {
        self.need(Role::Prefill, "send")?;
        prefill::send(&self.inner, send)
    }

    /// Decode side: expects a request into this rank's slots (see [`Expect`]).
    ///
    /// # Errors
    ///
    /// Invalid parameters or a duplicate id (nothing is taken), or a prefill rank.
    pub fn expect(&self, expect: Expect) -> Result<(), CallError> {
        self.need(Role::Decode, "expect")?;
        decode::expect(&self.inner, expect)
    }

    /// Decode side: tells prefill instance `peer` that this instance still wants `requests`,
    /// which it has not expected yet (its engine queued them): every rank of `peer` reached
    /// through `endpoints` (or, when empty, those whose metadata was added with
    /// [`add_peer`](Self::add_peer)) that holds one of them unclaimed runs its lease from now
    /// again, up to ten leases after its send. Returns at once; nothing is reported (a
    /// request that ran out anyway fails at its `expect`, as it would have). Engines call it
    /// periodically, well within the lease, for requests still queued.
    ///
    /// # Errors
    ///
    /// A prefill rank, or a stopped agent.
    pub fn hold(
        &self,
        peer: &str,
        endpoints: &[String],
        requests: &[u64],
    ) -> Result<(), CallError> {
        self.need(Role::Decode, "hold")?;
        decode::hold(
            &self.inner,
            peer.to_string(),
            endpoints.to_vec(),
            requests.to_vec(),
        )
    }

    /// Cancels a request: always accepted while the request has not ended, and answered by
    /// its terminal event ([`Event::Cancelled`], or the event that beat the cancel). On the
    /// decode side it comes only after every writer acknowledged or is gone.
    ///
    /// # Errors
    ///
    /// [`CallError::Unknown`] if the request is not known or has ended.
    pub fn cancel(&self, request: u64) -> Result<(), CallError> {
        match self.inner.config.role {
            Role::Prefill => prefill::cancel(&self.inner, request),
            Role::Decode => decode::cancel(&self.inner, request),
        }
    }

    /// Every event since the last call, oldest first.
    pub fn poll(&self) -> Vec<Event> {
        self.inner.events.drain()
    }

    /// A descriptor that is readable while events wait (an eventfd: add it to the engine's
    /// epoll set; [`poll`](Self::poll) clears it). Owned by the agent.
    pub fn wake_fd(&self) -> RawFd {
        self.inner.events.raw_fd()
    }

    /// Makes [`wake_fd`](Self::wake_fd) readable again, as an event would: for a caller that
    /// took events from [`poll`](Self::poll) and keeps some of them for later.
    pub fn rewake(&self) {
        self.inner.events.rewake();
    }

    /// This agent's role.
    pub fn role(&self) -> Role {
        self.inner.config.role
    }

    /// Requests this agent holds (in flight, not yet ended).
    pub fn requests_held(&self) -> usize {
        match self.inner.config.role {
            Role::Prefill => lock(&self.inner.prefill).machine.len(),
            Role::Decode => lock(&self.inner.decode).machine.len(),
        }
    }

    /// What this agent did since it started: its requests by outcome and failure kind, bytes,
    /// fragments, pieces, puts, planning and write time, a histogram of request times, and
    /// the requests and peers it holds now (see [`AgentStats`]).
    pub fn stats(&self) -> AgentStats {
        AgentStats {
            in_flight: self.requests_held() as u64,
            peers: self.connections() as u64,
            ..self.inner.events.stats()
        }
    }

    /// Vetted peer connections: a prefill rank's accepted decode ranks, a decode rank's
    /// links to prefill ranks.
    pub fn connections(&self) -> usize {
        match self.inner.config.role {
            Role::Prefill => prefill::connections(&self.inner),
            Role::Decode => decode::connections(&self.inner),
        }
    }

    /// Planner calls declared wedged so far.
    pub fn wedged_planner_calls(&self) -> usize {
        self.inner.planning.wedged()
    }

    #[cfg(feature = "harness")]
    #[doc(hidden)]
    /// Prefill ranks recording plans ([`AgentConfig::record_plans`]): writes the plans this
    /// rank recorded for `requests` again with the rank thread's bare put loop (every fragment
    /// resolved before the clock starts, one window and one flush per plan) — the baseline
    /// `kvferry bench` sets the agent path against. The outcome arrives on the returned
    /// channel; `None` when this rank wrote none of the requests.
    ///
    /// The replay reads the requests' source slots and writes their destination slots again
    /// after their terminal events: call it only while both engines still hold those slots
    /// and nothing else uses them.
    ///
    /// # Errors
    ///
    /// Not a prefill rank, or one that does not record plans.
    pub fn replay(
        &self,
        requests: &[u64],
    ) -> Result<Option<std::sync::mpsc::Receiver<Result<ReplayStats, WriteError>>>, CallError> {
        self.need(Role::Prefill, "replay")?;
        let plans = self.recorded_plans(requests)?;
        if plans.is_empty() {
            return Ok(None);
        }
        Ok(Some(record::replay(
            &self.inner.thread,
            plans,
            self.inner.config.timeout,
        )))
    }

    #[cfg(feature = "harness")]
    #[doc(hidden)]
    /// The plans this rank recorded for `requests` as fragment lists per decode rank,
    /// relative to each side's pools: exactly what [`replay`](Self::replay) puts, in its
    /// order.
    ///
    /// # Errors
    ///
    /// As for [`replay`](Self::replay), or a fragment outside the pools.
    pub fn recorded_fragments(&self, requests: &[u64]) -> Result<Vec<PairFragments>, CallError> {
        self.need(Role::Prefill, "recorded_fragments")?;
        let plans = self.recorded_plans(requests)?;
        record::fragments(self.inner.info.instance_rank, &self.inner._pools, &plans).map_err(
            |reason| CallError::Invalid {
                request: requests.first().copied().unwrap_or(0),
                reason,
            },
        )
    }

    #[cfg(feature = "harness")]
    #[doc(hidden)]
    /// Whether this rank recorded plans for `request`.
    pub fn has_recorded(&self, request: u64) -> bool {
        lock(&self.inner.recorded).has(request)
    }

    #[cfg(feature = "harness")]
    #[doc(hidden)]
    /// Drops the plans recorded for `requests`.
    pub fn forget_recorded(&self, requests: &[u64]) {
        lock(&self.inner.recorded).forget(requests);
    }

    #[cfg(feature = "harness")]
    #[doc(hidden)]
    fn recorded_plans(&self, requests: &[u64]) -> Result<Vec<record::Recorded>, CallError> {
        if !self.inner.config.harness.record_plans {
            return Err(CallError::Invalid {
                request: requests.first().copied().unwrap_or(0),
                reason: "this agent does not record plans (`record_plans`)".into(),
            });
        }
        Ok(lock(&self.inner.recorded).plans(requests))
    }

    fn need(&self, role: Role, call: &'static str) -> Result<(), CallError> {
        if self.inner.stopped.load(Ordering::Acquire) {
            return Err(CallError::Stopped);
        }
        if self.inner.config.role != role {
            return Err(CallError::Role {
                call,
                needed: role,
                role: self.inner.config.role,
            });
        }
        Ok(())
    }
}

/// The checks every start makes before touching UCX.
fn check_config(config: &AgentConfig, bound: &BoundPlanner) -> Result<(), StartError> {
    if config.instance.is_empty() {
        return Err(StartError::Config("empty instance name".into()));
    }
    if config.rank.planner_id.as_str() != bound.id() && !config.rank.planner_id.is_empty() {
        return Err(StartError::Config(format!(
            "the rank names planner {}, the bound planner is {}",
            config.rank.planner_id,
            bound.id()
        )));
    }
    config
        .rank
        .page_table
        .validate()
        .map_err(|e| StartError::Config(format!("invalid page table: {e}")))?;
    if let Some(algorithm) = config.integrity {
        if config.role == Role::Decode && memory_kind(&config.rank) != MemoryKind::Host {
            return Err(StartError::Config(format!(
                "integrity {algorithm} reads the bytes that landed with the CPU: it needs host \
                 (DRAM) pools, and this rank has device pools"
            )));
        }
    }
    Ok(())
}

/// The bounce memory the rank's role and config ask for: a decode rank's arena, a
/// prefill rank's staging buffer, or neither (bounce off, or pools that mix host and device
/// memory). Device pools get device memory on their device (cargo feature `cuda`).
fn bounce_memory(
    config: &AgentConfig,
    context: &Arc<Context>,
    pools: &RankPools,
) -> Result<(Option<Arc<Arena>>, Option<Staging>), StartError> {
    let b = &config.bounce;
    if !b.may_bounce_over(&config.transport) {
        // Off, or auto within the node: nothing to allocate.
        return Ok((None, None));
    }
    let want = match config.role {
        Role::Decode => b.arena_bytes,
        Role::Prefill => b.staging_bytes.saturating_mul(2),
    };
    let what = match config.role {
        Role::Decode => "bounce arena",
        Role::Prefill => "bounce staging buffer",
    };
    let refused =
        |e: String| StartError::Config(format!("{what} (--bounce off starts without it): {e}"));
    let Some(copier) = bounce_copier(config, pools, want).map_err(refused)? else {
        return Ok((None, None));
    };
    match config.role {
        Role::Decode if b.arena_bytes > 0 => Arena::new(context, b.arena_bytes, copier)
            .map(|a| (Some(Arc::new(a)), None))
            .map_err(refused),
        Role::Prefill if b.staging_bytes > 0 => Staging::new(context, b.staging_bytes, copier)
            .map(|s| (None, Some(s)))
            .map_err(refused),
        _ => Ok((None, None)),
    }
}

/// How the rank's bounce memory copies, once `want` bytes of it are known to fit (checked
/// before anything is touched, like the pools): `None` where the rank does not bounce.
fn bounce_copier(
    config: &AgentConfig,
    pools: &RankPools,
    want: u64,
) -> Result<Option<crate::bounce::Copier>, String> {
    let vram = |p: &kvferry_planner_abi::PhysicalPool| {
        p.memory_type == kvferry_planner_abi::MemoryType::VRAM
    };
    let table = &config.rank.page_table.pools;
    if !table.iter().any(vram) {
        if let Some(budget) = kvferry_platform::HostBudget::measure() {
            if want > budget.bytes {
                return Err(format!("{want} bytes do not fit: {budget}"));
            }
        }
        return Ok(Some(crate::bounce::Copier::Host));
    }
    if !table.iter().all(vram) {
        tracing::info!(
            mode = %config.bounce.mode,
            "pools of host and device memory do not bounce (a gather copies one kind):              pieces go fragment by fragment"
        );
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        let Some(device) = pools.device() else {
            return Err("device pools without their device".into());
        };
        let free = device.free_memory().map_err(|e| {
            format!(
                "cannot ask cuda device {} for its memory: {}",
                device.ordinal(),
                kvferry_plan::error_chain(&e)
            )
        })?;
        if want > free as u64 {
            return Err(format!(
                "{want} bytes do not fit: cuda device {} has {free} bytes free",
                device.ordinal()
            ));
        }
        let copier =
            crate::cuda::DeviceCopier::new(device).map_err(|e| kvferry_plan::error_chain(&e))?;
        tracing::debug!(
            device = device.ordinal(),
            batched = copier.is_batched(),
            "bounced pieces gather and scatter in device memory"
        );
        Ok(Some(crate::bounce::Copier::Device(Arc::new(copier))))
    }
    #[cfg(not(feature = "cuda"))]
    {
        // Unreachable in practice: such a build refuses VRAM pools before this.
        let _ = pools;
        Ok(None)
    }
}

/// Device pools need UCX's CUDA transports in the context.
fn memory_kind(rank: &RankInfo) -> MemoryKind {
    if rank
        .page_table
        .pools
        .iter()
        .any(|p| p.memory_type == kvferry_planner_abi::MemoryType::VRAM)
    {
        MemoryKind::Cuda
    } else {
        MemoryKind::Host
    }
}

/// Threads scattering bounced pieces on a decode rank with an arena.
const SCATTER_THREADS: usize = 2;

/// How long dropping an agent waits for its threads to let go of it.
const DROP_WAIT: Duration = Duration::from_secs(2);

impl Drop for Agent {
    /// Stops taking work, tells every peer, ends every connection, and waits (at most
    /// 2 s) until nothing else holds the agent, so that its rank thread — and UCX
    /// with it — is torn down before this returns and an engine may exit right after.
    fn drop(&mut self) {
        self.inner.stopped.store(true, Ordering::Release);
        self.inner.alarm.ring();
        self.inner.dispatch.stop();
        if let Some(scatter) = &self.inner.scatter {
            scatter.stop();
        }
        match self.inner.config.role {
            Role::Prefill => prefill::shutdown(&self.inner),
            Role::Decode => decode::shutdown(&self.inner),
        }
        let deadline = Instant::now() + DROP_WAIT;
        let open = match self.inner.config.role {
            Role::Prefill => lock(&self.inner.prefill).machine.len(),
            Role::Decode => lock(&self.inner.decode).machine.len(),
        };
        // The one line an orderly shutdown logs (each peer's end is at debug level).
        tracing::info!(agent = %self.inner.me(), open_requests = open, "agent stopped");
        while Arc::strong_count(&self.inner) > 1 {
            if Instant::now() >= deadline {
                tracing::warn!(
                    agent = %self.inner.me(),
                    holders = Arc::strong_count(&self.inner) - 1,
                    "agent threads still hold it after {} ms; it is torn down when they end",
                    DROP_WAIT.as_millis()
                );
                break;
            }
            thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Whether a read failed only because the peer sent nothing within the read timeout.
pub(crate) fn is_timeout(e: &kvferry_protocol::WireError) -> bool {
    matches!(e, kvferry_protocol::WireError::Io(io) if matches!(
        io.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    ))
}

fn random_u64() -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(u64::from_le_bytes(b))
}

/// The `host:port` to advertise for a listener bound to `local`.
fn advertised(local: SocketAddr, advertise: Option<&str>) -> Result<String, StartError> {
    if let Some(host) = advertise {
        let ip: IpAddr = host
            .parse()
            .map_err(|_| StartError::Listen(format!("advertise `{host}` is not an IP address")))?;
        if ip.is_unspecified() {
            return Err(StartError::Listen(format!(
                "advertise `{host}` is unspecified; peers cannot reach it"
            )));
        }
        return Ok(SocketAddr::new(ip, local.port()).to_string());
    }
    if !local.ip().is_unspecified() {
        return Ok(local.to_string());
    }
    let ip = kvferry_platform::first_interface_address(local.is_ipv6()).ok_or_else(|| {
        StartError::Listen(format!(
            "listening on {local}, but no interface that is up has a non-loopback address to \
             advertise; set `advertise` or listen on a specific address"
        ))
    })?;
    Ok(SocketAddr::new(ip, local.port()).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_files_readable_by_others_or_blank_are_refused_naming_the_fix() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "a deployment secret of 32 bytes.\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = load_secret(Some(&path)).unwrap_err();
        assert!(
            matches!(e, LoadSecretError::Exposed { mode: 0o644, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(load_secret(Some(&path)).is_ok());
        std::fs::write(&path, " ".repeat(20)).unwrap();
        let e = load_secret(Some(&path)).unwrap_err();
        assert!(e.to_string().contains("whitespace"), "{e}");
    }

    #[test]
    fn advertised_endpoints_are_never_unspecified() {
        let lo: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(advertised(lo, None).unwrap(), "127.0.0.1:4000");
        let any: SocketAddr = "0.0.0.0:4000".parse().unwrap();
        assert_eq!(advertised(any, Some("10.1.2.3")).unwrap(), "10.1.2.3:4000");
        assert!(advertised(any, Some("0.0.0.0")).is_err());
        assert!(advertised(any, Some("host.example")).is_err());
        match advertised(any, None) {
            Ok(e) => {
                let ip: SocketAddr = e.parse().unwrap();
                assert!(!ip.ip().is_unspecified() && !ip.ip().is_loopback(), "{e}");
            }
            Err(e) => assert!(e.to_string().contains("no interface"), "{e}"),
        }
    }
}
