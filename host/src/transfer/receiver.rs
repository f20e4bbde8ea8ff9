//! The generation (receiver) side: peers, requests, completions, timeouts, verification.
//!
//! # Peers
//!
//! The first request naming a context server's control address bootstraps it: fetch its
//! [`InstanceInfo`], compare `planner_id` and `describer_id` before anything else, run this
//! instance's `check_peer` (me = each of its ranks, peer = context rank 0), and only then
//! [`Message::Register`] this instance's ranks. The verdict is cached per address: a refused
//! peer fails every later request addressed to it at once, with the reason, and nothing else.
//! A compatible peer keeps one control connection; when it closes, every request still
//! waiting on that peer fails at once, naming it, and the next request reconnects.
//!
//! # Requests
//!
//! A request takes slots in its DP group (free slots always hold the canary: primed at start,
//! re-primed on release), asks every receiver
//! rank's planner for its targets (`targets(me, context rank 0, ctx_dp_rank)`) and sends one
//! [`Message::RequestData`] per (receiver, target) pair. It completes when every pair has
//! reported a successful last piece (each report is sent after the sender's flush); any
//! failed piece, the deadline, a cancel or the peer's connection closing fails it. Slots of a
//! failed request stay quarantined until every writer reported its last piece or the peer is
//! gone, since a late write could otherwise land in a reused slot.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_planner_abi::ffi::ROption;
use kvferry_planner_abi::{PairRequest, PlanError, SlotTable, TokenRange};

use super::conn::{Outbox, spawn_writer};
use super::instance::Instance;
use super::rank::PeerId;
use super::slots::{Allocation, SlotError, SlotPools};
use super::verify::{ReceiverPart, VerifyError, prime_slots, verify_idle, verify_request};
use super::wire::{
    Completion, CompletionStatus, InstanceInfo, Message, RankTables, RequestData, RequestStats,
    Role, Submit, VerifySummary, read_frame, write_frame,
};
use super::{Flow, request_pieces};
use kvferry_testkit::oracle::{Oracle, VerifyReport};
use kvferry_testkit::scenario::slot_tables;

/// How long connecting to a context server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the bootstrap exchange may take.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(10);
/// How often deadlines are checked.
const REAPER_PERIOD: Duration = Duration::from_millis(20);

/// Why a context peer cannot be used.
#[derive(Clone, Debug, thiserror::Error)]
pub enum PeerError {
    /// Unreachable, or it answered out of protocol; tried again by the next request.
    #[error("context peer at {addr}: {problem}")]
    Unreachable {
        /// The peer's control address.
        addr: String,
        /// What failed.
        problem: String,
    },
    /// Incompatible; the verdict is cached for the address.
    #[error("context peer {instance} at {addr} refused: {reason}")]
    Refused {
        /// The peer's control address.
        addr: String,
        /// The peer instance.
        instance: String,
        /// Which side refused which rank, and why (the planner's field-level reason).
        reason: String,
    },
}

/// Why a request failed on the generation side (sent to the controller in `Done`).
#[derive(Clone, Debug, thiserror::Error)]
pub enum RequestError {
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
    /// The context peer cannot be used.
    #[error("request {request}: {source}")]
    Peer {
        /// The request.
        request: u64,
        /// Why.
        source: PeerError,
    },
    /// A receiver rank's planner could not compute its targets.
    #[error("request {request}: gen rank {rank}: targets: {source}")]
    Targets {
        /// The request.
        request: u64,
        /// The receiver rank.
        rank: u32,
        /// The planner's error.
        source: PlanError,
    },
    /// A receiver rank's planner targets a context rank outside the request's DP group.
    #[error(
        "request {request}: gen rank {rank} targets ctx rank {target}, which is not in ctx dp \
         group {dp}"
    )]
    TargetOutsideGroup {
        /// The request.
        request: u64,
        /// The receiver rank.
        rank: u32,
        /// The context rank it names.
        target: u32,
        /// The request's context DP group.
        dp: u32,
    },
    /// No slots.
    #[error("request {request}: {source}")]
    Slots {
        /// The request.
        request: u64,
        /// The allocator's error.
        source: SlotError,
    },
    /// A writer reported a failed piece.
    #[error(
        "request {request}: {peer}: ctx rank {sender} -> gen rank {receiver} piece {piece} \
         failed: {reason}"
    )]
    Piece {
        /// The request.
        request: u64,
        /// The context peer.
        peer: String,
        /// The writer.
        sender: u32,
        /// The receiver rank.
        receiver: u32,
        /// The piece.
        piece: u32,
        /// The writer's reason.
        reason: String,
    },
    /// Not every writer reported its last piece in time.
    #[error("request {request}: timed out after {timeout_ms} ms waiting on {peer} for {missing}")]
    Timeout {
        /// The request.
        request: u64,
        /// The timeout.
        timeout_ms: u128,
        /// The context peer.
        peer: String,
        /// The (sender, receiver) pairs still missing.
        missing: String,
    },
    /// The context peer's control connection ended.
    #[error("request {request}: {reason}")]
    PeerLost {
        /// The request.
        request: u64,
        /// How, naming the peer.
        reason: String,
    },
    /// The controller cancelled it.
    #[error("request {request}: cancelled: {reason}")]
    Cancelled {
        /// The request.
        request: u64,
        /// The controller's reason.
        reason: String,
    },
    /// The controller released it before it finished.
    #[error("request {request}: released while in flight")]
    Released {
        /// The request.
        request: u64,
    },
}

/// Why a verification could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// No such request (never submitted, or released).
    #[error("request {request} is unknown (or released)")]
    Unknown {
        /// The request.
        request: u64,
    },
    /// The request failed; there is nothing to check.
    #[error("request {request} failed: {source}")]
    Failed {
        /// The request.
        request: u64,
        /// Why it failed.
        source: RequestError,
    },
    /// The request has not finished.
    #[error("request {request} is still in flight")]
    InFlight {
        /// The request.
        request: u64,
    },
    /// The controller named a context rank the peer does not have.
    #[error("{peer} has no rank {rank}")]
    NoPeerRank {
        /// The context peer.
        peer: String,
        /// The rank.
        rank: u32,
    },
    /// Requests still hold slots, so the pools are not idle.
    #[error("{count} requests still hold slots")]
    Busy {
        /// Requests holding slots.
        count: usize,
    },
    /// The oracle could not check.
    #[error("request {request}: {source}")]
    Oracle {
        /// The request (0 for the idle check).
        request: u64,
        /// The oracle's error.
        source: VerifyError,
    },
}

/// A context server this instance registered with.
#[derive(Debug)]
struct CtxPeer {
    id: PeerId,
    addr: String,
    info: InstanceInfo,
    outbox: Outbox,
    alive: AtomicBool,
}

impl CtxPeer {
    fn name(&self) -> String {
        format!("context peer {} at {}", self.info.instance_name, self.addr)
    }
}

#[derive(Debug)]
enum Verdict {
    Compatible(Arc<CtxPeer>),
    Refused(PeerError),
}

#[derive(Debug)]
struct GenRequest {
    peer: Arc<CtxPeer>,
    allocation: Allocation,
    tables: BTreeMap<u32, Vec<SlotTable>>,
    pieces: Vec<PairRequest>,
    expected: BTreeSet<(u32, u32)>,
    finished: BTreeSet<(u32, u32)>,
    terminal: BTreeSet<(u32, u32)>,
    stats: RequestStats,
    started: Instant,
    deadline: Instant,
    outcome: Option<Result<RequestStats, RequestError>>,
    reply: Outbox,
    release_pending: bool,
}

impl GenRequest {
    /// Whether no write of the request can still land.
    fn quiescent(&self) -> bool {
        self.terminal.len() == self.expected.len() || !self.peer.alive.load(Ordering::Acquire)
    }

    fn missing(&self) -> Vec<String> {
        self.expected
            .difference(&self.finished)
            .map(|(c, g)| format!("ctx rank {c} -> gen rank {g}"))
            .collect()
    }
}

#[derive(Debug)]
struct State {
    slots: SlotPools,
    requests: HashMap<u64, GenRequest>,
}

/// A generation server: one instance, its context peers and its requests.
#[derive(Debug)]
pub struct GenerationServer {
    instance: Instance,
    info: InstanceInfo,
    oracle: Oracle,
    timeout: Duration,
    next_peer: AtomicU64,
    peers: Mutex<HashMap<String, Arc<Mutex<Option<Verdict>>>>>,
    state: Mutex<State>,
}

/// A controller connection to a generation server (no per-connection state).
#[derive(Debug, Default)]
pub struct GenerationSession;

impl GenerationServer {
    /// A server for `instance`: requests time out after `timeout`; the oracle's canary and
    /// tags are keyed by `seed`. Starts the deadline thread.
    pub fn new(instance: Instance, seed: u64, timeout: Duration) -> Arc<Self> {
        let config = instance.config();
        let slots = SlotPools::new(
            instance.dp_groups(),
            config.paged_slots,
            config.state_slots,
            instance.has_state(),
        );
        let info = instance.describe();
        let server = Arc::new(Self {
            instance,
            info,
            oracle: Oracle::new(seed),
            timeout,
            next_peer: AtomicU64::new(1),
            peers: Mutex::new(HashMap::new()),
            state: Mutex::new(State {
                slots,
                requests: HashMap::new(),
            }),
        });
        let weak = Arc::downgrade(&server);
        let reaper = thread::Builder::new().name("reaper".into()).spawn(move || {
            while let Some(server) = weak.upgrade() {
                server.reap();
                drop(server);
                thread::sleep(REAPER_PERIOD);
            }
        });
        if let Err(e) = reaper {
            tracing::warn!(error = %e, "cannot spawn the deadline thread; requests will not time out");
        }
        server
    }

    /// The instance.
    pub fn instance(&self) -> &Instance {
        &self.instance
    }

    /// The oracle keyed by the server's seed.
    pub fn oracle(&self) -> &Oracle {
        &self.oracle
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Handles one message of a controller connection.
    pub fn handle(
        self: &Arc<Self>,
        _session: &mut GenerationSession,
        outbox: &Outbox,
        message: Message,
    ) -> Flow {
        match message {
            Message::Submit(submit) => {
                let request = submit.request;
                if let Err(e) = self.submit(submit, outbox) {
                    tracing::warn!(request, error = %e, "request failed");
                    let _ = outbox.send(Message::Done {
                        request,
                        result: Err(e.to_string()),
                    });
                }
                Flow::Continue
            }
            Message::Verify { request, context } => {
                let result = self.verify(request, &context).map_err(|e| e.to_string());
                let _ = outbox.send(Message::Verified { request, result });
                Flow::Continue
            }
            Message::Release { request } => {
                self.release(request);
                let _ = outbox.send(Message::Released { request });
                Flow::Continue
            }
            Message::Cancel { request, reason } => {
                self.cancel(request, &reason);
                Flow::Continue
            }
            Message::VerifyIdle => {
                let result = self.verify_idle().map_err(|e| e.to_string());
                let _ = outbox.send(Message::IdleVerified { result });
                Flow::Continue
            }
            Message::InstanceInfoRequest => {
                let _ = outbox.send(Message::InstanceInfo(self.info.clone()));
                Flow::Continue
            }
            Message::Shutdown => Flow::Exit,
            other => Flow::Refuse(format!(
                "{} is not a message a generation server accepts",
                other.kind()
            )),
        }
    }

    /// Starts a request; `Err` fails it at once (the caller sends `Done`).
    fn submit(self: &Arc<Self>, submit: Submit, reply: &Outbox) -> Result<(), RequestError> {
        let id = submit.request;
        let invalid = |reason: String| RequestError::Invalid {
            request: id,
            reason,
        };
        let addr = submit
            .peer
            .clone()
            .ok_or_else(|| invalid("no context peer address".into()))?;
        let model = &self.instance.config().model;
        if submit.cached > submit.prompt_len {
            return Err(invalid(format!(
                "cached {} exceeds prompt_len {}",
                submit.cached, submit.prompt_len
            )));
        }
        let mut pieces =
            request_pieces(model, submit.prompt_len, submit.chunks.clone()).map_err(invalid)?;
        let tpb = u64::from(model.tokens_per_block);
        let cached = submit.cached / tpb * tpb;
        let dst_start_token = (cached > 0).then_some(cached);
        for p in &mut pieces {
            p.dst_start_token = match dst_start_token {
                Some(t) => ROption::RSome(t),
                None => ROption::RNone,
            };
        }
        let group = self.instance.dp_group(submit.gen_dp_rank);
        if group.is_empty() {
            return Err(invalid(format!(
                "gen_dp_rank {} does not exist ({} dp groups)",
                submit.gen_dp_rank,
                self.instance.dp_groups()
            )));
        }
        if self.lock().requests.contains_key(&id) {
            return Err(RequestError::Duplicate { request: id });
        }

        let peer = self.peer(&addr).map_err(|source| RequestError::Peer {
            request: id,
            source,
        })?;
        // A peer without ranks is refused at bootstrap.
        let ctx0 = peer
            .info
            .ranks
            .first()
            .map(|d| &d.info)
            .ok_or_else(|| invalid(format!("{} has no ranks", peer.name())))?;
        let ctx_group: BTreeSet<u32> = peer
            .info
            .ranks
            .iter()
            .filter(|d| d.info.dp_rank == submit.ctx_dp_rank)
            .map(|d| d.info.instance_rank)
            .collect();
        if ctx_group.is_empty() {
            return Err(invalid(format!(
                "{} has no dp rank {}",
                peer.name(),
                submit.ctx_dp_rank
            )));
        }
        let mut expected = BTreeSet::new();
        for &g in &group {
            let Some(rank) = self.instance.rank(g) else {
                continue;
            };
            let targets = rank
                .planner
                .targets(&rank.info, ctx0, submit.ctx_dp_rank)
                .map_err(|source| RequestError::Targets {
                    request: id,
                    rank: g,
                    source,
                })?;
            for &c in targets.ranks.iter() {
                if !ctx_group.contains(&c) {
                    return Err(RequestError::TargetOutsideGroup {
                        request: id,
                        rank: g,
                        target: c,
                        dp: submit.ctx_dp_rank,
                    });
                }
                expected.insert((c, g));
            }
        }

        let blocks = submit.prompt_len.div_ceil(tpb);
        let allocation = self
            .lock()
            .slots
            .allocate(submit.gen_dp_rank, blocks, id ^ 0x0009_e4e7)
            .map_err(|source| RequestError::Slots {
                request: id,
                source,
            })?;
        // Free slots hold the canary already (primed at start, re-primed on release).
        let tables: BTreeMap<u32, Vec<SlotTable>> = group
            .iter()
            .filter_map(|&g| self.instance.rank(g))
            .map(|rank| {
                let t = slot_tables(
                    &rank.info,
                    submit.prompt_len,
                    submit.cached,
                    &allocation.assignment,
                );
                (rank.info.instance_rank, t)
            })
            .collect();

        let started = Instant::now();
        let messages: Vec<RequestData> = expected
            .iter()
            .filter_map(|&(c, g)| Some((c, g, tables.get(&g)?)))
            .map(|(c, g, t)| RequestData {
                request: id,
                receiver_instance: self.instance.name().to_string(),
                receiver_rank: g,
                sender_rank: c,
                slot_tables: t.clone(),
                token_range: TokenRange {
                    start: 0,
                    end: submit.prompt_len,
                },
                prompt_len: submit.prompt_len,
                dst_start_token,
                excluded_views: Vec::new(),
            })
            .collect();
        let writers = expected.len();
        {
            let mut state = self.lock();
            state.requests.insert(
                id,
                GenRequest {
                    peer: Arc::clone(&peer),
                    allocation,
                    tables,
                    pieces,
                    expected,
                    finished: BTreeSet::new(),
                    terminal: BTreeSet::new(),
                    stats: RequestStats::default(),
                    started,
                    deadline: started + self.timeout,
                    outcome: None,
                    reply: reply.clone(),
                    release_pending: false,
                },
            );
            if writers == 0 {
                // Nobody writes: complete at once.
                if let Some(req) = state.requests.get_mut(&id) {
                    complete(id, req);
                }
                return Ok(());
            }
        }
        tracing::debug!(request = id, peer = %peer.info.instance_name, writers, "requesting data");
        for data in messages {
            if peer.outbox.send(Message::RequestData(data)).is_err() {
                self.fail(
                    id,
                    RequestError::PeerLost {
                        request: id,
                        reason: format!("{} is not connected", peer.name()),
                    },
                );
                break;
            }
        }
        Ok(())
    }

    /// The peer at `addr`: cached, or bootstrapped now.
    fn peer(self: &Arc<Self>, addr: &str) -> Result<Arc<CtxPeer>, PeerError> {
        let slot = {
            let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
            Arc::clone(peers.entry(addr.to_string()).or_default())
        };
        let mut verdict = slot.lock().unwrap_or_else(|e| e.into_inner());
        match &*verdict {
            Some(Verdict::Refused(reason)) => return Err(reason.clone()),
            Some(Verdict::Compatible(peer)) if peer.alive.load(Ordering::Acquire) => {
                return Ok(Arc::clone(peer));
            }
            _ => {}
        }
        match self.bootstrap(addr) {
            Ok(peer) => {
                *verdict = Some(Verdict::Compatible(Arc::clone(&peer)));
                Ok(peer)
            }
            Err(e @ PeerError::Refused { .. }) => {
                tracing::info!(peer = %addr, reason = %e, "context peer refused; verdict cached");
                *verdict = Some(Verdict::Refused(e.clone()));
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// Fetches, vets and registers with the context server at `addr`.
    fn bootstrap(self: &Arc<Self>, addr: &str) -> Result<Arc<CtxPeer>, PeerError> {
        let failed = |problem: String| PeerError::Unreachable {
            addr: addr.to_string(),
            problem,
        };
        let sock = addr
            .to_socket_addrs()
            .map_err(|e| failed(format!("cannot resolve: {e}")))?
            .next()
            .ok_or_else(|| failed("resolves to no address".into()))?;
        let mut stream = TcpStream::connect_timeout(&sock, CONNECT_TIMEOUT)
            .map_err(|e| failed(format!("cannot connect: {e}")))?;
        let _ = stream.set_nodelay(true);
        stream
            .set_read_timeout(Some(BOOTSTRAP_TIMEOUT))
            .map_err(|e| failed(e.to_string()))?;
        write_frame(&mut stream, &Message::InstanceInfoRequest)
            .map_err(|e| failed(format!("sending InstanceInfoRequest: {e}")))?;
        let info = match read_frame(&mut stream) {
            Ok(Message::InstanceInfo(info)) => info,
            Ok(other) => {
                return Err(failed(format!(
                    "answered {} to InstanceInfoRequest",
                    other.kind()
                )));
            }
            Err(e) => return Err(failed(format!("reading InstanceInfo: {e}"))),
        };
        let refuse = |reason: String| PeerError::Refused {
            addr: addr.to_string(),
            instance: info.instance_name.clone(),
            reason,
        };
        let bound = self.instance.bound();
        if info.planner_id != bound.id() || info.describer_id != bound.describer_id() {
            return Err(refuse(format!(
                "it binds planner {} (describer {}), this generation instance binds {} (describer \
                 {})",
                info.planner_id,
                info.describer_id,
                bound.id(),
                bound.describer_id()
            )));
        }
        if info.role != Role::Context {
            return Err(refuse(format!("it is a {} instance", info.role)));
        }
        let ctx0 = info
            .ranks
            .first()
            .ok_or_else(|| refuse("it has no ranks".into()))?;
        for (c, d) in info.ranks.iter().enumerate() {
            if d.info.instance_rank as usize != c {
                return Err(refuse(format!(
                    "rank {c} describes itself as rank {}",
                    d.info.instance_rank
                )));
            }
            d.info
                .page_table
                .validate()
                .map_err(|e| refuse(format!("rank {c} has an invalid page table: {e}")))?;
        }
        for rank in self.instance.ranks() {
            rank.planner
                .check_peer(&rank.info, &ctx0.info)
                .map_err(|e| {
                    refuse(format!(
                        "gen rank {} (planner {}) refuses ctx rank 0: {e}",
                        rank.info.instance_rank,
                        bound.id()
                    ))
                })?;
        }
        write_frame(&mut stream, &Message::Register(self.info.clone()))
            .map_err(|e| failed(format!("sending Register: {e}")))?;
        match read_frame(&mut stream) {
            Ok(Message::Registered { .. }) => {}
            Ok(Message::Refused { reason }) => return Err(refuse(reason)),
            Ok(other) => return Err(failed(format!("answered {} to Register", other.kind()))),
            Err(e) => return Err(failed(format!("reading the registration verdict: {e}"))),
        }
        stream
            .set_read_timeout(None)
            .map_err(|e| failed(e.to_string()))?;
        let reader = stream
            .try_clone()
            .map_err(|e| failed(format!("cannot clone the socket: {e}")))?;
        let peer = Arc::new(CtxPeer {
            id: self.next_peer.fetch_add(1, Ordering::Relaxed),
            addr: addr.to_string(),
            outbox: spawn_writer(stream, format!("peer-{addr}")),
            info,
            alive: AtomicBool::new(true),
        });
        let server = Arc::clone(self);
        let reading = Arc::clone(&peer);
        thread::Builder::new()
            .name(format!("peer-{addr}"))
            .spawn(move || server.read_peer(&reading, reader))
            .map_err(|e| failed(format!("cannot spawn its reader: {e}")))?;
        tracing::info!(peer = %peer.info.instance_name, %addr, label = %peer.info.label, "registered with context peer");
        Ok(peer)
    }

    /// Reads a peer's completions until its connection ends, then fails what waits on it.
    fn read_peer(&self, peer: &Arc<CtxPeer>, stream: TcpStream) {
        let mut reader = std::io::BufReader::new(stream);
        let why = loop {
            match read_frame(&mut reader) {
                Ok(Message::Completion(c)) => self.completion(peer, c),
                Ok(Message::Error { message }) => {
                    break format!("{} reported an error and closed: {message}", peer.name());
                }
                Ok(other) => {
                    tracing::warn!(peer = %peer.name(), kind = other.kind(), "ignoring an unexpected message")
                }
                Err(e) if e.is_disconnect() => {
                    break format!("{} closed its control connection", peer.name());
                }
                Err(e) => break format!("{} sent a bad frame: {e}", peer.name()),
            }
        };
        peer.alive.store(false, Ordering::Release);
        let failed = self.peer_lost(peer, &why);
        if failed > 0 {
            tracing::warn!(peer = %peer.info.instance_name, reason = %why, failed, "context peer lost");
        } else {
            tracing::info!(peer = %peer.info.instance_name, reason = %why, "context peer gone");
        }
    }

    fn completion(&self, peer: &CtxPeer, c: Completion) {
        let mut release = None;
        {
            let mut state = self.lock();
            let Some(req) = state.requests.get_mut(&c.request) else {
                tracing::debug!(request = c.request, "completion for an unknown request");
                return;
            };
            let pair = (c.sender_rank, c.receiver_rank);
            if req.peer.id != peer.id || !req.expected.contains(&pair) {
                tracing::warn!(
                    request = c.request,
                    sender = c.sender_rank,
                    receiver = c.receiver_rank,
                    "unexpected completion ignored"
                );
                return;
            }
            if c.is_last {
                req.terminal.insert(pair);
            }
            match &c.status {
                CompletionStatus::Ok => {
                    req.stats.bytes += c.bytes;
                    req.stats.fragments += c.fragments;
                    req.stats.pieces += 1;
                    if c.is_last {
                        req.finished.insert(pair);
                        req.stats.writers += 1;
                    }
                    if req.outcome.is_none() && req.finished.len() == req.expected.len() {
                        complete(c.request, req);
                    }
                }
                CompletionStatus::Failed(reason) => {
                    if req.outcome.is_none() {
                        let error = RequestError::Piece {
                            request: c.request,
                            peer: peer.name(),
                            sender: c.sender_rank,
                            receiver: c.receiver_rank,
                            piece: c.piece,
                            reason: reason.clone(),
                        };
                        fail_request(c.request, req, error);
                    }
                }
            }
            if req.release_pending && req.quiescent() {
                release = state.requests.remove(&c.request);
            }
        }
        if let Some(req) = release {
            self.free(req);
        }
    }

    /// Fails every request waiting on `peer`; returns how many.
    fn peer_lost(&self, peer: &CtxPeer, why: &str) -> usize {
        let mut released = Vec::new();
        let mut failed = 0;
        {
            let mut state = self.lock();
            let ids: Vec<u64> = state
                .requests
                .iter()
                .filter(|(_, r)| r.peer.id == peer.id)
                .map(|(&id, _)| id)
                .collect();
            for id in ids {
                let Some(req) = state.requests.get_mut(&id) else {
                    continue;
                };
                if req.outcome.is_none() {
                    let error = RequestError::PeerLost {
                        request: id,
                        reason: why.to_string(),
                    };
                    fail_request(id, req, error);
                    failed += 1;
                }
                if req.release_pending {
                    released.extend(state.requests.remove(&id));
                }
            }
        }
        for req in released {
            self.free(req);
        }
        failed
    }

    /// Fails requests past their deadline.
    fn reap(&self) {
        let now = Instant::now();
        let mut cancels = Vec::new();
        {
            let mut state = self.lock();
            for (&id, req) in state.requests.iter_mut() {
                if req.outcome.is_none() && now >= req.deadline {
                    let error = RequestError::Timeout {
                        request: id,
                        timeout_ms: self.timeout.as_millis(),
                        peer: req.peer.name(),
                        missing: req.missing().join(", "),
                    };
                    fail_request(id, req, error);
                    cancels.push((Arc::clone(&req.peer), id));
                }
            }
        }
        for (peer, request) in cancels {
            let _ = peer.outbox.send(Message::Cancel {
                request,
                reason: "receiver timed out".into(),
            });
        }
    }

    fn fail(&self, id: u64, error: RequestError) {
        let mut state = self.lock();
        if let Some(req) = state.requests.get_mut(&id) {
            if req.outcome.is_none() {
                fail_request(id, req, error);
            }
        }
    }

    fn cancel(&self, id: u64, reason: &str) {
        let peer = {
            let mut state = self.lock();
            match state.requests.get_mut(&id) {
                Some(req) if req.outcome.is_none() => {
                    let error = RequestError::Cancelled {
                        request: id,
                        reason: reason.to_string(),
                    };
                    fail_request(id, req, error);
                    Some(Arc::clone(&req.peer))
                }
                _ => None,
            }
        };
        if let Some(peer) = peer {
            let _ = peer.outbox.send(Message::Cancel {
                request: id,
                reason: reason.to_string(),
            });
        }
    }

    /// Frees a request's slots now if no write can still land, else once none can.
    fn release(&self, id: u64) {
        let req = {
            let mut state = self.lock();
            match state.requests.get_mut(&id) {
                Some(req) if req.outcome.is_some() && req.quiescent() => state.requests.remove(&id),
                Some(req) => {
                    if req.outcome.is_none() {
                        fail_request(id, req, RequestError::Released { request: id });
                    }
                    tracing::debug!(
                        request = id,
                        "slots quarantined until every writer reported"
                    );
                    req.release_pending = true;
                    None
                }
                None => None,
            }
        };
        if let Some(req) = req {
            self.free(req);
        }
    }

    /// Re-primes a request's slots with the canary and returns them.
    fn free(&self, req: GenRequest) {
        for (&g, tables) in &req.tables {
            if let Some(rank) = self.instance.rank(g) {
                if let Err(e) = prime_slots(&self.oracle, &rank.info, &rank.pools, tables) {
                    tracing::warn!(rank = g, error = %e, "cannot re-prime released slots");
                }
            }
        }
        self.lock().slots.free(&req.allocation);
    }

    /// Checks a completed request's destination slots with the oracle.
    fn verify(&self, id: u64, context: &[RankTables]) -> Result<VerifySummary, CheckError> {
        let (peer, tables, pieces) = {
            let state = self.lock();
            let req = state
                .requests
                .get(&id)
                .ok_or(CheckError::Unknown { request: id })?;
            match &req.outcome {
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    return Err(CheckError::Failed {
                        request: id,
                        source: e.clone(),
                    });
                }
                None => return Err(CheckError::InFlight { request: id }),
            }
            (
                Arc::clone(&req.peer),
                req.tables.clone(),
                req.pieces.clone(),
            )
        };
        let parts: Vec<ReceiverPart<'_>> = tables
            .iter()
            .filter_map(|(&g, t)| {
                let rank = self.instance.rank(g)?;
                Some(ReceiverPart {
                    info: &rank.info,
                    pools: &rank.pools,
                    tables: t,
                    excluded: &[],
                })
            })
            .collect();
        let mut ctx = Vec::with_capacity(context.len());
        for t in context {
            let d = peer
                .info
                .ranks
                .get(t.rank as usize)
                .ok_or_else(|| CheckError::NoPeerRank {
                    peer: peer.name(),
                    rank: t.rank,
                })?;
            ctx.push((&d.info, t.tables.as_slice()));
        }
        let report = verify_request(&self.oracle, &parts, &ctx, &pieces).map_err(|source| {
            CheckError::Oracle {
                request: id,
                source,
            }
        })?;
        Ok(summary(&report))
    }

    fn verify_idle(&self) -> Result<VerifySummary, CheckError> {
        let count = self.lock().requests.len();
        if count > 0 {
            return Err(CheckError::Busy { count });
        }
        let ranks: Vec<_> = self
            .instance
            .ranks()
            .iter()
            .map(|r| (&r.info, r.pools.as_ref()))
            .collect();
        let report = verify_idle(&self.oracle, &ranks)
            .map_err(|source| CheckError::Oracle { request: 0, source })?;
        Ok(summary(&report))
    }
}

fn complete(id: u64, req: &mut GenRequest) {
    req.stats.latency_us = req.started.elapsed().as_micros() as u64;
    let stats = req.stats.clone();
    tracing::debug!(
        request = id,
        bytes = stats.bytes,
        latency_us = stats.latency_us,
        "complete"
    );
    req.outcome = Some(Ok(stats.clone()));
    let _ = req.reply.send(Message::Done {
        request: id,
        result: Ok(stats),
    });
}

fn fail_request(id: u64, req: &mut GenRequest, error: RequestError) {
    tracing::warn!(request = id, %error, "request failed");
    let message = error.to_string();
    req.outcome = Some(Err(error));
    let _ = req.reply.send(Message::Done {
        request: id,
        result: Err(message),
    });
}

/// The wire form of a report.
pub fn summary(report: &VerifyReport) -> VerifySummary {
    VerifySummary {
        ok: report.is_clean(),
        bytes_checked: report.bytes_checked,
        bytes_covered: report.bytes_covered,
        mismatched_bytes: report.mismatched_bytes,
        detail: report.to_string(),
    }
}
