//! The handle of a rank thread: starting it, its commands, and what it tells about its
//! worker's activity.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use kvferry_platform::{EventFd, wait_any_readable};
use kvferry_protocol::exec::ExecConfig;
use kvferry_ucx::{ErrorMode, Worker};

use super::exec::run;
use super::{Forgotten, KEEP_AWAKE, PeerId, RemoteRank, VetDone, WriteJob};
use super::{SpawnError, WriteError};
use crate::bounce::{Gatherer, Staging};
use crate::memory::{BindError, RankPools};

/// A [`VetDone`] that is called exactly once: with [`WriteError::Stopped`] if it is dropped
/// unanswered (its command was still queued when the thread ended).
pub(super) struct VetReply {
    rank: u32,
    reply: Option<VetDone>,
}

impl VetReply {
    pub(super) fn send(mut self, result: Result<(), WriteError>) {
        if let Some(reply) = self.reply.take() {
            reply(result);
        }
    }
}

impl Drop for VetReply {
    fn drop(&mut self) {
        if let Some(reply) = self.reply.take() {
            reply(Err(WriteError::Stopped { rank: self.rank }));
        }
    }
}

pub(super) enum Command {
    Write(WriteJob),
    #[cfg(feature = "harness")]
    Replay(super::ReplayJob),
    Vet(Arc<RemoteRank>, Option<Vec<u8>>, VetReply),
    Forget(PeerId, Option<Forgotten>),
}

/// The handle of one rank's progress thread.
#[derive(Debug)]
pub struct RankThread {
    rank: u32,
    address: Vec<u8>,
    tx: Commands,
    thread: Option<JoinHandle<()>>,
    activity: Arc<Activity>,
}

/// When the rank thread's worker last had something to do, and when it last went idle
/// (nanoseconds since `base`): how a receiver knows that bytes already on the way to it
/// have landed ([`RankThread::quiet_for`]).
#[derive(Debug)]
pub(super) struct Activity {
    pub(super) base: Instant,
    /// The last progress round that found work.
    pub(super) busy: AtomicU64,
    /// The last time a run of idle rounds ended in the loop going to sleep, or staying
    /// awake ([`RankThread::keep_awake`]) with nothing to do.
    pub(super) idle: AtomicU64,
    /// Whether the loop is asleep on its armed worker's descriptor now: nothing can have
    /// arrived since it went to sleep, or it would have woken.
    pub(super) asleep: AtomicBool,
    /// Until when the loop does not go to sleep when idle ([`RankThread::keep_awake`]).
    pub(super) awake_until: AtomicU64,
    /// The armed worker's wake-up descriptor the loop sleeps on (`-1` before its first
    /// sleep): readable while bytes it has not taken in wait.
    pub(super) efd: AtomicI32,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            base: Instant::now(),
            busy: AtomicU64::new(0),
            idle: AtomicU64::new(0),
            asleep: AtomicBool::new(false),
            awake_until: AtomicU64::new(0),
            efd: AtomicI32::new(-1),
        }
    }

    /// See [`RankThread::quiet_for`].
    fn quiet_for(&self) -> Option<Duration> {
        let (asleep, busy, idle, now) = (
            self.asleep.load(Ordering::Acquire),
            self.busy.load(Ordering::Acquire),
            self.idle.load(Ordering::Acquire),
            self.now(),
        );
        if asleep && idle > busy {
            // Armed and asleep: anything arriving wakes it, so it has been quiet since its
            // last busy round — unless something arrived and the thread has not run since
            // (its process stopped, or starved of CPU): its descriptor is readable then, and
            // the bytes may not have landed yet.
            let efd = self.efd.load(Ordering::Acquire);
            if efd >= 0 && matches!(wait_any_readable(&[efd], Duration::ZERO), Ok(true)) {
                return None;
            }
            return Some(Duration::from_nanos(now.saturating_sub(busy)));
        }
        let fresh = Duration::from_nanos(now.saturating_sub(idle)) < IDLE_FRESH;
        (fresh && idle > busy).then(|| Duration::from_nanos(idle - busy))
    }

    pub(super) fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// The sending side of a rank thread's commands: each send signals the eventfd the thread
/// sleeps on.
#[derive(Debug)]
struct Commands {
    tx: Sender<Command>,
    wake: Arc<EventFd>,
}

impl Commands {
    fn send(&self, command: Command) -> Result<(), mpsc::SendError<Command>> {
        self.tx.send(command)?;
        self.wake.signal();
        Ok(())
    }
}

/// How recently the loop must have gone idle for [`RankThread::quiet_for`] to answer, unless
/// it is asleep on its armed worker: a thread that has not reached its idle sleep since is
/// busy, or not running at all.
const IDLE_FRESH: Duration = Duration::from_millis(50);

impl Drop for RankThread {
    /// Ends the thread and waits for it, so UCX is torn down (quarantined puts abandoned,
    /// endpoints closed, the worker destroyed) before this returns — an engine that exits
    /// right after dropping its agent must not race UCX's teardown (a heap corruption about
    /// one exit in twenty, seen in the engine example). Dropped on the rank thread itself (a
    /// job's callback let go of the last owner), it cannot wait for itself; the thread ends
    /// once that callback returns.
    fn drop(&mut self) {
        let (closed, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.tx.tx, closed));
        // Wake it from its sleep to find the channel closed.
        self.tx.wake.signal();
        if let Some(thread) = self.thread.take() {
            if thread.thread().id() != thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

impl RankThread {
    /// Moves `worker` to a new thread that progresses it for ever and executes jobs reading
    /// from `pools`, connecting to receivers with endpoints in `errors` mode
    /// ([`crate::TransportSpec::error_mode`] says which the rank's transports support; see
    /// the module docs on dead receivers). Returns once the thread has started: for device
    /// pools, once it has made their CUDA context current (UCX's CUDA transports move the
    /// pools from this thread).
    ///
    /// # Errors
    ///
    /// The worker's address cannot be read, the thread cannot be spawned, or it cannot bind
    /// the pools' CUDA context ([`SpawnError::Bind`]: the thread has ended, nothing runs).
    #[cfg_attr(not(feature = "harness"), allow(dead_code))]
    pub fn spawn(
        label: &str,
        rank: u32,
        worker: Worker,
        pools: Arc<RankPools>,
        errors: ErrorMode,
    ) -> Result<RankThread, SpawnError> {
        let config = ExecConfig::default();
        Self::spawn_bouncing(label, rank, worker, pools, errors, None, config)
    }

    /// [`spawn`](Self::spawn) with a staging buffer for bounced pieces ([`BounceJob`]),
    /// which the thread owns from now on, and the executor's timing rules.
    pub fn spawn_bouncing(
        label: &str,
        rank: u32,
        worker: Worker,
        pools: Arc<RankPools>,
        errors: ErrorMode,
        staging: Option<Staging>,
        config: ExecConfig,
    ) -> Result<RankThread, SpawnError> {
        Self::spawn_with(
            label,
            rank,
            worker,
            (pools, errors, staging, config),
            RankPools::bind_device_to_thread,
        )
    }

    /// [`spawn`](Self::spawn) with the thread's first step passed in (tests fail it).
    fn spawn_with(
        label: &str,
        rank: u32,
        worker: Worker,
        (pools, errors, staging, config): (Arc<RankPools>, ErrorMode, Option<Staging>, ExecConfig),
        bind: impl FnOnce(&RankPools) -> Result<(), BindError> + Send + 'static,
    ) -> Result<RankThread, SpawnError> {
        let address = worker
            .address()
            .map_err(|source| SpawnError::Address { rank, source })?;
        let worker = worker
            .into_send()
            .map_err(|_| SpawnError::Shared { rank })?;
        let wake = Arc::new(EventFd::new().map_err(|source| SpawnError::Wake { rank, source })?);
        let (tx, rx) = mpsc::channel();
        let tx = Commands {
            tx,
            wake: Arc::clone(&wake),
        };
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let activity = Arc::new(Activity::new());
        let thread_activity = Arc::clone(&activity);
        let thread = thread::Builder::new()
            .name(format!("{label}-rank{rank}"))
            // `pools` outlives `run`, and so every handle on the worker, which `run` drops:
            // puts abandoned when the thread ends may read the pools until then.
            .spawn(move || {
                let worker = worker.into_worker();
                // Device pools: UCX's CUDA transports move them from this thread, in the
                // device's context; a thread that cannot bind it must not serve them.
                let bound = bind(&pools);
                let ok = bound.is_ok();
                let _ = ready_tx.send(bound);
                // Like `pools`, the staging buffer outlives `run`: abandoned puts may read it.
                let gatherer = match &staging {
                    Some(s) => match Gatherer::spawn(&format!("r{rank}"), s.copier().clone()) {
                        Ok(g) => Some(g),
                        Err(e) => {
                            tracing::warn!(error = %e, "no gather thread: pieces go fragment by fragment");
                            None
                        }
                    },
                    None => None,
                };
                let staging = staging.as_ref().zip(gatherer);
                if ok {
                    let commands = (rx, &*wake);
                    let setup = (errors, config);
                    run(rank, worker, setup, &pools, staging, commands, &thread_activity);
                }
            })
            .map_err(|source| SpawnError::Thread { rank, source })?;
        let started = ready_rx.recv();
        if !matches!(started, Ok(Ok(()))) {
            // It has ended or is ending (dropping the worker on its own thread): wait for it,
            // so nothing of this rank outlives the failed start.
            let panicked = thread.join().is_err();
            return Err(match started {
                Ok(Err(source)) => SpawnError::Bind { rank, source },
                _ => SpawnError::Died { rank, panicked },
            });
        }
        Ok(RankThread {
            rank,
            address,
            tx,
            thread: Some(thread),
            activity,
        })
    }

    /// The rank.
    #[cfg_attr(not(feature = "harness"), allow(dead_code))]
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// How long the worker has had nothing to do, as of its last idle round: `None` while it
    /// is busy or has not gone idle lately (a thread starved of CPU has not looked). A
    /// receiver's bytes arrive only through its worker's progress, so a receiver whose
    /// worker went idle with nothing arriving for a while has taken in whatever had already
    /// reached its sockets.
    pub fn quiet_for(&self) -> Option<Duration> {
        self.activity.quiet_for()
    }

    /// The worker's UCX address.
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// Bytes are about to move through this rank (its claims went out, or a claim is being
    /// planned): its loop keeps progressing its worker instead of going to sleep when idle,
    /// for [`KEEP_AWAKE`] from now (or longer, if an earlier call asked for longer).
    pub fn keep_awake(&self) {
        let a = &self.activity;
        let until = a
            .now()
            .saturating_add(u64::try_from(KEEP_AWAKE.as_nanos()).unwrap_or(u64::MAX));
        a.awake_until.fetch_max(until, Ordering::SeqCst);
        // Paired with the loop's store of `asleep` and load of the deadline (`sleep`).
        if a.asleep.load(Ordering::SeqCst) {
            // Asleep on its descriptors: woken now, so it is running before the bytes come.
            self.tx.wake.signal();
        }
    }

    /// Queues a job; if the thread is gone, fails it at once.
    pub fn write(&self, job: WriteJob) {
        if let Err(mpsc::SendError(Command::Write(job))) = self.tx.send(Command::Write(job)) {
            if let Some(release) = job.release {
                release();
            }
            (job.done)(Err(WriteError::Stopped { rank: self.rank }));
        }
    }

    /// Queues a replay (a benchmark baseline); if the thread is gone, fails it at once.
    #[cfg(feature = "harness")]
    pub fn replay(&self, job: super::ReplayJob) {
        if let Err(mpsc::SendError(Command::Replay(job))) = self.tx.send(Command::Replay(job)) {
            if let Some(release) = job.release {
                release();
            }
            (job.done)(Err(WriteError::Stopped { rank: self.rank }));
        }
    }

    /// Connects to `dest` as a job would (endpoint, remote keys, and the check of every
    /// declared pool against what its key maps), keeps the connection for later jobs, and
    /// replies with the outcome: so a caller can refuse a peer whose keys do not cover its
    /// declared pools ([`WriteError::KeyRange`]) before accepting it. Queued behind earlier
    /// commands; if the thread is gone, replies [`WriteError::Stopped`] at once (and so if it
    /// ends before it gets to the command).
    ///
    /// With `challenge`, once connected it also sends those bytes to the peer's worker as an
    /// active message of id [`WORKER_CHALLENGE_AM`](kvferry_protocol::agent::WORKER_CHALLENGE_AM)
    /// (see `agent::worker_proof`): the reply comes once the send is under way, not delivered.
    pub fn vet(&self, dest: Arc<RemoteRank>, challenge: Option<Vec<u8>>, reply: VetDone) {
        let reply = VetReply {
            rank: self.rank,
            reply: Some(reply),
        };
        // A refused send drops the command, and so replies `Stopped`.
        let _ = self.tx.send(Command::Vet(dest, challenge, reply));
    }

    /// Drops the endpoints and keys kept for `peer`: each endpoint is closed then, or, while a
    /// quarantined window still has puts to it in flight, once that window has drained.
    pub fn forget(&self, peer: PeerId) {
        let _ = self.tx.send(Command::Forget(peer, None));
    }

    /// [`forget`](Self::forget), then `then` on the rank thread: what must wait until this
    /// rank no longer has an endpoint to the peer's worker (a departing peer's side channel,
    /// held open until then, see `agent::prefill`).
    pub(crate) fn forget_then(&self, peer: PeerId, then: Forgotten) {
        let _ = self.tx.send(Command::Forget(peer, Some(then)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Transport;
    use crate::memory::PoolAllocator;

    /// A rank asleep on its armed descriptor is quiet since its last busy round, unless the
    /// descriptor is readable: bytes arrived that its thread has not taken in yet (its
    /// process was stopped, or starved of CPU), and a receiver told it is quiet could end a
    /// request whose late bytes are about to land. (Found by the joint simulation of the
    /// request machines, `host/protocol/tests/joint.rs`, once it let bytes wait in a stopped
    /// receiver's socket.)
    #[test]
    fn an_asleep_rank_whose_descriptor_is_readable_is_not_quiet() {
        use std::os::fd::AsRawFd;
        let a = Activity::new();
        let efd = EventFd::new().expect("eventfd");
        a.busy.store(1, Ordering::Release);
        a.idle.store(2, Ordering::Release);
        a.asleep.store(true, Ordering::SeqCst);
        a.efd.store(efd.as_raw_fd(), Ordering::Release);
        assert!(
            a.quiet_for().is_some(),
            "asleep with nothing waiting: quiet"
        );
        efd.signal();
        assert_eq!(
            a.quiet_for(),
            None,
            "asleep with something waiting: not quiet"
        );
        efd.clear();
        assert!(a.quiet_for().is_some());
    }

    /// What a rank thread runs with: `pools`, no peer error mode, no staging, the default
    /// timing rules.
    fn parts(pools: Arc<RankPools>) -> (Arc<RankPools>, ErrorMode, Option<Staging>, ExecConfig) {
        (pools, ErrorMode::None, None, ExecConfig::default())
    }

    fn rank_parts() -> (Worker, Arc<RankPools>) {
        let ctx = Transport::Shm.context().expect("create UCX context");
        let worker = Worker::new(&ctx).expect("create UCX worker");
        let pools = PoolAllocator::new(&ctx)
            .finish(1)
            .expect("no pools")
            .remove(0);
        (worker, Arc::new(pools))
    }

    /// A thread that cannot bind its device's context fails the start, naming the rank, the
    /// device and the cause; it does not serve with a warning.
    #[test]
    fn a_failed_context_bind_fails_the_start() {
        let (worker, pools) = rank_parts();
        let err = RankThread::spawn_with("test", 3, worker, parts(pools), |_| {
            Err(BindError {
                device: 1,
                source: "cuCtxSetCurrent failed: CUDA_ERROR_INVALID_CONTEXT".into(),
            })
        })
        .unwrap_err();
        assert!(
            matches!(&err, SpawnError::Bind { rank: 3, source } if source.device == 1),
            "{err:?}"
        );
        assert_eq!(
            kvferry_plan::error_chain(&err),
            "rank 3: its thread cannot serve device pools: cannot make the context of cuda \
             device 1 current on this thread: cuCtxSetCurrent failed: CUDA_ERROR_INVALID_CONTEXT"
        );
    }

    #[test]
    fn a_thread_that_dies_before_it_starts_is_an_error() {
        let (worker, pools) = rank_parts();
        let err = RankThread::spawn_with("test", 0, worker, parts(pools), |_| panic!("injected"))
            .unwrap_err();
        assert!(
            matches!(
                err,
                SpawnError::Died {
                    rank: 0,
                    panicked: true
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn host_pools_start() {
        let (worker, pools) = rank_parts();
        let thread = RankThread::spawn("test", 0, worker, pools, ErrorMode::None).expect("start");
        assert_eq!(thread.rank(), 0);
        assert!(!thread.address().is_empty());
    }

    /// Polls `what` every millisecond for up to 10 s; whether it came true.
    fn within_10s(what: impl Fn() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if what() {
                return true;
            }
            thread::sleep(Duration::from_millis(1));
        }
        false
    }

    /// An idle thread sleeps; `keep_awake` wakes it and keeps it progressing (quiet, not
    /// asleep) while it is asked again within `KEEP_AWAKE`, after which it sleeps again.
    #[test]
    fn keep_awake_wakes_a_sleeping_rank_for_a_while() {
        let (worker, pools) = rank_parts();
        let thread = RankThread::spawn("test", 0, worker, pools, ErrorMode::None).expect("start");
        let asleep = || thread.activity.asleep.load(Ordering::Acquire);
        assert!(within_10s(asleep), "an idle rank never went to sleep");
        let awake = || {
            thread.keep_awake();
            !asleep()
        };
        assert!(within_10s(awake), "keep_awake did not wake it");
        // Awake with nothing to do: its idle rounds still say it is quiet.
        assert!(within_10s(|| {
            thread.keep_awake();
            thread.quiet_for().is_some() && !asleep()
        }));
        let asked = Instant::now();
        thread.keep_awake();
        assert!(within_10s(asleep), "it never went back to sleep");
        assert!(
            asked.elapsed() >= KEEP_AWAKE,
            "asleep again {:?} after keep_awake, before KEEP_AWAKE",
            asked.elapsed()
        );
    }
}
