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
mod config;
mod decode;
mod dispatch;
mod error;
mod events;
mod planning;
mod prefill;
mod record;
mod secret;
mod start;
mod typed;
mod worker_proof;

pub use crate::bounce::{BounceConfig, BounceMode};
pub use config::{AgentConfig, MAX_CONNECTIONS};
pub use decode::Expect;
pub use error::{CallError, StartError};
pub use events::{AgentStats, Event, FAILURE_KINDS, FailureKind, LATENCY_BUCKETS};
pub use kvferry_protocol::exec::ExecConfig;
pub use kvferry_protocol::{
    AgentMetadata, Integrity, PeerIdentity, PoolKey, RankDescriptor, Secret, SecretError, WireError,
};
/// The type of [`AgentConfig::harness`], named for the harness (its fields are of use only
/// with the `harness` feature).
#[doc(hidden)]
pub use record::HarnessOptions;
pub use secret::{LoadSecretError, PREVIOUS_SECRET_FILE_ENV, SECRET_ENV, load_secret};
pub use typed::{DecodeAgent, PrefillAgent};

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_loader::BoundPlanner;
use kvferry_planner_abi::{RankInfo, SlotTable, TokenRange, ViewId};
use kvferry_protocol::Role;
use kvferry_ucx::Context;

use crate::bounce::Arena;
use crate::memory::RankPools;
#[cfg(feature = "harness")]
use crate::outcome::PairFragments;
use crate::rank::RankThread;
#[cfg(feature = "harness")]
use crate::rank::{ReplayStats, WriteError};
pub(crate) use crate::sync::{SLOW_LOCK, lock};

use events::Events;
use planning::Planning;

/// How long a TCP connect to a peer's side channel may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub(crate) use crate::conn::HANDSHAKE_TIMEOUT;

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
