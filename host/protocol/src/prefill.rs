//! A prefill rank's requests as a state machine, sans I/O: which sends were made, which
//! decode ranks claimed them, what is planned and written, and when each request ends.
//!
//! The machine knows no socket, thread or clock. Its driver (the transfer agent) feeds it
//! what happened — the engine's `send` and `cancel`, a decode rank's claim, cancel or hold,
//! a plan made, a piece written, a peer lost, the time — through the `handle_*` calls, each
//! with the time it happened, and carries out what it asks through [`poll_action`]: send a
//! message to a decode rank, plan chunks for a claim, report a request's end. When nothing
//! happens, [`poll_timeout`] says when the machine next needs [`handle_timeout`] (a lease, a
//! timeout, a stashed claim's expiry). quinn-proto's `Connection` is the model.
//!
//! ```text
//!  engine: send ──▶ ┌────────────────────┐ ──▶ Send{peer, Completion | refusal}
//!  peer: claim, ──▶ │   PrefillMachine   │ ──▶ Plan{request, rank, chunks}
//!  cancel, hold     │ requests · claims  │ ──▶ Ended{request, Sent | Cancelled | Failed}
//!  driver: planned, │ stash · tombstones │
//!  written, lost ──▶└────────────────────┘ ◀── handle_timeout(now) at poll_timeout()
//! ```
//!
//! A request becomes writable for a decode rank once both its first send and that rank's
//! `RequestData` (its claim) arrived, in either order: a claim that comes first waits in a
//! bounded [stash](crate::stash). The first claim fixes the request's owner (the claiming
//! instance, or the send's `to`) and the ranks this rank writes (the planner's `targets` for
//! the claimer's DP group, known per peer). Each claim's chunks are planned in order, one
//! planning task at a time, and its pieces queued in order: a claim stays *planning* until
//! the driver says the planned pieces are queued ([`handle_queued`]), so a later chunk's
//! pieces can never overtake them. The request is `Sent` once every expected receiver has
//! its last piece; a failure, a cancel (either side's), the lease or the timeout end it once
//! no job reads its slots, answering every claim still open with a failed (or cancelled)
//! last piece. Exactly one [`RequestOutcome`] per request, and none while a job may still
//! read its slots.
//!
//! [`poll_action`]: PrefillMachine::poll_action
//! [`poll_timeout`]: PrefillMachine::poll_timeout
//! [`handle_timeout`]: PrefillMachine::handle_timeout
//! [`handle_queued`]: PrefillMachine::handle_queued

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_planner_abi::ffi::ROption;
use kvferry_planner_abi::{PairRequest, TokenRange, ViewId};

use crate::outcome::{FailureKind, RequestOutcome, Stages};
use crate::stash::{Stash, request_data_bytes};
use crate::{AgentMessage, BouncedPiece, Completion, CompletionStatus, PieceDigest, RequestData};

/// How long a claim for a request not sent yet is kept at most (the lease bounds it too).
pub const STASH_TTL: Duration = Duration::from_secs(120);
/// How far holds may push an unclaimed request's lease: this many leases after its first
/// send, whatever its receiver says.
pub const MAX_HELD_LEASES: u32 = 10;
/// The longest cancel reason a tombstone keeps (the rest is cut): the bytes come from a peer.
const TOMBSTONE_REASON: usize = 256;

/// A decode rank's connection, as the driver numbers it (never reused).
pub type PeerId = u64;

/// What the machine is told of a vetted decode rank when it connects.
#[derive(Clone, Debug)]
pub struct Peer {
    /// Its instance.
    pub instance: String,
    /// Its rank in that instance.
    pub rank: u32,
    /// How messages and events name it (`instance rank N`).
    pub name: String,
    /// The ranks of its instance this rank writes for its DP group (the planner's
    /// `targets`, asked once for the connection's life), or why they are not known.
    pub targets: Result<BTreeSet<u32>, String>,
}

/// The machine's settings.
#[derive(Clone, Debug)]
pub struct PrefillConfig {
    /// This rank's rank in its instance (the sender rank of every completion).
    pub rank: u32,
    /// How this rank names itself in a cancel its receivers hear.
    pub me: String,
    /// How long a send waits for its first claim (holds may extend it).
    pub lease: Duration,
    /// How long a request may take from its first claim.
    pub timeout: Duration,
    /// Bytes of claims kept for requests not sent yet (a sixteenth of it each for the
    /// cancels and ends remembered).
    pub max_stashed: usize,
}

/// The engine's `send` of one chunk (or one layer-wise part of a chunk), after the checks
/// that need no state (slot tables inside the pools, tokens inside the prompt, the views
/// named this rank's).
#[derive(Clone, Debug)]
pub struct SendCall<T> {
    /// The request.
    pub request: u64,
    /// The decode instance it is for, if the engine knows.
    pub to: Option<String>,
    /// The prompt's length in tokens.
    pub prompt_len: u64,
    /// The tokens this chunk covers.
    pub tokens: TokenRange,
    /// Whether the engine says this is the request's last send.
    pub is_last: bool,
    /// The views it carries, when only some (a layer-wise send).
    pub carried: Option<BTreeSet<ViewId>>,
    /// The driver's part of the chunk (its slot tables), handed back in [`Action::Plan`].
    pub tables: T,
}

/// Why a send was not taken (nothing of it was kept).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SendRefused {
    /// The request ended here, or was cancelled or failed.
    Unknown,
    /// The id is in use: a request of that id took its last send and has not ended, and this
    /// send starts a request again (at token 0).
    Duplicate,
    /// It does not follow the request's earlier sends; why.
    Invalid(String),
}

/// One piece of a request as its send gave it: planned for every claim, in order.
#[derive(Clone, Debug)]
pub struct Chunk<T> {
    /// The driver's part (its slot tables).
    pub tables: T,
    /// For the planner: `is_last` when the tokens reach the prompt's end (recurrent state
    /// rides on every view of such a piece).
    pub piece: PairRequest,
    /// The views it carries when only some (a layer-wise send), else `None`.
    pub views: Option<Arc<Vec<ViewId>>>,
    /// The rest of this rank's views, which its plans leave out.
    pub excluded: Arc<Vec<ViewId>>,
    /// The request's last piece: its completion ends the pair.
    pub last: bool,
}

/// Chunks to plan for one claim, in piece order ([`Action::Plan`]); the driver answers with
/// [`PrefillMachine::handle_planned`] (or [`PrefillMachine::handle_plan_hung`]).
#[derive(Clone, Debug)]
pub struct PlanTask<T> {
    /// The request.
    pub request: u64,
    /// The claiming decode rank.
    pub rank: u32,
    /// Its connection.
    pub peer: PeerId,
    /// Its claim.
    pub data: RequestData,
    /// (piece index, chunk), from the claim's first unplanned piece.
    pub chunks: Vec<(u32, Chunk<T>)>,
    /// Bytes of the claim's offered bounce region that earlier pieces took.
    pub bounce_cursor: u64,
}

/// What the machine asks its driver to do, in order.
#[derive(Clone, Debug)]
pub enum Action<T> {
    /// Send `message` to the decode rank on connection `peer` (in this order with the
    /// other sends to it: completions of a pair go out in piece order).
    Send {
        /// The connection.
        peer: PeerId,
        /// The message.
        message: AgentMessage,
    },
    /// Plan these chunks (on the planner pool).
    Plan(PlanTask<T>),
    /// The request ended: its one terminal outcome. Nothing of it is planned or written
    /// after this, and no job of it is still queued.
    Ended {
        /// The request.
        request: u64,
        /// How: `Sent`, `Cancelled` or `Failed`.
        outcome: RequestOutcome,
    },
}

/// What became of a claim ([`PrefillMachine::handle_claim`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimFate {
    /// Bound to its request; its chunks are being planned.
    Bound,
    /// Its request is not sent here yet: it waits for the send (at most the lease).
    Stashed,
    /// Refused, with a failed first piece that says why (also this reason).
    Refused(String),
}

/// What a planning task made of a claim's chunks ([`PrefillMachine::handle_planned`]).
#[derive(Clone, Copy, Debug)]
pub struct Planned {
    /// The next piece to plan (one past the last chunk of the task).
    pub through: u32,
    /// Pieces planned and to be queued (fewer than the task's chunks if one failed).
    pub pieces: usize,
    /// The bounce cursor after them.
    pub bounce_cursor: u64,
    /// Where the planning's time went.
    pub stages: Stages,
}

/// What a piece's write job reported ([`PrefillMachine::handle_written`]).
#[derive(Clone, Debug)]
pub struct Written {
    /// The piece.
    pub piece: u32,
    /// The request's last piece.
    pub is_last: bool,
    /// Bytes, fragments and puts written, or why the write failed.
    pub result: Result<WriteCounts, String>,
    /// Where it went in the receiver's bounce region, when it bounced.
    pub bounce: Option<BouncedPiece>,
    /// Its integrity digest, when the receiver asked for one.
    pub digest: Option<PieceDigest>,
    /// The views it carries, when only some.
    pub views: Option<Arc<Vec<ViewId>>>,
    /// Where its time went on the rank thread (when it was written).
    pub stages: Stages,
    /// Whether the peer's registration still stands: a registration that ended (peer lost,
    /// or given up for not draining) hears nothing more, so its receiver waits out the bytes
    /// the network may still hold.
    pub registered: bool,
}

/// What a piece's write moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteCounts {
    /// Bytes written.
    pub bytes: u64,
    /// Fragments written.
    pub fragments: u64,
    /// Puts issued.
    pub puts: u64,
}

#[derive(Debug)]
struct Stashed {
    peer: PeerId,
    data: RequestData,
}

/// A receiver's cancel of a request not sent here yet: the send that comes later ends at
/// once (as cancelled by that peer) instead of waiting for its lease.
#[derive(Debug)]
struct Tombstone {
    /// The decode instance that cancelled (only it, or the send's `to`, may end the send).
    instance: String,
    /// The cancelling rank's name, for the event.
    peer: String,
    reason: String,
}

impl Tombstone {
    fn bytes(&self) -> usize {
        64 + self.instance.len() + self.peer.len() + self.reason.len()
    }
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

#[derive(Debug)]
struct Claim {
    peer: PeerId,
    name: String,
    data: RequestData,
    /// Chunks handed to planning so far.
    planned: usize,
    /// A planning task for this claim is out, or its pieces are not queued yet.
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
    /// A piece failed while later pieces of it were still queued: nothing more of it is
    /// reported piece by piece; the failure goes out as its last piece once those jobs
    /// reported (they may still write into the receiver's slots until then).
    withheld: bool,
    /// When its `RequestData` was taken up (after the send, if it came first).
    arrived: Instant,
    /// Bytes of the offered bounce region that pieces have been given so far.
    bounce_cursor: u64,
    /// Where its time went so far (`control` is filled in when it ends).
    stages: Stages,
}

impl Claim {
    fn busy(&self) -> bool {
        self.jobs > 0 || self.planning
    }
}

#[derive(Debug)]
struct OutReq<T> {
    to: Option<String>,
    prompt_len: u64,
    chunks: Vec<Chunk<T>>,
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

impl<T> OutReq<T> {
    fn new(
        now: Instant,
        to: Option<String>,
        prompt_len: u64,
        chunk: Chunk<T>,
        unsent: BTreeSet<ViewId>,
    ) -> Self {
        Self {
            to,
            prompt_len,
            finished: chunk.last,
            chunks: vec![chunk],
            unsent,
            first_send: now,
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

    fn ending(&self) -> bool {
        self.cancelled || self.failure.is_some()
    }

    /// When the lease ends, while nothing claimed it.
    fn lease_end(&self, lease: Duration) -> Instant {
        self.held_until.unwrap_or(self.first_send + lease)
    }
}

/// A prefill rank's requests (see the module docs). `T` is the driver's part of each chunk
/// (its slot tables), handed back when the chunk is to be planned.
#[derive(Debug)]
pub struct PrefillMachine<T> {
    config: PrefillConfig,
    peers: HashMap<PeerId, Peer>,
    requests: HashMap<u64, OutReq<T>>,
    stash: Stash<Stashed>,
    /// Cancels of requests not sent yet, bounded like the stash and expired with it.
    tombstones: Stash<Tombstone>,
    /// Requests that ended here lately, so a claim that comes after the end is refused at
    /// once instead of waiting in the stash; bounded and expired like the tombstones.
    ended: Stash<Ended>,
    actions: VecDeque<Action<T>>,
}

impl<T: Clone> PrefillMachine<T> {
    /// A machine with no peers and no requests.
    pub fn new(config: PrefillConfig) -> Self {
        let max = config.max_stashed;
        Self {
            config,
            peers: HashMap::new(),
            requests: HashMap::new(),
            stash: Stash::new(max, STASH_TTL),
            tombstones: Stash::new(max / 16, STASH_TTL),
            ended: Stash::new(max / 16, STASH_TTL),
            actions: VecDeque::new(),
        }
    }

    /// Requests not ended yet.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether no request is open.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Whether request `id` is open here.
    pub fn contains(&self, id: u64) -> bool {
        self.requests.contains_key(&id)
    }

    /// Bytes of claims waiting for their send.
    pub fn stashed_bytes(&self) -> usize {
        self.stash.bytes()
    }

    /// The next thing to do, in order.
    pub fn poll_action(&mut self) -> Option<Action<T>> {
        self.actions.pop_front()
    }

    /// No handler gives anything a deadline sooner than this after the `now` it is called
    /// with (a lease, a claimed request's timeout, a stash or memory's expiry; a hold only
    /// moves a lease later): a driver whose timer sleeps at most this long past the
    /// [`poll_timeout`](Self::poll_timeout) it last read misses no deadline that a handler
    /// made in the meantime, without being woken for it. The simulation checks it.
    pub fn horizon(&self) -> Duration {
        self.config
            .lease
            .min(self.config.timeout)
            .min(self.stash_ttl())
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next due, if anything waits on the
    /// clock: an unclaimed send's lease, a claimed request's timeout, a stashed claim, a
    /// remembered cancel or end expiring.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let ttl = self.stash_ttl();
        let kept = [
            self.stash.oldest(),
            self.tombstones.oldest(),
            self.ended.oldest(),
        ]
        .into_iter()
        .flatten()
        .map(|at| at + ttl);
        let requests = self
            .requests
            .values()
            .filter(|r| !r.ending())
            .map(|r| match r.claimed_at {
                None => r.lease_end(self.config.lease),
                Some(at) => at + self.config.timeout,
            });
        kept.chain(requests).min()
    }

    fn stash_ttl(&self) -> Duration {
        self.config.lease.min(STASH_TTL)
    }

    /// A vetted decode rank connected on `id`.
    pub fn handle_connected(&mut self, id: PeerId, peer: Peer) {
        self.peers.insert(id, peer);
    }

    /// The engine sends a chunk of request `call.request`; `all` is every view of this
    /// rank's page table.
    pub fn handle_send(
        &mut self,
        now: Instant,
        call: SendCall<T>,
        all: &BTreeSet<ViewId>,
    ) -> Result<(), SendRefused> {
        let id = call.request;
        let stashed = match self.requests.get_mut(&id) {
            Some(req) => {
                if req.finished && !req.ending() && call.tokens.start == 0 {
                    return Err(SendRefused::Duplicate);
                }
                if req.finished || req.ending() {
                    return Err(SendRefused::Unknown);
                }
                let latest = req.chunks.last().map(|c| c.piece.token_range);
                let pending = match latest {
                    Some(t) if !req.unsent.is_empty() => {
                        if call.tokens != t || call.prompt_len != req.prompt_len {
                            return Err(SendRefused::Invalid(format!(
                                "tokens {}..{}: {} view(s) of tokens {}..{} are not sent yet \
                                 (a layer-wise send repeats its chunk's tokens until every view \
                                 went)",
                                call.tokens.start,
                                call.tokens.end,
                                req.unsent.len(),
                                t.start,
                                t.end
                            )));
                        }
                        req.unsent.clone()
                    }
                    _ => {
                        let end = latest.map_or(0, |t| t.end);
                        if call.prompt_len != req.prompt_len || call.tokens.start != end {
                            return Err(SendRefused::Invalid(format!(
                                "chunk {}..{} of a {}-token prompt does not follow {end} of {}",
                                call.tokens.start, call.tokens.end, call.prompt_len, req.prompt_len
                            )));
                        }
                        all.clone()
                    }
                };
                if call.to != req.to {
                    return Err(SendRefused::Invalid(
                        "a later chunk names another receiver".into(),
                    ));
                }
                let (chunk, unsent) =
                    next_chunk(all, &call, pending).map_err(SendRefused::Invalid)?;
                req.finished = chunk.last;
                req.chunks.push(chunk);
                req.unsent = unsent;
                Vec::new()
            }
            None => {
                if call.tokens.start != 0 {
                    return Err(SendRefused::Invalid(format!(
                        "the first chunk starts at token {}, not 0",
                        call.tokens.start
                    )));
                }
                let (chunk, unsent) =
                    next_chunk(all, &call, all.clone()).map_err(SendRefused::Invalid)?;
                // The id is sent again: claims are for this request now.
                let _ = self.ended.take(id);
                // A receiver that may claim it cancelled it already: it ends as cancelled by
                // that peer (its other ranks' stashed claims are answered as ended).
                let to = call.to.clone();
                let cancelled_by = self
                    .tombstones
                    .take(id)
                    .into_iter()
                    .find(|t| to.as_ref().is_none_or(|to| *to == t.instance));
                let mut req = OutReq::new(now, call.to, call.prompt_len, chunk, unsent);
                if let Some(t) = &cancelled_by {
                    let detail = format!(
                        "{} cancelled request {id} before it was sent here: {}",
                        t.peer, t.reason
                    );
                    req.owner = Some(t.instance.clone());
                    req.failure =
                        Some((Some(t.peer.clone()), FailureKind::CancelledByPeer, detail));
                }
                self.requests.insert(id, req);
                self.stash.take(id)
            }
        };
        for s in stashed {
            let _ = self.claim(now, s.peer, s.data);
        }
        self.settle(now, id);
        self.pump(id);
        Ok(())
    }

    /// The engine cancels request `id`; `Err(())` when it is not open here.
    #[allow(clippy::result_unit_err)]
    pub fn cancel(&mut self, now: Instant, id: u64) -> Result<(), ()> {
        let req = self.requests.get_mut(&id).ok_or(())?;
        if req.failure.is_none() {
            req.cancelled = true;
        }
        self.settle(now, id);
        Ok(())
    }

    /// Refuses a claim with a failed first piece.
    fn refuse(&mut self, peer: PeerId, data: &RequestData, reason: String) -> ClaimFate {
        let pair = (data.sender_rank, data.receiver_rank);
        self.send(peer, failed(data.request, pair, 0, reason.clone()));
        ClaimFate::Refused(reason)
    }

    fn send(&mut self, peer: PeerId, message: AgentMessage) {
        self.actions.push_back(Action::Send { peer, message });
    }

    /// A decode rank's claim, after the checks that need no request state (it names this
    /// rank and its own, its slot tables fit its pools, its bounce offer fits its arena, its
    /// tokens lie inside its prompt): bound to the request, or stashed until its send, or
    /// refused.
    pub fn handle_claim(&mut self, now: Instant, peer: PeerId, data: RequestData) -> ClaimFate {
        let Some(p) = self.peers.get(&peer) else {
            return ClaimFate::Refused("its connection is not registered here".into());
        };
        let request = data.request;
        if !self.requests.contains_key(&request) {
            let instance = p.instance.clone();
            let ended = self.ended.find(request, |e| {
                e.instance.as_ref().is_none_or(|i| *i == instance)
            });
            if let Some(e) = ended {
                let reason = format!("request {request} already ended here: {}", e.how);
                return self.refuse(peer, &data, reason);
            }
            // A claim after its own cancel (the id asked for again) supersedes the cancel.
            self.tombstones
                .retain_request(request, |t| t.instance != instance);
            let bytes = request_data_bytes(&data);
            if let Err(item) = self.stash.push(request, Stashed { peer, data }, bytes, now) {
                let limit = self.stash.limit();
                return self.refuse(
                    peer,
                    &item.data,
                    format!(
                        "request {request} is not sent here yet, and {limit} bytes of claims \
                         waiting for their send are held already"
                    ),
                );
            }
            return ClaimFate::Stashed;
        }
        self.claim(now, peer, data)
    }

    /// Binds a claim to a sent request (or refuses it), then plans what is due.
    fn claim(&mut self, now: Instant, peer: PeerId, data: RequestData) -> ClaimFate {
        let Some(p) = self.peers.get(&peer) else {
            return ClaimFate::Refused("its connection is not registered here".into());
        };
        let (instance, name, targets) = (p.instance.clone(), p.name.clone(), p.targets.clone());
        let id = data.request;
        let g = data.receiver_rank;
        if !self.requests.contains_key(&id) {
            // It ended while its stashed claims were being bound (an earlier one failed it):
            // each of the others hears so now, not at its own timeout.
            let how = self
                .ended
                .find(id, |_| true)
                .map_or_else(|| "it ended".to_string(), |e| e.how.clone());
            return self.refuse(
                peer,
                &data,
                format!("request {id} already ended here: {how}"),
            );
        }
        let req = self.requests.get_mut(&id).expect("checked");
        let refusal = if req.ending() {
            Some("the request has ended here".to_string())
        } else if !req.open_to(&instance) {
            Some(format!(
                "request {id} belongs to another decode instance; {instance} cannot claim it"
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
        };
        if let Some(reason) = refusal {
            return self.refuse(peer, &data, reason);
        }
        if req.expected.is_none() {
            match targets {
                Ok(t) => req.expected = Some(t),
                Err(reason) => {
                    let fate = self.refuse(peer, &data, reason.clone());
                    self.fail(now, id, Some(name), FailureKind::Planner, reason);
                    return fate;
                }
            }
        }
        if !req.expected.as_ref().is_some_and(|e| e.contains(&g)) {
            let reason = format!("this rank does not write rank {g} (or it claimed twice)");
            return self.refuse(peer, &data, reason);
        }
        req.owner.get_or_insert(instance);
        req.claimed_at.get_or_insert(now);
        req.claims.insert(
            g,
            Claim {
                peer,
                name,
                data,
                planned: 0,
                planning: false,
                jobs: 0,
                reported: 0,
                ended: false,
                ok: false,
                cancelled: false,
                withheld: false,
                arrived: now,
                bounce_cursor: 0,
                stages: Stages::default(),
            },
        );
        self.pump(id);
        ClaimFate::Bound
    }

    /// Hands every claim's unplanned chunks to planning (one task per claim at a time, so
    /// pieces stay in order).
    fn pump(&mut self, id: u64) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        if req.ending() {
            return;
        }
        for (&g, claim) in req.claims.iter_mut() {
            if claim.planning || claim.ended || claim.cancelled || claim.planned >= req.chunks.len()
            {
                continue;
            }
            let chunks = req.chunks[claim.planned..]
                .iter()
                .enumerate()
                .map(|(k, c)| ((claim.planned + k) as u32, c.clone()))
                .collect();
            claim.planning = true;
            self.actions.push_back(Action::Plan(PlanTask {
                request: id,
                rank: g,
                peer: claim.peer,
                data: claim.data.clone(),
                chunks,
                bounce_cursor: claim.bounce_cursor,
            }));
        }
    }

    /// Claim `g` of request `id` while it is still `peer`'s, and whether the request is
    /// still live.
    fn claim_of(&mut self, id: u64, g: u32, peer: PeerId) -> Option<(bool, &mut Claim)> {
        let req = self.requests.get_mut(&id)?;
        let live = !req.ending();
        let claim = req.claims.get_mut(&g).filter(|c| c.peer == peer)?;
        Some((live, claim))
    }

    /// The claim's planning task is over (answered or abandoned): it is no longer planning.
    /// The peer's name, for a failure.
    fn planning_over(&mut self, id: u64, g: u32, peer: PeerId) -> Option<String> {
        match self.claim_of(id, g, peer) {
            Some((_, claim)) => {
                claim.planning = false;
                Some(claim.name.clone())
            }
            None => self.peers.get(&peer).map(|p| p.name.clone()),
        }
    }

    /// A planning task ([`Action::Plan`]) was not answered within the planner's deadline:
    /// the call is abandoned, and the request fails.
    pub fn handle_plan_hung(
        &mut self,
        now: Instant,
        id: u64,
        g: u32,
        peer: PeerId,
        reason: String,
    ) {
        let name = self.planning_over(id, g, peer);
        self.fail(now, id, name, FailureKind::Planner, reason);
    }

    /// A planning task's result: `true` when the driver is to queue its
    /// [`Planned::pieces`] on the rank thread, in order, then call
    /// [`handle_queued`](Self::handle_queued); `false` when the request or claim ended
    /// meanwhile (the plans are dropped; nothing more is due).
    pub fn handle_planned(
        &mut self,
        now: Instant,
        id: u64,
        g: u32,
        peer: PeerId,
        planned: Planned,
    ) -> bool {
        let Some((live, claim)) = self.claim_of(id, g, peer) else {
            return false;
        };
        claim.stages.merge(&planned.stages);
        if !live || claim.ended || claim.cancelled {
            claim.planning = false;
            self.settle(now, id);
            return false;
        }
        claim.planned = planned.through as usize;
        claim.jobs += planned.pieces;
        claim.bounce_cursor = planned.bounce_cursor;
        // The claim stays `planning` until these pieces are on the rank thread's queue: a
        // `pump` in between (the engine's next layer-wise chunk) would otherwise plan the
        // later pieces on another planning task and could queue them first.
        true
    }

    /// The pieces of a [`handle_planned`](Self::handle_planned) that said `true` are queued;
    /// `error`: the piece that could not be planned, and why (the claim then ends with it
    /// once its queued jobs reported, and the request fails).
    pub fn handle_queued(
        &mut self,
        now: Instant,
        id: u64,
        g: u32,
        peer: PeerId,
        error: Option<(u32, String)>,
    ) {
        let name = self.planning_over(id, g, peer);
        // Whatever ended the request while its pieces were being queued waited on `planning`.
        self.settle(now, id);
        if let Some((piece, reason)) = error {
            self.end_claim(id, g, peer, piece, reason.clone(), true);
            return self.fail(now, id, name, FailureKind::Planner, reason);
        }
        self.pump(id);
    }

    /// A queued write job let go of its sources (it reports [`handle_written`] next).
    ///
    /// [`handle_written`]: Self::handle_written
    pub fn handle_released(&mut self, id: u64, g: u32) {
        if let Some(claim) = self
            .requests
            .get_mut(&id)
            .and_then(|r| r.claims.get_mut(&g))
        {
            claim.jobs = claim.jobs.saturating_sub(1);
        }
    }

    /// A piece's write job reported: its completion goes to the receiver, and the request
    /// ends if this was what it waited for.
    pub fn handle_written(&mut self, now: Instant, id: u64, g: u32, written: Written) {
        let me = self.config.rank;
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        let Some(claim) = req.claims.get_mut(&g) else {
            return;
        };
        if claim.ended || claim.withheld {
            // Ended without this piece (its peer lost), or an earlier piece failed: nothing
            // to report, but this job may have been the last thing the request waited on. A
            // registration that ended meanwhile hears nothing more, the held-back failure
            // included (see `Written::registered`).
            if !written.registered {
                claim.ended = true;
            }
            return self.settle(now, id);
        }
        if let (Err(reason), true, true) = (&written.result, claim.jobs > 0, written.registered) {
            // Later pieces of this claim are still queued and may write into the receiver's
            // slots: were this failure its last piece now, the receiver could end the request
            // and give its slots to another while they land. It goes out as the last piece
            // once they reported (`settle`, the request failing), and they report nothing.
            claim.withheld = true;
            let detail = format!(
                "writing piece {} to {}: {reason}",
                written.piece, claim.name
            );
            if req.failure.is_none() {
                req.failure = Some((Some(claim.name.clone()), FailureKind::Write, detail));
            }
            return self.settle(now, id);
        }
        let (counts, status) = match &written.result {
            Ok(c) => (*c, CompletionStatus::Ok),
            Err(e) => (WriteCounts::default(), CompletionStatus::Failed(e.clone())),
        };
        let ok = written.result.is_ok();
        let ends = written.is_last || !ok;
        if ok {
            claim.stages.merge(&written.stages);
        }
        let piece = written.piece;
        let message = written.registered.then(|| {
            AgentMessage::Completion(Completion {
                request: id,
                sender_rank: me,
                receiver_rank: g,
                piece,
                is_last: ends,
                bytes: counts.bytes,
                fragments: counts.fragments,
                status: status.clone(),
                bounce: written.bounce.filter(|_| ok),
                digest: written.digest.filter(|_| ok),
                views: written.views.as_ref().map(|v| v.to_vec()),
            })
        });
        claim.reported = piece + 1;
        req.bytes += counts.bytes;
        req.puts += counts.puts;
        if ends {
            claim.ended = true;
            claim.ok = ok;
            if ok {
                let mut stages = claim.stages;
                stages.control_ns = nanos(now.saturating_duration_since(claim.arrived))
                    .saturating_sub(stages.total_ns());
                req.stages.merge(&stages);
            }
        }
        if let (CompletionStatus::Failed(reason), None) = (&status, &req.failure) {
            req.failure = Some((
                Some(claim.name.clone()),
                FailureKind::Write,
                format!("writing piece {piece} to {}: {reason}", claim.name),
            ));
        }
        let peer = claim.peer;
        if let Some(message) = message {
            self.send(peer, message);
        }
        self.settle(now, id);
    }

    /// Ends a claim with a failed last piece (unless it ended already). `after_jobs`: the
    /// claim's queued jobs report first, so the failure is sent when they have.
    fn end_claim(
        &mut self,
        id: u64,
        g: u32,
        peer: PeerId,
        piece: u32,
        reason: String,
        after_jobs: bool,
    ) {
        let me = self.config.rank;
        let Some(claim) = self
            .requests
            .get_mut(&id)
            .and_then(|r| r.claims.get_mut(&g))
        else {
            return;
        };
        if claim.ended || claim.peer != peer || (after_jobs && claim.jobs > 0) {
            return;
        }
        claim.ended = true;
        let piece = piece.max(claim.reported);
        self.send(peer, failed(id, (me, g), piece, reason));
    }

    fn fail(
        &mut self,
        now: Instant,
        id: u64,
        peer: Option<String>,
        kind: FailureKind,
        detail: String,
    ) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        if !req.ending() {
            req.failure = Some((peer, kind, detail));
        }
        self.settle(now, id);
    }

    /// Ends the request if it can end: answers the claims still open, emits its one
    /// outcome and forgets it.
    fn settle(&mut self, now: Instant, id: u64) {
        let me = self.config.rank;
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        let mut sends = Vec::new();
        // Cancelled claims whose jobs drained get their failed last piece.
        for (&g, claim) in req.claims.iter_mut() {
            if claim.cancelled && !claim.ended && !claim.busy() {
                claim.ended = true;
                sends.push((
                    claim.peer,
                    failed(
                        id,
                        (me, g),
                        claim.reported,
                        "cancelled by the receiver".into(),
                    ),
                ));
            }
        }
        let busy = req.claims.values().any(Claim::busy);
        if req.ending() {
            // Every claim still open with nothing of its own in flight hears it is over now
            // (the others when their jobs reported). A cancel by this side's engine reaches
            // the receivers as one, so they end `CancelledByPeer` at once rather than as a
            // failed write.
            let status = match &req.failure {
                Some((_, _, d)) => CompletionStatus::Failed(d.clone()),
                None => CompletionStatus::Cancelled(format!(
                    "{} cancelled request {id}",
                    self.config.me
                )),
            };
            for (&g, claim) in req.claims.iter_mut() {
                if !claim.ended && !claim.busy() {
                    claim.ended = true;
                    sends.push((
                        claim.peer,
                        last_piece(id, (me, g), claim.reported, status.clone()),
                    ));
                }
            }
        }
        let all_ended = req.claims.values().all(|c| c.ended);
        let expected_done = req.expected.as_ref().is_some_and(|e| {
            e.iter()
                .all(|g| req.claims.get(g).is_some_and(|c| c.ended && c.ok))
        });
        let outcome = if busy {
            None
        } else if req.cancelled {
            Some(RequestOutcome::Cancelled)
        } else if let Some((peer, kind, detail)) = &req.failure {
            Some(RequestOutcome::Failed {
                peer: peer.clone(),
                kind: *kind,
                detail: detail.clone(),
            })
        } else if req.finished && expected_done && all_ended {
            Some(RequestOutcome::Sent {
                bytes: req.bytes,
                puts: req.puts,
                stages: req.stages,
            })
        } else if all_ended && !req.claims.is_empty() && req.claims.values().any(|c| !c.ok) {
            let peer = req.claims.values().find(|c| !c.ok).map(|c| c.name.clone());
            Some(RequestOutcome::Failed {
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
        for (peer, message) in sends {
            self.send(peer, message);
        }
        let Some(outcome) = outcome else {
            return;
        };
        if let Some(req) = self.requests.remove(&id) {
            let how = match &outcome {
                RequestOutcome::Sent { .. } => "it was sent".to_string(),
                RequestOutcome::Received { .. } => "it was received".to_string(),
                RequestOutcome::Cancelled => "the engine cancelled it".to_string(),
                RequestOutcome::Failed { kind, detail, .. } => format!("failed[{kind}]: {detail}"),
            };
            let ended = Ended {
                instance: req.owner.or(req.to),
                how,
            };
            let bytes = ended.bytes();
            let _ = self.ended.push(id, ended, bytes, now);
        }
        self.actions.push_back(Action::Ended {
            request: id,
            outcome,
        });
    }

    /// The receiver on `peer` cancels request `id`: its claim stops being written; the
    /// failed last piece goes out once its jobs drained. A cancel of a request not sent yet
    /// is remembered, so its send ends at once.
    pub fn handle_cancel(&mut self, now: Instant, peer: PeerId, id: u64, reason: &str) {
        let Some(p) = self.peers.get(&peer) else {
            return;
        };
        let (instance, name, g) = (p.instance.clone(), p.name.clone(), p.rank);
        let me = self.config.rank;
        self.stash.retain_request(id, |s| s.peer != peer);
        let answer_now = match self.requests.get_mut(&id) {
            // Not sent here yet: the send that comes later ends at once.
            None => {
                let tomb = Tombstone {
                    instance,
                    peer: name,
                    reason: reason.chars().take(TOMBSTONE_REASON).collect(),
                };
                let bytes = tomb.bytes();
                // Too many cancels of unsent requests held: this one is not kept; its send
                // ends at its lease.
                let _ = self.tombstones.push(id, tomb, bytes, now);
                Some(0)
            }
            Some(req) => match req.claims.get_mut(&g) {
                Some(claim) if claim.peer == peer && !claim.ended => {
                    claim.cancelled = true;
                    (!claim.busy()).then_some(claim.reported)
                }
                // Claimed by another connection, or over: nothing of this peer's is in flight.
                Some(_) => None,
                // Sent, but this rank never claimed it: a receiver that gives up on a request
                // it may claim ends it now (not at the lease); any peer gets its answer.
                None => {
                    let targeted = req.expected.as_ref().is_none_or(|e| e.contains(&g));
                    if targeted && req.open_to(&instance) && !req.ending() {
                        req.failure = Some((
                            Some(name.clone()),
                            FailureKind::CancelledByPeer,
                            format!("{name} cancelled request {id} before claiming it: {reason}"),
                        ));
                    }
                    Some(0)
                }
            },
        };
        // Otherwise the claim's failed last piece goes out once its jobs drained (`settle`).
        if let Some(piece) = answer_now {
            if let Some(claim) = self
                .requests
                .get_mut(&id)
                .and_then(|r| r.claims.get_mut(&g))
            {
                claim.ended = true;
            }
            self.send(
                peer,
                failed(
                    id,
                    (me, g),
                    piece,
                    format!("cancelled by the receiver: {reason}"),
                ),
            );
            self.settle(now, id);
        }
    }

    /// A receiver's instance still wants request `id`, which nothing claimed yet (its engine
    /// queued it): the lease runs from now again, at most [`MAX_HELD_LEASES`] leases after
    /// the first send. A hold for a request it may not claim, one already claimed or ended,
    /// or one not sent here is ignored (a claim then gets its answer as it would have).
    /// Whether it was taken.
    pub fn handle_hold(&mut self, now: Instant, peer: PeerId, id: u64) -> bool {
        let lease = self.config.lease;
        let Some(p) = self.peers.get(&peer) else {
            return false;
        };
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        if !req.open_to(&p.instance) || req.claimed_at.is_some() || req.ending() {
            return false;
        }
        let bound = req.first_send + lease * MAX_HELD_LEASES;
        let until = (now + lease).min(bound);
        req.held_until = Some(req.held_until.map_or(until, |h| h.max(until)));
        true
    }

    /// Whether a refusal of `instance` rank `rank` could end anything: an open send bound to
    /// that instance (`to`) that the rank has not claimed. (The driver then asks the planner
    /// whether this rank writes it before [`handle_receiver_refused`].)
    ///
    /// [`handle_receiver_refused`]: Self::handle_receiver_refused
    pub fn bound_to(&self, instance: &str, rank: u32) -> bool {
        self.requests.values().any(|r| refusable(r, instance, rank))
    }

    /// A decode rank this rank writes was refused, by this rank or by itself: every open
    /// send bound to its instance that it has not claimed can never complete, so it fails
    /// now as refused rather than at its lease.
    pub fn handle_receiver_refused(
        &mut self,
        now: Instant,
        instance: &str,
        rank: u32,
        who: &str,
        reason: &str,
    ) {
        let ids: Vec<u64> = self
            .requests
            .iter_mut()
            .filter(|(_, r)| refusable(r, instance, rank))
            .map(|(&id, r)| {
                r.failure = Some((
                    Some(who.to_string()),
                    FailureKind::Refused,
                    format!("{who}, its receiver, was refused: {reason}"),
                ));
                id
            })
            .collect();
        for id in ids {
            self.settle(now, id);
        }
    }

    /// The decode rank on `peer` is gone (its connection ended, or this agent stops): its
    /// stashed claims are dropped and the requests it claimed fail; nothing more is sent to
    /// it.
    pub fn handle_lost(&mut self, now: Instant, peer: PeerId, why: &str) {
        let Some(p) = self.peers.remove(&peer) else {
            return;
        };
        self.stash.retain(|s, _| s.peer != peer);
        let mut ids = Vec::new();
        for (&id, req) in self.requests.iter_mut() {
            let mut touched = false;
            for claim in req.claims.values_mut() {
                if claim.peer == peer && !claim.ended {
                    claim.ended = true;
                    touched = true;
                }
            }
            if touched {
                if req.failure.is_none() {
                    req.failure = Some((
                        Some(p.name.clone()),
                        FailureKind::Peer,
                        format!("{} {why}", p.name),
                    ));
                }
                ids.push(id);
            }
        }
        for id in ids {
            self.settle(now, id);
        }
    }

    /// The clock reached `now`: stashed claims, cancels and ends expire (a stashed claim's
    /// receiver hears that its request was never sent), unclaimed sends past their lease
    /// and claimed requests past their timeout fail, and ending requests settle.
    pub fn handle_timeout(&mut self, now: Instant) {
        let ttl = self.stash_ttl();
        let mut expired = Vec::new();
        self.stash.retain(|s, at| {
            let keep = now.saturating_duration_since(at) < ttl;
            if !keep {
                expired.push((
                    s.peer,
                    s.data.request,
                    s.data.sender_rank,
                    s.data.receiver_rank,
                ));
            }
            keep
        });
        self.tombstones
            .retain(|_, at| now.saturating_duration_since(at) < ttl);
        self.ended
            .retain(|_, at| now.saturating_duration_since(at) < ttl);
        let (lease, timeout) = (self.config.lease, self.config.timeout);
        let mut due = Vec::new();
        for (&id, req) in self.requests.iter_mut() {
            if req.ending() || req.claims.values().any(|c| c.cancelled && !c.ended) {
                due.push(id);
            }
            if req.ending() {
                continue;
            }
            match req.claimed_at {
                None if now >= req.lease_end(lease) => {
                    let held = match req.held_until {
                        Some(h) => format!(
                            " (held by its receiver for {} ms)",
                            h.saturating_duration_since(req.first_send).as_millis()
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
        for (peer, request, c, g) in expired {
            self.send(
                peer,
                failed(
                    request,
                    (c, g),
                    0,
                    format!("request {request} was never sent here"),
                ),
            );
        }
        due.sort_unstable();
        for id in due {
            self.settle(now, id);
        }
    }
}

fn refusable<T>(r: &OutReq<T>, instance: &str, rank: u32) -> bool {
    r.to.as_deref() == Some(instance) && !r.ending() && !r.claims.contains_key(&rank)
}

/// The chunk `call` makes of its tokens' views not sent yet (`pending`): the views it
/// carries (`call.carried`, or all of `pending`) and the views still pending after it; or
/// why it may not.
fn next_chunk<T: Clone>(
    all: &BTreeSet<ViewId>,
    call: &SendCall<T>,
    pending: BTreeSet<ViewId>,
) -> Result<(Chunk<T>, BTreeSet<ViewId>), String> {
    let carried = call.carried.clone().unwrap_or_else(|| pending.clone());
    if let Some(v) = carried.difference(&pending).next() {
        return Err(format!(
            "view (group {}, view {}) of tokens {}..{} was sent already",
            v.group, v.view, call.tokens.start, call.tokens.end
        ));
    }
    let unsent: BTreeSet<ViewId> = pending.difference(&carried).copied().collect();
    let at_end = call.tokens.end == call.prompt_len;
    let last = at_end && unsent.is_empty();
    if call.is_last != last {
        return Err(
            "is_last must mark exactly the send that ends at the prompt's end and carries the \
             last of its views"
                .into(),
        );
    }
    let excluded: Vec<ViewId> = all.difference(&carried).copied().collect();
    let views = (!excluded.is_empty()).then(|| Arc::new(carried.into_iter().collect()));
    let chunk = Chunk {
        tables: call.tables.clone(),
        piece: PairRequest {
            token_range: call.tokens,
            prompt_len: call.prompt_len,
            dst_start_token: ROption::RNone,
            is_last: at_end,
        },
        views,
        excluded: Arc::new(excluded),
        last,
    };
    Ok((chunk, unsent))
}

/// A pair's failed last piece.
pub fn failed(request: u64, pair: (u32, u32), piece: u32, reason: String) -> AgentMessage {
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

/// A duration in nanoseconds, saturating.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
