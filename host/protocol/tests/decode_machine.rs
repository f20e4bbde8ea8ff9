//! The decode side's request machine (`kvferry_protocol::decode`) under seeded simulation:
//! an engine that expects and cancels, linking that finds one or two writers (or fails),
//! prefill writers that answer claims with pieces (some failed), answer cancels, and lose
//! their links (a writer that broke the protocol is dropped), links that deliver in order but
//! late, bounced and digested pieces scattered off the lock (some refused), this rank's own
//! plan of the bytes arriving at any time (sometimes disagreeing), a worker that is busy or
//! quiet, and a clock — in an order drawn from the seed. Every run checks:
//!
//! - exactly one outcome per expected request, none while a piece of it is being scattered;
//! - a claim to each writer at most once, before the outcome; a cancel at most once;
//! - `Received` only when every writer's last piece landed Ok, this rank's plan was known
//!   and every writer's bytes match it, and never after the engine's cancel;
//! - `clean` false only when a writer's link ended without its last piece;
//! - liveness: once the links are drained, a request whose writers all answered, or that
//!   the engine cancelled with every writer's link up, has ended without the clock moving;
//! - at the end (clock past every deadline and late-write limit): nothing left open.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvferry_planner_abi::TokenRange;
use kvferry_protocol::decode::{
    Action, CANCEL_ANSWER_LIMIT, DecodeConfig, DecodeMachine, ExpectCall, LATE_WRITE_LIMIT, LinkId,
};
use kvferry_protocol::{
    AgentMessage, BounceOffer, BouncedPiece, Completion, CompletionStatus, FailureKind, Integrity,
    PieceDigest, RequestOutcome,
};

use crate::seeded::{self, Rng, Simulated, Tally};

const TIMEOUT: Duration = Duration::from_millis(3000);
const PIECE_BYTES: u64 = 100;

/// The engine's view of one request.
#[derive(Debug, Default)]
struct Req {
    expected: bool,
    cancelled: bool,
    linked: bool,
    /// Writers (prefill ranks) and their links, once linked.
    writers: BTreeMap<u32, LinkId>,
    /// Pieces each writer will send.
    pieces: u32,
    /// This rank's plan was handed over (`Some(mismatch)`: one writer's total is off).
    planned: Option<bool>,
    outcomes: Vec<(RequestOutcome, bool)>,
    /// Scatters issued and not answered.
    scattering: u32,
}

/// One writer of one request, on the prefill side.
#[derive(Debug, Default)]
struct Writing {
    claimed: bool,
    cancels: u32,
    /// The next piece to send.
    next: u32,
    /// Its last piece was sent (Ok or failed).
    done: bool,
    /// All its pieces were Ok.
    ok: bool,
    /// Its last piece reached the machine.
    landed: bool,
    /// At a cancel it stops and never answers (a broken writer that keeps its link alive).
    deaf: bool,
}

#[derive(Debug)]
struct Link {
    rank: u32,
    up: bool,
    /// Dropped by the machine or cut: its reader ends at the next network step.
    ending: bool,
    inbound: VecDeque<Completion>,
}

struct Sim {
    rng: Rng,
    now: Instant,
    integrity: bool,
    m: DecodeMachine,
    reqs: BTreeMap<u64, Req>,
    writing: HashMap<(u64, u32), Writing>,
    links: BTreeMap<LinkId, Link>,
    next_link: LinkId,
    /// The current link to each prefill rank.
    current: BTreeMap<u32, LinkId>,
    scatters: Vec<(LinkId, Completion)>,
    /// Links dropped with a writer on them that left a cancel unanswered.
    dropped_deaf: u32,
    log: Vec<String>,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = Rng(seed);
        let integrity = rng.chance(30);
        let m = DecodeMachine::new(DecodeConfig {
            instance: "decode".into(),
            rank: 0,
            timeout: TIMEOUT,
            integrity: integrity.then_some(Integrity::Xxh3),
        });
        let mut sim = Sim {
            rng,
            now: Instant::now(),
            integrity,
            m,
            reqs: BTreeMap::new(),
            writing: HashMap::new(),
            links: BTreeMap::new(),
            next_link: 1,
            current: BTreeMap::new(),
            scatters: Vec::new(),
            dropped_deaf: 0,
            log: Vec::new(),
        };
        for id in 1..=4 {
            sim.reqs.insert(id, Req::default());
        }
        sim.link(0);
        sim.link(1);
        sim
    }

    fn link(&mut self, rank: u32) -> LinkId {
        let id = self.next_link;
        self.next_link += 1;
        self.links.insert(
            id,
            Link {
                rank,
                up: true,
                ending: false,
                inbound: VecDeque::new(),
            },
        );
        self.current.insert(rank, id);
        self.m
            .handle_link_up(id, format!("prefill rank {rank} (link {id})"));
        self.log.push(format!("link {id} to rank {rank}"));
        id
    }

    fn drain(&mut self) {
        while let Some(action) = self.m.poll_action() {
            match action {
                Action::Send { link, message } => self.sent(link, message),
                Action::Scatter { link, completion } => {
                    let r = self.reqs.get_mut(&completion.request).unwrap();
                    assert!(r.outcomes.is_empty(), "scatter after the outcome");
                    assert_eq!(
                        r.scattering, 0,
                        "two scatters of request {} at once",
                        completion.request
                    );
                    r.scattering += 1;
                    self.scatters.push((link, completion));
                }
                Action::DropLink { link } => {
                    self.log.push(format!("drop link {link}"));
                    let deaf = self.writing.iter().any(|((id, c), w)| {
                        w.deaf && !w.landed && self.reqs[id].writers.get(c) == Some(&link)
                    });
                    if deaf {
                        self.dropped_deaf += 1;
                    }
                    if let Some(l) = self.links.get_mut(&link) {
                        l.ending = true;
                    }
                }
                Action::Ended {
                    request,
                    outcome,
                    clean,
                } => self.ended(request, outcome, clean),
            }
        }
    }

    fn sent(&mut self, link: LinkId, message: AgentMessage) {
        let l = &self.links[&link];
        assert!(l.up, "a message on link {link} after it ended: {message:?}");
        let rank = l.rank;
        match message {
            AgentMessage::RequestData(d) => {
                let r = &self.reqs[&d.request];
                assert!(
                    r.outcomes.is_empty(),
                    "a claim of request {} after its outcome",
                    d.request
                );
                assert_eq!(r.writers.get(&d.sender_rank), Some(&link));
                let w = self.writing.entry((d.request, rank)).or_default();
                assert!(
                    !w.claimed,
                    "request {} claimed twice from rank {rank}",
                    d.request
                );
                w.claimed = true;
                w.deaf = self.rng.chance(5);
                self.log.push(format!("claim {} → rank {rank}", d.request));
            }
            AgentMessage::Cancel { request, .. } => {
                let w = self.writing.entry((request, rank)).or_default();
                w.cancels += 1;
                assert_eq!(
                    w.cancels, 1,
                    "request {request} cancelled twice to rank {rank}"
                );
                self.log.push(format!("cancel {request} → rank {rank}"));
                // A deaf writer stops writing and never answers (its link stays up).
                if w.deaf {
                    w.done = true;
                }
                // The writer answers at its next piece, if it has not ended its pair.
                if !w.done {
                    w.done = true;
                    w.ok = false;
                    let piece = w.next;
                    let c = completion(
                        request,
                        rank,
                        piece,
                        true,
                        CompletionStatus::Failed("cancelled by the receiver".into()),
                    );
                    self.links.get_mut(&link).unwrap().inbound.push_back(c);
                }
            }
            other => panic!("the machine sends claims and cancels only, not {other:?}"),
        }
    }

    fn ended(&mut self, id: u64, outcome: RequestOutcome, clean: bool) {
        self.log
            .push(format!("ended {id}: {outcome:?} clean {clean}"));
        let r = self
            .reqs
            .get_mut(&id)
            .expect("an outcome for an unknown request");
        assert!(r.expected, "an outcome for request {id}, never expected");
        assert!(
            r.outcomes.is_empty(),
            "a second outcome for request {id}: {outcome:?}"
        );
        assert_eq!(r.scattering, 0, "request {id} ended under a scatter");
        assert!(
            !matches!(outcome, RequestOutcome::Sent { .. }),
            "request {id} ended Sent on a decode rank"
        );
        let writers: Vec<(u32, LinkId)> = r.writers.iter().map(|(&c, &l)| (c, l)).collect();
        if let RequestOutcome::Received { stats } = &outcome {
            assert!(
                !r.cancelled,
                "request {id} Received after the engine's cancel"
            );
            assert_eq!(
                r.planned,
                Some(false),
                "request {id} Received without a matching plan"
            );
            assert!(!writers.is_empty());
            assert_eq!(
                stats.bytes,
                PIECE_BYTES * u64::from(r.pieces) * writers.len() as u64
            );
            for (c, _) in &writers {
                let w = &self.writing[&(id, *c)];
                assert!(
                    w.ok && w.landed,
                    "request {id} Received without rank {c}'s last piece"
                );
            }
        }
        if !clean {
            let missing = writers.iter().any(|(c, l)| {
                let landed = self.writing.get(&(id, *c)).is_some_and(|w| w.landed);
                !landed && !self.links[l].up
            });
            assert!(
                missing,
                "request {id} ended unclean with every writer answered or up"
            );
        }
        let r = self.reqs.get_mut(&id).unwrap();
        r.outcomes.push((outcome, clean));
    }

    fn step(&mut self) {
        let now = self.now;
        match self.rng.below(12) {
            0 => {
                let id = 1 + self.rng.below(4);
                let r = self.reqs.get_mut(&id).unwrap();
                if !r.expected {
                    r.expected = true;
                    r.pieces = 1 + self.rng.below(3) as u32;
                    let call = ExpectCall {
                        request: id,
                        peer: "prefill".into(),
                        prompt_len: 64 * u64::from(r.pieces),
                        cached_prefix: None,
                        tables: Vec::new(),
                        excluded_views: Vec::new(),
                    };
                    self.log.push(format!("expect {id}"));
                    self.m.expect(now, call).unwrap();
                }
            }
            1 => {
                let id = 1 + self.rng.below(4);
                let r = self.reqs.get_mut(&id).unwrap();
                if r.expected && r.outcomes.is_empty() && self.rng.chance(25) {
                    r.cancelled = true;
                    self.log.push(format!("engine cancels {id}"));
                    self.m.cancel(now, id).unwrap();
                }
            }
            2 => self.link_one(),
            3 => self.plan_one(),
            4..=6 => self.write_one(),
            7 | 8 => self.network(),
            9 => self.scatter_one(),
            10 => self.cut(),
            _ => self.advance(),
        }
        self.drain();
    }

    /// Linking of a request expected and not linked yet ends.
    fn link_one(&mut self) {
        let now = self.now;
        let Some((&id, _)) = self.reqs.iter().find(|(_, r)| r.expected && !r.linked) else {
            return;
        };
        self.reqs.get_mut(&id).unwrap().linked = true;
        if self.rng.chance(10) {
            self.log.push(format!("linking {id} fails"));
            self.m.handle_link_failed(
                now,
                id,
                Some("prefill".into()),
                FailureKind::Peer,
                "unreachable".into(),
            );
            return;
        }
        let ranks: Vec<u32> = if self.rng.chance(50) {
            vec![0, 1]
        } else {
            vec![0]
        };
        let mut writers = BTreeMap::new();
        for c in ranks {
            let link = match self.current.get(&c) {
                Some(&l) if self.links[&l].up && !self.links[&l].ending => l,
                _ => self.link(c),
            };
            writers.insert(c, link);
        }
        let offer = self.rng.chance(40).then_some((
            0,
            BounceOffer {
                offset: 0,
                len: 1 << 20,
            },
        ));
        self.reqs.get_mut(&id).unwrap().writers = writers.clone();
        self.log.push(format!("linked {id}: {writers:?}"));
        let _ = self.m.handle_linked(now, id, writers, offer);
    }

    fn plan_one(&mut self) {
        let now = self.now;
        let ids: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.linked && !r.writers.is_empty() && r.planned.is_none())
            .map(|(&id, _)| id)
            .collect();
        let Some(&id) = ids.first() else { return };
        let mismatch = self.rng.chance(5);
        let overlap = self
            .rng
            .chance(3)
            .then(|| "two writers' plans overlap".to_string());
        let r = self.reqs.get_mut(&id).unwrap();
        r.planned = Some(mismatch || overlap.is_some());
        let expected: BTreeMap<u32, u64> = r
            .writers
            .keys()
            .map(|&c| {
                (
                    c,
                    PIECE_BYTES * u64::from(r.pieces) + u64::from(mismatch && c == 0),
                )
            })
            .collect();
        self.log.push(format!(
            "planned {id}: mismatch {mismatch} overlap {overlap:?}"
        ));
        self.m.handle_expected(now, id, expected, overlap);
    }

    /// A writer with a claim sends its next piece (onto its link).
    fn write_one(&mut self) {
        let open: Vec<(u64, u32)> = self
            .writing
            .iter()
            .filter(|(_, w)| w.claimed && !w.done)
            .map(|(&k, _)| k)
            .collect();
        if open.is_empty() {
            return;
        }
        let (id, c) = open[self.rng.below(open.len() as u64) as usize];
        let link = self.reqs[&id].writers[&c];
        if !self.links[&link].up {
            return;
        }
        let pieces = self.reqs[&id].pieces;
        let fails = self.rng.chance(4);
        let cancelled = self.rng.chance(50);
        let bounced = c == 0 && self.rng.chance(50);
        let w = self.writing.get_mut(&(id, c)).unwrap();
        let piece = w.next;
        w.next += 1;
        let last = fails || piece + 1 == pieces;
        if last {
            w.done = true;
            w.ok = !fails;
        }
        let mut comp = if fails {
            // Now and then the prefill side's engine cancelled it.
            let status = if cancelled {
                CompletionStatus::Cancelled("prefill rank 0 cancelled request".into())
            } else {
                CompletionStatus::Failed("flush failed".into())
            };
            completion(id, c, piece, true, status)
        } else {
            completion(id, c, piece, last, CompletionStatus::Ok)
        };
        if !fails {
            comp.bytes = PIECE_BYTES;
            if bounced {
                comp.bounce = Some(BouncedPiece {
                    offset: u64::from(piece) * PIECE_BYTES,
                    tokens: TokenRange {
                        start: 64 * u64::from(piece),
                        end: 64 * u64::from(piece + 1),
                    },
                });
            }
            if self.integrity {
                comp.digest = Some(PieceDigest {
                    tokens: TokenRange {
                        start: 64 * u64::from(piece),
                        end: 64 * u64::from(piece + 1),
                    },
                    value: 7,
                });
            }
        }
        // A hostile writer now and then repeats a piece: a protocol violation.
        let repeat = self.rng.chance(1).then(|| comp.clone());
        let l = self.links.get_mut(&link).unwrap();
        l.inbound.push_back(comp);
        if let Some(r) = repeat {
            l.inbound.push_back(r);
        }
    }

    /// The next message of one link reaches the machine, or a link that is ending ends.
    fn network(&mut self) {
        let now = self.now;
        let ending: Vec<LinkId> = self
            .links
            .iter()
            .filter(|(_, l)| l.up && l.ending)
            .map(|(&i, _)| i)
            .collect();
        if let Some(&link) = ending.first() {
            if self.rng.chance(50) {
                return self.lose(link, "was dropped by this rank");
            }
        }
        let ready: Vec<LinkId> = self
            .links
            .iter()
            .filter(|(_, l)| l.up && !l.inbound.is_empty())
            .map(|(&i, _)| i)
            .collect();
        if ready.is_empty() {
            return;
        }
        let link = ready[self.rng.below(ready.len() as u64) as usize];
        let c = self
            .links
            .get_mut(&link)
            .unwrap()
            .inbound
            .pop_front()
            .unwrap();
        if c.is_last {
            if let Some(w) = self.writing.get_mut(&(c.request, c.sender_rank)) {
                w.landed = true;
            }
        }
        self.log.push(format!(
            "link {link} → {} piece {} last {} {:?}",
            c.request, c.piece, c.is_last, c.status
        ));
        self.m.handle_completion(now, link, c);
    }

    fn lose(&mut self, link: LinkId, why: &str) {
        let now = self.now;
        let l = self.links.get_mut(&link).unwrap();
        l.up = false;
        l.inbound.clear();
        self.log.push(format!("link {link} lost: {why}"));
        self.m.handle_link_lost(now, link, why);
    }

    fn cut(&mut self) {
        if !self.rng.chance(30) {
            return;
        }
        let up: Vec<LinkId> = self
            .links
            .iter()
            .filter(|(_, l)| l.up)
            .map(|(&i, _)| i)
            .collect();
        if up.is_empty() {
            return;
        }
        let link = up[self.rng.below(up.len() as u64) as usize];
        self.lose(link, "closed its connection");
    }

    fn scatter_one(&mut self) {
        if self.scatters.is_empty() {
            return;
        }
        let i = self.rng.below(self.scatters.len() as u64) as usize;
        let (link, c) = self.scatters.swap_remove(i);
        self.reqs.get_mut(&c.request).unwrap().scattering -= 1;
        let outcome = if self.rng.chance(5) {
            Err((
                FailureKind::Integrity,
                "the digest of the bytes that landed differs".to_string(),
            ))
        } else {
            Ok(1000)
        };
        let now = self.now;
        self.m.handle_scattered(now, link, c, outcome);
    }

    fn advance(&mut self) {
        self.now += Duration::from_millis(self.rng.below(300));
        let quiet = match self.rng.below(3) {
            0 => None,
            _ => Some(Duration::from_millis(self.rng.below(600))),
        };
        if self.m.poll_timeout().is_some_and(|t| t <= self.now) {
            self.m.handle_timeout(self.now, quiet);
        }
    }

    fn finish(&mut self) {
        // Everything that needs no clock: linking, plans, writes, links, scatters.
        for _ in 0..20_000 {
            let idle = self.scatters.is_empty()
                && self
                    .links
                    .values()
                    .all(|l| !l.up || (l.inbound.is_empty() && !l.ending))
                && !self.writing.iter().any(|((id, c), w)| {
                    w.claimed && !w.done && self.links[&self.reqs[id].writers[c]].up
                })
                && !self.reqs.values().any(|r| {
                    r.expected && (!r.linked || (!r.writers.is_empty() && r.planned.is_none()))
                });
            if idle {
                break;
            }
            match self.rng.below(5) {
                0 => self.link_one(),
                1 => self.plan_one(),
                2 => self.write_one(),
                3 => self.scatter_one(),
                _ => self.network(),
            }
            self.drain();
        }
        for (id, r) in &self.reqs {
            if !r.expected || !r.outcomes.is_empty() {
                continue;
            }
            let all_up = r.writers.values().all(|l| self.links[l].up);
            let deaf = r.writers.keys().any(|c| {
                self.writing
                    .get(&(*id, *c))
                    .is_some_and(|w| w.deaf && !w.landed)
            });
            let answered = r
                .writers
                .keys()
                .all(|c| self.writing.get(&(*id, *c)).is_some_and(|w| w.landed));
            assert!(
                !(answered || (r.cancelled && all_up && !deaf)),
                "request {id} waits on the clock though its writers answered ({answered}) or \
                 the engine cancelled it with every link up"
            );
        }
        // The clock past every deadline, cancel-answer limit and late-write wait, a few times:
        // writers still up answer the cancels, deaf ones are dropped, lost links waited out.
        let mut quiet = None;
        for _ in 0..4 {
            self.now += TIMEOUT + LATE_WRITE_LIMIT + Duration::from_secs(1);
            self.m.handle_timeout(self.now, quiet);
            self.drain();
            for _ in 0..1000 {
                let busy = self
                    .links
                    .values()
                    .any(|l| l.up && (l.ending || !l.inbound.is_empty()));
                if !busy && self.scatters.is_empty() {
                    break;
                }
                self.network();
                self.scatter_one();
                self.drain();
            }
            quiet = Some(Duration::from_secs(1));
        }
        assert!(self.m.is_empty(), "requests left open at the end");
        assert_eq!(self.m.poll_timeout(), None);
        for (id, r) in &self.reqs {
            assert_eq!(r.outcomes.len(), usize::from(r.expected), "request {id}");
        }
    }
}

fn completion(
    request: u64,
    sender: u32,
    piece: u32,
    is_last: bool,
    status: CompletionStatus,
) -> Completion {
    Completion {
        request,
        sender_rank: sender,
        receiver_rank: 0,
        piece,
        is_last,
        bytes: 0,
        fragments: 1,
        status,
        bounce: None,
        digest: None,
        views: None,
    }
}

impl Simulated for Sim {
    fn step(&mut self) {
        let (at, before) = (self.now, self.m.poll_timeout());
        Sim::step(self);
        seeded::check_horizon(at, self.m.horizon(), before, self.m.poll_timeout());
    }

    fn finish(&mut self) {
        Sim::finish(self);
    }

    fn log(&self) -> &[String] {
        &self.log
    }

    fn tally(&self, tally: &mut Tally) {
        if self.dropped_deaf > 0 {
            *tally.entry("dropped".into()).or_default() += self.dropped_deaf;
        }
        for r in self.reqs.values() {
            for (outcome, clean) in &r.outcomes {
                let kind = match outcome {
                    RequestOutcome::Sent { .. } => "sent".to_string(),
                    RequestOutcome::Received { .. } => "received".to_string(),
                    RequestOutcome::Cancelled => "cancelled".to_string(),
                    RequestOutcome::Failed { kind, .. } => kind.to_string(),
                };
                *tally.entry(kind).or_default() += 1;
                if !clean {
                    *tally.entry("unclean".into()).or_default() += 1;
                }
            }
        }
    }
}

#[test]
fn ten_thousand_seeded_interleavings_keep_every_invariant() {
    seeded::run(
        Sim::new,
        150,
        &[
            "received",
            "cancelled",
            "peer",
            "write",
            "protocol",
            "integrity",
            "planner",
            "timeout",
            "cancelled-by-peer",
            "unclean",
            "dropped",
        ],
    );
}

/// A machine expecting request 5 (64 tokens) with one link up (1, to prefill rank 0).
fn expecting(now: Instant) -> DecodeMachine {
    let mut m = DecodeMachine::new(DecodeConfig {
        instance: "decode".into(),
        rank: 0,
        timeout: TIMEOUT,
        integrity: None,
    });
    m.handle_link_up(1, "prefill rank 0".into());
    m.expect(
        now,
        ExpectCall {
            request: 5,
            peer: "prefill".into(),
            prompt_len: 64,
            cached_prefix: None,
            tables: Vec::new(),
            excluded_views: Vec::new(),
        },
    )
    .unwrap();
    m
}

#[test]
fn a_cancel_with_every_writer_idle_ends_once_they_answer_without_the_clock() {
    let now = Instant::now();
    let mut m = expecting(now);
    let linked = m.handle_linked(now, 5, [(0, 1)].into(), None);
    assert!(linked.claimed);
    m.cancel(now, 5).unwrap();
    let asked: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        asked.iter().any(|a| matches!(
            a,
            Action::Send {
                link: 1,
                message: AgentMessage::Cancel { request: 5, .. }
            }
        )),
        "{asked:?}"
    );
    m.handle_completion(
        now,
        1,
        completion(
            5,
            0,
            0,
            true,
            CompletionStatus::Failed("cancelled by the receiver".into()),
        ),
    );
    let ended: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        matches!(
            ended.as_slice(),
            [Action::Ended {
                request: 5,
                outcome: RequestOutcome::Cancelled,
                clean: true
            }]
        ),
        "{ended:?}"
    );
}

#[test]
fn a_lost_writer_holds_the_slots_for_the_late_write_grace_then_ends_unclean() {
    let now = Instant::now();
    let mut m = expecting(now);
    m.handle_linked(now, 5, [(0, 1)].into(), None);
    let _: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    m.handle_link_lost(now, 1, "closed its connection");
    assert!(
        m.poll_action().is_none(),
        "its bytes may still be on the way"
    );
    let due = m.poll_timeout().expect("the grace");
    m.handle_timeout(due, Some(Duration::from_millis(300)));
    let ended: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        matches!(
            ended.as_slice(),
            [Action::Ended {
                request: 5,
                outcome: RequestOutcome::Failed {
                    kind: FailureKind::Peer,
                    ..
                },
                clean: false
            }]
        ),
        "{ended:?}"
    );
}

#[test]
fn a_piece_repeated_after_the_last_is_scattered_before_the_request_may_end() {
    // Before the machine, the agent emitted `Received` as soon as its own plan of the bytes
    // came, even while a completion the writer repeated after its last piece was being
    // scattered into the request's slots: the scatter could still write them after the
    // engine had them back.
    let now = Instant::now();
    let mut m = expecting(now);
    let offer = BounceOffer {
        offset: 0,
        len: 1 << 20,
    };
    assert!(
        m.handle_linked(now, 5, [(0, 1)].into(), Some((0, offer)))
            .offer_taken
    );
    let _: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    let mut last = completion(5, 0, 0, true, CompletionStatus::Ok);
    last.bytes = PIECE_BYTES;
    last.bounce = Some(BouncedPiece {
        offset: 0,
        tokens: TokenRange { start: 0, end: 64 },
    });
    for round in 0..2 {
        m.handle_completion(now, 1, last.clone());
        let scatter: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
        assert!(
            matches!(scatter.as_slice(), [Action::Scatter { link: 1, .. }]),
            "{scatter:?}"
        );
        if round == 0 {
            m.handle_scattered(now, 1, last.clone(), Ok(10));
            assert!(
                m.poll_action().is_none(),
                "it waits for this rank's own plan"
            );
        }
    }
    // The plan comes while the repeat is being scattered: nothing ends under the scatter.
    m.handle_expected(now, 5, [(0, PIECE_BYTES)].into(), None);
    assert!(m.poll_action().is_none());
    let refused = (
        FailureKind::Protocol,
        "bounced 100 bytes at 0 of a region whose next free byte is 100".to_string(),
    );
    m.handle_scattered(now, 1, last, Err(refused));
    let ended: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        matches!(
            ended.as_slice(),
            [
                Action::DropLink { link: 1 },
                Action::Ended {
                    request: 5,
                    outcome: RequestOutcome::Failed {
                        kind: FailureKind::Protocol,
                        ..
                    },
                    clean: true
                }
            ]
        ),
        "{ended:?}"
    );
}

#[test]
fn a_writer_that_leaves_a_cancel_unanswered_is_dropped_and_waited_out() {
    // Before, a writer that kept its link alive with keep-alives but never answered a cancel
    // held the request — and its slots — for ever.
    let now = Instant::now();
    let mut m = expecting(now);
    m.handle_linked(now, 5, [(0, 1)].into(), None);
    let _: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    m.cancel(now, 5).unwrap();
    let cancel: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        matches!(cancel.as_slice(), [Action::Send { link: 1, .. }]),
        "{cancel:?}"
    );
    let limit = m.poll_timeout().expect("the wait for the answer");
    assert_eq!(limit, now + CANCEL_ANSWER_LIMIT);
    m.handle_timeout(limit, None);
    let dropped: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        matches!(dropped.as_slice(), [Action::DropLink { link: 1 }]),
        "{dropped:?}"
    );
    // Its bytes may still be on the way: the late-write wait, then an unclean end.
    m.handle_link_lost(limit, 1, "was dropped by this rank");
    assert!(m.poll_action().is_none());
    let due = m.poll_timeout().expect("the late-write grace");
    m.handle_timeout(due, Some(Duration::from_secs(1)));
    let ended: Vec<Action> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        matches!(
            ended.as_slice(),
            [Action::Ended {
                request: 5,
                outcome: RequestOutcome::Cancelled,
                clean: false
            }]
        ),
        "{ended:?}"
    );
}
