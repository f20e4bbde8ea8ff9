//! The generation (receiver) side: peers, requests, completions, timeouts.
//!
//! # Peers
//!
//! The first request naming a context server's control address bootstraps it: fetch its
//! [`InstanceInfo`], compare `planner_id` and `describer_id` before anything else, run this
//! instance's `check_peer` (me = each of its ranks, peer = context rank 0), and only then
//! [`PeerMessage::Register`] this instance's ranks. A refusal is cached for the instance that
//! earned it, not for its address: a later request to that address asks again who answers
//! there, repeats the cached reason if it is the same instance (same name, planner, ranks),
//! and vets it anew if not — a context server restarted with a compatible build is accepted.
//! A compatible peer keeps one control connection; when it closes, every request still
//! waiting on that peer fails at once, naming it, and the next request reconnects.
//!
//! # Requests
//!
//! A request ([`GenerationServer::expect`]) names its DP group's destination slot tables (the
//! caller's slots), asks every receiver rank's planner for its targets (`targets(me, context
//! rank 0, ctx_dp_rank)`) and sends one [`PeerMessage::RequestData`] per (receiver, target)
//! pair. It completes when every pair has reported a successful last piece (each report is
//! sent after the sender's flush); any failed piece, the deadline, a cancel or the peer's
//! connection closing fails it. Exactly one `on_done` call reports the outcome. A released
//! request's `on_free` runs only once every writer reported its last piece or the peer is
//! gone, since a late write could otherwise land in a reused slot.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_planner_abi::ffi::ROption;
use kvferry_planner_abi::{PairRequest, PlanError, SlotTable, TokenRange};

use kvferry_plan::error_chain;
use kvferry_protocol::{
    Completion, DialEvent, Dialer, InstanceInfo, PeerMessage, RequestData, RequestTracker,
    SessionError, Tracked, Violation, read_frame, write_frame,
};

use crate::conn::{Outbox, spawn_writer};
use crate::instance::Instance;
use crate::outcome::{OnFree, RequestStats};
use crate::rank::PeerId;

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
    /// Incompatible; the verdict is cached for that peer instance.
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

/// Why a request failed on the generation side.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
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
    #[error("request {request}: context peer unusable")]
    Peer {
        /// The request.
        request: u64,
        /// Why.
        source: PeerError,
    },
    /// A receiver rank's planner could not compute its targets.
    #[error("request {request}: gen rank {rank}: targets failed")]
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
    /// A writer's completion broke the protocol (a piece out of order or range, repeated, or
    /// after its last): the request's bytes cannot be vouched for.
    #[error("request {request}: {peer} broke the protocol")]
    Protocol {
        /// The request.
        request: u64,
        /// The context peer.
        peer: String,
        /// What it did.
        source: Violation,
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
    /// The caller cancelled it.
    #[error("request {request}: cancelled: {reason}")]
    Cancelled {
        /// The request.
        request: u64,
        /// The controller's reason.
        reason: String,
    },
    /// The caller released it before it finished.
    #[error("request {request}: released while in flight")]
    Released {
        /// The request.
        request: u64,
    },
}

/// Why a request's outcome cannot be read ([`GenerationServer::completed`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckError {
    /// No such request (never expected, or released).
    #[error("request {request} is unknown (or released)")]
    Unknown {
        /// The request.
        request: u64,
    },
    /// The request failed; there is nothing to check.
    #[error("request {request} failed")]
    Failed {
        /// The request.
        request: u64,
        /// Why it failed.
        #[source]
        source: RequestError,
    },
    /// The request has not finished.
    #[error("request {request} is still in flight")]
    InFlight {
        /// The request.
        request: u64,
    },
}

/// A completed request, as [`GenerationServer::completed`] reports it.
#[derive(Clone, Debug)]
pub struct Completed {
    /// The context peer that wrote it.
    pub peer: InstanceInfo,
    /// The destination slot tables, per receiver rank.
    pub tables: BTreeMap<u32, Vec<SlotTable>>,
    /// The pieces it was sent in.
    pub pieces: Vec<PairRequest>,
    /// What it moved.
    pub stats: RequestStats,
}

/// Reports a request's outcome, once. Called on a kvferry thread with internal locks held:
/// it must not call back into the server; hand the news to a channel.
pub type OnDone = Box<dyn FnOnce(u64, Result<RequestStats, RequestError>) + Send>;

/// A request a generation instance expects ([`GenerationServer::expect`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expect {
    /// The request id both sides know.
    pub request: u64,
    /// The context server's peer address (`host:port`).
    pub peer: String,
    /// The context DP group that holds it.
    pub ctx_dp_rank: u32,
    /// This instance's DP group receiving it.
    pub gen_dp_rank: u32,
    /// Prompt tokens.
    pub prompt_len: u64,
    /// The pieces the sender sends (one, or block-aligned chunks).
    pub pieces: Vec<PairRequest>,
    /// Block-aligned token where the destination tables start to matter (a cached prefix).
    pub dst_start_token: Option<u64>,
    /// The destination slot tables of every rank of the DP group, one per layer group.
    pub tables: BTreeMap<u32, Vec<SlotTable>>,
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
    /// Refused: the description of the instance that was refused (none if it was refused
    /// before describing itself), and why.
    Refused(Option<Box<InstanceInfo>>, PeerError),
}

struct GenRequest {
    peer: Arc<CtxPeer>,
    tables: BTreeMap<u32, Vec<SlotTable>>,
    pieces: Vec<PairRequest>,
    /// Which writers the request waits on and what they reported.
    tracker: RequestTracker,
    started: Instant,
    deadline: Instant,
    outcome: Option<Result<RequestStats, RequestError>>,
    on_done: Option<OnDone>,
    on_free: Option<OnFree>,
}

impl fmt::Debug for GenRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GenRequest")
            .field("peer", &self.peer.addr)
            .field("tracker", &self.tracker)
            .field("outcome", &self.outcome)
            .field("released", &self.on_free.is_some())
            .finish_non_exhaustive()
    }
}

impl GenRequest {
    /// Whether no write of the request can still land.
    fn quiescent(&self) -> bool {
        self.tracker.quiescent() || !self.peer.alive.load(Ordering::Acquire)
    }

    fn missing(&self) -> Vec<String> {
        self.tracker
            .missing()
            .map(|(c, g)| format!("ctx rank {c} -> gen rank {g}"))
            .collect()
    }
}

#[derive(Debug)]
struct State {
    requests: HashMap<u64, GenRequest>,
}

/// A generation server: one instance, its context peers and its requests.
#[derive(Debug)]
pub struct GenerationServer {
    instance: Instance,
    info: InstanceInfo,
    timeout: Duration,
    next_peer: AtomicU64,
    peers: Mutex<HashMap<String, Arc<Mutex<Option<Verdict>>>>>,
    state: Mutex<State>,
}

impl GenerationServer {
    /// A server for `instance`: requests time out after `timeout`. Starts the deadline
    /// thread.
    pub fn new(instance: Instance, timeout: Duration) -> Arc<Self> {
        let info = instance.describe();
        let server = Arc::new(Self {
            instance,
            info,
            timeout,
            next_peer: AtomicU64::new(1),
            peers: Mutex::new(HashMap::new()),
            state: Mutex::new(State {
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

    /// What this instance advertises.
    pub fn info(&self) -> &InstanceInfo {
        &self.info
    }

    /// Requests held (in flight, or finished and not yet freed).
    pub fn requests_held(&self) -> usize {
        self.lock().requests.len()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Expects a request: bootstraps the context peer at `expect.peer` if needed (planner
    /// and describer ids, then `check_peer`, refusals cached per peer instance), asks every receiver
    /// rank of the DP group for its targets, and asks each target for its part. `on_done`
    /// reports the outcome exactly once (possibly before this returns); the slots in
    /// `expect.tables` are kvferry's to write until then, and — for a request that failed
    /// with writes possibly still in flight — until [`release`](Self::release)'s `on_free`.
    ///
    /// # Errors
    ///
    /// Invalid parameters, a duplicate id, an unusable peer or a planner refusal: the request
    /// is not taken (and `on_done` is not called).
    pub fn expect(self: &Arc<Self>, expect: Expect, on_done: OnDone) -> Result<(), RequestError> {
        let id = expect.request;
        let _span = tracing::debug_span!("expect", request = id, peer = %expect.peer).entered();
        let invalid = |reason: String| RequestError::Invalid {
            request: id,
            reason,
        };
        let addr = expect.peer.clone();
        if expect.pieces.is_empty() {
            return Err(invalid("no pieces".into()));
        }
        let mut pieces = expect.pieces.clone();
        let dst_start_token = expect.dst_start_token;
        for p in &mut pieces {
            p.dst_start_token = match dst_start_token {
                Some(t) => ROption::RSome(t),
                None => ROption::RNone,
            };
        }
        let group = self.instance.dp_group(expect.gen_dp_rank);
        if group.is_empty() {
            return Err(invalid(format!(
                "gen_dp_rank {} does not exist ({} dp groups)",
                expect.gen_dp_rank,
                self.instance.dp_groups()
            )));
        }
        if let Some(g) = group.iter().find(|g| !expect.tables.contains_key(g)) {
            return Err(invalid(format!("no slot tables for gen rank {g}")));
        }
        if self.lock().requests.contains_key(&id) {
            return Err(RequestError::Duplicate { request: id });
        }
        let submit = &expect;

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

        let tables: BTreeMap<u32, Vec<SlotTable>> = group
            .iter()
            .filter_map(|g| Some((*g, expect.tables.get(g)?.clone())))
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
        let piece_count = u32::try_from(pieces.len()).unwrap_or(u32::MAX);
        {
            let mut state = self.lock();
            // Checked again where it is inserted: the check above ran before the lock was
            // released for bootstrap and planning, and a second `expect` of the same id may
            // have come in since; overwriting it would leak its callback and its slots.
            let std::collections::hash_map::Entry::Vacant(slot) = state.requests.entry(id) else {
                return Err(RequestError::Duplicate { request: id });
            };
            slot.insert(GenRequest {
                peer: Arc::clone(&peer),
                tables,
                pieces,
                tracker: RequestTracker::new(id, piece_count, expected),
                started,
                deadline: started + self.timeout,
                outcome: None,
                on_done: Some(on_done),
                on_free: None,
            });
            if writers == 0 {
                // Nobody writes: complete at once.
                if let Some(req) = state.requests.get_mut(&id) {
                    complete(id, req);
                }
                return Ok(());
            }
        }
        tracing::debug!(writers, "requesting data");
        for data in messages {
            if peer.outbox.send(PeerMessage::RequestData(data)).is_err() {
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
        let refused_before = match verdict.take() {
            Some(Verdict::Compatible(peer)) if peer.alive.load(Ordering::Acquire) => {
                *verdict = Some(Verdict::Compatible(Arc::clone(&peer)));
                return Ok(peer);
            }
            Some(Verdict::Refused(info, error)) => info.map(|info| (info, error)),
            _ => None,
        };
        let mut described = None;
        match self.bootstrap(addr, refused_before.as_ref(), &mut described) {
            Ok(peer) => {
                *verdict = Some(Verdict::Compatible(Arc::clone(&peer)));
                Ok(peer)
            }
            Err(e @ PeerError::Refused { .. }) => {
                tracing::info!(peer = %addr, reason = %kvferry_plan::error_chain(&e), "context peer refused; verdict cached for that instance");
                *verdict = Some(Verdict::Refused(described, e.clone()));
                Err(e)
            }
            Err(e) => {
                // Unreachable now: keep what was known, so a refused instance that answers
                // again is recognised.
                if let Some((info, error)) = refused_before {
                    *verdict = Some(Verdict::Refused(Some(info), error));
                }
                Err(e)
            }
        }
    }

    /// Fetches, vets and registers with the context server at `addr`. If the instance that
    /// answers is exactly the one in `refused_before`, its cached refusal is returned without
    /// vetting it again. `described` receives the description the peer sent, if it sent one.
    fn bootstrap(
        self: &Arc<Self>,
        addr: &str,
        refused_before: Option<&(Box<InstanceInfo>, PeerError)>,
        described: &mut Option<Box<InstanceInfo>>,
    ) -> Result<Arc<CtxPeer>, PeerError> {
        let failed = |problem: String| PeerError::Unreachable {
            addr: addr.to_string(),
            problem,
        };
        let mut stream =
            crate::conn::dial(addr, CONNECT_TIMEOUT, BOOTSTRAP_TIMEOUT).map_err(failed)?;
        let (mut session, hello) = Dialer::new();
        write_frame(&mut stream, &hello)
            .map_err(|e| failed(format!("sending InstanceInfoRequest: {e}")))?;
        let answer = read_frame(&mut stream)
            .map_err(|e| failed(format!("reading InstanceInfo: {}", error_chain(&e))))?;
        let info = match session.receive(answer) {
            Ok(DialEvent::Info(info)) => *info,
            Ok(other) => return Err(failed(format!("answered {other:?} to InstanceInfoRequest"))),
            Err(SessionError::Role {
                instance, found, ..
            }) => {
                return Err(PeerError::Refused {
                    addr: addr.to_string(),
                    instance,
                    reason: format!("it is a {found} instance"),
                });
            }
            Err(e) => return Err(failed(e.to_string())),
        };
        if let Some((old, error)) = refused_before.filter(|(old, _)| **old == info) {
            *described = Some(old.clone());
            return Err(error.clone());
        }
        *described = Some(Box::new(info.clone()));
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
        let register = session
            .register(self.info.clone())
            .map_err(|e| failed(e.to_string()))?;
        write_frame(&mut stream, &register)
            .map_err(|e| failed(format!("sending Register: {}", error_chain(&e))))?;
        let verdict = read_frame(&mut stream).map_err(|e| {
            failed(format!(
                "reading the registration verdict: {}",
                error_chain(&e)
            ))
        })?;
        match session.receive(verdict) {
            Ok(DialEvent::Registered { .. }) => {}
            Ok(DialEvent::Refused { reason }) => return Err(refuse(reason)),
            Ok(other) => return Err(failed(format!("answered {other:?} to Register"))),
            Err(e) => return Err(failed(e.to_string())),
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
            .spawn(move || server.read_peer(&reading, session, reader))
            .map_err(|e| failed(format!("cannot spawn its reader: {e}")))?;
        tracing::info!(peer = %peer.info.instance_name, %addr, label = %peer.info.label, "registered with context peer");
        Ok(peer)
    }

    /// Reads a peer's completions until its connection ends, then fails what waits on it.
    fn read_peer(&self, peer: &Arc<CtxPeer>, mut session: Dialer, stream: TcpStream) {
        let _span =
            tracing::info_span!("ctx_peer", peer = %peer.info.instance_name, addr = %peer.addr)
                .entered();
        let mut reader = std::io::BufReader::new(stream);
        let why = loop {
            let message = match read_frame(&mut reader) {
                Ok(message) => message,
                Err(e) if e.is_disconnect() => {
                    break format!("{} closed its control connection", peer.name());
                }
                Err(e) => break format!("{} sent a bad frame: {}", peer.name(), error_chain(&e)),
            };
            match session.receive(message) {
                Ok(DialEvent::Completion(c)) => self.completion(peer, c),
                Ok(DialEvent::Cancel { request, reason }) => self.fail(
                    request,
                    RequestError::Cancelled {
                        request,
                        reason: format!("{} cancelled it: {reason}", peer.name()),
                    },
                ),
                Ok(other) => break format!("{} sent {other:?} after registering", peer.name()),
                Err(SessionError::PeerError { message }) => {
                    break format!("{} reported an error and closed: {message}", peer.name());
                }
                Err(e) => {
                    let _ = peer.outbox.send(PeerMessage::Error {
                        message: e.to_string(),
                    });
                    break format!("{} broke the protocol: {e}", peer.name());
                }
            }
        };
        peer.alive.store(false, Ordering::Release);
        let failed = self.peer_lost(peer, &why);
        if failed > 0 {
            tracing::warn!(reason = %why, failed, "context peer lost");
        } else {
            tracing::info!(reason = %why, "context peer gone");
        }
    }

    fn completion(&self, peer: &CtxPeer, c: Completion) {
        let _span = tracing::debug_span!(
            "completion",
            request = c.request,
            sender = c.sender_rank,
            receiver = c.receiver_rank,
            piece = c.piece
        )
        .entered();
        let mut release = None;
        {
            let mut state = self.lock();
            let Some(req) = state.requests.get_mut(&c.request) else {
                tracing::debug!("completion for an unknown request");
                return;
            };
            if req.peer.id != peer.id {
                tracing::warn!("completion from a peer that does not serve this request ignored");
                return;
            }
            match req.tracker.on_completion(&c) {
                Ok(Tracked::Progress | Tracked::Late) => {}
                Ok(Tracked::Completed(_)) => complete(c.request, req),
                Ok(Tracked::Failed(f)) => {
                    let error = RequestError::Piece {
                        request: c.request,
                        peer: peer.name(),
                        sender: f.sender,
                        receiver: f.receiver,
                        piece: f.piece,
                        reason: f.reason,
                    };
                    fail_request(c.request, req, error);
                }
                Err(
                    violation @ (Violation::UnknownPair { .. } | Violation::OtherRequest { .. }),
                ) => {
                    tracing::warn!(error = %violation, "unexpected completion ignored");
                }
                Err(violation) => {
                    if req.outcome.is_none() {
                        let error = RequestError::Protocol {
                            request: c.request,
                            peer: peer.name(),
                            source: violation,
                        };
                        fail_request(c.request, req, error);
                    } else {
                        tracing::warn!(error = %violation, "protocol violation after the request ended");
                    }
                }
            }
            if req.on_free.is_some() && req.quiescent() {
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
                if req.on_free.is_some() {
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
            let _ = peer.outbox.send(PeerMessage::Cancel {
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

    /// Cancels a request still in flight: it fails ([`RequestError::Cancelled`]) and its
    /// writers are told. Its slots stay kvferry's until [`release`](Self::release)'s
    /// `on_free`, as for any failed request.
    pub fn cancel(&self, id: u64, reason: &str) {
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
            let _ = peer.outbox.send(PeerMessage::Cancel {
                request: id,
                reason: reason.to_string(),
            });
        }
    }

    /// Lets go of a request: a request still in flight fails ([`RequestError::Released`]);
    /// `on_free` runs now if no write can still land in its slots, else once none can (every
    /// writer reported its last piece, or the peer is gone). Returns whether the request was
    /// known (`on_free` is dropped uncalled otherwise).
    pub fn release(&self, id: u64, on_free: OnFree) -> bool {
        let (known, req) = {
            let mut state = self.lock();
            match state.requests.get_mut(&id) {
                Some(req) if req.outcome.is_some() && req.quiescent() => {
                    req.on_free = Some(on_free);
                    (true, state.requests.remove(&id))
                }
                Some(req) => {
                    if req.outcome.is_none() {
                        fail_request(id, req, RequestError::Released { request: id });
                    }
                    tracing::debug!(
                        request = id,
                        "slots quarantined until every writer reported"
                    );
                    req.on_free = Some(on_free);
                    (true, None)
                }
                None => (false, None),
            }
        };
        if let Some(req) = req {
            self.free(req);
        }
        known
    }

    /// Hands a released, quiescent request's slots back to the caller.
    fn free(&self, mut req: GenRequest) {
        if let Some(on_free) = req.on_free.take() {
            on_free();
        }
    }

    /// A completed request: its peer, destination tables, pieces and stats (to check its
    /// bytes, for instance).
    ///
    /// # Errors
    ///
    /// The request is unknown (or released), failed, or still in flight.
    pub fn completed(&self, id: u64) -> Result<Completed, CheckError> {
        let state = self.lock();
        let req = state
            .requests
            .get(&id)
            .ok_or(CheckError::Unknown { request: id })?;
        match &req.outcome {
            Some(Ok(stats)) => Ok(Completed {
                peer: req.peer.info.clone(),
                tables: req.tables.clone(),
                pieces: req.pieces.clone(),
                stats: stats.clone(),
            }),
            Some(Err(e)) => Err(CheckError::Failed {
                request: id,
                source: e.clone(),
            }),
            None => Err(CheckError::InFlight { request: id }),
        }
    }
}

fn complete(id: u64, req: &mut GenRequest) {
    let totals = req.tracker.totals();
    let stats = RequestStats {
        bytes: totals.bytes,
        fragments: totals.fragments,
        writers: totals.writers,
        pieces: totals.pieces,
        latency_us: req.started.elapsed().as_micros() as u64,
    };
    tracing::debug!(
        request = id,
        bytes = stats.bytes,
        latency_us = stats.latency_us,
        "complete"
    );
    req.outcome = Some(Ok(stats.clone()));
    if let Some(on_done) = req.on_done.take() {
        on_done(id, Ok(stats));
    }
}

fn fail_request(id: u64, req: &mut GenRequest, error: RequestError) {
    req.tracker.fail();
    tracing::warn!(request = id, error = %kvferry_plan::error_chain(&error), "request failed");
    req.outcome = Some(Err(error.clone()));
    if let Some(on_done) = req.on_done.take() {
        on_done(id, Err(error));
    }
}
