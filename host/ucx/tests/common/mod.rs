//! Helpers shared by the integration tests (each test file is its own binary and uses a
//! different subset, hence the `dead_code` allowance).
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use kvferry_ucx::{
    Context, Endpoint, Error, ErrorMode, MemRegion, PackedRkey, RemoteKey, Request, SendWorker,
    Worker,
};

/// How long any single wait in these tests may take before the test fails instead of hanging.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// Transport selections, set through context overrides so that the environment's `UCX_TLS`
/// cannot change what a test exercises (except [`Transport::Env`], which is exactly that).
#[derive(Clone, Copy, Debug)]
pub enum Transport {
    /// Intra-node shared memory: `posix,sysv,self`.
    Shm,
    /// Loopback TCP: `tcp` on `lo`; puts are emulated with active messages.
    Tcp,
    /// Whatever `UCX_TLS` / `UCX_NET_DEVICES` in the environment select (UCX's default if unset).
    Env,
}

impl Transport {
    pub fn context(self) -> Arc<Context> {
        let builder = Context::builder();
        let builder = match self {
            Transport::Shm => builder.tls("posix,sysv,self"),
            Transport::Tcp => builder.tls("tcp").net_devices("lo"),
            Transport::Env => builder,
        };
        builder.build().expect("create UCX context")
    }
}

/// Deterministic bytes that are never 0x00 nor 0xFF, so a zeroed target byte, a byte of this
/// pattern and a byte of its complement are always three different values.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8 ^ seed;
            x.clamp(1, 0xFE)
        })
        .collect()
}

/// Waits for `request` while progressing every worker in `workers` (the request's own among
/// them): in one thread the target must be progressed by hand, or emulated puts and wire-up
/// never finish.
pub fn drive(mut request: Request<'_>, workers: &[&Worker]) -> Result<(), Error> {
    let deadline = Instant::now() + DEADLINE;
    while !request.is_done() {
        assert!(
            Instant::now() < deadline,
            "{:?} did not finish in {DEADLINE:?}",
            request.op()
        );
        for worker in workers {
            worker.progress();
        }
    }
    request.wait()
}

/// Progresses `workers` until `done()` holds.
pub fn progress_until(workers: &[&Worker], mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "condition not reached in {DEADLINE:?}"
        );
        for worker in workers {
            worker.progress();
        }
    }
}

/// A worker progressed by its own thread, as a target process would.
pub struct Progressor {
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    thread: JoinHandle<SendWorker>,
}

impl Progressor {
    /// Moves `worker` (which must have no endpoints) to a new thread that progresses it.
    pub fn spawn(worker: Worker) -> Progressor {
        let worker = worker
            .into_send()
            .expect("a worker with endpoints cannot move to another thread");
        let stop = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicBool::new(false));
        let (stop_flag, pause_flag) = (Arc::clone(&stop), Arc::clone(&paused));
        let thread = thread::spawn(move || {
            let worker = worker.into_worker();
            while !stop_flag.load(Ordering::Acquire) {
                if pause_flag.load(Ordering::Acquire) {
                    thread::yield_now();
                } else {
                    worker.progress();
                }
            }
            worker
                .into_send()
                .expect("the progress thread made no endpoints")
        });
        Progressor {
            stop,
            paused,
            thread,
        }
    }

    /// Stops progressing the worker (a stalled peer) until [`Progressor::resume`]. A tcp
    /// target that does not progress stops reading its socket, so once the kernel buffers are
    /// full every further put queues inside the sender's UCX: that makes "in flight" a
    /// certainty instead of a race against a fast peer.
    pub fn pause(&self) {
        self.paused.store(true, Ordering::Release);
    }

    /// Progresses the worker again after [`Progressor::pause`].
    pub fn resume(&self) {
        self.paused.store(false, Ordering::Release);
    }

    /// Stops the thread and hands the worker back.
    pub fn stop(self) -> Worker {
        self.stop.store(true, Ordering::Release);
        self.thread
            .join()
            .expect("progress thread panicked")
            .into_worker()
    }
}

/// A target process's half of a test: a worker progressed on its own thread and a region of
/// its memory, with what an initiator needs to write there.
pub struct Target {
    pub progressor: Progressor,
    pub region: MemRegion,
    pub address: Vec<u8>,
    pub packed: PackedRkey,
    pub base: u64,
}

impl Target {
    /// A worker and a `len`-byte region on `ctx`, the worker progressed from now on.
    pub fn start(ctx: &Arc<Context>, len: usize) -> Target {
        let worker = Worker::new(ctx).unwrap();
        let region = MemRegion::allocate(ctx, len).unwrap();
        let (address, packed, base) = (
            worker.address().unwrap(),
            region.pack_rkey().unwrap(),
            region.remote_addr(),
        );
        Target {
            progressor: Progressor::spawn(worker),
            region,
            address,
            packed,
            base,
        }
    }

    /// An endpoint from `worker` to this target in `mode`, wired up (while the target
    /// progresses), and the region's key unpacked on it.
    pub fn connect(&self, worker: &Worker, mode: ErrorMode) -> (Endpoint, RemoteKey) {
        let ep = worker.connect_with(&self.address, mode).unwrap();
        let rkey = ep.unpack_rkey(self.packed.as_bytes()).unwrap();
        ep.flush().unwrap().wait().unwrap();
        (ep, rkey)
    }
}

/// The name libtest gives test `test` of the module at `module_path` (`module_path!()` there):
/// the path below the crate, for re-running this binary on that test alone (`--exact`).
pub fn test_named(module_path: &str, test: &str) -> String {
    match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{test}"),
        None => test.to_string(),
    }
}
