//! A job's puts and copies: fragment by fragment, or through the receiver's bounce region,
//! then the flush — under the job's deadline.

use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::mpsc::TryRecvError;
use std::time::{Duration, Instant};

use kvferry_ucx::{MemRegion, PutWindow, RemoteKey, Status};

use super::super::error::{gone, peer_failed, ucx_error, waiting_for};
use super::super::{BounceJob, MAX_PUT_BYTES, RemoteRank, WriteError, WriteJob, WriteStats};
use super::Executor;
use super::nanos;
use crate::bounce::{GatherTask, Gatherer, Staging};
use crate::memory::RankPools;
use crate::streaming::{
    CopyHelper, Halves, SHARE_MIN_JOB_BYTES, STREAM_MIN_JOB_BYTES, Sharing, copy_to_peer,
};

impl<'a> Executor<'a> {
    /// Fragment `k`'s source `[src, src + len)`: the region of this rank's pools that holds it
    /// whole, and its offset there.
    pub(super) fn source(
        &self,
        k: usize,
        src: u64,
        len: u64,
    ) -> Result<(&'a MemRegion, usize), WriteError> {
        let pools: &'a RankPools = self.pools;
        pools
            .locate(src, len)
            .and_then(|(pool, offset)| Some((pools.region(pool)?, offset)))
            .ok_or_else(|| source_outside(self.rank, k, src, len))
    }

    /// Writes `job`'s fragments: each with UCX puts, or — to a pool whose key maps it into this
    /// process ([`Mapped`]) from host memory — with one copy straight into the peer's shared
    /// mapping, which is what UCX's shared-memory put does for each put, without a request
    /// per put. Then the flush, which also orders the puts' bytes before the completion.
    pub(super) fn write_plan(
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
            let (region, offset) = self.source(k, src, len)?;
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
            let (region, offset) = self.source(k, src, len)?;
            // The gather copies one kind of memory: the staging buffer's.
            if region.memory_type().is_host() != staging.copier().is_host() {
                return Err(source_outside(self.rank, k, src, len));
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

/// Runs window operations under a job's deadline, rechecking the receiver's registration
/// every [`ExecConfig::alive_check`].
pub(super) struct Waiter<'d> {
    pub(super) dest: &'d RemoteRank,
    pub(super) started: Instant,
    pub(super) deadline: Instant,
    /// How often the receiver's registration is rechecked ([`ExecConfig::alive_check`]).
    pub(super) alive_check: Duration,
}

impl Waiter<'_> {
    /// Runs `op` until it succeeds or fails for another reason than the window's deadline;
    /// on the window's deadline, fails if the receiver is gone or the job's deadline passed,
    /// else moves the window's deadline on and runs `op` again (a put refused at a deadline
    /// was not issued; a flush goes on waiting for the same flush).
    pub(super) fn wait<'a>(
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

/// [`WriteError::SourceOutside`] for fragment `fragment` of rank `rank`.
fn source_outside(rank: u32, fragment: usize, address: u64, len: u64) -> WriteError {
    WriteError::SourceOutside {
        fragment,
        rank,
        address,
        len,
    }
}
