//! A fixed pool of threads for the decode side's per-request work (linking peers, asking
//! the planner for targets, sending `RequestData`, planning the byte check), so `expect`
//! returns at once and a burst of requests costs a queue entry each, not a thread each; and
//! a second, smaller one that scatters bounced pieces.

use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread;

type Job = Box<dyn FnOnce() + Send>;

/// Threads of one agent's dispatch pool: enough that a request stuck connecting to an
/// unreachable peer (at most the connect and handshake timeouts) does not hold up the
/// others behind it.
pub(crate) const DISPATCH_THREADS: usize = 8;

/// The pool; dropping it lets its threads finish the queue and end.
#[derive(Debug)]
pub(crate) struct Dispatch {
    tx: Mutex<Option<Sender<Job>>>,
}

impl Dispatch {
    pub(crate) fn new(label: &str) -> std::io::Result<Self> {
        Self::with_threads(label, "dispatch", DISPATCH_THREADS)
    }

    /// A pool of `threads` threads named `{kind}-{label}-{i}`.
    pub(crate) fn with_threads(label: &str, kind: &str, threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = Arc::clone(&rx);
            thread::Builder::new()
                .name(format!("{kind}-{label}-{i}"))
                .spawn(move || {
                    loop {
                        let job = {
                            let rx = rx.lock().unwrap_or_else(|e| e.into_inner());
                            rx.recv()
                        };
                        match job {
                            Ok(job) => {
                                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                            }
                            Err(_) => return,
                        }
                    }
                })?;
        }
        Ok(Self {
            tx: Mutex::new(Some(tx)),
        })
    }

    /// Queues `job`; gives it back if the pool has stopped.
    pub(crate) fn run(&self, job: Job) -> Result<(), Job> {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        match tx.as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        }
    }

    /// Stops taking jobs; queued ones still run.
    pub(crate) fn stop(&self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}
