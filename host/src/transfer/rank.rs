//! One thread per rank, owning that rank's UCX worker: the progress loop and the executor.
//!
//! UCX workers run in single-thread mode, so everything a worker does happens on its thread:
//! endpoints, remote keys and puts never leave it. The rest of the host talks to the thread
//! through a channel ([`RankThread`]).
//!
//! - A **receiver** (generation) rank thread only progresses its worker, always: wire-up,
//!   `tcp` puts (emulated with active messages) and registered memory all need the target to
//!   progress. It never issues an operation, so it never waits on a peer and a dead sender
//!   cannot block it.
//! - A **sender** (context) rank thread also executes [`WriteJob`]s, in arrival order: for
//!   every fragment of a [`ValidatedPlan`] a `ucp_put_nbx` from its pool into the receiver's
//!   pool (a [`PutWindow`] bounds the puts in flight), then a flush of the endpoint, and only
//!   then the job's completion callback. Endpoints and unpacked remote keys are cached per
//!   (peer instance, peer rank) until [`RankThread::forget`].
//!
//! When idle the loop spins on `ucp_worker_progress` for a while, then sleeps in short,
//! growing steps (at most [`MAX_IDLE_SLEEP`]) waiting for a command, so idle ranks cost little
//! CPU on small machines while busy ones progress without pause.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use kvferry_ucx::{Endpoint, PutWindow, RemoteKey, Worker};
use typed_arena::Arena;

use super::memory::RankPools;
use super::wire::PoolKey;
use crate::plan::ValidatedPlan;

/// Puts kept in flight per job (platform-notes §2: bound them, or tcp's final flush collapses).
pub const PUT_WINDOW: usize = 32;
/// Fragments are split into puts of at most this many bytes.
pub const MAX_PUT_BYTES: u64 = 1 << 20;
/// Idle progress rounds before the loop starts sleeping.
const SPIN_ROUNDS: u32 = 2000;
/// The longest an idle rank sleeps between progress rounds.
pub const MAX_IDLE_SLEEP: Duration = Duration::from_micros(200);

/// Identifies one registration of a peer instance (a new connection gets a new id).
pub type PeerId = u64;

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
}

impl RemoteRank {
    /// The pool holding `[address, address + len)` entirely.
    fn pool_of(&self, address: u64, len: u64) -> Option<usize> {
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
    /// Puts issued (fragments split at [`MAX_PUT_BYTES`]).
    pub puts: u64,
}

/// Why a job did not complete.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// No endpoint to the peer rank.
    #[error("cannot connect to {instance} rank {rank}: {source}")]
    Connect {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// A peer pool's remote key could not be unpacked.
    #[error("cannot unpack the remote key of {instance} rank {rank} pool {pool}: {source}")]
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
    #[error("put to {instance} rank {rank} failed: {source}")]
    Put {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// The flush after the puts failed.
    #[error("flush to {instance} rank {rank} failed: {source}")]
    Flush {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// The peer's registration ended (its control connection closed).
    #[error("{instance} rank {rank} is gone")]
    PeerGone {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
    },
    /// The rank thread is gone.
    #[error("rank {rank} thread has stopped")]
    Stopped {
        /// The rank.
        rank: u32,
    },
}

/// Called on the rank thread once a job is done (after its flush) or has failed.
pub type JobDone = Box<dyn FnOnce(Result<WriteStats, WriteError>) + Send>;

/// One piece of one request for one receiver rank.
pub struct WriteJob {
    /// Where to write.
    pub dest: Arc<RemoteRank>,
    /// What to write.
    pub plan: ValidatedPlan,
    /// Fault injection: sleep this long after issuing the puts, before flushing.
    pub stall: Duration,
    /// The completion callback.
    pub done: JobDone,
}

impl std::fmt::Debug for WriteJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteJob")
            .field("dest", &(&self.dest.instance, self.dest.rank))
            .field("fragments", &self.plan.len())
            .field("bytes", &self.plan.total_bytes())
            .finish_non_exhaustive()
    }
}

enum Command {
    Write(WriteJob),
    Forget(PeerId),
}

/// The handle of one rank's progress thread.
#[derive(Debug)]
pub struct RankThread {
    rank: u32,
    address: Vec<u8>,
    tx: Sender<Command>,
    _thread: JoinHandle<()>,
}

impl RankThread {
    /// Moves `worker` to a new thread that progresses it for ever and executes jobs reading
    /// from `pools`.
    ///
    /// # Errors
    ///
    /// The worker's address cannot be read, or the thread cannot be spawned.
    pub fn spawn(
        label: &str,
        rank: u32,
        worker: Worker,
        pools: Arc<RankPools>,
    ) -> Result<RankThread, SpawnError> {
        let address = worker.address().map_err(|source| SpawnError::Address {
            rank,
            error: source,
        })?;
        let (tx, rx) = mpsc::channel();
        let thread = thread::Builder::new()
            .name(format!("{label}-rank{rank}"))
            .spawn(move || run(rank, worker, &pools, rx))
            .map_err(|source| SpawnError::Thread {
                rank,
                error: source,
            })?;
        Ok(RankThread {
            rank,
            address,
            tx,
            _thread: thread,
        })
    }

    /// The rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The worker's UCX address.
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// Queues a job; if the thread is gone, fails it at once.
    pub fn write(&self, job: WriteJob) {
        if let Err(mpsc::SendError(Command::Write(job))) = self.tx.send(Command::Write(job)) {
            (job.done)(Err(WriteError::Stopped { rank: self.rank }));
        }
    }

    /// Drops the endpoints and keys kept for `peer`.
    pub fn forget(&self, peer: PeerId) {
        let _ = self.tx.send(Command::Forget(peer));
    }
}

/// Why a rank thread could not start.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The worker address could not be read.
    #[error("rank {rank}: cannot read the worker address: {error}")]
    Address {
        /// The rank.
        rank: u32,
        /// UCX's error.
        error: kvferry_ucx::Error,
    },
    /// The OS refused a thread.
    #[error("rank {rank}: cannot spawn its thread: {error}")]
    Thread {
        /// The rank.
        rank: u32,
        /// The OS error.
        error: std::io::Error,
    },
}

/// An endpoint to a peer rank and the keys of its pools.
struct Conn<'a, 'w> {
    ep: &'a Endpoint<'w>,
    rkeys: Vec<RemoteKey<'a>>,
}

fn run(rank: u32, worker: Worker, pools: &RankPools, rx: Receiver<Command>) {
    // Endpoints live in the arena for the thread's life so remote keys can borrow them; a
    // forgotten peer's endpoint stays there (closed when the thread ends).
    let arena: Arena<Endpoint<'_>> = Arena::new();
    let mut conns: HashMap<(PeerId, u32), Conn<'_, '_>> = HashMap::new();
    let mut idle = 0u32;
    loop {
        let command = match rx.try_recv() {
            Ok(c) => Some(c),
            Err(TryRecvError::Disconnected) => return,
            Err(TryRecvError::Empty) => {
                if worker.progress() {
                    idle = 0;
                    continue;
                }
                idle = idle.saturating_add(1);
                if idle < SPIN_ROUNDS {
                    std::hint::spin_loop();
                    continue;
                }
                let step = (idle - SPIN_ROUNDS).min(16);
                let sleep = Duration::from_micros(10 * u64::from(step + 1)).min(MAX_IDLE_SLEEP);
                match rx.recv_timeout(sleep) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
        };
        let Some(command) = command else { continue };
        idle = 0;
        match command {
            Command::Forget(peer) => conns.retain(|(p, _), _| *p != peer),
            Command::Write(job) => {
                let result = execute(rank, &worker, &arena, &mut conns, pools, &job);
                if let Err(e) = &result {
                    tracing::warn!(rank, error = %e, "write job failed");
                }
                (job.done)(result);
            }
        }
    }
}

/// Writes one job's plan and flushes.
fn execute<'a, 'w>(
    rank: u32,
    worker: &'w Worker,
    arena: &'a Arena<Endpoint<'w>>,
    conns: &mut HashMap<(PeerId, u32), Conn<'a, 'w>>,
    pools: &RankPools,
    job: &WriteJob,
) -> Result<WriteStats, WriteError> {
    let dest = &job.dest;
    let gone = || WriteError::PeerGone {
        instance: dest.instance.clone(),
        rank: dest.rank,
    };
    if !dest.alive.load(Ordering::Acquire) {
        return Err(gone());
    }
    if job.plan.is_empty() {
        // Nothing to write, so nothing to flush: earlier pieces were flushed before their
        // own completions.
        return Ok(WriteStats::default());
    }
    let conn = match conns.entry((dest.peer, dest.rank)) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(slot) => {
            let ep =
                worker
                    .connect(&dest.worker_address)
                    .map_err(|source| WriteError::Connect {
                        instance: dest.instance.clone(),
                        rank: dest.rank,
                        source,
                    })?;
            let ep: &'a Endpoint<'w> = arena.alloc(ep);
            let rkeys = dest
                .pools
                .iter()
                .enumerate()
                .map(|(pool, k)| {
                    ep.unpack_rkey(&k.rkey)
                        .map_err(|source| WriteError::UnpackKey {
                            instance: dest.instance.clone(),
                            rank: dest.rank,
                            pool,
                            source,
                        })
                })
                .collect::<Result<Vec<_>, _>>()?;
            tracing::debug!(rank, peer = %dest.instance, peer_rank = dest.rank, "connected");
            slot.insert(Conn { ep, rkeys })
        }
    };
    let put_error = |source| WriteError::Put {
        instance: dest.instance.clone(),
        rank: dest.rank,
        source,
    };
    let mut stats = WriteStats::default();
    let mut window = PutWindow::with_capacity(conn.ep, PUT_WINDOW);
    for (k, (src, dst, len)) in job.plan.fragments().enumerate() {
        if !dest.alive.load(Ordering::Acquire) {
            return Err(gone());
        }
        let (pool, offset) = pools.locate(src, len).ok_or(WriteError::SourceOutside {
            fragment: k,
            rank,
            address: src,
            len,
        })?;
        let region = pools.region(pool).ok_or(WriteError::SourceOutside {
            fragment: k,
            rank,
            address: src,
            len,
        })?;
        let rkey = dest
            .pool_of(dst, len)
            .and_then(|p| conn.rkeys.get(p))
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
            window
                .put_region(region, offset + done as usize, n as usize, dst + done, rkey)
                .map_err(put_error)?;
            done += n;
            stats.puts += 1;
        }
        stats.fragments += 1;
        stats.bytes += len;
    }
    if !job.stall.is_zero() {
        thread::sleep(job.stall);
    }
    window.finish().map_err(|source| {
        if source.op() == kvferry_ucx::Op::Flush {
            WriteError::Flush {
                instance: dest.instance.clone(),
                rank: dest.rank,
                source,
            }
        } else {
            put_error(source)
        }
    })?;
    Ok(stats)
}
