//! The bench's baseline: recorded plans written again by a bare loop of puts
//! ([`ReplayJob`]), on the same endpoints and memory as the agent's jobs.

use std::sync::Arc;
use std::time::Instant;

use kvferry_ucx::{MemRegion, PutWindow, Status};

use super::super::error::{ucx_error, waiting_for};
use super::super::{
    JobRelease, MAX_PUT_BYTES, RemoteRank, ReplayJob, ReplayStats, WriteError, WriteStats,
};
use super::{Executor, Keys, Then, nanos};

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
    /// Writes recorded plans again with a bare loop (see [`ReplayJob`]); runs its release
    /// callback once its sources are free.
    pub(super) fn replay(&mut self, job: &mut ReplayJob) -> Result<ReplayStats, WriteError> {
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
        let mut resolved = Vec::with_capacity(job.plans.len());
        for (dest, plan) in &job.plans {
            if plan.is_empty() {
                continue;
            }
            self.admit(dest, false)?;
            let (window, keys, _) = self.window(dest)?;
            let mut puts = Vec::with_capacity(plan.len());
            for (k, (src, dst, len)) in plan.fragments().enumerate() {
                let (region, offset) = self.source(k, src, len)?;
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
