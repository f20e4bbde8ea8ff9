//! Pools registered with UCX, and the raw byte access the oracle glue needs.
//!
//! Every pool of a rank is one UCX region sized to the pool's footprint, in the memory the
//! instance asks for ([`MemoryKind`], `kvferry serve --memory`):
//!
//! - **host**: a [`MemRegion::allocate`] region (`UCP_MEM_MAP_ALLOCATE`, the one-sided
//!   shared-memory fast path), read and written by the host through the region.
//! - **cuda** (cargo feature `cuda`): a `CudaPool` on the rank's device (`--cuda-device`, or
//!   the rank's index modulo the device count) registered with `cuda::register_with_ucx` as
//!   CUDA memory; the host reads and writes it only through `CudaPool::download` and
//!   `CudaPool::upload`. A UCX without CUDA support is refused (`CudaError::UcxLacksCuda`)
//!   before anything is allocated: nothing is staged through host memory.
//!
//! A [`RankPools`] owns a rank's regions (and device pools); peers write them through the
//! packed keys of [`RankPools::keys`], senders read them with `put_region`.
//!
//! # Slot ownership
//!
//! Several requests use one pool at once, each in its own slots. Bytes of a slot are touched
//! by exactly one party at a time: on the prefill side the host while it fills the slots of a
//! request no receiver has asked for yet, then UCX reading them for puts until the request is
//! released after its last job; on the decode side the host while it primes free slots
//! (at start, and on release once no writer can still write), UCX while a request's puts run,
//! and the host again while it verifies a request whose every writer reported its flushed
//! last piece. That protocol is what makes [`RankPools::write`] sound; it is `unsafe` because
//! the type system cannot see it.

use std::ptr;
use std::sync::Arc;

use kvferry_ucx::{Context, MemRegion};

use kvferry_platform::HostBudget;

#[cfg(feature = "cuda")]
use crate::cuda::{self, CudaDevice, CudaError, CudaPool};
use kvferry_protocol::{PoolKey, unknown_name};

/// Where an instance's pools live: `host` or `cuda` on the command line.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    strum::AsRefStr,
    strum::Display,
    strum::EnumString,
    strum::VariantNames,
)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = String,
    parse_err_fn = unknown_memory
)]
pub enum MemoryKind {
    /// Host memory (DRAM) allocated through UCX.
    #[default]
    Host,
    /// CUDA device memory registered with UCX (cargo feature `cuda`, and a UCX built with
    /// CUDA support).
    Cuda,
}

fn unknown_memory(name: &str) -> String {
    unknown_name::<MemoryKind>("memory", name)
}

impl MemoryKind {
    /// Whether this build can place pools in this memory.
    ///
    /// # Errors
    ///
    /// [`MemoryError::CudaNotBuilt`] for [`MemoryKind::Cuda`] in a build without the `cuda`
    /// feature.
    pub fn check_built(self) -> Result<(), MemoryError> {
        match self {
            MemoryKind::Cuda if !cfg!(feature = "cuda") => Err(MemoryError::CudaNotBuilt),
            _ => Ok(()),
        }
    }
}

/// Why pools could not be allocated or described.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The host pools asked for so far would not fit in the memory this process may take:
    /// refused before allocating, instead of being killed when the pools are first touched.
    #[error(
        "rank {rank} pool {pool}: host pools would not fit: {} asked for in all (this pool {}), \
         {budget}",
        kvferry_platform::units::bytes(*total),
        kvferry_platform::units::bytes(*bytes)
    )]
    HostMemory {
        /// The rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// Bytes of this pool.
        bytes: u64,
        /// Bytes of every host pool so far, this one included.
        total: u64,
        /// What this process may still allocate, and what limits it.
        budget: HostBudget,
    },
    /// UCX refused an allocation.
    #[error("rank {rank} pool {pool}: cannot allocate {bytes} bytes through UCX")]
    Allocate {
        /// The rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// Bytes asked for.
        bytes: u64,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// A pool's remote key could not be packed.
    #[error("rank {rank} pool {pool}: cannot pack its remote key")]
    PackKey {
        /// The rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// An engine-owned pool cannot be registered ([`RankPools::register`]).
    #[error("rank {rank} pool {pool} at {base:#x} ({bytes} bytes): {problem}")]
    Register {
        /// The rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// Its base address.
        base: u64,
        /// Its footprint.
        bytes: u64,
        /// What is wrong.
        problem: String,
    },
    /// The callback was asked for pools out of order.
    #[error("rank {rank} pool {pool} asked for out of order")]
    Order {
        /// The rank.
        rank: u32,
        /// The pool.
        pool: usize,
    },
    /// Device pools were asked for in a build without them.
    #[error(
        "this kvferry was built without the `cuda` feature; rebuild with `cargo build \
         --features cuda`"
    )]
    CudaNotBuilt,
    /// No usable CUDA driver or device, or a UCX that cannot move CUDA memory.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A device pool could not be allocated or registered with UCX.
    #[cfg(feature = "cuda")]
    #[error("rank {rank} pool {pool}: cannot {what} {bytes} bytes on cuda device {device}")]
    CudaPool {
        /// The rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// The device.
        device: usize,
        /// Bytes asked for.
        bytes: u64,
        /// `allocate` or `register`.
        what: &'static str,
        /// The CUDA or UCX error.
        #[source]
        error: CudaError,
    },
}

/// A thread could not make the CUDA context of its rank's device pools current
/// ([`RankPools::bind_device_to_thread`]).
#[derive(Debug, thiserror::Error)]
#[error("cannot make the context of cuda device {device} current on this thread")]
pub struct BindError {
    /// The device whose context was to be bound.
    pub device: usize,
    /// The driver's error (a `CudaError` with the `cuda` feature).
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// A device pool could not be copied to or from (host pools never fail).
#[derive(Debug, thiserror::Error)]
#[error("rank {rank} pool {pool}: {op} of {len} bytes at offset {offset} failed: {error}")]
pub struct CopyError {
    /// The rank.
    pub rank: u32,
    /// The pool.
    pub pool: usize,
    /// `download` or `upload`.
    pub op: &'static str,
    /// Offset in the pool.
    pub offset: usize,
    /// Bytes copied.
    pub len: usize,
    /// The device API's error, with its causes.
    pub error: String,
}

/// One pool: its UCX region and, for a device pool, the allocation the host copies through.
#[derive(Debug)]
struct Pool {
    region: MemRegion,
    #[cfg(feature = "cuda")]
    device: Option<CudaPool>,
}

impl Pool {
    fn host(region: MemRegion) -> Pool {
        Pool {
            region,
            #[cfg(feature = "cuda")]
            device: None,
        }
    }
}

/// The pools of one rank, in page-table order.
#[derive(Debug)]
pub struct RankPools {
    rank: u32,
    pools: Vec<Pool>,
    /// The device of engine-owned VRAM pools ([`RankPools::register`]), whose context the
    /// rank thread binds.
    #[cfg(feature = "cuda")]
    engine_device: Option<CudaDevice>,
}

impl RankPools {
    /// The rank these pools belong to.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of pools.
    pub fn len(&self) -> usize {
        self.pools.len()
    }

    /// Whether the rank has no pool.
    pub fn is_empty(&self) -> bool {
        self.pools.is_empty()
    }

    /// The region of pool `pool`.
    pub fn region(&self, pool: usize) -> Option<&MemRegion> {
        self.pools.get(pool).map(|p| &p.region)
    }

    /// Makes the CUDA context of this rank's device pools current on the calling thread, so
    /// UCX's CUDA transports find it when they move the pools (a no-op for host pools).
    ///
    /// # Errors
    ///
    /// [`BindError`], naming the device, if the driver cannot make its context current.
    pub fn bind_device_to_thread(&self) -> Result<(), BindError> {
        #[cfg(feature = "cuda")]
        if let Some(device) = self.device() {
            device.bind_to_thread().map_err(|e| BindError {
                device: device.ordinal(),
                source: Box::new(e),
            })?;
        }
        Ok(())
    }

    /// The device of this rank's device pools, if it has any.
    #[cfg(feature = "cuda")]
    pub fn device(&self) -> Option<&CudaDevice> {
        self.pools
            .iter()
            .find_map(|p| p.device.as_ref().map(CudaPool::device))
            .or(self.engine_device.as_ref())
    }

    /// Bytes over all pools.
    pub fn total_bytes(&self) -> u64 {
        self.pools.iter().map(|p| p.region.len() as u64).sum()
    }

    /// The pool holding `[address, address + len)` and the offset of `address` in it.
    pub fn locate(&self, address: u64, len: u64) -> Option<(usize, usize)> {
        self.pools.iter().enumerate().find_map(|(i, p)| {
            let base = p.region.remote_addr();
            let end = base + p.region.len() as u64;
            let inside = address >= base && address.checked_add(len).is_some_and(|e| e <= end);
            inside.then(|| (i, (address - base) as usize))
        })
    }

    /// One packed key per pool, for peers that write these pools.
    ///
    /// # Errors
    ///
    /// UCX cannot pack a key.
    pub fn keys(&self) -> Result<Vec<PoolKey>, MemoryError> {
        self.pools
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let r = &p.region;
                let rkey = r.pack_rkey().map_err(|source| MemoryError::PackKey {
                    rank: self.rank,
                    pool: i,
                    source,
                })?;
                Ok(PoolKey {
                    base: r.remote_addr(),
                    len: r.len() as u64,
                    rkey: rkey.into_bytes(),
                })
            })
            .collect()
    }

    /// The pool `pool`, after checking that `[offset, offset + len)` lies inside it.
    fn checked(&self, pool: usize, offset: usize, len: usize) -> &Pool {
        let p = &self.pools[pool];
        let end = offset.checked_add(len);
        assert!(
            end.is_some_and(|end| end <= p.region.len()),
            "range {offset}+{len} is outside pool {pool} of {} bytes",
            p.region.len()
        );
        p
    }

    /// Copies `dst.len()` bytes at `offset` of pool `pool` out: from host memory directly,
    /// from a device pool with `CudaPool::download`.
    ///
    /// # Errors
    ///
    /// A device pool's copy failed.
    ///
    /// # Panics
    ///
    /// If the pool does not exist or the range leaves it (callers compute ranges from the
    /// page table the pools were sized from).
    pub fn read(&self, pool: usize, offset: usize, dst: &mut [u8]) -> Result<(), CopyError> {
        let p = self.checked(pool, offset, dst.len());
        #[cfg(feature = "cuda")]
        if let Some(device) = &p.device {
            let len = dst.len();
            return device
                .download(offset, dst)
                .map_err(|e| self.copy_error(pool, "download", offset, len, e));
        }
        p.region.read_at(offset, dst);
        Ok(())
    }

    /// Copies `src` into pool `pool` at `offset`: into host memory directly, into a device
    /// pool with `CudaPool::upload`.
    ///
    /// # Safety
    ///
    /// The caller owns the bytes `[offset, offset + src.len())` of the pool (see the module
    /// docs): no local put reads them and no peer writes them during the call.
    ///
    /// # Errors
    ///
    /// A device pool's copy failed.
    ///
    /// # Panics
    ///
    /// If the pool does not exist or the range leaves it.
    pub unsafe fn write(&self, pool: usize, offset: usize, src: &[u8]) -> Result<(), CopyError> {
        let p = self.checked(pool, offset, src.len());
        #[cfg(feature = "cuda")]
        if let Some(device) = &p.device {
            return device
                .upload(offset, src)
                .map_err(|e| self.copy_error(pool, "upload", offset, src.len(), e));
        }
        let region = &p.region;
        // SAFETY: the range lies inside the region (checked above), whose bytes are valid for
        // writes while `region` lives; by this function's contract nothing else reads or
        // writes them meanwhile, and `src` is a Rust slice distinct from UCX memory.
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), region.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn copy_error(
        &self,
        pool: usize,
        op: &'static str,
        offset: usize,
        len: usize,
        error: CudaError,
    ) -> CopyError {
        // The whole chain: the copy error travels to the controller as text.
        let mut text = error.to_string();
        let mut cause = std::error::Error::source(&error);
        while let Some(c) = cause {
            text = format!("{text}: {c}");
            cause = c.source();
        }
        CopyError {
            rank: self.rank,
            pool,
            op,
            offset,
            len,
            error: text,
        }
    }
}

/// Where a [`PoolAllocator`] places pools.
#[cfg_attr(not(feature = "harness"), allow(dead_code))]
#[derive(Debug)]
enum Placement {
    Host,
    #[cfg(feature = "cuda")]
    Cuda {
        /// `--cuda-device`: every rank on this device; `None`: rank `r` on `r % count`.
        fixed: Option<usize>,
        /// Devices the driver reports.
        count: usize,
        /// Devices opened so far, by ordinal.
        opened: Vec<Option<CudaDevice>>,
    },
}

/// Allocates pools as the caller's layout asks for them (`kvferry serve`, then
/// [`crate::agent::Agent::start_on`]):
/// every pool the page tables name is allocated here first, and the page tables carry the
/// addresses [`PoolAllocator::alloc`] returns.
#[cfg_attr(not(feature = "harness"), allow(dead_code))]
#[derive(Debug)]
pub struct PoolAllocator {
    ctx: Arc<Context>,
    placement: Placement,
    ranks: Vec<Vec<Pool>>,
    error: Option<MemoryError>,
    /// What host pools may take in all, measured when the allocator was made (`None`: not
    /// measurable here, nothing is checked).
    host_budget: Option<HostBudget>,
    /// Bytes of the host pools allocated so far.
    host_bytes: u64,
}

#[cfg_attr(not(feature = "harness"), allow(dead_code))]
impl PoolAllocator {
    /// The memory type the page tables must name for the pools this allocator hands out:
    /// DRAM for host pools, VRAM for CUDA pools.
    pub fn memory_type(&self) -> kvferry_planner_abi::MemoryType {
        if matches!(self.placement, Placement::Host) {
            kvferry_planner_abi::MemoryType::DRAM
        } else {
            kvferry_planner_abi::MemoryType::VRAM
        }
    }

    /// An allocator of host pools on `ctx`, which refuses host pools beyond what this
    /// process may still allocate ([`HostBudget::measure`]).
    pub fn new(ctx: &Arc<Context>) -> Self {
        Self::with_host_budget(ctx, HostBudget::measure())
    }

    /// [`new`](Self::new) with the host budget given (`None`: unchecked).
    pub fn with_host_budget(ctx: &Arc<Context>, host_budget: Option<HostBudget>) -> Self {
        Self {
            ctx: Arc::clone(ctx),
            placement: Placement::Host,
            ranks: Vec::new(),
            error: None,
            host_budget,
            host_bytes: 0,
        }
    }

    /// Checks, before anything is allocated, that this build and machine can hold pools of
    /// `kind`: for [`MemoryKind::Cuda`], the feature, the driver, the device and a context
    /// whose UCX can move CUDA memory (with the feature, `check_cuda_device` does the driver
    /// part alone, before a UCX context exists).
    ///
    /// `cuda_device`: the device of every rank; `None` puts rank `r` on device
    /// `r % device_count`. Ignored for host pools.
    ///
    /// # Errors
    ///
    /// [`MemoryError::CudaNotBuilt`] without the feature; with it, `MemoryError::Cuda`
    /// holding `CudaError::NoDriver`, `Init`, `NoDevice` or `UcxLacksCuda`.
    pub fn for_memory(
        ctx: &Arc<Context>,
        kind: MemoryKind,
        cuda_device: Option<usize>,
    ) -> Result<Self, MemoryError> {
        kind.check_built()?;
        #[cfg(feature = "cuda")]
        if kind == MemoryKind::Cuda {
            let count = check_cuda_device(cuda_device)?;
            cuda::ucx_cuda_support(ctx)?;
            return Ok(Self {
                placement: Placement::Cuda {
                    fixed: cuda_device,
                    count,
                    opened: vec![None; count],
                },
                ..Self::new(ctx)
            });
        }
        #[cfg(not(feature = "cuda"))]
        let _ = cuda_device;
        Ok(Self::new(ctx))
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
        match self.allocate(rank, pool, bytes) {
            Ok(p) => {
                let base = p.region.remote_addr();
                self.ranks[r].push(p);
                base
            }
            Err(e) => {
                self.error = Some(e);
                0
            }
        }
    }

    fn allocate(&mut self, rank: u32, pool: usize, bytes: u64) -> Result<Pool, MemoryError> {
        let len = bytes.max(1) as usize;
        match &mut self.placement {
            Placement::Host => {
                let total = self.host_bytes.saturating_add(len as u64);
                if let Some(budget) = self.host_budget.as_ref().filter(|b| total > b.bytes) {
                    return Err(MemoryError::HostMemory {
                        rank,
                        pool,
                        bytes,
                        total,
                        budget: budget.clone(),
                    });
                }
                let pool = MemRegion::allocate(&self.ctx, len)
                    .map(Pool::host)
                    .map_err(|source| MemoryError::Allocate {
                        rank,
                        pool,
                        bytes,
                        source,
                    })?;
                self.host_bytes = total;
                Ok(pool)
            }
            #[cfg(feature = "cuda")]
            Placement::Cuda {
                fixed,
                count,
                opened,
            } => {
                let ordinal = fixed.unwrap_or(rank as usize % *count);
                let failed = |what, error| MemoryError::CudaPool {
                    rank,
                    pool,
                    device: ordinal,
                    bytes,
                    what,
                    error,
                };
                let device = match opened.get(ordinal).and_then(Option::as_ref) {
                    Some(device) => device.clone(),
                    None => {
                        let device = CudaDevice::open(ordinal)?;
                        if let Some(slot) = opened.get_mut(ordinal) {
                            *slot = Some(device.clone());
                        }
                        device
                    }
                };
                let device_pool = CudaPool::new(&device, len).map_err(|e| failed("allocate", e))?;
                let region = cuda::register_with_ucx(&self.ctx, &device_pool)
                    .map_err(|e| failed("register", e))?;
                Ok(Pool {
                    region,
                    device: Some(device_pool),
                })
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
            .map(|(rank, pools)| RankPools {
                rank: rank as u32,
                pools,
                #[cfg(feature = "cuda")]
                engine_device: None,
            })
            .collect())
    }
}

impl RankPools {
    /// Registers the engine's own pools of rank `rank` with UCX: each pool's
    /// `[base, base + footprint)` becomes one region peers may write through its key. Nothing
    /// is allocated, filled or primed; the bytes stay the engine's.
    ///
    /// Host (DRAM) pools are registered as host memory. VRAM pools (cargo feature `cuda`)
    /// must each lie inside one CUDA allocation the driver knows, all on `cuda_device`, and
    /// the context must move CUDA memory; they are registered as CUDA memory and the rank
    /// thread binds that device's context. Without the feature a VRAM pool is refused by
    /// name.
    ///
    /// # Safety
    ///
    /// For as long as the returned pools (and the rank thread and agent using them) live,
    /// every pool's `[base, base + footprint)` is one live allocation (initialised host
    /// memory for DRAM pools; device memory on `cuda_device` for VRAM pools) that is not
    /// freed, and whose bytes the engine touches only as the transfer protocol allows
    /// (source slots unchanged from `send` to its terminal event; destination slots not relied
    /// on from `expect` to its terminal event).
    ///
    /// # Errors
    ///
    /// [`MemoryError::Register`] naming the pool: not DRAM, no bytes, a null base, a range
    /// that wraps, or UCX refusing the registration.
    pub unsafe fn register(
        ctx: &Arc<Context>,
        rank: u32,
        pools: &[kvferry_planner_abi::PhysicalPool],
        cuda_device: Option<usize>,
    ) -> Result<RankPools, MemoryError> {
        let mut out = Vec::with_capacity(pools.len());
        #[cfg(feature = "cuda")]
        let mut engine_device: Option<CudaDevice> = None;
        #[cfg(not(feature = "cuda"))]
        let _ = cuda_device;
        for (index, p) in pools.iter().enumerate() {
            let refuse = |problem: String| MemoryError::Register {
                rank,
                pool: index,
                base: p.base,
                bytes: p.footprint(),
                problem,
            };
            let bytes = p.footprint();
            if bytes == 0 || p.base == 0 {
                return Err(refuse("an empty pool or a null base".into()));
            }
            if p.base.checked_add(bytes).is_none() {
                return Err(refuse("the range wraps the address space".into()));
            }
            let len = usize::try_from(bytes).map_err(|_| refuse("too large".into()))?;
            if p.memory_type == kvferry_planner_abi::MemoryType::VRAM {
                #[cfg(feature = "cuda")]
                {
                    let device = match &engine_device {
                        Some(d) => d.clone(),
                        None => {
                            let ordinal = cuda_device.ok_or_else(|| {
                                refuse("a VRAM pool needs the agent's `cuda_device`".into())
                            })?;
                            let d = CudaDevice::open(ordinal)
                                .map_err(|e| refuse(format!("cuda device {ordinal}: {e}")))?;
                            cuda::ucx_cuda_support(ctx).map_err(|e| refuse(e.to_string()))?;
                            engine_device = Some(d.clone());
                            d
                        }
                    };
                    device
                        .bind_to_thread()
                        .map_err(|e| refuse(format!("cannot bind its device: {e}")))?;
                    if !cuda::device_allocation_holds(p.base, bytes) {
                        return Err(refuse(
                            "it does not lie inside one CUDA allocation the driver knows".into(),
                        ));
                    }
                    // SAFETY: the range is inside one live device allocation (just checked
                    // with the driver) that the caller keeps alive and orders access to for
                    // the pools' whole life (this function's contract); it is registered as
                    // CUDA memory, so no host access is made through the region.
                    let region = unsafe {
                        MemRegion::register_with_memory_type(
                            ctx,
                            p.base as usize as *mut u8,
                            len,
                            kvferry_ucx::MemoryType::CUDA,
                        )
                    }
                    .map_err(|e| refuse(format!("UCX refuses to register it: {e}")))?;
                    out.push(Pool::host(region));
                    continue;
                }
                #[cfg(not(feature = "cuda"))]
                return Err(refuse(
                    "a VRAM pool: this kvferry was built without the `cuda` feature".into(),
                ));
            }
            if p.memory_type != kvferry_planner_abi::MemoryType::DRAM {
                return Err(refuse(format!(
                    "memory type {:?} is not known",
                    p.memory_type
                )));
            }
            // SAFETY: the caller guarantees `[base, base + footprint)` is a live, initialised
            // host allocation that outlives the pools and is touched only as the protocol
            // allows (this function's contract, passed on to `MemRegion::register`).
            let region = unsafe { MemRegion::register(ctx, p.base as usize as *mut u8, len) }
                .map_err(|e| refuse(format!("UCX refuses to register it: {e}")))?;
            out.push(Pool::host(region));
        }
        Ok(RankPools {
            rank,
            pools: out,
            #[cfg(feature = "cuda")]
            engine_device,
        })
    }
}

/// Checks that the CUDA driver loads and reports a device (and device `device`, if given);
/// returns the device count. Touches no UCX.
///
/// # Errors
///
/// [`MemoryError::Cuda`] with [`CudaError::NoDriver`] or [`CudaError::Init`] (the driver) or
/// [`CudaError::NoDevice`] (no such device, or none at all).
#[cfg(feature = "cuda")]
pub fn check_cuda_device(device: Option<usize>) -> Result<usize, MemoryError> {
    let count = cuda::device_count()?;
    let ordinal = device.unwrap_or(0);
    if ordinal >= count {
        return Err(CudaError::NoDevice { ordinal, count }.into());
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Transport;

    #[test]
    fn host_pools_beyond_the_budget_are_refused_with_the_numbers() {
        let ctx = Transport::Shm.context().expect("create UCX context");
        let budget = HostBudget {
            bytes: 3 << 20,
            limit: "test".into(),
        };
        let mut allocator = PoolAllocator::with_host_budget(&ctx, Some(budget));
        assert_ne!(allocator.alloc(0, 0, 2 << 20), 0, "2 MiB of 3 fit");
        // 2 + 2 MiB do not: refused before UCX allocates anything.
        assert_eq!(allocator.alloc(0, 1, 2 << 20), 0);
        let err = allocator.finish(1).unwrap_err();
        assert!(
            matches!(&err, MemoryError::HostMemory { rank: 0, pool: 1, total, .. } if *total == 4 << 20),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("host pools would not fit: 4194304 bytes (4 MiB) asked for in all")
                && text.contains("3145728 bytes (3 MiB) available (test)"),
            "{text}"
        );
    }

    #[test]
    fn this_machine_refuses_a_pool_larger_than_its_memory() {
        let ctx = Transport::Shm.context().expect("create UCX context");
        let mut allocator = PoolAllocator::new(&ctx);
        // 1 PiB: no machine this runs on has it; UCX is never asked.
        assert_eq!(allocator.alloc(0, 0, 1 << 50), 0);
        let err = allocator.finish(1).unwrap_err();
        assert!(matches!(err, MemoryError::HostMemory { .. }), "{err:?}");
    }
}
