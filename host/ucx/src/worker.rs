//! Workers: progress, addresses and active-message handlers.

/*
Maintainer notes.

Active messages arrive in `am_trampoline`, called by UCX from inside `ucp_worker_progress`.
Handlers are registered with `UCP_AM_FLAG_WHOLE_MSG`, so eager messages (what our senders
produce, see `AmProto::Eager`) reach the trampoline as one contiguous payload and the Rust handler
runs right there. A rendezvous message only delivers a descriptor: the trampoline queues it and
returns `UCS_INPROGRESS` (UCX's client/server example does the same), and after
`ucp_worker_progress` returns, `pump_rndv` starts `ucp_am_recv_data_nbx` into a fresh buffer and
polls it; the handler runs when the data is in. So handlers always see inline bytes, whichever
protocol the sender picked.

Panics: every Rust frame UCX calls into runs under `PanicSlot::wrap`; `progress` resumes the
first payload after UCX has returned. A handler that panicked is poisoned (never called again)
until it is replaced.

Ownership: `Worker` is an `Rc` handle on `WorkerInner`, which owns the `ucp_worker_h`; every
endpoint holds another (see endpoint.rs), so the UCX worker is destroyed only after its last
endpoint is closed, whichever of the `Worker` value and the endpoints goes first. The `Rc`s make
every handle `!Send + !Sync`, which is exactly the serialized thread mode's "one thread at a
time"; the one way across threads is `SendWorker`, which can only be made from the last handle.

Reentrancy: UCX forbids calling `ucp_worker_progress` from a callback. Handlers are `'static +
Send`, so they cannot capture the worker or anything holding it (no handle is `Send`), but a
handle parked in a thread-local could still be reached; `State::in_progress` turns that into a
panic (`progress`) or an error (`set_am_handler`, `into_send`), and into an abort where a
destructor would have to wait (see `progress_for_drop`).
*/

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt;
use std::os::fd::RawFd;
use std::os::raw::c_void;
use std::ptr;
use std::rc::Rc;
use std::sync::Arc;

use ucx_sys as sys;

use crate::callback::PanicSlot;
use crate::endpoint::{Endpoint, ErrorMode};
use crate::ffi::{self, RawRequest, check, check_ptr};
use crate::status::WithOp;
use crate::{Context, Error, Op, Status};

/// Progress calls in a row that find nothing before [`Worker::progress_or_yield`] starts
/// yielding: about 0.1 ms of a tcp worker's polling (each call an `epoll_wait`), a few µs of a
/// shared-memory one's. Measured on the 2-core machine (README "Measured"): yielding at once
/// made one tcp stream 16 % slower (it had a core to itself, and every gap between packets
/// handed that core to some waking thread); yielding after 64 kept that stream (−4 %, within
/// noise) and the 1.1–1.35× of yielding when 4–8 transfers share two cores.
pub const SPIN_BEFORE_YIELD: u32 = 64;

/// Yields in a row, after [`SPIN_BEFORE_YIELD`] idle calls, before
/// [`Worker::progress_or_nap`] sleeps on the worker's wake-up descriptor instead (on every
/// further idle call, until one progresses something). On the 2-core machine, where four tcp
/// streams and their receivers share two cores, senders yielding in their put windows still
/// took CPU time the kernel's copies needed: napping there moved DeepSeek-V3 dep4 → dep4
/// over tcp from 4.02–4.52 to 4.48–4.87 GB/s, while one stream with a core to itself and
/// the shared-memory workloads stayed within their noise (docs/BENCHMARKS.md "Napping in
/// put and flush waits"). Napping after 8 or 128 yields measured alike.
pub const YIELDS_BEFORE_NAP: u32 = 32;

/// The longest one nap lasts: every event of the worker's transports ends it at once, so
/// only a transport that cannot signal its completions would wait this long (and then
/// only this long before the next progress call).
pub const NAP: std::time::Duration = std::time::Duration::from_micros(100);

/// A boxed active-message handler: `(header, data)`.
type AmHandler = Box<dyn FnMut(&[u8], &[u8]) + Send>;

/// A UCP worker (`ucp_worker_h`): the progress engine behind endpoints and requests.
///
/// Created in `UCS_THREAD_MODE_SERIALIZED`: UCX does no locking for it, any thread may use it
/// but never two at once. The UCX worker lives in an inner shared (through `Rc`) with every
/// [`Endpoint`] made from it (and, through those, with their remote keys, requests and put
/// windows), so it is destroyed only once the last of them is gone: an endpoint may outlive
/// the `Worker` value that connected it. All of these handles are neither `Send` nor `Sync`;
/// they stay on one thread, which is what the serialized mode needs. To move a worker to the
/// thread that progresses it, move it before connecting anything, through
/// [`Worker::into_send`].
///
/// `Drop` releases this handle; the last handle's drop wraps `ucp_worker_destroy`.
#[doc(alias = "ucp_worker_h")]
pub struct Worker {
    inner: Rc<WorkerInner>,
}

/// The UCX worker and its Rust state, shared by every handle on it.
struct WorkerInner {
    handle: sys::ucp_worker_h,
    // Boxed so that `AmSlot::state` pointers stay valid when a `SendWorker` moves the inner
    // out of its `Rc`.
    state: Box<State>,
    ctx: Arc<Context>,
}

/// A [`Worker`] on its way to another thread: the only handle on its UCX worker, so it is
/// `Send`. Made by [`Worker::into_send`], turned back with [`SendWorker::into_worker`].
#[doc(alias = "ucp_worker_h")]
pub struct SendWorker {
    inner: WorkerInner,
}

// SAFETY: the worker is created in `UCS_THREAD_MODE_SERIALIZED`, whose contract is "multiple
// threads may access the worker, but only one at a time". A `SendWorker` is made only from the
// last handle on its worker (`Worker::into_send` unwraps the `Rc`, which fails while endpoints,
// remote keys, requests or windows hold it) and outside of its progress, and it offers nothing
// but `into_worker` and its drop; so every UCX call before the move happened on the old thread,
// every later one happens on the new thread, and the move itself is ordered by whatever
// synchronisation performed it. The Rust state travelling with it is `Send` as well: handlers
// are `FnMut + Send`, panic payloads are `Send`, the rendezvous descriptors and buffers belong to
// this worker alone, the kept error-handler cells are `Send` (atomics), and the context is
// `Send + Sync`.
unsafe impl Send for SendWorker {}

impl SendWorker {
    /// The worker again, on the thread that will progress it.
    pub fn into_worker(self) -> Worker {
        Worker {
            inner: Rc::new(self.inner),
        }
    }
}

impl fmt::Debug for SendWorker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendWorker")
            .field("handle", &self.inner.handle)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    handlers: RefCell<HashMap<u16, Box<AmSlot>>>,
    panic: PanicSlot,
    in_progress: Cell<bool>,
    /// Rendezvous descriptors handed to the trampoline, not yet passed to
    /// `ucp_am_recv_data_nbx`.
    rndv_arrived: RefCell<Vec<RndvArrived>>,
    /// Rendezvous receives in flight; each buffer must outlive its request.
    rndv_receiving: RefCell<Vec<RndvReceiving>>,
    /// Memory UCX may still use until the worker is destroyed (the error-handler cells of
    /// endpoints whose close did not finish); dropped after `ucp_worker_destroy`.
    kept: RefCell<Vec<Box<dyn Any + Send>>>,
}

/// What UCX gets as the `arg` of one registered handler.
struct AmSlot {
    id: u16,
    /// The owning worker's state (boxed, outlives the slot).
    state: *const State,
    handler: RefCell<AmHandler>,
    poisoned: Cell<bool>,
}

struct RndvArrived {
    id: u16,
    header: Vec<u8>,
    desc: *mut c_void,
    len: usize,
}

struct RndvReceiving {
    id: u16,
    header: Vec<u8>,
    /// Capacity `len`; UCX writes into it until `req` completes.
    buf: Vec<u8>,
    len: usize,
    req: RawRequest,
}

impl Worker {
    /// Creates a worker on `ctx`.
    ///
    /// Wraps `ucp_worker_create`.
    ///
    /// # Errors
    ///
    /// [`Op::WorkerCreate`] if UCX cannot open the configured transports.
    #[doc(alias = "ucp_worker_create")]
    pub fn new(ctx: &Arc<Context>) -> Result<Worker, Error> {
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut handle = ptr::null_mut();
        // SAFETY: the context is live (we hold an `Arc`), `params` is initialised and names only
        // `thread_mode`, and `handle` is a valid out-pointer.
        check(unsafe { sys::ucp_worker_create(ctx.as_raw(), &params, &mut handle) })
            .op(Op::WorkerCreate)?;
        let worker = Worker {
            inner: Rc::new(WorkerInner {
                handle,
                state: Box::default(),
                ctx: Arc::clone(ctx),
            }),
        };
        // UCX 1.13 segfaults (a null handler table) when an active message reaches a worker that
        // never had a handler installed; once the table exists, unknown ids are dropped with a
        // warning. Installing an empty handler creates the table.
        worker.install_am_handler(0, None, ptr::null_mut())?;
        Ok(worker)
    }

    /// The context this worker belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner.ctx
    }

    /// This worker's address, to be sent to peers out of band for [`Worker::connect`].
    ///
    /// Wraps `ucp_worker_get_address` and `ucp_worker_release_address`.
    ///
    /// # Errors
    ///
    /// [`Op::WorkerAddress`] if UCX cannot pack the address.
    #[doc(alias = "ucp_worker_get_address")]
    pub fn address(&self) -> Result<Vec<u8>, Error> {
        let mut address = ptr::null_mut();
        let mut len = 0;
        // SAFETY: the worker is live and both out-pointers are valid.
        check(unsafe { sys::ucp_worker_get_address(self.inner.handle, &mut address, &mut len) })
            .op(Op::WorkerAddress)?;
        // SAFETY: on success UCX returns a buffer of `len` bytes that stays valid until it is
        // released below; it is copied before that.
        let bytes = unsafe { ffi::bytes(address.cast_const().cast(), len) }.to_vec();
        // SAFETY: `address` came from `ucp_worker_get_address` on this worker, released once.
        unsafe { sys::ucp_worker_release_address(self.inner.handle, address) };
        Ok(bytes)
    }

    /// Connects to the peer worker whose [`address`](Worker::address) is `address`.
    ///
    /// The endpoint is usable at once, but wire-up completes only as both workers progress. It
    /// holds a handle on this worker: the UCX worker lives on, after this `Worker` value is
    /// dropped, until the endpoint (and everything made from it) is gone.
    ///
    /// Wraps `ucp_ep_create`.
    ///
    /// # Errors
    ///
    /// [`Op::EpCreate`] if UCX finds no transport to the peer, or [`Status::INVALID_PARAM`] for
    /// an empty address or one whose first byte names an address version UCX does not know
    /// (on which UCX would abort the process).
    ///
    /// The address must be bytes produced by a peer's `address()`, delivered intact: UCX parses
    /// it without a length (see the crate docs on trust). Measured on UCX 1.22.0: other garbage
    /// (random bytes of a known version, a truncated address, zeros) fails with
    /// [`Status::UNREACHABLE`] or [`Status::INVALID_PARAM`], but a truncated address is read
    /// past its end, and one flipped byte can still connect (to nothing that answers).
    #[doc(alias = "ucp_ep_create")]
    pub fn connect(&self, address: &[u8]) -> Result<Endpoint, Error> {
        Endpoint::connect(self, address, ErrorMode::None)
    }

    /// [`connect`](Worker::connect) with an explicit error handling mode.
    ///
    /// With [`ErrorMode::Peer`] the endpoint gets an error handler: once UCX detects that the
    /// peer failed (over `tcp`, its connection reset or closed, or keep-alive silence), every
    /// request on the endpoint completes with an error instead of waiting, and
    /// [`Endpoint::failure`] reports UCX's status. UCX then selects only transports with a
    /// peer-failure handler (not `posix`, `sysv` or `self`), so a selection of shared memory
    /// alone cannot connect this way. UCX's documentation of `UCP_EP_CLOSE_FLAG_FORCE`, which
    /// closes use when a flush does not finish, asks for this mode on both sides; a target
    /// worker that only accepts connections gets the initiator's mode with the wire-up.
    ///
    /// Wraps `ucp_ep_create` with `UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE` and
    /// `UCP_EP_PARAM_FIELD_ERR_HANDLER`.
    ///
    /// # Errors
    ///
    /// As [`Worker::connect`]; [`Op::EpCreate`] with [`Status::UNREACHABLE`] (or another
    /// status) when no enabled transport both reaches the peer and supports the mode.
    #[doc(alias = "ucp_ep_create")]
    pub fn connect_with(&self, address: &[u8], mode: ErrorMode) -> Result<Endpoint, Error> {
        Endpoint::connect(self, address, mode)
    }

    /// Keeps `value` until after `ucp_worker_destroy`: memory UCX may still use while it
    /// knows an endpoint whose close it finishes on its own.
    pub(crate) fn keep_until_destroyed(&self, value: Box<dyn Any + Send>) {
        self.inner.state.kept.borrow_mut().push(value);
    }

    /// Makes this worker `Send`, to move it to the thread that will progress it.
    ///
    /// Only the last handle on a UCX worker may move: endpoints, remote keys, requests and put
    /// windows made from it share it and stay on this thread, so while any of them exists (or
    /// from inside one of the worker's active-message handlers) the worker is given back as
    /// the error. A worker that was never connected always converts.
    ///
    /// # Errors
    ///
    /// This worker, unchanged, if other handles on it exist.
    pub fn into_send(self) -> Result<SendWorker, Worker> {
        if self.inner.state.in_progress.get() {
            return Err(self);
        }
        Rc::try_unwrap(self.inner)
            .map(|inner| SendWorker { inner })
            .map_err(|inner| Worker { inner })
    }

    /// Another handle on the same UCX worker, for the endpoints made from it.
    pub(crate) fn share(&self) -> Worker {
        Worker {
            inner: Rc::clone(&self.inner),
        }
    }

    /// Advances every operation of this worker; returns whether anything happened.
    ///
    /// Active-message handlers run inside this call.
    ///
    /// Wraps `ucp_worker_progress`.
    ///
    /// # Panics
    ///
    /// Resumes the panic of an active-message handler that panicked during this call (UCX never
    /// sees it). Panics if called from inside a handler of this worker, which UCX forbids.
    #[doc(alias = "ucp_worker_progress")]
    pub fn progress(&self) -> bool {
        let Some(progressed) = self.progress_guarded() else {
            panic!("Worker::progress called from inside one of its active-message handlers");
        };
        self.inner.state.panic.resume();
        progressed
    }

    /// [`progress`](Worker::progress) for a wait loop: once this thread's last
    /// [`SPIN_BEFORE_YIELD`] calls all progressed nothing, each further call that progresses
    /// nothing gives the rest of the thread's time slice to another runnable thread
    /// (`sched_yield`). A thread waiting on its peer then does not take the CPU from the
    /// threads that peer's progress needs when there are fewer cores than busy threads, and
    /// a short wait still spins. For a loop that waits on something besides this worker
    /// (another thread, a channel); one that waits only on this worker's own operations uses
    /// [`progress_or_nap`](Worker::progress_or_nap).
    ///
    /// # Panics
    ///
    /// As [`Worker::progress`].
    pub fn progress_or_yield(&self) -> bool {
        self.progress_waiting(false)
    }

    /// [`progress_or_yield`](Worker::progress_or_yield) for a loop that waits only on this
    /// worker's own operations (puts, flushes, sends): after [`YIELDS_BEFORE_NAP`] yields in
    /// a row it arms the worker and sleeps on its wake-up descriptor, for at most [`NAP`],
    /// on every further call until one progresses something. The thread then takes no CPU at
    /// all while its transport is blocked (a full socket, bytes still on the way), and wakes
    /// as soon as any of the worker's transports has an event. A worker without a descriptor
    /// only yields.
    ///
    /// # Panics
    ///
    /// As [`Worker::progress`].
    pub fn progress_or_nap(&self) -> bool {
        self.progress_waiting(true)
    }

    fn progress_waiting(&self, nap: bool) -> bool {
        thread_local! {
            /// Calls in a row on this thread that progressed nothing.
            static IDLE: Cell<u32> = const { Cell::new(0) };
        }
        let progressed = self.progress();
        IDLE.with(|idle| {
            if progressed {
                idle.set(0);
                return;
            }
            let n = idle.get().saturating_add(1);
            idle.set(n);
            if nap && n > SPIN_BEFORE_YIELD + YIELDS_BEFORE_NAP {
                self.nap();
            } else if n > SPIN_BEFORE_YIELD {
                std::thread::yield_now();
            }
        });
        progressed
    }

    /// Arms the worker and sleeps until its descriptor is readable or [`NAP`] passes; returns
    /// at once when events are already pending (the caller progresses them) or the worker has
    /// no descriptor.
    fn nap(&self) {
        let Ok(fd) = self.event_fd() else {
            std::thread::yield_now();
            return;
        };
        if !matches!(self.arm(), Ok(true)) {
            return;
        }
        // An error (the descriptor is the worker's own and open while it lives) or a signal
        // just ends the nap early.
        let _ = kvferry_platform::wait_readable(fd, NAP);
    }

    /// The descriptor that becomes readable when this worker has an event to progress, once
    /// [`arm`](Worker::arm)ed: what a thread with nothing to do polls (beside its own
    /// descriptors) instead of spinning on [`progress`](Worker::progress). The worker owns
    /// it; it stays open while the worker lives.
    ///
    /// Wraps `ucp_worker_get_efd`.
    ///
    /// # Errors
    ///
    /// [`Op::WorkerEventFd`] if this worker's transports cannot signal events.
    #[doc(alias = "ucp_worker_get_efd")]
    pub fn event_fd(&self) -> Result<RawFd, Error> {
        let mut fd: std::os::raw::c_int = -1;
        // SAFETY: the worker is live (we hold it); `fd` is a valid out-pointer.
        check(unsafe { sys::ucp_worker_get_efd(self.inner.handle, &mut fd) })
            .op(Op::WorkerEventFd)?;
        Ok(fd)
    }

    /// Arms [`event_fd`](Worker::event_fd) so the next event makes it readable: `true` when
    /// armed (the caller may sleep on the descriptor), `false` when events are pending that
    /// must be progressed first ([`Status::BUSY`]; no sleep until progress has drained them).
    ///
    /// Wraps `ucp_worker_arm`.
    ///
    /// # Errors
    ///
    /// [`Op::WorkerArm`] for any other failure.
    #[doc(alias = "ucp_worker_arm")]
    pub fn arm(&self) -> Result<bool, Error> {
        // SAFETY: the worker is live (we hold it); UCX reads nothing else.
        match check(unsafe { sys::ucp_worker_arm(self.inner.handle) }) {
            Ok(()) => Ok(true),
            Err(status) if status == Status::BUSY => Ok(false),
            Err(status) => Err(Error::new(Op::WorkerArm, status)),
        }
    }

    /// Installs `handler` for active messages with `id`, replacing any previous handler.
    ///
    /// The handler gets `(header, data)` of each message, both inline whatever protocol the
    /// sender used. It runs inside [`Worker::progress`] and must not block. If it panics, the
    /// panic is resumed from `progress` once UCX has returned, and the handler is not called
    /// again (messages for `id` are dropped) until it is replaced.
    ///
    /// Wraps `ucp_worker_set_am_recv_handler`.
    ///
    /// # Errors
    ///
    /// [`Op::SetAmHandler`] if UCX rejects the handler, or [`Status::BUSY`] when called from
    /// inside a handler of this worker.
    #[doc(alias = "ucp_worker_set_am_recv_handler")]
    pub fn set_am_handler<F>(&self, id: u16, handler: F) -> Result<(), Error>
    where
        F: FnMut(&[u8], &[u8]) + Send + 'static,
    {
        self.not_in_progress()?;
        let slot = Box::new(AmSlot {
            id,
            state: &*self.inner.state,
            handler: RefCell::new(Box::new(handler)),
            poisoned: Cell::new(false),
        });
        let arg: *const AmSlot = &*slot;
        self.install_am_handler(id, Some(am_trampoline), arg.cast_mut().cast())?;
        // Only now that UCX points at the new slot may the old one be freed.
        self.inner.state.handlers.borrow_mut().insert(id, slot);
        Ok(())
    }

    /// Removes the handler for `id`; later messages with `id` are dropped by UCX.
    ///
    /// Wraps `ucp_worker_set_am_recv_handler` with a null callback.
    ///
    /// # Errors
    ///
    /// As [`Worker::set_am_handler`].
    pub fn remove_am_handler(&self, id: u16) -> Result<(), Error> {
        self.not_in_progress()?;
        self.install_am_handler(id, None, ptr::null_mut())?;
        self.inner.state.handlers.borrow_mut().remove(&id);
        Ok(())
    }

    pub(crate) fn as_raw(&self) -> sys::ucp_worker_h {
        self.inner.handle
    }

    /// Progress for destructors, which must wait but cannot unwind: a handler panic stays
    /// stashed for the next [`Worker::progress`].
    ///
    /// Aborts the process if called from inside a handler of this worker: the destructor could
    /// neither wait (UCX forbids progress there) nor return (memory UCX still uses would be
    /// freed). Reaching this needs a worker smuggled into a handler through a thread-local.
    pub(crate) fn progress_for_drop(&self) -> bool {
        match self.progress_guarded() {
            Some(progressed) => progressed,
            None => {
                eprintln!(
                    "kvferry-ucx: an in-flight UCX operation was dropped inside an \
                     active-message handler of its own worker, where it can neither be waited \
                     for nor abandoned; aborting"
                );
                std::process::abort();
            }
        }
    }

    /// One round of `ucp_worker_progress` plus the rendezvous pump; `None` if reentrant.
    fn progress_guarded(&self) -> Option<bool> {
        if self.inner.state.in_progress.replace(true) {
            return None;
        }
        let _reset = ResetOnDrop(&self.inner.state.in_progress);
        // SAFETY: the worker is live (this handle keeps it) and, every handle on it being
        // `!Send + !Sync` and this call not reentered (checked above), used by this thread
        // only. Callbacks it runs are `am_trampoline`, which never unwinds.
        let events = unsafe { sys::ucp_worker_progress(self.inner.handle) };
        let pumped = self.pump_rndv();
        Some(events != 0 || pumped)
    }

    fn not_in_progress(&self) -> Result<(), Error> {
        if self.inner.state.in_progress.get() {
            Err(Error::new(Op::SetAmHandler, Status::BUSY))
        } else {
            Ok(())
        }
    }

    fn install_am_handler(
        &self,
        id: u16,
        cb: sys::ucp_am_recv_callback_t,
        arg: *mut c_void,
    ) -> Result<(), Error> {
        let param = sys::ucp_am_handler_param_t {
            field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
            id: id.into(),
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb,
            arg,
        };
        // SAFETY: the worker is live; `param` is fully initialised. `arg` is null (with a null
        // callback) or an `AmSlot` that the caller keeps alive until the handler is replaced,
        // removed or the worker destroyed, and `am_trampoline` matches the callback type.
        check(unsafe { sys::ucp_worker_set_am_recv_handler(self.inner.handle, &param) })
            .op(Op::SetAmHandler)
    }

    /// Starts receives for queued rendezvous messages and delivers finished ones.
    fn pump_rndv(&self) -> bool {
        let state = &*self.inner.state;
        let mut progressed = false;

        let arrived = std::mem::take(&mut *state.rndv_arrived.borrow_mut());
        for msg in arrived {
            progressed = true;
            let mut buf = Vec::<u8>::with_capacity(msg.len);
            let param = sys::ucp_request_param_t::default();
            // SAFETY: `msg.desc` is a rendezvous descriptor for which the trampoline returned
            // `UCS_INPROGRESS`, so it is still valid and not yet received; `buf` has room for
            // `msg.len` bytes and stays alive until the receive completes (in `rndv_receiving`)
            // or, if the worker is destroyed first, until after `ucp_worker_destroy`.
            let ptr = unsafe {
                sys::ucp_am_recv_data_nbx(
                    self.inner.handle,
                    msg.desc,
                    buf.as_mut_ptr().cast(),
                    msg.len,
                    &param,
                )
            };
            match check_ptr(ptr) {
                Ok(None) => {
                    // SAFETY: the receive completed in place: UCX wrote all `msg.len` bytes.
                    unsafe { buf.set_len(msg.len) };
                    self.dispatch(msg.id, &msg.header, &buf);
                }
                Ok(Some(req)) => state.rndv_receiving.borrow_mut().push(RndvReceiving {
                    id: msg.id,
                    header: msg.header,
                    buf,
                    len: msg.len,
                    req,
                }),
                Err(status) => tracing::warn!(
                    id = msg.id,
                    len = msg.len,
                    %status,
                    "dropping a rendezvous active message: ucp_am_recv_data_nbx failed"
                ),
            }
        }

        state.rndv_receiving.borrow_mut().retain_mut(|recv| {
            // SAFETY: `recv.req` is a live request of this worker, not yet freed.
            let status = unsafe { sys::ucp_request_check_status(recv.req.as_ptr()) };
            if status == sys::ucs_status_t::UCS_INPROGRESS {
                return true;
            }
            progressed = true;
            // SAFETY: the request has completed and is released once; dropping it from the
            // list below is the only other use.
            unsafe { sys::ucp_request_free(recv.req.as_ptr()) };
            match check(status) {
                Ok(()) => {
                    // SAFETY: the receive completed successfully: all `len` bytes are written.
                    unsafe { recv.buf.set_len(recv.len) };
                    self.dispatch(recv.id, &recv.header, &recv.buf);
                }
                Err(status) => tracing::warn!(
                    id = recv.id,
                    len = recv.len,
                    %status,
                    "dropping a rendezvous active message: receive failed"
                ),
            }
            false
        });

        progressed
    }

    /// Runs the current handler for `id` on a complete message (outside UCX callbacks).
    fn dispatch(&self, id: u16, header: &[u8], data: &[u8]) {
        match self.inner.state.handlers.borrow().get(&id) {
            Some(slot) => slot.invoke(&self.inner.state, header, data),
            None => tracing::warn!(id, "dropping an active message: no handler for its id"),
        }
    }
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        for msg in self.state.rndv_arrived.get_mut().drain(..) {
            // SAFETY: a rendezvous descriptor kept with `UCS_INPROGRESS` and never passed to
            // `ucp_am_recv_data_nbx` must be released with `ucp_am_data_release` (which also
            // completes the sender's request).
            unsafe { sys::ucp_am_data_release(self.handle, msg.desc) };
        }
        for recv in self.state.rndv_receiving.get_mut().iter() {
            // SAFETY: `ucp_request_free` may release a request in any state; UCX stops using
            // `recv.buf` at the latest inside `ucp_worker_destroy` below, and the buffers are
            // dropped only after this function returns (they live in `self.state`).
            unsafe { sys::ucp_request_free(recv.req.as_ptr()) };
        }
        // SAFETY: `handle` came from `ucp_worker_create` and is destroyed once, here, when the
        // last handle on it goes. Endpoints hold one (and remote keys, requests and windows
        // hold their endpoint's), so every endpoint has been closed and none of those is left;
        // the handler slots UCX points at (and the error-handler cells in `kept`) are dropped
        // after this call.
        unsafe { sys::ucp_worker_destroy(self.handle) };
    }
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ids: Vec<u16> = self.inner.state.handlers.borrow().keys().copied().collect();
        ids.sort_unstable();
        f.debug_struct("Worker")
            .field("handle", &self.inner.handle)
            .field("handles", &Rc::strong_count(&self.inner))
            .field("am_handlers", &ids)
            .finish_non_exhaustive()
    }
}

impl AmSlot {
    /// Runs the handler under `catch_unwind`; a panic poisons the slot.
    fn invoke(&self, state: &State, header: &[u8], data: &[u8]) {
        if self.poisoned.get() {
            tracing::warn!(
                id = self.id,
                "dropping an active message: its handler panicked"
            );
            return;
        }
        let Ok(mut handler) = self.handler.try_borrow_mut() else {
            // Unreachable: handlers cannot progress their worker, so cannot re-enter.
            tracing::warn!(
                id = self.id,
                "dropping an active message: handler re-entered"
            );
            return;
        };
        if state.panic.wrap(|| handler(header, data)).is_none() {
            self.poisoned.set(true);
        }
    }
}

/// UCX's view of every Rust active-message handler.
///
/// # Safety
///
/// Called by UCX only, as a `ucp_am_recv_callback_t` registered by `install_am_handler`:
///
/// 1. `arg` is the `AmSlot` registered for the message's id; it is alive because slots are
///    freed only after UCX has been pointed elsewhere, which cannot happen during progress.
/// 2. `header` is valid for `header_length` bytes (not read when 0), `param` is valid, and
///    `data` is valid for `length` bytes unless `param.recv_attr` has
///    `UCP_AM_RECV_ATTR_FLAG_RNDV`, in which case it is a descriptor.
/// 3. All are valid for the duration of the call only.
unsafe extern "C" fn am_trampoline(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: by (1) `arg` points to a live `AmSlot`, only read through shared references.
    let slot = unsafe { &*arg.cast_const().cast::<AmSlot>() };
    // SAFETY: `slot.state` points into the boxed state of the worker that owns the slot, which
    // outlives it.
    let state = unsafe { &*slot.state };
    // SAFETY: by (2) `param` is valid for reads during the call.
    let recv_attr = unsafe { (*param).recv_attr };
    let rndv = recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    let failed = if rndv {
        sys::ucs_status_t::UCS_ERR_CANCELED
    } else {
        sys::ucs_status_t::UCS_OK
    };

    state
        .panic
        .wrap(|| {
            // SAFETY: by (2) and (3) `header` is valid for `header_length` bytes for this call,
            // and the slice does not outlive it.
            let header = unsafe { ffi::bytes(header, header_length) };
            if rndv {
                if slot.poisoned.get() {
                    // Reject it: the sender's request completes with this status.
                    return sys::ucs_status_t::UCS_ERR_CANCELED;
                }
                state.rndv_arrived.borrow_mut().push(RndvArrived {
                    id: slot.id,
                    header: header.to_vec(),
                    desc: data,
                    len: length,
                });
                // Keeps the descriptor alive for `pump_rndv`.
                return sys::ucs_status_t::UCS_INPROGRESS;
            }
            // SAFETY: not a rendezvous descriptor, so by (2) and (3) `data` holds `length`
            // payload bytes for this call, and the slice does not outlive it.
            let data = unsafe { ffi::bytes(data, length) };
            slot.invoke(state, header, data);
            sys::ucs_status_t::UCS_OK
        })
        .unwrap_or(failed)
}

/// Clears the reentrancy flag even if progress unwinds.
struct ResetOnDrop<'a>(&'a Cell<bool>);

impl Drop for ResetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.set(false);
    }
}
