//! Memory regions mapped for RMA, and their packed remote keys.

use std::any::Any;
use std::fmt;
use std::os::raw::c_void;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use ucx_sys as sys;

use crate::ffi::{self, check};
use crate::status::WithOp;
use crate::{Context, Error, MemoryType, Op, Status};

/// Memory mapped with a [`Context`] for RMA (`ucp_mem_h`): a put source, or a put target whose
/// [`pack_rkey`](MemRegion::pack_rkey) bytes let peers write into it.
///
/// Two kinds:
///
/// * [`allocate`](MemRegion::allocate): UCX allocates the memory (`UCP_MEM_MAP_ALLOCATE`) and the
///   region owns it. On one host this is the one-sided shared-memory fast path: peers write it
///   directly, without this side progressing (platform-notes §4d).
/// * [`register`](MemRegion::register): memory the caller owns. Puts into it from peers are
///   emulated by UCX with active messages, so the owner's worker must progress for them to
///   complete.
///   [`register_with_memory_type`](MemRegion::register_with_memory_type) does the same for
///   memory of a stated [`MemoryType`], e.g. CUDA device memory, which UCX then moves with its
///   device transports (`cuda_copy`, `cuda_ipc`, GPUDirect RDMA) when it has them.
///
/// # Device memory
///
/// A region of a non-host [`memory_type`](MemRegion::memory_type) is only a handle for UCX:
/// its address is a device address the CPU cannot dereference, so the host accessors
/// ([`read_at`](MemRegion::read_at), [`write_at`](MemRegion::write_at),
/// [`as_slice`](MemRegion::as_slice), [`as_mut_slice`](MemRegion::as_mut_slice)) panic on it.
/// Copy through the device API instead (kvferry's `cuda` feature does).
///
/// # Remote access and Rust references
///
/// A region whose key has been handed out may be written by peers at any time. The safe
/// accessors [`read_at`](MemRegion::read_at) and [`write_at`](MemRegion::write_at) copy through
/// raw pointers and never hold a reference to the bytes; [`as_slice`](MemRegion::as_slice) and
/// [`as_mut_slice`](MemRegion::as_mut_slice) do, so they are `unsafe`: the application protocol
/// (for example, a peer's completion notice after its flush) must guarantee that no peer accesses
/// the bytes while the slice lives. Dropping a region that peers may still write is a protocol
/// error too: with registered memory, a late emulated put would land in freed memory.
///
/// `Drop` wraps `ucp_mem_unmap`, which also frees allocated memory.
#[doc(alias = "ucp_mem_h")]
pub struct MemRegion {
    ctx: Arc<Context>,
    memh: sys::ucp_mem_h,
    ptr: NonNull<u8>,
    len: usize,
    allocated: bool,
    memory_type: MemoryType,
    /// Kept alive until after `ucp_mem_unmap` (fields drop after `Drop::drop`); see
    /// [`MemRegion::keep_alive`].
    owners: Vec<Arc<dyn Any + Send + Sync>>,
}

// SAFETY: the handle belongs to a context created with `mt_workers_shared` (see `Context`), so
// `ucp_rkey_pack` and `ucp_mem_unmap` may be called from any thread; host memory is plain bytes,
// read through `&self` and written only through `&mut self`, and device memory is never touched
// by this type at all; the kept-alive owners are `Send + Sync` themselves.
unsafe impl Send for MemRegion {}
// SAFETY: as above; shared access only reads the bytes or packs keys (context-locked in UCX).
unsafe impl Sync for MemRegion {}

impl MemRegion {
    /// Lets UCX allocate and map `len` bytes, zero-filled.
    ///
    /// Wraps `ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`, and `ucp_mem_query` for the address.
    ///
    /// # Errors
    ///
    /// [`Op::MemMap`] if the allocation fails ([`Status::INVALID_PARAM`] for `len == 0`),
    /// [`Op::MemQuery`] if UCX cannot report where it put the memory.
    #[doc(alias = "ucp_mem_map")]
    #[doc(alias = "UCP_MEM_MAP_ALLOCATE")]
    pub fn allocate(ctx: &Arc<Context>, len: usize) -> Result<MemRegion, Error> {
        if len == 0 {
            return Err(Error::new(Op::MemMap, Status::INVALID_PARAM));
        }
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64,
            address: ptr::null_mut(),
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let memh = map(ctx, &params)?;
        // Owns the mapping from here on, so an error below unmaps it.
        let mut region = MemRegion {
            ctx: Arc::clone(ctx),
            memh,
            ptr: NonNull::dangling(),
            len: 0,
            allocated: true,
            memory_type: MemoryType::HOST,
            owners: Vec::new(),
        };

        let mut attr = sys::ucp_mem_attr_t {
            field_mask: (sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            ..Default::default()
        };
        // SAFETY: `memh` is a live mapping; `attr` is initialised and names only the two fields
        // UCX fills in.
        check(unsafe { sys::ucp_mem_query(memh, &mut attr) }).op(Op::MemQuery)?;
        let ptr = NonNull::new(attr.address.cast::<u8>())
            .filter(|_| attr.length >= len)
            .ok_or(Error::new(Op::MemQuery, Status::NO_MEMORY))?;
        // SAFETY: UCX allocated at least `len` writable bytes at `ptr` (checked above) that
        // nothing else references yet. Zeroing makes them initialised, so they may be read as
        // `u8` (UCX's allocator may be a plain `malloc`).
        unsafe { ptr.as_ptr().write_bytes(0, len) };
        region.ptr = ptr;
        region.len = len;
        Ok(region)
    }

    /// Maps `len` bytes of caller-owned memory at `ptr`.
    ///
    /// Wraps `ucp_mem_map`.
    ///
    /// # Safety
    ///
    /// For as long as the returned region (and any request borrowing it) lives:
    ///
    /// 1. `ptr` is valid for reads and writes of `len` bytes, and those bytes are initialised.
    /// 2. The memory is not freed, and is not accessed other than through the region (its
    ///    accessors, or UCX on its behalf); in particular the caller holds no Rust reference to
    ///    it.
    ///
    /// # Errors
    ///
    /// [`Op::MemMap`] if UCX cannot register the memory, or [`Status::INVALID_PARAM`] for a null
    /// `ptr` or `len == 0`.
    #[doc(alias = "ucp_mem_map")]
    pub unsafe fn register(
        ctx: &Arc<Context>,
        ptr: *mut u8,
        len: usize,
    ) -> Result<MemRegion, Error> {
        let Some(ptr) = NonNull::new(ptr).filter(|_| len > 0) else {
            return Err(Error::new(Op::MemMap, Status::INVALID_PARAM));
        };
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                as u64,
            address: ptr.as_ptr().cast(),
            length: len,
            ..Default::default()
        };
        let memh = map(ctx, &params)?;
        Ok(MemRegion {
            ctx: Arc::clone(ctx),
            memh,
            ptr,
            len,
            allocated: false,
            memory_type: MemoryType::HOST,
            owners: Vec::new(),
        })
    }

    /// Maps `len` bytes of caller-owned memory of type `memory_type` at `ptr`, e.g. CUDA device
    /// memory from `cuMemAlloc` ([`MemoryType::CUDA`]), so that peers can put into it and local
    /// puts can read from it with [`Endpoint::put_region`](crate::Endpoint::put_region).
    ///
    /// Stating the type spares UCX its detection (and is how UCX learns it at all when the
    /// memory-type cache is off). The region's [`remote_addr`](MemRegion::remote_addr) is `ptr`
    /// as an integer, which for CUDA memory is the `CUdeviceptr`.
    ///
    /// The context must support the type ([`Context::memory_types`]); otherwise this refuses
    /// before UCX sees the pointer. That check matters: UCX 1.13.1 without CUDA maps memory
    /// typed CUDA "successfully" (measured: `UCS_OK` and a 9-byte remote key naming no memory
    /// domain), so a peer's put into it would be emulated, ending in a host `memcpy` to a
    /// device address.
    ///
    /// Wraps `ucp_context_query` and `ucp_mem_map` with `UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE`.
    ///
    /// # Safety
    ///
    /// For as long as the returned region (and any request borrowing it) lives:
    ///
    /// 1. `ptr..ptr + len` is one live allocation of type `memory_type` (for CUDA, from one
    ///    `cuMemAlloc` or a range inside it), and it is not freed. To tie the allocation's life
    ///    to the region's, hand its owner to [`keep_alive`](MemRegion::keep_alive).
    /// 2. For [`MemoryType::HOST`]: as [`register`](MemRegion::register), i.e. the bytes are
    ///    initialised, valid for reads and writes, and not accessed other than through the
    ///    region.
    /// 3. For device memory: nothing else writes the range while UCX may read it for a local
    ///    put, and nothing relies on its contents while peers may write it (the application
    ///    protocol orders device copies and UCX transfers, as it does for host memory).
    ///
    /// # Errors
    ///
    /// * [`Op::MemMap`] with [`Status::INVALID_PARAM`] for a null `ptr` or `len == 0`.
    /// * [`Op::MemMap`] with [`Status::UNSUPPORTED`] if the context does not list
    ///   `memory_type` (for CUDA: this UCX was built without `--with-cuda`).
    /// * [`Op::ContextQuery`] if the context cannot be asked; [`Op::MemMap`] if UCX cannot
    ///   register the memory.
    #[doc(alias = "ucp_mem_map")]
    #[doc(alias = "UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE")]
    pub unsafe fn register_with_memory_type(
        ctx: &Arc<Context>,
        ptr: *mut u8,
        len: usize,
        memory_type: MemoryType,
    ) -> Result<MemRegion, Error> {
        let Some(ptr) = NonNull::new(ptr).filter(|_| len > 0) else {
            return Err(Error::new(Op::MemMap, Status::INVALID_PARAM));
        };
        if !ctx.memory_types()?.contains(memory_type) {
            return Err(Error::new(Op::MemMap, Status::UNSUPPORTED));
        }
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE) as u64,
            address: ptr.as_ptr().cast(),
            length: len,
            memory_type: memory_type.as_raw(),
            ..Default::default()
        };
        let memh = map(ctx, &params)?;
        Ok(MemRegion {
            ctx: Arc::clone(ctx),
            memh,
            ptr,
            len,
            allocated: false,
            memory_type,
            owners: Vec::new(),
        })
    }

    /// Keeps `owner` alive until after the region is unmapped, e.g. the device allocation a
    /// [`register_with_memory_type`](MemRegion::register_with_memory_type) region maps, so the
    /// memory cannot be freed while UCX (or a peer holding the key) may still use it. May be
    /// called more than once; owners are released after the unmap, in the order given.
    pub fn keep_alive(mut self, owner: Arc<dyn Any + Send + Sync>) -> MemRegion {
        self.owners.push(owner);
        self
    }

    /// The type of the mapped memory: [`MemoryType::HOST`] for
    /// [`allocate`](MemRegion::allocate) and [`register`](MemRegion::register), the stated
    /// type for [`register_with_memory_type`](MemRegion::register_with_memory_type).
    pub fn memory_type(&self) -> MemoryType {
        self.memory_type
    }

    /// The first byte of the region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The region's address as peers use it for `remote_addr` in puts.
    pub fn remote_addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: regions have at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether UCX allocated the memory ([`MemRegion::allocate`]) rather than the caller.
    pub fn is_allocated(&self) -> bool {
        self.allocated
    }

    /// The context the region is mapped with.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    ///
    /// # Panics
    ///
    /// If `offset + dst.len()` exceeds the region, or the region is not host memory (see
    /// "Device memory" above).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) {
        self.check_range(offset, dst.len());
        // SAFETY: the range is inside the region (checked), whose bytes are initialised and
        // valid while `self` lives; `dst` is a distinct Rust allocation or at least not the
        // region (the region's bytes are never lent out as `&mut` while `&self` exists), so
        // the two do not overlap.
        unsafe {
            ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len())
        };
    }

    /// Copies `src` into the region starting at `offset`.
    ///
    /// Takes `&mut self`, so no local put can be reading the region meanwhile.
    ///
    /// # Panics
    ///
    /// If `offset + src.len()` exceeds the region, or the region is not host memory.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) {
        self.check_range(offset, src.len());
        // SAFETY: the range is inside the region (checked) and writable; `&mut self` excludes
        // every other local use, and `src` cannot alias the region for the same reason.
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
    }

    /// The region's bytes as a slice.
    ///
    /// # Safety
    ///
    /// No peer may write the region while the slice lives (see "Remote access and Rust
    /// references" above).
    ///
    /// # Panics
    ///
    /// If the region is not host memory.
    pub unsafe fn as_slice(&self) -> &[u8] {
        self.assert_host();
        // SAFETY: `ptr` is valid for `len` initialised bytes while `self` lives; local writes
        // need `&mut self`, and the caller excludes remote writes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The region's bytes as a mutable slice.
    ///
    /// # Safety
    ///
    /// No peer may read or write the region while the slice lives (see "Remote access and Rust
    /// references" above).
    ///
    /// # Panics
    ///
    /// If the region is not host memory.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        self.assert_host();
        // SAFETY: `ptr` is valid for `len` initialised bytes while `self` lives; `&mut self`
        // excludes local access, and the caller excludes remote access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Packs the key peers need to write this region (send it with
    /// [`remote_addr`](MemRegion::remote_addr) and [`len`](MemRegion::len)).
    ///
    /// Wraps `ucp_rkey_pack` and `ucp_rkey_buffer_release`.
    ///
    /// # Errors
    ///
    /// [`Op::RkeyPack`] if UCX cannot pack the key.
    #[doc(alias = "ucp_rkey_pack")]
    pub fn pack_rkey(&self) -> Result<PackedRkey, Error> {
        let mut buffer: *mut c_void = ptr::null_mut();
        let mut size = 0;
        // SAFETY: the context and mapping are live; both out-pointers are valid.
        check(unsafe { sys::ucp_rkey_pack(self.ctx.as_raw(), self.memh, &mut buffer, &mut size) })
            .op(Op::RkeyPack)?;
        // SAFETY: on success UCX returns `size` bytes at `buffer`, valid until released below;
        // they are copied before that.
        let bytes = unsafe { ffi::bytes(buffer, size) }.to_vec();
        // SAFETY: `buffer` came from `ucp_rkey_pack` and is released once, here.
        unsafe { sys::ucp_rkey_buffer_release(buffer) };
        Ok(PackedRkey(bytes))
    }

    pub(crate) fn as_raw(&self) -> sys::ucp_mem_h {
        self.memh
    }

    fn assert_host(&self) {
        assert!(
            self.memory_type.is_host(),
            "the {}-byte region holds {} memory, which the host cannot access directly",
            self.len,
            self.memory_type
        );
    }

    fn check_range(&self, offset: usize, len: usize) {
        self.assert_host();
        let end = offset.checked_add(len);
        assert!(
            end.is_some_and(|end| end <= self.len),
            "range {offset}..{offset}+{len} is outside the {}-byte region",
            self.len
        );
    }
}

/// `ucp_mem_map` on `ctx`.
fn map(ctx: &Context, params: &sys::ucp_mem_map_params_t) -> Result<sys::ucp_mem_h, Error> {
    let mut memh = ptr::null_mut();
    // SAFETY: the context is live; `params` is initialised and names only fields that hold
    // valid values (the callers' own contracts cover the registered memory); `memh` is a valid
    // out-pointer.
    check(unsafe { sys::ucp_mem_map(ctx.as_raw(), params, &mut memh) }).op(Op::MemMap)?;
    Ok(memh)
}

impl Drop for MemRegion {
    fn drop(&mut self) {
        // SAFETY: `memh` came from `ucp_mem_map` on this context and is unmapped once, here.
        // Local requests reading the region borrow it, so none is in flight.
        let status = unsafe { sys::ucp_mem_unmap(self.ctx.as_raw(), self.memh) };
        if let Err(status) = check(status) {
            tracing::warn!(%status, len = self.len, "ucp_mem_unmap failed");
        }
    }
}

impl fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemRegion")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("allocated", &self.allocated)
            .field("memory_type", &self.memory_type)
            .finish_non_exhaustive()
    }
}

/// A memory region's packed remote key (`ucp_rkey_pack` output): opaque bytes to send to the
/// peer that will write the region, which unpacks them with [`crate::Endpoint::unpack_rkey`].
#[derive(Clone, Debug, Eq, PartialEq)]
pub struct PackedRkey(Vec<u8>);

impl PackedRkey {
    /// The packed bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The packed bytes, owned.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl From<Vec<u8>> for PackedRkey {
    /// Wraps bytes received from a peer (see the crate docs on trust).
    fn from(bytes: Vec<u8>) -> PackedRkey {
        PackedRkey(bytes)
    }
}

impl AsRef<[u8]> for PackedRkey {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shm() -> Arc<Context> {
        Context::builder().tls("posix,sysv,self").build().unwrap()
    }

    #[test]
    fn host_memory_type_registration_keeps_host_access() {
        let ctx = shm();
        let mut backing = vec![0u8; 256];
        // SAFETY: `backing` is a live, initialised host allocation of 256 bytes; it is not
        // touched or freed until the region is dropped at the end of this block.
        let mut region = unsafe {
            MemRegion::register_with_memory_type(&ctx, backing.as_mut_ptr(), 256, MemoryType::HOST)
        }
        .unwrap();
        assert_eq!(region.memory_type(), MemoryType::HOST);
        region.write_at(8, &[1, 2, 3]);
        let mut got = [0u8; 3];
        region.read_at(8, &mut got);
        assert_eq!(got, [1, 2, 3]);
        assert!(format!("{region:?}").contains("memory_type: MemoryType(host)"));
        drop(region);
        assert_eq!(&backing[8..11], &[1, 2, 3]);
    }

    #[test]
    fn null_or_empty_is_invalid_param() {
        let ctx = shm();
        // SAFETY: refused before UCX sees the pointer (null, or zero length).
        let null = unsafe {
            MemRegion::register_with_memory_type(&ctx, ptr::null_mut(), 8, MemoryType::HOST)
        };
        assert_eq!(
            null.unwrap_err(),
            Error::new(Op::MemMap, Status::INVALID_PARAM)
        );
        let mut byte = 0u8;
        // SAFETY: as above.
        let empty = unsafe {
            MemRegion::register_with_memory_type(&ctx, &raw mut byte, 0, MemoryType::HOST)
        };
        assert_eq!(
            empty.unwrap_err(),
            Error::new(Op::MemMap, Status::INVALID_PARAM)
        );
    }

    /// On a UCX without CUDA support (Debian's), registering CUDA memory is refused up front
    /// instead of producing a region with no memory domain.
    #[test]
    fn unsupported_memory_type_is_refused_before_mapping() {
        let ctx = shm();
        let types = ctx.memory_types().unwrap();
        for memory_type in [MemoryType::CUDA, MemoryType::ROCM] {
            if types.contains(memory_type) {
                eprintln!("this UCX supports {memory_type} ({types}); refusal not exercised");
                continue;
            }
            let mut host = vec![0u8; 64];
            // SAFETY: the context does not list `memory_type` (checked just above), so the
            // call returns before UCX is given the pointer; the pointer is a live allocation
            // regardless.
            let refused = unsafe {
                MemRegion::register_with_memory_type(&ctx, host.as_mut_ptr(), 64, memory_type)
            };
            assert_eq!(
                refused.unwrap_err(),
                Error::new(Op::MemMap, Status::UNSUPPORTED)
            );
        }
    }

    #[test]
    fn kept_alive_owner_outlives_the_region() {
        let ctx = shm();
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(vec![0u8; 16]);
        let region = MemRegion::allocate(&ctx, 64)
            .unwrap()
            .keep_alive(Arc::clone(&owner));
        assert_eq!(Arc::strong_count(&owner), 2);
        drop(region);
        assert_eq!(Arc::strong_count(&owner), 1);
    }

    #[test]
    #[should_panic(expected = "holds cuda memory")]
    fn host_accessors_refuse_device_regions() {
        let ctx = shm();
        let mut region = MemRegion::allocate(&ctx, 64).unwrap();
        // Pretend; the accessor must refuse before touching the pointer.
        region.memory_type = MemoryType::CUDA;
        let mut dst = [0u8; 4];
        region.read_at(0, &mut dst);
    }
}
