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
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;
#[cfg(feature = "harness")]
use std::time::Instant;

use kvferry_plan::ValidatedPlan;
use kvferry_protocol::PoolKey;

mod error;
mod exec;
mod keys;
mod thread;

pub use error::{SpawnError, WriteError};
pub(crate) use exec::nanos;
pub use thread::RankThread;

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

#[cfg(feature = "harness")]
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

#[cfg(feature = "harness")]
/// Called on the rank thread once a replay is done or has failed.
pub(crate) type ReplayDone = Box<dyn FnOnce(Result<ReplayStats, WriteError>) + Send>;

#[cfg(feature = "harness")]
/// A benchmark baseline: plans already written by [`WriteJob`]s, written again by a bare
/// loop — every fragment resolved to (source region, offset, remote key) before the clock
/// starts, then per plan one [`PutWindow`](kvferry_ucx::PutWindow) of [`PUT_WINDOW`] puts (split at
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

#[cfg(feature = "harness")]
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

#[cfg(test)]
mod bounds_tests;
