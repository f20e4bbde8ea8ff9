//! Pools as bytes: the [`PoolMemory`] the oracle reads and writes, and [`LocalMemory`], the
//! in-process address space that executes plans.

use std::cell::RefCell;
use std::fmt;

use kvferry_plan::ValidatedPlan;

/// First address [`LocalMemory`] hands out.
const ADDRESS_BASE: u64 = 0x7100_0000_0000;
/// Pool alignment, and the unmapped gap left after every pool.
const POOL_ALIGN: u64 = 1 << 20;

/// A pool address or range that does not resolve.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// The range starts outside every pool.
    #[error("{address:#x} +{len} lies outside every pool")]
    Unmapped {
        /// Start of the range.
        address: u64,
        /// Length of the range.
        len: u64,
    },
    /// The range starts in a pool and runs past its end.
    #[error("{address:#x} +{len} runs past the end of {pool}")]
    PastEnd {
        /// Start of the range.
        address: u64,
        /// Length of the range.
        len: u64,
        /// The pool's label.
        pool: String,
    },
    /// The pool was reserved for its address but never backed with memory.
    #[error("{pool} is reserved but not backed")]
    NotBacked {
        /// The pool's label.
        pool: String,
    },
    /// A pool placed at a caller's address would overlap a pool already there.
    #[error("{address:#x} +{len} overlaps {pool}")]
    Overlaps {
        /// Start of the range.
        address: u64,
        /// Length of the range.
        len: u64,
        /// The label of the pool already there.
        pool: String,
    },
    /// No pool starts at the address.
    #[error("no pool starts at {0:#x}")]
    NoPoolAt(u64),
}

struct Region {
    base: u64,
    size: u64,
    label: String,
    data: Option<Vec<u8>>,
}

/// Most bytes of dropped pools a thread keeps for the next [`LocalMemory`] to back its pools
/// with.
const SPARE_LIMIT: usize = 2 << 30;

thread_local! {
    /// Backing buffers of dropped [`LocalMemory`]s, for reuse. A fresh allocation of pool size
    /// is mapped by the allocator on its own and faulted in page by page as the oracle tags
    /// it, then unmapped when the case ends: in the oracle matrix that was about 40 % of the
    /// run. A reused buffer is only zeroed.
    static SPARE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// `len` zero bytes, in the smallest spare buffer that holds them if there is one.
fn zeroed(len: usize) -> Vec<u8> {
    let mut buf = spare(len);
    buf.fill(0);
    buf
}

/// `len` bytes of scratch, whatever they hold, in the smallest spare buffer that holds them if
/// there is one; give it back with [`recycle`].
pub(super) fn scratch(len: usize) -> Vec<u8> {
    spare(len)
}

fn spare(len: usize) -> Vec<u8> {
    let reused = SPARE.with_borrow_mut(|spare| {
        let best = spare
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i)?;
        Some(spare.swap_remove(best))
    });
    match reused {
        Some(mut buf) => {
            buf.truncate(len);
            buf.resize(len, 0);
            buf
        }
        None => vec![0; len],
    }
}

/// Keeps `bufs` for [`zeroed`] and [`scratch`], the largest first, up to [`SPARE_LIMIT`] bytes per thread.
pub(super) fn recycle(bufs: impl Iterator<Item = Vec<u8>>) {
    SPARE.with_borrow_mut(|spare| {
        spare.extend(bufs);
        spare.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
        let mut kept = 0;
        spare.retain(|b| {
            kept += b.capacity();
            kept <= SPARE_LIMIT
        });
    });
}

/// Memory the oracle fills and checks: pools addressed by their page tables' base addresses.
///
/// [`LocalMemory`] implements it for in-process tests; the transfer code implements it over
/// UCX pools. The oracle only copies whole slots in and out through it, so an
/// implementation never hands out references into memory a peer may write.
pub trait PoolMemory {
    /// Copies `out.len()` bytes at `address` into `out`.
    ///
    /// # Errors
    ///
    /// The range does not lie inside one accessible pool.
    fn read(&self, address: u64, out: &mut [u8]) -> Result<(), MemoryError>;

    /// Copies `data` to `address`.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read).
    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), MemoryError>;

    /// Whether the pool starting at `base` is accessible through this memory.
    fn is_backed(&self, base: u64) -> bool;
}

impl PoolMemory for LocalMemory {
    fn read(&self, address: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        out.copy_from_slice(self.bytes(address, out.len() as u64)?);
        Ok(())
    }

    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), MemoryError> {
        self.bytes_mut(address, data.len() as u64)?
            .copy_from_slice(data);
        Ok(())
    }

    fn is_backed(&self, base: u64) -> bool {
        LocalMemory::is_backed(self, base)
    }
}

/// In-process pools in a private address space, and a local plan executor.
///
/// Addresses are synthetic: pools are aligned to 1 MiB and separated by an unmapped gap of
/// at least 1 MiB, so a fragment that leaves its pool is an error rather than a silent write
/// into a neighbour. A pool is first *reserved* (it has an address) and may later be
/// *backed* (it has bytes); only ranks that take part in a request need backing. Pools of
/// hand-built page tables keep their own addresses ([`reserve_at`](Self::reserve_at)).
#[derive(Default)]
pub struct LocalMemory {
    /// Sorted by base, never overlapping.
    regions: Vec<Region>,
}

impl fmt::Debug for LocalMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalMemory")
            .field("pools", &self.regions.len())
            .field("backed_bytes", &self.backed_bytes())
            .finish()
    }
}

impl Drop for LocalMemory {
    fn drop(&mut self) {
        recycle(self.regions.iter_mut().filter_map(|r| r.data.take()));
    }
}

impl LocalMemory {
    /// An empty address space.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reserves `bytes` of address space labelled `label` (e.g. `decode rank 3 pool 1`); returns
    /// the base. Nothing is allocated until [`back`](Self::back).
    pub fn reserve(&mut self, bytes: u64, label: impl Into<String>) -> u64 {
        let base = match self.regions.last() {
            Some(r) => (r.base + r.size).next_multiple_of(POOL_ALIGN) + POOL_ALIGN,
            None => ADDRESS_BASE,
        };
        self.regions.push(Region {
            base,
            size: bytes,
            label: label.into(),
            data: None,
        });
        base
    }

    /// Reserves `bytes` of address space at `base`, for a page table whose pools already have
    /// addresses (e.g. [`crate::builder`] ranks). [`reserve`](Self::reserve) still hands out
    /// addresses past every pool.
    ///
    /// # Errors
    ///
    /// The range overlaps a pool already reserved.
    pub fn reserve_at(
        &mut self,
        base: u64,
        bytes: u64,
        label: impl Into<String>,
    ) -> Result<(), MemoryError> {
        let end = |base: u64, size: u64| base.saturating_add(size.max(1));
        let i = self.regions.partition_point(|r| r.base < base);
        let clash = [i.checked_sub(1), Some(i)]
            .into_iter()
            .flatten()
            .filter_map(|j| self.regions.get(j))
            .find(|r| r.base < end(base, bytes) && base < end(r.base, r.size));
        if let Some(r) = clash {
            return Err(MemoryError::Overlaps {
                address: base,
                len: bytes,
                pool: r.label.clone(),
            });
        }
        self.regions.insert(
            i,
            Region {
                base,
                size: bytes,
                label: label.into(),
                data: None,
            },
        );
        Ok(())
    }

    /// Reserves and backs `bytes` (zeroed); returns the base.
    pub fn allocate(&mut self, bytes: u64, label: impl Into<String>) -> u64 {
        let base = self.reserve(bytes, label);
        if let Some(r) = self.regions.last_mut() {
            r.data = Some(zeroed(r.size as usize));
        }
        base
    }

    /// Backs the pool reserved at `base` with zeroed bytes; backing twice is a no-op.
    ///
    /// # Errors
    ///
    /// No pool starts at `base`.
    pub fn back(&mut self, base: u64) -> Result<(), MemoryError> {
        let i = self
            .regions
            .binary_search_by_key(&base, |r| r.base)
            .map_err(|_| MemoryError::NoPoolAt(base))?;
        let r = &mut self.regions[i];
        if r.data.is_none() {
            r.data = Some(zeroed(r.size as usize));
        }
        Ok(())
    }

    /// Whether a pool starts at `base` and is backed.
    pub fn is_backed(&self, base: u64) -> bool {
        self.regions
            .binary_search_by_key(&base, |r| r.base)
            .is_ok_and(|i| self.regions[i].data.is_some())
    }

    /// Bytes backed over all pools.
    pub fn backed_bytes(&self) -> u64 {
        self.regions
            .iter()
            .filter(|r| r.data.is_some())
            .map(|r| r.size)
            .sum()
    }

    /// The bytes `[address, address + len)`.
    ///
    /// # Errors
    ///
    /// The range leaves its pool, lies outside every pool, or its pool is not backed.
    pub fn bytes(&self, address: u64, len: u64) -> Result<&[u8], MemoryError> {
        let (i, off) = self.resolve(address, len)?;
        let data = self.regions[i].data.as_deref().unwrap_or_default();
        Ok(&data[off..off + len as usize])
    }

    /// The bytes `[address, address + len)`, writable.
    ///
    /// # Errors
    ///
    /// As [`bytes`](Self::bytes).
    pub fn bytes_mut(&mut self, address: u64, len: u64) -> Result<&mut [u8], MemoryError> {
        let (i, off) = self.resolve(address, len)?;
        let data = self.regions[i].data.as_deref_mut().unwrap_or_default();
        Ok(&mut data[off..off + len as usize])
    }

    /// Copies every fragment of `plan`, in order; returns the bytes copied.
    ///
    /// # Errors
    ///
    /// The first fragment whose source or destination does not resolve to one backed pool;
    /// the fragments before it have been copied.
    pub fn execute(&mut self, plan: &ValidatedPlan) -> Result<u64, MemoryError> {
        let mut copied = 0;
        for (src, dst, len) in plan.fragments() {
            let (si, so) = self.resolve(src, len)?;
            let (di, dof) = self.resolve(dst, len)?;
            let n = len as usize;
            if si == di {
                if let Some(data) = self.regions[si].data.as_mut() {
                    data.copy_within(so..so + n, dof);
                }
            } else {
                let (lo, hi) = (si.min(di), si.max(di));
                let (left, right) = self.regions.split_at_mut(hi);
                let (a, b) = (&mut left[lo], &mut right[0]);
                let (from, to) = if si < di { (a, b) } else { (b, a) };
                if let (Some(from), Some(to)) = (from.data.as_ref(), to.data.as_mut()) {
                    to[dof..dof + n].copy_from_slice(&from[so..so + n]);
                }
            }
            copied += len;
        }
        Ok(copied)
    }

    /// The backed region holding `[address, address + len)` and the offset in it.
    fn resolve(&self, address: u64, len: u64) -> Result<(usize, usize), MemoryError> {
        let i = self.regions.partition_point(|r| r.base <= address);
        let unmapped = MemoryError::Unmapped { address, len };
        let Some(r) = i.checked_sub(1).map(|i| &self.regions[i]) else {
            return Err(unmapped);
        };
        let off = address - r.base;
        if off >= r.size.max(1) {
            return Err(unmapped);
        }
        if off.checked_add(len).is_none_or(|end| end > r.size) {
            return Err(MemoryError::PastEnd {
                address,
                len,
                pool: r.label.clone(),
            });
        }
        if r.data.is_none() {
            return Err(MemoryError::NotBacked {
                pool: r.label.clone(),
            });
        }
        Ok((i - 1, off as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_resolves_inside_pools_only() {
        let mut m = LocalMemory::new();
        let a = m.allocate(100, "a");
        let b = m.reserve(50, "b");
        assert!(b >= a + 100 + POOL_ALIGN);
        assert!(m.bytes(a, 100).is_ok());
        assert!(matches!(
            m.bytes(a + 90, 20),
            Err(MemoryError::PastEnd { .. })
        ));
        assert!(matches!(
            m.bytes(a + 100, 1),
            Err(MemoryError::Unmapped { .. })
        ));
        assert!(matches!(
            m.bytes(a - 1, 1),
            Err(MemoryError::Unmapped { .. })
        ));
        assert!(matches!(m.bytes(b, 1), Err(MemoryError::NotBacked { .. })));
        m.back(b).unwrap();
        assert!(m.is_backed(b));
        assert_eq!(m.backed_bytes(), 150);
        assert_eq!(m.back(b + 1), Err(MemoryError::NoPoolAt(b + 1)));
    }

    #[test]
    fn pools_keep_their_own_addresses_and_never_overlap() {
        let mut m = LocalMemory::new();
        m.reserve_at(0x3000, 0x100, "high").unwrap();
        m.reserve_at(0x1000, 0x100, "low").unwrap();
        m.reserve_at(0x1100, 0x10, "adjacent").unwrap();
        for (base, len) in [(0x10ff, 1), (0x0f00, 0x101), (0x2fff, 2), (0x3050, 1)] {
            assert!(
                matches!(
                    m.reserve_at(base, len, "x"),
                    Err(MemoryError::Overlaps { .. })
                ),
                "{base:#x} +{len}"
            );
        }
        m.back(0x1000).unwrap();
        m.back(0x3000).unwrap();
        m.bytes_mut(0x10f0, 0x10).unwrap().fill(7);
        assert!(matches!(
            m.bytes(0x10f0, 0x11),
            Err(MemoryError::PastEnd { .. })
        ));
        assert!(matches!(
            m.bytes(0x1100, 1),
            Err(MemoryError::NotBacked { .. })
        ));
        assert!(m.bytes(0x30ff, 1).is_ok());
        // Addresses handed out later lie past every pool.
        assert!(m.reserve(1, "next") > 0x3100);
    }
}
