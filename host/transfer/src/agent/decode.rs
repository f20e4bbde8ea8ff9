//! The decode side of an agent: the peer directory, links to prefill ranks,
//! expected requests and their completions.
//!
//! `expect` checks the request against this rank's own pools at once, reserves its id, and
//! hands the rest to the agent's dispatch pool: find the prefill instance (metadata added with
//! `add_peer`, or fetched through the endpoints passed with the request), ask the planner
//! which prefill ranks write this rank, link to each (dial, prove the secret, vet; a rank that
//! claims one already linked is held to that link, see `Claim`), and send each its
//! `RequestData`. Completions arrive on the links. A request ends in exactly one
//! terminal event, and a failed or cancelled one only once every writer that may still
//! write has answered the `Cancel` with its last piece or its link is gone.
//!
//! The request logic — trackers, the order completions are taken up in around scatters, the
//! byte check against this rank's own plan, cancels, timeouts, late writes — is the
//! [`DecodeMachine`]'s, sans I/O, in `kvferry_protocol::decode`; this module is its driver:
//! it links the writers, plans and scatters, and carries out the machine's actions under the
//! role's lock (non-blocking steps only; a scatter that cannot go to its pool runs after the
//! lock is let go).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_plan::error_chain;
use kvferry_planner_abi::{SlotTable, TokenRange, ViewId};
use kvferry_protocol::decode::{Action, DecodeConfig, DecodeMachine, ExpectCall, LinkId};
use kvferry_protocol::secure::HandshakeError;
use kvferry_protocol::{
    AgentEvent, AgentMessage, AgentMetadata, AgentSession, BounceOffer, Completion, Integrity,
    PeerIdentity, Role, read_frame, write_frame,
};

use super::events::{Event, FailureKind};
use super::{CONNECT_TIMEOUT, CallError, Inner, lock};
use crate::bounce::Region;
use crate::conn::{Outbox, Reader, Secured, drain, secure_dial, spawn_writer};
use crate::rank::{PeerId, nanos};

/// A request this decode rank expects ([`super::Agent::expect`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expect {
    /// The request id both engines agree on.
    pub request: u64,
    /// The prefill instance that sends it.
    pub peer: String,
    /// Side-channel endpoints of that instance's ranks, any order (may be empty when their
    /// metadata was added with `add_peer`). Unknown ranks are fetched through them.
    pub endpoints: Vec<String>,
    /// The prefill DP group that holds it.
    pub ctx_dp_rank: u32,
    /// The prompt's length.
    pub prompt_len: u64,
    /// Tokens already cached here (block-aligned): nothing before it is written.
    pub cached_prefix: Option<u64>,
    /// This rank's destination slot tables, one per layer group.
    pub tables: Vec<SlotTable>,
    /// Views of this rank that must not be written.
    pub excluded_views: Vec<ViewId>,
}

/// A vetted link to one prefill rank.
#[derive(Debug)]
struct Link {
    id: PeerId,
    identity: PeerIdentity,
    /// The endpoint it was dialled at.
    endpoint: String,
    /// The metadata the rank presented on it, having proved the secret and had this rank's
    /// worker answer its challenge: what a second claimant of its identity is held to
    /// ([`claim`]).
    metadata: AgentMetadata,
    outbox: Outbox<AgentMessage>,
    alive: AtomicBool,
    /// Its reader has ended (at its function's end, however it ends).
    ended: AtomicBool,
    /// The link's socket, to end its reader at shutdown.
    socket: TcpStream,
}

/// Sets [`Link::ended`] when the reader's function returns.
struct ReaderEnds<'a>(&'a Link);

impl Drop for ReaderEnds<'_> {
    fn drop(&mut self) {
        self.0.ended.store(true, Ordering::Release);
    }
}

/// How long a stopping decode rank waits for its prefill ranks to close their ends of the
/// side channel before it closes them itself (and its UCX worker goes).
const LEAVE_GRACE: Duration = Duration::from_millis(500);

impl Link {
    fn name(&self) -> String {
        self.identity.to_string()
    }
}

/// What the driver keeps of an open request beside the machine: what the engine expects
/// (to plan pieces here) and the bounce region offered to its writer.
#[derive(Debug)]
struct Extra {
    expect: Arc<Expect>,
    bounce: Option<Offered>,
}

/// A bounce region offered to one writer of a request.
#[derive(Debug)]
struct Offered {
    region: Region,
    writer: u32,
    /// Bytes of the region before which no bounced piece may start (the end of the last
    /// one scattered): pieces come in order and never overlap.
    cursor: u64,
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) machine: DecodeMachine,
    /// Per open request.
    extras: HashMap<u64, Extra>,
    /// Links by id, from their dial until their reader ended.
    by_id: HashMap<LinkId, Arc<Link>>,
    directory: HashMap<String, BTreeMap<u32, AgentMetadata>>,
    links: HashMap<(String, u32), Arc<Link>>,
    /// Why a start was refused, by its identity, with the metadata refused: a refusal holds
    /// for that metadata only, so a claimant of another rank's identity cannot have that
    /// rank refused.
    refused: HashMap<PeerIdentity, (AgentMetadata, String)>,
    /// Per prefill rank (instance, rank), the epochs of its starts that a start filed later
    /// replaced here, the latest last (at most [`SUPERSEDED_KEPT`]): epochs are random, so
    /// this is how a start is told to be older than another ([`claim`]).
    superseded: HashMap<(String, u32), VecDeque<u64>>,
    /// One gate per endpoint dialed: requests expected together wait for one dial and
    /// share its link instead of each opening its own.
    dialing: HashMap<String, Arc<std::sync::Mutex<()>>>,
    /// Each known prefill rank's planner, instantiated here once for the byte check.
    writer_planners: HashMap<PeerIdentity, WriterPlanner>,
    /// The planner's `targets` (the prefill ranks that write this rank), per prefill rank
    /// asked about and DP group: they depend on the two ranks' descriptions alone, so
    /// `expect` asks the planner (a round trip to its worker) once, not once per request.
    writer_targets: HashMap<(PeerIdentity, u32), Arc<[u32]>>,
}

/// A prefill rank's planner, built here (a trait object, shown by name only).
#[derive(Clone)]
struct WriterPlanner(Arc<dyn kvferry_planner_abi::TransferPlanner>);

impl std::fmt::Debug for WriterPlanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WriterPlanner")
    }
}

impl State {
    pub(crate) fn new(config: DecodeConfig) -> Self {
        Self {
            machine: DecodeMachine::new(config),
            extras: HashMap::new(),
            by_id: HashMap::new(),
            directory: HashMap::new(),
            links: HashMap::new(),
            refused: HashMap::new(),
            superseded: HashMap::new(),
            dialing: HashMap::new(),
            writer_planners: HashMap::new(),
            writer_targets: HashMap::new(),
        }
    }

    /// Files a prefill rank's metadata, replacing an older start of that rank (whose
    /// planner, instantiated for the byte check, goes with it, and whose epoch is kept as
    /// superseded).
    fn record(&mut self, m: AgentMetadata) {
        let identity = m.identity();
        let filed = self
            .directory
            .get(&identity.instance)
            .and_then(|ranks| ranks.get(&identity.rank))
            .map(|m| m.epoch);
        self.supersede(&identity, filed);
        let current = |id: &PeerIdentity| {
            id.instance != identity.instance
                || id.rank != identity.rank
                || id.epoch == identity.epoch
        };
        self.writer_planners.retain(|id, _| current(id));
        self.writer_targets.retain(|(id, _), _| current(id));
        self.directory
            .entry(identity.instance)
            .or_default()
            .insert(identity.rank, m);
    }

    /// `identity`'s start of its rank is taken after the start of epoch `old`: `old`, when
    /// another, is kept as superseded (the oldest kept goes past [`SUPERSEDED_KEPT`]), and
    /// `identity`'s own epoch is current again if it was superseded before.
    fn supersede(&mut self, identity: &PeerIdentity, old: Option<u64>) {
        let key = (identity.instance.clone(), identity.rank);
        match old.filter(|&old| old != identity.epoch) {
            Some(old) => {
                let kept = self.superseded.entry(key).or_default();
                kept.retain(|&e| e != old && e != identity.epoch);
                kept.push_back(old);
                if kept.len() > SUPERSEDED_KEPT {
                    kept.pop_front();
                }
            }
            None => {
                if let Some(kept) = self.superseded.get_mut(&key) {
                    kept.retain(|&e| e != identity.epoch);
                }
            }
        }
    }
}

/// Superseded epochs kept per prefill rank ([`State::superseded`]).
const SUPERSEDED_KEPT: usize = 8;

/// What this rank makes of a prefill rank that presents metadata `m` (when dialled, or to
/// `add_peer`), by the live link it holds to the rank `m` names (instance and rank), if any.
///
/// A rank's identity is its instance, rank and epoch, and the epoch is random per start: a
/// restart is a new epoch, and of two epochs the newer is the one this rank filed later
/// ([`State::supersede`]). So: a claimant of a live start (its epoch) must present, byte for
/// byte, the metadata that start proved on the live link, or it is refused and the live link,
/// its directory entry and its requests stay as they were; a start that this rank saw
/// superseded is refused as older while a newer start's link lives; any other epoch is a
/// restart and replaces the live link. There are no per-rank keys, so a holder of the secret
/// can still present a fresh epoch of a live rank and displace its link (its requests end,
/// and the start it displaced is refused as older until the displacing link ends): the rule
/// keeps it from claiming a live start, not from claiming to be a restart.
#[derive(Debug)]
enum Claim {
    /// No live link to that rank: vet the claimant, then link it.
    Free,
    /// A live link to that very start, with the same metadata (the rank reached at another
    /// address of its host, or a copy of its metadata): the live link serves, and the new
    /// connection is closed without a word (a refusal would make the prefill rank fail what
    /// it holds for this rank).
    Same(Arc<Link>),
    /// A live link to another start of the rank, not one filed after the claimant's: the
    /// claimant is a restart and replaces it (the live link's requests end).
    Newer(Arc<Link>),
    /// Refused, in these words (what is live, and where).
    Refused(String),
}

/// See [`Claim`].
fn claim(state: &State, m: &AgentMetadata) -> Claim {
    let identity = m.identity();
    let key = (identity.instance.clone(), identity.rank);
    let Some(live) = state
        .links
        .get(&key)
        .filter(|l| l.alive.load(Ordering::Acquire))
    else {
        return Claim::Free;
    };
    if live.identity.epoch == identity.epoch {
        if live.metadata == *m {
            return Claim::Same(Arc::clone(live));
        }
        return Claim::Refused(format!(
            "a live link to it exists at {}, and this claim of it differs from the metadata \
             that link proved ({}): a second claimant of a live rank is refused",
            live.endpoint,
            differences(&live.metadata, m).join(", ")
        ));
    }
    if state
        .superseded
        .get(&key)
        .is_some_and(|kept| kept.contains(&identity.epoch))
    {
        return Claim::Refused(format!(
            "an older start of that rank: a live link to its newer start (epoch {:016x}) \
             exists at {}",
            live.identity.epoch, live.endpoint
        ));
    }
    Claim::Newer(Arc::clone(live))
}

/// What differs between two metadata of one identity, in words.
fn differences(proven: &AgentMetadata, claimed: &AgentMetadata) -> Vec<&'static str> {
    let (a, b) = (proven, claimed);
    let planner = (&a.planner_id, &a.describer_id, &a.planner_version)
        != (&b.planner_id, &b.describer_id, &b.planner_version);
    let named: Vec<&'static str> = [
        (
            a.rank.worker_address != b.rank.worker_address,
            "its UCX worker address",
        ),
        (a.endpoint != b.endpoint, "its advertised endpoint"),
        (a.rank.info != b.rank.info, "its rank description"),
        (a.rank.pools != b.rank.pools, "its pool keys"),
        (a.rank.bounce != b.rank.bounce, "its bounce arena's key"),
        (a.role != b.role, "its role"),
        (planner, "its planner"),
        (a.label != b.label, "its label"),
    ]
    .into_iter()
    .filter_map(|(differs, what)| differs.then_some(what))
    .collect();
    if named.is_empty() {
        vec!["its metadata"]
    } else {
        named
    }
}

/// Takes `link` out of use for a newer start of its rank, `why`: its requests end now, and
/// its reader at its next message. Returns the scatters to run once the lock is let go.
fn retire(inner: &Arc<Inner>, state: &mut State, link: &Link, why: &str) -> Vec<Deferred> {
    link.alive.store(false, Ordering::Release);
    let key = (link.identity.instance.clone(), link.identity.rank);
    if state.links.get(&key).is_some_and(|l| l.id == link.id) {
        state.links.remove(&key);
    }
    state.machine.handle_link_lost(Instant::now(), link.id, why);
    run(inner, state)
}

// ---------------------------------------------------------------------------------------
// Peers.

pub(crate) fn add_peer(inner: &Arc<Inner>, m: AgentMetadata) -> Result<PeerIdentity, CallError> {
    if m.role != Role::Prefill {
        return Err(CallError::Metadata(format!(
            "{} is a {} rank; a decode rank adds prefill ranks",
            m.identity(),
            m.role
        )));
    }
    inner.vet_shape(&m).map_err(CallError::Metadata)?;
    inner
        .check_peer(&m.rank.info)
        .map_err(CallError::Metadata)?;
    let identity = m.identity();
    let mut state = lock(&inner.decode);
    // Held to the live link to that rank, as a rank that is dialled is (see `Claim`).
    if let Claim::Refused(reason) = claim(&state, &m) {
        return Err(CallError::Metadata(format!("{identity}: {reason}")));
    }
    let rank = m.rank.info.instance_rank;
    state.record(m);
    // A link to an older start of that rank is stale.
    if let Some(link) = state.links.get(&(identity.instance.clone(), rank)).cloned() {
        if link.identity.epoch != identity.epoch {
            // Its requests end now; its reader ends at its next message.
            let deferred = retire(inner, &mut state, &link, "was replaced by a newer start");
            drop(state);
            deferred.into_iter().for_each(|job| job());
        }
    }
    Ok(identity)
}

/// Why no link came of an endpoint.
#[derive(Debug)]
struct NoLink {
    kind: FailureKind,
    detail: String,
    /// The rank there claimed the identity of a rank this one holds a live link to, and was
    /// refused ([`Claim::Refused`]): a request that named the endpoint fails, even where the
    /// live link could serve it.
    claim: bool,
}

impl From<(FailureKind, String)> for NoLink {
    fn from((kind, detail): (FailureKind, String)) -> Self {
        NoLink {
            kind,
            detail,
            claim: false,
        }
    }
}

/// The live link to the rank advertising `endpoint`, or a new one: one dial at a time per
/// endpoint, so concurrent requests share a link.
fn link_to(inner: &Arc<Inner>, endpoint: &str) -> Result<Arc<Link>, NoLink> {
    let gate = Arc::clone(
        lock(&inner.decode)
            .dialing
            .entry(endpoint.to_string())
            .or_default(),
    );
    // Held for a whole dial (up to the handshake deadline) by design: not a state lock.
    let _one_at_a_time = gate.lock().unwrap_or_else(|e| e.into_inner());
    let live = {
        let state = lock(&inner.decode);
        state
            .directory
            .iter()
            .flat_map(|(instance, ranks)| ranks.iter().map(move |(r, m)| (instance, r, m)))
            .find(|(_, _, m)| m.endpoint.as_deref() == Some(endpoint))
            .and_then(|(instance, r, _)| state.links.get(&(instance.clone(), *r)))
            .filter(|l| l.alive.load(Ordering::Acquire))
            .cloned()
    };
    match live {
        Some(link) => Ok(link),
        None => dial(inner, endpoint),
    }
}

/// Dials a prefill rank's side channel, runs the secure handshake, vets the rank, links it.
/// A rank that claims the identity of one this rank holds a live link to is held to that
/// link ([`Claim`]): refused, or served by the live link, or (a restart) it replaces it.
fn dial(inner: &Arc<Inner>, endpoint: &str) -> Result<Arc<Link>, NoLink> {
    let unreachable = |problem: String| (FailureKind::Peer, format!("{endpoint}: {problem}"));
    let handshake = inner.config.handshake_timeout;
    let stream = crate::conn::dial(endpoint, CONNECT_TIMEOUT, handshake).map_err(unreachable)?;
    let deadline = Instant::now() + handshake;
    let Secured {
        mut reader,
        mut writer,
        socket,
        binding,
    } = secure_dial::<AgentMessage>(stream, &inner.config.secret, endpoint, deadline).map_err(
        |e| match e {
            HandshakeError::Refused | HandshakeError::Unauthenticated => {
                (FailureKind::Refused, format!("{endpoint}: {e}"))
            }
            e => unreachable(format!("handshake: {}", error_chain(&e))),
        },
    )?;
    let (mut session, own) = AgentSession::dial(inner.metadata.clone());
    write_frame(&mut writer, &own).map_err(|e| unreachable(error_chain(&e)))?;
    let metadata = loop {
        let message: AgentMessage = read_frame(&mut reader)
            .map_err(|e| unreachable(format!("handshake: {}", error_chain(&e))))?;
        match session.receive(message) {
            Ok(AgentEvent::Metadata(m)) => break *m,
            Ok(AgentEvent::ProveWorker) => {
                // The challenge the prefill rank sent our worker for this session, if it
                // came (by the handshake's deadline); nothing else.
                let tag = super::worker_proof::worker_challenge_tag(&binding);
                let challenge = inner
                    .challenges
                    .take(&tag, deadline)
                    .map(Vec::from)
                    .unwrap_or_default();
                write_frame(&mut writer, &AgentMessage::WorkerProof { challenge })
                    .map_err(|e| unreachable(error_chain(&e)))?;
            }
            Ok(AgentEvent::Nothing) => {}
            Ok(other) => {
                return Err(unreachable(format!("handshake: unexpected {other:?}")).into());
            }
            Err(e @ kvferry_protocol::AgentError::Refused { .. }) => {
                return Err((
                    FailureKind::Refused,
                    format!("{endpoint} refused this rank: {e}"),
                )
                    .into());
            }
            Err(e) => return Err(unreachable(e.to_string()).into()),
        }
    };
    let identity = metadata.identity();
    // Held to a live link to that rank before it is vetted; a refusal of a claim is not
    // cached (the identity is the live rank's).
    let early = claim(&lock(&inner.decode), &metadata);
    match early {
        Claim::Same(live) => {
            tracing::debug!(peer = %identity, %endpoint, linked = %live.endpoint,
                "the rank at this endpoint is one this rank is linked to: using that link");
            let _ = socket.shutdown(std::net::Shutdown::Both);
            return Ok(live);
        }
        Claim::Refused(reason) => {
            let refused = claim_refused(&identity, endpoint, &reason);
            let _ = write_frame(&mut writer, &session.refuse(refused.detail.clone()));
            return Err(refused);
        }
        Claim::Free | Claim::Newer(_) => {}
    }
    let cached = lock(&inner.decode)
        .refused
        .get(&identity)
        .filter(|(refused, _)| *refused == metadata)
        .map(|(_, reason)| reason.clone());
    let verdict = match cached {
        Some(reason) => Err(reason),
        None => inner
            .vet_shape(&metadata)
            .and_then(|()| inner.check_peer(&metadata.rank.info)),
    };
    if let Err(reason) = verdict {
        let _ = write_frame(&mut writer, &session.refuse(reason.clone()));
        lock(&inner.decode)
            .refused
            .insert(identity.clone(), (metadata.clone(), reason.clone()));
        return Err((
            FailureKind::Refused,
            format!("{identity} at {endpoint}: {reason}"),
        )
            .into());
    }
    session.ready().map_err(|e| unreachable(e.to_string()))?;
    reader
        .get_mut()
        .get_mut()
        .settle(Some(inner.config.peer_timeout))
        .map_err(|e| unreachable(e.to_string()))?;
    let link = Arc::new(Link {
        id: inner.next_peer.fetch_add(1, Ordering::Relaxed),
        identity: identity.clone(),
        endpoint: endpoint.to_string(),
        metadata: metadata.clone(),
        outbox: spawn_writer(writer, format!("ctx-{identity}")),
        alive: AtomicBool::new(true),
        ended: AtomicBool::new(false),
        socket,
    });
    let mut state = lock(&inner.decode);
    // Again, under the lock it is linked under: another dial may have linked that rank
    // while this one vetted it.
    let deferred = match claim(&state, &metadata) {
        Claim::Free => Vec::new(),
        Claim::Newer(old) => {
            state.supersede(&identity, Some(old.identity.epoch));
            let why = format!(
                "was replaced by a newer start (epoch {:016x}) at {endpoint}",
                identity.epoch
            );
            tracing::info!(peer = %old.name(), newer = %identity, %endpoint,
                "a newer start of a linked prefill rank replaces its link");
            retire(inner, &mut state, &old, &why)
        }
        Claim::Same(live) => {
            drop(state);
            link.alive.store(false, Ordering::Release);
            let _ = link.socket.shutdown(std::net::Shutdown::Both);
            return Ok(live);
        }
        Claim::Refused(reason) => {
            drop(state);
            let refused = claim_refused(&identity, endpoint, &reason);
            link.alive.store(false, Ordering::Release);
            let _ = link.outbox.send(session.refuse(refused.detail.clone()));
            return Err(refused);
        }
    };
    let rank = identity.rank;
    state.record(metadata);
    state
        .links
        .insert((identity.instance.clone(), rank), Arc::clone(&link));
    state.by_id.insert(link.id, Arc::clone(&link));
    state.machine.handle_link_up(link.id, link.name());
    drop(state);
    deferred.into_iter().for_each(|job| job());
    let weak = Arc::downgrade(inner);
    let reading = Arc::clone(&link);
    thread::Builder::new()
        .name(format!("ctx-{}", identity.rank))
        .spawn(move || read_link(&weak, &reading, session, reader))
        .map_err(|e| unreachable(format!("cannot spawn its reader: {e}")))?;
    tracing::info!(peer = %identity, %endpoint, "linked to prefill rank");
    Ok(link)
}

/// The failure of the requests that dialled a claimant refused by [`claim`], in words that
/// name the identity it claimed and where it was reached.
fn claim_refused(identity: &PeerIdentity, endpoint: &str, reason: &str) -> NoLink {
    tracing::warn!(peer = %identity, %endpoint, %reason, "claimant of a linked prefill rank refused");
    NoLink {
        kind: FailureKind::Refused,
        detail: format!("{identity} at {endpoint}: {reason}"),
        claim: true,
    }
}

fn read_link(
    weak: &std::sync::Weak<Inner>,
    link: &Arc<Link>,
    mut session: AgentSession,
    mut reader: Reader,
) {
    let _ends = ReaderEnds(link);
    // Whether the prefill rank's end may still be open (the read neither saw it close nor
    // failed nor timed out): the prefill closes it once its endpoint to this rank's worker is
    // closed, and this reader waits for that (below).
    let mut open = true;
    let why = loop {
        let message: AgentMessage = match read_frame(&mut reader) {
            Ok(m) => m,
            Err(e) => {
                open = false;
                if e.is_disconnect() {
                    break "closed its connection".to_string();
                }
                if super::is_timeout(&e) {
                    break match weak.upgrade() {
                        Some(inner) => format!(
                            "sent nothing for {} ms (not even a keep-alive): stopped, or cut off",
                            inner.config.peer_timeout.as_millis()
                        ),
                        None => "went silent".to_string(),
                    };
                }
                break format!("connection failed: {}", error_chain(&e));
            }
        };
        let Some(inner) = weak.upgrade() else { return };
        if !link.alive.load(Ordering::Acquire) {
            if inner.stopped.load(Ordering::Acquire) {
                // This agent is leaving: what the prefill rank still says is moot, but its
                // end must close first (see `shutdown`).
                continue;
            }
            break "was dropped by this rank".to_string();
        }
        match session.receive(message) {
            Ok(AgentEvent::Completion(c)) => completion(&inner, link, c),
            Ok(AgentEvent::Nothing) => {}
            Ok(other) => break format!("sent {other:?}"),
            // Its last word, said on purpose (its shutdown, or its refusal of this rank).
            Err(kvferry_protocol::AgentError::PeerError { message }) => {
                break format!("ended the link: {message}");
            }
            Err(e) => break format!("broke the protocol: {e}"),
        }
    };
    let dropped = !link.alive.swap(false, Ordering::AcqRel);
    if let Some(inner) = weak.upgrade() {
        // Dropped here (a newer start, a broken protocol, a cancel left unanswered): the
        // socket's error says less than that.
        let why = if dropped && !inner.stopped.load(Ordering::Acquire) {
            "was dropped by this rank".to_string()
        } else {
            why
        };
        if inner.stopped.load(Ordering::Acquire) {
            // This agent's own shutdown ended it: `Drop for Agent` logs that once.
            tracing::debug!(peer = %link.name(), reason = %why, "prefill rank link ended");
        } else {
            tracing::info!(peer = %link.name(), reason = %why, "prefill rank link ended");
        }
        let key = (link.identity.instance.clone(), link.identity.rank);
        with_machine(&inner, |state, now| {
            if state.links.get(&key).is_some_and(|l| l.id == link.id) {
                state.links.remove(&key);
            }
            state.by_id.remove(&link.id);
            state.machine.handle_link_lost(now, link.id, &why);
        });
        if open {
            // The link ended on a word (the prefill rank's goodbye or refusal, a message out
            // of place): half-close it and hold the agent, and so this rank's worker, until
            // the prefill rank has closed its end (see `shutdown`), at most `LEAVE_GRACE`.
            let _ = link.socket.shutdown(std::net::Shutdown::Write);
            if link.socket.set_read_timeout(Some(LEAVE_GRACE)).is_ok() {
                drain(&mut &link.socket, LEAVE_GRACE);
            }
        }
    }
}

pub(crate) fn connections(inner: &Arc<Inner>) -> usize {
    lock(&inner.decode)
        .links
        .values()
        .filter(|l| l.alive.load(Ordering::Acquire))
        .count()
}

pub(crate) fn ping(inner: &Arc<Inner>) {
    // Every link a request still writes through, not only the directory's: dispatches that
    // run together may each have dialled the same rank, and the directory keeps the last
    // link only. An unpinged link falls silent to its peer, whose read timeout ends it.
    let links: Vec<Arc<Link>> = {
        let state = lock(&inner.decode);
        let mut by_id: BTreeMap<PeerId, Arc<Link>> = BTreeMap::new();
        let in_use = state
            .machine
            .links_in_use()
            .filter_map(|id| state.by_id.get(&id));
        for l in state.links.values().chain(in_use) {
            by_id.entry(l.id).or_insert_with(|| Arc::clone(l));
        }
        by_id.into_values().collect()
    };
    for l in links {
        let _ = l.outbox.send(AgentMessage::Ping);
    }
}

/// Ends every link, the prefill ranks' ends first. A link is half-closed, and its reader
/// reads on until the prefill rank closes its end, which it does once it has closed its UCX
/// endpoint to this rank's worker (`prefill::lost`): an endpoint closed after the worker it
/// writes to has gone fails its flush, and UCX logs that as an error for an endpoint without
/// peer error handling ("error during flush: Connection reset by remote peer"). A link whose
/// reader ended before (on the prefill rank's goodbye: it is stopping too) has left the
/// directory, and its reader waits for the close itself, holding the agent (`read_link`), so
/// `Drop for Agent` waits for it. A prefill rank that does not close its end within
/// [`LEAVE_GRACE`] (stopped, or busy) is cut off then.
pub(crate) fn shutdown(inner: &Arc<Inner>) {
    let links: Vec<Arc<Link>> = {
        let mut guard = lock(&inner.decode);
        let state = &mut *guard;
        let mut by_id: BTreeMap<PeerId, Arc<Link>> = BTreeMap::new();
        for l in state
            .links
            .drain()
            .map(|(_, l)| l)
            .chain(state.by_id.values().cloned())
        {
            by_id.entry(l.id).or_insert(l);
        }
        by_id.into_values().collect()
    };
    for l in &links {
        l.alive.store(false, Ordering::Release);
        let _ = l.socket.shutdown(std::net::Shutdown::Write);
    }
    let deadline = Instant::now() + LEAVE_GRACE;
    while links.iter().any(|l| !l.ended.load(Ordering::Acquire)) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(1));
    }
    for l in links {
        let _ = l.socket.shutdown(std::net::Shutdown::Both);
    }
}

// ---------------------------------------------------------------------------------------
// Requests.

/// A scatter that could not go to its pool, run once the role's lock is let go.
type Deferred = Box<dyn FnOnce() + std::marker::Send>;

/// Carries out what the machine asks, in order, under the role's lock (every step is
/// non-blocking); returns the scatters to run after the lock is let go.
fn run(inner: &Arc<Inner>, state: &mut State) -> Vec<Deferred> {
    let mut deferred = Vec::new();
    while let Some(action) = state.machine.poll_action() {
        match action {
            Action::Send { link, message } => {
                let Some(l) = state.by_id.get(&link) else {
                    continue;
                };
                if l.outbox.send(message).is_err() {
                    l.alive.store(false, Ordering::Release);
                    let why = "is not connected (its writer ended)";
                    state.machine.handle_link_lost(Instant::now(), link, why);
                }
            }
            Action::Scatter { link, completion } => match state.by_id.get(&link) {
                Some(l) => {
                    if let Some(job) = submit_scatter(inner, Arc::clone(l), completion) {
                        deferred.push(job);
                    }
                }
                None => state.machine.handle_scattered(
                    Instant::now(),
                    link,
                    completion,
                    Err((FailureKind::Peer, "its writer's link is gone".into())),
                ),
            },
            Action::DropLink { link } => {
                // Its reader ends now (the machine hears of it as a lost link), and the
                // prefill rank sees the connection close, so it stops writing to this rank.
                if let Some(l) = state.by_id.get(&link) {
                    l.alive.store(false, Ordering::Release);
                    let _ = l.socket.shutdown(std::net::Shutdown::Both);
                }
            }
            Action::Ended {
                request,
                outcome,
                clean,
            } => {
                // Its bounce region goes back, or — when a writer may still write into it
                // (it did not answer with its last piece) — stays out of use.
                let extra = state.extras.remove(&request);
                if let (Some(b), Some(arena)) = (extra.and_then(|e| e.bounce), &inner.arena) {
                    if clean {
                        arena.release(b.region);
                    } else {
                        arena.quarantine(b.region);
                    }
                }
                if !clean {
                    tracing::debug!(
                        request,
                        "ended with a writer that may still write: its bounce region is kept \
                         out of use"
                    );
                }
                inner.events.push(Event::ended(request, outcome));
            }
        }
    }
    deferred
}

/// Calls `f` on the role's state under its lock, carries out the machine's actions, lets
/// the lock go and runs any scatter that could not go to its pool.
#[track_caller]
fn with_machine<R>(inner: &Arc<Inner>, f: impl FnOnce(&mut State, Instant) -> R) -> R {
    let mut state = lock(&inner.decode);
    let r = f(&mut state, Instant::now());
    let deferred = run(inner, &mut state);
    drop(state);
    for job in deferred {
        job();
    }
    r
}

pub(crate) fn expect(inner: &Arc<Inner>, e: Expect) -> Result<(), CallError> {
    let id = e.request;
    let invalid = |reason: String| CallError::Invalid {
        request: id,
        reason,
    };
    if e.prompt_len == 0 {
        return Err(invalid("an empty prompt".into()));
    }
    kvferry_plan::check_slot_tables(&inner.info, &e.tables, &e.excluded_views, e.prompt_len)
        .map_err(invalid)?;
    let tpb = u64::from(inner.info.page_table.tokens_per_block.max(1));
    if let Some(p) = e.cached_prefix {
        if p > e.prompt_len || p % tpb != 0 {
            return Err(invalid(format!(
                "cached prefix {p} is not a block boundary ({tpb} tokens) inside the {}-token \
                 prompt",
                e.prompt_len
            )));
        }
    }
    if e.peer.is_empty() {
        return Err(invalid("no peer instance named".into()));
    }
    let call = ExpectCall {
        request: id,
        peer: e.peer.clone(),
        prompt_len: e.prompt_len,
        cached_prefix: e.cached_prefix,
        tables: e.tables.clone(),
        excluded_views: e.excluded_views.clone(),
    };
    with_machine(inner, |state, now| {
        state
            .machine
            .expect(now, call)
            .map_err(|()| CallError::Duplicate { request: id })?;
        let extra = Extra {
            expect: Arc::new(e.clone()),
            bounce: None,
        };
        state.extras.insert(id, extra);
        Ok(())
    })?;
    let worker = Arc::clone(inner);
    if inner
        .dispatch
        .run(Box::new(move || dispatch(&worker, e)))
        .is_err()
    {
        let mut state = lock(&inner.decode);
        state.machine.forget(id);
        state.extras.remove(&id);
        return Err(CallError::Stopped);
    }
    Ok(())
}

/// Sends `Hold` for `requests` to every rank of `peer` reached through `endpoints` (or, when
/// none are given, the endpoints of its ranks on file), on the dispatch pool.
pub(crate) fn hold(
    inner: &Arc<Inner>,
    peer: String,
    endpoints: Vec<String>,
    requests: Vec<u64>,
) -> Result<(), CallError> {
    if requests.is_empty() {
        return Ok(());
    }
    let worker = Arc::clone(inner);
    let job = move || {
        let endpoints = if endpoints.is_empty() {
            lock(&worker.decode)
                .directory
                .get(&peer)
                .map(|ranks| ranks.values().filter_map(|m| m.endpoint.clone()).collect())
                .unwrap_or_default()
        } else {
            endpoints
        };
        for endpoint in &endpoints {
            match link_to(&worker, endpoint) {
                Ok(link) if link.identity.instance == peer => {
                    for &request in &requests {
                        let _ = link.outbox.send(AgentMessage::Hold { request });
                    }
                }
                Ok(link) => tracing::warn!(
                    %peer, %endpoint, found = %link.identity,
                    "holding requests: the endpoint is another instance's"
                ),
                Err(NoLink {
                    kind,
                    detail: reason,
                    ..
                }) => tracing::warn!(
                    %peer, %endpoint, %kind, %reason,
                    "holding requests: cannot reach the rank"
                ),
            }
        }
    };
    inner
        .dispatch
        .run(Box::new(job))
        .map_err(|_| CallError::Stopped)
}

fn dispatch(inner: &Arc<Inner>, e: Expect) {
    let id = e.request;
    let _span = tracing::debug_span!("expect", request = id, peer = %e.peer).entered();
    let writers = match link_writers(inner, &e) {
        Ok(writers) => writers,
        Err((peer, kind, detail)) => {
            // No writer was asked: nothing can land, the request may end at once.
            with_machine(inner, |state, now| {
                state
                    .machine
                    .handle_link_failed(now, id, peer, kind, detail)
            });
            return;
        }
    };
    let offer = offer_region(inner, &e, &writers);
    // The claims go out below: this rank's worker is awake when their bytes arrive.
    inner.thread.keep_awake();
    let linked = with_machine(inner, |state, now| {
        let mut ids = BTreeMap::new();
        let mut gone = Vec::new();
        for (&c, link) in &writers {
            state
                .by_id
                .entry(link.id)
                .or_insert_with(|| Arc::clone(link));
            state.machine.handle_link_up(link.id, link.name());
            if !link.alive.load(Ordering::Acquire) {
                gone.push(link.id);
            }
            ids.insert(c, link.id);
        }
        let bounce = offer.map(|(writer, region)| {
            let offer = BounceOffer {
                offset: region.offset,
                len: region.len,
            };
            (writer, region, offer)
        });
        // Even a request that ended before it was asked for: its writers hear of the
        // cancel (a send they hold for it ends now, not at its lease), and it ends once
        // they answered, so no late answer meets a reused id.
        let linked =
            state
                .machine
                .handle_linked(now, id, ids, bounce.as_ref().map(|(w, _, o)| (*w, *o)));
        if let Some((writer, region, _)) = bounce {
            match state.extras.get_mut(&id) {
                Some(extra) if linked.offer_taken => {
                    extra.bounce = Some(Offered {
                        region,
                        writer,
                        cursor: 0,
                    });
                }
                _ => {
                    if let Some(arena) = &inner.arena {
                        arena.release(region);
                    }
                }
            }
        }
        // A link that ended before this request listed it: its reader's end missed it.
        for link in gone {
            state
                .machine
                .handle_link_lost(now, link, "ended before it was used");
        }
        linked
    });
    if !linked.claimed {
        return;
    }
    // While the writers write: what each must write, by this rank's own plan.
    let asked: Vec<u32> = writers.keys().copied().collect();
    let (expected, overlap) = expected_bytes(inner, &e, &asked);
    with_machine(inner, |state, now| {
        state.machine.handle_expected(now, id, expected, overlap)
    });
}

fn completion(inner: &Arc<Inner>, link: &Arc<Link>, c: Completion) {
    with_machine(inner, |state, now| {
        state.machine.handle_completion(now, link.id, c)
    });
}

/// Scatters (or checks) `c` on the scatter pool; the machine holds the request's later
/// completions meanwhile. Returns the job when there is no pool to take it (no arena here,
/// or the agent is stopping): it runs once the lock is let go, where it fails for want of an
/// offered region or finishes the request.
fn submit_scatter(inner: &Arc<Inner>, link: Arc<Link>, c: Completion) -> Option<Deferred> {
    let worker = Arc::clone(inner);
    let job: Deferred = Box::new(move || {
        let outcome = check_piece(&worker, &link, &c);
        if let Err((kind, reason)) = &outcome {
            tracing::warn!(request = c.request, peer = %link.name(), %kind, %reason, "piece refused");
        }
        with_machine(&worker, |state, now| {
            state.machine.handle_scattered(now, link.id, c, outcome)
        });
    });
    match inner.scatter.as_ref() {
        Some(pool) => pool.run(job).err(),
        None => Some(job),
    }
}

pub(crate) fn cancel(inner: &Arc<Inner>, id: u64) -> Result<(), CallError> {
    with_machine(inner, |state, now| state.machine.cancel(now, id))
        .map_err(|()| CallError::Unknown { request: id })
}

/// The reaper's turn: the machine sees the time (and how long this rank's worker has been
/// quiet, for requests waiting out late writes).
pub(crate) fn reap(inner: &Arc<Inner>) {
    let due = lock(&inner.decode)
        .machine
        .poll_timeout()
        .is_some_and(|t| t <= Instant::now());
    if due {
        let quiet = inner.thread.quiet_for();
        with_machine(inner, |state, now| state.machine.handle_timeout(now, quiet));
    }
}
type Failure = (Option<String>, FailureKind, String);
/// The prefill ranks of `any`'s instance that write this rank for their DP group `dp`: the
/// planner's `targets`, asked the first time and then kept per (prefill rank, DP group)
/// until that rank restarts.
fn writer_targets(inner: &Inner, any: &AgentMetadata, dp: u32) -> Result<Arc<[u32]>, Failure> {
    let key = (any.identity(), dp);
    if let Some(known) = lock(&inner.decode).writer_targets.get(&key) {
        return Ok(Arc::clone(known));
    }
    let targets: Arc<[u32]> = inner
        .ask_targets(&any.rank.info, dp)
        .map_err(|reason| (None, FailureKind::Planner, reason))?
        .into();
    lock(&inner.decode)
        .writer_targets
        .insert(key, Arc::clone(&targets));
    Ok(targets)
}
fn link_writers(inner: &Arc<Inner>, e: &Expect) -> Result<BTreeMap<u32, Arc<Link>>, Failure> {
    // Ranks reachable only through the endpoints given: fetch them.
    let known_endpoints: Vec<String> = {
        let state = lock(&inner.decode);
        state
            .directory
            .get(&e.peer)
            .map(|ranks| ranks.values().filter_map(|m| m.endpoint.clone()).collect())
            .unwrap_or_default()
    };
    let mut last_error = None;
    for endpoint in e
        .endpoints
        .iter()
        .filter(|ep| !known_endpoints.contains(ep))
    {
        match link_to(inner, endpoint) {
            Ok(_) => {}
            // The engine named an endpoint whose rank claims a live rank's identity: the
            // request does not go on as if it had not.
            Err(no) if no.claim => return Err((Some(endpoint.clone()), no.kind, no.detail)),
            Err(no) => last_error = Some((Some(endpoint.clone()), no.kind, no.detail)),
        }
    }
    let any = {
        let state = lock(&inner.decode);
        state
            .directory
            .get(&e.peer)
            .and_then(|ranks| ranks.values().next().cloned())
    };
    let Some(any) = any else {
        return Err(last_error.unwrap_or((
            None,
            FailureKind::Peer,
            format!(
                "no rank of prefill instance {} is known: pass its endpoints or add its \
                 metadata",
                e.peer
            ),
        )));
    };
    let targets = writer_targets(inner, &any, e.ctx_dp_rank)?;
    let mut writers = BTreeMap::new();
    for &c in targets.iter() {
        let existing = {
            let state = lock(&inner.decode);
            let link = state
                .links
                .get(&(e.peer.clone(), c))
                .filter(|l| l.alive.load(Ordering::Acquire))
                .cloned();
            let endpoint = state
                .directory
                .get(&e.peer)
                .and_then(|r| r.get(&c))
                .map(|m| (m.endpoint.clone(), m.rank.info.dp_rank));
            (link, endpoint)
        };
        let link = match existing {
            (Some(link), _) => link,
            (None, Some((Some(endpoint), _))) => link_to(inner, &endpoint)
                .map_err(|no| (Some(endpoint.clone()), no.kind, no.detail))?,
            (None, _) => {
                return Err((
                    None,
                    FailureKind::Peer,
                    format!(
                        "prefill instance {} rank {c} writes this rank, but neither its \
                         metadata nor its endpoint is known",
                        e.peer
                    ),
                ));
            }
        };
        writers.insert(c, link);
    }
    Ok(writers)
}
/// Scatters one bounced piece: plans it here as its writer's planner would (stand-in
/// sources, this rank's real tables, the tokens the completion names), checks that the
/// packed image the writer put is as long as that plan and lies, after the previous piece,
/// inside the offered region, then copies it into the slots the plan names. Returns the
/// runs it wrote (ascending), or why the piece is refused (nothing was copied then).
fn scatter_piece(
    inner: &Arc<Inner>,
    link: &Link,
    c: &Completion,
) -> Result<Vec<(u64, u64)>, String> {
    let id = c.request;
    let Some(piece) = c.bounce else {
        return Err("not a bounced piece".into());
    };
    let (expect, offered) = {
        let state = lock(&inner.decode);
        let Some(req) = state.extras.get(&id) else {
            return Err(format!("request {id} is not held here"));
        };
        let offered = req
            .bounce
            .as_ref()
            .filter(|b| b.writer == c.sender_rank)
            .map(|b| (b.region, b.cursor));
        (Arc::clone(&req.expect), offered)
    };
    let (Some(arena), Some((region, cursor))) = (inner.arena.as_ref(), offered) else {
        return Err(format!(
            "{} bounced piece {} of request {id}, but no bounce region was offered to it",
            link.name(),
            c.piece
        ));
    };
    let tokens = piece.tokens;
    let runs = writer_runs(inner, link, &expect, c, tokens, "bounced")?;
    let total: u64 = runs.iter().map(|&(_, n)| n).sum();
    if total != c.bytes {
        return Err(format!(
            "{} bounced {} bytes for tokens {}..{}, but this rank's own plan of them says {total}",
            link.name(),
            c.bytes,
            tokens.start,
            tokens.end
        ));
    }
    let fits = piece.offset >= cursor
        && piece
            .offset
            .checked_add(total)
            .is_some_and(|end| end <= region.len);
    if !fits {
        return Err(format!(
            "{} bounced {total} bytes at {} of a {}-byte region whose next free byte is {cursor}",
            link.name(),
            piece.offset,
            region.len
        ));
    }
    if let Some(b) = lock(&inner.decode)
        .extras
        .get_mut(&id)
        .and_then(|r| r.bounce.as_mut())
    {
        b.cursor = piece.offset + total;
    }
    // SAFETY: `[region.offset + piece.offset, + total)` lies inside the arena (the region is
    // inside it, and the image inside the region: checked above); every run is a
    // destination of this rank's own validated plan, so inside its pools, which are memory
    // of this process of the arena's kind (an arena is made only for pools all of one kind,
    // on their device) that kvferry holds no reference into, and which the request's slots
    // may be written in until its terminal event — which waits for this scatter.
    unsafe { arena.scatter(region.offset + piece.offset, &runs) }.map_err(|e| {
        format!(
            "scattering the {total} bytes {} bounced for tokens {}..{} failed: {e}",
            link.name(),
            tokens.start,
            tokens.end
        )
    })?;
    Ok(runs)
}
/// The destination runs (ascending, merged) of `c`'s writer's piece for `tokens`, by this
/// rank's own plan of it ([`plan_as_writer`]); `what` the writer did with the tokens, for the
/// refusal of a range outside the prompt.
fn writer_runs(
    inner: &Arc<Inner>,
    link: &Link,
    expect: &Expect,
    c: &Completion,
    tokens: TokenRange,
    what: &str,
) -> Result<Vec<(u64, u64)>, String> {
    if tokens.start >= tokens.end || tokens.end > expect.prompt_len {
        return Err(format!(
            "{} {what} tokens {}..{} of a {}-token prompt",
            link.name(),
            tokens.start,
            tokens.end,
            expect.prompt_len
        ));
    }
    let pair = kvferry_planner_abi::PairRequest {
        token_range: tokens,
        prompt_len: expect.prompt_len,
        dst_start_token: match expect.cached_prefix {
            Some(t) => kvferry_planner_abi::ffi::ROption::RSome(t),
            None => kvferry_planner_abi::ffi::ROption::RNone,
        },
        // Recurrent state rides on pieces that reach the prompt's end, as the writer planned.
        is_last: tokens.end == expect.prompt_len,
    };
    let plan = plan_as_writer(inner, expect, c.sender_rank, pair, c.views.as_deref())?;
    Ok(kvferry_plan::bounce::scatter_runs(&plan))
}
/// Takes a piece in before the tracker: scatters it if it was bounced, then checks its
/// digest if the request asked for one. Returns the nanoseconds it took, or why the piece is
/// refused and as what.
fn check_piece(
    inner: &Arc<Inner>,
    link: &Link,
    c: &Completion,
) -> Result<u64, (FailureKind, String)> {
    let started = Instant::now();
    let runs = match c.bounce {
        Some(_) => Some(scatter_piece(inner, link, c).map_err(|r| (FailureKind::Protocol, r))?),
        None => None,
    };
    if let Some(algorithm) = inner.config.integrity {
        check_digest(inner, link, c, algorithm, runs)?;
    }
    Ok(nanos(started.elapsed()))
}
/// Checks a piece's digest ([`kvferry_protocol::Integrity`]) against the bytes in this rank's
/// slots, by this rank's own plan of the piece (`runs`, when the scatter made it already).
fn check_digest(
    inner: &Arc<Inner>,
    link: &Link,
    c: &Completion,
    algorithm: Integrity,
    runs: Option<Vec<(u64, u64)>>,
) -> Result<(), (FailureKind, String)> {
    let protocol = |reason: String| (FailureKind::Protocol, reason);
    let Some(digest) = c.digest else {
        return Err(protocol(format!(
            "{} reported piece {} of request {} without the {algorithm} digest this rank asked \
             for",
            link.name(),
            c.piece,
            c.request
        )));
    };
    let tokens = digest.tokens;
    let runs = match runs {
        Some(runs) => {
            if c.bounce.is_some_and(|b| b.tokens != tokens) {
                return Err(protocol(format!(
                    "{} bounced tokens {}..{} but its digest covers {}..{}",
                    link.name(),
                    c.bounce.map_or(0, |b| b.tokens.start),
                    c.bounce.map_or(0, |b| b.tokens.end),
                    tokens.start,
                    tokens.end
                )));
            }
            runs
        }
        None => {
            let expect = match lock(&inner.decode).extras.get(&c.request) {
                Some(req) => Arc::clone(&req.expect),
                None => return Err(protocol(format!("request {} is not held here", c.request))),
            };
            writer_runs(inner, link, &expect, c, tokens, "digested").map_err(protocol)?
        }
    };
    let total: u64 = runs.iter().map(|&(_, n)| n).sum();
    if c.bounce.is_none() && total != c.bytes {
        return Err(protocol(format!(
            "{} wrote {} bytes for tokens {}..{}, but this rank's own plan of them says {total}",
            link.name(),
            c.bytes,
            tokens.start,
            tokens.end
        )));
    }
    // SAFETY: every run is a destination of this rank's own validated plan of the piece, so
    // inside its pools: host memory (an agent with integrity has no device pools, checked at
    // start) of this process, live for the agent's life. The writer flushed before it
    // reported, so the piece's bytes are in place; its completions are taken in one at a
    // time (a scatter of this piece was this very job), and other writers of the request
    // write other bytes (their plans are checked not to overlap).
    let landed = unsafe { crate::integrity::digest_runs(algorithm, runs.iter().copied()) };
    if landed != digest.value {
        return Err((
            FailureKind::Integrity,
            format!(
                "{} piece {} (tokens {}..{}): the {algorithm} digest of the {total} bytes that \
                 landed here is {landed:#018x}, the writer's is {:#018x}",
                link.name(),
                c.piece,
                tokens.start,
                tokens.end,
                digest.value
            ),
        ));
    }
    Ok(())
}
/// The region to offer a request's writer, if it is bounced: one writer (multi-writer
/// bounce is off, `transfer-semantics.md` §9.1), the mode and the gates of
/// [`kvferry_plan::bounce::reserve`] allow it, and the arena has room (else logged).
fn offer_region(
    inner: &Arc<Inner>,
    e: &Expect,
    writers: &BTreeMap<u32, Arc<Link>>,
) -> Option<(u32, Region)> {
    let arena = inner.arena.as_ref()?;
    let config = &inner.config.bounce;
    if !config.may_bounce_over(&inner.config.transport) {
        return None;
    }
    let (&writer, _) = writers.iter().next()?;
    let sender = {
        let state = lock(&inner.decode);
        state
            .directory
            .get(&e.peer)
            .and_then(|r| r.get(&writer))
            .map(|m| m.rank.info.clone())?
    };
    let planner = Arc::clone(&inner.planner);
    let (me, tables) = (inner.info.clone(), e.tables.clone());
    let extra = match inner
        .planning
        .call(move || planner.receiver_payload_bytes(&me, &sender, &tables))
    {
        Ok(Ok(n)) => n,
        _ => {
            tracing::info!(
                request = e.request,
                "no recurrent-state size from the planner: not bounced"
            );
            return None;
        }
    };
    let limits = config.limits(arena.capacity());
    let writer_count = u32::try_from(writers.len()).unwrap_or(u32::MAX);
    let reservation = match kvferry_plan::bounce::reserve(
        &inner.info.page_table,
        &e.tables,
        extra,
        writer_count,
        writer_count == 1,
        &limits,
    ) {
        Ok(r) => r,
        Err(why) => {
            tracing::debug!(request = e.request, reason = %why, "not bounced");
            return None;
        }
    };
    match arena.reserve(reservation.total) {
        Some(region) => Some((writer, region)),
        None => {
            tracing::info!(
                request = e.request,
                bytes = reservation.total,
                arena = arena.capacity(),
                "the bounce arena has no free region this large now: not bounced"
            );
            None
        }
    }
}
/// What each writer in `asked` must write for `e`, by this rank's own plan: the writer's
/// planner (instantiated here for its rank) pairs a stand-in of its slots with this rank's
/// real ones for the whole prompt. A total does not depend on where the writer keeps its
/// blocks or how it chunks the prompt (chunks are block-aligned and partition it). A writer
/// whose plan cannot be made here is left unchecked, with a warning.
///
/// Also whether two writers' plans write the same bytes of this rank's slots (a planner bug
/// no writer's own checks or byte count can see): the reason, when they do.
fn expected_bytes(
    inner: &Arc<Inner>,
    e: &Expect,
    asked: &[u32],
) -> (BTreeMap<u32, u64>, Option<String>) {
    let mut out = BTreeMap::new();
    let mut plans: Vec<(u32, kvferry_plan::ValidatedPlan)> = Vec::new();
    let whole = kvferry_planner_abi::PairRequest {
        token_range: TokenRange {
            start: 0,
            end: e.prompt_len,
        },
        prompt_len: e.prompt_len,
        dst_start_token: match e.cached_prefix {
            Some(t) => kvferry_planner_abi::ffi::ROption::RSome(t),
            None => kvferry_planner_abi::ffi::ROption::RNone,
        },
        is_last: true,
    };
    for &c in asked {
        match plan_as_writer(inner, e, c, whole, None) {
            Ok(plan) => {
                out.insert(c, plan.total_bytes());
                plans.push((c, plan));
            }
            Err(reason) => tracing::warn!(
                request = e.request,
                ctx_rank = c,
                %reason,
                "cannot plan the request here; its writer's byte count goes unchecked"
            ),
        }
    }
    let views: Vec<&kvferry_plan::ValidatedPlan> = plans.iter().map(|(_, p)| p).collect();
    let overlap = kvferry_plan::overlapping_writers(&views).map(|o| {
        let (a, b) = (plans[o.first].0, plans[o.second].0);
        let name = |c: u32| format!("{} rank {c}", e.peer);
        format!(
            "the planner has {} and {} both write {:#x} +{} of this rank's slots, so one \
             overwrites the other and some bytes stay unwritten: refusing the request",
            name(a),
            name(b),
            o.address,
            o.len
        )
    });
    (out, overlap)
}
/// This rank's own plan of `piece` as prefill rank `c` of `e.peer` makes it: that rank's
/// planner (instantiated here for its rank once, then kept while that start of the rank is
/// on file) pairs stand-in source slots ([`kvferry_plan::bounce::stand_in_tables`]) with
/// this rank's real ones, under the planner deadline. `views`: the writer's views the piece
/// carries, when only some (a layer-wise piece); refused unless they are that rank's and
/// distinct.
fn plan_as_writer(
    inner: &Arc<Inner>,
    e: &Expect,
    c: u32,
    piece: kvferry_planner_abi::PairRequest,
    views: Option<&[ViewId]>,
) -> Result<kvferry_plan::ValidatedPlan, String> {
    let (sender, identity, known) = {
        let state = lock(&inner.decode);
        let Some(m) = state.directory.get(&e.peer).and_then(|r| r.get(&c)) else {
            return Err(format!("{} rank {c} is not on file here", e.peer));
        };
        let identity = m.identity();
        let known = state
            .writer_planners
            .get(&identity)
            .map(|p| Arc::clone(&p.0));
        (m.rank.info.clone(), identity, known)
    };
    let writer_excluded: Vec<ViewId> = match views {
        None => Vec::new(),
        Some(views) => kvferry_plan::excluded_views(&sender, views)
            .map_err(|r| format!("{} rank {c} names a piece's views wrongly: {r}", e.peer))?,
    };
    let bound = inner.bound.clone();
    let me = inner.info.clone();
    let (tables, excluded, prompt) = (e.tables.clone(), e.excluded_views.clone(), e.prompt_len);
    let planned = inner.planning.call(move || -> Result<_, String> {
        let planner = match known {
            Some(p) => p,
            None => bound.instantiate(&sender).map_err(|e| error_chain(&e))?,
        };
        let stand_in = kvferry_plan::bounce::stand_in_tables(&sender.page_table, prompt);
        let plan = kvferry_plan::plan_transfer(
            planner.as_ref(),
            kvferry_plan::RequestSide {
                info: &sender,
                slot_tables: &stand_in,
                excluded: &writer_excluded,
            },
            kvferry_plan::RequestSide {
                info: &me,
                slot_tables: &tables,
                excluded: &excluded,
            },
            &piece,
        )
        .map_err(|e| error_chain(&e))?;
        Ok((plan, planner))
    });
    match planned {
        Ok(Ok((plan, planner))) => {
            let mut state = lock(&inner.decode);
            // Only for a start of that rank still on file.
            let current = state
                .directory
                .get(&identity.instance)
                .and_then(|r| r.get(&identity.rank))
                .is_some_and(|m| m.epoch == identity.epoch);
            if current {
                state
                    .writer_planners
                    .entry(identity)
                    .or_insert(WriterPlanner(planner));
            }
            Ok(plan)
        }
        Ok(Err(reason)) => Err(reason),
        Err(h) => Err(format!(
            "the planner did not plan it here within {} ms",
            h.deadline.as_millis()
        )),
    }
}
