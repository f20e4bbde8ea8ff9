//! The memcpy baseline of `kvferry bench`: the fragments a prefill server recorded
//! ([`crate::agent::Agent::recorded_fragments`]) copied with `memcpy` between host buffers
//! shaped like the pools, in one process — on shared memory the physical ceiling of the
//! machine for that fragment list.
//!
//! A [`CopyArena`] holds one buffer per pool of every prefill rank (sources) and of every
//! decode rank (destinations), each as long as the pool, so a fragment's `(pool,
//! offset)` lands at the same offset of its buffer: the same layout, the same strides.
//! Buffers are allocated once, checked against the host budget first, and every page is
//! written before any copy is timed (first-touch faults would otherwise dominate).
//! [`CopyArena::copy`] resolves every fragment against the buffers before the clock starts —
//! a fragment outside its pools, or two that write the same destination byte, refuse the
//! whole copy, naming it, and nothing is copied — then copies with one thread per context
//! rank (the agent path's concurrency: one rank thread each), each its pairs' fragments in
//! plan order, all released at once and timed from the first copy to the last.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex};
use std::thread;
use std::time::Instant;

use crate::outcome::PairFragments;
use crate::rank::nanos;
use kvferry_platform::HostBudget;
use kvferry_platform::units;

/// Why the memcpy baseline did not run. Nothing was copied.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CopyError {
    /// A fragment does not lie inside the pools of its pair.
    #[error("prefill rank {ctx_rank} -> decode rank {gen_rank}: fragment {fragment} {reason}")]
    Outside {
        /// The prefill rank.
        ctx_rank: u32,
        /// The decode rank.
        gen_rank: u32,
        /// The fragment's index in its pair's list.
        fragment: usize,
        /// What lies outside what.
        reason: String,
    },
    /// Two fragments write the same destination byte.
    #[error(
        "decode rank {gen_rank} pool {pool}: bytes {first_offset}+{first_len} (from context \
         rank {first_ctx}) and {second_offset}+{second_len} (from prefill rank {second_ctx}) \
         overlap"
    )]
    Overlap {
        /// The decode rank.
        gen_rank: u32,
        /// Its pool.
        pool: u32,
        /// The lower fragment's writer.
        first_ctx: u32,
        /// Its offset in the pool.
        first_offset: u64,
        /// Its length.
        first_len: u64,
        /// The other fragment's writer.
        second_ctx: u32,
        /// Its offset.
        second_offset: u64,
        /// Its length.
        second_len: u64,
    },
    /// Two pairs describe one rank's pools differently.
    #[error(
        "{side} rank {rank}: one pair gives its pools as {first:?} bytes, another as {second:?}"
    )]
    Shape {
        /// `prefill` or `decode`.
        side: &'static str,
        /// The rank.
        rank: u32,
        /// One description.
        first: Vec<u64>,
        /// The other.
        second: Vec<u64>,
    },
    /// The buffers would not fit in the memory this process may still take.
    #[error("the memcpy baseline needs {} more for buffers shaped like the pools; {budget}", units::bytes(*.needed))]
    Memory {
        /// Bytes to allocate.
        needed: u64,
        /// What is available.
        budget: HostBudget,
    },
    /// A pool is larger than this machine can address.
    #[error("{side} rank {rank} pool {pool}: {len} bytes cannot be allocated here")]
    TooLarge {
        /// `prefill` or `decode`.
        side: &'static str,
        /// The rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// Its size.
        len: u64,
    },
    /// A copy thread could not be started.
    #[error("cannot start a copy thread")]
    Thread(#[source] std::io::Error),
    /// A copy thread panicked.
    #[error("a copy thread panicked")]
    Panicked,
}

/// What one run of [`CopyArena::copy`] moved, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyStats {
    /// When the first thread started copying.
    pub started: Instant,
    /// When the last thread finished.
    pub finished: Instant,
    /// Bytes copied.
    pub bytes: u64,
    /// Fragments copied (one `memcpy` each).
    pub fragments: u64,
    /// Plans they came in.
    pub plans: u64,
    /// Prefill ranks, one thread each.
    pub ranks: u32,
    /// Nanoseconds the threads spent copying, summed.
    pub copy_ns: u64,
}

/// Host buffers shaped like the pools of the ranks a bench's fragments name (see the module
/// docs). Kept across runs: buffers of a rank whose pools keep their sizes are reused.
#[derive(Debug, Default)]
pub struct CopyArena {
    /// Prefill rank → one buffer per pool.
    src: BTreeMap<u32, Vec<Vec<u8>>>,
    /// Decode rank → one buffer per pool.
    dst: BTreeMap<u32, Vec<Vec<u8>>>,
}

/// One fragment, resolved: source pool, offset, destination buffer (an index into the run's
/// destination list), offset, length.
#[derive(Clone, Copy, Debug)]
struct Resolved {
    src_pool: usize,
    src_offset: usize,
    dst: usize,
    dst_offset: usize,
    len: usize,
}

/// A destination buffer's start, shared by the copy threads of one run.
#[derive(Clone, Copy, Debug)]
struct DstPtr(*mut u8);

// SAFETY: a `DstPtr` is only dereferenced by `CopyArena::copy`'s threads, within the scope in
// which the arena is mutably borrowed (so its buffers neither move nor are freed nor are
// accessed otherwise), at ranges checked in bounds and disjoint from every other thread's.
unsafe impl Send for DstPtr {}
// SAFETY: as for `Send`: the threads only write disjoint ranges through it.
unsafe impl Sync for DstPtr {}

impl CopyArena {
    /// An empty arena.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes held in buffers.
    pub fn bytes(&self) -> u64 {
        self.src
            .values()
            .chain(self.dst.values())
            .flatten()
            .map(|b| b.len() as u64)
            .sum()
    }

    /// Makes sure every rank `pairs` names has buffers of its pools' sizes: new ones are
    /// checked against the host budget, allocated and written through (sources with a byte
    /// per rank and pool, destinations with zeros). Returns the bytes allocated.
    ///
    /// # Errors
    ///
    /// [`CopyError::Shape`] when two pairs disagree on a rank's pools, [`CopyError::Memory`]
    /// when the new buffers do not fit, [`CopyError::TooLarge`].
    pub fn prepare(&mut self, pairs: &[PairFragments]) -> Result<u64, CopyError> {
        let src = shapes("context", pairs.iter().map(|p| (p.ctx_rank, &p.src_pools)))?;
        let dst = shapes(
            "generation",
            pairs.iter().map(|p| (p.gen_rank, &p.dst_pools)),
        )?;
        let stale = |held: &BTreeMap<u32, Vec<Vec<u8>>>, want: &BTreeMap<u32, Vec<u64>>| {
            want.iter()
                .filter(|(r, sizes)| {
                    held.get(r).is_none_or(|b| {
                        b.len() != sizes.len()
                            || b.iter()
                                .zip(sizes.iter())
                                .any(|(b, &s)| b.len() as u64 != s)
                    })
                })
                .map(|(&r, sizes)| (r, sizes.clone()))
                .collect::<Vec<_>>()
        };
        let (new_src, new_dst) = (stale(&self.src, &src), stale(&self.dst, &dst));
        let needed: u64 = new_src
            .iter()
            .chain(&new_dst)
            .flat_map(|(_, sizes)| sizes.iter())
            .sum();
        if needed == 0 {
            return Ok(0);
        }
        // What the stale buffers of those ranks hold comes back before the new ones are made.
        let freed: u64 = new_src
            .iter()
            .filter_map(|(r, _)| self.src.get(r))
            .chain(new_dst.iter().filter_map(|(r, _)| self.dst.get(r)))
            .flatten()
            .map(|b| b.len() as u64)
            .sum();
        if let Some(budget) = HostBudget::measure() {
            if needed > budget.bytes.saturating_add(freed) {
                return Err(CopyError::Memory { needed, budget });
            }
        }
        for (side, new, held) in [
            ("context", new_src, &mut self.src),
            ("generation", new_dst, &mut self.dst),
        ] {
            for (rank, sizes) in new {
                held.remove(&rank);
                let mut buffers = Vec::with_capacity(sizes.len());
                for (pool, &len) in sizes.iter().enumerate() {
                    let n = usize::try_from(len).map_err(|_| CopyError::TooLarge {
                        side,
                        rank,
                        pool,
                        len,
                    })?;
                    let mut b = Vec::new();
                    b.try_reserve_exact(n).map_err(|_| CopyError::TooLarge {
                        side,
                        rank,
                        pool,
                        len,
                    })?;
                    // Every page written now: first-touch faults stay out of the timed copy.
                    let fill = if side == "context" {
                        (rank as u8).wrapping_mul(31).wrapping_add(pool as u8 + 1)
                    } else {
                        0
                    };
                    b.resize(n, fill);
                    buffers.push(b);
                }
                held.insert(rank, buffers);
            }
        }
        Ok(needed)
    }

    /// Copies every fragment of `pairs` (see the module docs), once
    /// [`prepare`](Self::prepare) has made the buffers.
    ///
    /// # Errors
    ///
    /// Those of [`prepare`](Self::prepare); [`CopyError::Outside`] or [`CopyError::Overlap`]
    /// for a fragment that cannot be copied (then nothing is); a thread that cannot start.
    pub fn copy(&mut self, pairs: &[PairFragments]) -> Result<CopyStats, CopyError> {
        self.prepare(pairs)?;
        let (jobs, dst) = self.resolve(pairs)?;
        let src = &self.src;
        let plans = pairs.iter().map(|p| p.plans.len() as u64).sum();
        let bytes = jobs.values().flatten().map(|r| r.len as u64).sum::<u64>();
        let fragments = jobs.values().map(|j| j.len() as u64).sum();
        let ranks = jobs.len() as u32;
        // Released together, or told to give up if a thread could not be started.
        let gate: (Mutex<Option<bool>>, Condvar) = (Mutex::new(None), Condvar::new());
        let open = |go: bool| {
            *gate.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(go);
            gate.1.notify_all();
        };
        let spans = thread::scope(|scope| {
            let mut handles = Vec::with_capacity(jobs.len());
            for (&rank, copies) in &jobs {
                let (gate, dst) = (&gate, &dst);
                let buffers = &src[&rank];
                let spawned = thread::Builder::new()
                    .name(format!("memcpy-r{rank}"))
                    .spawn_scoped(scope, move || {
                        let mut go = gate.0.lock().unwrap_or_else(|e| e.into_inner());
                        while go.is_none() {
                            go = gate.1.wait(go).unwrap_or_else(|e| e.into_inner());
                        }
                        if *go != Some(true) {
                            return None;
                        }
                        drop(go);
                        let started = Instant::now();
                        for c in copies {
                            let from = &buffers[c.src_pool][c.src_offset..c.src_offset + c.len];
                            let to: DstPtr = dst[c.dst];
                            // SAFETY: `resolve` checked `dst_offset + len` inside destination
                            // buffer `c.dst`, and that no two fragments of this run, in any
                            // thread, write the same byte; the buffer is owned by the arena,
                            // mutably borrowed for this whole scope and touched by nothing
                            // else; the source is another allocation (a shared slice).
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    from.as_ptr(),
                                    to.0.add(c.dst_offset),
                                    c.len,
                                );
                            }
                        }
                        Some((started, Instant::now()))
                    });
                match spawned {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        open(false);
                        return Err(CopyError::Thread(e));
                    }
                }
            }
            open(true);
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| CopyError::Panicked))
                .collect::<Result<Vec<_>, _>>()
        })?;
        let spans: Vec<(Instant, Instant)> = spans.into_iter().flatten().collect();
        let now = Instant::now();
        let started = spans.iter().map(|s| s.0).min().unwrap_or(now);
        let finished = spans.iter().map(|s| s.1).max().unwrap_or(now);
        Ok(CopyStats {
            started,
            finished,
            bytes,
            fragments,
            plans,
            ranks,
            copy_ns: spans.iter().map(|(a, b)| nanos(b.duration_since(*a))).sum(),
        })
    }

    /// Every fragment against the buffers, per prefill rank; and the destination buffers'
    /// starts the copies index.
    #[allow(clippy::type_complexity)]
    fn resolve(
        &mut self,
        pairs: &[PairFragments],
    ) -> Result<(BTreeMap<u32, Vec<Resolved>>, Vec<DstPtr>), CopyError> {
        let mut index: BTreeMap<(u32, usize), usize> = BTreeMap::new();
        let mut starts = Vec::new();
        let mut jobs: BTreeMap<u32, Vec<Resolved>> = BTreeMap::new();
        // (decode rank, pool, offset, length, prefill rank) of every write.
        let mut writes: Vec<(u32, u32, u64, u64, u32)> = Vec::new();
        for p in pairs {
            let (c, g) = (p.ctx_rank, p.gen_rank);
            let src = self.src.get(&c).map_or(&[][..], Vec::as_slice);
            let dst = self.dst.get_mut(&g).map_or(&mut [][..], Vec::as_mut_slice);
            let job = jobs.entry(c).or_default();
            job.reserve(p.fragments.len());
            writes.reserve(p.fragments.len());
            for (k, f) in p.fragments.iter().enumerate() {
                let outside = |reason: String| CopyError::Outside {
                    ctx_rank: c,
                    gen_rank: g,
                    fragment: k,
                    reason,
                };
                let (sp, so, dp, d, len) = (f.0 as usize, f.1, f.2 as usize, f.3, f.4);
                if len == 0 {
                    return Err(outside("moves no bytes".into()));
                }
                let src_offset = within("reads source", src.get(sp).map(Vec::len), sp, so, len)
                    .map_err(&outside)?;
                let dst_offset =
                    within("writes destination", dst.get(dp).map(Vec::len), dp, d, len)
                        .map_err(&outside)?;
                let slot = *index.entry((g, dp)).or_insert_with(|| {
                    starts.push(DstPtr(dst[dp].as_mut_ptr()));
                    starts.len() - 1
                });
                job.push(Resolved {
                    src_pool: sp,
                    src_offset,
                    dst: slot,
                    dst_offset,
                    len: len as usize,
                });
                writes.push((g, f.2, d, len, c));
            }
        }
        writes.sort_unstable();
        for w in writes.windows(2) {
            let (a, b) = (w[0], w[1]);
            if a.0 == b.0 && a.1 == b.1 && a.2 + a.3 > b.2 {
                return Err(CopyError::Overlap {
                    gen_rank: a.0,
                    pool: a.1,
                    first_ctx: a.4,
                    first_offset: a.2,
                    first_len: a.3,
                    second_ctx: b.4,
                    second_offset: b.2,
                    second_len: b.3,
                });
            }
        }
        Ok((jobs, starts))
    }

    #[cfg(test)]
    fn destination(&self, rank: u32, pool: usize) -> &[u8] {
        &self.dst[&rank][pool]
    }
}

/// The pools of every rank `pairs` name, each rank described once.
fn shapes<'a>(
    side: &'static str,
    pairs: impl Iterator<Item = (u32, &'a Vec<u64>)>,
) -> Result<BTreeMap<u32, Vec<u64>>, CopyError> {
    let mut out: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for (rank, sizes) in pairs {
        match out.get(&rank) {
            Some(known) if known != sizes => {
                return Err(CopyError::Shape {
                    side,
                    rank,
                    first: known.clone(),
                    second: sizes.clone(),
                });
            }
            Some(_) => {}
            None => {
                out.insert(rank, sizes.clone());
            }
        }
    }
    Ok(out)
}

/// `offset` as an index when `[offset, offset + len)` lies inside pool `pool` (of `size`
/// bytes; `None`: no such pool).
fn within(
    what: &str,
    size: Option<usize>,
    pool: usize,
    offset: u64,
    len: u64,
) -> Result<usize, String> {
    let Some(size) = size else {
        return Err(format!("{what} pool {pool}, which the rank does not have"));
    };
    match offset.checked_add(len) {
        Some(end) if end <= size as u64 => Ok(offset as usize),
        _ => Err(format!(
            "{what} pool {pool} at {offset}+{len}, outside its {size} bytes"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::PoolFragment;

    fn pair(c: u32, g: u32, fragments: Vec<PoolFragment>) -> PairFragments {
        PairFragments {
            ctx_rank: c,
            gen_rank: g,
            src_pools: vec![4096, 8192],
            dst_pools: vec![16384],
            plans: vec![fragments.len() as u64],
            bytes: fragments.iter().map(PoolFragment::len).sum(),
            fragments,
        }
    }

    #[test]
    fn fragments_land_at_their_offsets_from_one_thread_per_context_rank() {
        let mut arena = CopyArena::new();
        // Two prefill ranks write disjoint bytes of one decode rank's pool.
        let pairs = [
            pair(
                0,
                0,
                vec![
                    PoolFragment(0, 0, 0, 0, 100),
                    PoolFragment(1, 8000, 0, 200, 192),
                ],
            ),
            pair(1, 0, vec![PoolFragment(1, 0, 0, 16384 - 50, 50)]),
        ];
        let stats = arena.copy(&pairs).unwrap();
        assert_eq!((stats.bytes, stats.fragments, stats.ranks), (342, 3, 2));
        assert_eq!(stats.plans, 2);
        assert!(stats.finished >= stats.started);
        assert_eq!(arena.bytes(), 2 * (4096 + 8192) + 16384);
        let d = arena.destination(0, 0);
        // Source fills: rank r pool p holds r * 31 + p + 1.
        assert!(d[..100].iter().all(|&b| b == 1));
        assert!(d[100..200].iter().all(|&b| b == 0));
        assert!(d[200..392].iter().all(|&b| b == 2));
        assert!(d[392..16384 - 50].iter().all(|&b| b == 0));
        assert!(d[16384 - 50..].iter().all(|&b| b == 33));
        // Buffers of unchanged pools are reused.
        assert_eq!(arena.prepare(&pairs).unwrap(), 0);
    }

    #[test]
    fn fragments_outside_the_pools_are_refused_and_nothing_is_copied() {
        let mut arena = CopyArena::new();
        let good = PoolFragment(0, 0, 0, 0, 64);
        for (bad, words) in [
            (
                PoolFragment(0, 4000, 0, 1000, 97),
                "reads source pool 0 at 4000+97",
            ),
            (PoolFragment(2, 0, 0, 1000, 8), "reads source pool 2, which"),
            (
                PoolFragment(1, 0, 0, 16380, 8),
                "writes destination pool 0 at 16380+8",
            ),
            (
                PoolFragment(0, 0, 1, 0, 8),
                "writes destination pool 1, which",
            ),
            (
                PoolFragment(0, u64::MAX, 0, 0, 2),
                "reads source pool 0 at 18446744073709551615+2",
            ),
            (PoolFragment(0, 0, 0, 1000, 0), "moves no bytes"),
        ] {
            let e = arena.copy(&[pair(3, 5, vec![good, bad])]).unwrap_err();
            let text = e.to_string();
            assert!(
                matches!(
                    e,
                    CopyError::Outside {
                        ctx_rank: 3,
                        gen_rank: 5,
                        fragment: 1,
                        ..
                    }
                ),
                "{text}"
            );
            assert!(text.contains(words), "{text}");
            assert!(
                text.starts_with("prefill rank 3 -> decode rank 5: fragment 1"),
                "{text}"
            );
            assert!(
                arena.destination(5, 0).iter().all(|&b| b == 0),
                "nothing is copied when one fragment is refused"
            );
        }
    }

    #[test]
    fn overlapping_destinations_and_disagreeing_shapes_are_refused() {
        let mut arena = CopyArena::new();
        let e = arena
            .copy(&[
                pair(0, 1, vec![PoolFragment(0, 0, 0, 100, 50)]),
                pair(2, 1, vec![PoolFragment(0, 0, 0, 149, 10)]),
            ])
            .unwrap_err();
        assert!(
            matches!(
                e,
                CopyError::Overlap {
                    gen_rank: 1,
                    pool: 0,
                    ..
                }
            ),
            "{e}"
        );
        assert!(arena.destination(1, 0).iter().all(|&b| b == 0));

        let mut other = pair(0, 2, vec![PoolFragment(0, 0, 0, 0, 8)]);
        other.src_pools = vec![4096];
        let e = arena
            .copy(&[pair(0, 1, vec![PoolFragment(0, 0, 0, 0, 8)]), other])
            .unwrap_err();
        assert!(
            matches!(
                e,
                CopyError::Shape {
                    side: "context",
                    rank: 0,
                    ..
                }
            ),
            "{e}"
        );
    }
}
