//! Host pools allocated through UCX, and the raw byte access the oracle glue needs.
//!
//! Every pool of a rank is one [`MemRegion::allocate`] region (`UCP_MEM_MAP_ALLOCATE`, the
//! one-sided shared-memory fast path), sized to the pool's footprint. A [`RankPools`] owns a
//! rank's regions; peers write them through the packed keys of [`RankPools::keys`], senders
//! read them with `put_region`.
//!
//! # Slot ownership
//!
//! Several requests use one pool at once, each in its own slots. Bytes of a slot are touched
//! by exactly one party at a time: on the context side the host while it fills the slots of a
//! request no receiver has asked for yet, then UCX reading them for puts until the request is
//! released after its last job; on the generation side the host while it primes free slots
//! (at start, and on release once no writer can still write), UCX while a request's puts run,
//! and the host again while it verifies a request whose every writer reported its flushed
//! last piece. That protocol is what makes [`RankPools::write`] sound; it is `unsafe` because
//! the type system cannot see it.

use std::ptr;
use std::sync::Arc;

use kvferry_ucx::{Context, MemRegion};

use super::wire::PoolKey;

/// Why pools could not be allocated or described.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// UCX refused an allocation.
    #[error("rank {rank} pool {pool}: cannot allocate {bytes} bytes through UCX: {error}")]
    Allocate {
        /// The rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// Bytes asked for.
        bytes: u64,
        /// UCX's error.
        error: kvferry_ucx::Error,
    },
    /// A pool's remote key could not be packed.
    #[error("rank {rank} pool {pool}: cannot pack its remote key: {error}")]
    PackKey {
        /// The rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// UCX's error.
        error: kvferry_ucx::Error,
    },
    /// The callback was asked for pools out of order.
    #[error("rank {rank} pool {pool} asked for out of order")]
    Order {
        /// The rank.
        rank: u32,
        /// The pool.
        pool: usize,
    },
}

/// The pools of one rank, in page-table order.
#[derive(Debug)]
pub struct RankPools {
    rank: u32,
    regions: Vec<MemRegion>,
}

impl RankPools {
    /// The rank these pools belong to.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of pools.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// Whether the rank has no pool.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// The region of pool `pool`.
    pub fn region(&self, pool: usize) -> Option<&MemRegion> {
        self.regions.get(pool)
    }

    /// Bytes over all pools.
    pub fn total_bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.len() as u64).sum()
    }

    /// The pool holding `[address, address + len)` and the offset of `address` in it.
    pub fn locate(&self, address: u64, len: u64) -> Option<(usize, usize)> {
        self.regions.iter().enumerate().find_map(|(p, r)| {
            let base = r.remote_addr();
            let end = base + r.len() as u64;
            let inside = address >= base && address.checked_add(len).is_some_and(|e| e <= end);
            inside.then(|| (p, (address - base) as usize))
        })
    }

    /// One packed key per pool, for peers that write these pools.
    ///
    /// # Errors
    ///
    /// UCX cannot pack a key.
    pub fn keys(&self) -> Result<Vec<PoolKey>, MemoryError> {
        self.regions
            .iter()
            .enumerate()
            .map(|(p, r)| {
                let rkey = r.pack_rkey().map_err(|source| MemoryError::PackKey {
                    rank: self.rank,
                    pool: p,
                    error: source,
                })?;
                Ok(PoolKey {
                    base: r.remote_addr(),
                    len: r.len() as u64,
                    rkey: rkey.into_bytes(),
                })
            })
            .collect()
    }

    /// Copies `dst.len()` bytes at `offset` of pool `pool` out.
    ///
    /// # Panics
    ///
    /// If the pool does not exist or the range leaves it (callers compute ranges from the
    /// page table the pools were sized from).
    pub fn read(&self, pool: usize, offset: usize, dst: &mut [u8]) {
        self.regions[pool].read_at(offset, dst);
    }

    /// Copies `src` into pool `pool` at `offset`.
    ///
    /// # Safety
    ///
    /// The caller owns the bytes `[offset, offset + src.len())` of the pool (see the module
    /// docs): no local put reads them and no peer writes them during the call.
    ///
    /// # Panics
    ///
    /// If the pool does not exist or the range leaves it.
    pub unsafe fn write(&self, pool: usize, offset: usize, src: &[u8]) {
        let region = &self.regions[pool];
        let end = offset.checked_add(src.len());
        assert!(
            end.is_some_and(|end| end <= region.len()),
            "range {offset}+{} is outside pool {pool} of {} bytes",
            src.len(),
            region.len()
        );
        // SAFETY: the range lies inside the region (checked above), whose bytes are valid for
        // writes while `region` lives; by this function's contract nothing else reads or
        // writes them meanwhile, and `src` is a Rust slice distinct from UCX memory.
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), region.as_ptr().add(offset), src.len()) };
    }
}

/// Allocates pools as [`crate::layout::build_instance`] asks for them; use
/// [`PoolAllocator::alloc`] as its callback.
#[derive(Debug)]
pub struct PoolAllocator {
    ctx: Arc<Context>,
    ranks: Vec<Vec<MemRegion>>,
    error: Option<MemoryError>,
}

impl PoolAllocator {
    /// An allocator on `ctx`.
    pub fn new(ctx: &Arc<Context>) -> Self {
        Self {
            ctx: Arc::clone(ctx),
            ranks: Vec::new(),
            error: None,
        }
    }

    /// Allocates `bytes` (at least 1) for pool `pool` of rank `rank`; returns its address, or
    /// 0 after recording the first error (reported by [`finish`](Self::finish)).
    pub fn alloc(&mut self, rank: u32, pool: usize, bytes: u64) -> u64 {
        if self.error.is_some() {
            return 0;
        }
        let r = rank as usize;
        if self.ranks.len() < r + 1 {
            self.ranks.resize_with(r + 1, Vec::new);
        }
        if self.ranks[r].len() != pool {
            self.error = Some(MemoryError::Order { rank, pool });
            return 0;
        }
        match MemRegion::allocate(&self.ctx, bytes.max(1) as usize) {
            Ok(region) => {
                let base = region.remote_addr();
                self.ranks[r].push(region);
                base
            }
            Err(source) => {
                self.error = Some(MemoryError::Allocate {
                    rank,
                    pool,
                    bytes,
                    error: source,
                });
                0
            }
        }
    }

    /// The pools of each of `world` ranks, in rank order (a rank without pools gets none).
    ///
    /// # Errors
    ///
    /// The first allocation that failed.
    pub fn finish(mut self, world: u32) -> Result<Vec<RankPools>, MemoryError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        if self.ranks.len() < world as usize {
            self.ranks.resize_with(world as usize, Vec::new);
        }
        Ok(self
            .ranks
            .into_iter()
            .enumerate()
            .map(|(rank, regions)| RankPools {
                rank: rank as u32,
                regions,
            })
            .collect())
    }
}
