//! The prefill side of an agent: the side channel, and the driver of the rank's
//! [`PrefillMachine`].
//!
//! The request logic — sends, claims (stashed until their send), holds, cancels from either
//! side, leases, timeouts, which claim's chunks to plan next, when a request ends and how —
//! is the machine's, sans I/O, in `kvferry_protocol::prefill`. This module feeds it what
//! happened (side-channel messages, the engine's calls, plans made on the planner pool,
//! pieces written by the rank thread, lost peers, the reaper's clock) and carries out what
//! it asks, under the role's lock: messages go on the peers' outboxes (non-blocking, so
//! a pair's completions leave in the order the machine decided them), planning tasks go to
//! the planner pool, outcomes become the engine's events. What needs I/O or the planner
//! stays here: the handshake, vetting a peer, the planner's `targets` (asked once per
//! connection), planning, digests, bounce placement and queueing writes.

use std::collections::{BTreeSet, HashMap};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_plan::{PlanFailure, RequestSide, ValidatedPlan, error_chain};
use kvferry_planner_abi::ffi::ROption;
use kvferry_planner_abi::{PairRequest, RankInfo, SlotTable, TokenRange, TransferPlanner, ViewId};
use kvferry_protocol::prefill::{
    self, Action, ClaimFate, Peer, PlanTask, Planned, PrefillConfig, PrefillMachine, SendCall,
    SendRefused, WriteCounts, Written,
};
use kvferry_protocol::{
    AgentError, AgentEvent, AgentMessage, AgentSession, BouncedPiece, CompletionStatus, Integrity,
    PeerIdentity, PieceDigest, RequestData, read_frame,
};

use super::events::Event;
use super::{CallError, Inner, SendChunk, lock};
use crate::bounce::{AUTO_MAX_MEAN_FRAGMENT, BounceMode};
use crate::conn::{Outbox, Pending, Reader, Secured, Unproven, drain, secure_accept, spawn_writer};
use crate::outcome::Stages;
use crate::rank::{BounceJob, PeerId, RemoteRank, WriteJob, nanos};

/// A chunk's slot tables, shared by every claim that plans it.
type Tables = Arc<Vec<SlotTable>>;

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
}

impl DecodeConn {
    fn name(&self) -> String {
        self.identity.to_string()
    }
}

/// The prefill role's state: the request machine and the connections it names.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) machine: PrefillMachine<Tables>,
    conns: HashMap<PeerId, Arc<DecodeConn>>,
    open: Arc<AtomicUsize>,
    /// Where the side channel listens (to wake its accept loop at shutdown).
    listening: Option<std::net::SocketAddr>,
}

impl State {
    pub(crate) fn new(config: PrefillConfig) -> Self {
        Self {
            machine: PrefillMachine::new(config),
            conns: HashMap::new(),
            open: Arc::new(AtomicUsize::new(0)),
            listening: None,
        }
    }
}

/// Carries out what the machine asks, in order, under the role's lock (every step is
/// non-blocking: an outbox push, a planner-pool submission, an event).
fn run(inner: &Arc<Inner>, state: &mut State) {
    while let Some(action) = state.machine.poll_action() {
        match action {
            Action::Send { peer, message } => {
                if let Some(conn) = state.conns.get(&peer) {
                    if let AgentMessage::Completion(c) = &message {
                        if let CompletionStatus::Failed(reason) = &c.status {
                            tracing::debug!(request = c.request, peer = %conn.name(), piece = c.piece, %reason, "pair ends failed");
                        }
                    }
                    let _ = conn.outbox.send(message);
                }
            }
            Action::Plan(task) => match state.conns.get(&task.peer) {
                Some(conn) => submit(inner, Arc::clone(conn), task),
                // Gone between the claim and now (this agent stops): nothing is planned.
                None => {
                    let first = task.chunks.first().map_or(0, |c| c.0);
                    state.machine.handle_queued(
                        Instant::now(),
                        task.request,
                        task.rank,
                        task.peer,
                        Some((first, "its connection is gone".into())),
                    );
                }
            },
            Action::Ended { request, outcome } => {
                inner.events.push(Event::ended(request, outcome));
            }
        }
    }
}

/// Calls the machine under the role's lock, then carries out what it asked.
#[track_caller]
fn with_machine<R>(
    inner: &Arc<Inner>,
    f: impl FnOnce(&mut PrefillMachine<Tables>, Instant) -> R,
) -> R {
    let mut state = lock(&inner.prefill);
    let r = f(&mut state.machine, Instant::now());
    run(inner, &mut state);
    r
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
                // Full, it closes the oldest unproven connection for this one; only when every
                // connection is proven is this one turned away.
                let Some(pending) = unproven.admit_counted(&stream, &open, max) else {
                    // Unauthenticated: it learns nothing but that it was turned away.
                    tracing::warn!(
                        limit = max,
                        "side channel full of proven or closing connections: connection refused"
                    );
                    drop(stream);
                    continue;
                };
                let counted = Arc::clone(&open);
                let spawned = thread::Builder::new()
                    .name(format!("gen-conn-{}", inner.info.instance_rank))
                    .spawn(move || {
                        serve_connection(&inner, stream, pending);
                        counted.fetch_sub(1, Ordering::AcqRel);
                    });
                if let Err(e) = spawned {
                    // The connection (and its place) went with the closure.
                    open.fetch_sub(1, Ordering::AcqRel);
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
                            let _ = conn.outbox.send(reply);
                            // Which of its instance's ranks this rank writes depends on the
                            // two descriptions alone: asked once, under the planner's deadline,
                            // before any of its claims is read.
                            let targets = inner
                                .ask_targets(&conn.info, conn.info.dp_rank)
                                .map(|t| t.into_iter().collect::<BTreeSet<u32>>());
                            let peer = Peer {
                                instance: conn.identity.instance.clone(),
                                rank: conn.info.instance_rank,
                                name: conn.name(),
                                targets,
                            };
                            let mut state = lock(&inner.prefill);
                            state.conns.insert(conn.id, Arc::clone(&conn));
                            state.machine.handle_connected(conn.id, peer);
                            drop(state);
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
            // peer's worker stalled (see `ExecConfig::stall_limit`). The reaper then cuts this read
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
    if !lock(&inner.prefill)
        .machine
        .bound_to(&who.instance, who.rank)
    {
        return;
    }
    if let Ok(targets) = inner.ask_targets(info, info.dp_rank) {
        if !targets.contains(&who.rank) {
            return;
        }
    }
    with_machine(inner, |m, now| {
        m.handle_receiver_refused(now, &who.instance, who.rank, &who.to_string(), reason)
    });
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

/// A decode rank's connection ended: its claims fail, nothing more is written to it. The
/// connection stays open until the rank thread has closed its endpoint to the decode rank's
/// worker: a decode rank that is leaving waits for that (`decode::shutdown`) before its worker
/// goes, so the endpoint's closing flush does not fail against a worker already destroyed.
fn lost(inner: &Arc<Inner>, conn: &Arc<DecodeConn>, why: &str) {
    conn.alive.store(false, Ordering::Release);
    let held = Arc::clone(conn);
    inner
        .thread
        .forget_then(conn.id, Box::new(move || drop(held)));
    let mut state = lock(&inner.prefill);
    state.machine.handle_lost(Instant::now(), conn.id, why);
    run(inner, &mut state);
    state.conns.remove(&conn.id);
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
        // Each connection leaves the map when its reader ends (`lost`).
        let conns: Vec<Arc<DecodeConn>> = state.conns.values().cloned().collect();
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
    // The views a layer-wise part leaves out need not be covered: nothing of them moves.
    let excluded: Vec<ViewId> = match &carried {
        Some(carried) => all.difference(carried).copied().collect(),
        None => Vec::new(),
    };
    kvferry_plan::check_slot_tables(&inner.info, &s.tables, &excluded, s.tokens.end)
        .map_err(invalid)?;
    let call = SendCall {
        request: id,
        to: s.to.take(),
        prompt_len: s.prompt_len,
        tokens: s.tokens,
        is_last: s.is_last,
        carried,
        tables: Arc::new(std::mem::take(&mut s.tables)),
    };
    with_machine(inner, |m, now| m.handle_send(now, call, &all)).map_err(|e| match e {
        SendRefused::Unknown => CallError::Unknown { request: id },
        SendRefused::Duplicate => CallError::Duplicate { request: id },
        SendRefused::Invalid(reason) => invalid(reason),
    })
}

/// Every view of `info`'s page table.
fn all_views(info: &RankInfo) -> BTreeSet<ViewId> {
    info.page_table.view_ids().collect()
}

/// Why this rank cannot digest its pieces with `algorithm` (device pools: the CPU reads the
/// bytes), if it cannot.
fn cannot_digest(inner: &Inner, algorithm: Integrity) -> Option<String> {
    let device = inner
        .info
        .page_table
        .pools
        .iter()
        .any(|p| p.memory_type == kvferry_planner_abi::MemoryType::VRAM);
    device.then(|| {
        format!(
            "the receiver asked for an {algorithm} digest of each piece, which the CPU computes, \
             and this rank's pools are device memory"
        )
    })
}

/// The digest of `plan`'s source bytes in the order of their destinations (the piece's
/// packed image, see [`kvferry_protocol::Integrity`]), and the nanoseconds it took. Only for a
/// rank of host pools ([`cannot_digest`]).
fn piece_digest(
    algorithm: Integrity,
    tokens: TokenRange,
    plan: &ValidatedPlan,
) -> (PieceDigest, u64) {
    let started = Instant::now();
    let runs = kvferry_plan::bounce::gather_list(plan)
        .into_iter()
        .map(|(src, _, len)| (src, len));
    // SAFETY: every source of this rank's validated plan lies inside its pools, host memory
    // of this process (checked by the caller, `cannot_digest`) live for the agent's life;
    // they are the request's source slots, which the engine leaves unchanged from `send` to
    // the terminal event (`Agent::start`'s contract; the piece's completion, which waits for
    // this digest, comes before it), and kvferry only reads.
    let value = unsafe { crate::integrity::digest_runs(algorithm, runs) };
    (PieceDigest { tokens, value }, nanos(started.elapsed()))
}

/// A piece's write and its digest, which the planner thread computes while the rank thread
/// puts the bytes (the sources are the same either way): whichever ends second hands the
/// piece to the machine, so its completion carries the digest and the digest costs the piece
/// only what it takes beyond the write. Pieces keep their order: writes end in order, and the
/// digests are made in order.
#[derive(Default)]
struct DigestJoin(Mutex<Join>);

#[derive(Default)]
enum Join {
    #[default]
    Neither,
    Written(Written),
    Digested(PieceDigest, u64),
    Done,
}

impl DigestJoin {
    /// The write ended: the piece, to go to the machine once its digest is in.
    fn written(&self, written: Written) -> Option<Written> {
        let mut join = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::take(&mut *join) {
            Join::Digested(digest, ns) => {
                *join = Join::Done;
                Some(with_digest(written, digest, ns))
            }
            _ => {
                *join = Join::Written(written);
                None
            }
        }
    }

    /// The digest is made: the piece, if its write already ended.
    fn digested(&self, digest: PieceDigest, ns: u64) -> Option<Written> {
        let mut join = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::take(&mut *join) {
            Join::Written(written) => {
                *join = Join::Done;
                Some(with_digest(written, digest, ns))
            }
            _ => {
                *join = Join::Digested(digest, ns);
                None
            }
        }
    }
}

fn with_digest(mut written: Written, digest: PieceDigest, ns: u64) -> Written {
    written.digest = Some(digest);
    written.stages.digest_ns += ns;
    written
}

/// A planned piece, ready for the rank thread.
struct Queued {
    piece: u32,
    /// Its tokens.
    tokens: TokenRange,
    is_last: bool,
    /// The views it carries, when only some.
    views: Option<Arc<Vec<ViewId>>>,
    plan: Arc<ValidatedPlan>,
    /// Its bounce job and what its completion says about it, if it bounces.
    bounce: Option<(BounceJob, BouncedPiece)>,
    /// The digest the receiver asked for, made while the piece is written.
    digest: Option<Integrity>,
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

/// A decode rank's claim: the checks that need no request state here (it names this rank
/// and its own, its tables fit its pools, its bounce offer its arena, its tokens its
/// prompt), the rest in the machine.
fn request_data(inner: &Arc<Inner>, conn: &Arc<DecodeConn>, data: RequestData) {
    let (c, g, request) = (data.sender_rank, data.receiver_rank, data.request);
    let me = inner.info.instance_rank;
    let refuse = |reason: String| {
        tracing::warn!(request, peer = %conn.name(), %reason, "claim refused");
        let _ = conn
            .outbox
            .send(prefill::failed(request, (c, g), 0, reason));
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
    // The receiver's tables cover what it wants, or its own plan would vouch for a partial
    // request (an honest agent checked this at `expect`; a peer's word is checked again).
    // Tokens past the prompt are refused by name further on.
    if let Err(e) = kvferry_plan::check_slot_tables(
        &conn.info,
        &data.slot_tables,
        &data.excluded_views,
        data.token_range.end.min(data.prompt_len),
    ) {
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
    match with_machine(inner, |m, now| m.handle_claim(now, conn.id, data)) {
        ClaimFate::Bound => tracing::debug!(request, peer = %conn.name(), "claimed"),
        ClaimFate::Stashed => {
            tracing::debug!(request, peer = %conn.name(), "claim stashed until its send")
        }
        ClaimFate::Refused(reason) => {
            tracing::warn!(request, peer = %conn.name(), %reason, "claim refused")
        }
    }
}

/// Submits a claim's planning task to the planner pool; a call that outlives the planner's
/// deadline fails the request.
fn submit(inner: &Arc<Inner>, conn: Arc<DecodeConn>, task: PlanTask<Tables>) {
    // Its write jobs follow the plan: the rank thread is awake to take them.
    inner.thread.keep_awake();
    let (id, g, peer) = (task.request, task.rank, task.peer);
    let worker = Arc::clone(inner);
    let hung = Arc::clone(inner);
    let deadline = inner.planning.deadline();
    let planner_id = inner.bound.id().to_string();
    let submitted = Instant::now();
    inner.planning.submit(
        Box::new(move || plan_and_queue(&worker, &conn, task, submitted)),
        Box::new(move || {
            let reason = format!(
                "planner {planner_id} did not return within {} ms while planning request {id}",
                deadline.as_millis()
            );
            // The call is abandoned: the claim is no longer being planned. Its last piece
            // (failed) goes out once its earlier pieces' jobs have reported.
            with_machine(&hung, |m, now| m.handle_plan_hung(now, id, g, peer, reason));
        }),
    );
}

fn plan_and_queue(
    inner: &Arc<Inner>,
    conn: &Arc<DecodeConn>,
    task: PlanTask<Tables>,
    submitted: Instant,
) {
    let PlanTask {
        request: id,
        rank: g,
        peer,
        data,
        chunks,
        bounce_cursor: mut cursor,
    } = task;
    let _span = tracing::debug_span!("plan", request = id, peer = %conn.name()).entered();
    let mut stages = Stages {
        queue_ns: nanos(submitted.elapsed()),
        ..Stages::default()
    };
    let mut plans: Vec<Queued> = Vec::with_capacity(chunks.len());
    let mut error = None;
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
                let digest = data.integrity;
                if let Some(reason) = digest.and_then(|a| cannot_digest(inner, a)) {
                    error = Some((*k, format!("piece {k}: {reason}")));
                    break;
                }
                let bounce = bounce_piece(inner, conn, id, &data, &piece, &plan, &mut cursor);
                plans.push(Queued {
                    piece: *k,
                    tokens: piece.token_range,
                    is_last: chunk.last,
                    views: chunk.views.clone(),
                    plan: Arc::new(plan),
                    bounce,
                    digest,
                });
            }
            Err(e) => {
                error = Some((*k, format!("piece {k}: {}", error_chain(&e))));
                break;
            }
        }
    }
    let planned = Planned {
        through: chunks.last().map_or(0, |c| c.0 + 1),
        pieces: plans.len(),
        bounce_cursor: cursor,
        stages,
    };
    if !with_machine(inner, |m, now| m.handle_planned(now, id, g, peer, planned)) {
        return;
    }
    let mut digests = Vec::new();
    for q in plans {
        let pending = q.digest.map(|a| (a, q.tokens, Arc::clone(&q.plan)));
        let join = queue(inner, id, g, conn, q);
        digests.extend(pending.zip(join));
    }
    if let Some((_, reason)) = &error {
        tracing::warn!(request = id, %reason, "cannot plan");
    }
    with_machine(inner, |m, now| m.handle_queued(now, id, g, peer, error));
    // The digests, in piece order, while the rank thread writes the pieces.
    for ((algorithm, tokens, plan), join) in digests {
        let (digest, ns) = piece_digest(algorithm, tokens, &plan);
        if let Some(written) = join.digested(digest, ns) {
            with_machine(inner, |m, now| m.handle_written(now, id, g, written));
        }
    }
}

/// Hands piece `q` to the rank thread; the join its digest goes to, when it has one to make.
fn queue(
    inner: &Arc<Inner>,
    id: u64,
    g: u32,
    conn: &Arc<DecodeConn>,
    q: Queued,
) -> Option<Arc<DigestJoin>> {
    let Queued {
        piece,
        is_last,
        views,
        plan,
        bounce,
        digest,
        tokens: _,
    } = q;
    let join = digest.map(|_| Arc::new(DigestJoin::default()));
    let done_join = join.clone();
    let (bounce, bounced_piece) = bounce.unzip();
    let done_inner = Arc::clone(inner);
    let done_conn = Arc::clone(conn);
    let release_inner = Arc::clone(inner);
    if inner.config.harness.record_plans {
        lock(&inner.recorded).record(id, &conn.remote, &plan);
    }
    let queued = Instant::now();
    inner.thread.write(WriteJob {
        request: id,
        dest: Arc::clone(&conn.remote),
        plan,
        timeout: inner.config.timeout,
        hook: inner.config.harness.hook.clone(),
        bounce,
        release: Some(Box::new(move || {
            with_machine(&release_inner, |m, _| m.handle_released(id, g));
        })),
        done: Box::new(move |result| {
            let mut stages = Stages::default();
            let (result, bounce) = match result {
                Ok(s) => {
                    // Its wait for the rank thread: the job's time there, less its own work.
                    stages.queue_ns = nanos(queued.elapsed()).saturating_sub(s.busy_ns);
                    stages.puts_ns = s.puts_ns;
                    stages.flush_ns = s.flush_ns;
                    stages.gather_ns = s.gather_ns;
                    let counts = WriteCounts {
                        bytes: s.bytes,
                        fragments: s.fragments,
                        puts: s.puts,
                    };
                    (Ok(counts), bounced_piece.filter(|_| s.bounced))
                }
                Err(e) => (Err(error_chain(&e)), None),
            };
            let written = Written {
                piece,
                is_last,
                result,
                bounce,
                digest: None,
                views,
                stages,
                // A registration that ended (the peer lost, or given up for not draining)
                // hears nothing more: after a forced close its slots may still receive bytes
                // the network holds, and only the end of its link without this report makes
                // the receiver wait for them (`decode::LATE_WRITE_GRACE`).
                registered: done_conn.alive.load(Ordering::Acquire),
            };
            let written = match &done_join {
                Some(join) => join.written(written),
                None => Some(written),
            };
            if let Some(written) = written {
                with_machine(&done_inner, |m, now| m.handle_written(now, id, g, written));
            }
        }),
    });
    join
}

/// The receiver cancels: its claim stops being written; the failed last piece goes out once
/// its jobs drained.
fn peer_cancel(inner: &Arc<Inner>, conn: &Arc<DecodeConn>, id: u64, reason: &str) {
    tracing::debug!(request = id, peer = %conn.name(), %reason, "cancelled by the receiver");
    with_machine(inner, |m, now| m.handle_cancel(now, conn.id, id, reason));
}

/// A receiver's instance still wants request `id`, which nothing claimed yet: its lease
/// runs from now again (see [`PrefillMachine::handle_hold`]).
fn hold(inner: &Arc<Inner>, conn: &Arc<DecodeConn>, id: u64) {
    if with_machine(inner, |m, now| m.handle_hold(now, conn.id, id)) {
        tracing::debug!(request = id, peer = %conn.name(), "held");
    } else {
        tracing::debug!(request = id, peer = %conn.name(), "hold ignored");
    }
}

pub(crate) fn cancel(inner: &Arc<Inner>, id: u64) -> Result<(), CallError> {
    with_machine(inner, |m, now| m.cancel(now, id)).map_err(|()| CallError::Unknown { request: id })
}

/// The reaper's turn: registrations the rank thread ended get their reader cut short, and
/// the machine sees the time.
pub(crate) fn reap(inner: &Arc<Inner>) {
    let mut state = lock(&inner.prefill);
    // A registration the rank thread ended (its peer stalled): end the reader's wait, so
    // the connection goes now (its reader says why).
    for c in state.conns.values() {
        if !c.alive.load(Ordering::Acquire) {
            let _ = c.socket.shutdown(std::net::Shutdown::Read);
        }
    }
    if state
        .machine
        .poll_timeout()
        .is_some_and(|due| due <= Instant::now())
    {
        state.machine.handle_timeout(Instant::now());
        run(inner, &mut state);
    }
}
