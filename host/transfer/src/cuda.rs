//! CUDA device memory for KV pools (cargo feature `cuda`).
//!
//! ```text
//!   CudaDevice::open(n) ──► CudaPool::new(&dev, bytes)      one cuMemAlloc and one stream per pool
//!                                 │  upload / download       H2D / D2H copies on the pool's stream
//!                                 ▼
//!   register_with_ucx(&ctx, &pool) ──► MemRegion (memory type CUDA, keeps the pool alive)
//!                                         └─ pack_rkey / put_region, as for host pools
//! ```
//!
//! # Design: register device memory directly, or refuse
//!
//! A device pool is handed to UCX as what it is, CUDA memory
//! ([`kvferry_ucx::MemoryType::CUDA`]), so that a CUDA-enabled UCX moves it with its device
//! transports (`cuda_copy`, `cuda_ipc`, GPUDirect RDMA) and peers put straight into GPU memory.
//! That needs a UCX built `--with-cuda`: [`register_with_ucx`] first asks the context which
//! memory types it supports ([`kvferry_ucx::Context::memory_types`]) and, without CUDA, refuses
//! with [`CudaError::UcxLacksCuda`], which names the UCX version and what to install.
//!
//! There is **no silent staging** through host buffers. Staging (a device-to-host copy, a put
//! of host memory, a host-to-device copy on the far side) would look like it works while
//! moving every byte three times over PCIe; a deployment that wants it should say so and
//! measure it, not discover it. Debian's UCX 1.13.1 has no CUDA transports (platform-notes §1),
//! so on such a machine device pools are refused and host pools are the path. Bounce
//! transfers over device pools stay on the device: their staging buffer and arena are device
//! memory, gathered and scattered by [`DeviceCopier`].
//!
//! # Allocation
//!
//! A pool is one plain `cuMemAlloc` allocation in the device's primary context, not cudarc's
//! stream-ordered `cuMemAllocAsync` (which [`cudarc::driver::CudaStream::alloc`] uses when the
//! device supports memory pools): UCX's CUDA IPC and GPUDirect registration do not handle
//! memory-pool allocations in every release, while `cuMemAlloc` memory works with all of them.
//! The pool sets `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on the allocation, as NVIDIA's GPUDirect
//! RDMA guide asks, so that the driver's synchronous copies into it complete before they
//! return, instead of racing a NIC that writes the memory next.
//!
//! # Copies: one private stream per pool
//!
//! Every pool owns a non-blocking CUDA stream (`cuStreamCreate(CU_STREAM_NON_BLOCKING)`).
//! [`CudaPool::new`] zeroes the pool, and [`CudaPool::upload`] and [`CudaPool::download`] copy,
//! on that stream, and each waits for that stream alone (`cuStreamSynchronize`) before it
//! returns: when any of them returns, the bytes are in place. Nothing waits for the whole
//! context (`cuCtxSynchronize`), so a copy into one pool never waits for UCX's own CUDA copies
//! (`cuda_copy` runs them on streams of its own in the same primary context), for another
//! pool's copies, or for an engine's kernels sharing the context. A non-blocking stream does
//! not synchronise with the legacy default stream either; ordering a pool's copies against
//! UCX's moves of it is the transfer protocol's job (slot ownership, see
//! `crate::memory`), exactly as for host pools.
//!
//! # Lifetimes
//!
//! A [`CudaPool`] is a handle to a reference-counted allocation. A region from
//! [`register_with_ucx`] holds that allocation too ([`kvferry_ucx::MemRegion::keep_alive`]),
//! and UCX unmaps the region before the allocation can be freed, so dropping the pool before
//! the region is harmless. Peers that hold the region's key may still write it until the
//! region is dropped, exactly as for host pools.
//!
//! # No driver, no panic
//!
//! cudarc loads `libcuda` lazily and *panics* when it is missing (platform-notes §6).
//! [`CudaDevice::open`] and [`device_count`] probe for the library first
//! ([`CudaError::NoDriver`]), and every driver call runs under `catch_unwind`, so a panic
//! inside cudarc (a symbol an old driver lacks, say) becomes [`CudaError::Init`]. This relies
//! on `panic = "unwind"`, the default; do not set `panic = "abort"` in a profile.

use std::any::Any;
use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError, result, sys};
use kvferry_ucx::{Context, MemRegion, MemoryType, MemoryTypes};

/// Why a CUDA device, pool or registration is not available.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver library is not installed (or not on the loader's path).
    #[error(
        "no CUDA driver: libcuda not found (searched for {}); install the NVIDIA driver or add \
         its directory to LD_LIBRARY_PATH",
        searched.join(", ")
    )]
    NoDriver {
        /// The library names that were tried, in order.
        searched: Vec<String>,
    },
    /// The driver library loaded but could not be initialised or used: `cuInit` failed (no
    /// device visible, driver/kernel-module mismatch, ...) or cudarc panicked.
    #[error("cuda driver unusable: {message}")]
    Init {
        /// What failed: `cuInit failed`, or the call that panicked with cudarc's message.
        message: String,
        /// The driver's error, when a driver call returned one.
        #[source]
        source: Option<DriverError>,
    },
    /// No device with this ordinal.
    #[error("no cuda device {ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// A driver call failed.
    #[error("cuda device {ordinal}: {op} failed")]
    Driver {
        /// The device.
        ordinal: usize,
        /// The driver function (or cudarc call) that failed.
        op: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// A pool must have at least one byte.
    #[error("a cuda pool needs at least one byte")]
    EmptyPool,
    /// A copy range leaves the pool.
    #[error("range {offset}+{len} is outside the {pool_len}-byte cuda pool")]
    OutOfBounds {
        /// Start of the range in the pool.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// The pool's length.
        pool_len: usize,
    },
    /// The loaded UCX cannot move CUDA memory, so device pools cannot be registered.
    #[error(
        "UCX {ucx_version} was built without CUDA support (memory types: {memory_types}); build \
         UCX with --with-cuda so `ucx_info -d` lists cuda_copy and cuda_ipc, or point \
         LD_LIBRARY_PATH at such a build (if it already does, check that UCX_TLS keeps them)"
    )]
    UcxLacksCuda {
        /// `kvferry_ucx::version()`, e.g. `"1.13.1"`.
        ucx_version: String,
        /// What the context reports instead.
        memory_types: MemoryTypes,
    },
    /// UCX refused the query or the registration.
    #[error("ucx cannot register the cuda pool")]
    Ucx(#[source] kvferry_ucx::Error),
}

/// Whether the CUDA driver library can be loaded. Never panics; touches no device.
///
/// Wraps cudarc's `is_culib_present` (a `dlopen` of each candidate name, closed again).
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate library names and drops
    // each handle it gets; it calls no driver function. Loading libcuda runs its initialisers,
    // which is what every CUDA program does.
    unsafe { sys::is_culib_present() }
}

/// Whether `[ptr, ptr + len)` lies inside one CUDA allocation the driver knows in this
/// process: one of ours, or a peer's that UCX's `cuda_ipc` mapped here. UCX translates a
/// peer's device address without checking it against the allocation its key names
/// (`kvferry_ucx::RangeCheck::Device`), so this is the check a peer's declared device range
/// gets. False for an address the driver does not know (host memory, or nothing), an empty
/// or wrapping range, and without a driver.
///
/// Wraps `cuPointerGetAttribute` with `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` and
/// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`.
#[doc(alias = "cuPointerGetAttribute")]
pub fn device_allocation_holds(ptr: u64, len: u64) -> bool {
    let Some(end) = ptr.checked_add(len).filter(|_| len > 0) else {
        return false;
    };
    if !driver_present() {
        return false;
    }
    let range = guarded("cuPointerGetAttribute", || {
        let mut start: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: RANGE_START_ADDR writes one `CUdeviceptr` and RANGE_SIZE one `size_t`
        // (`usize`), to out-pointers valid for the call; the driver only looks `ptr` up and
        // answers an error for an address it does not know.
        unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut start).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                ptr,
            )
            .result()?;
            sys::cuPointerGetAttribute(
                (&raw mut size).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                ptr,
            )
            .result()?;
        }
        Ok::<_, DriverError>((start, size as u64))
    });
    matches!(range, Ok(Ok((start, size)))
        if start <= ptr && start.checked_add(size).is_some_and(|e| end <= e))
}

/// How many CUDA devices the driver reports.
///
/// Wraps `cuInit` and `cuDeviceGetCount`.
///
/// # Errors
///
/// [`CudaError::NoDriver`] without the driver library, [`CudaError::Init`] if it cannot be
/// initialised.
#[doc(alias = "cuDeviceGetCount")]
pub fn device_count() -> Result<usize, CudaError> {
    init()?;
    let count =
        guarded("cuDeviceGetCount", result::device::get_count)?.map_err(|e| CudaError::Init {
            message: "cuDeviceGetCount failed".to_string(),
            source: Some(e),
        })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Probes for the driver library, then runs `cuInit`.
fn init() -> Result<(), CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver {
            searched: ["cuda", "nvcuda"]
                .iter()
                .flat_map(|name| cudarc::get_lib_name_candidates(name))
                .collect(),
        });
    }
    guarded("cuInit", result::init)?.map_err(|e| CudaError::Init {
        message: "cuInit failed".to_string(),
        source: Some(e),
    })
}

/// Runs a cudarc call, turning a panic (cudarc's answer to a missing library or symbol) into
/// [`CudaError::Init`].
fn guarded<T>(op: &str, f: impl FnOnce() -> T) -> Result<T, CudaError> {
    panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| CudaError::Init {
        message: format!("{op} panicked: {}", panic_message(payload.as_ref())),
        source: None,
    })
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("non-string panic payload")
}

/// One CUDA device, through its primary context.
///
/// Cheap to clone; `Send + Sync`. Every operation makes the context current on the calling
/// thread first, so any thread may use it.
#[derive(Clone)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    name: String,
}

impl CudaDevice {
    /// Opens device `ordinal` (retaining its primary context).
    ///
    /// Probes for the driver library before cudarc touches it, so a machine without a GPU
    /// driver gets [`CudaError::NoDriver`], never a panic.
    ///
    /// Wraps `cuInit`, `cuDeviceGetCount`, `cuDevicePrimaryCtxRetain` and `cuDeviceGetName`.
    ///
    /// # Errors
    ///
    /// * [`CudaError::NoDriver`] without the driver library.
    /// * [`CudaError::Init`] if the driver cannot be initialised, or cudarc panics.
    /// * [`CudaError::NoDevice`] if `ordinal` is not below [`device_count`].
    /// * [`CudaError::Driver`] if the context cannot be created or queried.
    #[doc(alias = "cuDevicePrimaryCtxRetain")]
    pub fn open(ordinal: usize) -> Result<CudaDevice, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let driver = |op| {
            move |source| CudaError::Driver {
                ordinal,
                op,
                source,
            }
        };
        let ctx = guarded("CudaContext::new", || CudaContext::new(ordinal))?
            .map_err(driver("cuDevicePrimaryCtxRetain"))?;
        let name = guarded("cuDeviceGetName", || ctx.name())?.map_err(driver("cuDeviceGetName"))?;
        Ok(CudaDevice { ctx, name })
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name, e.g. `"NVIDIA H200"`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Total device memory in bytes.
    ///
    /// # Errors
    ///
    /// [`CudaError::Driver`] if the driver cannot say.
    #[doc(alias = "cuDeviceTotalMem")]
    pub fn total_memory(&self) -> Result<usize, CudaError> {
        self.call("cuDeviceTotalMem", || self.ctx.total_mem())
    }

    /// Device memory not in use, in bytes (what an allocation may still take).
    ///
    /// Wraps `cuMemGetInfo`.
    ///
    /// # Errors
    ///
    /// [`CudaError::Driver`] if the driver cannot say.
    #[doc(alias = "cuMemGetInfo")]
    pub fn free_memory(&self) -> Result<usize, CudaError> {
        self.call("cuMemGetInfo", || {
            result::mem_get_info().map(|(free, _)| free)
        })
    }

    /// Makes the device's primary context current on the calling thread (as every operation
    /// here does first), for work on this thread that is not a call of this module: UCX's
    /// CUDA transports moving a pool, say.
    ///
    /// Wraps `cuCtxSetCurrent`.
    ///
    /// # Errors
    ///
    /// [`CudaError::Driver`] if the driver refuses, [`CudaError::Init`] if cudarc panics.
    #[doc(alias = "cuCtxSetCurrent")]
    pub fn bind_to_thread(&self) -> Result<(), CudaError> {
        self.call("cuCtxSetCurrent", || Ok(()))
    }

    /// The cudarc context, for work this module does not wrap (kernels, streams).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes the context current on this thread, then runs `f` under `catch_unwind`.
    fn call<T>(
        &self,
        op: &'static str,
        f: impl FnOnce() -> Result<T, DriverError>,
    ) -> Result<T, CudaError> {
        let ordinal = self.ordinal();
        guarded(op, || {
            self.ctx.bind_to_thread()?;
            f()
        })?
        .map_err(|source| CudaError::Driver {
            ordinal,
            op,
            source,
        })
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal())
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Device memory for one KV pool: a single `cuMemAlloc` of `len` bytes, zero-filled.
///
/// A handle to a reference-counted allocation: the memory is freed when the pool and every
/// region [`register_with_ucx`] made from it are gone. `Send + Sync`.
///
/// The bytes are never reachable as a Rust reference, only through [`upload`](Self::upload)
/// and [`download`](Self::download) (and UCX), so they may be written concurrently — by a peer
/// through UCX, say — without undefined behaviour on the host; ordering those writers is the
/// transfer protocol's job, exactly as for host pools.
#[derive(Clone)]
pub struct CudaPool {
    alloc: Arc<DeviceAlloc>,
}

/// The allocation behind a [`CudaPool`], and the pool's private stream; freed on drop (the
/// memory first, then the stream).
struct DeviceAlloc {
    device: CudaDevice,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// The pool's own non-blocking stream: every host copy into or out of the pool runs on it.
    stream: Arc<CudaStream>,
}

impl CudaPool {
    /// Allocates `len` bytes on `device`, zero-filled, with synchronous memory operations and
    /// a private stream for its copies.
    ///
    /// Wraps `cuStreamCreate(CU_STREAM_NON_BLOCKING)`, `cuMemAlloc`,
    /// `cuPointerSetAttribute(CU_POINTER_ATTRIBUTE_SYNC_MEMOPS)`, `cuMemsetD8Async` and
    /// `cuStreamSynchronize`.
    ///
    /// # Errors
    ///
    /// [`CudaError::EmptyPool`] for `len == 0`, [`CudaError::Driver`] if the allocation (out of
    /// memory, typically) or its set-up fails.
    #[doc(alias = "cuMemAlloc")]
    pub fn new(device: &CudaDevice, len: usize) -> Result<CudaPool, CudaError> {
        if len == 0 {
            return Err(CudaError::EmptyPool);
        }
        let stream = device.call("cuStreamCreate", || device.ctx.new_stream())?;
        // SAFETY: the context is current on this thread (`call` binds it); the returned
        // pointer is uninitialised device memory, owned by `DeviceAlloc` from the next line on
        // and zeroed below before anyone can read it.
        let ptr = device.call("cuMemAlloc", || unsafe { result::malloc_sync(len) })?;
        let alloc = Arc::new(DeviceAlloc {
            device: device.clone(),
            ptr,
            len,
            stream,
        });
        let sync_memops: u32 = 1;
        device.call("cuPointerSetAttribute", || {
            // SAFETY: `ptr` is a live `cuMemAlloc` allocation; SYNC_MEMOPS takes a pointer to
            // an `unsigned int`, which `sync_memops` is, valid for the call.
            unsafe {
                sys::cuPointerSetAttribute(
                    (&raw const sync_memops).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                    ptr,
                )
            }
            .result()
        })?;
        // SAFETY: `ptr..ptr + len` is the allocation made above; nothing else knows it yet; the
        // stream is the pool's own, live while `alloc` is.
        device.call("cuMemsetD8Async", || unsafe {
            result::memset_d8_async(ptr, 0, len, alloc.stream.cu_stream())
        })?;
        // The memset is queued, not done: make the zeroes visible to whatever reads the pool
        // next (a download, or UCX once the pool is registered).
        alloc.synchronize()?;
        Ok(CudaPool { alloc })
    }

    /// The pool's device address (`CUdeviceptr`), also what peers use as its remote address.
    #[cfg_attr(not(feature = "harness"), allow(dead_code))]
    pub fn device_ptr(&self) -> u64 {
        self.alloc.ptr
    }

    /// The pool's length in bytes.
    #[cfg_attr(not(feature = "harness"), allow(dead_code))]
    pub fn len(&self) -> usize {
        self.alloc.len
    }

    /// Always `false`: pools have at least one byte.
    #[cfg_attr(not(feature = "harness"), allow(dead_code))]
    pub fn is_empty(&self) -> bool {
        self.alloc.len == 0
    }

    /// The device the pool lives on.
    pub fn device(&self) -> &CudaDevice {
        &self.alloc.device
    }

    /// The pool's private stream, on which [`upload`](Self::upload) and
    /// [`download`](Self::download) copy (work queued on it by others is waited for by them).
    #[cfg_attr(not(feature = "harness"), allow(dead_code))]
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.alloc.stream
    }

    /// Copies `src` into the pool at `offset`; the bytes are on the device when this returns.
    ///
    /// The copy runs on the pool's stream and waits for that stream only, not for other work
    /// in the device's context (UCX's copies, other pools).
    ///
    /// Wraps `cuMemcpyHtoDAsync` and `cuStreamSynchronize`.
    ///
    /// # Errors
    ///
    /// [`CudaError::OutOfBounds`] if the range leaves the pool, [`CudaError::Driver`] if the
    /// copy fails.
    #[doc(alias = "cuMemcpyHtoD")]
    #[doc(alias = "cuMemcpyHtoDAsync")]
    pub fn upload(&self, offset: usize, src: &[u8]) -> Result<(), CudaError> {
        let dst = self.range(offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let alloc = &self.alloc;
        // SAFETY: `dst..dst + src.len()` lies inside the live allocation (checked by `range`);
        // `u8` is the type the pool holds; the stream is the pool's own. `src` is borrowed for
        // the whole call and the stream is synchronised below before it returns; even if that
        // wait fails, a copy from pageable host memory has read `src` into the driver's
        // staging buffers before `cuMemcpyHtoDAsync` returns, so the driver never reads `src`
        // after the borrow ends.
        alloc.device.call("cuMemcpyHtoDAsync", || unsafe {
            result::memcpy_htod_async(dst, src, alloc.stream.cu_stream())
        })?;
        // The copy is queued, or staged and still landing: wait for the pool's stream, so that
        // UCX or a NIC reading the pool next sees the bytes.
        alloc.synchronize()
    }

    /// Copies `dst.len()` bytes at `offset` out of the pool; they are in `dst` when this
    /// returns.
    ///
    /// The copy runs on the pool's stream and waits for that stream only.
    ///
    /// Wraps `cuMemcpyDtoHAsync` and `cuStreamSynchronize`.
    ///
    /// # Errors
    ///
    /// [`CudaError::OutOfBounds`] if the range leaves the pool, [`CudaError::Driver`] if the
    /// copy fails.
    #[doc(alias = "cuMemcpyDtoH")]
    #[doc(alias = "cuMemcpyDtoHAsync")]
    pub fn download(&self, offset: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        let src = self.range(offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let alloc = &self.alloc;
        // SAFETY: `src..src + dst.len()` lies inside the live allocation (checked by `range`);
        // `u8` is the type the pool holds; the stream is the pool's own. `dst` is exclusively
        // borrowed for the whole call, and the driver is done writing it when this returns: a
        // copy from device to pageable host memory returns only once it has completed, and the
        // stream is synchronised below in any case.
        alloc.device.call("cuMemcpyDtoHAsync", || unsafe {
            result::memcpy_dtoh_async(dst, src, alloc.stream.cu_stream())
        })?;
        alloc.synchronize()
    }

    /// The device address of `offset..offset + len`, if it lies inside the pool.
    fn range(&self, offset: usize, len: usize) -> Result<sys::CUdeviceptr, CudaError> {
        let pool_len = self.alloc.len;
        if offset.checked_add(len).is_none_or(|end| end > pool_len) {
            return Err(CudaError::OutOfBounds {
                offset,
                len,
                pool_len,
            });
        }
        Ok(self.alloc.ptr + offset as u64)
    }
}

impl fmt::Debug for CudaPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaPool")
            .field("device", &self.alloc.device.ordinal())
            .field("ptr", &format_args!("{:#x}", self.alloc.ptr))
            .field("len", &self.alloc.len)
            .finish()
    }
}

/// Runs one call of [`DeviceCopier::copy`] queues at most (a bound on its argument arrays).
const COPY_BATCH: usize = 4096;

/// The first driver version with `cuMemcpyBatchAsync` (CUDA 12.8: 1000 × major + 10 × minor).
const BATCH_DRIVER_VERSION: i32 = 12080;

/// Copies lists of device-to-device runs: the gather and scatter of bounced pieces over
/// device pools (`crate::bounce`).
///
/// A list is queued in as few driver calls as the driver allows — `cuMemcpyBatchAsync`, up to
/// 4,096 runs a call, on drivers of CUDA 12.8 and later; one `cuMemcpyDtoDAsync` per run on
/// older drivers, or once the batch call has refused (logged once) — on a non-blocking stream
/// of the copier's own, and waited for (`cuStreamSynchronize`, that stream only) before
/// [`copy`](Self::copy) returns. Streams are pooled: callers on several threads at once (the
/// scatter threads) each take a stream and wait only for their own copies. `Send + Sync`.
pub struct DeviceCopier {
    device: CudaDevice,
    streams: std::sync::Mutex<Vec<Arc<CudaStream>>>,
    batched: std::sync::atomic::AtomicBool,
}

impl DeviceCopier {
    /// A copier on `device`; asks the driver's version to choose batched or per-run copies.
    ///
    /// Wraps `cuDriverGetVersion` and `cuStreamCreate(CU_STREAM_NON_BLOCKING)`.
    ///
    /// # Errors
    ///
    /// [`CudaError::Driver`] if the first stream cannot be created.
    pub fn new(device: &CudaDevice) -> Result<DeviceCopier, CudaError> {
        let version = device
            .call("cuDriverGetVersion", || {
                let mut v: std::ffi::c_int = 0;
                // SAFETY: `v` is a valid out-pointer for the call.
                unsafe { sys::cuDriverGetVersion(&raw mut v) }
                    .result()
                    .map(|()| v)
            })
            .unwrap_or(0);
        let stream = device.call("cuStreamCreate", || device.ctx.new_stream())?;
        Ok(DeviceCopier {
            device: device.clone(),
            streams: std::sync::Mutex::new(vec![stream]),
            batched: std::sync::atomic::AtomicBool::new(version >= BATCH_DRIVER_VERSION),
        })
    }

    /// The device it copies on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Whether lists go out through `cuMemcpyBatchAsync` (false on drivers before CUDA 12.8,
    /// or once the batch call refused).
    pub fn is_batched(&self) -> bool {
        self.batched.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Copies every run `(destination, source, length)`, device addresses, and returns once
    /// all of them have landed; on an error, once nothing it queued still runs.
    ///
    /// # Safety
    ///
    /// Every source range is device memory of this process, readable, that nothing writes
    /// until this returns; every destination range is device memory of this process that
    /// nothing else reads or writes until this returns; no destination overlaps a source or
    /// another destination.
    ///
    /// # Errors
    ///
    /// [`CudaError::Driver`] naming the call that failed (the copy or the stream wait).
    pub unsafe fn copy(&self, runs: &[(u64, u64, u64)]) -> Result<(), CudaError> {
        if runs.is_empty() {
            return Ok(());
        }
        let pooled = crate::sync::lock(&self.streams).pop();
        let stream = match pooled {
            Some(s) => s,
            None => self
                .device
                .call("cuStreamCreate", || self.device.ctx.new_stream())?,
        };
        // SAFETY: the caller's contract is `queue`'s.
        let queued = unsafe { self.queue(&stream, runs) };
        // Waited for even when queueing failed half-way: nothing queued may run on after
        // this returns.
        let waited = self
            .device
            .call("cuStreamSynchronize", || stream.synchronize());
        if waited.is_ok() {
            crate::sync::lock(&self.streams).push(stream);
        }
        queued.and(waited)
    }

    /// Queues `runs` on `stream`, in batches where the driver takes them.
    ///
    /// # Safety
    ///
    /// As [`copy`](Self::copy), which waits for the stream afterwards.
    unsafe fn queue(&self, stream: &CudaStream, runs: &[(u64, u64, u64)]) -> Result<(), CudaError> {
        let n = runs.len().min(COPY_BATCH);
        let (mut dsts, mut srcs, mut sizes) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for chunk in runs.chunks(COPY_BATCH) {
            if self.is_batched() {
                dsts.clear();
                srcs.clear();
                sizes.clear();
                for &(dst, src, len) in chunk {
                    dsts.push(dst as sys::CUdeviceptr);
                    srcs.push(src as sys::CUdeviceptr);
                    sizes.push(len as usize);
                }
                let here = sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: self.device.ordinal() as std::ffi::c_int,
                };
                let mut attrs = sys::CUmemcpyAttributes {
                    srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                    srcLocHint: here,
                    dstLocHint: here,
                    flags: 0,
                };
                let mut attr_index = [0usize];
                let mut failed_at = usize::MAX;
                let batched = self.device.call("cuMemcpyBatchAsync", || {
                    // SAFETY: the three arrays hold `chunk.len()` elements each and, like
                    // `attrs`, `attr_index` and `failed_at`, live for the call (the driver
                    // copies the descriptors before it returns); one attribute set applies
                    // from run 0 on; the stream is a live non-blocking stream of this
                    // context. The ranges are the caller's contract.
                    unsafe {
                        sys::cuMemcpyBatchAsync(
                            dsts.as_mut_ptr(),
                            srcs.as_mut_ptr(),
                            sizes.as_mut_ptr(),
                            chunk.len(),
                            &raw mut attrs,
                            attr_index.as_mut_ptr(),
                            1,
                            &raw mut failed_at,
                            stream.cu_stream(),
                        )
                    }
                    .result()
                });
                match batched {
                    Ok(()) => continue,
                    Err(error) => {
                        // Whatever the batch queued, the same runs again copy the same bytes:
                        // wait for it, then go run by run from now on.
                        self.device
                            .call("cuStreamSynchronize", || stream.synchronize())?;
                        self.batched
                            .store(false, std::sync::atomic::Ordering::Relaxed);
                        tracing::warn!(
                            device = self.device.ordinal(),
                            %error,
                            failed_run = failed_at,
                            "cuMemcpyBatchAsync refused; bounced pieces copy run by run"
                        );
                    }
                }
            }
            for &(dst, src, len) in chunk {
                self.device.call("cuMemcpyDtoDAsync", || {
                    // SAFETY: the ranges are the caller's contract; the stream is a live
                    // non-blocking stream of this context.
                    unsafe { result::memcpy_dtod_async(dst, src, len as usize, stream.cu_stream()) }
                })?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for DeviceCopier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceCopier")
            .field("device", &self.device.ordinal())
            .field("batched", &self.is_batched())
            .finish_non_exhaustive()
    }
}

impl DeviceAlloc {
    /// Waits for the work queued on the pool's stream, and nothing else.
    fn synchronize(&self) -> Result<(), CudaError> {
        self.device
            .call("cuStreamSynchronize", || self.stream.synchronize())
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `cuMemAlloc` in this context and is freed once, here: the
        // last `CudaPool` handle is gone and every UCX region mapping it has been unmapped
        // (they hold this allocation until after `ucp_mem_unmap`). Every copy on the pool's
        // stream was waited for before its call returned, and `cuMemFree` waits for outstanding
        // device work on the memory; the stream itself is destroyed after this, when the field
        // drops.
        let freed = self
            .device
            .call("cuMemFree", || unsafe { result::free_sync(self.ptr) });
        if let Err(error) = freed {
            tracing::warn!(%error, ptr = self.ptr, len = self.len, "cannot free cuda pool");
        }
    }
}

/// Checks that `ctx` can register and move CUDA device memory, and returns what it supports.
///
/// Wraps `ucp_context_query` (through [`Context::memory_types`]).
///
/// # Errors
///
/// [`CudaError::UcxLacksCuda`] if the context does not list CUDA memory (the loaded UCX was
/// built without `--with-cuda`, as Debian's is), [`CudaError::Ucx`] if UCX cannot be queried.
pub fn ucx_cuda_support(ctx: &Context) -> Result<MemoryTypes, CudaError> {
    let memory_types = ctx.memory_types().map_err(CudaError::Ucx)?;
    if memory_types.contains_cuda() {
        Ok(memory_types)
    } else {
        Err(CudaError::UcxLacksCuda {
            ucx_version: kvferry_ucx::version().to_owned(),
            memory_types,
        })
    }
}

/// Registers `pool` with UCX as CUDA memory, so peers can put into it (and local puts read it
/// with `put_region`), or refuses when this UCX cannot move CUDA memory.
///
/// The region's `remote_addr()` is the pool's [`device_ptr`](CudaPool::device_ptr) and its
/// `memory_type()` is [`MemoryType::CUDA`]; its host accessors (`read_at`, `write_at`) panic,
/// so read and write the pool through [`CudaPool::download`] and [`CudaPool::upload`]. The
/// region keeps the allocation alive: it may outlive `pool`.
///
/// Wraps `ucp_context_query` and `ucp_mem_map` with `UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE`.
///
/// # Errors
///
/// [`CudaError::UcxLacksCuda`] as [`ucx_cuda_support`] (nothing is registered, nothing is
/// staged), [`CudaError::Ucx`] if UCX refuses the registration, [`CudaError::Driver`] if the
/// pool's context cannot be made current.
#[doc(alias = "ucp_mem_map")]
pub fn register_with_ucx(ctx: &Arc<Context>, pool: &CudaPool) -> Result<MemRegion, CudaError> {
    ucx_cuda_support(ctx)?;
    let alloc = &pool.alloc;
    // UCX's CUDA memory domains query the pointer with the driver; give them the pool's
    // context on this thread.
    alloc.device.bind_to_thread()?;
    // SAFETY: `alloc.ptr..alloc.ptr + alloc.len` is one live `cuMemAlloc` allocation of CUDA
    // device memory (a device address, never dereferenced on the host: the region refuses host
    // access for non-host types). The region holds `alloc` through `keep_alive`, and
    // `MemRegion` unmaps before releasing it, so the memory is not freed while mapped. Other
    // writers of the pool (`upload`, peers) are ordered by the transfer protocol, as this
    // function's docs and `CudaPool`'s say.
    let region = unsafe {
        MemRegion::register_with_memory_type(
            ctx,
            alloc.ptr as usize as *mut u8,
            alloc.len,
            MemoryType::CUDA,
        )
    }
    .map_err(CudaError::Ucx)?;
    Ok(region.keep_alive(Arc::clone(alloc) as Arc<dyn Any + Send + Sync>))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device-range check behind `RangeCheck::Device`: false without a driver, for an
    /// empty or wrapping range, and for host memory; with a GPU (`KVFERRY_GPU_TESTS=1`), true
    /// exactly inside one allocation.
    #[test]
    fn device_allocation_holds_exactly_its_range() {
        assert!(!device_allocation_holds(0x1000, 0));
        assert!(!device_allocation_holds(u64::MAX, 2));
        let host = [0u8; 64];
        let opted_in = std::env::var_os("KVFERRY_GPU_TESTS").is_some_and(|v| v == "1");
        if !driver_present() || !opted_in {
            assert!(
                !opted_in,
                "KVFERRY_GPU_TESTS=1 but libcuda cannot be loaded"
            );
            assert!(!device_allocation_holds(host.as_ptr() as u64, 64));
            println!("skipped the device half: no CUDA driver, or KVFERRY_GPU_TESTS unset");
            return;
        }
        let device = CudaDevice::open(0).expect("open device 0");
        device.bind_to_thread().unwrap();
        assert!(!device_allocation_holds(host.as_ptr() as u64, 64));
        let pool = CudaPool::new(&device, 1 << 20).unwrap();
        let (base, len) = (pool.device_ptr(), pool.len() as u64);
        assert!(device_allocation_holds(base, len));
        assert!(device_allocation_holds(base + len - 1, 1));
        assert!(!device_allocation_holds(base, len + 1));
        assert!(!device_allocation_holds(0x1000, 64));
    }

    #[test]
    fn refusal_names_the_version_and_the_fix() {
        let err = CudaError::UcxLacksCuda {
            ucx_version: "1.13.1".into(),
            memory_types: MemoryTypes::from_bits(1),
        };
        assert_eq!(
            err.to_string(),
            "UCX 1.13.1 was built without CUDA support (memory types: host); build UCX with \
             --with-cuda so `ucx_info -d` lists cuda_copy and cuda_ipc, or point \
             LD_LIBRARY_PATH at such a build (if it already does, check that UCX_TLS keeps them)"
        );
    }

    /// Calls the real check against the loaded UCX, on a context made as `serve --memory cuda`
    /// makes it (where a driver is present), and prints the outcome: on a UCX without CUDA
    /// support (or without libcuda) the refusal (this is how to read the exact message on a
    /// machine without a GPU), on a CUDA-enabled UCX the supported types. Either is a pass, unless `KVFERRY_GPU_TESTS=1`
    /// (as `scripts/gpu-check` sets on a GPU machine): then a refusal fails. A panic or another
    /// error always fails.
    #[test]
    fn ucx_memory_type_check_against_the_loaded_ucx() {
        let opted_in = std::env::var_os("KVFERRY_GPU_TESTS").is_some_and(|v| v == "1");
        // Without a driver UCX has no CUDA component, and a context naming `cuda_copy` would
        // only add a UCX warning: ask a default one then.
        let ctx = if opted_in || driver_present() {
            crate::Transport::Shm.context_for(crate::MemoryKind::Cuda)
        } else {
            Context::new()
        }
        .expect("create UCX context");
        match ucx_cuda_support(&ctx) {
            Ok(types) => println!(
                "kvferry-gpu: UCX {} supports CUDA memory ({types})",
                kvferry_ucx::version()
            ),
            Err(err @ CudaError::UcxLacksCuda { .. }) => {
                let message = err.to_string();
                assert!(!opted_in, "KVFERRY_GPU_TESTS=1 but UCX refuses: {message}");
                println!("refused: {message}");
                assert!(message.contains(kvferry_ucx::version()), "{message}");
                assert!(message.contains("--with-cuda"), "{message}");
            }
            Err(other) => panic!("unexpected error: {other}"),
        }
    }

    #[test]
    fn no_driver_message_lists_the_search() {
        let err = CudaError::NoDriver {
            searched: vec!["libcuda.so".into(), "libcuda.so.1".into()],
        };
        assert_eq!(
            err.to_string(),
            "no CUDA driver: libcuda not found (searched for libcuda.so, libcuda.so.1); install \
             the NVIDIA driver or add its directory to LD_LIBRARY_PATH"
        );
    }

    #[test]
    fn caught_panics_become_init_errors() {
        let err = guarded("cuSomething", || panic!("Missing symbol cuSomething")).unwrap_err();
        assert!(
            matches!(&err, CudaError::Init { message, source: None }
                if message == "cuSomething panicked: Missing symbol cuSomething"),
            "{err}"
        );
    }

    /// On a GPU, with `KVFERRY_GPU_TESTS=1` (as `scripts/gpu-check` runs it): every pool copies
    /// on a non-blocking stream of its own, and bytes round-trip through it from two threads at
    /// once. Without a driver it prints why it is skipped; with the variable set, a missing
    /// driver fails.
    #[test]
    fn pools_copy_on_private_streams() {
        let opted_in = std::env::var_os("KVFERRY_GPU_TESTS").is_some_and(|v| v == "1");
        if !driver_present() {
            assert!(
                !opted_in,
                "KVFERRY_GPU_TESTS=1 but libcuda cannot be loaded"
            );
            println!("skipped: no CUDA driver (libcuda not found)");
            return;
        }
        if !opted_in {
            println!("skipped: a CUDA driver is present; set KVFERRY_GPU_TESTS=1");
            return;
        }
        let device = CudaDevice::open(0).expect("open device 0");
        const LEN: usize = 4 << 20;
        let pools = [
            CudaPool::new(&device, LEN).unwrap(),
            CudaPool::new(&device, LEN).unwrap(),
        ];
        let streams = pools.each_ref().map(|p| p.stream().cu_stream());
        assert!(streams.iter().all(|s| !s.is_null()), "{streams:?}");
        assert_ne!(streams[0], streams[1]);
        for stream in streams {
            let mut flags = 0u32;
            device
                .call("cuStreamGetFlags", || {
                    // SAFETY: `stream` is a live stream of a pool held above; `flags` is a valid
                    // out-pointer for the call.
                    unsafe { sys::cuStreamGetFlags(stream, &raw mut flags) }.result()
                })
                .unwrap();
            assert_eq!(
                flags,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                "a pool's stream must not synchronise with the legacy default stream"
            );
        }
        std::thread::scope(|scope| {
            for (i, pool) in pools.iter().enumerate() {
                scope.spawn(move || {
                    let bytes: Vec<u8> = (0..LEN).map(|j| (j % 251) as u8 ^ i as u8).collect();
                    for _ in 0..4 {
                        pool.upload(0, &bytes).unwrap();
                        let mut got = vec![0u8; LEN];
                        pool.download(0, &mut got).unwrap();
                        assert!(got == bytes, "pool {i}: downloaded bytes differ");
                    }
                });
            }
        });
        println!(
            "kvferry-gpu: pools copy on private non-blocking streams ({})",
            device.name()
        );
    }

    /// On a GPU, with `KVFERRY_GPU_TESTS=1`: a list of runs between two pools lands byte for
    /// byte, batched (where the driver has `cuMemcpyBatchAsync`) and run by run, from two
    /// threads at once; bytes outside the runs stay as they were.
    #[test]
    fn device_copier_copies_runs_batched_and_run_by_run() {
        let opted_in = std::env::var_os("KVFERRY_GPU_TESTS").is_some_and(|v| v == "1");
        if !driver_present() || !opted_in {
            assert!(
                !opted_in,
                "KVFERRY_GPU_TESTS=1 but libcuda cannot be loaded"
            );
            println!("skipped: no CUDA driver, or KVFERRY_GPU_TESTS unset");
            return;
        }
        let device = CudaDevice::open(0).expect("open device 0");
        const LEN: usize = 1 << 20;
        let src = CudaPool::new(&device, LEN).unwrap();
        let pattern: Vec<u8> = (0..LEN).map(|j| (j % 253) as u8 ^ 0x5a).collect();
        src.upload(0, &pattern).unwrap();
        // 5,000 runs of 96 bytes (more than one batch), every other 96 bytes of the source, to
        // the front of the destination, packed.
        let runs = |dst: &CudaPool| -> Vec<(u64, u64, u64)> {
            (0..5000u64)
                .map(|k| (dst.device_ptr() + k * 96, src.device_ptr() + k * 192, 96))
                .collect()
        };
        for batched in [true, false] {
            let copier = DeviceCopier::new(&device).unwrap();
            if !batched {
                copier
                    .batched
                    .store(false, std::sync::atomic::Ordering::Relaxed);
            }
            let dsts = [
                CudaPool::new(&device, LEN).unwrap(),
                CudaPool::new(&device, LEN).unwrap(),
            ];
            std::thread::scope(|scope| {
                for dst in &dsts {
                    let (copier, runs) = (&copier, runs(dst));
                    // SAFETY: every run lies inside `src` or `dst`, live device pools; nothing
                    // else touches them meanwhile; the destinations are disjoint.
                    scope.spawn(move || unsafe { copier.copy(&runs) }.unwrap());
                }
            });
            for (i, dst) in dsts.iter().enumerate() {
                let mut got = vec![0u8; LEN];
                dst.download(0, &mut got).unwrap();
                for k in 0..5000 {
                    let (d, s) = (k * 96, k * 192);
                    assert!(
                        got[d..d + 96] == pattern[s..s + 96],
                        "batched {batched}, pool {i}: run {k} differs"
                    );
                }
                assert!(
                    got[5000 * 96..].iter().all(|&b| b == 0),
                    "batched {batched}, pool {i}: bytes after the runs touched"
                );
            }
            println!(
                "kvferry-gpu: device copier ({}) moved 2 x 5,000 runs",
                if copier.is_batched() {
                    "cuMemcpyBatchAsync"
                } else {
                    "run by run"
                }
            );
        }
    }

    #[test]
    fn without_a_driver_open_is_a_clean_error() {
        if driver_present() {
            // Not a skip (scripts/gpu-check fails skips on a GPU machine): there is nothing to
            // check where the driver is present.
            println!("a CUDA driver is present; the no-driver path does not apply");
            return;
        }
        let err = CudaDevice::open(0).unwrap_err();
        assert!(matches!(err, CudaError::NoDriver { .. }), "{err}");
        assert!(err.to_string().contains("libcuda.so.1"), "{err}");
        assert!(matches!(device_count(), Err(CudaError::NoDriver { .. })));
    }
}
