//! Endpoints: one-sided puts, flushes, active messages, and the remote keys they use.
//!
//! Ownership, and so the order UCX needs at destruction, is carried by `Rc`s rather than by
//! lifetimes: an [`Endpoint`] holds a handle on its worker, a [`RemoteKey`] holds its endpoint,
//! and a [`Request`] (or a [`crate::PutWindow`]) holds its endpoint and the remote key it uses.
//! So `ucp_rkey_destroy` runs before `ucp_ep_close_nbx`, which runs before
//! `ucp_worker_destroy`, whatever order the values are dropped in; requests borrow only their
//! source bytes.

use std::cell::Cell;
use std::fmt;
use std::os::raw::c_void;
use std::ptr::{self, NonNull};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicI8, Ordering};
use std::time::{Duration, Instant};

use ucx_sys as sys;

use crate::ffi::{RawRequest, check, check_ptr};
use crate::library::shared_rw_mapping_covers;
use crate::request::Request;
use crate::rkey_format::{KeyLayout, check_packed_rkey};
use crate::status::WithOp;
use crate::{Error, MemRegion, Op, Status, Worker};

/// How long `Drop` lets an endpoint flush before closing it with `UCP_EP_CLOSE_FLAG_FORCE`.
const DROP_CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Zero bytes after the copy of a peer's key that [`Endpoint::unpack_rkey`] hands UCX. Each
/// transport's `rkey_unpack` reads its own fixed struct from where its entry starts (inside
/// the checked key), whatever the entry's size byte says: the largest, 1.22.0's extended
/// `cuda_ipc` key (`uct_cuda_ipc_extended_rkey_t`, `src/uct/cuda/cuda_ipc/cuda_ipc_md.h:139-157`,
/// 200 bytes with CUDA fabric handles; read at `cuda_ipc_md.c:474-483`), ends in the padding.
/// `posix` reads a NUL-terminated directory after its 24 bytes when its segment id says so
/// (`src/uct/sm/mm/posix/mm_posix.c:412-429`): the padding ends it.
const KEY_PADDING: usize = 256;

/// A connection from a [`Worker`] to one peer worker (`ucp_ep_h`).
///
/// Holds a handle on its worker, so it may outlive the `Worker` value that connected it: the
/// UCX worker is destroyed only after its last endpoint is closed. Like every handle on a
/// worker it is neither `Send` nor `Sync` (the worker runs in `UCS_THREAD_MODE_SERIALIZED`).
///
/// The endpoint is closed when the last handle on it goes: this value, the [`RemoteKey`]s
/// unpacked on it, and the [`Request`]s and [`crate::PutWindow`]s issued on it (each keeps
/// what its operations use until UCX is done with them). The close is what
/// [`Endpoint::close`] does with a 2 s timeout: flush (progressing the worker), then a graceful
/// `ucp_ep_close_nbx`; if the flush does not finish in time (the peer is gone or not
/// progressing), a forced close instead.
#[doc(alias = "ucp_ep_h")]
pub struct Endpoint {
    inner: Rc<EndpointInner>,
}

/// The UCX endpoint, shared by the [`Endpoint`] and what was made from it.
struct EndpointInner {
    /// Null once closed (by the last handle, or by [`Endpoint::force_close`] from any).
    handle: Cell<sys::ucp_ep_h>,
    /// What the error handler records ([`ErrorMode::Peer`] only): the `arg` UCX holds. Freed
    /// only once the endpoint's close has finished (UCX then knows the endpoint no more), or,
    /// if it did not, handed to the worker to be freed after `ucp_worker_destroy`.
    failure: Option<FailureCell>,
    /// Dropped after `Drop::drop` has closed the endpoint.
    worker: Worker,
}

/// How an endpoint learns that its peer failed: UCX's `ucp_err_handling_mode_t`, chosen when
/// the endpoint is created ([`Worker::connect_with`]).
#[doc(alias = "ucp_err_handling_mode_t")]
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq, Hash)]
#[non_exhaustive]
pub enum ErrorMode {
    /// `UCP_ERR_HANDLING_MODE_NONE`: no guarantees. A request to a peer that died or became
    /// unreachable may never complete (over `tcp` a put or flush to a dead peer waits for
    /// ever), and no error handler is called. What [`Worker::connect`] uses: it is the only
    /// mode shared memory (`posix`, `sysv`, `self`) supports, so the only one with the
    /// one-sided fast path.
    #[default]
    None,
    /// `UCP_ERR_HANDLING_MODE_PEER` with an error handler: UCX "guarantees that send requests
    /// are always completed (successfully or error) even in case of remote failure" and
    /// "disables protocols and APIs which may cause a hang or undefined behavior in case of
    /// peer failure" (ucp_def.h). On a transport-level error UCX calls the handler once,
    /// from inside a worker call (progress), and the endpoint is unusable from then on:
    /// requests in flight and every later operation on it fail with the handler's status,
    /// which [`Endpoint::failure`] reports.
    ///
    /// Only transports with a peer-failure handler can carry such an endpoint. Measured with
    /// `ucx_info -d` (UCX 1.22.0 and Debian's 1.13.1): `tcp` and `cma` list "error handling:
    /// peer failure, ep_check, keepalive", `posix`, `sysv` and `self` only "ep_check"; so
    /// with shared memory alone UCX finds no transport to the peer (or falls back to a
    /// slower one that supports the mode, where one is enabled).
    Peer,
}

impl ErrorMode {
    fn raw(self) -> sys::ucp_err_handling_mode_t {
        match self {
            ErrorMode::None => sys::UCP_ERR_HANDLING_MODE_NONE,
            ErrorMode::Peer => sys::UCP_ERR_HANDLING_MODE_PEER,
        }
    }
}

/// The cell UCX's error handler writes: the first failure status, 0 (`UCS_OK`) while none.
/// Atomic, so the handler needs no more than a shared reference whatever thread UCX calls it
/// from (in serialized mode that is the thread in the worker call).
#[derive(Default)]
struct FailureSlot(AtomicI8);

impl FailureSlot {
    fn record(&self, status: sys::ucs_status_t) {
        // Errors are negative; `UCS_OK` (or any other non-error) is not a failure.
        if status.0 < 0 {
            let _ = self
                .0
                .compare_exchange(0, status.0, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    fn get(&self) -> Option<Status> {
        match self.0.load(Ordering::Acquire) {
            0 => None,
            code => Some(Status::from_raw(sys::ucs_status_t(code))),
        }
    }
}

/// Owns a heap [`FailureSlot`] through a raw pointer, which UCX holds as the error handler's
/// `arg`. Not a `Box`: moving a `Box` asserts unique access to its contents, which UCX's
/// pointer would contradict; this owner only ever hands out shared references.
struct FailureCell(NonNull<FailureSlot>);

// SAFETY: the cell uniquely owns its `FailureSlot` (an atomic, `Send + Sync`), so moving the
// owner to another thread moves nothing that is tied to this one; UCX touches the slot only
// through shared, atomic accesses.
unsafe impl Send for FailureCell {}

impl FailureCell {
    fn new() -> FailureCell {
        FailureCell(NonNull::from(Box::leak(Box::<FailureSlot>::default())))
    }

    /// The pointer UCX gets as `arg`.
    fn as_arg(&self) -> *mut c_void {
        self.0.as_ptr().cast()
    }

    fn slot(&self) -> &FailureSlot {
        // SAFETY: the slot was leaked from a `Box` in `new` and is freed only in `drop`, so it
        // is live for `&self`; every access to it (ours and UCX's) is through shared
        // references to its atomic.
        unsafe { self.0.as_ref() }
    }
}

impl Drop for FailureCell {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `Box::leak` in `new` and is freed once, here; the
        // owner drops the cell only once UCX no longer knows the endpoint (its close finished,
        // or the worker was destroyed), so nothing uses it any more.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

/// The endpoint error handler (`ucp_err_handler_cb_t`) of [`ErrorMode::Peer`] endpoints.
///
/// UCX calls it at most once per endpoint, and never once the endpoint's close has begun: its
/// source (`ucp_ep_invoke_err_cb`, 1.13 and 1.22) returns early for an endpoint flagged
/// closed or whose handler already ran. The header promises neither, so `arg` is kept valid
/// for as long as UCX may know the endpoint (see `EndpointInner::failure`).
///
/// # Safety
///
/// Called by UCX only, with the `arg` registered in `Endpoint::connect`: a live
/// `FailureSlot`, valid for the whole call. It never unwinds (an atomic store cannot panic).
unsafe extern "C" fn on_peer_failure(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    // SAFETY: by this function's contract `arg` points to a live `FailureSlot`, only ever
    // accessed through shared references (its state is atomic).
    let slot = unsafe { &*arg.cast_const().cast::<FailureSlot>() };
    slot.record(status);
}

/// The protocol for an active message's payload.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
#[non_exhaustive]
pub enum AmProto {
    /// Eager (`UCP_AM_SEND_FLAG_EAGER`): the payload travels with the message and is copied on
    /// the receiver; fragmented and reassembled before the handler runs when large. The
    /// default, and what kvferry's notifications use.
    #[default]
    Eager,
    /// Rendezvous (`UCP_AM_SEND_FLAG_RNDV`): the receiver pulls the payload after the header
    /// arrives. Saves a copy for large payloads; handlers still see inline bytes.
    Rendezvous,
    /// Let UCX choose by size (eager below its rendezvous threshold).
    Auto,
}

/// The low four bits of a worker address's first byte: its format version.
const ADDRESS_VERSION_MASK: u8 = 0x0f;
/// The address versions UCX parses (`UCP_OBJECT_VERSION_V1` and `V2`, 0 and 1).
const ADDRESS_VERSIONS: std::ops::RangeInclusive<u8> = 0..=1;

impl Endpoint {
    pub(crate) fn connect(
        worker: &Worker,
        address: &[u8],
        mode: ErrorMode,
    ) -> Result<Endpoint, Error> {
        // UCX aborts the process on any other version (an always-on assertion in
        // `ucp_address_unpack_header`, 1.13.1 and 1.22.0; measured: a first byte of 0x42 or
        // 0xff kills it with SIGABRT), so such bytes are refused here.
        let known = address
            .first()
            .is_some_and(|b| ADDRESS_VERSIONS.contains(&(b & ADDRESS_VERSION_MASK)));
        if !known {
            return Err(Error::new(Op::EpCreate, Status::INVALID_PARAM));
        }
        let mut params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE) as u64,
            address: address.as_ptr().cast(),
            err_mode: mode.raw(),
            ..Default::default()
        };
        // On the heap: UCX keeps the pointer, so the slot must not move with the endpoint.
        let failure = (mode == ErrorMode::Peer).then(FailureCell::new);
        if let Some(cell) = &failure {
            params.field_mask |= sys::UCP_EP_PARAM_FIELD_ERR_HANDLER as u64;
            params.err_handler = sys::ucp_err_handler_t {
                cb: Some(on_peer_failure),
                arg: cell.as_arg(),
            };
        }
        let mut handle = ptr::null_mut();
        // SAFETY: the worker is live and used from this thread only; `params` is initialised
        // and names only the fields set above; `address` is readable for the call (UCX copies
        // what it needs; its format is the caller's trust contract, see the crate docs);
        // `handle` is a valid out-pointer. The error handler's `arg` is the cell's slot, which
        // the endpoint's inner value owns and frees only once UCX no longer knows the
        // endpoint (see `EndpointInner::close`); if creation fails, UCX keeps nothing.
        check(unsafe { sys::ucp_ep_create(worker.as_raw(), &params, &mut handle) })
            .op(Op::EpCreate)?;
        Ok(Endpoint {
            inner: Rc::new(EndpointInner {
                handle: Cell::new(handle),
                failure,
                worker: worker.share(),
            }),
        })
    }

    /// The error handling mode the endpoint was created with.
    pub fn error_mode(&self) -> ErrorMode {
        if self.inner.failure.is_some() {
            ErrorMode::Peer
        } else {
            ErrorMode::None
        }
    }

    /// The status UCX's error handler reported for this endpoint, if it was called: the peer
    /// failed or became unreachable (for example [`Status::CONNECTION_RESET`] or
    /// [`Status::ENDPOINT_TIMEOUT`]), and every operation in flight or issued later on this
    /// endpoint fails. Always `None` for an [`ErrorMode::None`] endpoint, whose failures UCX
    /// does not report.
    ///
    /// UCX calls the handler from inside a worker call (normally [`Worker::progress`], which
    /// every wait here runs), so a failure shows up once the worker has been progressed past
    /// the moment UCX noticed it. It never clears: connect anew to a restarted peer.
    pub fn failure(&self) -> Option<Status> {
        self.inner
            .failure
            .as_ref()
            .and_then(|cell| cell.slot().get())
    }

    /// The worker this endpoint belongs to (a handle on it that this endpoint keeps).
    pub fn worker(&self) -> &Worker {
        &self.inner.worker
    }

    /// Another handle on the same endpoint, for requests and windows.
    pub(crate) fn share(&self) -> Endpoint {
        Endpoint {
            inner: Rc::clone(&self.inner),
        }
    }

    /// The open UCX endpoint, or [`Status::NOT_CONNECTED`] (for `op`) once
    /// [`force_close`](Self::force_close) closed it: nothing is issued on a closed endpoint.
    fn handle(&self, op: Op) -> Result<sys::ucp_ep_h, Error> {
        let handle = self.inner.handle.get();
        if handle.is_null() {
            Err(Error::new(op, Status::NOT_CONNECTED))
        } else {
            Ok(handle)
        }
    }

    /// Stops using the endpoint without closing it, whatever other handles on it exist:
    /// every later operation through any handle fails with [`Status::NOT_CONNECTED`] before
    /// reaching UCX, dropping the last handle closes nothing, and the UCX endpoint is
    /// destroyed with its worker (`ucp_worker_destroy` destroys every endpoint it still has,
    /// `src/ucp/core/ucp_worker.c`, 1.13.1 and 1.22.0), which ends whatever is still in
    /// flight on it. For an endpoint in [`ErrorMode::None`] whose peer stopped draining, where
    /// UCX allows no forced close: the caller then lets the worker go. A peer-mode endpoint is
    /// closed by force instead ([`force_close`](Self::force_close)).
    ///
    /// # Errors
    ///
    /// As [`force_close`](Self::force_close), for a peer-mode endpoint.
    pub fn leave_to_worker(&self) -> Result<(), Error> {
        if self.inner.failure.is_some() {
            return self.force_close();
        }
        self.inner.handle.set(ptr::null_mut());
        Ok(())
    }

    /// Whether [`force_close`](Self::force_close) closed the endpoint, or
    /// [`leave_to_worker`](Self::leave_to_worker) left it.
    pub fn is_closed(&self) -> bool {
        self.inner.handle.get().is_null()
    }

    /// Closes the endpoint now, without the peer, whatever other handles on it exist: UCX
    /// completes every operation still in flight on it with [`Status::CANCELED`] (at once or
    /// at the worker's next progress) and sends nothing more to the peer. Every later
    /// operation through any handle fails with [`Status::NOT_CONNECTED`] before reaching UCX,
    /// and [`failure`](Self::failure) reports [`Status::CANCELED`] if UCX had reported no
    /// failure before. Closing an endpoint that is already closed does nothing.
    ///
    /// For an endpoint whose peer stopped draining: a receiver that is stopped (or stopped
    /// reading its socket) leaves puts over `tcp` in flight for ever, holding their sources.
    /// The operations' [`Request`]s, windows and remote keys stay valid; they are released as
    /// usual once they see their (cancelled) completion. Remote keys unpacked on the endpoint
    /// may outlive it: `ucp_rkey_destroy` releases the key's transport keys and returns it to
    /// the worker's pool without touching the endpoint (`src/ucp/core/ucp_rkey.c`, 1.13.1 and
    /// 1.22.0), although the header asks for keys to be destroyed first.
    ///
    /// Wraps `ucp_ep_close_nbx` with `UCP_EP_CLOSE_FLAG_FORCE`.
    ///
    /// # Errors
    ///
    /// [`Op::EpClose`] with [`Status::UNSUPPORTED`] for an [`ErrorMode::None`] endpoint (UCX
    /// allows a forced close only with peer error handling, which shared memory lacks; the
    /// endpoint is left open), or UCX's status if the close failed (the endpoint is then
    /// closed as far as this crate is concerned: nothing more is issued on it).
    #[doc(alias = "ucp_ep_close_nbx")]
    pub fn force_close(&self) -> Result<(), Error> {
        if self.is_closed() {
            return Ok(());
        }
        let Some(cell) = &self.inner.failure else {
            return Err(Error::new(Op::EpClose, Status::UNSUPPORTED));
        };
        let handle = self.inner.handle.replace(ptr::null_mut());
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: `handle` was open (not null) and is used on its worker's thread (no handle
        // is `Send`); it is never used again (the cell now holds null, and every operation
        // checks it). The endpoint was created with peer error handling, which a forced close
        // requires. Requests still in flight on it stay valid: UCX completes them with
        // `UCS_ERR_CANCELED` and they are released by their owners as usual; remote keys
        // unpacked on it do not refer to it (see above).
        let close = check_ptr(unsafe { sys::ucp_ep_close_nbx(handle, &param) });
        // A forced close completes at once (the header: it "forces immediate completion").
        let result = match close {
            Ok(None) => Ok(()),
            Ok(Some(req)) => {
                // SAFETY: a close request references no memory of ours; released once, here,
                // and `ucp_request_free` accepts a request in any state (UCX finishes the close
                // internally).
                unsafe { sys::ucp_request_free(req.as_ptr()) };
                Ok(())
            }
            Err(status) => Err(Error::new(Op::EpClose, status)),
        };
        cell.slot().record(sys::ucs_status_t::UCS_ERR_CANCELED);
        result
    }

    /// Unpacks a peer's packed remote key (from [`MemRegion::pack_rkey`]) for use on this
    /// endpoint. The key holds a handle on the endpoint, which stays open until the key is
    /// destroyed.
    ///
    /// UCX parses the bytes without a length and reads past the end of a short key (a
    /// truncated one crashed the process), so they are first checked against the packed
    /// layout of the UCX loaded here ([`KeyLayout::loaded`]): header, every memory domain's
    /// entry, and (UCX 1.20 and later) the system device and its distances must fill the bytes
    /// exactly. UCX then gets a writable copy (1.13.1's `cuda_ipc` unpack writes into the
    /// buffer, `src/uct/cuda/cuda_ipc/cuda_ipc_md.c:147` by way of `:196`) followed by 256 zero
    /// bytes: a transport that reads more than its entry declares (its fixed struct is
    /// longer than a forged size byte says, or `posix`'s directory string has no end) reads
    /// zeros this crate owns rather than whatever follows on the heap.
    ///
    /// Wraps `ucp_ep_rkey_unpack`.
    ///
    /// # Errors
    ///
    /// - [`Op::RkeyUnpack`] with [`Status::INVALID_PARAM`] and a [`KeyFormatError`]
    ///   ([`Error::key_format`]) if the bytes are not a complete key of that layout (empty
    ///   bytes included); UCX is not called.
    /// - [`Op::RkeyUnpack`] with UCX's status if UCX cannot reach the key's memory over this
    ///   endpoint's transports, or a transport refuses its part of the key.
    ///
    /// [`KeyLayout::loaded`]: crate::rkey_format::KeyLayout::loaded
    /// [`KeyFormatError`]: crate::rkey_format::KeyFormatError
    #[doc(alias = "ucp_ep_rkey_unpack")]
    pub fn unpack_rkey(&self, packed: &[u8]) -> Result<RemoteKey, Error> {
        check_packed_rkey(packed, KeyLayout::loaded()).map_err(Error::refused_key)?;
        let mut owned = Vec::with_capacity(packed.len() + KEY_PADDING);
        owned.extend_from_slice(packed);
        owned.resize(packed.len() + KEY_PADDING, 0);
        let mut handle = ptr::null_mut();
        // SAFETY: the endpoint is open (it is closed only once its last handle, `self` among
        // them, is gone) and used on its worker's thread (no handle is `Send`). `owned` is a
        // complete key of the loaded UCX's layout (checked above), so UCP's parse of it stays
        // inside it; it is readable and writable (UCX may write into it) and nothing else
        // refers to it during the call; UCX copies what it keeps, and the copy is freed after.
        // `handle` is a valid out-pointer.
        check(unsafe {
            sys::ucp_ep_rkey_unpack(
                self.handle(Op::RkeyUnpack)?,
                owned.as_mut_ptr().cast_const().cast(),
                &mut handle,
            )
        })
        .op(Op::RkeyUnpack)?;
        Ok(RemoteKey {
            inner: Rc::new(RkeyInner {
                handle,
                leaked: Cell::new(false),
                ep: Rc::clone(&self.inner),
            }),
        })
    }

    /// Writes `src` to `remote_addr` in the peer memory described by `rkey`.
    ///
    /// The returned request borrows `src` until it is finished or dropped, and dropping it
    /// waits for UCX to let go of `src`, so the bytes can neither be freed nor changed while
    /// UCX may still read them. It holds handles on this endpoint and on `rkey`, so neither is
    /// closed or destroyed while the put is in flight. Completion is local (`src` reusable);
    /// call [`Endpoint::flush`] for remote completion.
    ///
    /// Wraps `ucp_put_nbx`.
    ///
    /// # Errors
    ///
    /// [`Op::Put`] if UCX cannot start the write, or [`Status::INVALID_PARAM`] if `rkey` was
    /// unpacked on another endpoint.
    #[doc(alias = "ucp_put_nbx")]
    pub fn put<'a>(
        &self,
        src: &'a [u8],
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Request<'a>, Error> {
        self.put_raw(src.as_ptr(), src.len(), None, remote_addr, rkey)
    }

    /// Writes `len` bytes of `src` starting at `offset` to `remote_addr`, passing the region's
    /// memory handle so UCX skips its registration lookup. Otherwise as [`Endpoint::put`].
    ///
    /// Wraps `ucp_put_nbx` with `UCP_OP_ATTR_FIELD_MEMH`.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::put`], plus [`Status::INVALID_PARAM`] if `offset..offset + len` is not
    /// inside `src` or `src` belongs to another context than this endpoint's worker.
    #[doc(alias = "ucp_put_nbx")]
    pub fn put_region<'a>(
        &self,
        src: &'a MemRegion,
        offset: usize,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Request<'a>, Error> {
        let in_bounds = offset.checked_add(len).is_some_and(|end| end <= src.len());
        if !in_bounds || !Arc::ptr_eq(src.context(), self.worker().context()) {
            return Err(Error::new(Op::Put, Status::INVALID_PARAM));
        }
        // `offset <= src.len()`, so this stays inside (or one past) the mapping.
        let start = src.as_ptr().wrapping_add(offset).cast_const();
        self.put_raw(start, len, Some(src), remote_addr, rkey)
    }

    fn put_raw<'a>(
        &self,
        src: *const u8,
        len: usize,
        region: Option<&'a MemRegion>,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Request<'a>, Error> {
        if !Rc::ptr_eq(&rkey.inner.ep, &self.inner) {
            return Err(Error::new(Op::Put, Status::INVALID_PARAM));
        }
        let mut param = sys::ucp_request_param_t::default();
        if let Some(region) = region {
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_MEMH;
            param.memh = region.as_raw();
        }
        // SAFETY: the endpoint is open and used on its worker's thread; `src` is readable for
        // `len` bytes for `'a` (a borrowed slice, or a bounds-checked range of a borrowed
        // region whose `memh` is passed alongside), and the returned `Request<'a>` keeps those
        // borrows until UCX has finished with them; `rkey` was unpacked on this endpoint (checked
        // above) and the request holds a handle on it (and on the endpoint) until then too;
        // `param` is initialised.
        let ptr = unsafe {
            sys::ucp_put_nbx(
                self.handle(Op::Put)?,
                src.cast(),
                len,
                remote_addr,
                rkey.inner.handle,
                &param,
            )
        };
        Request::new(self.share(), Some(rkey.share()), Op::Put, check_ptr(ptr))
    }

    /// Completes every operation issued on this endpoint so far, remotely: once the returned
    /// request finishes, earlier puts are visible in the peer's memory.
    ///
    /// Wraps `ucp_ep_flush_nbx`.
    ///
    /// # Errors
    ///
    /// [`Op::Flush`] if UCX cannot start the flush.
    #[doc(alias = "ucp_ep_flush_nbx")]
    pub fn flush(&self) -> Result<Request<'static>, Error> {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: the endpoint is open and used on its worker's thread; `param` is initialised.
        let ptr = unsafe { sys::ucp_ep_flush_nbx(self.handle(Op::Flush)?, &param) };
        Request::new(self.share(), None, Op::Flush, check_ptr(ptr))
    }

    /// Sends an active message: `header` and `data` reach the peer's handler for `id` (see
    /// [`Worker::set_am_handler`]). Eager protocol; see [`Endpoint::am_send_with`].
    ///
    /// The request borrows both buffers until UCX is done with them, as for [`Endpoint::put`].
    /// Active messages on one endpoint are delivered after the puts issued before them only if
    /// a [`flush`](Endpoint::flush) completed in between.
    ///
    /// Wraps `ucp_am_send_nbx`.
    ///
    /// # Errors
    ///
    /// [`Op::AmSend`] if UCX cannot start the send (for example a header longer than the
    /// worker's maximum active-message header).
    #[doc(alias = "ucp_am_send_nbx")]
    pub fn am_send<'a>(
        &self,
        id: u16,
        header: &'a [u8],
        data: &'a [u8],
    ) -> Result<Request<'a>, Error> {
        self.am_send_with(id, header, data, AmProto::Eager)
    }

    /// [`Endpoint::am_send`] with an explicit payload protocol.
    ///
    /// Wraps `ucp_am_send_nbx`.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::am_send`].
    #[doc(alias = "ucp_am_send_nbx")]
    pub fn am_send_with<'a>(
        &self,
        id: u16,
        header: &'a [u8],
        data: &'a [u8],
        proto: AmProto,
    ) -> Result<Request<'a>, Error> {
        // SAFETY: both slices are borrowed for `'a` by the returned request.
        let ptr = unsafe { self.am_send_raw(id, header, data, proto) }?;
        Request::new(self.share(), None, Op::AmSend, check_ptr(ptr))
    }

    /// [`Endpoint::am_send`] for buffers the request should own: it keeps `header` and `data`
    /// until UCX is done with them, so the request borrows nothing.
    ///
    /// Wraps `ucp_am_send_nbx`.
    ///
    /// # Errors
    ///
    /// As [`Endpoint::am_send`].
    #[doc(alias = "ucp_am_send_nbx")]
    pub fn am_send_owned(
        &self,
        id: u16,
        header: Vec<u8>,
        data: Vec<u8>,
    ) -> Result<Request<'static>, Error> {
        // SAFETY: the heap buffers of `header` and `data` do not move when the vectors move into
        // the request, which keeps them until UCX has finished with them.
        let ptr = unsafe { self.am_send_raw(id, &header, &data, AmProto::Eager) }?;
        Ok(Request::new(self.share(), None, Op::AmSend, check_ptr(ptr))?.keep(header, data))
    }

    /// # Safety
    ///
    /// `header` and `data` must stay valid and unchanged until the operation completes (the
    /// returned pointer is null, an error, or a request that has left `UCS_INPROGRESS`).
    /// Nothing is sent (an error) once the endpoint is closed.
    unsafe fn am_send_raw(
        &self,
        id: u16,
        header: &[u8],
        data: &[u8],
        proto: AmProto,
    ) -> Result<sys::ucs_status_ptr_t, Error> {
        let handle = self.handle(Op::AmSend)?;
        let flags = match proto {
            AmProto::Eager => sys::UCP_AM_SEND_FLAG_EAGER,
            AmProto::Rendezvous => sys::UCP_AM_SEND_FLAG_RNDV,
            AmProto::Auto => 0,
        };
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags,
            ..Default::default()
        };
        // UCX wants a null header with length 0.
        let header_ptr = if header.is_empty() {
            ptr::null()
        } else {
            header.as_ptr()
        };
        // SAFETY: the endpoint is open and used on its worker's thread; the buffers are readable
        // for their lengths and, by this function's contract, stay so until completion; `param`
        // is initialised.
        Ok(unsafe {
            sys::ucp_am_send_nbx(
                handle,
                id.into(),
                header_ptr.cast(),
                header.len(),
                data.as_ptr().cast(),
                data.len(),
                &param,
            )
        })
    }

    /// Closes the endpoint, reporting how: flushes it (progressing the worker) for up to
    /// `timeout`, then closes gracefully; if the flush fails or times out, closes with
    /// `UCP_EP_CLOSE_FLAG_FORCE`, which drops whatever was still queued.
    ///
    /// Only the last handle on the endpoint can close it: while remote keys unpacked on it, or
    /// requests or windows issued on it, still exist, this releases `self` only and reports
    /// [`Status::BUSY`]; the endpoint is then closed as on drop (2 s timeout) when the last of
    /// them goes.
    ///
    /// Wraps `ucp_ep_flush_nbx` and `ucp_ep_close_nbx`.
    ///
    /// # Errors
    ///
    /// [`Op::Flush`] if the flush failed or timed out ([`Status::TIMED_OUT`]) and the endpoint was
    /// force-closed; [`Op::EpClose`] if closing failed or did not finish within the timeout
    /// (UCX then finishes it internally), or with [`Status::BUSY`] if other handles keep the
    /// endpoint open. `self` is released in every case.
    #[doc(alias = "ucp_ep_close_nbx")]
    pub fn close(self, timeout: Duration) -> Result<(), Error> {
        match Rc::try_unwrap(self.inner) {
            // Closed here; its `Drop` then finds it closed.
            Ok(mut inner) => inner.close(timeout),
            Err(_shared) => Err(Error::new(Op::EpClose, Status::BUSY)),
        }
    }
}

impl EndpointInner {
    /// [`Endpoint::close`] for the last handle (or its drop).
    fn close(&mut self, timeout: Duration) -> Result<(), Error> {
        let handle = self.handle.replace(ptr::null_mut());
        if handle.is_null() {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;

        let param = sys::ucp_request_param_t::default();
        // SAFETY: `handle` is open and used on its worker's thread; this is its last handle
        // (`close` unwrapped the `Rc`, `drop` runs when the last one goes), so no remote key
        // unpacked on it is left and no request or window on it is in flight (each holds a
        // handle), except requests abandoned through `PutWindow::abandon`, whose sources their
        // caller keeps valid until this close is done.
        let flush = check_ptr(unsafe { sys::ucp_ep_flush_nbx(handle, &param) });
        let (flushed, stale_flush) = match flush {
            Ok(None) => (Ok(()), None),
            Ok(Some(req)) => match self.wait_raw(&req, deadline) {
                Some(status) => {
                    // SAFETY: the flush request completed; released once, here.
                    unsafe { sys::ucp_request_free(req.as_ptr()) };
                    (check(status).op(Op::Flush), None)
                }
                None => (Err(Error::new(Op::Flush, Status::TIMED_OUT)), Some(req)),
            },
            Err(status) => (Err(Error::new(Op::Flush, status)), None),
        };

        let flags = match &flushed {
            Ok(()) => 0,
            Err(err) => {
                // Reported by the caller: `close` returns the error, the drop warns.
                tracing::debug!(
                    status = %err.status(),
                    "endpoint flush did not finish; closing it with UCP_EP_CLOSE_FLAG_FORCE"
                );
                sys::UCP_EP_CLOSE_FLAG_FORCE
            }
        };
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags,
            ..Default::default()
        };
        // SAFETY: `handle` is open; it is never used again after this call.
        let close = check_ptr(unsafe { sys::ucp_ep_close_nbx(handle, &param) });
        // Whether UCX is known to be done with the endpoint (and so with the error handler's
        // `arg`): the close completed, at once or by its request.
        let mut finished = false;
        let closed = match close {
            Ok(None) => {
                finished = true;
                Ok(())
            }
            Ok(Some(req)) => {
                // A forced close completes without the peer; give it a moment past a deadline
                // that the flush may have used up.
                let deadline = deadline.max(Instant::now() + Duration::from_millis(100));
                let status = self.wait_raw(&req, deadline);
                // SAFETY: released once, here; `ucp_request_free` accepts a request in any
                // state, and a close request references no memory of ours.
                unsafe { sys::ucp_request_free(req.as_ptr()) };
                match status {
                    Some(status) => {
                        finished = true;
                        check(status).op(Op::EpClose)
                    }
                    None => Err(Error::new(Op::EpClose, Status::TIMED_OUT)),
                }
            }
            Err(status) => Err(Error::new(Op::EpClose, status)),
        };
        if !finished {
            if let Some(cell) = self.failure.take() {
                // UCX finishes the close internally and might still call the handler until
                // then: the worker frees the slot after `ucp_worker_destroy`.
                self.worker.keep_until_destroyed(Box::new(cell));
            }
        }

        if let Some(req) = stale_flush {
            // SAFETY: the timed-out flush was purged by the forced close; a flush references no
            // memory of ours, and `ucp_request_free` accepts a request in any state.
            unsafe { sys::ucp_request_free(req.as_ptr()) };
        }
        flushed.and(closed)
    }

    /// Progresses the worker until `req` completes (its status) or `deadline` passes (`None`).
    fn wait_raw(&self, req: &RawRequest, deadline: Instant) -> Option<sys::ucs_status_t> {
        loop {
            // SAFETY: `req` is a live request of this worker, not yet freed.
            let status = unsafe { sys::ucp_request_check_status(req.as_ptr()) };
            if status != sys::ucs_status_t::UCS_INPROGRESS {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            self.worker.progress_for_drop();
        }
    }
}

impl Drop for EndpointInner {
    fn drop(&mut self) {
        if let Err(err) = self.close(DROP_CLOSE_TIMEOUT) {
            tracing::warn!(error = %err, status = %err.status(), "endpoint closed uncleanly");
        }
        // `failure` (if the close finished) and `worker` drop next: the UCX worker is
        // destroyed after this endpoint if this was the last handle on it.
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("handle", &self.inner.handle.get())
            .field("error_mode", &self.error_mode())
            .field("failure", &self.failure())
            .field("handles", &Rc::strong_count(&self.inner))
            .finish_non_exhaustive()
    }
}

/// A peer's remote key unpacked on an [`Endpoint`] (`ucp_rkey_h`): the permission to write the
/// peer memory it describes, used only with that endpoint.
///
/// Holds a handle on the endpoint, so the endpoint stays open until the key is destroyed, and
/// puts in flight hold a handle on the key, so it is destroyed only once UCX is done with them.
/// Neither `Send` nor `Sync`, like every handle on a worker.
///
/// `Drop` wraps `ucp_rkey_destroy` (skipped for a key that an abandoned put may still use, see
/// [`crate::PutWindow::abandon`]).
#[doc(alias = "ucp_rkey_h")]
pub struct RemoteKey {
    inner: Rc<RkeyInner>,
}

struct RkeyInner {
    handle: sys::ucp_rkey_h,
    /// Set when a put using the key is abandoned: UCX may use it for ever, so it is never
    /// destroyed.
    leaked: Cell<bool>,
    /// The endpoint it was unpacked on: kept open until after `ucp_rkey_destroy`, and
    /// compared to reject use on another endpoint.
    ep: Rc<EndpointInner>,
}

impl RemoteKey {
    /// Another handle on the same key, for a request that uses it.
    pub(crate) fn share(&self) -> RemoteKey {
        RemoteKey {
            inner: Rc::clone(&self.inner),
        }
    }

    /// Never destroys the key: an abandoned request may go on using it.
    pub(crate) fn leak(&self) {
        self.inner.leaked.set(true);
    }

    /// The local address UCX translates the peer address `raddr` to through this key: where
    /// a put to `raddr` lands in this process when a shared-memory transport (`posix`,
    /// `sysv`, `self`) copies it, or the device address a device transport (`cuda_ipc`)
    /// mapped it at.
    ///
    /// UCX does **not** check that `raddr` lies inside the memory the key describes:
    /// measured with UCX 1.22.0 and 1.13.1, over `posix` and `sysv` every address translates,
    /// by the constant offset between the peer's segment and where this process attached
    /// it (`0`, `u64::MAX` and addresses far outside the segment included, wrapping around),
    /// and a key that no transport here can map (`tcp`, memory registered rather than
    /// allocated) fails with [`Status::UNREACHABLE`] for every address, inside or not. Use
    /// [`check_range`](Self::check_range) to check a peer's declared range.
    ///
    /// Wraps `ucp_rkey_ptr`.
    ///
    /// # Errors
    ///
    /// [`Op::RkeyPtr`] with UCX's status: [`Status::UNREACHABLE`] when no transport of the
    /// key can map it into this process.
    #[doc(alias = "ucp_rkey_ptr")]
    pub fn ptr(&self, raddr: u64) -> Result<*mut u8, Error> {
        let mut local = ptr::null_mut();
        // SAFETY: the key is live (destroyed only once its last handle, `self` among them, is
        // gone) and used on its worker's thread (no handle is `Send`); `local` is a valid
        // out-pointer. UCX only computes the pointer: nothing is read or written through it.
        check(unsafe { sys::ucp_rkey_ptr(self.inner.handle, raddr, &mut local) })
            .op(Op::RkeyPtr)?;
        Ok(local.cast())
    }

    /// Checks a peer's declared range `[base, base + len)` against what this key maps, so
    /// that no put through the key can land outside the memory the peer packed it for.
    ///
    /// Over shared memory the sender itself copies each put to the address [`ptr`](Self::ptr)
    /// gives, and UCX translates any address, inside the key's segment or not (see there), so
    /// a peer that declares a pool at `0x1000` with the real key of another region would
    /// make this process write at a wild address. UCX cannot say where the segment ends, but
    /// the kernel can: the segment is attached as a shared, writable mapping of its own file
    /// (`/dev/shm/ucx_shm_posix_*`, or the `/SYSV*` segment), so the range is accepted only
    /// if its translation lies inside such mappings of one file in `/proc/self/maps`.
    ///
    /// - [`RangeCheck::NotMappable`]: `ucp_rkey_ptr(base)` fails with
    ///   [`Status::UNREACHABLE`]. No transport of the key translates addresses in this
    ///   process (`tcp`, `cma`, registered memory): puts through it are resolved by the peer
    ///   or the kernel, never copied here to a translated address, so there is nothing to
    ///   check here. UCX answers per key, not per address (measured: 1.22.0 and 1.13.1), so
    ///   a wild `base` never makes a mappable key look unmappable.
    /// - [`RangeCheck::Mapped`]: `base` and `base + len - 1` both translate, `len - 1` bytes
    ///   apart, and the translated range lies inside shared, writable mappings of one file.
    /// - [`RangeCheck::Device`]: both ends translate contiguously, the range is in no such
    ///   host mapping, and this key's context moves device memory (it reports a memory type
    ///   besides host, e.g. `cuda_ipc` in its transports): the translation may be a device
    ///   address, which only the device's driver can check. The caller verifies it there or
    ///   refuses the range.
    ///
    /// Reads `/proc/self/maps` once per call (unless the key is not mappable).
    ///
    /// # Errors
    ///
    /// [`Op::RkeyPtr`] with
    /// - [`Status::INVALID_PARAM`] if `len` is 0 or `base + len` overflows;
    /// - UCX's status if `base` translates but `base + len - 1` does not;
    /// - [`Status::INVALID_ADDR`] if the two ends are not `len - 1` bytes apart, or (in a
    ///   context without device memory) the translated range leaves the key's mapping;
    /// - [`Status::IO_ERROR`] if `/proc/self/maps` cannot be read: the range cannot be
    ///   checked, so it is refused.
    pub fn check_range(&self, base: u64, len: u64) -> Result<RangeCheck, Error> {
        let refuse = |status| Err(Error::new(Op::RkeyPtr, status));
        if len == 0 || base.checked_add(len).is_none() {
            return refuse(Status::INVALID_PARAM);
        }
        let start = match self.ptr(base) {
            Ok(start) => start,
            Err(e) if e.status() == Status::UNREACHABLE => return Ok(RangeCheck::NotMappable),
            Err(e) => return Err(e),
        };
        let last = self.ptr(base + (len - 1))?;
        if (last as u64).wrapping_sub(start as u64) != len - 1 {
            return refuse(Status::INVALID_ADDR);
        }
        // `start + len - 1` is `last`, so the local range does not wrap and `len` fits.
        let local_len =
            usize::try_from(len).map_err(|_| Error::new(Op::RkeyPtr, Status::INVALID_ADDR))?;
        match shared_rw_mapping_covers(start as usize, local_len) {
            Ok(true) => Ok(RangeCheck::Mapped),
            Ok(false) if self.moves_device_memory() => Ok(RangeCheck::Device { local: start }),
            Ok(false) => refuse(Status::INVALID_ADDR),
            Err(_) => refuse(Status::IO_ERROR),
        }
    }

    /// Whether the key's context reports a memory type besides host (so a device transport
    /// may have translated an address). An unanswered query counts as no.
    fn moves_device_memory(&self) -> bool {
        self.inner
            .ep
            .worker
            .context()
            .memory_types()
            .is_ok_and(|types| types.iter().any(|t| !t.is_host()))
    }
}

/// What [`RemoteKey::check_range`] found out about a peer's declared range.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
#[non_exhaustive]
pub enum RangeCheck {
    /// The key maps the range into this process, inside the key's own shared mapping:
    /// puts through it are copies into memory the peer shared.
    Mapped,
    /// The key cannot be mapped into this process (`UCS_ERR_UNREACHABLE`, e.g. over `tcp`):
    /// puts through it are not translated here, so the range needs no check here.
    NotMappable,
    /// The range translates to `local..local + len`, outside every shared host mapping, in a
    /// context that moves device memory: a device address (`cuda_ipc`), or nothing the key
    /// maps. Only the device's driver can tell which; the caller must check it there (one
    /// device allocation holds the whole range) or refuse the range.
    Device {
        /// The local address `base` translates to.
        local: *mut u8,
    },
}

impl Drop for RkeyInner {
    fn drop(&mut self) {
        if self.leaked.get() {
            return;
        }
        // SAFETY: `handle` came from `ucp_ep_rkey_unpack` and is destroyed once, here, when the
        // last handle on it goes, on the worker's thread (no handle is `Send`): puts that use
        // it hold a handle, so none is in flight (an abandoned one marks the key leaked and
        // never gets here); and the endpoint it was unpacked on is still open, kept by `ep`,
        // which drops only after this.
        unsafe { sys::ucp_rkey_destroy(self.handle) };
    }
}

impl fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteKey")
            .field("handle", &self.inner.handle)
            .field("leaked", &self.inner.leaked.get())
            .finish_non_exhaustive()
    }
}
