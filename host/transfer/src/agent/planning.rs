//! Planner calls under a deadline, off the connection threads.
//!
//! A planner is third-party code: a `pair` that never returns must fail the requests it was
//! planning and leave everything else working. Calls run on a small pool of worker threads
//! fed from one queue. The agent's reaper asks [`Planning::watch`] at each turn, and wakes
//! for [`Planning::next_deadline`];
//! a worker busy past the deadline is declared wedged: its task's `on_hang` runs (failing
//! that request, naming the planner), a fresh worker takes its place so the queue keeps
//! moving, and the wedged thread exits whenever the call returns (its result is discarded by
//! the task itself, which finds its request ended). A thread stuck for ever is leaked — Rust
//! cannot kill it — and counted in [`Planning::wedged`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

type Work = Box<dyn FnOnce() + Send>;
type OnHang = Box<dyn FnOnce() + Send>;

struct Task {
    work: Work,
    on_hang: Option<OnHang>,
}

#[derive(Default)]
struct Busy {
    since: Option<Instant>,
    on_hang: Option<OnHang>,
}

struct Slot {
    busy: Mutex<Busy>,
    wedged: AtomicBool,
}

struct Shared {
    queue: Mutex<VecDeque<Task>>,
    ready: Condvar,
    stop: AtomicBool,
}

/// The planner worker pool of one agent.
pub(crate) struct Planning {
    shared: Arc<Shared>,
    slots: Mutex<Vec<Arc<Slot>>>,
    deadline: Duration,
    label: String,
    wedged: AtomicUsize,
}

impl std::fmt::Debug for Planning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planning")
            .field("deadline", &self.deadline)
            .field("wedged", &self.wedged.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A planner call did not return within the deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hung {
    pub(crate) deadline: Duration,
}

const WORKERS: usize = 2;

impl Planning {
    pub(crate) fn new(label: &str, deadline: Duration) -> std::io::Result<Self> {
        let planning = Self {
            shared: Arc::new(Shared {
                queue: Mutex::new(VecDeque::new()),
                ready: Condvar::new(),
                stop: AtomicBool::new(false),
            }),
            slots: Mutex::new(Vec::new()),
            deadline,
            label: label.to_string(),
            wedged: AtomicUsize::new(0),
        };
        for _ in 0..WORKERS {
            planning.spawn_worker()?;
        }
        Ok(planning)
    }

    pub(crate) fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Worker threads declared wedged so far.
    pub(crate) fn wedged(&self) -> usize {
        self.wedged.load(Ordering::Relaxed)
    }

    fn spawn_worker(&self) -> std::io::Result<()> {
        let slot = Arc::new(Slot {
            busy: Mutex::new(Busy::default()),
            wedged: AtomicBool::new(false),
        });
        let shared = Arc::clone(&self.shared);
        let mine = Arc::clone(&slot);
        thread::Builder::new()
            .name(format!("plan-{}", self.label))
            .spawn(move || worker(&shared, &mine))?;
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(slot);
        Ok(())
    }

    /// Queues `work`; if it runs past the deadline, `on_hang` runs (once) instead of waiting.
    pub(crate) fn submit(&self, work: Work, on_hang: OnHang) {
        self.push(Task {
            work,
            on_hang: Some(on_hang),
        });
    }

    fn push(&self, task: Task) {
        self.shared
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(task);
        self.shared.ready.notify_one();
    }

    /// Runs `f` on a worker and waits for it, at most the deadline (counted from when it
    /// starts, plus the same again for the queue ahead of it).
    pub(crate) fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Hung> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.push(Task {
            work: Box::new(move || {
                let _ = tx.send(f());
            }),
            on_hang: None,
        });
        rx.recv_timeout(self.deadline * 2).map_err(|_| Hung {
            deadline: self.deadline,
        })
    }

    /// When [`watch`](Self::watch) will find the oldest running call past its deadline, if
    /// a call runs. (A call that starts later has its deadline no sooner than the deadline's
    /// length after it.)
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots
            .iter()
            .filter(|slot| !slot.wedged.load(Ordering::Acquire))
            .filter_map(|slot| slot.busy.lock().unwrap_or_else(|e| e.into_inner()).since)
            .min()
            // `watch` wants a call busy for more than the deadline.
            .map(|since| since + self.deadline + Duration::from_millis(1))
    }

    /// Declares workers busy past the deadline wedged, runs their tasks' `on_hang`, and
    /// replaces them. Called by the agent's reaper.
    pub(crate) fn watch(&self) {
        let now = Instant::now();
        let mut hung = Vec::new();
        {
            let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            for slot in slots.iter() {
                if slot.wedged.load(Ordering::Acquire) {
                    continue;
                }
                let mut busy = slot.busy.lock().unwrap_or_else(|e| e.into_inner());
                if busy
                    .since
                    .is_some_and(|s| now.saturating_duration_since(s) > self.deadline)
                {
                    slot.wedged.store(true, Ordering::Release);
                    hung.push(busy.on_hang.take());
                }
            }
        }
        if hung.is_empty() {
            return;
        }
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|s| !s.wedged.load(Ordering::Acquire));
        for on_hang in hung {
            self.wedged.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                deadline_ms = self.deadline.as_millis() as u64,
                "a planner call did not return within its deadline; its request fails and a \
                 new planner thread takes over"
            );
            if let Some(on_hang) = on_hang {
                on_hang();
            }
            if let Err(e) = self.spawn_worker() {
                tracing::error!(error = %e, "cannot replace a wedged planner thread");
            }
        }
    }
}

impl Drop for Planning {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.ready.notify_all();
    }
}

fn worker(shared: &Shared, slot: &Slot) {
    loop {
        let task = {
            let mut queue = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if shared.stop.load(Ordering::Acquire) {
                    return;
                }
                if let Some(task) = queue.pop_front() {
                    break task;
                }
                queue = shared
                    .ready
                    .wait_timeout(queue, Duration::from_millis(200))
                    .map(|(q, _)| q)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        };
        {
            let mut busy = slot.busy.lock().unwrap_or_else(|e| e.into_inner());
            busy.since = Some(Instant::now());
            busy.on_hang = task.on_hang;
        }
        // A panicking planner is caught at the ABI boundary; this catches host code.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task.work));
        {
            let mut busy = slot.busy.lock().unwrap_or_else(|e| e.into_inner());
            *busy = Busy::default();
        }
        if slot.wedged.load(Ordering::Acquire) {
            // Replaced while this call ran: the new worker serves the queue.
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn a_call_past_its_deadline_is_reported_and_the_queue_keeps_moving() {
        let planning = Planning::new("test", Duration::from_millis(100)).unwrap();
        let hung = Arc::new(AtomicU32::new(0));
        let seen = Arc::clone(&hung);
        // Two hung calls: every original worker wedges.
        for _ in 0..2 {
            let seen = Arc::clone(&seen);
            planning.submit(
                Box::new(|| thread::sleep(Duration::from_secs(2))),
                Box::new(move || {
                    seen.fetch_add(1, Ordering::SeqCst);
                }),
            );
        }
        thread::sleep(Duration::from_millis(50));
        let deadline = Instant::now() + Duration::from_secs(5);
        while hung.load(Ordering::SeqCst) < 2 {
            planning.watch();
            assert!(
                Instant::now() < deadline,
                "the hung calls were never reported"
            );
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(planning.wedged(), 2);
        // Replacements serve the next call at once.
        assert_eq!(planning.call(|| 7), Ok(7));
        // A call that returns in time is never reported.
        planning.submit(
            Box::new(|| {}),
            Box::new(|| panic!("reported a call that returned")),
        );
        thread::sleep(Duration::from_millis(150));
        planning.watch();
        assert_eq!(planning.wedged(), 2);
    }

    #[test]
    fn a_blocking_call_that_hangs_returns_hung() {
        let planning = Planning::new("test", Duration::from_millis(50)).unwrap();
        let r = planning.call(|| thread::sleep(Duration::from_secs(1)));
        assert_eq!(
            r,
            Err(Hung {
                deadline: Duration::from_millis(50)
            })
        );
    }
}
