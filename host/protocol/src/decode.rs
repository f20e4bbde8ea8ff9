//! A decode rank's requests as a state machine, sans I/O: what the engine expects, which
//! prefill ranks write it (linked by the driver), what their completions add up to, and
//! when each request ends and how.
//!
//! Like [`prefill`](crate::prefill), the machine knows no socket, thread or clock: its
//! driver (the transfer agent) feeds it the engine's `expect` and `cancel`, what linking the
//! writers found, the writers' completions, a scattered piece's result, this rank's own plan
//! of the bytes, a lost link and the time, and carries out what [`poll_action`] asks: send a
//! claim or a cancel to a writer, scatter a bounced piece (or check a piece's digest), drop
//! a link whose writer broke the protocol, report a request's end. [`poll_timeout`] says
//! when the clock next matters.
//!
//! ```text
//!  engine: expect, cancel ──▶ ┌──────────────────┐ ──▶ Send{link, RequestData | Cancel}
//!  driver: linked, expected,  │   DecodeMachine  │ ──▶ Scatter{link, completion}
//!  scattered, link lost  ───▶ │ requests·trackers│ ──▶ DropLink{link}
//!  writers: completions  ───▶ └──────────────────┘ ──▶ Ended{request, outcome, clean}
//! ```
//!
//! Each request's completions go through its [`RequestTracker`] in the order they arrived;
//! while a bounced (or digested) piece is being scattered (checked), later completions wait
//! behind it, so none overtakes another and the request cannot end under a scatter. A
//! request is `Received` once every writer's last piece landed and each writer's bytes match
//! this rank's own plan of them. A failure or cancel first sends `Cancel` to every writer
//! still open, once, and ends when each answered with its last piece or its link is gone —
//! then, when a writer whose link ended may still have bytes in flight, only after a grace
//! and once this rank's worker went quiet (or a limit passed), and `clean` is false: its
//! bounce region must not be reused.
//!
//! [`poll_action`]: DecodeMachine::poll_action
//! [`poll_timeout`]: DecodeMachine::poll_timeout

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvferry_planner_abi::{SlotTable, TokenRange, ViewId};

use crate::outcome::{FailureKind, RequestOutcome, RequestStats, Stages};
use crate::{
    AgentMessage, BounceOffer, Completion, CompletionStatus, Integrity, RequestData,
    RequestTracker, Tracked,
};

/// The most completions held back while a bounced piece is scattered; a writer that sends
/// more breaks the protocol (each has one piece in flight per chunk of the prompt).
pub const MAX_PENDING: usize = 4096;
/// How long a failed or cancelled request whose writer's link ended without its last piece
/// waits before its outcome: bytes that writer had already handed to the network land
/// first instead of in slots the engine has taken back. Measured: a decode server stopped
/// (SIGSTOP) past its writer's peer timeout received 2.2 MB of the request's bytes after it
/// resumed, some more than a second later on a loaded machine; so the outcome also waits
/// until this rank's worker went idle with nothing arriving for [`LATE_WRITE_QUIET`] (bytes
/// reach the slots only through its progress), at most [`LATE_WRITE_LIMIT`].
pub const LATE_WRITE_GRACE: Duration = Duration::from_secs(1);
/// See [`LATE_WRITE_GRACE`].
pub const LATE_WRITE_QUIET: Duration = Duration::from_millis(250);
/// See [`LATE_WRITE_GRACE`]: past it the outcome goes out (with
/// [`Action::Ended`]'s `clean` false) even if the worker is still busy.
pub const LATE_WRITE_LIMIT: Duration = Duration::from_secs(10);
/// How long a writer whose link is up may leave a request's `Cancel` unanswered (no last
/// piece) before its link is dropped: a writer that keeps its link alive with keep-alives but
/// never answers would otherwise hold the request, and its slots, for ever. The request then
/// ends as with a lost link: after the late-write wait, not clean; the link's other requests
/// fail when the driver has closed it.
pub const CANCEL_ANSWER_LIMIT: Duration = Duration::from_secs(10);

/// A link to a prefill rank, as the driver numbers it (never reused).
pub type LinkId = u64;

/// The machine's settings.
#[derive(Clone, Debug)]
pub struct DecodeConfig {
    /// This rank's instance (the receiver of every claim).
    pub instance: String,
    /// This rank's rank in it.
    pub rank: u32,
    /// How long a request may take from `expect`.
    pub timeout: Duration,
    /// The digest asked of every writer's pieces, if any.
    pub integrity: Option<Integrity>,
}

/// The engine's `expect`, after the checks that need no state (slots inside the pools, the
/// cached prefix on a block boundary inside the prompt).
#[derive(Clone, Debug)]
pub struct ExpectCall {
    /// The request.
    pub request: u64,
    /// The prefill instance that sends it.
    pub peer: String,
    /// The prompt's length.
    pub prompt_len: u64,
    /// Tokens already cached here: nothing before it is written.
    pub cached_prefix: Option<u64>,
    /// This rank's destination slot tables, one per layer group.
    pub tables: Vec<SlotTable>,
    /// Views of this rank that must not be written.
    pub excluded_views: Vec<ViewId>,
}

/// A writer of a request, as linking found it.
#[derive(Clone, Debug)]
pub struct Writer {
    /// Its link.
    pub link: LinkId,
    /// How messages and events name it.
    pub name: String,
}

/// What the machine asks its driver to do, in order.
#[derive(Clone, Debug)]
pub enum Action {
    /// Send `message` (a claim or a cancel) to the writer on `link`.
    Send {
        /// The link.
        link: LinkId,
        /// The message.
        message: AgentMessage,
    },
    /// Scatter this bounced piece from the bounce region into the slots, and check its
    /// digest when one was asked (off the lock), then answer with
    /// [`DecodeMachine::handle_scattered`].
    Scatter {
        /// Its writer's link.
        link: LinkId,
        /// The piece.
        completion: Completion,
    },
    /// The writer on `link` broke the protocol: end its link (its requests end on the
    /// link's loss, not on its word).
    DropLink {
        /// The link.
        link: LinkId,
    },
    /// The request ended: its one outcome. No write of it can land after this, unless
    /// `clean` is false: a writer whose link ended without its last piece may still have
    /// bytes on the way, so its bounce region must be kept out of use.
    Ended {
        /// The request.
        request: u64,
        /// How: `Received`, `Cancelled` or `Failed`.
        outcome: RequestOutcome,
        /// Every writer answered with its last piece (or none was asked).
        clean: bool,
    },
}

/// What [`DecodeMachine::handle_linked`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Linked {
    /// The writers were sent their claims (the request had not ended).
    pub claimed: bool,
    /// The bounce offer was taken.
    pub offer_taken: bool,
}

#[derive(Debug)]
struct LinkState {
    name: String,
    alive: bool,
}

#[derive(Debug)]
struct InReq {
    call: ExpectCall,
    /// Writers by prefill rank; empty until linking ended.
    writers: BTreeMap<u32, LinkId>,
    tracker: Option<RequestTracker>,
    started: Instant,
    deadline: Instant,
    cancelled: bool,
    failure: Option<(Option<String>, FailureKind, String)>,
    /// When `Cancel` went to the open writers, if it did.
    cancel_sent: Option<Instant>,
    /// Bytes each writer reported so far, by prefill rank.
    reported: BTreeMap<u32, u64>,
    /// Bytes each writer must write, by this rank's own plan (`None` until computed; a
    /// writer missing from it is not checked).
    expected: Option<BTreeMap<u32, u64>>,
    /// Every writer finished before `expected` was known: the stats wait for the check.
    finished: Option<RequestStats>,
    /// From `expect` until every claim was handed to its link (0 until then).
    claims_ns: u64,
    /// When the last completion came, if the stats wait for the check.
    completed_at: Option<Instant>,
    /// The writer offered a bounce region, if any.
    bounce_writer: Option<u32>,
    /// A piece is being scattered, or the completions held back meanwhile are being taken
    /// up: later completions wait in `pending`, in order, and the request cannot end.
    scattering: bool,
    pending: VecDeque<(LinkId, Completion)>,
    /// Nanoseconds spent scattering bounced pieces and checking digests.
    scatter_ns: u64,
    /// When it was first ready to end with a writer whose link is gone without its last
    /// piece: its outcome waits from then ([`LATE_WRITE_GRACE`]).
    late_until: Option<Instant>,
}

impl InReq {
    fn ending(&self) -> bool {
        self.cancelled || self.failure.is_some()
    }

    fn fail(&mut self, peer: Option<String>, kind: FailureKind, detail: String) {
        if !self.ending() {
            self.failure = Some((peer, kind, detail));
        }
    }

    /// Whether `c` is a piece that landed for a request still going and must be scattered
    /// or checked before it counts. (A request that is over only counts its pieces.)
    fn to_scatter(&self, integrity: bool, c: &Completion) -> bool {
        (c.bounce.is_some() || integrity)
            && matches!(c.status, CompletionStatus::Ok)
            && !self.ending()
    }
}

/// A decode rank's requests (see the module docs).
#[derive(Debug)]
pub struct DecodeMachine {
    config: DecodeConfig,
    requests: HashMap<u64, InReq>,
    links: HashMap<LinkId, LinkState>,
    actions: VecDeque<Action>,
}

impl DecodeMachine {
    /// A machine with no requests.
    pub fn new(config: DecodeConfig) -> Self {
        Self {
            config,
            requests: HashMap::new(),
            links: HashMap::new(),
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

    /// The links requests still write through (each needs keep-alives).
    pub fn links_in_use(&self) -> impl Iterator<Item = LinkId> + '_ {
        self.requests
            .values()
            .flat_map(|r| r.writers.values().copied())
    }

    /// The next thing to do, in order.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// No handler gives a request a deadline sooner than this after the `now` it is called
    /// with (its timeout, a late-write grace, a cancel's answer limit): a driver whose timer
    /// sleeps at most this long past the [`poll_timeout`](Self::poll_timeout) it last read
    /// misses no deadline that a handler made in the meantime, without being woken for it.
    /// The simulation checks it.
    pub fn horizon(&self) -> Duration {
        self.config
            .timeout
            .min(LATE_WRITE_GRACE)
            .min(CANCEL_ANSWER_LIMIT)
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next due: a request's timeout, the
    /// end of a late-write grace (due at every call after it until the worker is quiet or
    /// the limit passed), or the end of the wait for a cancel's answers.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.requests
            .values()
            .filter_map(|r| match (r.ending(), r.late_until, r.cancel_sent) {
                (false, _, _) => Some(r.deadline),
                (true, Some(since), _) => Some(since + LATE_WRITE_GRACE),
                (true, None, Some(at)) => Some(at + CANCEL_ANSWER_LIMIT),
                (true, None, None) => None,
            })
            .min()
    }

    /// The engine expects request `call.request`; `Err(())` if it is expected already. The
    /// driver then links its writers and answers with [`handle_linked`] or
    /// [`handle_link_failed`].
    ///
    /// [`handle_linked`]: Self::handle_linked
    /// [`handle_link_failed`]: Self::handle_link_failed
    #[allow(clippy::result_unit_err)]
    pub fn expect(&mut self, now: Instant, call: ExpectCall) -> Result<(), ()> {
        let std::collections::hash_map::Entry::Vacant(slot) = self.requests.entry(call.request)
        else {
            return Err(());
        };
        slot.insert(InReq {
            call,
            writers: BTreeMap::new(),
            tracker: None,
            started: now,
            deadline: now + self.config.timeout,
            cancelled: false,
            failure: None,
            cancel_sent: None,
            reported: BTreeMap::new(),
            expected: None,
            finished: None,
            claims_ns: 0,
            completed_at: None,
            bounce_writer: None,
            scattering: false,
            pending: VecDeque::new(),
            scatter_ns: 0,
            late_until: None,
        });
        Ok(())
    }

    /// Forgets a request the driver could not start (nothing was asked of anyone).
    pub fn forget(&mut self, id: u64) {
        self.requests.remove(&id);
    }

    /// A link to a prefill rank is up (a link known already keeps its state).
    pub fn handle_link_up(&mut self, link: LinkId, name: String) {
        self.links
            .entry(link)
            .or_insert(LinkState { name, alive: true });
    }

    /// Linking found request `id`'s writers (by prefill rank). `offer`: the writer and the
    /// bounce region offered to it, if the driver reserved one. Each writer gets its claim
    /// (unless the request ended meanwhile: then its writers hear of the cancel, and it ends
    /// once they answered). The driver then plans the request itself for the byte check
    /// ([`handle_expected`](Self::handle_expected)) when the writers were claimed from, and
    /// gives the region back when the offer was not taken.
    pub fn handle_linked(
        &mut self,
        now: Instant,
        id: u64,
        writers: BTreeMap<u32, LinkId>,
        offer: Option<(u32, BounceOffer)>,
    ) -> Linked {
        let (me, instance, integrity) = (
            self.config.rank,
            self.config.instance.clone(),
            self.config.integrity,
        );
        let Some(req) = self.requests.get_mut(&id) else {
            return Linked::default();
        };
        let pairs: Vec<(u32, u32)> = writers.keys().map(|&c| (c, me)).collect();
        req.tracker = Some(RequestTracker::streaming(id, pairs));
        let live = !req.ending();
        let taken = live && offer.is_some();
        if taken {
            req.bounce_writer = offer.map(|(w, _)| w);
        }
        let mut sends = Vec::new();
        if live {
            for (&c, &link) in &writers {
                let call = &req.call;
                sends.push((
                    link,
                    AgentMessage::RequestData(RequestData {
                        request: id,
                        receiver_instance: instance.clone(),
                        receiver_rank: me,
                        sender_rank: c,
                        slot_tables: call.tables.clone(),
                        token_range: TokenRange {
                            start: 0,
                            end: call.prompt_len,
                        },
                        prompt_len: call.prompt_len,
                        dst_start_token: call.cached_prefix,
                        excluded_views: call.excluded_views.clone(),
                        bounce: offer.filter(|(w, _)| *w == c).map(|(_, o)| o),
                        integrity,
                    }),
                ));
            }
            req.claims_ns = nanos(now.saturating_duration_since(req.started));
        }
        req.writers = writers;
        for (link, message) in sends {
            self.actions.push_back(Action::Send { link, message });
        }
        self.settle(now, id, None);
        Linked {
            claimed: live,
            offer_taken: taken,
        }
    }

    /// Linking request `id`'s writers failed: it fails (no writer was asked, so it may end
    /// at once).
    pub fn handle_link_failed(
        &mut self,
        now: Instant,
        id: u64,
        peer: Option<String>,
        kind: FailureKind,
        detail: String,
    ) {
        if let Some(req) = self.requests.get_mut(&id) {
            req.fail(peer, kind, detail);
            req.tracker = Some(RequestTracker::streaming(id, []));
        }
        self.settle(now, id, None);
    }

    /// This rank's own plan of request `id`: what each writer must write, and whether two
    /// writers' plans overlap (why, if so).
    pub fn handle_expected(
        &mut self,
        now: Instant,
        id: u64,
        expected: BTreeMap<u32, u64>,
        overlap: Option<String>,
    ) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        if let Some(detail) = overlap {
            req.fail(None, FailureKind::Planner, detail);
        }
        req.expected = Some(expected);
        if !self.try_receive(now, id) {
            self.settle(now, id, None);
        }
    }

    /// Ends the request as received if every writer finished, this rank's own plan is known
    /// and no piece is being scattered; fails it if the writers' bytes disagree with the
    /// plan. Whether it ended.
    fn try_receive(&mut self, now: Instant, id: u64) -> bool {
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        if req.ending() || req.scattering || req.expected.is_none() || req.finished.is_none() {
            return false;
        }
        match self.byte_mismatch(id) {
            None => {
                let req = self.requests.get_mut(&id).expect("checked");
                let mut stats = req.finished.take().expect("checked");
                // The wait for this rank's own plan of the request, or for the scatter.
                stats.stages.control_ns += req
                    .completed_at
                    .map_or(0, |at| nanos(now.saturating_duration_since(at)));
                self.end(id, RequestOutcome::Received { stats }, true);
                true
            }
            Some((peer, detail)) => {
                let req = self.requests.get_mut(&id).expect("checked");
                req.finished = None;
                req.fail(Some(peer), FailureKind::Protocol, detail);
                false
            }
        }
    }

    /// A completion from the writer on `link`: taken up now, or after the piece being
    /// scattered.
    pub fn handle_completion(&mut self, now: Instant, link: LinkId, c: Completion) {
        let me = self.config.rank;
        let name = self.link_name(link);
        let Some(req) = self.requests.get_mut(&c.request) else {
            return;
        };
        if c.receiver_rank != me || req.writers.get(&c.sender_rank) != Some(&link) {
            // From a rank that does not write it: ignored.
            return;
        }
        if req.scattering || !req.pending.is_empty() {
            if req.pending.len() >= MAX_PENDING {
                req.fail(
                    Some(name.clone()),
                    FailureKind::Protocol,
                    format!(
                        "{name} sent more than {MAX_PENDING} completions while a bounced piece \
                         was scattered"
                    ),
                );
                return self.drop_link(link);
            }
            req.pending.push_back((link, c));
            return;
        }
        if req.to_scatter(self.config.integrity.is_some(), &c) {
            req.scattering = true;
            self.actions.push_back(Action::Scatter {
                link,
                completion: c,
            });
            return;
        }
        self.track(now, link, c);
    }

    /// A [`Action::Scatter`] ended: `Ok(ns)` it took, or why the piece is refused (and as
    /// what). The piece goes to the tracker (failed, if refused), then the completions held
    /// back meanwhile.
    pub fn handle_scattered(
        &mut self,
        now: Instant,
        link: LinkId,
        mut c: Completion,
        outcome: Result<u64, (FailureKind, String)>,
    ) {
        let id = c.request;
        let name = self.link_name(link);
        let integrity = self.config.integrity.is_some();
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        match outcome {
            Ok(ns) => req.scatter_ns += ns,
            Err((kind, reason)) => {
                req.fail(Some(name), kind, reason.clone());
                c.status = CompletionStatus::Failed(reason);
            }
        }
        // Still marked scattering: completions that arrived meanwhile queue behind this one.
        self.track(now, link, c);
        loop {
            let Some(req) = self.requests.get_mut(&id) else {
                return;
            };
            match req.pending.pop_front() {
                None => {
                    req.scattering = false;
                    if self.try_receive(now, id) {
                        return;
                    }
                    break;
                }
                Some((link, c)) if req.to_scatter(integrity, &c) => {
                    self.actions.push_back(Action::Scatter {
                        link,
                        completion: c,
                    });
                    return;
                }
                Some((link, c)) => self.track(now, link, c),
            }
        }
        self.settle(now, id, None);
    }

    /// Whether the writer of `c` was offered request `c.request`'s bounce region.
    pub fn offered_to(&self, c: &Completion) -> bool {
        self.requests
            .get(&c.request)
            .is_some_and(|r| r.bounce_writer == Some(c.sender_rank))
    }

    fn link_name(&self, link: LinkId) -> String {
        self.links
            .get(&link)
            .map_or_else(|| format!("link {link}"), |l| l.name.clone())
    }

    fn drop_link(&mut self, link: LinkId) {
        if let Some(l) = self.links.get_mut(&link) {
            l.alive = false;
        }
        self.actions.push_back(Action::DropLink { link });
    }

    /// Feeds one completion to the request's tracker and ends the request if it can.
    fn track(&mut self, now: Instant, link: LinkId, c: Completion) {
        let id = c.request;
        let name = self.link_name(link);
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        let Some(tracker) = req.tracker.as_mut() else {
            return;
        };
        let tracked = tracker.on_completion(&c);
        if matches!(c.status, CompletionStatus::Ok) && tracked.is_ok() {
            let total = req.reported.entry(c.sender_rank).or_default();
            *total = total.saturating_add(c.bytes);
        }
        match tracked {
            Ok(Tracked::Completed(totals)) if !req.ending() => {
                let stats = RequestStats {
                    bytes: totals.bytes,
                    fragments: totals.fragments,
                    writers: totals.writers,
                    pieces: totals.pieces,
                    latency_us: u64::try_from(
                        now.saturating_duration_since(req.started).as_micros(),
                    )
                    .unwrap_or(u64::MAX),
                    puts: 0,
                    stages: Stages {
                        control_ns: req.claims_ns,
                        scatter_ns: req.scatter_ns,
                        ..Stages::default()
                    },
                };
                // It ends once this rank's own plan is known and no scatter is out (a
                // completion after the last is scattered only to be refused).
                req.finished = Some(stats);
                req.completed_at = Some(now);
                if self.try_receive(now, id) {
                    return;
                }
            }
            Ok(Tracked::Failed(f)) => {
                if f.cancelled {
                    req.fail(Some(name), FailureKind::CancelledByPeer, f.reason);
                } else {
                    let detail = format!("{name} piece {} failed: {}", f.piece, f.reason);
                    req.fail(Some(name), FailureKind::Write, detail);
                }
            }
            Ok(_) => {}
            Err(violation) => {
                req.fail(
                    Some(name.clone()),
                    FailureKind::Protocol,
                    format!("{name}: {violation}"),
                );
                // Its word is no longer trusted: drop the link, so its requests end on the
                // link's loss rather than on its say-so.
                self.drop_link(link);
            }
        }
        self.settle(now, id, None);
    }

    /// The first writer whose reported bytes differ from this rank's own plan, and how.
    fn byte_mismatch(&self, id: u64) -> Option<(String, String)> {
        let req = self.requests.get(&id)?;
        let expected = req.expected.as_ref()?;
        for (c, &want) in expected {
            let got = req.reported.get(c).copied().unwrap_or(0);
            if got != want {
                let peer = req
                    .writers
                    .get(c)
                    .map_or_else(|| format!("prefill rank {c}"), |&l| self.link_name(l));
                return Some((
                    peer.clone(),
                    format!(
                        "{peer} reported {got} bytes written, but this rank's own plan of the \
                         request says {want}: its word cannot be vouched for"
                    ),
                ));
            }
        }
        None
    }

    fn end(&mut self, id: u64, outcome: RequestOutcome, clean: bool) {
        if let Some(req) = self.requests.remove(&id) {
            // A lost link this was the last request of is forgotten.
            for link in req.writers.into_values() {
                let dead = self.links.get(&link).is_some_and(|l| !l.alive);
                if dead && !self.links_in_use().any(|l| l == link) {
                    self.links.remove(&link);
                }
            }
        }
        self.actions.push_back(Action::Ended {
            request: id,
            outcome,
            clean,
        });
    }

    /// Ends a failed or cancelled request once no writer may still write: tells the open
    /// writers first, once. `quiet`: how long this rank's worker has had nothing to do,
    /// when known (a late-write wait ends only once it is quiet, or at its limit).
    fn settle(&mut self, now: Instant, id: u64, quiet: Option<Duration>) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        if !req.ending() || req.scattering {
            // A scatter writes the request's slots: it settles again when it is done.
            return;
        }
        let Some(tracker) = req.tracker.as_mut() else {
            // Still linking: it settles when linking ended.
            return;
        };
        tracker.fail();
        let open: Vec<LinkId> = tracker
            .open_pairs()
            .filter_map(|(c, _)| req.writers.get(&c).copied())
            .filter(|l| self.links.get(l).is_some_and(|s| s.alive))
            .collect();
        if !open.is_empty() {
            match req.cancel_sent {
                None => {
                    req.cancel_sent = Some(now);
                    let reason = match &req.failure {
                        Some((_, _, d)) => d.clone(),
                        None => "cancelled by the decode engine".into(),
                    };
                    for link in open {
                        self.actions.push_back(Action::Send {
                            link,
                            message: AgentMessage::Cancel {
                                request: id,
                                reason: reason.clone(),
                            },
                        });
                    }
                }
                Some(at) if now.saturating_duration_since(at) >= CANCEL_ANSWER_LIMIT => {
                    // Writers that left the cancel unanswered are taken for broken: their
                    // links go, and this request waits out their late writes instead.
                    for link in open {
                        self.drop_link(link);
                    }
                    return self.settle(now, id, quiet);
                }
                Some(_) => {}
            }
            return;
        }
        // Every writer answered with its last piece, or may still write (its link is gone
        // without one): then its bytes already on the way land before the slots go back.
        let clean = tracker.quiescent();
        if !clean {
            let since = *req.late_until.get_or_insert(now);
            let waited = now.saturating_duration_since(since);
            let quiet = quiet.is_some_and(|q| q >= LATE_WRITE_QUIET);
            if waited < LATE_WRITE_GRACE || (!quiet && waited < LATE_WRITE_LIMIT) {
                return;
            }
        }
        let outcome = match req.failure.take() {
            _ if req.cancelled => RequestOutcome::Cancelled,
            Some((peer, kind, detail)) => RequestOutcome::Failed { peer, kind, detail },
            None => RequestOutcome::Cancelled,
        };
        self.end(id, outcome, clean);
    }

    /// The engine cancels request `id`; `Err(())` when it is not open here.
    #[allow(clippy::result_unit_err)]
    pub fn cancel(&mut self, now: Instant, id: u64) -> Result<(), ()> {
        let req = self.requests.get_mut(&id).ok_or(())?;
        if req.failure.is_none() {
            req.cancelled = true;
        }
        self.settle(now, id, None);
        Ok(())
    }

    /// The link to a prefill rank ended (`why`): the requests it writes fail, and end once
    /// their other writers answered.
    pub fn handle_link_lost(&mut self, now: Instant, link: LinkId, why: &str) {
        let name = self.link_name(link);
        if let Some(l) = self.links.get_mut(&link) {
            l.alive = false;
        }
        if !self.links_in_use().any(|l| l == link) {
            self.links.remove(&link);
        }
        let mut ids: Vec<u64> = Vec::new();
        for (&id, req) in self.requests.iter_mut() {
            if req.writers.values().any(|&w| w == link) {
                req.fail(
                    Some(name.clone()),
                    FailureKind::Peer,
                    format!("{name} {why}"),
                );
                ids.push(id);
            }
        }
        ids.sort_unstable();
        for id in ids {
            self.settle(now, id, None);
        }
    }

    /// The clock reached `now`; `quiet`: how long this rank's worker has had nothing to do,
    /// if known. Requests past their timeout fail; ending requests settle.
    pub fn handle_timeout(&mut self, now: Instant, quiet: Option<Duration>) {
        let timeout = self.config.timeout;
        let mut due = Vec::new();
        for (&id, req) in self.requests.iter_mut() {
            if !req.ending() && now >= req.deadline {
                let missing: Vec<String> = req
                    .tracker
                    .iter()
                    .flat_map(|t| t.missing())
                    .map(|(c, g)| format!("prefill rank {c} -> decode rank {g}"))
                    .collect();
                let detail = format!(
                    "request {id} timed out after {} ms waiting on {} for {}",
                    timeout.as_millis(),
                    req.call.peer,
                    if missing.is_empty() {
                        "its writers to be linked".to_string()
                    } else {
                        missing.join(", ")
                    }
                );
                req.failure = Some((Some(req.call.peer.clone()), FailureKind::Timeout, detail));
            }
            if req.ending() {
                due.push(id);
            }
        }
        due.sort_unstable();
        for id in due {
            self.settle(now, id, quiet);
        }
    }
}

/// A duration in nanoseconds, saturating.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
