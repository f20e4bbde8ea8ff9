//! One thread per rank, owning that rank's UCX worker: the progress loop and the executor.
//!
//! UCX workers run in serialized mode (one thread at a time), so everything a worker does
//! happens on its thread: the worker moves there before it has endpoints, and endpoints, remote
//! keys and puts never leave it. The rest of the host talks to the thread through a channel
//! ([`RankThread`]).
//!
//! - A **receiver** (decode) rank thread only progresses its worker, always: wire-up,
//!   `tcp` puts (emulated with active messages) and registered memory all need the target to
//!   progress. It never issues an operation, so it never waits on a peer and a dead sender
//!   cannot block it.
//! - A **sender** (context) rank thread also executes [`WriteJob`]s, in arrival order: for
//!   every fragment of a [`ValidatedPlan`] a `ucp_put_nbx` from its pool into the receiver's
//!   pool (a [`PutWindow`] bounds the puts in flight), then a flush of the endpoint, and only
//!   then the job's completion callback. Endpoints and unpacked remote keys are cached per
//!   (peer instance, peer rank), owned by that cache entry, until [`RankThread::forget`] drops
//!   them: the endpoint is closed then, or once no quarantined window uses it any more.
//!
//! # Declared pools and their keys
//!
//! A peer declares each pool as (base, length, packed key), and over shared memory this
//! thread copies every put itself, to the address UCX translates through the key, which UCX
//! does for any address, inside the key's segment or not. So before a connection is cached
//! every declared pool is checked against what its key maps
//! ([`kvferry_ucx::RemoteKey::check_range`]; a device range with the CUDA driver): a pool
//! declared elsewhere (a hostile `0x1000`, one byte too long) fails the connection with
//! [`WriteError::KeyRange`], and no put ever goes through its key. Keys no transport here
//! can map (`tcp`) are not translated here and pass. [`RankThread::vet`] runs the same
//! connection up front, so a caller can refuse such a peer before accepting it.
//!
//! Since a pool that passed lies, whole, inside one shared mapping of this process, a
//! fragment from host memory into it is copied straight there (one copy to the translated
//! address, what UCX's shared-memory put does for each put, without a UCX request per
//! fragment; in jobs from 16 MiB, fragments from 16 KiB with streaming stores,
//! `crate::streaming`); the job's flush still follows, then its completion. The bare put
//! loop ([`ReplayJob`]) keeps UCX's puts: it is the baseline the agent path is measured
//! against.
//!
//! # Dead and hung receivers
//!
//! A sender waits on its receiver: over `tcp` (and into registered memory) every put and
//! flush completes only while the receiver's worker progresses. So every job runs under a
//! deadline, [`WriteJob::timeout`] after it starts, and its window also gives up within
//! [`ExecConfig::alive_check`] once the receiver's registration ends (its control connection closed). The
//! job then fails with an error naming the peer rank ([`WriteError::TimedOut`],
//! [`WriteError::PeerGone`]) and the thread moves on to its other jobs.
//!
//! Where the rank's transports support it, endpoints are created in UCX's peer-failure mode
//! ([`ErrorMode::Peer`], chosen at [`RankThread::spawn`], see
//! [`crate::TransportSpec::error_mode`]): a receiver that died or became unreachable then
//! fails the puts and flush in flight through UCX itself, as soon as UCX notices (over `tcp`
//! at once when its process is gone: the kernel resets the connection), instead of at the
//! job's deadline or the side channel's verdict. The job fails with
//! [`WriteError::PeerFailed`] naming the peer rank and UCX's status; the connection is
//! dropped from the cache, so a later job (to the same registration or a new one) connects
//! afresh; and the quarantined operations on the endpoint drain, since UCX completes them with
//! errors. A job that finds its cached endpoint already failed (UCX noticed while the thread
//! was idle) fails the same way without writing. Shared memory (`posix`, `sysv`, `self`)
//! has no peer-failure support in UCX, so the `shm` preset keeps [`ErrorMode::None`] and
//! relies on the deadline and the side channel alone; if UCX refuses a peer-mode endpoint
//! (no enabled transport supports it), the executor connects without it.
//!
//! Puts still in flight when a job gives up may be read by UCX at any later progress, so their
//! window is **quarantined**, never dropped: it is parked (its puts hold handles on the
//! endpoint and the remote keys they use, so forgetting the peer meanwhile closes nothing under
//! them; the pools outlive the thread), polled from the progress loop, and released once UCX
//! has finished every operation in it. Only then does the job report (its [`JobRelease`], then
//! its [`JobDone`] with the error): the sender's slots stay held and the receiver hears of the
//! failure only when none of its bytes can land any more (a receiver that gave up meanwhile
//! keeps the slots quarantined until that report, as for any late writer). Until then further
//! jobs for that peer rank fail at once ([`WriteError::Stuck`]) instead of queueing behind the
//! stuck puts, and are reported after the quarantined job, in order.
//! A quarantined window whose receiver cannot drain it is cut, in peer error mode: once the
//! receiver's registration has ended for [`ExecConfig::gone_drain_grace`] (a stopped receiver is declared
//! gone at the agent's peer timeout), or while it is still registered once nothing in the
//! window finished for [`ExecConfig::stall_limit`] (a peer that keeps its session alive but stopped
//! reading its UCX socket; its registration is then ended here), the endpoint is closed by
//! force ([`Endpoint::force_close`]): UCX completes the puts with errors, the window drains,
//! and the job reports, its slots back — within the peer timeout plus the grace for a stopped
//! receiver. Bytes the kernel had already taken into the socket may still reach the receiver
//! if it resumes; it has lost its link to this rank by then and failed the request. Without
//! peer error mode UCX forbids a forced close, so such a window is marked due to be cut and,
//! once every quarantined window's receiver is gone, the thread replaces its worker
//! (`Executor::replace_worker`): destroying the old one destroys its endpoints and ends
//! their puts. These rules are decided by [`ExecMachine`], sans I/O and tested on a
//! simulated clock (`kvferry_protocol::exec`); this thread looks at its windows, tells the
//! machine what it saw, and carries out what it asks.
//! When the thread ends, windows still quarantined are abandoned (their keys are then never
//! destroyed), before the endpoints are closed (forced once their flush times out) and the
//! worker destroyed, all before the pools go (see `Executor`'s `Drop`).
//!
//! When idle the loop spins on `ucp_worker_progress` for a while ([`SPIN_ROUNDS`]), then arms
//! the worker's wake-up descriptor (`ucp_worker_arm`) and sleeps in `poll` on it and on the
//! thread's command eventfd (every command sent signals it), so an idle rank costs no CPU and
//! wakes as soon as a command or a UCX event (bytes arriving over tcp, a completion) comes;
//! the sleep is bounded ([`IDLE_SLEEP`], or [`ExecConfig::look_every`] while a quarantined window waits
//! for its deadlines). Busy ranks progress without pause. Every spin — this loop's,
//! and the waits for puts, flushes and the gather thread — gives up the rest of its time
//! slice after [`kvferry_ucx::SPIN_BEFORE_YIELD`] progress calls in a row that did nothing
//! ([`Worker::progress_or_yield`]): over `tcp` a sender waiting for its puts and a receiver
//! waiting for the next bytes would otherwise take turns burning the cores the kernel's
//! copies and the other side's progress need (on a 2-core machine, 1.1–1.35× faster tcp
//! transfers when 4–8 share the cores; README "Measured"). The waits for puts and flushes,
//! which wait on the worker alone, then sleep on its wake-up descriptor in short naps
//! ([`Worker::progress_or_nap`]); the gather wait and this loop's spin, which also wait on
//! another thread or on commands, only yield.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use kvferry_ucx::{
    Endpoint, ErrorMode, MemRegion, Op, PeerProcess, PutWindow, RemoteKey, Request, Status, Worker,
};

use kvferry_plan::ValidatedPlan;
use kvferry_protocol::PoolKey;
use kvferry_protocol::exec::{
    Action as ExecAction, Admit, ExecConfig, ExecMachine, JobEnd, Look, Target, WindowId,
};

use kvferry_platform::{EventFd, wait_any_readable};

use crate::bounce::{GatherTask, Gatherer, Staging};
use crate::memory::{BindError, RankPools};
use crate::streaming::{
    CopyHelper, Halves, SHARE_MIN_JOB_BYTES, STREAM_MIN_JOB_BYTES, Sharing, copy_to_peer,
};

/// Puts kept in flight per job (platform-notes §2: bound them, or tcp's final flush collapses).
pub const PUT_WINDOW: usize = 32;
/// Fragments are split into puts of at most this many bytes.
pub(crate) const MAX_PUT_BYTES: u64 = 1 << 20;
/// Idle progress rounds before the loop sleeps.
const SPIN_ROUNDS: u32 = 2000;
/// How long a rank thread stays awake, progressing its worker, after its agent says bytes
/// are about to move through it ([`RankThread::keep_awake`]): a decode rank from the moment
/// its claims go out, a prefill rank from the moment a claim is planned. Bytes that reach
/// an awake receiver are taken in by a thread already running on its own core; a receiver
/// asleep on its worker's descriptor is woken by the sender's bytes and, on a loaded
/// machine, placed on the sender's core, where the two take turns (one 4.5 MB request over
/// tcp on the 2-core machine: 0.5–0.8 ms on two cores, 1.7–1.9 ms on one; ARCHITECTURE
/// "Rank threads stay awake while bytes are due"). Long enough for a claim's round trip and
/// its planning on a small request; a request whose bytes come later finds the thread
/// asleep, as before.
pub(crate) const KEEP_AWAKE: Duration = Duration::from_millis(5);
/// The longest an idle rank sleeps on its descriptors: only a missed wake-up would make it
/// matter (every command and UCX event wakes the thread at once).
const IDLE_SLEEP: Duration = Duration::from_millis(100);
/// The sleep between progress rounds of a worker whose transports cannot signal events (no
/// wake-up descriptor): the thread then polls its commands at this pace.
const FALLBACK_SLEEP: Duration = Duration::from_micros(200);
/// How long closing a forgotten peer's endpoint may flush before it is closed by force: every
/// job on it was flushed already (or is quarantined, which keeps the endpoint open), so the
/// flush has nothing to wait for unless the peer is gone.
const FORGET_CLOSE_TIMEOUT: Duration = Duration::from_millis(100);

/// Identifies one registration of a peer instance (a new connection gets a new id).
pub(crate) type PeerId = u64;

/// A peer rank as a sender writes it: its worker and its pools.
#[derive(Clone, Debug)]
pub struct RemoteRank {
    /// The registration this rank belongs to.
    pub peer: PeerId,
    /// The peer instance's name.
    pub instance: String,
    /// The peer rank.
    pub rank: u32,
    /// Its UCX worker address.
    pub worker_address: Vec<u8>,
    /// Its pools, in page-table order.
    pub pools: Vec<PoolKey>,
    /// Cleared when the peer's registration ends: jobs for it stop issuing puts.
    pub alive: Arc<AtomicBool>,
    /// Its bounce arena, if it has one (checked against its key like the pools).
    pub bounce: Option<PoolKey>,
}

impl RemoteRank {
    /// The pool holding `[address, address + len)` entirely.
    pub(crate) fn pool_of(&self, address: u64, len: u64) -> Option<usize> {
        self.pools.iter().position(|p| {
            address >= p.base
                && address
                    .checked_add(len)
                    .is_some_and(|end| end <= p.base.saturating_add(p.len))
        })
    }
}

/// What a finished job wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Bytes written.
    pub bytes: u64,
    /// Fragments of the plan.
    pub fragments: u64,
    /// Writes issued: puts (fragments split at `MAX_PUT_BYTES`), or one direct copy per
    /// fragment into a peer pool mapped into this process (shared memory).
    pub puts: u64,
    /// Nanoseconds spent issuing the puts (waits for a full window included).
    pub puts_ns: u64,
    /// Nanoseconds spent waiting for the flush.
    pub flush_ns: u64,
    /// Nanoseconds the job held the rank thread: the endpoint and keys, the puts, the flush.
    pub busy_ns: u64,
    /// Whether the piece went through the receiver's bounce region ([`WriteJob::bounce`]).
    pub bounced: bool,
    /// Nanoseconds the rank thread waited for the gather thread (bounced pieces).
    pub gather_ns: u64,
}

/// Why a job did not complete.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// No endpoint to the peer rank.
    #[error("cannot connect to {instance} rank {rank}")]
    Connect {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// A peer pool's remote key could not be unpacked.
    #[error("cannot unpack the remote key of {instance} rank {rank} pool {pool}")]
    UnpackKey {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// A peer pool's declared range is not what its remote key maps, so nothing is ever
    /// put through that key: over shared memory this process copies each put to the
    /// address UCX translates, and UCX translates any address (see
    /// [`RemoteKey::check_range`]).
    #[error("{instance} rank {rank} declares pool {pool} at {base:#x} +{len}, but {reason}")]
    KeyRange {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// Its declared base.
        base: u64,
        /// Its declared length.
        len: u64,
        /// Why the range is refused.
        reason: &'static str,
        /// UCX's refusal (none where the CUDA driver refused a device range).
        #[source]
        source: Option<kvferry_ucx::Error>,
    },
    /// The peer's worker address or a pool's key names memory that is not the peer's own:
    /// a shared-memory key of another process, or its transports naming two processes
    /// ([`kvferry_ucx::PeerProcess`]); or a key that maps memory of this rank itself.
    #[error("{instance} rank {rank}{}: {reason}", pool_of(.pool))]
    KeyOwner {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// The pool whose key is refused (`None`: the worker address is).
        pool: Option<usize>,
        /// Why.
        reason: String,
    },
    /// A fragment's source is not inside one local pool.
    #[error(
        "fragment {fragment}: source {address:#x} +{len} is not inside one pool of rank {rank}"
    )]
    SourceOutside {
        /// Index of the fragment.
        fragment: usize,
        /// This rank.
        rank: u32,
        /// Source address.
        address: u64,
        /// Length.
        len: u64,
    },
    /// A fragment's destination is not inside one pool of the peer (or straddles two).
    #[error(
        "fragment {fragment}: destination {address:#x} +{len} is not inside one pool of \
         {instance} rank {rank}"
    )]
    DestinationOutside {
        /// Index of the fragment.
        fragment: usize,
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// Destination address.
        address: u64,
        /// Length.
        len: u64,
    },
    /// A put failed to start or complete.
    #[error("put to {instance} rank {rank} failed")]
    Put {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// The flush after the puts failed.
    #[error("flush to {instance} rank {rank} failed")]
    Flush {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// The job's deadline passed while its puts or flush were in flight.
    #[error(
        "writing to {instance} rank {rank} timed out after {waited_ms} ms waiting for its \
         {waiting} ({in_flight} operations still in flight are quarantined)"
    )]
    TimedOut {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// What the job was waiting for: `puts` or `flush`.
        waiting: &'static str,
        /// How long the job had run.
        waited_ms: u128,
        /// Operations (puts, and a flush) left in flight.
        in_flight: usize,
    },
    /// An earlier job to the peer rank gave up with operations in flight that have not
    /// finished yet.
    #[error(
        "{instance} rank {rank} has {in_flight} operations of an earlier job stuck in flight \
         for {stuck_ms} ms; not writing to it until they finish"
    )]
    Stuck {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// Operations still in flight.
        in_flight: usize,
        /// Since when (milliseconds ago) they are quarantined.
        stuck_ms: u128,
    },
    /// UCX reported the peer failed (its endpoint's error handler ran, or an operation failed
    /// with a peer-failure status): the receiver died or is unreachable. Only endpoints in
    /// [`ErrorMode::Peer`] report this.
    #[error("{instance} rank {rank} failed in UCX: {status}")]
    PeerFailed {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// What UCX's error handler reported (else the failed operation's status).
        status: Status,
        /// The operation that failed, if one did (none when the job found the endpoint
        /// already failed).
        #[source]
        source: Option<kvferry_ucx::Error>,
    },
    /// The peer's registration ended (its control connection closed).
    #[error("{instance} rank {rank} is gone")]
    PeerGone {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
    },
    /// Gathering a bounced piece into the staging buffer failed (a device copy the CUDA
    /// driver refused): the piece fails as a failed put does.
    #[error("rank {rank}: gathering a bounced piece failed: {detail}")]
    Gather {
        /// The rank.
        rank: u32,
        /// The driver's error, with its causes.
        detail: String,
    },
    /// The rank thread is gone.
    #[error("rank {rank} thread has stopped")]
    Stopped {
        /// The rank.
        rank: u32,
    },
}

/// Called on the rank thread once a job is done (after its flush) or has failed — for a job
/// that gave up with puts in flight, only once those have drained (never, if the thread ends
/// first), so that a receiver told of the failure knows none of its bytes can still land.
pub(crate) type JobDone = Box<dyn FnOnce(Result<WriteStats, WriteError>) + Send>;

/// Called on the rank thread once UCX no longer reads a job's sources, right before its
/// [`JobDone`] (for a replay: at once, or once its quarantined operations drained). Until then
/// the sources' slots must not be reused.
pub(crate) type JobRelease = Box<dyn FnOnce() + Send>;

/// Observes a sender rank's write jobs at fixed points, on the rank thread. Production code
/// installs none; tests and the CLI's fault-injection flag use it to delay a job (a hung
/// receiver, a slow network) without any fault field in the executor's own types.
pub trait WriteHook: Send + Sync + std::fmt::Debug {
    /// After a job issued every put and before it flushes.
    fn before_flush(&self, dest: &RemoteRank, plan: &ValidatedPlan);
}

/// One piece of one request for one receiver rank.
pub struct WriteJob {
    /// The request the plan belongs to (for logs).
    pub request: u64,
    /// Where to write.
    pub dest: Arc<RemoteRank>,
    /// What to write.
    pub plan: Arc<ValidatedPlan>,
    /// How long the job may run once started before it gives up (see the module docs).
    pub timeout: Duration,
    /// Called before the flush, if installed.
    pub hook: Option<Arc<dyn WriteHook>>,
    /// The completion callback.
    pub done: JobDone,
    /// The source-release callback (taken when the job runs).
    pub release: Option<JobRelease>,
    /// Write the piece through the receiver's bounce region instead of fragment by fragment.
    pub bounce: Option<BounceJob>,
}

/// A piece to bounce: its packed image ([`kvferry_plan::bounce::gather_list`]) is gathered
/// through the rank's staging buffer and put at `remote_addr`, inside the receiver's arena
/// ([`RemoteRank::bounce`]). Without a staging buffer (or while an earlier bounced window is
/// quarantined and may still read it) the job writes fragment by fragment instead, and its
/// [`WriteStats::bounced`] says so.
#[derive(Debug)]
pub struct BounceJob {
    /// Where the image goes.
    pub remote_addr: u64,
    /// The plan's fragments `(src, dst, len)` in packed order.
    pub gather: Vec<(u64, u64, u64)>,
}

impl std::fmt::Debug for WriteJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteJob")
            .field("dest", &(&self.dest.instance, self.dest.rank))
            .field("fragments", &self.plan.len())
            .field("bytes", &self.plan.total_bytes())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// What a replay moved, and when it ran on the rank thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayStats {
    /// When the first put was issued (after every fragment was resolved).
    pub started: Instant,
    /// When the last flush finished.
    pub finished: Instant,
    /// Totals over every replayed plan.
    pub written: WriteStats,
    /// Plans replayed (one window and one flush each).
    pub plans: u64,
}

/// Called on the rank thread once a replay is done or has failed.
pub(crate) type ReplayDone = Box<dyn FnOnce(Result<ReplayStats, WriteError>) + Send>;

/// A benchmark baseline: plans already written by [`WriteJob`]s, written again by a bare
/// loop — every fragment resolved to (source region, offset, remote key) before the clock
/// starts, then per plan one [`PutWindow`] of [`PUT_WINDOW`] puts (split at
/// `MAX_PUT_BYTES`) and one flush, on the same endpoints and memory. No liveness checks, no
/// per-fragment lookups, no callbacks between plans.
pub struct ReplayJob {
    /// The plans, with where each goes, in order.
    pub plans: Vec<(Arc<RemoteRank>, Arc<ValidatedPlan>)>,
    /// Deadline of the whole replay, from its first put.
    pub timeout: Duration,
    /// The completion callback.
    pub done: ReplayDone,
    /// The source-release callback, as for [`WriteJob::release`].
    pub release: Option<JobRelease>,
}

impl std::fmt::Debug for ReplayJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayJob")
            .field("plans", &self.plans.len())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Called on the rank thread with the outcome of [`RankThread::vet`]; with
/// [`WriteError::Stopped`] if the rank thread is gone (at once, on the caller's thread) or ends
/// before it gets to the command.
pub(crate) type VetDone = Box<dyn FnOnce(Result<(), WriteError>) + Send>;

/// Run once [`RankThread::forget_then`] has closed a peer's endpoints (or left those that
/// quarantined windows hold to close once they drain); dropped unrun, on whichever thread
/// drops it, if the rank thread ends first.
pub(crate) type Forgotten = Box<dyn FnOnce() + Send>;

/// A [`VetDone`] that is called exactly once: with [`WriteError::Stopped`] if it is dropped
/// unanswered (its command was still queued when the thread ended).
struct VetReply {
    rank: u32,
    reply: Option<VetDone>,
}

impl VetReply {
    fn send(mut self, result: Result<(), WriteError>) {
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

enum Command {
    Write(WriteJob),
    #[cfg_attr(not(feature = "harness"), allow(dead_code))]
    Replay(ReplayJob),
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
struct Activity {
    base: Instant,
    /// The last progress round that found work.
    busy: AtomicU64,
    /// The last time a run of idle rounds ended in the loop going to sleep, or staying
    /// awake ([`RankThread::keep_awake`]) with nothing to do.
    idle: AtomicU64,
    /// Whether the loop is asleep on its armed worker's descriptor now: nothing can have
    /// arrived since it went to sleep, or it would have woken.
    asleep: AtomicBool,
    /// Until when the loop does not go to sleep when idle ([`RankThread::keep_awake`]).
    awake_until: AtomicU64,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            base: Instant::now(),
            busy: AtomicU64::new(0),
            idle: AtomicU64::new(0),
            asleep: AtomicBool::new(false),
            awake_until: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
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
        let a = &self.activity;
        let (asleep, busy, idle, now) = (
            a.asleep.load(Ordering::Acquire),
            a.busy.load(Ordering::Acquire),
            a.idle.load(Ordering::Acquire),
            a.now(),
        );
        if asleep && idle > busy {
            // Armed and asleep: anything arriving would have woken it, so it has been quiet
            // since its last busy round.
            return Some(Duration::from_nanos(now.saturating_sub(busy)));
        }
        let fresh = Duration::from_nanos(now.saturating_sub(idle)) < IDLE_FRESH;
        (fresh && idle > busy).then(|| Duration::from_nanos(idle - busy))
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
    #[cfg_attr(not(feature = "harness"), allow(dead_code))]
    pub fn replay(&self, job: ReplayJob) {
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

/// Why a rank thread could not start.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The worker address could not be read.
    #[error("rank {rank}: cannot read the worker address")]
    Address {
        /// The rank.
        rank: u32,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// The worker already has endpoints (or other handles), so it cannot move to the thread.
    #[error("rank {rank}: its UCX worker is already in use, so it cannot move to its thread")]
    Shared {
        /// The rank.
        rank: u32,
    },
    /// The OS refused the eventfd that wakes the thread for its commands.
    #[error("rank {rank}: cannot create its thread's wake-up descriptor")]
    Wake {
        /// The rank.
        rank: u32,
        /// The OS error.
        source: std::io::Error,
    },
    /// The OS refused a thread.
    #[error("rank {rank}: cannot spawn its thread")]
    Thread {
        /// The rank.
        rank: u32,
        /// The OS error.
        source: std::io::Error,
    },
    /// The thread could not make its device pools' CUDA context current, so it ended.
    #[error("rank {rank}: its thread cannot serve device pools")]
    Bind {
        /// The rank.
        rank: u32,
        /// The device and the driver's error.
        source: BindError,
    },
    /// The thread ended before it reported that it started.
    #[error(
        "rank {rank}: its thread ended before it started{}",
        if *panicked { " (it panicked)" } else { "" }
    )]
    Died {
        /// The rank.
        rank: u32,
        /// Whether it panicked.
        panicked: bool,
    },
}

fn run(
    rank: u32,
    worker: Worker,
    (errors, config): (ErrorMode, ExecConfig),
    pools: &RankPools,
    staging: Option<(&Staging, Gatherer)>,
    (rx, wake): (Receiver<Command>, &EventFd),
    activity: &Activity,
) {
    // Every event of this thread carries its rank.
    let _span = tracing::info_span!("rank", rank).entered();
    // Its `Drop` abandons what is still quarantined, then its connections close their
    // endpoints; the UCX worker goes with the last handle on it.
    let mut exec = Executor {
        rank,
        worker,
        errors,
        pools,
        staging,
        conns: HashMap::new(),
        machine: ExecMachine::new(config),
        parked: HashMap::new(),
        next_window: 0,
        challenges: Vec::new(),
        own_files: std::cell::OnceCell::new(),
        copier: std::cell::OnceCell::new(),
    };
    let mut idle = 0u32;
    loop {
        let command = match rx.try_recv() {
            Ok(c) => Some(c),
            Err(TryRecvError::Disconnected) => return,
            Err(TryRecvError::Empty) => {
                if exec.worker.progress_or_yield() {
                    activity.busy.store(activity.now(), Ordering::Release);
                    exec.poll_stuck();
                    idle = 0;
                    continue;
                }
                idle = idle.saturating_add(1);
                if idle < SPIN_ROUNDS {
                    continue;
                }
                let now = activity.now();
                // A run of idle rounds: quiet as of now, whether it sleeps or stays awake.
                activity.idle.store(now, Ordering::Release);
                exec.poll_stuck();
                if now < activity.awake_until.load(Ordering::Acquire) {
                    continue;
                }
                match exec.sleep(&rx, wake, activity) {
                    Ok(c) => c,
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
        };
        let Some(command) = command else { continue };
        idle = 0;
        match command {
            Command::Forget(peer, then) => {
                exec.forget(peer);
                if let Some(then) = then {
                    exec.once_released(peer, then);
                }
            }
            Command::Vet(dest, challenge, reply) => {
                let result = exec
                    .connect(&dest)
                    .map(|_| ())
                    .and_then(|()| match challenge {
                        Some(payload) => exec.challenge(&dest, payload),
                        None => Ok(()),
                    });
                if let Err(e) = &result {
                    tracing::warn!(
                        peer = %dest.instance,
                        peer_rank = dest.rank,
                        error = %kvferry_plan::error_chain(&e),
                        "peer rank refused"
                    );
                }
                reply.send(result);
            }
            Command::Write(job) => exec.execute(job),
            Command::Replay(mut job) => {
                let result = exec.replay(&mut job);
                if let Err(e) = &result {
                    tracing::warn!(error = %kvferry_plan::error_chain(&e), "replay failed");
                }
                (job.done)(result);
            }
        }
    }
}

/// The remote keys of one peer rank's pools, unpacked on its endpoint, in pool order; shared
/// with the jobs that use them (each put in flight holds its own handle on its key).
type Keys = Rc<[RemoteKey]>;

/// Where each of a peer rank's pools lies in this process when its key maps it into a shared
/// host mapping here (the shared-memory transports): the local address of the pool's declared
/// base, valid for the whole declared range while the pool's key lives
/// ([`RemoteKey::check_range`] found the range contiguous inside one shared, writable mapping).
/// `None` for a pool only UCX's puts reach (tcp, device memory). In pool order, like [`Keys`].
type Mapped = Rc<[Option<NonNull<u8>>]>;

/// An endpoint to a peer rank and the keys of its pools, owned by the connection cache. When
/// it is dropped (the peer forgotten), a quarantined window with puts to the peer still holds
/// the endpoint and the keys those puts use, so the endpoint closes once the window drains.
struct Conn {
    ep: Endpoint,
    keys: Keys,
    mapped: Mapped,
}

/// A job's outcome, and the window it left in flight, if any.
type Written<'a> = (Result<WriteStats, WriteError>, Option<PutWindow<'a>>);

/// A window that gave up with operations in flight, parked until the executor's machine
/// releases it or the worker is replaced. It holds the endpoint and the remote keys those use,
/// and borrows their sources from the pools.
struct Parked<'a> {
    /// Dropped only once settled (or its endpoint broken), or abandoned with the worker.
    window: PutWindow<'a>,
    instance: String,
    rank: u32,
    since: Instant,
    /// The peer's registration flag ([`RemoteRank::alive`]).
    alive: Arc<AtomicBool>,
}

/// What the executor's machine runs when its rules say: a job's report, or a forgotten
/// peer's follow-up.
type Then = Box<dyn FnOnce()>;

/// A rank thread's executor state. `'a` is the life of the worker value and of the pools,
/// which puts borrow their sources from.
struct Executor<'a> {
    rank: u32,
    /// Replaced when stuck puts without peer error mode must be cut
    /// ([`replace_worker`](Self::replace_worker)).
    worker: Worker,
    /// The mode new endpoints are created in (falling back to `None` where UCX refuses it).
    errors: ErrorMode,
    pools: &'a RankPools,
    /// The staging buffer and its gather thread, if the rank bounces.
    staging: Option<(&'a Staging, Gatherer)>,
    conns: HashMap<(PeerId, u32), Conn>,
    /// The decisions: which jobs write, when parked windows are released or cut, in which
    /// order jobs report (see [`kvferry_protocol::exec`]).
    machine: ExecMachine<Then>,
    /// Quarantined windows (see the module docs), by the machine's number; never dropped
    /// while not idle.
    parked: HashMap<WindowId, Parked<'a>>,
    /// The number of the next parked window.
    next_window: WindowId,
    /// Worker challenges still being sent (each owns its payload).
    challenges: Vec<Request<'static>>,
    /// The shared files this rank's own pools and staging buffer are mappings of (a peer's
    /// key that maps one of them is refused), read once.
    own_files: std::cell::OnceCell<Vec<(String, u64)>>,
    /// The thread that copies half of a large job's direct copies
    /// ([`SHARE_MIN_JOB_BYTES`]), started with the first such job (`None` inside if it could
    /// not start: this thread copies alone).
    copier: std::cell::OnceCell<Option<CopyHelper>>,
}

/// One put of a replay, resolved before the clock starts.
struct ResolvedPut<'a> {
    region: &'a MemRegion,
    offset: usize,
    len: usize,
    dst: u64,
    key: usize,
}

/// One plan of a replay, resolved: its window (idle until the clock starts) and keys.
struct ResolvedPlan<'a> {
    dest: Arc<RemoteRank>,
    window: PutWindow<'a>,
    keys: Keys,
    puts: Vec<ResolvedPut<'a>>,
    bytes: u64,
    fragments: u64,
}

impl<'a> Executor<'a> {
    /// The cached connection to `dest`, or a new one, once every pool's declared range has
    /// passed [`check_key_range`]. A cached endpoint that UCX reported failed is dropped and
    /// replaced (a job finds out first, in [`window`](Self::window)).
    fn connect(&mut self, dest: &RemoteRank) -> Result<&Conn, WriteError> {
        let key = (dest.peer, dest.rank);
        if self
            .conns
            .get(&key)
            .is_some_and(|c| c.ep.failure().is_some())
        {
            self.drop_conn(key);
        }
        let errors = self.errors;
        let worker = &self.worker;
        let slot = match self.conns.entry(key) {
            Entry::Occupied(e) => return Ok(e.into_mut()),
            Entry::Vacant(slot) => slot,
        };
        // Whose memory the peer's keys may name: the process its worker address names
        // (checked before UCX maps anything the address or a key names).
        let owner_refused = |pool, reason: String| WriteError::KeyOwner {
            instance: dest.instance.clone(),
            rank: dest.rank,
            pool,
            reason,
        };
        let peer = PeerProcess::of_address(&dest.worker_address)
            .map_err(|e| owner_refused(None, e.to_string()))?;
        for (pool, k) in dest.pools.iter().chain(dest.bounce.iter()).enumerate() {
            // A malformed key is refused by name where it is unpacked, below.
            let layout = kvferry_ucx::KeyLayout::loaded();
            if kvferry_ucx::rkey_format::check_packed_rkey(&k.rkey, layout).is_ok() {
                peer.check_key(&k.rkey)
                    .map_err(|e| owner_refused(Some(pool), e.to_string()))?;
            }
        }
        let (pools, staging) = (self.pools, self.staging.as_ref().map(|(s, _)| *s));
        let own_files = self.own_files.get_or_init(|| own_files(pools, staging));
        let connect = |mode| worker.connect_with(&dest.worker_address, mode);
        let ep = match connect(errors) {
            Err(e) if errors != ErrorMode::None => {
                tracing::warn!(
                    peer = %dest.instance,
                    peer_rank = dest.rank,
                    mode = ?errors,
                    status = %e.status(),
                    "ucx refuses an endpoint with peer error handling; connecting without it"
                );
                connect(ErrorMode::None)
            }
            other => other,
        }
        .map_err(|source| WriteError::Connect {
            instance: dest.instance.clone(),
            rank: dest.rank,
            source,
        })?;
        // The bounce arena's key comes last, after the pools' (its index: the pool count).
        let (keys, mapped): (Vec<_>, Vec<_>) = dest
            .pools
            .iter()
            .chain(dest.bounce.iter())
            .enumerate()
            .map(|(pool, k)| {
                let key = ep
                    .unpack_rkey(&k.rkey)
                    .map_err(|source| WriteError::UnpackKey {
                        instance: dest.instance.clone(),
                        rank: dest.rank,
                        pool,
                        source,
                    })?;
                let local = check_key_range(dest, pool, k, &key)?;
                if let Some(at) = local {
                    refuse_own_file(own_files, at)
                        .and_then(|()| in_own_segment(&peer, &k.rkey, &key, at))
                        .map_err(|reason| owner_refused(Some(pool), reason))?;
                }
                Ok((key, local))
            })
            .collect::<Result<Vec<_>, WriteError>>()?
            .into_iter()
            .unzip();
        tracing::debug!(
            peer = %dest.instance,
            peer_rank = dest.rank,
            mapped = mapped.iter().filter(|m| m.is_some()).count(),
            "connected"
        );
        Ok(slot.insert(Conn {
            ep,
            keys: Rc::from(keys),
            mapped: Rc::from(mapped),
        }))
    }

    /// A window of [`PUT_WINDOW`] puts to `dest` (connecting first if need be), and the keys
    /// of its pools.
    ///
    /// A cached endpoint that UCX reported failed fails the job
    /// ([`WriteError::PeerFailed`]) and is dropped, so the next job connects afresh.
    fn window(&mut self, dest: &RemoteRank) -> Result<(PutWindow<'a>, Keys, Mapped), WriteError> {
        let key = (dest.peer, dest.rank);
        if let Some(status) = self.conns.get(&key).and_then(|c| c.ep.failure()) {
            self.drop_conn(key);
            return Err(peer_failed(dest, status, None));
        }
        let conn = self.connect(dest)?;
        let window = PutWindow::with_capacity(&conn.ep, PUT_WINDOW);
        Ok((window, Rc::clone(&conn.keys), Rc::clone(&conn.mapped)))
    }

    /// Drops the connections to `peer` (see [`RankThread::forget`]).
    fn forget(&mut self, peer: PeerId) {
        let ranks: Vec<(PeerId, u32)> = self
            .conns
            .keys()
            .filter(|(p, _)| *p == peer)
            .copied()
            .collect();
        for key in ranks {
            self.drop_conn(key);
        }
    }

    /// Drops the connection to `key` from the cache and closes its endpoint, or leaves it to
    /// close once the quarantined windows that hold it have drained.
    fn drop_conn(&mut self, key: (PeerId, u32)) {
        let (peer, peer_rank) = key;
        let Some(Conn { ep, keys, mapped }) = self.conns.remove(&key) else {
            return;
        };
        // The keys first: while they exist they keep the endpoint open (and the local
        // addresses of their mappings mean nothing without them).
        drop(mapped);
        drop(keys);
        match ep.close(FORGET_CLOSE_TIMEOUT) {
            Ok(()) => tracing::debug!(peer, peer_rank, "endpoint closed"),
            Err(e) if e.status() == Status::BUSY => tracing::debug!(
                peer,
                peer_rank,
                "endpoint closes once its quarantined puts have drained"
            ),
            Err(e) => tracing::debug!(
                peer,
                peer_rank,
                error = %e,
                status = %e.status(),
                "endpoint closed uncleanly"
            ),
        }
    }

    /// Releases quarantined windows whose operations have all finished.
    /// Sends `payload` to `dest`'s worker as a worker challenge, on the connection
    /// [`connect`](Self::connect) made; the send is kept until it completes.
    fn challenge(&mut self, dest: &RemoteRank, payload: Vec<u8>) -> Result<(), WriteError> {
        let Some(conn) = self.conns.get(&(dest.peer, dest.rank)) else {
            return Err(WriteError::Stopped { rank: self.rank });
        };
        let mut send = conn
            .ep
            .am_send_owned(
                kvferry_protocol::agent::WORKER_CHALLENGE_AM,
                Vec::new(),
                payload,
            )
            .map_err(|source| WriteError::Connect {
                instance: dest.instance.clone(),
                rank: dest.rank,
                source,
            })?;
        if !send.is_done() {
            self.challenges.push(send);
        }
        Ok(())
    }

    /// The idle loop's sleep, once a run of progress rounds found nothing: arms the worker
    /// and sleeps until it or the command eventfd `wake` is readable (at most [`IDLE_SLEEP`],
    /// or [`STUCK_SLEEP`] while a quarantined window waits). A command already queued is
    /// returned without sleeping. A worker with events still to progress, or one whose
    /// transports cannot signal them, gets the short timed wait for a command instead.
    fn sleep(
        &mut self,
        rx: &Receiver<Command>,
        wake: &EventFd,
        activity: &Activity,
    ) -> Result<Option<Command>, RecvTimeoutError> {
        let armed = self
            .worker
            .event_fd()
            .and_then(|efd| Ok((efd, self.worker.arm()?)));
        let efd = match armed {
            Ok((efd, true)) => efd,
            Ok((_, false)) => return rx.recv_timeout(FALLBACK_SLEEP).map(Some),
            Err(e) => {
                tracing::debug!(error = %e, "no UCX wake-up descriptor; polling for commands");
                return rx.recv_timeout(FALLBACK_SLEEP).map(Some);
            }
        };
        // Cleared before the channel is looked at: a command sent after this look signals
        // the descriptor again, so the poll below cannot miss it.
        wake.clear();
        match rx.try_recv() {
            Ok(c) => return Ok(Some(c)),
            Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
            Err(TryRecvError::Empty) => {}
        }
        // Parked windows are looked at again when the machine asks.
        let timeout = self.machine.poll_timeout().map_or(IDLE_SLEEP, |at| {
            at.saturating_duration_since(Instant::now()).min(IDLE_SLEEP)
        });
        activity.asleep.store(true, Ordering::SeqCst);
        // `keep_awake` stores its deadline, then reads `asleep` (both sequentially
        // consistent): either it sees this thread asleep and signals `wake`, or this load
        // sees its deadline and the thread does not sleep.
        if activity.now() < activity.awake_until.load(Ordering::SeqCst) {
            activity.asleep.store(false, Ordering::Release);
            return Ok(None);
        }
        let woke = wait_any_readable(&[wake.as_raw_fd(), efd], timeout);
        activity.asleep.store(false, Ordering::Release);
        if let Err(e) = woke {
            tracing::debug!(error = %e, "poll on the wake-up descriptors failed");
            return rx.recv_timeout(FALLBACK_SLEEP).map(Some);
        }
        Ok(None)
    }

    /// Looks at every parked window (has it settled, how much is in flight, is its receiver
    /// still registered) and carries out what the machine decides.
    fn poll_stuck(&mut self) {
        self.challenges.retain_mut(|send| !send.is_done());
        if !self.machine.is_quarantining() {
            return;
        }
        let now = Instant::now();
        for (&id, p) in &mut self.parked {
            // Settled, not merely idle: a put completes locally, and over tcp its bytes may
            // still be on the way; reporting the failure before a flush proves they landed
            // would let the receiver reuse slots those bytes are about to overwrite. A failed
            // flush means the endpoint is broken and delivers nothing more.
            let settled = match p.window.settle() {
                Ok(settled) => settled,
                Err(e) => {
                    tracing::debug!(peer = %p.instance, peer_rank = p.rank, error = %e, "quarantined operation failed");
                    p.window.is_idle()
                }
            };
            let look = Look {
                in_flight: p.window.in_flight() + usize::from(p.window.is_flushing()),
                settled,
                alive: p.alive.load(Ordering::Acquire),
            };
            self.machine.handle_look(now, id, look);
        }
        self.machine.handle_tick(now);
        self.drive();
    }

    /// Carries out what the machine asked, in order.
    fn drive(&mut self) {
        while let Some(action) = self.machine.poll_action() {
            match action {
                ExecAction::Run(then) => then(),
                ExecAction::Release { window } => {
                    if let Some(p) = self.parked.remove(&window) {
                        tracing::info!(
                            peer = %p.instance,
                            peer_rank = p.rank,
                            after_ms = p.since.elapsed().as_millis(),
                            "quarantined operations finished; released"
                        );
                    }
                }
                ExecAction::EndRegistration { window } => {
                    if let Some(p) = self.parked.get(&window) {
                        p.alive.store(false, Ordering::Release);
                    }
                }
                ExecAction::ForceClose {
                    window,
                    target,
                    reason,
                } => {
                    let Some(p) = self.parked.get(&window) else {
                        continue;
                    };
                    tracing::warn!(
                        peer = %p.instance,
                        peer_rank = p.rank,
                        in_flight = p.window.in_flight(),
                        quarantined_ms = p.since.elapsed().as_millis(),
                        reason = %reason,
                        "closing the endpoint of a quarantined window by force"
                    );
                    if let Err(e) = p.window.endpoint().force_close() {
                        tracing::warn!(
                            peer = %p.instance,
                            peer_rank = p.rank,
                            error = %e,
                            "forced endpoint close failed"
                        );
                    }
                    // Connect afresh next time: the cached endpoint may be the one closed.
                    self.drop_conn((target.peer, target.rank));
                }
                ExecAction::CutDue { window, reason } => {
                    if let Some(p) = self.parked.get(&window) {
                        tracing::warn!(
                            peer = %p.instance,
                            peer_rank = p.rank,
                            in_flight = p.window.in_flight(),
                            quarantined_ms = p.since.elapsed().as_millis(),
                            reason = %reason,
                            "a quarantined window cannot be closed by force without peer error \
                             mode: the worker is replaced once every quarantined window's peer \
                             is gone"
                        );
                    }
                }
                ExecAction::ReplaceWorker { windows } => {
                    let replaced = self.replace_worker(&windows);
                    self.machine.handle_replaced(replaced);
                }
            }
        }
    }

    /// Runs `then` once no quarantined window of `peer` is left: at once, or when the last of
    /// them is released or cut.
    fn once_released(&mut self, peer: PeerId, then: Forgotten) {
        self.machine.forget_then(peer, then);
        self.drive();
    }

    /// Cuts the quarantined `windows` (every parked one) by replacing the worker, for windows
    /// whose endpoints cannot be closed by force (no peer error mode) and whose peers are all
    /// gone: every endpoint of the old worker is left to it ([`Endpoint::leave_to_worker`]),
    /// the windows and worker challenges abandoned, the connection cache emptied (live peers
    /// are connected afresh by their next job), and the old worker destroyed, which closes its
    /// connections and ends what was in flight. Returns whether it did; the machine then
    /// reports the quarantined jobs, in order. Receivers never dial a sender's worker, so its
    /// new address matters to no one.
    fn replace_worker(&mut self, windows: &[WindowId]) -> bool {
        let fresh = match Worker::new(self.worker.context()) {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot make a new worker: quarantined puts stay");
                return false;
            }
        };
        for conn in self.conns.values() {
            let _ = conn.ep.leave_to_worker();
        }
        let parked: Vec<Parked<'a>> = windows
            .iter()
            .filter_map(|id| self.parked.remove(id))
            .collect();
        for p in &parked {
            let _ = p.window.endpoint().leave_to_worker();
        }
        self.conns.clear();
        for send in self.challenges.drain(..) {
            send.forget();
        }
        let old = std::mem::replace(&mut self.worker, fresh);
        for p in parked {
            tracing::warn!(
                peer = %p.instance,
                peer_rank = p.rank,
                puts = p.window.in_flight(),
                quarantined_ms = p.since.elapsed().as_millis(),
                "cutting quarantined puts: replacing this rank's worker"
            );
            // SAFETY: the abandoned puts read this rank's pools or its staging buffer, which
            // outlive this thread. The worker they were issued on is destroyed just below,
            // before this thread does anything else: its last handles are this window's
            // (released by `abandon`), the cached connections' (dropped above; every endpoint
            // left to the worker, so none is closed on its own) and `old`. Its destruction
            // destroys the endpoints and ends the operations.
            unsafe { p.window.abandon() };
        }
        drop(old);
        true
    }

    /// Looks at the parked windows, then asks the machine whether a job to `dest` writes:
    /// `Ok(None)` when it has nothing to write, an error when it may not.
    fn admit(&mut self, dest: &RemoteRank, empty: bool) -> Result<Option<()>, WriteError> {
        self.poll_stuck();
        let alive = dest.alive.load(Ordering::Acquire);
        match self.machine.admit(target_of(dest), alive, empty) {
            Admit::Gone => Err(gone(dest)),
            Admit::Nothing => Ok(None),
            Admit::Behind { in_flight, since } => Err(WriteError::Stuck {
                instance: dest.instance.clone(),
                rank: dest.rank,
                in_flight,
                stuck_ms: since.elapsed().as_millis(),
            }),
            Admit::Write => Ok(Some(())),
        }
    }

    /// Parks `window`, which has operations in flight, in the quarantine, and tells the
    /// machine; `report` runs once they have all finished (or were cut).
    fn quarantine(
        &mut self,
        window: PutWindow<'a>,
        dest: &RemoteRank,
        bounced: bool,
        report: Then,
    ) {
        tracing::warn!(
            peer = %dest.instance,
            peer_rank = dest.rank,
            puts = window.in_flight(),
            "quarantining a window with operations in flight"
        );
        let id = self.next_window;
        self.next_window += 1;
        let end = JobEnd::Left {
            window: id,
            in_flight: window.in_flight() + usize::from(window.is_flushing()),
            bounced,
            forcible: window.endpoint().error_mode() == ErrorMode::Peer,
        };
        self.parked.insert(
            id,
            Parked {
                window,
                instance: dest.instance.clone(),
                rank: dest.rank,
                since: Instant::now(),
                alive: Arc::clone(&dest.alive),
            },
        );
        self.machine
            .handle_job(Instant::now(), target_of(dest), end, report);
        self.drive();
    }

    /// Runs one job and reports it: release (its sources are free) then done, at once; or,
    /// when it gave up with puts in flight, quarantines them and reports only once they have
    /// drained, so the receiver hears of the failure only when no more of its bytes can land.
    fn execute(&mut self, mut job: WriteJob) {
        let _span = tracing::debug_span!(
            "write",
            request = job.request,
            peer = %job.dest.instance,
            peer_rank = job.dest.rank
        )
        .entered();
        let release = job.release.take();
        let (result, stuck) = self.write(&job);
        if matches!(result, Err(WriteError::PeerFailed { .. })) {
            // Connect afresh next time; a window quarantined on it keeps the endpoint until
            // UCX has failed its operations too.
            self.drop_conn((job.dest.peer, job.dest.rank));
        }
        let behind = matches!(result, Err(WriteError::Stuck { .. }));
        if let Err(e) = &result {
            let reported = if stuck.is_some() || behind {
                "once the quarantine drains"
            } else {
                "now"
            };
            tracing::warn!(error = %kvferry_plan::error_chain(&e), reported, "write job failed");
        }
        let done = job.done;
        let report: Then = Box::new(move || {
            if let Some(release) = release {
                release();
            }
            done(result);
        });
        match stuck {
            Some(window) => {
                let bounced = job.bounce.is_some();
                self.quarantine(window, &job.dest, bounced, report);
            }
            // Refused behind a quarantined window (or nothing written while one is parked):
            // reported after it, so the receiver does not hear of this piece's end while an
            // earlier piece's bytes may still land.
            None => {
                let end = if behind { JobEnd::Behind } else { JobEnd::Done };
                self.machine
                    .handle_job(Instant::now(), target_of(&job.dest), end, report);
                self.drive();
            }
        }
    }

    /// Writes one job's plan and flushes. Returns the outcome and, if it gave up with
    /// operations in flight, their window (which holds the endpoint and keys they use).
    fn write(&mut self, job: &WriteJob) -> Written<'a> {
        let taken = Instant::now();
        let (window, keys, mapped) = match self.prepare(job) {
            Ok(Some(conn)) => conn,
            Ok(None) => return (Ok(WriteStats::default()), None),
            Err(e) => return (Err(e), None),
        };
        let dest = &*job.dest;
        let started = Instant::now();
        let deadline = started + job.timeout;
        let alive_check = self.machine.config().alive_check;
        let mut window = window.with_deadline(deadline.min(started + alive_check));
        let mut waiter = Waiter {
            dest,
            started,
            deadline,
            alive_check,
        };
        let result = self
            .write_plan(&mut window, &mut waiter, &keys, &mapped, job)
            .map(|mut stats| {
                stats.busy_ns = nanos(taken.elapsed());
                stats
            });
        if result.is_err() && !window.is_idle() {
            let hopeless = matches!(
                result,
                Err(WriteError::TimedOut { .. }
                    | WriteError::PeerGone { .. }
                    | WriteError::PeerFailed { .. })
            );
            if !hopeless {
                // A local refusal mid-plan: let what was issued finish, within the deadline.
                let _ = waiter.wait(&mut window, PutWindow::flush);
            }
        }
        if window.is_idle() {
            drop(window);
            (result, None)
        } else {
            (result, Some(window))
        }
    }

    /// The window and keys a job writes with, `None` for an empty plan (nothing to write, so
    /// nothing to flush: earlier pieces were flushed before their own completions).
    #[allow(clippy::type_complexity)]
    fn prepare(
        &mut self,
        job: &WriteJob,
    ) -> Result<Option<(PutWindow<'a>, Keys, Mapped)>, WriteError> {
        let dest = &*job.dest;
        match self.admit(dest, job.plan.is_empty())? {
            Some(()) => self.window(dest).map(Some),
            None => Ok(None),
        }
    }

    /// Writes `job`'s fragments: each with UCX puts, or — to a pool whose key maps it into this
    /// process ([`Mapped`]) from host memory — with one copy straight into the peer's shared
    /// mapping, which is what UCX's shared-memory put does for each put, without a request
    /// per put. Then the flush, which also orders the puts' bytes before the completion.
    fn write_plan(
        &self,
        window: &mut PutWindow<'a>,
        waiter: &mut Waiter<'_>,
        keys: &[RemoteKey],
        mapped: &[Option<NonNull<u8>>],
        job: &WriteJob,
    ) -> Result<WriteStats, WriteError> {
        if let Some(bounce) = &job.bounce {
            if self.machine.staging_busy() {
                tracing::info!(
                    request = job.request,
                    "an earlier bounced window is quarantined and may still read the staging \
                     buffer: this piece goes fragment by fragment"
                );
            } else if let Some((staging, gatherer)) = &self.staging {
                return self.write_bounced(window, waiter, keys, job, bounce, staging, gatherer);
            }
        }
        let dest = &*job.dest;
        let pools: &'a RankPools = self.pools;
        let mut stats = WriteStats::default();
        let stream = job.plan.total_bytes() >= STREAM_MIN_JOB_BYTES;
        let shared = job.plan.total_bytes() >= SHARE_MIN_JOB_BYTES;
        // A large job's direct copies, made after the loop by this thread and a helper.
        let mut halves = Halves::new(stream);
        let issuing = Instant::now();
        for (k, (src, dst, len)) in job.plan.fragments().enumerate() {
            if !dest.alive.load(Ordering::Acquire) {
                return Err(gone(dest));
            }
            let outside = || WriteError::SourceOutside {
                fragment: k,
                rank: self.rank,
                address: src,
                len,
            };
            let (pool, offset) = pools.locate(src, len).ok_or_else(outside)?;
            let region = pools.region(pool).ok_or_else(outside)?;
            let outside = || WriteError::DestinationOutside {
                fragment: k,
                instance: dest.instance.clone(),
                rank: dest.rank,
                address: dst,
                len,
            };
            let dst_pool = dest.pool_of(dst, len).ok_or_else(outside)?;
            let rkey = keys.get(dst_pool).ok_or_else(outside)?;
            if let (Some(Some(local)), true) =
                (mapped.get(dst_pool), region.memory_type().is_host())
            {
                let declared = &dest.pools[dst_pool];
                // `pool_of` put `[dst, dst + len)` inside the pool's declared range.
                let at = usize::try_from(dst - declared.base).map_err(|_| outside())?;
                let n = usize::try_from(len).map_err(|_| outside())?;
                // SAFETY: the source is `n` bytes at `offset` of a host region of this rank's
                // pools (`locate` put the fragment inside it), kept alive by `self.pools`. The
                // destination is `n` bytes at `at` past the local address of the peer pool's
                // declared base: `pool_of` put the fragment inside that declared range, and
                // `check_key_range` found the whole range translated contiguously into one
                // shared, writable mapping of this process, which stays mapped while the
                // pool's key lives (`keys` holds it for this job). `copy_to_peer` tolerates
                // the two ranges overlapping (a peer in this process, or a key that names one
                // of our own segments), as `ptr::copy` does, so no aliasing assumption is made.
                // A job that shares its copies only computes the two addresses here (inside
                // the same ranges); its copies are made below, under the same promise.
                unsafe {
                    let (from, to) = (region.as_ptr().add(offset), local.as_ptr().add(at));
                    if shared {
                        halves.push(from, to, n);
                    } else {
                        copy_to_peer(from, to, n, stream);
                    }
                }
                stats.puts += 1;
                stats.fragments += 1;
                stats.bytes += len;
                continue;
            }
            let mut done = 0;
            while done < len {
                let n = (len - done).min(MAX_PUT_BYTES);
                let (at, to) = (offset + done as usize, dst + done);
                waiter.wait(window, |w| w.put_region(region, at, n as usize, to, rkey))?;
                done += n;
                stats.puts += 1;
            }
            stats.fragments += 1;
            stats.bytes += len;
        }
        if !halves.is_empty() {
            let (_sharing, helped) = Sharing::start();
            let copier = self.copier.get_or_init(|| {
                CopyHelper::spawn(&format!("r{}", self.rank))
                    .inspect_err(|e| {
                        tracing::warn!(error = %e, "no copy helper thread: jobs copy on the rank thread alone");
                    })
                    .ok()
            });
            // SAFETY: every run was pushed above with the promise stated there: a source
            // inside this rank's host pools (alive with `self.pools`) and a destination inside
            // a peer pool's shared mapping, mapped while `keys` (this job's) holds the pool's
            // key, which outlives this call; `run` returns only once every byte is copied.
            unsafe {
                halves.run(copier.as_ref().filter(|_| helped), || {
                    self.worker.progress_or_yield();
                });
            }
        }
        stats.puts_ns = nanos(issuing.elapsed());
        // The copies' bytes before the flush's completion and the completion message that
        // follows it (a no-op on x86; UCX's own copies are ordered by its flush).
        std::sync::atomic::fence(Ordering::SeqCst);
        Self::flush_job(window, waiter, job, stats)
    }

    /// A job's puts are issued: the hook (if any), then the flush, timed into `stats`.
    fn flush_job(
        window: &mut PutWindow<'a>,
        waiter: &mut Waiter<'_>,
        job: &WriteJob,
        mut stats: WriteStats,
    ) -> Result<WriteStats, WriteError> {
        if let Some(hook) = &job.hook {
            hook.before_flush(&job.dest, &job.plan);
        }
        let flushing = Instant::now();
        waiter.wait(window, PutWindow::flush)?;
        stats.flush_ns = nanos(flushing.elapsed());
        Ok(stats)
    }

    /// Writes one piece through the receiver's bounce region (see [`BounceJob`]): the packed
    /// image in chunks of one staging half, the gather thread filling one half while the
    /// other's puts are in flight, then one flush.
    #[allow(clippy::too_many_arguments)]
    fn write_bounced(
        &self,
        window: &mut PutWindow<'a>,
        waiter: &mut Waiter<'_>,
        keys: &[RemoteKey],
        job: &WriteJob,
        bounce: &BounceJob,
        staging: &'a Staging,
        gatherer: &Gatherer,
    ) -> Result<WriteStats, WriteError> {
        let dest = &*job.dest;
        let mut stats = WriteStats {
            bounced: true,
            ..WriteStats::default()
        };
        // Every source, resolved to this process's address, before anything moves.
        let mut sources = Vec::with_capacity(bounce.gather.len());
        for (k, &(src, _, len)) in bounce.gather.iter().enumerate() {
            let outside = || WriteError::SourceOutside {
                fragment: k,
                rank: self.rank,
                address: src,
                len,
            };
            let (pool, offset) = self.pools.locate(src, len).ok_or_else(outside)?;
            let region = self.pools.region(pool).ok_or_else(outside)?;
            // The gather copies one kind of memory: the staging buffer's.
            if region.memory_type().is_host() != staging.copier().is_host() {
                return Err(outside());
            }
            sources.push((region.as_ptr() as u64 + offset as u64, len));
            stats.bytes += len;
        }
        stats.fragments = sources.len() as u64;
        let total = stats.bytes;
        let arena_key = keys.get(dest.pools.len());
        let inside = dest.bounce.as_ref().is_some_and(|a| {
            bounce.remote_addr >= a.base
                && bounce
                    .remote_addr
                    .checked_add(total)
                    .is_some_and(|end| end <= a.base.saturating_add(a.len))
        });
        let Some(arena_key) = arena_key.filter(|_| inside) else {
            return Err(WriteError::DestinationOutside {
                fragment: 0,
                instance: dest.instance.clone(),
                rank: dest.rank,
                address: bounce.remote_addr,
                len: total,
            });
        };
        if total == 0 {
            return Ok(stats);
        }
        // The packed stream cut into chunks of one half each.
        let half = staging.half() as u64;
        let chunks = total.div_ceil(half) as usize;
        let mut parts: Vec<Vec<(u64, u64)>> = Vec::with_capacity(chunks);
        let mut current = Vec::new();
        let mut room = half;
        for (mut src, mut len) in sources {
            while len > 0 {
                let n = len.min(room);
                current.push((src, n));
                (src, len, room) = (src + n, len - n, room - n);
                if room == 0 {
                    parts.push(std::mem::take(&mut current));
                    room = half;
                }
            }
        }
        if !current.is_empty() {
            parts.push(current);
        }
        let base = staging.region().as_ptr() as u64;
        let mut outstanding = Outstanding { gatherer, count: 0 };
        let submit = |j: usize, parts: &mut Vec<Vec<(u64, u64)>>, o: &mut Outstanding<'_>| {
            let task = GatherTask {
                parts: std::mem::take(&mut parts[j]),
                dst: base + (j % 2) as u64 * half,
                id: j,
            };
            if o.gatherer.submit(task) {
                o.count += 1;
                true
            } else {
                false
            }
        };
        let stopped = || WriteError::Stopped { rank: self.rank };
        for j in 0..chunks.min(2) {
            if !submit(j, &mut parts, &mut outstanding) {
                return Err(stopped());
            }
        }
        let issuing = Instant::now();
        for j in 0..chunks {
            let waiting = Instant::now();
            loop {
                match gatherer.done.try_recv() {
                    Ok((_, copied)) => {
                        outstanding.count -= 1;
                        if let Err(detail) = copied {
                            return Err(WriteError::Gather {
                                rank: self.rank,
                                detail,
                            });
                        }
                        break;
                    }
                    Err(TryRecvError::Disconnected) => return Err(stopped()),
                    Err(TryRecvError::Empty) => {
                        if !dest.alive.load(Ordering::Acquire) {
                            return Err(gone(dest));
                        }
                        self.worker.progress_or_yield();
                    }
                }
            }
            stats.gather_ns += nanos(waiting.elapsed());
            let at = (j % 2) * half as usize;
            let len = (total - j as u64 * half).min(half);
            let mut done = 0;
            while done < len {
                let n = (len - done).min(MAX_PUT_BYTES);
                let to = bounce.remote_addr + j as u64 * half + done;
                waiter.wait(window, |w| {
                    w.put_region(
                        staging.region(),
                        at + done as usize,
                        n as usize,
                        to,
                        arena_key,
                    )
                })?;
                done += n;
                stats.puts += 1;
            }
            if j + 2 < chunks {
                // This half is refilled once its puts no longer read it.
                waiter.wait(window, PutWindow::wait_all)?;
                if !submit(j + 2, &mut parts, &mut outstanding) {
                    return Err(stopped());
                }
            }
        }
        stats.puts_ns = nanos(issuing.elapsed());
        Self::flush_job(window, waiter, job, stats)
    }

    /// Writes recorded plans again with a bare loop (see [`ReplayJob`]); runs its release
    /// callback once its sources are free.
    fn replay(&mut self, job: &mut ReplayJob) -> Result<ReplayStats, WriteError> {
        let mut release = job.release.take();
        let result = self.replay_plans(job, &mut release);
        if let Some(release) = release {
            release();
        }
        result
    }

    /// [`replay`](Self::replay); `release` is taken if a window is quarantined.
    fn replay_plans(
        &mut self,
        job: &ReplayJob,
        release: &mut Option<JobRelease>,
    ) -> Result<ReplayStats, WriteError> {
        let pools: &'a RankPools = self.pools;
        let mut resolved = Vec::with_capacity(job.plans.len());
        for (dest, plan) in &job.plans {
            if plan.is_empty() {
                continue;
            }
            self.admit(dest, false)?;
            let (window, keys, _) = self.window(dest)?;
            let mut puts = Vec::with_capacity(plan.len());
            for (k, (src, dst, len)) in plan.fragments().enumerate() {
                let outside = || WriteError::SourceOutside {
                    fragment: k,
                    rank: self.rank,
                    address: src,
                    len,
                };
                let (pool, offset) = pools.locate(src, len).ok_or_else(outside)?;
                let region = pools.region(pool).ok_or_else(outside)?;
                let key = dest
                    .pool_of(dst, len)
                    .filter(|&p| p < keys.len())
                    .ok_or_else(|| WriteError::DestinationOutside {
                        fragment: k,
                        instance: dest.instance.clone(),
                        rank: dest.rank,
                        address: dst,
                        len,
                    })?;
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(MAX_PUT_BYTES);
                    puts.push(ResolvedPut {
                        region,
                        offset: offset + done as usize,
                        len: n as usize,
                        dst: dst + done,
                        key,
                    });
                    done += n;
                }
            }
            resolved.push(ResolvedPlan {
                dest: Arc::clone(dest),
                window,
                keys,
                puts,
                bytes: plan.total_bytes(),
                fragments: plan.len() as u64,
            });
        }

        let started = Instant::now();
        let deadline = started + job.timeout;
        let mut written = WriteStats::default();
        let plans = resolved.len() as u64;
        for plan in resolved {
            let mut window = plan.window.with_deadline(deadline);
            let issuing = Instant::now();
            let mut outcome = Ok(());
            for put in &plan.puts {
                outcome = window.put_region(
                    put.region,
                    put.offset,
                    put.len,
                    put.dst,
                    &plan.keys[put.key],
                );
                if outcome.is_err() {
                    break;
                }
            }
            let flushing = Instant::now();
            if outcome.is_ok() {
                outcome = window.flush();
            }
            let flushed = Instant::now();
            let dest = &*plan.dest;
            let error = outcome.err().map(|source| {
                if source.status() == Status::TIMED_OUT {
                    WriteError::TimedOut {
                        instance: dest.instance.clone(),
                        rank: dest.rank,
                        waiting: waiting_for(&source),
                        waited_ms: started.elapsed().as_millis(),
                        in_flight: window.in_flight() + usize::from(window.is_flushing()),
                    }
                } else {
                    ucx_error(dest, window.endpoint(), source)
                }
            });
            if matches!(error, Some(WriteError::PeerFailed { .. })) {
                self.drop_conn((dest.peer, dest.rank));
            }
            if !window.is_idle() {
                let release = release.take();
                let on_drain: Then = Box::new(move || {
                    if let Some(release) = release {
                        release();
                    }
                });
                self.quarantine(window, dest, false, on_drain);
            }
            if let Some(error) = error {
                return Err(error);
            }
            written.bytes += plan.bytes;
            written.fragments += plan.fragments;
            written.puts += plan.puts.len() as u64;
            written.puts_ns += nanos(flushing.duration_since(issuing));
            written.flush_ns += nanos(flushed.duration_since(flushing));
        }
        written.busy_ns = nanos(started.elapsed());
        Ok(ReplayStats {
            started,
            finished: Instant::now(),
            written,
            plans,
        })
    }
}

impl Drop for Executor<'_> {
    fn drop(&mut self) {
        for mut send in self.challenges.drain(..) {
            if !send.is_done() {
                // A challenge to a worker that never took it: forgotten rather than waited
                // for (its drop would wait for the peer). Sound: the request owns its
                // payload and holds its endpoint, both leaked with it, so nothing UCX may
                // still read is freed.
                std::mem::forget(send);
            }
        }
        for (_, parked) in self.parked.drain() {
            let Parked {
                mut window,
                instance,
                rank,
                ..
            } = parked;
            let _ = window.poll();
            if window.is_idle() {
                drop(window);
                continue;
            }
            tracing::warn!(
                peer = %instance,
                peer_rank = rank,
                puts = window.in_flight(),
                "rank thread ending with quarantined puts in flight: abandoning them"
            );
            // SAFETY: the abandoned puts read this rank's pools, which the thread's closure
            // keeps alive until after `run` has returned. By then every handle on their
            // endpoint is gone: `abandon` releases the window's, the connection cache's go when
            // the executor's fields drop right after this, and no other window on it is left
            // (each was abandoned or dropped idle here). So the endpoint has been closed, which
            // ends the operations (gracefully only after a flush that completed them, else by
            // force), and the worker destroyed, before the pools go.
            unsafe { window.abandon() };
        }
    }
}

/// Gather tasks a bounced job submitted and has not seen reported: waited for when the job
/// ends early, so no task of it still writes the staging buffer (or reports) after it.
struct Outstanding<'g> {
    gatherer: &'g Gatherer,
    count: usize,
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        while self.count > 0 {
            if self.gatherer.done.recv().is_err() {
                return;
            }
            self.count -= 1;
        }
    }
}

/// `d` in whole nanoseconds (saturating: 584 years).
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Runs window operations under a job's deadline, rechecking the receiver's registration
/// every [`ExecConfig::alive_check`].
struct Waiter<'d> {
    dest: &'d RemoteRank,
    started: Instant,
    deadline: Instant,
    /// How often the receiver's registration is rechecked ([`ExecConfig::alive_check`]).
    alive_check: Duration,
}

impl Waiter<'_> {
    /// Runs `op` until it succeeds or fails for another reason than the window's deadline;
    /// on the window's deadline, fails if the receiver is gone or the job's deadline passed,
    /// else moves the window's deadline on and runs `op` again (a put refused at a deadline
    /// was not issued; a flush goes on waiting for the same flush).
    fn wait<'a>(
        &mut self,
        window: &mut PutWindow<'a>,
        mut op: impl FnMut(&mut PutWindow<'a>) -> Result<(), kvferry_ucx::Error>,
    ) -> Result<(), WriteError> {
        loop {
            match op(window) {
                Ok(()) => return Ok(()),
                Err(e) if e.status() == Status::TIMED_OUT => {
                    if let Some(status) = window.endpoint().failure() {
                        return Err(peer_failed(self.dest, status, None));
                    }
                    if !self.dest.alive.load(Ordering::Acquire) {
                        return Err(gone(self.dest));
                    }
                    let now = Instant::now();
                    if now >= self.deadline {
                        return Err(WriteError::TimedOut {
                            instance: self.dest.instance.clone(),
                            rank: self.dest.rank,
                            waiting: waiting_for(&e),
                            waited_ms: now.duration_since(self.started).as_millis(),
                            in_flight: window.in_flight() + usize::from(window.is_flushing()),
                        });
                    }
                    window.set_deadline(Some(self.deadline.min(now + self.alive_check)));
                }
                Err(e) => return Err(ucx_error(self.dest, window.endpoint(), e)),
            }
        }
    }
}

/// " declares pool N", for a [`WriteError::KeyOwner`] about one pool.
fn pool_of(pool: &Option<usize>) -> String {
    pool.map_or_else(String::new, |p| format!(" declares pool {p}, but"))
}

/// What a window that timed out with `e` was waiting for.
fn waiting_for(e: &kvferry_ucx::Error) -> &'static str {
    if e.op() == Op::Flush { "flush" } else { "puts" }
}

/// The machine's name for a receiver rank.
fn target_of(dest: &RemoteRank) -> Target {
    Target {
        peer: dest.peer,
        rank: dest.rank,
    }
}

fn gone(dest: &RemoteRank) -> WriteError {
    WriteError::PeerGone {
        instance: dest.instance.clone(),
        rank: dest.rank,
    }
}

fn peer_failed(
    dest: &RemoteRank,
    status: Status,
    source: Option<kvferry_ucx::Error>,
) -> WriteError {
    WriteError::PeerFailed {
        instance: dest.instance.clone(),
        rank: dest.rank,
        status,
        source,
    }
}

/// Whether `status` says the peer or the link to it failed (a connection reset, an endpoint
/// timeout, UCX's link and endpoint failure ranges).
fn is_peer_failure(status: Status) -> bool {
    matches!(
        status,
        Status::CONNECTION_RESET | Status::NOT_CONNECTED | Status::ENDPOINT_TIMEOUT
    ) || (-89..=-40).contains(&status.code())
}

/// The job's error for UCX's `source` on `ep`: [`WriteError::PeerFailed`] if the endpoint
/// reports a failure (or, in peer mode, the operation failed with a peer-failure status,
/// should the handler not have run yet), else a put or flush error.
fn ucx_error(dest: &RemoteRank, ep: &Endpoint, source: kvferry_ucx::Error) -> WriteError {
    let failure = ep.failure().or_else(|| {
        (ep.error_mode() == ErrorMode::Peer && is_peer_failure(source.status()))
            .then(|| source.status())
    });
    if let Some(status) = failure {
        return peer_failed(dest, status, Some(source));
    }
    if source.op() == Op::Flush {
        WriteError::Flush {
            instance: dest.instance.clone(),
            rank: dest.rank,
            source,
        }
    } else {
        WriteError::Put {
            instance: dest.instance.clone(),
            rank: dest.rank,
            source,
        }
    }
}

mod keys;
use keys::{check_key_range, in_own_segment, own_files, refuse_own_file};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Transport;
    use crate::memory::PoolAllocator;

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

#[cfg(test)]
mod bounds_tests;
