//! The context (sender) side: registrations, source requests, planning, writing, notifying.
//!
//! A request becomes writable once two things happened, in either order: the caller's
//! [`ContextServer::add_request`] (the DP group's slot tables, whose slots hold the request's
//! KV cache) and a receiver rank's [`PeerMessage::RequestData`]. Then, for that (sender, receiver) pair,
//! every piece is planned with [`plan_transfer`] (describe both sides, the bound planner's
//! `pair`, validation against both sides' rows, coalescing) and queued on the sender rank's
//! thread, which writes, flushes and only then lets [`PeerMessage::Completion`] go out. Pieces of
//! one pair run in order on one thread, so the `is_last` completion is the last one sent. A
//! plan that cannot be made is reported as a failed last piece, so the receiver never waits
//! for it.
//!
//! Every write job runs under the server's per-request timeout and gives up early on a
//! receiver whose registration ended; a job that gave up with puts in flight is reported
//! (failed, naming the receiver rank) only once those have drained, and holds its request's
//! slots until then (see [`crate::rank`]): [`ContextServer::release`] calls the request's
//! `on_free` only once no job reads its slots. With [`ContextOptions::record_plans`] the queued
//! plans are kept until release, so [`ContextServer::replay`] can write them again with a bare
//! put loop (the benchmark's baseline).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use kvferry_planner_abi::ffi::ROption;
use kvferry_planner_abi::{PairRequest, PlanError, RankInfo, SlotTable};

use kvferry_plan::{PlanFailure, RequestSide, ValidatedPlan, error_chain, plan_transfer};
use kvferry_protocol::{
    AcceptEvent, Acceptor, Completion, CompletionStatus, InstanceInfo, PeerMessage, RequestData,
    Role, SessionError,
};

use crate::conn::Flow;
use crate::conn::Outbox;
use crate::instance::Instance;
use crate::outcome::{BenchStats, OnFree, PairFragments, PoolFragment};
use crate::rank::{
    JobRelease, PeerId, RemoteRank, ReplayDone, ReplayJob, ReplayStats, WriteError, WriteHook,
    WriteJob,
};
use crate::stash::{Stash, request_data_bytes};

/// How long a `RequestData` for a request not yet submitted is kept.
const ORPHAN_TTL: Duration = Duration::from_secs(120);
/// The most bytes of such `RequestData` kept at once, from all peers together.
const ORPHAN_BYTES: usize = 64 << 20;
/// How long past its own deadline a replay may take to report before `Bench` gives up on it.
const REPLAY_GRACE: Duration = Duration::from_secs(30);

/// Why a generation instance's registration is refused.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// The registering instance is not a generation instance.
    #[error("{instance} registers as a {role} instance; only generation instances register")]
    Role {
        /// The registering instance.
        instance: String,
        /// Its role.
        role: Role,
    },
    /// The two instances bind different planners or describers.
    #[error("generation instance {instance} binds {theirs}; context instance {ours}")]
    Planner {
        /// The registering instance.
        instance: String,
        /// Its planner and describer, e.g. `planner kvferry.default (describer ...)`.
        theirs: String,
        /// This instance's name, planner and describer.
        ours: String,
    },
    /// The registering instance has no ranks.
    #[error("generation instance {instance} has no ranks")]
    NoRanks {
        /// The registering instance.
        instance: String,
    },
    /// One of its rank descriptors is malformed.
    #[error("generation instance {instance} rank {rank}: {problem}")]
    BadRank {
        /// The registering instance.
        instance: String,
        /// The rank.
        rank: usize,
        /// What is wrong.
        problem: String,
    },
    /// A context rank's planner refuses a generation rank.
    #[error(
        "context instance {ours} rank {rank} refuses generation instance {instance} rank \
         {peer_rank}"
    )]
    Refused {
        /// This instance.
        ours: String,
        /// The refusing rank.
        rank: u32,
        /// The registering instance.
        instance: String,
        /// The refused rank.
        peer_rank: u32,
        /// The planner's field-level reason.
        source: PlanError,
    },
}

/// Why a source request could not be added.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AddError {
    /// The request's parameters are invalid.
    #[error("request {request}: {reason}")]
    Invalid {
        /// The request.
        request: u64,
        /// What is wrong.
        reason: String,
    },
    /// The id is taken.
    #[error("request {request} already exists")]
    Duplicate {
        /// The request.
        request: u64,
    },
}

/// A request whose KV cache sits in this instance's slots, ready to be written to whoever
/// asks for it ([`ContextServer::add_request`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceRequest {
    /// The request id both sides know.
    pub request: u64,
    /// Prompt tokens.
    pub prompt_len: u64,
    /// The pieces it is sent in (one, or block-aligned chunks: [`kvferry_plan::pieces`]).
    pub pieces: Vec<PairRequest>,
    /// The DP group serving it: slot tables per rank, one table per layer group.
    pub tables: BTreeMap<u32, Vec<SlotTable>>,
    /// The DP rank of that group (for messages).
    pub dp_rank: u32,
}

/// Options of a context server beyond its instance.
#[derive(Clone, Debug, Default)]
pub struct ContextOptions {
    /// How long each write job may run once it starts before it fails and its puts are
    /// quarantined (see [`crate::rank`]).
    pub timeout: Duration,
    /// Keep every queued plan until its request is released, so [`ContextServer::replay`] can
    /// write it again (`kvferry bench`).
    pub record_plans: bool,
    /// Observes every write job (fault injection in tests); `None` in production.
    pub hook: Option<Arc<dyn WriteHook>>,
}

/// Why a (sender, receiver) pair of a request cannot be served; reported to the receiver as
/// a failed last piece.
#[derive(Debug, thiserror::Error)]
pub enum PairError {
    /// The sender rank does not exist.
    #[error("context rank {rank} does not exist")]
    NoRank {
        /// The rank.
        rank: u32,
    },
    /// The receiver rank does not exist.
    #[error("generation instance {instance} has no rank {rank}")]
    NoPeerRank {
        /// The peer instance.
        instance: String,
        /// The rank.
        rank: u32,
    },
    /// The request is not prefilled (any more).
    #[error("request {request} is not prefilled")]
    NotPrefilled {
        /// The request.
        request: u64,
    },
    /// The sender rank is not in the request's DP group.
    #[error("context rank {rank} does not serve request {request} (dp rank {dp})")]
    NotServing {
        /// The rank.
        rank: u32,
        /// The request.
        request: u64,
        /// The request's DP group.
        dp: u32,
    },
    /// The two sides disagree on the prompt.
    #[error("receiver says prompt_len {theirs}, context prefilled {ours}")]
    PromptLen {
        /// The receiver's value.
        theirs: u64,
        /// This side's.
        ours: u64,
    },
    /// The sender's planner could not compute its targets.
    #[error("targets of generation rank {peer_rank} failed")]
    Targets {
        /// The receiver.
        peer_rank: u32,
        /// The planner's error.
        source: PlanError,
    },
    /// The sender's planner does not target the receiver back.
    #[error("this rank does not target generation rank {peer_rank} back (it targets {targets:?})")]
    Asymmetric {
        /// The receiver.
        peer_rank: u32,
        /// What the sender targets.
        targets: Vec<u32>,
    },
    /// Planning a piece failed (describe, pair, validation).
    #[error("piece {piece}")]
    Plan {
        /// The piece.
        piece: usize,
        /// What failed.
        source: PlanFailure,
    },
}

impl PairError {
    /// The piece a failure concerns (0 for failures before planning).
    fn piece(&self) -> u32 {
        match self {
            PairError::Plan { piece, .. } => *piece as u32,
            _ => 0,
        }
    }
}

/// A registered generation instance.
#[derive(Debug)]
struct GenPeer {
    id: PeerId,
    instance: String,
    infos: Vec<RankInfo>,
    ranks: Vec<Arc<RemoteRank>>,
    outbox: Outbox,
    alive: Arc<AtomicBool>,
}

#[derive(Debug)]
struct Stashed {
    peer: Arc<GenPeer>,
    data: RequestData,
}

/// A plan queued for a request, kept for [`ContextServer::replay`] when recording.
#[derive(Debug)]
struct Recorded {
    rank: u32,
    dest: Arc<RemoteRank>,
    plan: Arc<ValidatedPlan>,
}

struct CtxRequest {
    prompt_len: u64,
    dp_rank: u32,
    on_free: Option<OnFree>,
    tables: BTreeMap<u32, Vec<SlotTable>>,
    pieces: Vec<PairRequest>,
    jobs_in_flight: usize,
    release_pending: bool,
    recorded: Vec<Recorded>,
}

impl std::fmt::Debug for CtxRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CtxRequest")
            .field("prompt_len", &self.prompt_len)
            .field("dp_rank", &self.dp_rank)
            .field("jobs_in_flight", &self.jobs_in_flight)
            .field("release_pending", &self.release_pending)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct State {
    requests: HashMap<u64, CtxRequest>,
    orphans: Stash<Stashed>,
    peers: HashMap<PeerId, Arc<GenPeer>>,
}

/// A context server: one instance, its registered generation peers and its requests.
#[derive(Debug)]
pub struct ContextServer {
    instance: Instance,
    info: InstanceInfo,
    hook: Option<Arc<dyn WriteHook>>,
    timeout: Duration,
    record: bool,
    next_peer: AtomicU64,
    state: Mutex<State>,
}

/// One connection to a context server: where its protocol stands and what it registered.
#[derive(Debug, Default)]
pub struct ContextSession {
    protocol: Acceptor,
    peer: Option<Arc<GenPeer>>,
}

impl ContextServer {
    /// A server for `instance`: every write job gives up after `options.timeout`;
    /// `options.record_plans` keeps every queued plan until its request is released, for
    /// [`ContextServer::replay`].
    pub fn new(instance: Instance, options: &ContextOptions) -> Self {
        let info = instance.describe();
        Self {
            instance,
            info,
            hook: options.hook.clone(),
            timeout: options.timeout,
            record: options.record_plans,
            next_peer: AtomicU64::new(1),
            state: Mutex::new(State {
                requests: HashMap::new(),
                orphans: Stash::new(ORPHAN_BYTES, ORPHAN_TTL),
                peers: HashMap::new(),
            }),
        }
    }

    /// The instance.
    pub fn instance(&self) -> &Instance {
        &self.instance
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What this instance advertises to its peers.
    pub fn info(&self) -> &InstanceInfo {
        &self.info
    }

    /// Handles one message of a peer connection.
    pub fn handle(
        self: &Arc<Self>,
        session: &mut ContextSession,
        outbox: &Outbox,
        message: PeerMessage,
    ) -> Flow {
        let event = match session.protocol.receive(message) {
            Ok(Some(event)) => event,
            Ok(None) => return Flow::Continue,
            Err(SessionError::PeerError { message }) => {
                tracing::info!(%message, "generation peer reported an error and closed");
                return Flow::Close;
            }
            Err(e) => return Flow::Refuse(e.to_string()),
        };
        match event {
            AcceptEvent::InfoRequested => {
                let _ = outbox.send(PeerMessage::InstanceInfo(self.info.clone()));
                Flow::Continue
            }
            AcceptEvent::Register(info) => {
                let reply = match self.register(*info, outbox) {
                    Ok(peer) => match session.protocol.accept(self.instance.name()) {
                        Ok(reply) => {
                            if let Some(old) = session.peer.replace(Arc::clone(&peer)) {
                                self.unregister(&old);
                            }
                            reply
                        }
                        Err(e) => return Flow::Refuse(e.to_string()),
                    },
                    Err(e) => {
                        tracing::info!(reason = %error_chain(&e), "refused a generation peer");
                        session.protocol.refuse(error_chain(&e))
                    }
                };
                let refused = matches!(reply, PeerMessage::Refused { .. });
                let _ = outbox.send(reply);
                if refused { Flow::Close } else { Flow::Continue }
            }
            AcceptEvent::RequestData(data) => match &session.peer {
                Some(peer) => {
                    self.request_data(peer, *data);
                    Flow::Continue
                }
                None => Flow::Refuse(format!(
                    "RequestData for request {} before Register",
                    data.request
                )),
            },
            AcceptEvent::Cancel { request, reason } => {
                if let Some(peer) = &session.peer {
                    self.cancel(peer, request, &reason);
                }
                Flow::Continue
            }
        }
    }

    /// The connection of `session` is gone.
    pub fn closed(&self, session: &mut ContextSession) {
        if let Some(peer) = session.peer.take() {
            tracing::info!(peer = %peer.instance, "generation peer disconnected");
            self.unregister(&peer);
        }
    }

    fn unregister(&self, peer: &GenPeer) {
        peer.alive.store(false, Ordering::Release);
        {
            let mut state = self.lock();
            state.peers.remove(&peer.id);
            state.orphans.retain(|s, _| s.peer.id != peer.id);
        }
        for rank in self.instance.ranks() {
            rank.thread.forget(peer.id);
        }
    }

    /// Vets a generation instance: planner and describer ids, page tables, then every context
    /// rank's `check_peer` against every generation rank.
    fn register(&self, info: InstanceInfo, outbox: &Outbox) -> Result<Arc<GenPeer>, RegisterError> {
        let name = &info.instance_name;
        if info.role != Role::Generation {
            return Err(RegisterError::Role {
                instance: name.clone(),
                role: info.role,
            });
        }
        let bound = self.instance.bound();
        if info.planner_id != bound.id() || info.describer_id != bound.describer_id() {
            return Err(RegisterError::Planner {
                instance: name.clone(),
                theirs: format!(
                    "planner {} (describer {})",
                    info.planner_id, info.describer_id
                ),
                ours: format!(
                    "{} binds {} (describer {})",
                    self.instance.name(),
                    bound.id(),
                    bound.describer_id()
                ),
            });
        }
        if info.ranks.is_empty() {
            return Err(RegisterError::NoRanks {
                instance: name.clone(),
            });
        }
        for (g, d) in info.ranks.iter().enumerate() {
            let bad = |problem: String| RegisterError::BadRank {
                instance: name.clone(),
                rank: g,
                problem,
            };
            if d.info.instance_rank as usize != g {
                return Err(bad(format!(
                    "describes itself as rank {}",
                    d.info.instance_rank
                )));
            }
            if d.info.planner_id != info.planner_id || d.info.describer_id != info.describer_id {
                return Err(bad(format!(
                    "planner {} / describer {} differ from its instance's",
                    d.info.planner_id, d.info.describer_id
                )));
            }
            d.info
                .page_table
                .validate()
                .map_err(|e| bad(format!("invalid page table: {e}")))?;
            if d.pools.len() != d.info.page_table.pools.len() {
                return Err(bad(format!(
                    "{} pool keys for {} pools",
                    d.pools.len(),
                    d.info.page_table.pools.len()
                )));
            }
            if d.worker_address.is_empty() {
                return Err(bad("empty worker address".into()));
            }
        }
        for rank in self.instance.ranks() {
            for d in &info.ranks {
                rank.planner
                    .check_peer(&rank.info, &d.info)
                    .map_err(|source| RegisterError::Refused {
                        ours: self.instance.name().to_string(),
                        rank: rank.info.instance_rank,
                        instance: name.clone(),
                        peer_rank: d.info.instance_rank,
                        source,
                    })?;
            }
        }
        let id = self.next_peer.fetch_add(1, Ordering::Relaxed);
        let alive = Arc::new(AtomicBool::new(true));
        let ranks = info
            .ranks
            .iter()
            .map(|d| {
                Arc::new(RemoteRank {
                    peer: id,
                    instance: name.clone(),
                    rank: d.info.instance_rank,
                    worker_address: d.worker_address.clone(),
                    pools: d.pools.clone(),
                    alive: Arc::clone(&alive),
                })
            })
            .collect();
        let peer = Arc::new(GenPeer {
            id,
            instance: name.clone(),
            infos: info.ranks.into_iter().map(|d| d.info).collect(),
            ranks,
            alive,
            outbox: outbox.clone(),
        });
        self.lock().peers.insert(id, Arc::clone(&peer));
        tracing::info!(peer = %name, label = %info.label, ranks = peer.infos.len(), "registered generation peer");
        Ok(peer)
    }

    /// Adds a request whose KV cache sits in `request.tables`' slots: from now on, receiver
    /// ranks that ask for it (a [`PeerMessage::RequestData`], before or after this call) get
    /// it written. The slots stay the caller's to keep intact until [`release`](Self::release)
    /// has been called and `on_free` has run.
    ///
    /// # Errors
    ///
    /// No pieces, no tables, a table for a rank this instance does not have, or an id in use.
    pub fn add_request(
        self: &Arc<Self>,
        request: SourceRequest,
        on_free: OnFree,
    ) -> Result<(), AddError> {
        let id = request.request;
        let invalid = |reason: String| AddError::Invalid {
            request: id,
            reason,
        };
        if request.pieces.is_empty() {
            return Err(invalid("no pieces".into()));
        }
        if request.tables.is_empty() {
            return Err(invalid("no slot tables".into()));
        }
        if let Some(r) = request
            .tables
            .keys()
            .find(|&&r| self.instance.rank(r).is_none())
        {
            return Err(invalid(format!(
                "slot tables for rank {r}, which does not exist"
            )));
        }
        let prompt_len = request.prompt_len;
        let orphans = {
            let mut state = self.lock();
            if state.requests.contains_key(&id) {
                return Err(AddError::Duplicate { request: id });
            }
            state.requests.insert(
                id,
                CtxRequest {
                    prompt_len,
                    dp_rank: request.dp_rank,
                    on_free: Some(on_free),
                    tables: request.tables,
                    pieces: request.pieces,
                    jobs_in_flight: 0,
                    release_pending: false,
                    recorded: Vec::new(),
                },
            );
            state.orphans.take(id)
        };
        tracing::debug!(
            request = id,
            prompt_len,
            waiting = orphans.len(),
            "source request added"
        );
        for stash in orphans {
            self.serve(&stash.peer, stash.data);
        }
        Ok(())
    }

    fn request_data(self: &Arc<Self>, peer: &Arc<GenPeer>, data: RequestData) {
        {
            let mut state = self.lock();
            if !state.requests.contains_key(&data.request) {
                let (request, c, g) = (data.request, data.sender_rank, data.receiver_rank);
                let bytes = request_data_bytes(&data);
                let stashed = Stashed {
                    peer: Arc::clone(peer),
                    data,
                };
                match state.orphans.push(request, stashed, bytes, Instant::now()) {
                    Ok(()) => {
                        tracing::debug!(request, "request data before prefill: stashed");
                    }
                    Err(_) => {
                        // A full stash refuses, and says so at once: the receiver fails this
                        // request now instead of at its timeout.
                        let limit = state.orphans.limit();
                        drop(state);
                        tracing::warn!(
                            request,
                            limit,
                            "request data before prefill: stash full, refused"
                        );
                        let reason = format!(
                            "request {request} is not prefilled here, and {limit} bytes of \
                             requests waiting for their prefill are held already"
                        );
                        let _ = peer.outbox.send(failed_piece(request, (c, g), 0, reason));
                    }
                }
                return;
            }
        }
        self.serve(peer, data);
    }

    /// Plans every piece of a prefilled request for one (sender, receiver) pair and queues
    /// the writes; any failure is reported to the receiver as a failed last piece.
    fn serve(self: &Arc<Self>, peer: &Arc<GenPeer>, data: RequestData) {
        let (c, g) = (data.sender_rank, data.receiver_rank);
        let _span = tracing::debug_span!(
            "serve",
            request = data.request,
            peer = %peer.instance,
            sender = c,
            receiver = g
        )
        .entered();
        let plans = self.plan_pair(peer, &data).and_then(|plans| {
            match (self.instance.rank(c), peer.ranks.get(g as usize)) {
                (Some(rank), Some(dest)) => Ok((plans, rank, dest)),
                (None, _) => Err(PairError::NoRank { rank: c }),
                (_, None) => Err(PairError::NoPeerRank {
                    instance: peer.instance.clone(),
                    rank: g,
                }),
            }
        });
        let (plans, rank, dest) = match plans {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "cannot serve");
                let _ = peer.outbox.send(failed_piece(
                    data.request,
                    (c, g),
                    e.piece(),
                    error_chain(&e),
                ));
                return;
            }
        };
        let plans: Vec<Arc<ValidatedPlan>> = plans.into_iter().map(Arc::new).collect();
        {
            let mut state = self.lock();
            if let Some(req) = state.requests.get_mut(&data.request) {
                req.jobs_in_flight += plans.len();
                if self.record {
                    req.recorded.extend(plans.iter().map(|plan| Recorded {
                        rank: c,
                        dest: Arc::clone(dest),
                        plan: Arc::clone(plan),
                    }));
                }
            }
        }
        let count = plans.len();
        for (k, plan) in plans.into_iter().enumerate() {
            let releasing = Arc::clone(self);
            let outbox = peer.outbox.clone();
            let request = data.request;
            let is_last = k + 1 == count;
            rank.thread.write(WriteJob {
                request,
                dest: Arc::clone(dest),
                plan,
                timeout: self.timeout,
                hook: self.hook.clone(),
                done: Box::new(move |result| {
                    let (bytes, fragments, status) = match result {
                        Ok(s) => (s.bytes, s.fragments, CompletionStatus::Ok),
                        Err(e) => (0, 0, CompletionStatus::Failed(error_chain(&e))),
                    };
                    let _ = outbox.send(PeerMessage::Completion(Completion {
                        request,
                        sender_rank: c,
                        receiver_rank: g,
                        piece: k as u32,
                        is_last,
                        bytes,
                        fragments,
                        status,
                    }));
                }),
                // Before the completion goes out (so a receiver that saw it sees the job
                // done here), or once the job's quarantined puts drained.
                release: Some(Box::new(move || releasing.job_done(request))),
            });
        }
        tracing::debug!(pieces = count, "queued");
    }

    /// The validated plans of every piece for one pair.
    fn plan_pair(
        &self,
        peer: &GenPeer,
        data: &RequestData,
    ) -> Result<Vec<ValidatedPlan>, PairError> {
        let (c, g) = (data.sender_rank, data.receiver_rank);
        let rank = self.instance.rank(c).ok_or(PairError::NoRank { rank: c })?;
        let receiver = peer
            .infos
            .get(g as usize)
            .ok_or_else(|| PairError::NoPeerRank {
                instance: peer.instance.clone(),
                rank: g,
            })?;
        let (tables, pieces, prompt_len) = {
            let state = self.lock();
            let req = state
                .requests
                .get(&data.request)
                .ok_or(PairError::NotPrefilled {
                    request: data.request,
                })?;
            let tables = req.tables.get(&c).cloned().ok_or(PairError::NotServing {
                rank: c,
                request: data.request,
                dp: req.dp_rank,
            })?;
            (tables, req.pieces.clone(), req.prompt_len)
        };
        if data.prompt_len != prompt_len {
            return Err(PairError::PromptLen {
                theirs: data.prompt_len,
                ours: prompt_len,
            });
        }
        let back = rank
            .planner
            .targets(&rank.info, receiver, receiver.dp_rank)
            .map_err(|source| PairError::Targets {
                peer_rank: g,
                source,
            })?;
        if !back.ranks.contains(&g) {
            return Err(PairError::Asymmetric {
                peer_rank: g,
                targets: back.ranks.to_vec(),
            });
        }
        let me = RequestSide::new(&rank.info, &tables);
        let them = RequestSide {
            info: receiver,
            slot_tables: &data.slot_tables,
            excluded: &data.excluded_views,
        };
        pieces
            .iter()
            .enumerate()
            .map(|(k, piece)| {
                let mut piece = *piece;
                piece.dst_start_token = match data.dst_start_token {
                    Some(t) => ROption::RSome(t),
                    None => ROption::RNone,
                };
                plan_transfer(rank.planner.as_ref(), me, them, &piece)
                    .map_err(|source| PairError::Plan { piece: k, source })
            })
            .collect()
    }

    /// Writes the recorded plans of `requests` again with every sender rank's bare replay
    /// loop (see [`ReplayJob`]), all ranks at once, and times it: from the first rank's first
    /// put to the last rank's last flush.
    ///
    /// The requests are held like write jobs hold them, so a [`release`](Self::release)
    /// meanwhile only quarantines their slots. The caller must still hold them on the
    /// generation side (their destination slots are written again) until this returns.
    ///
    /// # Errors
    ///
    /// Plans are not recorded ([`ContextOptions::record_plans`]), a request is unknown or has
    /// jobs in flight, a rank failed, or the replay did not finish in time.
    pub fn replay(self: &Arc<Self>, requests: &[u64]) -> Result<BenchStats, String> {
        if !self.record {
            return Err("this context server does not record plans".into());
        }
        let ids: BTreeSet<u64> = requests.iter().copied().collect();
        type Plans = Vec<(Arc<RemoteRank>, Arc<ValidatedPlan>)>;
        let mut by_rank: BTreeMap<u32, (Plans, BTreeSet<u64>)> = BTreeMap::new();
        {
            let mut state = self.lock();
            for id in &ids {
                let req = state
                    .requests
                    .get(id)
                    .ok_or_else(|| format!("request {id} is not prefilled"))?;
                if req.jobs_in_flight > 0 {
                    return Err(format!(
                        "request {id} still has {} write jobs in flight",
                        req.jobs_in_flight
                    ));
                }
            }
            for id in &ids {
                let Some(req) = state.requests.get_mut(id) else {
                    continue;
                };
                let mut ranks = BTreeSet::new();
                for r in &req.recorded {
                    let entry = by_rank.entry(r.rank).or_default();
                    entry.0.push((Arc::clone(&r.dest), Arc::clone(&r.plan)));
                    entry.1.insert(*id);
                    ranks.insert(r.rank);
                }
                // Held once per rank replaying it; each replay lets go when it reports.
                req.jobs_in_flight += ranks.len();
            }
        }
        let (tx, rx) = mpsc::channel();
        let mut waiting = 0usize;
        for (rank, (plans, held)) in by_rank {
            let tx = tx.clone();
            let server = Arc::clone(self);
            let done: ReplayDone = Box::new(move |result: Result<ReplayStats, WriteError>| {
                let _ = tx.send((rank, result));
            });
            let release: JobRelease = Box::new(move || {
                for id in held {
                    server.job_done(id);
                }
            });
            match self.instance.rank(rank) {
                Some(r) => r.thread.replay(ReplayJob {
                    plans,
                    timeout: self.timeout,
                    done,
                    release: Some(release),
                }),
                None => {
                    release();
                    done(Err(WriteError::Stopped { rank }));
                }
            }
            waiting += 1;
        }
        drop(tx);

        let limit = Instant::now() + self.timeout + REPLAY_GRACE;
        let mut stats = BenchStats::default();
        let mut span: Option<(Instant, Instant)> = None;
        for _ in 0..waiting {
            let left = limit.saturating_duration_since(Instant::now());
            let (rank, result) = rx
                .recv_timeout(left)
                .map_err(|_| format!("replay did not finish within {} ms", left.as_millis()))?;
            let replay = result.map_err(|e| format!("context rank {rank}: {e}"))?;
            stats.bytes += replay.written.bytes;
            stats.fragments += replay.written.fragments;
            stats.puts += replay.written.puts;
            stats.plans += replay.plans;
            stats.ranks += 1;
            span = Some(match span {
                None => (replay.started, replay.finished),
                Some((a, b)) => (a.min(replay.started), b.max(replay.finished)),
            });
        }
        if let Some((started, finished)) = span {
            stats.elapsed_ns = finished.duration_since(started).as_nanos() as u64;
        }
        Ok(stats)
    }

    /// The recorded plans of `requests` as fragment lists per (context rank, generation
    /// rank) pair, relative to the pools each side holds: exactly the coalesced fragments
    /// [`replay`](Self::replay) puts, in its order (requests in ascending id, each request's
    /// plans as queued). For benchmarks that move the same bytes with another library.
    ///
    /// Pairs come in order of context rank, then of first appearance. A fragment that does
    /// not lie inside one pool of each side (which validation rules out) is an error.
    ///
    /// # Errors
    ///
    /// Plans are not recorded ([`ContextOptions::record_plans`]), or a request is unknown.
    pub fn recorded_fragments(&self, requests: &[u64]) -> Result<Vec<PairFragments>, String> {
        if !self.record {
            return Err("this context server does not record plans".into());
        }
        let ids: BTreeSet<u64> = requests.iter().copied().collect();
        // Copy the plan handles out so the lock is not held while resolving fragments.
        let mut recorded: Vec<(u32, Arc<RemoteRank>, Arc<ValidatedPlan>)> = Vec::new();
        {
            let state = self.lock();
            for id in &ids {
                let req = state
                    .requests
                    .get(id)
                    .ok_or_else(|| format!("request {id} is not prefilled"))?;
                recorded.extend(
                    req.recorded
                        .iter()
                        .map(|r| (r.rank, Arc::clone(&r.dest), Arc::clone(&r.plan))),
                );
            }
        }
        // Per context rank, its pairs keyed by (registration, generation rank).
        type Keyed = Vec<((PeerId, u32), PairFragments)>;
        let mut pairs: BTreeMap<u32, Keyed> = BTreeMap::new();
        for (c, dest, plan) in recorded {
            let rank = self
                .instance
                .rank(c)
                .ok_or_else(|| format!("context rank {c} does not exist"))?;
            let pools = &rank.pools;
            let of_rank = pairs.entry(c).or_default();
            let key = (dest.peer, dest.rank);
            let k = match of_rank.iter().position(|(k, _)| *k == key) {
                Some(k) => k,
                None => {
                    of_rank.push((
                        key,
                        PairFragments {
                            ctx_rank: c,
                            gen_rank: dest.rank,
                            src_pools: (0..pools.len())
                                .filter_map(|p| pools.region(p).map(|r| r.len() as u64))
                                .collect(),
                            dst_pools: dest.pools.iter().map(|p| p.len).collect(),
                            ..PairFragments::default()
                        },
                    ));
                    of_rank.len() - 1
                }
            };
            let pair = &mut of_rank[k].1;
            pair.plans.push(plan.len() as u64);
            pair.bytes += plan.total_bytes();
            pair.fragments.reserve(plan.len());
            for (src, dst, len) in plan.fragments() {
                let (sp, so) = pools.locate(src, len).ok_or_else(|| {
                    format!("context rank {c}: source {src:#x}+{len} lies outside its pools")
                })?;
                let dp = dest.pool_of(dst, len).ok_or_else(|| {
                    format!(
                        "generation rank {}: destination {dst:#x}+{len} lies outside its pools",
                        dest.rank
                    )
                })?;
                let d = &dest.pools[dp];
                pair.fragments.push(PoolFragment(
                    sp as u32,
                    so as u64,
                    dp as u32,
                    dst - d.base,
                    len,
                ));
            }
        }
        Ok(pairs.into_values().flatten().map(|(_, p)| p).collect())
    }

    fn job_done(&self, request: u64) {
        let freed = {
            let mut state = self.lock();
            let free = match state.requests.get_mut(&request) {
                Some(req) => {
                    req.jobs_in_flight = req.jobs_in_flight.saturating_sub(1);
                    req.release_pending && req.jobs_in_flight == 0
                }
                None => false,
            };
            if free {
                state.requests.remove(&request)
            } else {
                None
            }
        };
        if let Some(on_free) = freed.and_then(|mut req| req.on_free.take()) {
            on_free();
        }
    }

    fn cancel(&self, peer: &GenPeer, request: u64, reason: &str) {
        tracing::debug!(request, peer = %peer.instance, %reason, "cancelled by receiver");
        let mut state = self.lock();
        state
            .orphans
            .retain_request(request, |s| s.peer.id != peer.id);
    }

    /// Lets go of a request: its `on_free` runs now if no write reads its slots, else once
    /// the last one stopped (a quarantined job's puts drained). Returns whether the request
    /// was known. Receiver ranks that ask for it later are not served.
    pub fn release(&self, request: u64) -> bool {
        let (known, freed) = {
            let mut state = self.lock();
            state.orphans.take(request);
            match state.requests.get_mut(&request) {
                Some(req) if req.jobs_in_flight == 0 => (true, state.requests.remove(&request)),
                Some(req) => {
                    req.release_pending = true;
                    (true, None)
                }
                None => (false, None),
            }
        };
        if let Some(on_free) = freed.and_then(|mut req| req.on_free.take()) {
            on_free();
        }
        known
    }
}

/// The completion that ends a (sender, receiver) pair's part of `request` at `piece`, failed:
/// nothing written, nothing more to come from this sender.
fn failed_piece(
    request: u64,
    (sender, receiver): (u32, u32),
    piece: u32,
    reason: String,
) -> PeerMessage {
    PeerMessage::Completion(Completion {
        request,
        sender_rank: sender,
        receiver_rank: receiver,
        piece,
        is_last: true,
        bytes: 0,
        fragments: 0,
        status: CompletionStatus::Failed(reason),
    })
}
