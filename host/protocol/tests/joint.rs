//! Both request machines and the sender's executor machine simulated together: a prefill
//! rank (`PrefillMachine` driven as the agent drives it, its write jobs run through an
//! `ExecMachine` as the rank thread runs them) and a decode rank (`DecodeMachine`), over a
//! simulated side channel (in order, late, cut at any moment, each side hearing of the cut
//! when it will), a simulated fabric that records every write into the decode rank's slots,
//! and a clock. The engines on both sides send, expect and cancel; the decode rank frees a
//! request's slots at its end and gives them to the next request; write jobs land, fail, or
//! give up with their puts still in flight (then they land later, while the receiver drains,
//! or are cut); the receiver stalls now and then. Every seed checks end to end:
//!
//! - every byte a `Received` covers was written by that request's own plan (each of its
//!   slots holds its own piece, not an earlier request's straggler nor nothing);
//! - nothing lands after either side's terminal event for its request: not in slots the
//!   decode engine took back, not from sources the prefill engine took back;
//! - one outcome per request per side, and at the end (the clock past every deadline, the
//!   network drained) every request ended on both sides, no window left parked.
//!
//! What each side's own simulation checks of its machine alone (`prefill_machine`,
//! `decode_machine`, `exec_machine`) is not repeated here: this is about their seams.
//! A window cut by force (or with its worker) may leave a write the kernel had already
//! taken (bytes that crossed the wire to a stopped receiver): they land when the receiver
//! next reads, whatever became of the connection, and until then it is not quiet; a stopped
//! receiver runs nothing (its engine and timers included) until it resumes. Not modelled:
//! bounce regions and digests, several ranks per side.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvferry_planner_abi::{SlotTable, TokenRange, ViewId};
use kvferry_protocol::decode::{self, DecodeConfig, DecodeMachine, ExpectCall};
use kvferry_protocol::exec::{self, Admit, ExecConfig, ExecMachine, JobEnd, Look, Target};
use kvferry_protocol::prefill::{
    self, Peer, PlanTask, Planned, PrefillConfig, PrefillMachine, SendCall, WriteCounts, Written,
};
use kvferry_protocol::{AgentMessage, FailureKind, RequestOutcome, Stages};

use crate::seeded::{self, Rng, Simulated, Tally};

const LEASE: Duration = Duration::from_millis(1500);
const TIMEOUT: Duration = Duration::from_millis(3000);
const TOKENS_PER_PIECE: u64 = 64;
const PIECE_BYTES: u64 = 100;
/// Requests per seed (ids 1..=REQUESTS) and the decode rank's slots: fewer than the requests
/// need at once, so slots are reused while earlier requests' writes may be in flight.
const REQUESTS: u64 = 6;
const SLOTS: i64 = 8;

fn views() -> BTreeSet<ViewId> {
    [ViewId { group: 0, view: 0 }].into()
}

/// One request, as both engines see it.
#[derive(Debug, Default)]
struct Req {
    pieces: u32,
    // The prefill engine.
    sent: u32,
    p_cancelled: bool,
    p_outcome: Option<RequestOutcome>,
    // The decode engine.
    expected: bool,
    slots: Vec<i64>,
    linked: bool,
    planned: bool,
    d_cancelled: bool,
    d_outcome: Option<(RequestOutcome, bool)>,
}

impl Req {
    fn prompt_len(&self) -> u64 {
        u64::from(self.pieces) * TOKENS_PER_PIECE
    }
}

/// The side channel between the two ranks: one connection at a time.
#[derive(Debug)]
struct Conn {
    id: u64,
    /// The wire carries messages (and the fabric bytes).
    wire: bool,
    /// Each side still believes it is up.
    up_p: bool,
    up_d: bool,
    /// The prefill rank's registration of the decode rank stands (`RemoteRank::alive`).
    registered: bool,
    to_p: VecDeque<AgentMessage>,
    to_d: VecDeque<AgentMessage>,
}

/// A planned piece on the rank thread's queue.
#[derive(Clone, Copy, Debug)]
struct Job {
    request: u64,
    peer: u64,
    piece: u32,
    is_last: bool,
    slot: i64,
}

/// A write that gave up with its puts in flight.
#[derive(Debug)]
struct Window {
    job: Job,
    /// Its bytes have not landed.
    pending: bool,
    /// Its endpoint was closed by force (what was in flight is dropped).
    closed: bool,
    /// Its bytes crossed the wire to a stopped receiver: they sit in its socket, and land
    /// when it reads again, whatever happens to the connection or the window meanwhile.
    in_socket: bool,
}

struct World {
    rng: Rng,
    start: Instant,
    now: Instant,
    prefill: PrefillMachine<u32>,
    decode: DecodeMachine,
    exec: ExecMachine<u64>,
    forcible: bool,
    reqs: BTreeMap<u64, Req>,
    conns: Vec<Conn>,
    next_conn: u64,
    /// The decode rank's receiver is stopped: nothing reaches it or leaves it.
    stalled: bool,
    /// Connections whose registration the executor ended: the agent closes their session at
    /// its next keep-alive (the next tick of the clock), not at once.
    closing: Vec<u64>,
    planning: Vec<PlanTask<u32>>,
    to_queue: Vec<(PlanTask<u32>, usize)>,
    jobs: VecDeque<Job>,
    /// Reports the executor holds: job number -> (job, its result).
    reports: HashMap<u64, (Job, Result<WriteCounts, String>)>,
    next_report: u64,
    windows: HashMap<u64, Window>,
    next_window: u64,
    /// Writes of windows cut by force or with their worker that the kernel had already
    /// taken: they land when the receiver next reads its socket.
    kernel: Vec<Job>,
    /// The decode rank's slots: who last wrote each.
    memory: HashMap<i64, (u64, u32)>,
    free: BTreeSet<i64>,
    /// When bytes last landed at the decode rank.
    landed_at: Instant,
    log: Vec<String>,
    tally: Tally,
}

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let start = Instant::now();
        let prefill = PrefillMachine::new(PrefillConfig {
            rank: 0,
            me: "p rank 0".into(),
            lease: LEASE,
            timeout: TIMEOUT,
            max_stashed: 4096,
        });
        let decode = DecodeMachine::new(DecodeConfig {
            instance: "d".into(),
            rank: 0,
            timeout: TIMEOUT,
            integrity: None,
        });
        let exec = ExecMachine::new(ExecConfig {
            gone_drain_grace: Duration::from_millis(500),
            stall_limit: Duration::from_millis(2000),
            look_every: Duration::from_millis(5),
            alive_check: Duration::from_millis(20),
        });
        let reqs = (1..=REQUESTS)
            .map(|id| {
                let pieces = 1 + rng.below(3) as u32;
                (
                    id,
                    Req {
                        pieces,
                        ..Req::default()
                    },
                )
            })
            .collect();
        let mut world = Self {
            forcible: rng.chance(50),
            rng,
            start,
            now: start,
            prefill,
            decode,
            exec,
            reqs,
            conns: Vec::new(),
            next_conn: 1,
            stalled: false,
            closing: Vec::new(),
            planning: Vec::new(),
            to_queue: Vec::new(),
            jobs: VecDeque::new(),
            reports: HashMap::new(),
            next_report: 0,
            windows: HashMap::new(),
            next_window: 0,
            kernel: Vec::new(),
            memory: HashMap::new(),
            free: (0..SLOTS).collect(),
            landed_at: start,
            log: Vec::new(),
            tally: Tally::new(),
        };
        world.connect();
        world
    }

    fn ms(&self) -> u128 {
        self.now.duration_since(self.start).as_millis()
    }

    fn note(&mut self, line: String) {
        let at = self.ms();
        self.log.push(format!("{at:>6} {line}"));
    }

    fn count(&mut self, kind: &str) {
        *self.tally.entry(kind.into()).or_default() += 1;
    }

    fn conn(&self, id: u64) -> Option<&Conn> {
        self.conns.iter().find(|c| c.id == id)
    }

    fn conn_mut(&mut self, id: u64) -> Option<&mut Conn> {
        self.conns.iter_mut().find(|c| c.id == id)
    }

    /// A new connection (once both sides heard the last one end).
    fn connect(&mut self) {
        if self.conns.iter().any(|c| c.up_p || c.up_d) {
            return;
        }
        let id = self.next_conn;
        self.next_conn += 1;
        self.note(format!("connection {id} up"));
        self.conns.push(Conn {
            id,
            wire: true,
            up_p: true,
            up_d: true,
            registered: true,
            to_p: VecDeque::new(),
            to_d: VecDeque::new(),
        });
        self.prefill.handle_connected(
            id,
            Peer {
                instance: "d".into(),
                rank: 0,
                name: "d rank 0".into(),
                targets: Ok([0].into()),
            },
        );
        self.decode.handle_link_up(id, "p rank 0".into());
    }

    /// The wire of connection `id` is cut: what it carried is lost; each side hears later.
    fn cut(&mut self, id: u64, why: &str) {
        let why = why.to_string();
        if let Some(c) = self.conn_mut(id) {
            if c.wire {
                c.wire = false;
                c.to_p.clear();
                c.to_d.clear();
                self.note(format!("connection {id} cut: {why}"));
            }
        }
    }

    // ------------------------------------------------------------------ the fabric

    /// A write of `job` lands in the decode rank's slot; `sent_before`: its bytes left the
    /// prefill rank's sources earlier (the kernel held them).
    fn land(&mut self, job: Job, sent_before: bool) {
        let r = &self.reqs[&job.request];
        assert!(
            r.d_outcome.is_none(),
            "a write of request {} piece {} landed in slot {} after the decode side's outcome \
             {:?}",
            job.request,
            job.piece,
            job.slot,
            r.d_outcome
        );
        assert!(
            sent_before || r.p_outcome.is_none(),
            "a write of request {} piece {} read its sources after the prefill side's outcome \
             {:?}",
            job.request,
            job.piece,
            r.p_outcome
        );
        self.note(format!(
            "lands: request {} piece {} in slot {}",
            job.request, job.piece, job.slot
        ));
        self.memory.insert(job.slot, (job.request, job.piece));
        self.landed_at = self.now;
    }

    /// Whether bytes can reach the decode rank over connection `id` now.
    fn delivers(&self, id: u64) -> bool {
        !self.stalled && self.conn(id).is_some_and(|c| c.wire)
    }

    /// The rank thread runs its next job.
    fn write_one(&mut self) {
        self.look();
        let Some(job) = self.jobs.pop_front() else {
            return;
        };
        let target = Target {
            peer: job.peer,
            rank: 0,
        };
        let alive = self.conn(job.peer).is_some_and(|c| c.registered && c.up_p);
        let report = self.next_report;
        self.next_report += 1;
        let admit = self.exec.admit(target, alive, false);
        let (end, result) = match admit {
            Admit::Gone => (JobEnd::Done, Err("the receiver is gone".to_string())),
            Admit::Nothing => unreachable!("no empty plans here"),
            Admit::Behind { .. } => {
                self.count("behind a quarantine");
                (JobEnd::Done, Err("stuck behind a quarantine".into()))
            }
            Admit::Write => {
                let counts = WriteCounts {
                    bytes: PIECE_BYTES,
                    fragments: 1,
                    puts: 1,
                };
                let roll = self.rng.below(100);
                if self.delivers(job.peer) && roll < 85 {
                    self.land(job, false);
                    (JobEnd::Done, Ok(counts))
                } else if self.delivers(job.peer) && roll < 90 {
                    (JobEnd::Done, Err("put refused".into()))
                } else {
                    let window = self.next_window;
                    self.next_window += 1;
                    let in_socket = self.stalled && self.conn(job.peer).is_some_and(|c| c.wire);
                    self.windows.insert(
                        window,
                        Window {
                            job,
                            pending: true,
                            closed: false,
                            in_socket,
                        },
                    );
                    self.count("quarantined");
                    let end = JobEnd::Left {
                        window,
                        in_flight: 1,
                        bounced: false,
                        forcible: self.forcible,
                    };
                    (end, Err("timed out with puts in flight".into()))
                }
            }
        };
        self.note(format!(
            "job: request {} piece {} to connection {}: {admit:?} -> {result:?}",
            job.request, job.piece, job.peer
        ));
        self.reports.insert(report, (job, result));
        self.exec.handle_job(self.now, target, end, report);
        self.drive_exec();
    }

    /// A cut window's write whose bytes already sit in the stopped receiver's socket: it
    /// lands when the receiver next reads, whatever became of the connection since.
    fn hold_in_socket(&mut self, job: Job) {
        self.note(format!(
            "the kernel holds request {} piece {} after the cut",
            job.request, job.piece
        ));
        self.count("late bytes");
        self.kernel.push(job);
    }

    /// UCX's progress: a parked window's bytes land while its receiver drains.
    fn progress(&mut self) {
        let held = std::mem::take(&mut self.kernel);
        for job in held {
            if self.stalled {
                self.kernel.push(job);
            } else {
                self.land(job, true);
            }
        }
        let ids: Vec<u64> = self.windows.keys().copied().collect();
        for id in ids {
            let w = &self.windows[&id];
            let reaches = if w.in_socket {
                !self.stalled
            } else {
                self.delivers(w.job.peer)
            };
            if w.pending && !w.closed && reaches && self.rng.chance(60) {
                let job = w.job;
                self.land(job, false);
                self.windows.get_mut(&id).unwrap().pending = false;
            }
        }
    }

    /// The driver looks at every parked window, then carries out what the executor asks.
    fn look(&mut self) {
        let parked: Vec<u64> = self.exec.parked().collect();
        for id in parked {
            let w = &self.windows[&id];
            let in_flight = usize::from(w.pending && !w.closed);
            let alive = self
                .conn(w.job.peer)
                .is_some_and(|c| c.registered && c.up_p);
            let look = Look {
                in_flight,
                settled: in_flight == 0,
                alive,
            };
            self.exec.handle_look(self.now, id, look);
        }
        self.exec.handle_tick(self.now);
        self.drive_exec();
    }

    fn drive_exec(&mut self) {
        while let Some(action) = self.exec.poll_action() {
            match action {
                exec::Action::EndRegistration { window } => {
                    let peer = self.windows[&window].job.peer;
                    self.note(format!("executor gives up connection {peer}"));
                    self.count("given up");
                    if let Some(c) = self.conn_mut(peer) {
                        c.registered = false;
                    }
                    // The agent closes the session at its next keep-alive: messages sent
                    // meanwhile still go out.
                    self.closing.push(peer);
                }
                exec::Action::ForceClose { window, .. } => {
                    self.count("force closed");
                    let w = self.windows.get_mut(&window).unwrap();
                    w.closed = true;
                    let (job, held) = (w.job, w.pending && w.in_socket);
                    if held {
                        self.hold_in_socket(job);
                    }
                }
                exec::Action::CutDue { .. } => {}
                exec::Action::ReplaceWorker { windows } => {
                    self.count("worker replaced");
                    for id in windows {
                        let w = self.windows.remove(&id).unwrap();
                        if w.pending && !w.closed && w.in_socket {
                            self.hold_in_socket(w.job);
                        }
                    }
                    self.exec.handle_replaced(true);
                }
                exec::Action::Release { window } => {
                    let w = self.windows.remove(&window).expect("released twice");
                    assert!(!w.pending || w.closed, "released with bytes in flight");
                }
                exec::Action::Run(report) => {
                    let (job, result) = self.reports.remove(&report).expect("reported twice");
                    let registered = self.conn(job.peer).is_some_and(|c| c.registered && c.up_p);
                    self.prefill.handle_released(job.request, 0);
                    let written = Written {
                        piece: job.piece,
                        is_last: job.is_last,
                        result,
                        bounce: None,
                        digest: None,
                        views: None,
                        stages: Stages::default(),
                        registered,
                    };
                    self.prefill
                        .handle_written(self.now, job.request, 0, written);
                }
            }
        }
        self.drain();
    }

    // ------------------------------------------------------------------ the machines' asks

    fn drain(&mut self) {
        loop {
            let mut any = false;
            while let Some(action) = self.prefill.poll_action() {
                any = true;
                match action {
                    prefill::Action::Send { peer, message } => {
                        if let Some(c) = self.conn_mut(peer) {
                            if c.wire {
                                c.to_d.push_back(message);
                            }
                        }
                    }
                    prefill::Action::Plan(task) => self.planning.push(task),
                    prefill::Action::Ended { request, outcome } => {
                        self.prefill_ended(request, outcome)
                    }
                }
            }
            while let Some(action) = self.decode.poll_action() {
                any = true;
                match action {
                    decode::Action::Send { link, message } => {
                        if let Some(c) = self.conn_mut(link) {
                            if c.wire {
                                c.to_p.push_back(message);
                            }
                        }
                    }
                    decode::Action::Scatter { .. } => panic!("nothing bounces here"),
                    decode::Action::DropLink { link } => self.cut(link, "dropped by the decode"),
                    decode::Action::Ended {
                        request,
                        outcome,
                        clean,
                    } => self.decode_ended(request, outcome, clean),
                }
            }
            if !any {
                return;
            }
        }
    }

    fn prefill_ended(&mut self, id: u64, outcome: RequestOutcome) {
        self.note(format!("prefill ends {id}: {outcome:?}"));
        assert!(
            !self
                .windows
                .values()
                .any(|w| w.job.request == id && w.pending && !w.closed),
            "the prefill side ended request {id} while a window of it may still read its sources"
        );
        assert!(
            !self.jobs.iter().any(|j| j.request == id),
            "the prefill side ended request {id} with a job of it queued"
        );
        let r = self.reqs.get_mut(&id).expect("an outcome for no request");
        assert!(r.p_outcome.is_none(), "a second prefill outcome for {id}");
        let kind = match &outcome {
            RequestOutcome::Sent { .. } => "sent",
            RequestOutcome::Cancelled => "prefill cancelled",
            RequestOutcome::Failed { kind, .. } => {
                let kind = format!("prefill failed: {kind}");
                *self.tally.entry(kind).or_default() += 1;
                "prefill failed"
            }
            RequestOutcome::Received { .. } => panic!("Received on the prefill side"),
        };
        r.p_outcome = Some(outcome);
        self.count(kind);
    }

    fn decode_ended(&mut self, id: u64, outcome: RequestOutcome, clean: bool) {
        self.note(format!("decode ends {id}: {outcome:?} clean {clean}"));
        let r = self.reqs.get_mut(&id).expect("an outcome for no request");
        assert!(r.d_outcome.is_none(), "a second decode outcome for {id}");
        let kind = match &outcome {
            RequestOutcome::Received { .. } => {
                assert!(!r.d_cancelled, "request {id} received after its cancel");
                // Every byte it covers is its own plan's.
                for (k, slot) in r.slots.iter().enumerate() {
                    let want = (id, k as u32);
                    assert_eq!(
                        self.memory.get(slot),
                        Some(&want),
                        "request {id} Received, but its slot {slot} (piece {k}) holds {:?}",
                        self.memory.get(slot)
                    );
                }
                "received"
            }
            RequestOutcome::Cancelled => "decode cancelled",
            RequestOutcome::Failed { kind, .. } => {
                let kind = format!("decode failed: {kind}");
                *self.tally.entry(kind).or_default() += 1;
                "decode failed"
            }
            RequestOutcome::Sent { .. } => panic!("Sent on the decode side"),
        };
        r.d_outcome = Some((outcome, clean));
        // The engine takes its slots back; the next request may get them.
        let slots = std::mem::take(&mut r.slots);
        self.free.extend(slots);
        self.count(kind);
    }

    // ------------------------------------------------------------------ the steps

    fn engine_send(&mut self) {
        let id = 1 + self.rng.below(REQUESTS);
        let r = &self.reqs[&id];
        if r.sent == r.pieces || r.p_cancelled || r.p_outcome.is_some() {
            return;
        }
        let k = r.sent;
        let tokens = TokenRange {
            start: u64::from(k) * TOKENS_PER_PIECE,
            end: u64::from(k + 1) * TOKENS_PER_PIECE,
        };
        let call = SendCall {
            request: id,
            to: Some("d".into()),
            prompt_len: r.prompt_len(),
            tokens,
            is_last: k + 1 == r.pieces,
            carried: None,
            tables: k,
        };
        let taken = self.prefill.handle_send(self.now, call, &views());
        self.note(format!("prefill engine sends {id} piece {k}: {taken:?}"));
        if taken.is_ok() {
            self.reqs.get_mut(&id).unwrap().sent += 1;
        }
    }

    fn engine_expect(&mut self) {
        if self.stalled {
            return;
        }
        let id = 1 + self.rng.below(REQUESTS);
        let r = &self.reqs[&id];
        if r.expected || self.free.len() < r.pieces as usize {
            return;
        }
        let slots: Vec<i64> = (0..r.pieces)
            .map(|_| {
                let i = self.rng.below(self.free.len() as u64) as usize;
                let slot = *self.free.iter().nth(i).unwrap();
                self.free.remove(&slot);
                slot
            })
            .collect();
        let call = ExpectCall {
            request: id,
            peer: "p".into(),
            prompt_len: r.prompt_len(),
            cached_prefix: None,
            tables: vec![SlotTable::new(slots.iter().copied())],
            excluded_views: Vec::new(),
        };
        self.note(format!("decode engine expects {id} into slots {slots:?}"));
        assert!(self.decode.expect(self.now, call).is_ok());
        let r = self.reqs.get_mut(&id).unwrap();
        r.expected = true;
        r.slots = slots;
    }

    fn engine_cancel(&mut self) {
        let id = 1 + self.rng.below(REQUESTS);
        let now = self.now;
        let r = self.reqs.get_mut(&id).unwrap();
        if self.rng.chance(50) {
            if r.sent > 0 && r.p_outcome.is_none() && !r.p_cancelled {
                r.p_cancelled = true;
                self.note(format!("prefill engine cancels {id}"));
                let _ = self.prefill.cancel(now, id);
            }
        } else if r.expected && r.d_outcome.is_none() && !r.d_cancelled && !self.stalled {
            r.d_cancelled = true;
            self.note(format!("decode engine cancels {id}"));
            let _ = self.decode.cancel(now, id);
        }
    }

    /// The decode agent links an expected request to its writer (or finds none), or hands
    /// the machine its own plan of the bytes.
    fn link_or_plan(&mut self) {
        if self.stalled {
            return;
        }
        let open: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.expected && r.d_outcome.is_none() && !(r.linked && r.planned))
            .map(|(&id, _)| id)
            .collect();
        if open.is_empty() {
            return;
        }
        let id = self.rng.pick(&open);
        let now = self.now;
        let r = &self.reqs[&id];
        if !r.linked {
            let link = self.conns.iter().find(|c| c.up_d).map(|c| c.id);
            self.reqs.get_mut(&id).unwrap().linked = true;
            match link {
                Some(link) => {
                    self.note(format!("decode links {id} over {link}"));
                    self.decode.handle_linked(now, id, [(0, link)].into(), None);
                }
                None => {
                    self.note(format!("decode cannot link {id}"));
                    self.decode.handle_link_failed(
                        now,
                        id,
                        Some("p rank 0".into()),
                        FailureKind::Peer,
                        "no connection".into(),
                    );
                }
            }
        } else if !r.planned {
            let bytes = u64::from(r.pieces) * PIECE_BYTES;
            self.reqs.get_mut(&id).unwrap().planned = true;
            self.decode
                .handle_expected(now, id, [(0, bytes)].into(), None);
        }
    }

    /// Delivers the next message one way on the connection.
    fn network(&mut self) {
        let now = self.now;
        let to_prefill = self.rng.chance(50);
        let Some(c) = self.conns.iter_mut().find(|c| {
            c.wire
                && if to_prefill {
                    !c.to_p.is_empty()
                } else {
                    !c.to_d.is_empty()
                }
        }) else {
            return;
        };
        if self.stalled {
            return;
        }
        let id = c.id;
        if to_prefill {
            let message = c.to_p.pop_front().unwrap();
            self.note(format!("→ prefill over {id}: {}", brief(&message)));
            match message {
                AgentMessage::RequestData(data) => {
                    let _ = self.prefill.handle_claim(now, id, data);
                }
                AgentMessage::Cancel { request, reason } => {
                    self.prefill.handle_cancel(now, id, request, &reason)
                }
                AgentMessage::Hold { request } => {
                    let _ = self.prefill.handle_hold(now, id, request);
                }
                other => panic!("the decode machine sent {other:?}"),
            }
        } else {
            let message = c.to_d.pop_front().unwrap();
            self.note(format!("→ decode over {id}: {}", brief(&message)));
            match message {
                AgentMessage::Completion(completion) => {
                    self.decode.handle_completion(now, id, completion)
                }
                other => panic!("the prefill machine sent {other:?}"),
            }
        }
    }

    /// A planning task finishes; its pieces are queued on the rank thread later.
    fn plan_one(&mut self) {
        if self.planning.is_empty() {
            return;
        }
        let i = self.rng.below(self.planning.len() as u64) as usize;
        let task = self.planning.swap_remove(i);
        let pieces = task.chunks.len();
        let through = task.chunks.last().map_or(0, |(k, _)| k + 1);
        let planned = Planned {
            through,
            pieces,
            bounce_cursor: 0,
            stages: Stages::default(),
        };
        let queue =
            self.prefill
                .handle_planned(self.now, task.request, task.rank, task.peer, planned);
        if queue {
            self.to_queue.push((task, pieces));
        }
    }

    fn queue_one(&mut self) {
        if self.to_queue.is_empty() {
            return;
        }
        let i = self.rng.below(self.to_queue.len() as u64) as usize;
        let (task, pieces) = self.to_queue.swap_remove(i);
        // The plan: piece k goes to the k-th slot of the claim's table (one block a piece).
        let table = &task.data.slot_tables[0].slots;
        for (k, chunk) in task.chunks.iter().take(pieces) {
            self.jobs.push_back(Job {
                request: task.request,
                peer: task.peer,
                piece: *k,
                is_last: chunk.last,
                slot: table[*k as usize],
            });
        }
        self.prefill
            .handle_queued(self.now, task.request, task.rank, task.peer, None);
    }

    /// The network or a side hears of a cut; a new connection once both have.
    fn links(&mut self) {
        let now = self.now;
        let roll = self.rng.below(100);
        let live: Vec<u64> = self.conns.iter().filter(|c| c.wire).map(|c| c.id).collect();
        if roll < 6 {
            if let Some(&id) = live.first() {
                self.cut(id, "the network");
            }
            return;
        }
        if roll < 12 {
            self.stalled = !self.stalled;
            let stalled = self.stalled;
            self.note(format!(
                "decode receiver {}",
                if stalled { "stops" } else { "resumes" }
            ));
            if stalled {
                self.count("stalled");
            }
            return;
        }
        // A side hears of a cut wire (its peer timeout, a reset).
        let heard: Vec<(u64, bool)> = self
            .conns
            .iter()
            .filter(|c| !c.wire && (c.up_p || c.up_d))
            .map(|c| (c.id, c.up_p))
            .collect();
        if let Some(&(id, up_p)) = heard.first() {
            // A stopped decode process hears nothing until it resumes.
            let prefill_hears =
                up_p && (self.stalled || self.rng.chance(50) || !self.conn(id).unwrap().up_d);
            if !prefill_hears && self.stalled {
                return;
            }
            let c = self.conn_mut(id).unwrap();
            if prefill_hears {
                c.up_p = false;
                c.registered = false;
                self.note(format!("prefill hears {id} is gone"));
                self.prefill.handle_lost(now, id, "closed its connection");
            } else {
                c.up_d = false;
                self.note(format!("decode hears {id} is gone"));
                self.decode
                    .handle_link_lost(now, id, "closed its connection");
            }
            self.conns.retain(|c| c.wire || c.up_p || c.up_d);
        }
        self.connect();
    }

    fn advance(&mut self) {
        let by = Duration::from_millis(self.rng.pick(&[1, 10, 50, 200, 600]));
        self.now += by;
        self.timeouts();
    }

    fn timeouts(&mut self) {
        for peer in std::mem::take(&mut self.closing) {
            self.cut(peer, "given up for not draining");
        }
        let now = self.now;
        if self.prefill.poll_timeout().is_some_and(|at| at <= now) {
            self.prefill.handle_timeout(now);
        }
        // A stopped decode process runs nothing, its timers included.
        if !self.stalled && self.decode.poll_timeout().is_some_and(|at| at <= now) {
            // Its worker has been quiet since bytes last landed, unless bytes wait in its
            // socket (its wake-up descriptor is readable: not quiet).
            let unread = !self.kernel.is_empty()
                || self
                    .windows
                    .values()
                    .any(|w| w.in_socket && w.pending && !w.closed);
            let quiet = (!unread).then(|| now.saturating_duration_since(self.landed_at));
            self.decode.handle_timeout(now, quiet);
        }
        if self.exec.poll_timeout().is_some_and(|at| at <= now) {
            self.look();
        }
    }
}

fn brief(m: &AgentMessage) -> String {
    match m {
        AgentMessage::RequestData(d) => format!("claim {}", d.request),
        AgentMessage::Completion(c) => format!(
            "completion {} piece {} last {} {:?}",
            c.request, c.piece, c.is_last, c.status
        ),
        AgentMessage::Cancel { request, .. } => format!("cancel {request}"),
        other => format!("{other:?}"),
    }
}

impl Simulated for World {
    fn step(&mut self) {
        match self.rng.below(20) {
            0..=2 => self.engine_send(),
            3 | 4 => self.engine_expect(),
            5 if self.rng.chance(40) => self.engine_cancel(),
            6 | 7 => self.link_or_plan(),
            8..=10 => self.network(),
            11 => self.plan_one(),
            12 => self.queue_one(),
            13 | 14 => self.write_one(),
            15 => self.progress(),
            16 => self.links(),
            17 => self.advance(),
            _ => self.network(),
        }
        self.drain();
    }

    fn finish(&mut self) {
        // The engines do their part (every request sent and expected), the receiver resumes,
        // the network heals; then everything runs out with the clock moving on.
        self.stalled = false;
        for _ in 0..20_000 {
            let done = self
                .reqs
                .values()
                .all(|r| r.p_outcome.is_some() && r.d_outcome.is_some())
                && !self.exec.is_quarantining();
            if done {
                break;
            }
            self.engine_send();
            self.engine_expect();
            self.link_or_plan();
            self.network();
            self.plan_one();
            self.queue_one();
            self.write_one();
            self.progress();
            if self.rng.chance(5) {
                self.links();
                self.stalled = false;
            }
            if self.rng.chance(20) {
                self.now += Duration::from_millis(50);
                self.timeouts();
            }
            self.drain();
        }
        for (id, r) in &self.reqs {
            assert!(
                r.p_outcome.is_some(),
                "request {id} never ended on the prefill side: {r:?}"
            );
            assert!(
                r.d_outcome.is_some(),
                "request {id} never ended on the decode side: {r:?}"
            );
        }
        assert!(!self.exec.is_quarantining(), "a window still parked");
        assert!(
            self.reports.is_empty(),
            "reports never run: {:?}",
            self.reports
        );
    }

    fn log(&self) -> &[String] {
        &self.log
    }

    fn tally(&self, tally: &mut Tally) {
        for (k, v) in &self.tally {
            *tally.entry(k.clone()).or_default() += v;
        }
    }
}

#[test]
fn both_sides_and_the_executor_agree_over_seeds() {
    seeded::run(
        World::new,
        200,
        &[
            "received",
            "sent",
            "decode failed",
            "decode cancelled",
            "prefill failed",
            "prefill cancelled",
            "quarantined",
            "behind a quarantine",
            "force closed",
            "worker replaced",
            "given up",
            "late bytes",
        ],
    );
}
