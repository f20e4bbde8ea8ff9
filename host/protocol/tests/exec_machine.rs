//! The sender's executor machine (`kvferry_protocol::exec`) under seeded simulation: jobs to
//! three receiver ranks that end well, give up with puts in flight or are refused behind a
//! parked window; receivers that drain, stall, or whose registration ends; endpoints that can
//! be closed by force or not; worker replacements that work or fail; forgotten peers with
//! follow-ups; and a clock — all in one thread, in an order drawn from the seed. Every run
//! checks what the rank thread's callers rely on:
//!
//! - every report runs exactly once, and at the end none is left;
//! - a job that left puts in flight reports only once its window was released (drained) or
//!   abandoned with a replaced worker; a released window had settled;
//! - per receiver rank, reports run in the order the jobs came (those refused behind a parked
//!   window, or that wrote nothing, after the parked job's);
//! - a window is cut (closed by force, or marked due) only once its receiver's registration
//!   had ended for the grace, or nothing in it finished for the stall limit; the worker is
//!   replaced only when every parked window's receiver is gone;
//! - a forgotten peer's follow-up runs only once none of its windows is parked;
//! - no rule waits on real time: the whole run is simulated.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kvferry_protocol::exec::{
    Action, Admit, CutReason, ExecConfig, ExecMachine, JobEnd, Look, Target, WindowId,
};

use crate::seeded::{self, Rng, Simulated, Tally};

const GRACE: Duration = Duration::from_millis(100);
const STALL: Duration = Duration::from_millis(1000);

fn config() -> ExecConfig {
    ExecConfig {
        gone_drain_grace: GRACE,
        stall_limit: STALL,
        look_every: Duration::from_millis(5),
        alive_check: Duration::from_millis(20),
    }
}

/// What runs: a job's report, or a forgotten peer's follow-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Run {
    Report(u64),
    Forgotten(u64),
}

/// One receiver rank as the simulated world has it.
#[derive(Debug)]
struct Receiver {
    target: Target,
    /// When its registration ended.
    ended: Option<Instant>,
    /// Whether it takes in what is put to it.
    draining: bool,
    /// Whether endpoints to it are in peer error mode.
    forcible: bool,
}

/// A window of puts left in flight.
#[derive(Debug)]
struct Window {
    target: usize,
    in_flight: usize,
    /// When one of its operations last finished (or it was parked).
    progressed: Instant,
    /// Its endpoint was closed by force: UCX fails what is left.
    closed: bool,
    /// Its job bounced (its puts may read the staging buffer).
    bounced: bool,
}

/// How a job went.
#[derive(Debug)]
struct Job {
    target: usize,
    /// The window it left, if any.
    window: Option<WindowId>,
    ran: u32,
}

struct World {
    rng: Rng,
    start: Instant,
    now: Instant,
    machine: ExecMachine<Run>,
    receivers: Vec<Receiver>,
    windows: HashMap<WindowId, Window>,
    /// Windows released or abandoned with a worker.
    gone_windows: Vec<WindowId>,
    jobs: Vec<Job>,
    /// Follow-ups asked, per peer, and how many ran.
    forgotten: BTreeMap<u64, (u32, u32)>,
    next_window: WindowId,
    /// Reports run, in order, per target index.
    order: Vec<Vec<u64>>,
    log: Vec<String>,
    tally: Tally,
}

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let receivers = (0..3)
            .map(|i| Receiver {
                target: Target {
                    peer: 1 + i / 2,
                    rank: (i % 2) as u32,
                },
                ended: None,
                draining: rng.chance(60),
                forcible: rng.chance(50),
            })
            .collect();
        let start = Instant::now();
        Self {
            rng,
            start,
            now: start,
            machine: ExecMachine::new(config()),
            receivers,
            windows: HashMap::new(),
            gone_windows: Vec::new(),
            jobs: Vec::new(),
            forgotten: BTreeMap::new(),
            next_window: 1,
            order: vec![Vec::new(); 3],
            log: Vec::new(),
            tally: Tally::new(),
        }
    }

    fn alive(&self, t: usize) -> bool {
        self.receivers[t].ended.is_none()
    }

    /// The driver's look at every parked window, then its tick, then what they asked.
    fn look(&mut self) {
        let parked: Vec<WindowId> = self.machine.parked().collect();
        for id in parked {
            let w = &self.windows[&id];
            let look = Look {
                in_flight: w.in_flight,
                settled: w.in_flight == 0,
                alive: self.alive(w.target),
            };
            self.machine.handle_look(self.now, id, look);
        }
        self.machine.handle_tick(self.now);
        self.drive();
    }

    fn drive(&mut self) {
        while let Some(action) = self.machine.poll_action() {
            self.log.push(format!("{:?}: {action:?}", self.ms()));
            match action {
                Action::EndRegistration { window } => {
                    let w = &self.windows[&window];
                    assert!(
                        self.now.duration_since(w.progressed) >= STALL,
                        "window {window} given up {:?} after its last progress",
                        self.now.duration_since(w.progressed)
                    );
                    let r = &mut self.receivers[w.target];
                    r.ended.get_or_insert(self.now);
                    self.tally.entry("stalled".into()).or_default();
                    *self.tally.get_mut("stalled").unwrap() += 1;
                }
                Action::ForceClose {
                    window,
                    target,
                    reason,
                } => {
                    self.check_cut(window, reason);
                    let w = self.windows.get_mut(&window).unwrap();
                    assert_eq!(self.receivers[w.target].target, target);
                    assert!(self.receivers[w.target].forcible);
                    w.closed = true;
                    *self.tally.entry("force closed".into()).or_default() += 1;
                }
                Action::CutDue { window, reason } => {
                    self.check_cut(window, reason);
                    assert!(!self.receivers[self.windows[&window].target].forcible);
                }
                Action::ReplaceWorker { windows } => {
                    let parked: Vec<WindowId> = self.machine.parked().collect();
                    assert_eq!(
                        windows, parked,
                        "a replacement abandons every parked window"
                    );
                    for id in &windows {
                        let t = self.windows[id].target;
                        assert!(!self.alive(t), "worker replaced under a live receiver");
                    }
                    let replaced = self.rng.chance(85);
                    if replaced {
                        for id in windows {
                            self.windows.remove(&id);
                            self.gone_windows.push(id);
                        }
                        *self.tally.entry("worker replaced".into()).or_default() += 1;
                    }
                    self.machine.handle_replaced(replaced);
                }
                Action::Release { window } => {
                    let w = self.windows.remove(&window).expect("released twice");
                    assert_eq!(w.in_flight, 0, "window {window} released unsettled");
                    self.gone_windows.push(window);
                    *self.tally.entry("released".into()).or_default() += 1;
                }
                Action::Run(Run::Report(job)) => {
                    let j = &mut self.jobs[job as usize];
                    j.ran += 1;
                    assert_eq!(j.ran, 1, "job {job} reported twice");
                    if let Some(w) = j.window {
                        assert!(
                            self.gone_windows.contains(&w),
                            "job {job} reported while its window {w} may still write"
                        );
                    }
                    self.order[j.target].push(job);
                }
                Action::Run(Run::Forgotten(peer)) => {
                    assert!(
                        !self
                            .windows
                            .values()
                            .any(|w| self.receivers[w.target].target.peer == peer),
                        "peer {peer}'s follow-up ran with a window of it parked"
                    );
                    self.forgotten.get_mut(&peer).unwrap().1 += 1;
                }
            }
        }
    }

    fn check_cut(&self, window: WindowId, reason: CutReason) {
        let w = &self.windows[&window];
        let r = &self.receivers[w.target];
        match reason {
            CutReason::Gone(_) => {
                let ended = r.ended.expect("cut as gone while registered");
                assert!(
                    self.now.duration_since(ended) >= GRACE,
                    "cut {:?} after its registration ended",
                    self.now.duration_since(ended)
                );
            }
            CutReason::Stalled(_) => assert!(
                self.now.duration_since(w.progressed) >= STALL,
                "cut as stalled {:?} after its last progress",
                self.now.duration_since(w.progressed)
            ),
        }
    }

    fn ms(&self) -> u128 {
        self.now.duration_since(self.start).as_millis()
    }

    fn job(&mut self) {
        let t = self.rng.below(3) as usize;
        let target = self.receivers[t].target;
        // The driver looks first: a drained window admits the job.
        self.look();
        let id = self.jobs.len() as u64;
        let empty = self.rng.chance(5);
        let admit = self.machine.admit(target, self.alive(t), empty);
        let (end, window) = match admit {
            Admit::Gone | Admit::Nothing => (JobEnd::Done, None),
            Admit::Behind { .. } => {
                *self.tally.entry("behind".into()).or_default() += 1;
                (JobEnd::Done, None)
            }
            Admit::Write if self.rng.chance(70) => (JobEnd::Done, None),
            Admit::Write => {
                let window = self.next_window;
                self.next_window += 1;
                let in_flight = 1 + self.rng.below(4) as usize;
                let bounced = self.rng.chance(30);
                self.windows.insert(
                    window,
                    Window {
                        target: t,
                        in_flight,
                        progressed: self.now,
                        closed: false,
                        bounced,
                    },
                );
                let end = JobEnd::Left {
                    window,
                    in_flight,
                    bounced,
                    forcible: self.receivers[t].forcible,
                };
                (end, Some(window))
            }
        };
        self.log
            .push(format!("{:?}: job {id} to {t}: {admit:?}", self.ms()));
        self.jobs.push(Job {
            target: t,
            window,
            ran: 0,
        });
        self.machine
            .handle_job(self.now, target, end, Run::Report(id));
        self.drive();
    }

    /// UCX's progress: draining receivers finish operations, closed endpoints fail them.
    fn progress(&mut self) {
        for w in self.windows.values_mut() {
            let r = &self.receivers[w.target];
            let drains = (r.draining && r.ended.is_none()) || w.closed;
            if drains && w.in_flight > 0 && self.rng.chance(50) {
                w.in_flight -= 1;
                w.progressed = self.now;
            }
        }
    }
}

impl Simulated for World {
    fn step(&mut self) {
        match self.rng.below(100) {
            0..=39 => self.job(),
            40..=64 => self.progress(),
            65..=66 => {
                let t = self.rng.below(3) as usize;
                if self.receivers[t].ended.is_none() {
                    self.log.push(format!("{:?}: receiver {t} gone", self.ms()));
                    self.receivers[t].ended = Some(self.now);
                }
            }
            70..=74 => {
                let peer = 1 + self.rng.below(2);
                self.forgotten.entry(peer).or_default().0 += 1;
                self.machine.forget_then(peer, Run::Forgotten(peer));
                self.drive();
            }
            _ => {
                let dt = self.rng.pick(&[1u64, 5, 50, 120, 400, 1100]);
                self.now += Duration::from_millis(dt);
                if self.machine.poll_timeout().is_some_and(|at| at <= self.now) {
                    self.look();
                }
            }
        }
        // A bounced window parked keeps the staging buffer busy, and only that.
        assert_eq!(
            self.machine.staging_busy(),
            self.windows.values().any(|w| w.bounced),
        );
    }

    fn finish(&mut self) {
        // Every receiver's registration ends: each parked window is cut or drains.
        for r in &mut self.receivers {
            r.ended.get_or_insert(self.now);
        }
        for _ in 0..10_000 {
            if !self.machine.is_quarantining() {
                break;
            }
            self.now += Duration::from_millis(50);
            self.progress();
            self.look();
        }
        assert!(
            !self.machine.is_quarantining(),
            "windows still parked: {:?}",
            self.machine.parked().collect::<Vec<_>>()
        );
        self.look();
        for (id, j) in self.jobs.iter().enumerate() {
            assert_eq!(j.ran, 1, "job {id} ({j:?}) never reported");
        }
        for (peer, (asked, ran)) in &self.forgotten {
            assert_eq!(asked, ran, "peer {peer}'s follow-ups: {ran} of {asked} ran");
        }
        for (t, order) in self.order.iter().enumerate() {
            assert!(
                order.windows(2).all(|w| w[0] < w[1]),
                "receiver {t}'s reports out of order: {order:?}"
            );
        }
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
fn executor_rules_hold_over_seeds() {
    seeded::run(
        World::new,
        80,
        &[
            "behind",
            "released",
            "force closed",
            "worker replaced",
            "stalled",
        ],
    );
}

/// A window to a receiver that stops draining but stays registered is given up after the
/// stall limit and not a moment before: its registration ended, its endpoint closed by force,
/// its job reported once the window drained — all on a simulated clock.
#[test]
fn a_stalled_receiver_is_given_up_at_the_stall_limit() {
    let t0 = Instant::now();
    let target = Target { peer: 7, rank: 1 };
    let mut m = ExecMachine::new(config());
    assert_eq!(m.admit(target, true, false), Admit::Write);
    let left = JobEnd::Left {
        window: 1,
        in_flight: 3,
        bounced: false,
        forcible: true,
    };
    m.handle_job(t0, target, left, "first");
    assert!(matches!(
        m.admit(target, true, false),
        Admit::Behind { in_flight: 3, .. }
    ));
    m.handle_job(t0, target, JobEnd::Done, "second");
    let stuck = Look {
        in_flight: 3,
        settled: false,
        alive: true,
    };
    let just_before = t0 + STALL - Duration::from_millis(1);
    m.handle_look(just_before, 1, stuck);
    m.handle_tick(just_before);
    assert!(m.poll_action().is_none(), "given up before the stall limit");
    assert_eq!(m.poll_timeout(), Some(just_before + config().look_every));
    m.handle_look(t0 + STALL, 1, stuck);
    assert!(matches!(
        m.poll_action(),
        Some(Action::EndRegistration { window: 1 })
    ));
    assert!(matches!(
        m.poll_action(),
        Some(Action::ForceClose { window: 1, target: t, reason: CutReason::Stalled(_) }) if t == target
    ));
    assert!(m.poll_action().is_none());
    // UCX fails what was in flight; the window settles; the reports follow, in order.
    let drained = Look {
        in_flight: 0,
        settled: true,
        alive: false,
    };
    m.handle_look(t0 + STALL + Duration::from_millis(5), 1, drained);
    assert!(matches!(
        m.poll_action(),
        Some(Action::Release { window: 1 })
    ));
    assert!(matches!(m.poll_action(), Some(Action::Run("first"))));
    assert!(matches!(m.poll_action(), Some(Action::Run("second"))));
    assert!(m.poll_action().is_none());
    assert_eq!(m.admit(target, true, false), Admit::Write);
    assert_eq!(m.poll_timeout(), None);
}

/// Without peer error mode a window cannot be closed by force: it waits, due, until every
/// parked window's receiver is gone, and then the worker is replaced once.
#[test]
fn unforcible_windows_wait_for_every_receiver_to_go_then_the_worker_is_replaced() {
    let t0 = Instant::now();
    let (a, b) = (Target { peer: 1, rank: 0 }, Target { peer: 2, rank: 0 });
    let mut m = ExecMachine::new(config());
    for (window, target) in [(1, a), (2, b)] {
        let left = JobEnd::Left {
            window,
            in_flight: 1,
            bounced: window == 2,
            forcible: false,
        };
        m.handle_job(t0, target, left, window);
    }
    assert!(m.staging_busy());
    let look = |alive| Look {
        in_flight: 1,
        settled: false,
        alive,
    };
    // a gone, b registered and still draining slowly.
    m.handle_look(t0, 1, look(false));
    m.handle_look(t0, 2, look(true));
    m.handle_tick(t0);
    let t1 = t0 + GRACE;
    m.handle_look(t1, 1, look(false));
    m.handle_look(t1, 2, look(true));
    m.handle_tick(t1);
    assert!(matches!(
        m.poll_action(),
        Some(Action::CutDue {
            window: 1,
            reason: CutReason::Gone(_)
        })
    ));
    assert!(m.poll_action().is_none(), "replaced under a live receiver");
    // b goes too: its window is due after its own grace, then the worker is replaced.
    let t2 = t1 + Duration::from_millis(10);
    m.handle_look(t2, 1, look(false));
    m.handle_look(t2, 2, look(false));
    m.handle_tick(t2);
    assert!(matches!(
        m.poll_action(),
        Some(Action::ReplaceWorker { windows }) if windows == [1, 2]
    ));
    // A replacement that failed leaves them parked and no longer due...
    m.handle_replaced(false);
    assert!(m.poll_action().is_none());
    let t3 = t2 + GRACE;
    m.handle_look(t3, 1, look(false));
    m.handle_look(t3, 2, look(false));
    m.handle_tick(t3);
    let mut asked = Vec::new();
    while let Some(action) = m.poll_action() {
        asked.push(format!("{action:?}"));
    }
    assert_eq!(
        asked.last().map(String::as_str),
        Some("ReplaceWorker { windows: [1, 2] }"),
        "{asked:?}"
    );
    // ...and one that worked reports both jobs, in order.
    m.handle_replaced(true);
    assert!(matches!(m.poll_action(), Some(Action::Run(1))));
    assert!(matches!(m.poll_action(), Some(Action::Run(2))));
    assert!(!m.staging_busy() && !m.is_quarantining());
}
