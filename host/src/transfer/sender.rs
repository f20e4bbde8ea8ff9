//! The context (sender) side: registrations, prefilled requests, planning, writing, notifying.
//!
//! A request becomes writable once two things happened, in either order: the controller's
//! [`Message::Submit`] ("prefill": the DP group's slots allocated and filled by the oracle)
//! and a receiver rank's [`Message::RequestData`]. Then, for that (sender, receiver) pair,
//! every piece is planned with [`plan_transfer`] (describe both sides, the bound planner's
//! `pair`, validation against both sides' rows, coalescing) and queued on the sender rank's
//! thread, which writes, flushes and only then lets [`Message::Completion`] go out. Pieces of
//! one pair run in order on one thread, so the `is_last` completion is the last one sent. A
//! plan that cannot be made is reported as a failed last piece, so the receiver never waits
//! for it.
//!
//! Every write job runs under the server's per-request timeout and gives up early on a
//! receiver whose registration ended; a job that gave up with puts in flight is reported
//! (failed, naming the receiver rank) only once those have drained, and holds its request's
//! slots until then (see [`super::rank`]). With `--record-plans` the queued plans are kept
//! until release, so [`Message::Bench`] can write them again with a bare put loop.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use kvferry_planner_abi::ffi::ROption;
use kvferry_planner_abi::{PairRequest, PlanError, RankInfo, SlotTable};

use super::conn::Outbox;
use super::instance::Instance;
use super::rank::{
    JobRelease, PeerId, RemoteRank, ReplayDone, ReplayJob, ReplayStats, WriteError, WriteJob,
};
use super::server::ServeOptions;
use super::slots::{Allocation, SlotError, SlotPools};
use super::verify::{VerifyError, fill_slots};
use super::wire::{
    BenchStats, Completion, CompletionStatus, InstanceInfo, Message, RankTables, RequestData, Role,
    Submit,
};
use super::{Flow, request_pieces};
use kvferry_plan::{PlanFailure, RequestSide, ValidatedPlan, plan_transfer};
use kvferry_testkit::oracle::Oracle;
use kvferry_testkit::scenario::slot_tables;

/// How long a `RequestData` for a request not yet submitted is kept.
const ORPHAN_TTL: Duration = Duration::from_secs(120);
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
         {peer_rank}: {source}"
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

/// Why a request could not be prefilled.
#[derive(Debug, thiserror::Error)]
pub enum PrefillError {
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
    /// No slots.
    #[error("request {request}: {source}")]
    Slots {
        /// The request.
        request: u64,
        /// The allocator's error.
        source: SlotError,
    },
    /// The oracle could not fill a rank's slots.
    #[error("request {request}: filling rank {rank}: {source}")]
    Fill {
        /// The request.
        request: u64,
        /// The rank.
        rank: u32,
        /// The oracle's error.
        source: VerifyError,
    },
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
    #[error("targets of generation rank {peer_rank}: {source}")]
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
    #[error("piece {piece}: {source}")]
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
    at: Instant,
}

/// A plan queued for a request, kept for [`Message::Bench`] when recording.
#[derive(Debug)]
struct Recorded {
    rank: u32,
    dest: Arc<RemoteRank>,
    plan: Arc<ValidatedPlan>,
}

#[derive(Debug)]
struct CtxRequest {
    prompt_len: u64,
    allocation: Allocation,
    tables: BTreeMap<u32, Vec<SlotTable>>,
    pieces: Vec<PairRequest>,
    jobs_in_flight: usize,
    release_pending: bool,
    recorded: Vec<Recorded>,
}

#[derive(Debug)]
struct State {
    slots: SlotPools,
    requests: HashMap<u64, CtxRequest>,
    orphans: HashMap<u64, Vec<Stashed>>,
    peers: HashMap<PeerId, Arc<GenPeer>>,
}

/// A context server: one instance, its registered generation peers and its requests.
#[derive(Debug)]
pub struct ContextServer {
    instance: Instance,
    info: InstanceInfo,
    oracle: Oracle,
    stall: Duration,
    timeout: Duration,
    record: bool,
    next_peer: AtomicU64,
    state: Mutex<State>,
}

/// What one connection to a context server has registered.
#[derive(Debug, Default)]
pub struct ContextSession {
    peer: Option<Arc<GenPeer>>,
}

impl ContextServer {
    /// A server for `instance` with the context side of `options`: the oracle fills
    /// prefilled requests with tags keyed by `options.seed`; every write job gives up after
    /// `options.timeout`; `options.stall` delays every flush (fault injection);
    /// `options.record_plans` keeps every queued plan until its request is released, for
    /// [`Message::Bench`].
    pub fn new(instance: Instance, options: &ServeOptions) -> Self {
        let config = instance.config();
        let slots = SlotPools::new(
            instance.dp_groups(),
            config.paged_slots,
            config.state_slots,
            instance.has_state(),
        );
        let info = instance.describe();
        Self {
            instance,
            info,
            oracle: Oracle::new(options.seed),
            stall: options.stall,
            timeout: options.timeout,
            record: options.record_plans,
            next_peer: AtomicU64::new(1),
            state: Mutex::new(State {
                slots,
                requests: HashMap::new(),
                orphans: HashMap::new(),
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

    /// Handles one message of a connection.
    pub fn handle(
        self: &Arc<Self>,
        session: &mut ContextSession,
        outbox: &Outbox,
        message: Message,
    ) -> Flow {
        match message {
            Message::InstanceInfoRequest => {
                let _ = outbox.send(Message::InstanceInfo(self.info.clone()));
                Flow::Continue
            }
            Message::Register(info) => {
                let reply = match self.register(info, outbox) {
                    Ok(peer) => {
                        if let Some(old) = session.peer.replace(Arc::clone(&peer)) {
                            self.unregister(&old);
                        }
                        Message::Registered {
                            instance: self.instance.name().to_string(),
                        }
                    }
                    Err(e) => {
                        tracing::info!(reason = %e, "refused a generation peer");
                        Message::Refused {
                            reason: e.to_string(),
                        }
                    }
                };
                let refused = matches!(reply, Message::Refused { .. });
                let _ = outbox.send(reply);
                if refused { Flow::Close } else { Flow::Continue }
            }
            Message::RequestData(data) => match &session.peer {
                Some(peer) => {
                    self.request_data(peer, data);
                    Flow::Continue
                }
                None => Flow::Refuse(format!(
                    "RequestData for request {} before Register",
                    data.request
                )),
            },
            Message::Cancel { request, reason } => {
                if let Some(peer) = &session.peer {
                    self.cancel(peer, request, &reason);
                }
                Flow::Continue
            }
            Message::Submit(submit) => {
                let request = submit.request;
                let result = self.submit(submit).map_err(|e| {
                    tracing::warn!(request, error = %e, "prefill refused");
                    e.to_string()
                });
                let _ = outbox.send(Message::Submitted { request, result });
                Flow::Continue
            }
            Message::Release { request } => {
                self.release(request);
                let _ = outbox.send(Message::Released { request });
                Flow::Continue
            }
            Message::Bench { requests } => {
                let result = self.bench(&requests).map_err(|e| {
                    tracing::warn!(error = %e, "bench replay failed");
                    e
                });
                let _ = outbox.send(Message::BenchDone { result });
                Flow::Continue
            }
            Message::Shutdown => Flow::Exit,
            other => Flow::Refuse(format!(
                "{} is not a message a context server accepts",
                other.kind()
            )),
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
            for stash in state.orphans.values_mut() {
                stash.retain(|s| s.peer.id != peer.id);
            }
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

    /// Prefills a request: slots for the DP group's ranks, tags from the oracle.
    fn submit(self: &Arc<Self>, submit: Submit) -> Result<Vec<RankTables>, PrefillError> {
        let id = submit.request;
        let invalid = |reason: String| PrefillError::Invalid {
            request: id,
            reason,
        };
        let model = &self.instance.config().model;
        let pieces =
            request_pieces(model, submit.prompt_len, submit.chunks.clone()).map_err(invalid)?;
        let group = self.instance.dp_group(submit.ctx_dp_rank);
        if group.is_empty() {
            return Err(invalid(format!(
                "ctx_dp_rank {} does not exist ({} dp groups)",
                submit.ctx_dp_rank,
                self.instance.dp_groups()
            )));
        }
        let blocks = submit
            .prompt_len
            .div_ceil(u64::from(model.tokens_per_block));
        let allocation = {
            let mut state = self.lock();
            if state.requests.contains_key(&id) {
                return Err(PrefillError::Duplicate { request: id });
            }
            state
                .slots
                .allocate(submit.ctx_dp_rank, blocks, id ^ 0x00c0_17e7)
                .map_err(|source| PrefillError::Slots {
                    request: id,
                    source,
                })?
        };
        let mut tables = BTreeMap::new();
        for &r in &group {
            let Some(rank) = self.instance.rank(r) else {
                continue;
            };
            let t = slot_tables(&rank.info, submit.prompt_len, 0, &allocation.assignment);
            if let Err(source) = fill_slots(&self.oracle, &rank.info, &rank.pools, &t) {
                self.lock().slots.free(&allocation);
                return Err(PrefillError::Fill {
                    request: id,
                    rank: r,
                    source,
                });
            }
            tables.insert(r, t);
        }
        let reply: Vec<RankTables> = tables
            .iter()
            .map(|(&rank, t)| RankTables {
                rank,
                tables: t.clone(),
            })
            .collect();
        let orphans = {
            let mut state = self.lock();
            state.requests.insert(
                id,
                CtxRequest {
                    prompt_len: submit.prompt_len,
                    allocation,
                    tables,
                    pieces,
                    jobs_in_flight: 0,
                    release_pending: false,
                    recorded: Vec::new(),
                },
            );
            state.orphans.remove(&id).unwrap_or_default()
        };
        tracing::debug!(
            request = id,
            prompt_len = submit.prompt_len,
            waiting = orphans.len(),
            "prefilled"
        );
        for stash in orphans {
            self.serve(&stash.peer, stash.data);
        }
        Ok(reply)
    }

    fn request_data(self: &Arc<Self>, peer: &Arc<GenPeer>, data: RequestData) {
        {
            let mut state = self.lock();
            if !state.requests.contains_key(&data.request) {
                let now = Instant::now();
                for stash in state.orphans.values_mut() {
                    stash.retain(|s| now.duration_since(s.at) < ORPHAN_TTL);
                }
                state.orphans.retain(|_, v| !v.is_empty());
                tracing::debug!(
                    request = data.request,
                    "request data before prefill: stashed"
                );
                state
                    .orphans
                    .entry(data.request)
                    .or_default()
                    .push(Stashed {
                        peer: Arc::clone(peer),
                        data,
                        at: now,
                    });
                return;
            }
        }
        self.serve(peer, data);
    }

    /// Plans every piece of a prefilled request for one (sender, receiver) pair and queues
    /// the writes; any failure is reported to the receiver as a failed last piece.
    fn serve(self: &Arc<Self>, peer: &Arc<GenPeer>, data: RequestData) {
        let (c, g) = (data.sender_rank, data.receiver_rank);
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
                tracing::warn!(request = data.request, sender = c, receiver = g, error = %e, "cannot serve");
                let _ = peer.outbox.send(Message::Completion(Completion {
                    request: data.request,
                    sender_rank: c,
                    receiver_rank: g,
                    piece: e.piece(),
                    is_last: true,
                    bytes: 0,
                    fragments: 0,
                    status: CompletionStatus::Failed(e.to_string()),
                }));
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
                dest: Arc::clone(dest),
                plan,
                timeout: self.timeout,
                stall: self.stall,
                done: Box::new(move |result| {
                    let (bytes, fragments, status) = match result {
                        Ok(s) => (s.bytes, s.fragments, CompletionStatus::Ok),
                        Err(e) => (0, 0, CompletionStatus::Failed(e.to_string())),
                    };
                    let _ = outbox.send(Message::Completion(Completion {
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
        tracing::debug!(
            request = data.request,
            sender = c,
            receiver = g,
            pieces = count,
            "queued"
        );
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
                dp: req.allocation.dp,
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
    /// The requests are held like write jobs hold them, so a `Release` meanwhile only
    /// quarantines their slots. The controller must still hold them on the generation side
    /// (their destination slots are written again) until the answer arrives.
    fn bench(self: &Arc<Self>, requests: &[u64]) -> Result<BenchStats, String> {
        if !self.record {
            return Err(
                "this context server does not record plans (start it with --record-plans)".into(),
            );
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

    fn job_done(&self, request: u64) {
        let mut state = self.lock();
        let free = match state.requests.get_mut(&request) {
            Some(req) => {
                req.jobs_in_flight = req.jobs_in_flight.saturating_sub(1);
                req.release_pending && req.jobs_in_flight == 0
            }
            None => false,
        };
        if free {
            if let Some(req) = state.requests.remove(&request) {
                state.slots.free(&req.allocation);
            }
        }
    }

    fn cancel(&self, peer: &GenPeer, request: u64, reason: &str) {
        tracing::debug!(request, peer = %peer.instance, %reason, "cancelled by receiver");
        let mut state = self.lock();
        if let Some(stash) = state.orphans.get_mut(&request) {
            stash.retain(|s| s.peer.id != peer.id);
        }
    }

    /// Frees a request's slots once no write reads them.
    fn release(&self, request: u64) {
        let mut state = self.lock();
        let free = match state.requests.get_mut(&request) {
            Some(req) if req.jobs_in_flight == 0 => true,
            Some(req) => {
                req.release_pending = true;
                false
            }
            None => false,
        };
        if free {
            if let Some(req) = state.requests.remove(&request) {
                state.slots.free(&req.allocation);
            }
        }
        state.orphans.remove(&request);
    }
}
