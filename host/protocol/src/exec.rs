//! A sender rank's executor decisions as a state machine, sans I/O: which jobs write, which
//! are refused behind a quarantined window, when a parked window is given up, cut by force or
//! by replacing the worker, and in which order jobs report.
//!
//! The machine knows no UCX type, thread or clock. Its driver (the rank thread) owns the
//! worker, the endpoints and the windows of puts; it asks [`admit`] before a job writes, tells
//! the machine how the job ended ([`handle_job`]), what it sees of each parked window when it
//! looks ([`handle_look`], then [`handle_tick`]) and what became of a worker replacement, and
//! carries out what the machine asks through [`poll_action`]: end a receiver's registration,
//! close a window's endpoint by force, replace the worker, drop a drained window, run a
//! report. While a window is parked, [`poll_timeout`] says when to look again.
//!
//! ```text
//!  job: admit ─────▶ ┌──────────────────┐ ──▶ EndRegistration{window}
//!  job ended ──────▶ │   ExecMachine    │ ──▶ ForceClose{window, target} | CutDue{window}
//!  look(window) ───▶ │ parked windows · │ ──▶ ReplaceWorker{windows}
//!  tick, replaced ─▶ │ reports · leaving│ ──▶ Release{window} · Run(report)
//!                    └──────────────────┘ ◀── handle_look/handle_tick at poll_timeout()
//! ```
//!
//! # The rules
//!
//! - A job whose puts were left in flight when it gave up parks its window (the
//!   *quarantine*): its report — the source release, then the failure — runs only once every
//!   operation in the window has settled, so a receiver that hears of the failure knows none
//!   of its bytes can still land. Later jobs to the same receiver rank are refused at once
//!   ([`Admit::Behind`]) and report after the parked one; so do jobs that wrote nothing
//!   (an empty plan, a receiver gone): a receiver rank's reports keep the order of its jobs.
//! - A parked window whose receiver's registration ended is cut once it has not drained for
//!   [`ExecConfig::gone_drain_grace`]; one whose receiver is still registered, once nothing in
//!   it finished for [`ExecConfig::stall_limit`] (its registration is ended first, so the
//!   agent drops the peer). An endpoint in UCX's peer error mode is closed by force
//!   ([`Action::ForceClose`]); the others cannot be, so they are marked due
//!   ([`Action::CutDue`]) and, once every parked window's receiver is gone, the driver
//!   replaces its worker ([`Action::ReplaceWorker`]), which ends all their operations.
//! - A peer forgotten with a follow-up ([`ExecMachine::forget_then`]) runs it only once none
//!   of its windows is parked.
//!
//! Exactly one `Run` per report handed in, in the order the rules give; none before the
//! window it waits for is released or cut.
//!
//! [`admit`]: ExecMachine::admit
//! [`handle_job`]: ExecMachine::handle_job
//! [`handle_look`]: ExecMachine::handle_look
//! [`handle_tick`]: ExecMachine::handle_tick
//! [`poll_action`]: ExecMachine::poll_action
//! [`poll_timeout`]: ExecMachine::poll_timeout

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The executor's timing rules, with the values kvferry has always used as defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecConfig {
    /// How long a parked window whose receiver's registration ended may still drain on its own
    /// before it is cut (peer error mode: closed by force). Long enough for puts about to
    /// complete when the registration ended to finish cleanly, short against the peer timeout
    /// that declares a stopped receiver gone. Default 500 ms.
    pub gone_drain_grace: Duration,
    /// How long a parked window of a receiver still registered may go with none of its
    /// operations finishing before the receiver is given up. Default 10 s.
    pub stall_limit: Duration,
    /// How often parked windows are looked at. Default 5 ms.
    pub look_every: Duration,
    /// How often a job blocked in its window checks that its receiver is still registered.
    /// Default 20 ms.
    pub alive_check: Duration,
}

impl Default for ExecConfig {
    fn default() -> Self {
        Self {
            gone_drain_grace: Duration::from_millis(500),
            stall_limit: Duration::from_secs(10),
            look_every: Duration::from_millis(5),
            alive_check: Duration::from_millis(20),
        }
    }
}

/// A parked window, as the driver numbers it (never reused).
pub type WindowId = u64;

/// A receiver rank: its registration (a new connection of the peer instance gets a new
/// one) and its rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target {
    /// The peer's registration.
    pub peer: u64,
    /// The peer rank.
    pub rank: u32,
}

/// Whether a job may write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Its receiver's registration ended: it fails without writing.
    Gone,
    /// Its plan is empty: nothing to write or flush; it reports at once.
    Nothing,
    /// An earlier job to the same receiver rank is parked: it fails without writing and,
    /// told as [`JobEnd::Done`], reports after that one.
    Behind {
        /// Operations of the parked window in flight when it was last looked at.
        in_flight: usize,
        /// When the window was parked.
        since: Instant,
    },
    /// It writes.
    Write,
}

/// How a job ended, as its driver tells the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobEnd {
    /// Nothing of it is in flight: it reports now, or after a window of its receiver rank
    /// that is parked (refused behind it, an empty plan, a receiver gone: nothing was
    /// written), so a receiver rank's reports keep the order of its jobs.
    Done,
    /// It gave up with operations in flight, left in window `window`, which is parked.
    Left {
        /// The window.
        window: WindowId,
        /// Its operations in flight (a flush counts as one).
        in_flight: usize,
        /// Whether its operations may read the staging buffer (a bounced piece).
        bounced: bool,
        /// Whether its endpoint can be closed by force (UCX's peer error mode).
        forcible: bool,
    },
}

/// What the driver saw of a parked window when it looked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Look {
    /// Its operations in flight (a flush counts as one).
    pub in_flight: usize,
    /// Every operation finished and none can deliver anything more (a flush completed, or
    /// the endpoint broke): it may be released.
    pub settled: bool,
    /// Whether its receiver is still registered.
    pub alive: bool,
}

/// Why a parked window is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutReason {
    /// Its receiver is registered but nothing in the window finished for this long.
    Stalled(Duration),
    /// Its receiver's registration ended this long ago.
    Gone(Duration),
}

impl std::fmt::Display for CutReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CutReason::Stalled(d) => write!(
                f,
                "nothing finished for {} ms: the receiver is not draining; giving it up",
                d.as_millis()
            ),
            CutReason::Gone(d) => write!(f, "its registration ended {} ms ago", d.as_millis()),
        }
    }
}

/// What the machine asks its driver to do, in order.
#[derive(Debug)]
pub enum Action<F> {
    /// End the registration of the window's receiver (clear its alive flag): it stopped
    /// draining, so the agent drops it at its next keep-alive.
    EndRegistration {
        /// The window.
        window: WindowId,
    },
    /// Close the window's endpoint by force, then drop the cached connection to `target`
    /// (the next job connects afresh): UCX completes what is in flight with errors.
    ForceClose {
        /// The window.
        window: WindowId,
        /// Its receiver rank.
        target: Target,
        /// Why.
        reason: CutReason,
    },
    /// The window cannot be closed by force: it waits for the worker to be replaced, once
    /// every parked window's receiver is gone (for the driver's log).
    CutDue {
        /// The window.
        window: WindowId,
        /// Why.
        reason: CutReason,
    },
    /// Replace the worker, abandoning these windows (every parked one) and every cached
    /// connection; answer with [`ExecMachine::handle_replaced`].
    ReplaceWorker {
        /// The windows to abandon.
        windows: Vec<WindowId>,
    },
    /// The window drained: drop it (its endpoint may close now).
    Release {
        /// The window.
        window: WindowId,
    },
    /// Run this: a job's report, or a forgotten peer's follow-up.
    Run(F),
}

/// One parked window.
#[derive(Debug)]
struct Parked<F> {
    id: WindowId,
    target: Target,
    since: Instant,
    bounced: bool,
    forcible: bool,
    /// Reports that run, in order, once it is released.
    on_drain: Vec<F>,
    /// Whether its receiver was registered at the last look.
    alive: bool,
    /// When its registration was first seen ended.
    gone_since: Option<Instant>,
    /// When an operation last finished (or it was parked), and how many were in flight then.
    progressed: (Instant, usize),
    /// Its endpoint was closed by force (it drains as UCX fails what is in flight).
    closed: bool,
    /// It waits for the worker to be replaced.
    cut_due: bool,
}

/// A sender rank's executor state (see the module docs). `F` is what runs when a rule says
/// so: the driver's report callbacks.
#[derive(Debug)]
pub struct ExecMachine<F> {
    config: ExecConfig,
    parked: Vec<Parked<F>>,
    /// Follow-ups of forgotten peers that still had parked windows.
    departing: Vec<(u64, F)>,
    actions: VecDeque<Action<F>>,
    /// A replacement was asked for and not answered yet.
    replacing: bool,
    /// When the parked windows were last looked at.
    looked: Option<Instant>,
}

impl<F> ExecMachine<F> {
    /// An executor with nothing parked.
    pub fn new(config: ExecConfig) -> Self {
        Self {
            config,
            parked: Vec::new(),
            departing: Vec::new(),
            actions: VecDeque::new(),
            replacing: false,
            looked: None,
        }
    }

    /// Its timing rules.
    pub fn config(&self) -> &ExecConfig {
        &self.config
    }

    /// The next thing to do, in order.
    pub fn poll_action(&mut self) -> Option<Action<F>> {
        self.actions.pop_front()
    }

    /// When the parked windows should next be looked at ([`handle_look`](Self::handle_look)
    /// for each, then [`handle_tick`](Self::handle_tick)); `None` while none is parked.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.parked.is_empty() {
            return None;
        }
        self.looked.map(|at| at + self.config.look_every)
    }

    /// The parked windows, oldest first.
    pub fn parked(&self) -> impl Iterator<Item = WindowId> + '_ {
        self.parked.iter().map(|p| p.id)
    }

    /// Whether any window is parked.
    pub fn is_quarantining(&self) -> bool {
        !self.parked.is_empty()
    }

    /// Whether a parked window may still read the staging buffer: a bounced piece must then
    /// go fragment by fragment.
    pub fn staging_busy(&self) -> bool {
        self.parked.iter().any(|p| p.bounced)
    }

    /// Whether a job to `target` may write. The driver looks at the parked windows first (a
    /// window that drained since admits the job).
    pub fn admit(&self, target: Target, alive: bool, empty: bool) -> Admit {
        if !alive {
            return Admit::Gone;
        }
        if empty {
            return Admit::Nothing;
        }
        match self.parked.iter().find(|p| p.target == target) {
            Some(p) => Admit::Behind {
                in_flight: p.progressed.1,
                since: p.since,
            },
            None => Admit::Write,
        }
    }

    /// A job to `target` ended as `end`; `report` runs when the rules say (see the module
    /// docs).
    pub fn handle_job(&mut self, now: Instant, target: Target, end: JobEnd, report: F) {
        match end {
            JobEnd::Done => match self.parked.iter_mut().find(|p| p.target == target) {
                Some(p) => p.on_drain.push(report),
                None => self.actions.push_back(Action::Run(report)),
            },
            JobEnd::Left {
                window,
                in_flight,
                bounced,
                forcible,
            } => {
                self.looked.get_or_insert(now);
                self.parked.push(Parked {
                    id: window,
                    target,
                    since: now,
                    bounced,
                    forcible,
                    on_drain: vec![report],
                    alive: true,
                    gone_since: None,
                    progressed: (now, in_flight),
                    closed: false,
                    cut_due: false,
                })
            }
        }
    }

    /// What the driver saw of parked window `window` at `now`: a settled window is released
    /// and its reports run; one whose receiver cannot drain it is cut (see the module docs).
    /// Unknown windows are ignored.
    pub fn handle_look(&mut self, now: Instant, window: WindowId, look: Look) {
        let Some(at) = self.parked.iter().position(|p| p.id == window) else {
            return;
        };
        if look.settled {
            let p = self.parked.remove(at);
            self.actions.push_back(Action::Release { window });
            self.actions.extend(p.on_drain.into_iter().map(Action::Run));
            return;
        }
        let config = self.config;
        let p = &mut self.parked[at];
        if look.in_flight < p.progressed.1 {
            p.progressed = (now, look.in_flight);
        }
        p.alive = p.alive && look.alive;
        if p.closed || p.cut_due {
            return;
        }
        let reason = if p.alive {
            let stalled = now.saturating_duration_since(p.progressed.0);
            if stalled < config.stall_limit {
                return;
            }
            p.alive = false;
            self.actions.push_back(Action::EndRegistration { window });
            CutReason::Stalled(stalled)
        } else {
            let gone = *p.gone_since.get_or_insert(now);
            let waited = now.saturating_duration_since(gone);
            if waited < config.gone_drain_grace {
                return;
            }
            CutReason::Gone(waited)
        };
        if p.forcible {
            p.closed = true;
            self.actions.push_back(Action::ForceClose {
                window,
                target: p.target,
                reason,
            });
        } else {
            p.cut_due = true;
            self.actions.push_back(Action::CutDue { window, reason });
        }
    }

    /// Every parked window was looked at: replaces the worker if a window is due to be cut
    /// and every parked window's receiver is gone, and runs the follow-ups of forgotten peers
    /// left with no parked window.
    pub fn handle_tick(&mut self, now: Instant) {
        self.looked = Some(now);
        let due = self.parked.iter().any(|p| p.cut_due);
        if due && !self.replacing && self.parked.iter().all(|p| !p.alive) {
            self.replacing = true;
            self.actions.push_back(Action::ReplaceWorker {
                windows: self.parked.iter().map(|p| p.id).collect(),
            });
            return;
        }
        self.release_departing();
    }

    /// The answer to [`Action::ReplaceWorker`]: `true` once the old worker (and with it every
    /// window it named) is gone, whose reports then run in order; `false` if no new worker
    /// could be made, so the windows stay parked and are no longer due.
    pub fn handle_replaced(&mut self, replaced: bool) {
        self.replacing = false;
        if !replaced {
            for p in &mut self.parked {
                p.cut_due = false;
            }
            return;
        }
        for p in std::mem::take(&mut self.parked) {
            self.actions.extend(p.on_drain.into_iter().map(Action::Run));
        }
        self.release_departing();
    }

    /// `then` runs once no window of `peer` is parked: at once, or when the last is released
    /// or cut.
    pub fn forget_then(&mut self, peer: u64, then: F) {
        if self.parked.iter().any(|p| p.target.peer == peer) {
            self.departing.push((peer, then));
        } else {
            self.actions.push_back(Action::Run(then));
        }
    }

    fn release_departing(&mut self) {
        if self.departing.is_empty() {
            return;
        }
        let parked = &self.parked;
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.departing)
            .into_iter()
            .partition(|(peer, _)| !parked.iter().any(|p| p.target.peer == *peer));
        self.departing = waiting;
        self.actions
            .extend(ready.into_iter().map(|(_, then)| Action::Run(then)));
    }
}
