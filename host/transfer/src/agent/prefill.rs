//! The prefill side of an agent: the side channel, sends, claims, writes.
//!
//! A request becomes writable for a decode rank once both its first `send` and that
//! rank's `RequestData` (its claim) arrived, in either order. The first claim fixes the
//! request's owner (the claiming instance, or the `to` of the send) and the receiver ranks
//! this rank must write ([`TransferPlanner::targets`] for the claimer's DP group); every
//! chunk is planned for every claim on the planner pool, then written on the rank thread, and
//! each piece's completion goes out after its flush. The request is `Sent` once every
//! expected receiver has its last piece; a failure, a cancel, the lease or the timeout end it
//! once no job reads its slots, answering every claim still open with a failed last piece.
//!
//! [`TransferPlanner::targets`]: kvferry_planner_abi::TransferPlanner::targets

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_plan::{PlanFailure, RequestSide, ValidatedPlan, error_chain};
use kvferry_planner_abi::ffi::ROption;
use kvferry_planner_abi::{PairRequest, RankInfo, SlotTable, TransferPlanner, ViewId};
use kvferry_protocol::{
    AgentError, AgentEvent, AgentMessage, AgentSession, BouncedPiece, Completion, CompletionStatus,
    Integrity, PeerIdentity, PieceDigest, RequestData, read_frame,
};

use super::events::{Event, FailureKind};
use super::{CallError, Inner, SendChunk, lock};
use crate::bounce::{AUTO_MAX_MEAN_FRAGMENT, BounceMode};
use crate::conn::{Outbox, Pending, Reader, Secured, Unproven, drain, secure_accept, spawn_writer};
use crate::outcome::Stages;
use crate::rank::{BounceJob, PeerId, RemoteRank, WriteJob, nanos};
use crate::stash::{Stash, request_data_bytes};

/// How long a claim for a request not sent yet is kept at most (the lease bounds it too).
const STASH_TTL: Duration = Duration::from_secs(120);
/// How far holds may push an unclaimed request's lease: this many leases after its first
/// send, whatever its receiver says.
pub(crate) const MAX_HELD_LEASES: u32 = 10;

/// An authenticated, vetted decode rank connected to this prefill rank.
#[derive(Debug)]
pub(crate) struct DecodeConn {
    id: PeerId,
    identity: PeerIdentity,
    info: RankInfo,
    remote: Arc<RemoteRank>,
    outbox: Outbox<AgentMessage>,
    alive: Arc<AtomicBool>,
    /// The connection's socket, to end its reader at shutdown.
    socket: TcpStream,
    /// The planner's `targets` for this peer's DP group: which of its ranks this rank writes.
    /// It depends on the two ranks' descriptions alone, fixed for the connection's life, so
    /// it is asked once (under the planner deadline) rather than once per request.
    targets: OnceLock<BTreeSet<u32>>,
}

impl DecodeConn {
    fn name(&self) -> String {
        self.identity.to_string()
    }
}

#[derive(Debug)]
struct Stashed {
    conn: Arc<DecodeConn>,
    data: RequestData,
}

/// A receiver's cancel of a request not sent here yet: the `send` that comes later ends at
/// once (as cancelled by that peer) instead of waiting for its lease.
#[derive(Debug)]
struct Tombstone {
    /// The decode instance that cancelled (only it, or the send's `to`, may end the send).
    instance: String,
    /// The cancelling rank's name, for the event.
    peer: String,
    reason: String,
}

/// A request that ended here: who could have claimed it, and how it ended.
#[derive(Debug)]
struct Ended {
    /// The instance it was bound to (its owner, else the send's `to`); `None`: anyone.
    instance: Option<String>,
    /// How it ended, for the refusal.
    how: String,
}

impl Ended {
    fn bytes(&self) -> usize {
        64 + self.instance.as_ref().map_or(0, String::len) + self.how.len()
    }
}

/// The longest cancel reason a tombstone keeps (the rest is cut): the bytes come from a peer.
const TOMBSTONE_REASON: usize = 256;

impl Tombstone {
    fn bytes(&self) -> usize {
        64 + self.instance.len() + self.peer.len() + self.reason.len()
    }
}

#[derive(Debug)]
struct Claim {
    conn: Arc<DecodeConn>,
    data: RequestData,
    /// Chunks handed to planning so far.
    planned: usize,
    /// A planning task for this claim is queued or running.
    planning: bool,
    /// Write jobs queued and not yet released.
    jobs: usize,
    /// Pieces whose completion was sent (the next piece index).
    reported: u32,
    /// The pair's last piece was reported (Ok or Failed).
    ended: bool,
    /// Its last piece was Ok.
    ok: bool,
    /// The receiver cancelled it.
    cancelled: bool,
    /// When its `RequestData` was taken up (after the send, if it came first).
    arrived: Instant,
    /// Bytes of the offered bounce region that pieces have been given so far.
    bounce_cursor: u64,
    /// Where its time went so far (`control` is filled in when it ends).
    stages: Stages,
}

/// One piece of a request as its `send` gave it: planned for every claim, in order.
#[derive(Clone, Debug)]
struct Chunk {
    tables: Arc<Vec<SlotTable>>,
    /// For the planner: `is_last` when the tokens reach the prompt's end (recurrent state
    /// rides on every view of such a piece).
    piece: PairRequest,
    /// The views it carries when only some (a layer-wise send), else `None`.
    views: Option<Arc<Vec<ViewId>>>,
    /// The rest of this rank's views, which its plans leave out.
    excluded: Arc<Vec<ViewId>>,
    /// The request's last piece: its completion ends the pair.
    last: bool,
}

#[derive(Debug)]
pub(crate) struct OutReq {
    to: Option<String>,
    prompt_len: u64,
    chunks: Vec<Chunk>,
    /// Views of the latest chunk's tokens no send has carried yet (layer-wise sends); the
    /// next send repeats those tokens until it is empty.
    unsent: BTreeSet<ViewId>,
    finished: bool,
    first_send: Instant,
    /// Until when a receiver's holds keep it unclaimed (the lease otherwise ends at
    /// `first_send + lease`).
    held_until: Option<Instant>,
    claimed_at: Option<Instant>,
    owner: Option<String>,
    /// Receiver ranks this rank writes, once the first claim told who claims.
    expected: Option<BTreeSet<u32>>,
    claims: BTreeMap<u32, Claim>,
    cancelled: bool,
    failure: Option<(Option<String>, FailureKind, String)>,
    bytes: u64,
    /// Puts issued for it.
    puts: u64,
    /// The stages of its claims that ended well, summed.
    stages: Stages,
}

impl OutReq {
    /// A request just sent, with its first chunk.
    fn new(to: Option<String>, prompt_len: u64, chunk: Chunk, unsent: BTreeSet<ViewId>) -> Self {
        Self {
            to,
            prompt_len,
            finished: chunk.last,
            chunks: vec![chunk],
            unsent,
            first_send: Instant::now(),
            held_until: None,
            claimed_at: None,
            owner: None,
            expected: None,
            claims: BTreeMap::new(),
            cancelled: false,
            failure: None,
            bytes: 0,
            puts: 0,
            stages: Stages::default(),
        }
    }

    /// Whether `instance` may claim or cancel it: its owner, or the send's `to`, or anyone
    /// while it has neither.
    fn open_to(&self, instance: &str) -> bool {
        self.owner
            .as_ref()
            .or(self.to.as_ref())
            .is_none_or(|o| o == instance)
    }
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) requests: HashMap<u64, OutReq>,
    conns: HashMap<PeerId, Arc<DecodeConn>>,
    stash: Stash<Stashed>,
    /// Cancels of requests not sent yet, bounded like the stash and expired with it.
    tombstones: Stash<Tombstone>,
    /// Requests that ended here lately, so a claim that comes after the end is refused at
    /// once instead of waiting in the stash; bounded and expired like the tombstones.
    ended: Stash<Ended>,
    open: Arc<AtomicUsize>,
    /// Where the side channel listens (to wake its accept loop at shutdown).
    listening: Option<std::net::SocketAddr>,
}

impl State {
    pub(crate) fn new(max_stashed: usize) -> Self {
        Self {
            requests: HashMap::new(),
            conns: HashMap::new(),
            stash: Stash::new(max_stashed, STASH_TTL),
            tombstones: Stash::new(max_stashed / 16, STASH_TTL),
            ended: Stash::new(max_stashed / 16, STASH_TTL),
            open: Arc::new(AtomicUsize::new(0)),
            listening: None,
        }
    }
}

fn failed(request: u64, pair: (u32, u32), piece: u32, reason: String) -> AgentMessage {
    last_piece(request, pair, piece, CompletionStatus::Failed(reason))
}

/// A pair's last piece that carries no bytes: failed, or cancelled by this side's engine.
fn last_piece(
    request: u64,
    (c, g): (u32, u32),
    piece: u32,
    status: CompletionStatus,
) -> AgentMessage {
    AgentMessage::Completion(Completion {
        request,
        sender_rank: c,
        receiver_rank: g,
        piece,
        is_last: true,
        bytes: 0,
        fragments: 0,
        status,
        bounce: None,
        digest: None,
        views: None,
    })
}

// ---------------------------------------------------------------------------------------
// The side channel.

pub(crate) fn listen(inner: &Arc<Inner>, listener: TcpListener) -> std::io::Result<()> {
    let weak = Arc::downgrade(inner);
    let open = {
        let mut state = lock(&inner.prefill);
        state.listening = listener.local_addr().ok();
        Arc::clone(&state.open)
    };
    let max = inner.config.max_connections;
    let unproven = Unproven::new();
    thread::Builder::new()
        .name(format!("side-{}", inner.info.instance_rank))
        .spawn(move || {
            let mut backoff = Duration::from_millis(1);
            for stream in listener.incoming() {
                let Some(inner) = weak.upgrade() else { break };
                if inner.stopped.load(Ordering::Acquire) {
                    break;
                }
                let stream = match stream {
                    Ok(s) => {
                        backoff = Duration::from_millis(1);
                        s
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, backoff_ms = backoff.as_millis() as u64, "accept failed");
                        drop(inner);
                        thread::sleep(backoff);
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                        continue;
                    }
                };
                if open.fetch_add(1, Ordering::AcqRel) >= max {
                    open.fetch_sub(1, Ordering::AcqRel);
                    // Unauthenticated: it learns nothing but that it was turned away.
                    tracing::warn!(limit = max, "side channel full: connection refused");
                    drop(stream);
                    continue;
                }
                let open = Arc::clone(&open);
                let pending = unproven.admit(&stream);
                let spawned = thread::Builder::new()
                    .name(format!("gen-conn-{}", inner.info.instance_rank))
                    .spawn(move || {
                        serve_connection(&inner, stream, pending);
                        open.fetch_sub(1, Ordering::AcqRel);
                    });
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "cannot spawn a connection thread");
                }
            }
        })?;
    Ok(())
}

fn serve_connection(inner: &Arc<Inner>, stream: TcpStream, pending: Pending) {
    let addr = stream
        .peer_addr()
        .map_or_else(|_| "?".to_string(), |a| a.to_string());
    let _span = tracing::info_span!("gen_conn", %addr).entered();
    let _ = stream.set_nodelay(true);
    let local = stream.local_addr().ok();
    let deadline = Instant::now() + inner.config.handshake_timeout;
    let (secured, intent) =
        match secure_accept::<AgentMessage>(stream, &inner.config.secret, deadline) {
            Ok(s) => s,
            Err(e) => {
                // An unauthenticated peer learns nothing.
                tracing::info!(error = %error_chain(&e), "side-channel handshake failed");
                return;
            }
        };
    let Secured {
        mut reader,
        writer,
        socket,
        binding,
    } = secured;
    let mut session = AgentSession::accept();
    // The first frame: the first record that opens proves the dialer holds the secret.
    let first = read_frame::<AgentMessage>(&mut reader);
    drop(pending);
    let first = match first {
        Ok(m) => m,
        Err(e) => {
            tracing::info!(error = %error_chain(&e), "side-channel connection ended during the handshake");
            return;
        }
    };
    let outbox = spawn_writer::<AgentMessage>(writer, format!("gen-{addr}"));
    let refuse = |session: &mut AgentSession, reason: String, mut reader: Reader| {
        let _ = outbox.send(session.refuse(reason));
        drain(&mut reader, Duration::from_millis(200));
    };
    if let Err(reason) = check_intent(inner, local, &intent.endpoint) {
        tracing::warn!(%reason, "decode rank refused");
        refuse(&mut session, reason, reader);
        return;
    }
    let conn = match session.receive(first) {
        Ok(AgentEvent::Metadata(m)) => {
            let Ok((expected, challenge)) = super::worker_proof::new_challenge(&binding) else {
                return;
            };
            match admit(inner, &m, outbox.clone(), socket, challenge) {
                Ok(conn) => {
                    // Nothing is written to the worker it declared before it proves it owns it.
                    if let Err(reason) = prove_worker(&mut session, &outbox, &mut reader, &expected)
                    {
                        tracing::warn!(peer = %m.identity(), %reason, "decode rank refused");
                        lost(inner, &conn, &reason);
                        receiver_refused(inner, &m.identity(), &m.rank.info, &reason);
                        refuse(&mut session, reason, reader);
                        return;
                    }
                    match session.admit(inner.metadata.clone()) {
                        Ok(reply) => {
                            lock(&inner.prefill)
                                .conns
                                .insert(conn.id, Arc::clone(&conn));
                            let _ = conn.outbox.send(reply);
                            conn
                        }
                        Err(_) => {
                            lost(inner, &conn, "broke the handshake");
                            return;
                        }
                    }
                }
                Err(reason) => {
                    tracing::info!(peer = %m.identity(), %reason, "decode rank refused");
                    receiver_refused(inner, &m.identity(), &m.rank.info, &reason);
                    refuse(&mut session, reason, reader);
                    return;
                }
            }
        }
        Ok(other) => {
            tracing::warn!(?other, "unexpected handshake event");
            return;
        }
        Err(e) => {
            tracing::warn!(error = %e, "side-channel handshake failed");
            let _ = outbox.send(AgentMessage::Error {
                message: e.to_string(),
            });
            return;
        }
    };
    drop(outbox);
    if let Err(e) = reader
        .get_mut()
        .get_mut()
        .settle(Some(inner.config.peer_timeout))
    {
        tracing::warn!(error = %e, "cannot set the connection's read timeout");
        lost(inner, &conn, "could not be served");
        return;
    }
    tracing::info!(peer = %conn.name(), "decode rank connected");
    let why = loop {
        let read = read_frame::<AgentMessage>(&mut reader);
        if !conn.alive.load(Ordering::Acquire) && !inner.stopped.load(Ordering::Acquire) {
            // While this loop runs only the rank thread ends a registration: puts to the
            // peer's worker stalled (see `rank::STALL_LIMIT`). The reaper then cuts this read
            // short, so the peer hears of it now, not at its next message.
            let why = "stopped draining this rank's puts: given up";
            let _ = conn.outbox.send(AgentMessage::Error {
                message: format!("{} gave this rank up: it {why}", inner.me()),
            });
            break why.to_string();
        }
        let message: AgentMessage = match read {
            Ok(m) => m,
            Err(e) if e.is_disconnect() => break "closed its connection".to_string(),
            Err(e) if super::is_timeout(&e) => {
                break format!(
                    "sent nothing for {} ms (not even a keep-alive): stopped, or cut off",
                    inner.config.peer_timeout.as_millis()
                );
            }
            Err(e) => break format!("connection failed: {}", error_chain(&e)),
        };
        match session.receive(message) {
            Ok(AgentEvent::RequestData(data)) => request_data(inner, &conn, *data),
            Ok(AgentEvent::Cancel { request, reason }) => {
                peer_cancel(inner, &conn, request, &reason)
            }
            Ok(AgentEvent::Hold { request }) => hold(inner, &conn, request),
            Ok(AgentEvent::Nothing) => {}
            Ok(other) => break format!("sent {other:?}"),
            Err(AgentError::PeerError { message }) => {
                // It refused this rank after its own vetting: it will not claim.
                receiver_refused(inner, &conn.identity, &conn.info, &message);
                break format!("refused this rank: {message}");
            }
            Err(e) => {
                let _ = conn.outbox.send(AgentMessage::Error {
                    message: e.to_string(),
                });
                break format!("broke the protocol: {e}");
            }
        }
    };
    if inner.stopped.load(Ordering::Acquire) {
        // This agent's own shutdown ended it: `Drop for Agent` logs that once.
        tracing::debug!(peer = %conn.name(), reason = %why, "decode rank gone");
    } else {
        tracing::info!(peer = %conn.name(), reason = %why, "decode rank gone");
    }
    lost(inner, &conn, &why);
}

/// A decode rank was refused, by this rank or by itself: every open send bound to its
/// instance (`to`) that this rank writes to it and that it has not claimed can never be
/// completed, so it fails at once as refused rather than at its lease. A rank this rank does
/// not write (the planner's `targets` for its DP group leave it out) changes nothing.
fn receiver_refused(inner: &Arc<Inner>, who: &PeerIdentity, info: &RankInfo, reason: &str) {
    let bound = |r: &OutReq| {
        r.to.as_deref() == Some(who.instance.as_str())
            && r.failure.is_none()
            && !r.cancelled
            && !r.claims.contains_key(&who.rank)
    };
    if !lock(&inner.prefill).requests.values().any(bound) {
        return;
    }
    if let Ok(targets) = inner.ask_targets(info, info.dp_rank) {
        if !targets.contains(&who.rank) {
            return;
        }
    }
    let ids: Vec<u64> = {
        let mut state = lock(&inner.prefill);
        state
            .requests
            .iter_mut()
            .filter(|(_, r)| bound(r))
            .map(|(&id, r)| {
                r.failure = Some((
                    Some(who.to_string()),
                    FailureKind::Refused,
                    format!("{who}, its receiver, was refused: {reason}"),
                ));
                id
            })
            .collect()
    };
    for id in ids {
        settle(inner, id);
    }
}

/// Whether the endpoint the dialer meant to reach is this rank's: its advertised endpoint,
/// or the address the connection arrived at. A dialer that was sent elsewhere (a relay that
/// forwards its handshake here) is refused, naming both.
fn check_intent(inner: &Inner, local: Option<SocketAddr>, meant: &str) -> Result<(), String> {
    let advertised = inner.metadata.endpoint.as_deref();
    if advertised == Some(meant) || local.is_some_and(|l| l.to_string() == meant) {
        return Ok(());
    }
    Err(format!(
        "it meant to reach {meant}, but this is {} (arrived at {}): a relay, or an endpoint \
         this rank does not advertise",
        advertised.unwrap_or("a rank with no advertised endpoint"),
        local.map_or_else(|| "?".to_string(), |l| l.to_string()),
    ))
}

/// The dialer's proof that it owns the worker it declared: the challenge `admit` sent that
/// worker, asked back on the session (see `worker_proof`).
fn prove_worker(
    session: &mut AgentSession,
    outbox: &Outbox<AgentMessage>,
    reader: &mut Reader,
    expected: &[u8],
) -> Result<(), String> {
    let ask = session.challenge().map_err(|e| e.to_string())?;
    outbox
        .send(ask)
        .map_err(|_| "its connection closed".to_string())?;
    let answer = read_frame::<AgentMessage>(reader)
        .map_err(|e| format!("it sent no worker proof: {}", error_chain(&e)))?;
    match session.receive(answer) {
        Ok(AgentEvent::WorkerProof(c)) if c.as_slice() == expected => Ok(()),
        Ok(AgentEvent::WorkerProof(_)) => Err(
            "the worker at the address it declared did not receive this session's challenge: \
             it does not own that worker"
                .into(),
        ),
        Ok(other) => Err(format!("it sent {other:?} instead of its worker's proof")),
        Err(e) => Err(e.to_string()),
    }
}

/// Vets a decode rank's metadata, connects to its worker and sends it `challenge`;
/// the connection is registered once the worker's proof came ([`prove_worker`]).
fn admit(
    inner: &Arc<Inner>,
    m: &kvferry_protocol::AgentMetadata,
    outbox: Outbox<AgentMessage>,
    socket: TcpStream,
    challenge: Vec<u8>,
) -> Result<Arc<DecodeConn>, String> {
    inner.vet_shape(m)?;
    inner.check_peer(&m.rank.info)?;
    let id = inner.next_peer.fetch_add(1, Ordering::Relaxed);
    let alive = Arc::new(AtomicBool::new(true));
    let identity = m.identity();
    let conn = Arc::new(DecodeConn {
        id,
        identity: identity.clone(),
        info: m.rank.info.clone(),
        targets: OnceLock::new(),
        remote: Arc::new(RemoteRank {
            peer: id,
            instance: m.instance.clone(),
            rank: m.rank.info.instance_rank,
            worker_address: m.rank.worker_address.clone(),
            pools: m.rank.pools.clone(),
            alive: Arc::clone(&alive),
            bounce: m.rank.bounce.clone(),
        }),
        outbox,
        alive,
        socket,
    });
    // Before it is accepted: every declared pool must lie inside what its key maps here,
    // or a put through it would land at a wild address (see `RemoteKey::check_range`).
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    inner.thread.vet(
        Arc::clone(&conn.remote),
        Some(challenge),
        Box::new(move |result| {
            let _ = tx.send(result);
        }),
    );
    let refused = |reason: String| {
        conn.alive.store(false, Ordering::Release);
        inner.thread.forget(id);
        Err(reason)
    };
    match rx.recv_timeout(inner.config.handshake_timeout) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return refused(error_chain(&e)),
        Err(_) => {
            return refused(format!(
                "its keys could not be checked within {} ms",
                inner.config.handshake_timeout.as_millis()
            ));
        }
    }
    Ok(conn)
}

/// A decode rank's connection ended: its claims fail, nothing more is written to it.
fn lost(inner: &Arc<Inner>, conn: &Arc<DecodeConn>, why: &str) {
    conn.alive.store(false, Ordering::Release);
    inner.thread.forget(conn.id);
    let ids: Vec<u64> = {
        let mut state = lock(&inner.prefill);
        state.conns.remove(&conn.id);
        state.stash.retain(|s, _| s.conn.id != conn.id);
        let mut ids = Vec::new();
        for (&id, req) in state.requests.iter_mut() {
            let mut touched = false;
            for claim in req.claims.values_mut() {
                if claim.conn.id == conn.id && !claim.ended {
                    claim.ended = true;
                    touched = true;
                }
            }
            if touched && req.failure.is_none() {
                req.failure = Some((
                    Some(conn.name()),
                    FailureKind::Peer,
                    format!("{} {why}", conn.name()),
                ));
            }
            if touched {
                ids.push(id);
            }
        }
        ids
    };
    for id in ids {
        settle(inner, id);
    }
}

pub(crate) fn connections(inner: &Arc<Inner>) -> usize {
    lock(&inner.prefill).conns.len()
}

pub(crate) fn ping(inner: &Arc<Inner>) {
    let conns: Vec<Arc<DecodeConn>> = lock(&inner.prefill).conns.values().cloned().collect();
    for c in conns {
        let _ = c.outbox.send(AgentMessage::Ping);
    }
}

pub(crate) fn shutdown(inner: &Arc<Inner>) {
    let (conns, listening) = {
        let mut state = lock(&inner.prefill);
        let conns: Vec<Arc<DecodeConn>> = state.conns.drain().map(|(_, c)| c).collect();
        (conns, state.listening.take())
    };
    // The accept loop sees the agent stopped at its next connection: make one, so the
    // thread ends and the port closes now.
    if let Some(mut addr) = listening {
        if addr.ip().is_unspecified() {
            addr.set_ip(match addr {
                std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
    }
    for c in conns {
        c.alive.store(false, Ordering::Release);
        let _ = c.outbox.send(AgentMessage::Error {
            message: format!("{} is shutting down", inner.me()),
        });
        // Its reader ends now (the writer still says why), so its thread lets go of us.
        let _ = c.socket.shutdown(std::net::Shutdown::Read);
    }
}

// ---------------------------------------------------------------------------------------
// Requests.

pub(crate) fn send(inner: &Arc<Inner>, mut s: SendChunk) -> Result<(), CallError> {
    let id = s.request;
    let invalid = |reason: String| CallError::Invalid {
        request: id,
        reason,
    };
    check_tables(&inner.info, &s.tables).map_err(invalid)?;
    if s.prompt_len == 0 || s.tokens.start >= s.tokens.end || s.tokens.end > s.prompt_len {
        return Err(invalid(format!(
            "tokens {}..{} of a {}-token prompt",
            s.tokens.start, s.tokens.end, s.prompt_len
        )));
    }
    let tpb = u64::from(inner.info.page_table.tokens_per_block.max(1));
    if s.tokens.end != s.prompt_len && s.tokens.end % tpb != 0 {
        return Err(invalid(format!(
            "chunk {}..{} ends inside a block ({tpb} tokens per block); chunks end on block \
             boundaries or at the prompt's end",
            s.tokens.start, s.tokens.end
        )));
    }
    // The rank's views, once per send: every part of a layer-wise send checks against them.
    let all = all_views(&inner.info);
    let carried = match &s.views {
        Some(views) => Some(kvferry_plan::carried_views(&all, views).map_err(invalid)?),
        None => None,
    };
    let tables = Arc::new(std::mem::take(&mut s.tables));
    let stashed = {
        let mut state = lock(&inner.prefill);
        match state.requests.get_mut(&id) {
            Some(req) => {
                if req.finished || req.cancelled || req.failure.is_some() {
                    return Err(CallError::Unknown { request: id });
                }
                let latest = req.chunks.last().map(|c| c.piece.token_range);
                let pending = match latest {
                    Some(t) if !req.unsent.is_empty() => {
                        if s.tokens != t || s.prompt_len != req.prompt_len {
                            return Err(invalid(format!(
                                "tokens {}..{}: {} view(s) of tokens {}..{} are not sent yet \
                                 (a layer-wise send repeats its chunk's tokens until every view \
                                 went)",
                                s.tokens.start,
                                s.tokens.end,
                                req.unsent.len(),
                                t.start,
                                t.end
                            )));
                        }
                        req.unsent.clone()
                    }
                    _ => {
                        let end = latest.map_or(0, |t| t.end);
                        if s.prompt_len != req.prompt_len || s.tokens.start != end {
                            return Err(invalid(format!(
                                "chunk {}..{} of a {}-token prompt does not follow {end} of {}",
                                s.tokens.start, s.tokens.end, s.prompt_len, req.prompt_len
                            )));
                        }
                        all.clone()
                    }
                };
                if s.to != req.to {
                    return Err(invalid("a later chunk names another receiver".into()));
                }
                let (chunk, unsent) =
                    next_chunk(&all, &s, Arc::clone(&tables), pending, carried).map_err(invalid)?;
                req.finished = chunk.last;
                req.chunks.push(chunk);
                req.unsent = unsent;
                Vec::new()
            }
            None => {
                if s.tokens.start != 0 {
                    return Err(invalid(format!(
                        "the first chunk starts at token {}, not 0",
                        s.tokens.start
                    )));
                }
                let (chunk, unsent) =
                    next_chunk(&all, &s, Arc::clone(&tables), all.clone(), carried)
                        .map_err(invalid)?;
                // The id is sent again: claims are for this request now.
                let _ = state.ended.take(id);
                // A receiver that may claim it cancelled it already: it ends as cancelled by
                // that peer (its other ranks' stashed claims are answered as ended).
                let to = s.to.clone();
                let cancelled_by = state
                    .tombstones
                    .take(id)
                    .into_iter()
                    .find(|t| to.as_ref().is_none_or(|to| *to == t.instance));
                if let Some(t) = cancelled_by {
                    tracing::debug!(request = id, peer = %t.peer, "sent after its receiver cancelled it");
                    let detail = format!(
                        "{} cancelled request {id} before it was sent here: {}",
                        t.peer, t.reason
                    );
                    state.requests.insert(
                        id,
                        OutReq {
                            owner: Some(t.instance),
                            failure: Some((Some(t.peer), FailureKind::CancelledByPeer, detail)),
                            ..OutReq::new(s.to, s.prompt_len, chunk, unsent)
                        },
                    );
                    let stashed = state.stash.take(id);
                    drop(state);
                    for s in stashed {
                        claim(inner, &s.conn, s.data);
                    }
                    settle(inner, id);
                    return Ok(());
                }
                state
                    .requests
                    .insert(id, OutReq::new(s.to, s.prompt_len, chunk, unsent));
                state.stash.take(id)
            }
        }
    };
    for s in stashed {
        claim(inner, &s.conn, s.data);
    }
    pump(inner, id);
    Ok(())
}

/// Every view of `info`'s page table.
fn all_views(info: &RankInfo) -> BTreeSet<ViewId> {
    info.page_table.view_ids().collect()
}

/// The chunk `s` makes of its tokens' views not sent yet (`pending`): the views it carries
/// (`carried`, or all of `pending`) and the views still pending after it; or why it may not.
fn next_chunk(
    all: &BTreeSet<ViewId>,
    s: &SendChunk,
    tables: Arc<Vec<SlotTable>>,
    pending: BTreeSet<ViewId>,
    carried: Option<BTreeSet<ViewId>>,
) -> Result<(Chunk, BTreeSet<ViewId>), String> {
    let carried = carried.unwrap_or_else(|| pending.clone());
    if let Some(v) = carried.difference(&pending).next() {
        return Err(format!(
            "view (group {}, view {}) of tokens {}..{} was sent already",
            v.group, v.view, s.tokens.start, s.tokens.end
        ));
    }
    let unsent: BTreeSet<ViewId> = pending.difference(&carried).copied().collect();
    let at_end = s.tokens.end == s.prompt_len;
    let last = at_end && unsent.is_empty();
    if s.is_last != last {
        return Err(
            "is_last must mark exactly the send that ends at the prompt's end and carries the \
             last of its views"
                .into(),
        );
    }
    let excluded: Vec<ViewId> = all.difference(&carried).copied().collect();
    let views = (!excluded.is_empty()).then(|| Arc::new(carried.into_iter().collect()));
    let chunk = Chunk {
        tables,
        piece: PairRequest {
            token_range: s.tokens,
            prompt_len: s.prompt_len,
            dst_start_token: ROption::RNone,
            is_last: at_end,
        },
        views,
        excluded: Arc::new(excluded),
        last,
    };
    Ok((chunk, unsent))
}

/// One table per layer group of `info`'s page table, every slot inside its pools.
pub(crate) fn check_tables(info: &RankInfo, tables: &[SlotTable]) -> Result<(), String> {
    let groups = info.page_table.groups.len();
    if tables.len() != groups {
        return Err(format!(
            "{} slot tables for {groups} layer groups",
            tables.len()
        ));
    }
    check_slots(info, tables)
}

/// Every slot named is inside its pool, for every view of every group.
pub(crate) fn check_slots(info: &RankInfo, tables: &[SlotTable]) -> Result<(), String> {
    let pt = &info.page_table;
    for (g, (group, table)) in pt.groups.iter().zip(tables).enumerate() {
        for view in group.views.iter() {
            let Some(pool) = pt.pools.get(view.pool as usize) else {
                return Err(format!(
                    "layer group {g} names pool {}, which does not exist",
                    view.pool
                ));
            };
            if let Some(&bad) = table
                .slots
                .iter()
                .find(|&&s| s != SlotTable::HOLE && (s < 0 || s as u64 >= pool.num_slots))
            {
                return Err(format!(
                    "layer group {g}: slot {bad} is outside pool {} ({} slots)",
                    view.pool, pool.num_slots
                ));
            }
        }
    }
    Ok(())
}

fn request_data(inner: &Arc<Inner>, conn: &Arc<DecodeConn>, data: RequestData) {
    let (c, g, request) = (data.sender_rank, data.receiver_rank, data.request);
    let me = inner.info.instance_rank;
    let refuse = |reason: String| {
        tracing::warn!(request, peer = %conn.name(), %reason, "claim refused");
        let _ = conn.outbox.send(failed(request, (c, g), 0, reason));
    };
    if c != me {
        return refuse(format!("this is rank {me}, not rank {c}"));
    }
    if g != conn.info.instance_rank || data.receiver_instance != conn.identity.instance {
        return refuse(format!(
            "the connection is {}; it cannot claim for {} rank {g}",
            conn.name(),
            data.receiver_instance
        ));
    }
    if let Err(e) = check_tables(&conn.info, &data.slot_tables) {
        return refuse(e);
    }
    if let Some(offer) = data.bounce {
        let fits = conn.remote.bounce.as_ref().is_some_and(|a| {
            offer
                .offset
                .checked_add(offer.len)
                .is_some_and(|end| end <= a.len)
        });
        if !fits {
            return refuse(format!(
                "it offers bounce region {}+{}, which is not inside its declared arena",
                offer.offset, offer.len
            ));
        }
    }
    if data.prompt_len == 0
        || data.token_range.start >= data.token_range.end
        || data.token_range.end > data.prompt_len
        || data.dst_start_token.is_some_and(|t| t > data.prompt_len)
    {
        return refuse(format!(
            "tokens {}..{} of a {}-token prompt",
            data.token_range.start, data.token_range.end, data.prompt_len
        ));
    }
    {
        let mut state = lock(&inner.prefill);
        if !state.requests.contains_key(&request) {
            let instance = &conn.identity.instance;
            let ended = state.ended.find(request, |e| {
                e.instance.as_ref().is_none_or(|i| i == instance)
            });
            if let Some(e) = ended {
                let reason = format!("request {request} already ended here: {}", e.how);
                drop(state);
                return refuse(reason);
            }
            // A claim after its own cancel (the id asked for again) supersedes the cancel.
            state
                .tombstones
                .retain_request(request, |t| t.instance != conn.identity.instance);
            let bytes = request_data_bytes(&data);
            let item = Stashed {
                conn: Arc::clone(conn),
                data,
            };
            if state
                .stash
                .push(request, item, bytes, Instant::now())
                .is_err()
            {
                let limit = state.stash.limit();
                drop(state);
                return refuse(format!(
                    "request {request} is not sent here yet, and {limit} bytes of claims \
                     waiting for their send are held already"
                ));
            }
            tracing::debug!(request, peer = %conn.name(), "claim stashed until its send");
            return;
        }
    }
    claim(inner, conn, data);
}

/// The ranks of `conn`'s instance this rank writes for its DP group: the planner's `targets`,
/// asked the first time and kept for the connection's life; or why not.
fn targets(inner: &Inner, conn: &DecodeConn) -> Result<BTreeSet<u32>, String> {
    if let Some(known) = conn.targets.get() {
        return Ok(known.clone());
    }
    let asked = inner.ask_targets(&conn.info, conn.info.dp_rank)?;
    Ok(conn
        .targets
        .get_or_init(|| asked.into_iter().collect())
        .clone())
}

/// Binds a claim to a sent request (or refuses it), then plans what is due.
fn claim(inner: &Arc<Inner>, conn: &Arc<DecodeConn>, data: RequestData) {
    let arrived = Instant::now();
    let id = data.request;
    let (c, g) = (data.sender_rank, data.receiver_rank);
    let refusal = {
        let mut state = lock(&inner.prefill);
        let Some(req) = state.requests.get_mut(&id) else {
            return;
        };
        if req.cancelled || req.failure.is_some() {
            Some("the request has ended here".to_string())
        } else if !req.open_to(&conn.identity.instance) {
            Some(format!(
                "request {id} belongs to another decode instance; {} cannot claim it",
                conn.identity.instance
            ))
        } else if req.claims.contains_key(&g) {
            Some(format!("rank {g} has claimed request {id} already"))
        } else if data.prompt_len != req.prompt_len {
            Some(format!(
                "receiver says prompt_len {}, this rank sends {}",
                data.prompt_len, req.prompt_len
            ))
        } else {
            None
        }
    };
    if let Some(reason) = refusal {
        tracing::warn!(request = id, peer = %conn.name(), %reason, "claim refused");
        let _ = conn.outbox.send(failed(id, (c, g), 0, reason));
        return;
    }
    // Who this rank writes for the claimer's DP group: asked once per connection, under the
    // deadline.
    let needs_targets = lock(&inner.prefill)
        .requests
        .get(&id)
        .is_some_and(|r| r.expected.is_none());
    let expected = if needs_targets {
        match targets(inner, conn) {
            Ok(t) => Some(t),
            Err(reason) => {
                let _ = conn.outbox.send(failed(id, (c, g), 0, reason.clone()));
                fail(inner, id, Some(conn.name()), FailureKind::Planner, reason);
                return;
            }
        }
    } else {
        None
    };
    {
        let mut state = lock(&inner.prefill);
        let Some(req) = state.requests.get_mut(&id) else {
            return;
        };
        if let Some(e) = expected {
            req.expected.get_or_insert(e);
        }
        let targeted = req.expected.as_ref().is_some_and(|e| e.contains(&g));
        if !targeted || req.claims.contains_key(&g) {
            drop(state);
            let reason = format!("this rank does not write rank {g} (or it claimed twice)");
            let _ = conn.outbox.send(failed(id, (c, g), 0, reason));
            return;
        }
        req.owner
            .get_or_insert_with(|| conn.identity.instance.clone());
        req.claimed_at.get_or_insert_with(Instant::now);
        req.claims.insert(
            g,
            Claim {
                conn: Arc::clone(conn),
                data,
                planned: 0,
                planning: false,
                jobs: 0,
                reported: 0,
                ended: false,
                ok: false,
                cancelled: false,
                arrived,
                bounce_cursor: 0,
                stages: Stages::default(),
            },
        );
    }
    tracing::debug!(request = id, peer = %conn.name(), "claimed");
    pump(inner, id);
}

/// Hands every claim's unplanned chunks to the planner pool (one task per claim at a time,
/// so pieces stay in order).
fn pump(inner: &Arc<Inner>, id: u64) {
    let mut tasks = Vec::new();
    {
        let mut state = lock(&inner.prefill);
        let Some(req) = state.requests.get_mut(&id) else {
            return;
        };
        if req.cancelled || req.failure.is_some() {
            return;
        }
        for (&g, claim) in req.claims.iter_mut() {
            if claim.planning || claim.ended || claim.cancelled || claim.planned >= req.chunks.len()
            {
                continue;
            }
            let chunks: Vec<(usize, Chunk)> = req.chunks[claim.planned..]
                .iter()
                .enumerate()
                .map(|(k, c)| (claim.planned + k, c.clone()))
                .collect();
            claim.planning = true;
            tasks.push((g, Arc::clone(&claim.conn), claim.data.clone(), chunks));
        }
    }
    for (g, conn, data, chunks) in tasks {
        let worker = Arc::clone(inner);
        let hung = Arc::clone(inner);
        let deadline = inner.planning.deadline();
        let planner_id = inner.bound.id().to_string();
        let hung_conn = Arc::clone(&conn);
        let submitted = Instant::now();
        inner.planning.submit(
            Box::new(move || plan_and_queue(&worker, id, g, &conn, &data, chunks, submitted)),
            Box::new(move || {
                let reason = format!(
                    "planner {planner_id} did not return within {} ms while planning request {id}",
                    deadline.as_millis()
                );
                // The call is abandoned: the claim is no longer being planned. Its last
                // piece (failed) goes out once its earlier pieces' jobs have reported.
                if let Some(claim) = lock(&hung.prefill)
                    .requests
                    .get_mut(&id)
                    .and_then(|r| r.claims.get_mut(&g))
                    .filter(|c| c.conn.id == hung_conn.id)
                {
                    claim.planning = false;
                }
                fail(
                    &hung,
                    id,
                    Some(hung_conn.name()),
                    FailureKind::Planner,
                    reason,
                );
            }),
        );
    }
}

fn plan_and_queue(
    inner: &Arc<Inner>,
    id: u64,
    g: u32,
    conn: &Arc<DecodeConn>,
    data: &RequestData,
    chunks: Vec<(usize, Chunk)>,
    submitted: Instant,
) {
    let _span = tracing::debug_span!("plan", request = id, peer = %conn.name()).entered();
    let mut stages = Stages {
        queue_ns: nanos(submitted.elapsed()),
        ..Stages::default()
    };
    let mut plans: Vec<Queued> = Vec::with_capacity(chunks.len());
    let mut error = None;
    let mut cursor = lock(&inner.prefill)
        .requests
        .get(&id)
        .and_then(|r| r.claims.get(&g))
        .map_or(0, |c| c.bounce_cursor);
    for (k, chunk) in &chunks {
        let mut piece = chunk.piece;
        piece.dst_start_token = match data.dst_start_token {
            Some(t) => ROption::RSome(t),
            None => ROption::RNone,
        };
        let me = RequestSide {
            info: &inner.info,
            slot_tables: &chunk.tables,
            excluded: &chunk.excluded,
        };
        let them = RequestSide {
            info: &conn.info,
            slot_tables: &data.slot_tables,
            excluded: &data.excluded_views,
        };
        match plan_timed(inner.planner.as_ref(), me, them, &piece, &mut stages) {
            Ok(plan) => {
                let digest = match data.integrity {
                    None => None,
                    Some(algorithm) => match piece_digest(inner, algorithm, &piece, &plan) {
                        Ok((digest, ns)) => {
                            stages.digest_ns += ns;
                            Some(digest)
                        }
                        Err(reason) => {
                            error = Some((*k as u32, format!("piece {k}: {reason}")));
                            break;
                        }
                    },
                };
                let bounce = bounce_piece(inner, conn, id, data, &piece, &plan, &mut cursor);
                plans.push(Queued {
                    piece: *k as u32,
                    is_last: chunk.last,
                    views: chunk.views.clone(),
                    plan: Arc::new(plan),
                    bounce,
                    digest,
                });
            }
            Err(e) => {
                error = Some((*k as u32, format!("piece {k}: {}", error_chain(&e))));
                break;
            }
        }
    }
    let last = chunks.last().map_or(0, |c| c.0);
    {
        let mut state = lock(&inner.prefill);
        let Some(req) = state.requests.get_mut(&id) else {
            return;
        };
        let live = req.failure.is_none() && !req.cancelled;
        let Some(claim) = req.claims.get_mut(&g).filter(|c| c.conn.id == conn.id) else {
            return;
        };
        claim.stages.merge(&stages);
        if !live || claim.ended || claim.cancelled {
            claim.planning = false;
            drop(state);
            settle(inner, id);
            return;
        }
        claim.planned = last + 1;
        claim.jobs += plans.len();
        claim.bounce_cursor = cursor;
        // The claim stays `planning` until these pieces are on the rank thread's queue: a
        // `pump` in between (the engine's next layer-wise chunk) would otherwise plan the
        // later pieces on another pool thread and could queue them first, and the receiver
        // fails a request whose pieces are reported out of order.
    }
    for q in plans {
        queue(inner, id, g, conn, q);
    }
    if let Some(claim) = lock(&inner.prefill)
        .requests
        .get_mut(&id)
        .and_then(|r| r.claims.get_mut(&g))
        .filter(|c| c.conn.id == conn.id)
    {
        claim.planning = false;
    }
    // Whatever ended the request while its pieces were being queued waited on `planning`.
    settle(inner, id);
    if let Some((piece, reason)) = error {
        tracing::warn!(request = id, %reason, "cannot plan");
        end_claim(inner, id, g, conn, piece, reason.clone(), true);
        fail(inner, id, Some(conn.name()), FailureKind::Planner, reason);
        return;
    }
    pump(inner, id);
}

/// The digest of `plan`'s source bytes in the order of their destinations (the piece's
/// packed image, see [`kvferry_protocol::Integrity`]), and the nanoseconds it took; or why it
/// cannot be made (device pools: the CPU reads the bytes).
fn piece_digest(
    inner: &Arc<Inner>,
    algorithm: Integrity,
    piece: &PairRequest,
    plan: &ValidatedPlan,
) -> Result<(PieceDigest, u64), String> {
    let started = Instant::now();
    let device = inner
        .info
        .page_table
        .pools
        .iter()
        .any(|p| p.memory_type == kvferry_planner_abi::MemoryType::VRAM);
    if device {
        return Err(format!(
            "the receiver asked for an {algorithm} digest of each piece, which the CPU computes, \
             and this rank's pools are device memory"
        ));
    }
    let runs = kvferry_plan::bounce::gather_list(plan)
        .into_iter()
        .map(|(src, _, len)| (src, len));
    // SAFETY: every source of this rank's validated plan lies inside its pools, host memory
    // of this process (checked above) live for the agent's life; they are the request's
    // source slots, which the engine leaves unchanged from `send` to the terminal event
    // (`Agent::start`'s contract), and kvferry only reads.
    let value = unsafe { crate::integrity::digest_runs(algorithm, runs) };
    let digest = PieceDigest {
        tokens: piece.token_range,
        value,
    };
    Ok((digest, nanos(started.elapsed())))
}

/// A planned piece, ready for the rank thread.
struct Queued {
    piece: u32,
    is_last: bool,
    /// The views it carries, when only some.
    views: Option<Arc<Vec<ViewId>>>,
    plan: Arc<ValidatedPlan>,
    /// Its bounce job and what its completion says about it, if it bounces.
    bounce: Option<(BounceJob, BouncedPiece)>,
    /// Its digest, when the receiver asked for one.
    digest: Option<PieceDigest>,
}

/// Whether `plan` (piece `piece` of the claim `data`) goes through the receiver's bounce
/// region, and where in it: the next `plan.total_bytes()` of the offered region after
/// `cursor`, which moves on. `None`: no offer, this rank does not bounce, the mode says no,
/// or the piece does not fit (logged).
fn bounce_piece(
    inner: &Arc<Inner>,
    conn: &DecodeConn,
    id: u64,
    data: &RequestData,
    piece: &PairRequest,
    plan: &ValidatedPlan,
    cursor: &mut u64,
) -> Option<(BounceJob, BouncedPiece)> {
    let config = &inner.config.bounce;
    let offer = data.bounce?;
    let arena = conn.remote.bounce.as_ref()?;
    let total = plan.total_bytes();
    if !inner.bounces || !config.may_bounce_over(&inner.config.transport) || total == 0 {
        return None;
    }
    if config.mode == BounceMode::Auto && total / plan.len().max(1) as u64 >= AUTO_MAX_MEAN_FRAGMENT
    {
        return None;
    }
    let offset = *cursor;
    if offset.checked_add(total).is_none_or(|end| end > offer.len) {
        tracing::info!(
            request = id,
            peer = %conn.name(),
            bytes = total,
            offered = offer.len,
            used = offset,
            "the piece does not fit the rest of the offered bounce region: it goes fragment \
             by fragment"
        );
        return None;
    }
    *cursor = offset + total;
    Some((
        BounceJob {
            remote_addr: arena.base + offer.offset + offset,
            gather: kvferry_plan::bounce::gather_list(plan),
        },
        BouncedPiece {
            offset,
            tokens: piece.token_range,
        },
    ))
}

/// [`kvferry_plan::plan_transfer`] in its two halves, timed: describing both sides' rows and
/// the planner's call ([`kvferry_plan::pair_piece`]) count as `plan`, validation and
/// coalescing as `validate`.
fn plan_timed(
    planner: &dyn TransferPlanner,
    me: RequestSide<'_>,
    them: RequestSide<'_>,
    piece: &PairRequest,
    stages: &mut Stages,
) -> Result<ValidatedPlan, PlanFailure> {
    let started = Instant::now();
    let planned = kvferry_plan::pair_piece(planner, me, them, piece)?;
    let paired = Instant::now();
    stages.plan_ns += nanos(paired.duration_since(started));
    let plan = planned.validate()?;
    stages.validate_ns += nanos(paired.elapsed());
    Ok(plan)
}

fn queue(inner: &Arc<Inner>, id: u64, g: u32, conn: &Arc<DecodeConn>, q: Queued) {
    let Queued {
        piece,
        is_last,
        views,
        plan,
        bounce,
        digest,
    } = q;
    let (bounce, bounced_piece) = bounce.unzip();
    let c = inner.info.instance_rank;
    let done_inner = Arc::clone(inner);
    let done_conn = Arc::clone(conn);
    let release_inner = Arc::clone(inner);
    if inner.config.record_plans {
        lock(&inner.recorded).record(id, &conn.remote, &plan);
    }
    let queued = Instant::now();
    inner.thread.write(WriteJob {
        request: id,
        dest: Arc::clone(&conn.remote),
        plan,
        timeout: inner.config.timeout,
        hook: inner.config.hook.clone(),
        bounce,
        release: Some(Box::new(move || {
            let mut state = lock(&release_inner.prefill);
            if let Some(claim) = state
                .requests
                .get_mut(&id)
                .and_then(|r| r.claims.get_mut(&g))
            {
                claim.jobs = claim.jobs.saturating_sub(1);
            }
        })),
        done: Box::new(move |result| {
            let (bytes, fragments, status) = match &result {
                Ok(s) => (s.bytes, s.fragments, CompletionStatus::Ok),
                Err(e) => (0, 0, CompletionStatus::Failed(error_chain(e))),
            };
            let bounced = match &result {
                Ok(s) if s.bounced => bounced_piece,
                _ => None,
            };
            let ok = result.is_ok();
            let ends = is_last || !ok;
            {
                let mut state = lock(&done_inner.prefill);
                let Some(req) = state.requests.get_mut(&id) else {
                    return;
                };
                let Some(claim) = req.claims.get_mut(&g) else {
                    return;
                };
                if claim.ended {
                    return;
                }
                if let Ok(s) = &result {
                    // Its wait for the rank thread: the job's time there, less its own work.
                    claim.stages.queue_ns += nanos(queued.elapsed()).saturating_sub(s.busy_ns);
                    claim.stages.puts_ns += s.puts_ns;
                    claim.stages.flush_ns += s.flush_ns;
                    claim.stages.gather_ns += s.gather_ns;
                }
                // A registration that ended (the peer lost, or given up for not draining)
                // hears nothing more: after a forced close its slots may still receive bytes
                // the network holds, and only the end of its link without this report makes
                // the receiver wait for them (`decode::LATE_WRITE_GRACE`).
                let registered = done_conn.alive.load(Ordering::Acquire);
                if registered {
                    let _ = done_conn.outbox.send(AgentMessage::Completion(Completion {
                        request: id,
                        sender_rank: c,
                        receiver_rank: g,
                        piece,
                        is_last: ends,
                        bytes,
                        fragments,
                        status: status.clone(),
                        bounce: bounced,
                        digest: digest.filter(|_| ok),
                        views: views.as_ref().map(|v| v.to_vec()),
                    }));
                }
                claim.reported = piece + 1;
                req.bytes += bytes;
                req.puts += result.as_ref().map_or(0, |s| s.puts);
                if ends {
                    claim.ended = true;
                    claim.ok = ok;
                    if ok {
                        let mut stages = claim.stages;
                        stages.control_ns =
                            nanos(claim.arrived.elapsed()).saturating_sub(stages.total_ns());
                        req.stages.merge(&stages);
                    }
                }
                if let (CompletionStatus::Failed(reason), None) = (&status, &req.failure) {
                    req.failure = Some((
                        Some(done_conn.name()),
                        FailureKind::Write,
                        format!("writing piece {piece} to {}: {reason}", done_conn.name()),
                    ));
                }
            }
            settle(&done_inner, id);
        }),
    });
}

/// Ends a claim with a failed last piece (unless it ended already). `after_jobs`: the
/// claim's queued jobs report first, so the failure is sent when they have.
fn end_claim(
    inner: &Arc<Inner>,
    id: u64,
    g: u32,
    conn: &Arc<DecodeConn>,
    piece: u32,
    reason: String,
    after_jobs: bool,
) {
    let mut state = lock(&inner.prefill);
    let Some(claim) = state
        .requests
        .get_mut(&id)
        .and_then(|r| r.claims.get_mut(&g))
    else {
        return;
    };
    if claim.ended || claim.conn.id != conn.id || (after_jobs && claim.jobs > 0) {
        return;
    }
    claim.ended = true;
    let piece = piece.max(claim.reported);
    let _ = conn
        .outbox
        .send(failed(id, (inner.info.instance_rank, g), piece, reason));
}

fn fail(inner: &Arc<Inner>, id: u64, peer: Option<String>, kind: FailureKind, detail: String) {
    {
        let mut state = lock(&inner.prefill);
        let Some(req) = state.requests.get_mut(&id) else {
            return;
        };
        if req.failure.is_none() && !req.cancelled {
            req.failure = Some((peer, kind, detail));
        }
    }
    settle(inner, id);
}

/// Ends the request if it can end: emits its one terminal event and forgets it.
fn settle(inner: &Arc<Inner>, id: u64) {
    let event = {
        let mut state = lock(&inner.prefill);
        let Some(req) = state.requests.get_mut(&id) else {
            return;
        };
        let busy = req.claims.values().any(|c| c.jobs > 0 || c.planning);
        let c = inner.info.instance_rank;
        let ending = req.cancelled || req.failure.is_some();
        if ending && !busy {
            // Every claim still open hears it is over; nothing of theirs is in flight.
            // A cancel by this side's engine reaches the receivers as one, so they end
            // `CancelledByPeer` at once rather than as a failed write.
            let status = match &req.failure {
                Some((_, _, d)) => CompletionStatus::Failed(d.clone()),
                None => {
                    CompletionStatus::Cancelled(format!("{} cancelled request {id}", inner.me()))
                }
            };
            for (&g, claim) in req.claims.iter_mut() {
                if !claim.ended {
                    claim.ended = true;
                    let _ = claim.conn.outbox.send(last_piece(
                        id,
                        (c, g),
                        claim.reported,
                        status.clone(),
                    ));
                }
            }
        }
        let all_ended = req.claims.values().all(|c| c.ended);
        let expected_done = req.expected.as_ref().is_some_and(|e| {
            e.iter()
                .all(|g| req.claims.get(g).is_some_and(|c| c.ended && c.ok))
        });
        let event = if busy {
            None
        } else if req.cancelled {
            Some(Event::Cancelled { request: id })
        } else if let Some((peer, kind, detail)) = &req.failure {
            Some(Event::Failed {
                request: id,
                peer: peer.clone(),
                kind: *kind,
                detail: detail.clone(),
            })
        } else if req.finished && expected_done && all_ended {
            Some(Event::Sent {
                request: id,
                bytes: req.bytes,
                puts: req.puts,
                stages: req.stages,
            })
        } else if all_ended && !req.claims.is_empty() && req.claims.values().any(|c| !c.ok) {
            let peer = req.claims.values().find(|c| !c.ok).map(|c| c.conn.name());
            Some(Event::Failed {
                request: id,
                peer: peer.clone(),
                kind: if req.claims.values().any(|c| c.cancelled) {
                    FailureKind::CancelledByPeer
                } else {
                    FailureKind::Write
                },
                detail: format!(
                    "{} abandoned request {id}",
                    peer.unwrap_or_else(|| "a receiver".into())
                ),
            })
        } else {
            None
        };
        if let Some(e) = &event {
            if let Some(req) = state.requests.remove(&id) {
                let how = match e {
                    Event::Sent { .. } => "it was sent".to_string(),
                    Event::Cancelled { .. } => "the engine cancelled it".to_string(),
                    Event::Failed { kind, detail, .. } => format!("failed[{kind}]: {detail}"),
                    _ => "it ended".to_string(),
                };
                let ended = Ended {
                    instance: req.owner.or(req.to),
                    how,
                };
                let bytes = ended.bytes();
                let _ = state.ended.push(id, ended, bytes, Instant::now());
            }
        }
        event
    };
    if let Some(e) = event {
        inner.events.push(e);
    }
}

/// The receiver cancels: its claim stops being written; the failed last piece goes out once
/// its jobs drained.
fn peer_cancel(inner: &Arc<Inner>, conn: &Arc<DecodeConn>, id: u64, reason: &str) {
    let g = conn.info.instance_rank;
    let pending = {
        let mut state = lock(&inner.prefill);
        state.stash.retain_request(id, |s| s.conn.id != conn.id);
        let instance = &conn.identity.instance;
        match state.requests.get_mut(&id) {
            // Not sent here yet: the send that comes later ends at once.
            None => {
                let tomb = Tombstone {
                    instance: instance.clone(),
                    peer: conn.name(),
                    reason: reason.chars().take(TOMBSTONE_REASON).collect(),
                };
                let bytes = tomb.bytes();
                if state
                    .tombstones
                    .push(id, tomb, bytes, Instant::now())
                    .is_err()
                {
                    tracing::warn!(request = id, peer = %conn.name(), "too many cancels of unsent requests held: this one is not kept, its send will end at its lease");
                }
                Some((true, 0))
            }
            Some(req) => match req.claims.get_mut(&g) {
                Some(claim) if claim.conn.id == conn.id && !claim.ended => {
                    claim.cancelled = true;
                    Some((claim.jobs == 0 && !claim.planning, claim.reported))
                }
                // Claimed by another connection, or over: nothing of this peer's is in flight.
                Some(_) => None,
                // Sent, but this rank never claimed it: a receiver that gives up on a request
                // it may claim ends it now (not at the lease); any peer gets its answer.
                None => {
                    let targeted = req.expected.as_ref().is_none_or(|e| e.contains(&g));
                    if targeted && req.open_to(instance) && !req.cancelled && req.failure.is_none()
                    {
                        req.failure = Some((
                            Some(conn.name()),
                            FailureKind::CancelledByPeer,
                            format!(
                                "{} cancelled request {id} before claiming it: {reason}",
                                conn.name()
                            ),
                        ));
                    }
                    Some((true, 0))
                }
            },
        }
    };
    tracing::debug!(request = id, peer = %conn.name(), %reason, "cancelled by the receiver");
    match pending {
        Some((true, piece)) => {
            let mut state = lock(&inner.prefill);
            if let Some(claim) = state
                .requests
                .get_mut(&id)
                .and_then(|r| r.claims.get_mut(&g))
            {
                claim.ended = true;
            }
            drop(state);
            let _ = conn.outbox.send(failed(
                id,
                (inner.info.instance_rank, g),
                piece,
                format!("cancelled by the receiver: {reason}"),
            ));
            settle(inner, id);
        }
        // The reaper answers it once its jobs drained (`finish_cancelled_claims`).
        Some((false, _)) => {}
        None => {}
    }
}

/// A receiver's instance still wants request `id`, which nothing claimed yet (its engine
/// queued it): the lease runs from now again, at most [`MAX_HELD_LEASES`] leases after the
/// first send. A hold for a request it may not claim, one already claimed or ended, or one
/// not sent here is ignored (a claim then gets its answer as it would have).
fn hold(inner: &Arc<Inner>, conn: &Arc<DecodeConn>, id: u64) {
    let lease = inner.config.lease;
    let mut state = lock(&inner.prefill);
    let Some(req) = state.requests.get_mut(&id) else {
        tracing::debug!(request = id, peer = %conn.name(), "hold for a request not held here");
        return;
    };
    let open = req.open_to(&conn.identity.instance);
    if !open || req.claimed_at.is_some() || req.cancelled || req.failure.is_some() {
        tracing::debug!(request = id, peer = %conn.name(), open, "hold ignored");
        return;
    }
    let bound = req.first_send + lease * MAX_HELD_LEASES;
    let until = (Instant::now() + lease).min(bound);
    req.held_until = Some(req.held_until.map_or(until, |h| h.max(until)));
    tracing::debug!(request = id, peer = %conn.name(), "held");
}

pub(crate) fn cancel(inner: &Arc<Inner>, id: u64) -> Result<(), CallError> {
    {
        let mut state = lock(&inner.prefill);
        let req = state
            .requests
            .get_mut(&id)
            .ok_or(CallError::Unknown { request: id })?;
        if req.failure.is_none() {
            req.cancelled = true;
        }
    }
    settle(inner, id);
    Ok(())
}

pub(crate) fn reap(inner: &Arc<Inner>) {
    let now = Instant::now();
    let (lease, timeout) = (inner.config.lease, inner.config.timeout);
    let mut due = Vec::new();
    let mut expired = Vec::new();
    {
        let mut state = lock(&inner.prefill);
        // A registration the rank thread ended (its peer stalled): end the reader's wait, so
        // the connection goes now (its reader says why).
        for c in state.conns.values() {
            if !c.alive.load(Ordering::Acquire) {
                let _ = c.socket.shutdown(std::net::Shutdown::Read);
            }
        }
        state.stash.retain(|s, at| {
            let keep = now.saturating_duration_since(at) < lease.min(STASH_TTL);
            if !keep {
                expired.push((
                    Arc::clone(&s.conn),
                    s.data.request,
                    s.data.sender_rank,
                    s.data.receiver_rank,
                ));
            }
            keep
        });
        let ttl = lease.min(STASH_TTL);
        state
            .tombstones
            .retain(|_, at| now.saturating_duration_since(at) < ttl);
        state
            .ended
            .retain(|_, at| now.saturating_duration_since(at) < ttl);
        for (&id, req) in state.requests.iter_mut() {
            if req.failure.is_some() || req.cancelled {
                // A cancelled claim waiting for its jobs, or an ending request: settle again.
                due.push(id);
                continue;
            }
            if req.claims.values().any(|c| c.cancelled && !c.ended) {
                due.push(id);
            }
            let lease_end = req.held_until.unwrap_or(req.first_send + lease);
            match req.claimed_at {
                None if now >= lease_end => {
                    let held = match req.held_until {
                        Some(_) => format!(
                            " (held by its receiver for {} ms)",
                            lease_end.duration_since(req.first_send).as_millis()
                        ),
                        None => String::new(),
                    };
                    req.failure = Some((
                        None,
                        FailureKind::Lease,
                        format!(
                            "no receiver claimed request {id} within the {} ms lease{held}",
                            lease.as_millis()
                        ),
                    ));
                    due.push(id);
                }
                Some(at) if now.saturating_duration_since(at) >= timeout => {
                    let missing: Vec<String> = req
                        .expected
                        .iter()
                        .flatten()
                        .filter(|g| !req.claims.get(g).is_some_and(|c| c.ended))
                        .map(|g| format!("rank {g}"))
                        .collect();
                    req.failure = Some((
                        req.owner.clone(),
                        FailureKind::Timeout,
                        format!(
                            "request {id} not written within {} ms (waiting on {})",
                            timeout.as_millis(),
                            missing.join(", ")
                        ),
                    ));
                    due.push(id);
                }
                _ => {}
            }
        }
    }
    for (conn, request, c, g) in expired {
        let _ = conn.outbox.send(failed(
            request,
            (c, g),
            0,
            format!("request {request} was never sent here"),
        ));
    }
    for id in due {
        finish_cancelled_claims(inner, id);
        settle(inner, id);
    }
}

/// Cancelled claims whose jobs drained get their failed last piece.
fn finish_cancelled_claims(inner: &Arc<Inner>, id: u64) {
    let c = inner.info.instance_rank;
    let mut state = lock(&inner.prefill);
    let Some(req) = state.requests.get_mut(&id) else {
        return;
    };
    for (&g, claim) in req.claims.iter_mut() {
        if claim.cancelled && !claim.ended && claim.jobs == 0 && !claim.planning {
            claim.ended = true;
            let _ = claim.conn.outbox.send(failed(
                id,
                (c, g),
                claim.reported,
                "cancelled by the receiver".into(),
            ));
        }
    }
}
