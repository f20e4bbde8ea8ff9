//! In-flight operations and their completion.

use std::fmt;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use ucx_sys as sys;

use crate::ffi::{RawRequest, check};
use crate::status::WithOp;
use crate::{Endpoint, Error, Op, RemoteKey, Status, Worker};

/// An operation UCX may still be working on: a put, flush or active-message send.
///
/// The lifetime `'a` covers the source buffers the operation reads, so they can be neither freed
/// nor changed while the request lives (`'static` for flushes and owning sends). What else the
/// operation uses, the request owns a handle on: its endpoint (and through it the worker) and,
/// for a put, the remote key; so those stay open until the request is gone, which makes a
/// request independent of how long the caller keeps the [`Endpoint`] or [`RemoteKey`] values.
/// Like them it is neither `Send` nor `Sync`. Completion is observed with
/// `ucp_request_check_status` while progressing the worker ([`Request::wait`]).
///
/// **Dropping a request that is still in flight cancels it (`ucp_request_cancel`) and then
/// waits, progressing the worker, until UCX reports it finished**, and only then releases it
/// (`ucp_request_free`). So when a drop returns, UCX no longer touches the request's buffers. In
/// UCX 1.13 cancelling affects only receives: a dropped put, flush or send runs to completion
/// (which may need the peer to progress, see the crate docs).
///
/// # Leaking
///
/// The guarantee rests on the destructor running. `std::mem::forget` on an in-flight request
/// (or on a [`crate::PutWindow`] holding some) ends the borrows of the sources without the
/// wait, so that memory could then be freed while UCX still reads it (the endpoint and remote
/// key are not at risk: their handles leak with the request, so they are never closed or
/// destroyed). The type system cannot prevent this (the reason `std::thread::scope` replaced
/// guard-based scoped threads); never leak requests, except through
/// [`crate::PutWindow::abandon`], whose `unsafe` contract says what must stay alive instead.
#[must_use = "dropping a request waits for it; call `wait` to learn its outcome"]
pub struct Request<'a> {
    op: Op,
    state: State,
    /// Buffers an owning send keeps alive; dropped after `Drop::drop` has waited.
    owned: Option<(Vec<u8>, Vec<u8>)>,
    /// The remote key a put uses; released after `Drop::drop` has waited.
    rkey: Option<RemoteKey>,
    /// The endpoint the operation was issued on; released last.
    ep: Endpoint,
    /// The borrowed source buffers.
    _sources: PhantomData<&'a [u8]>,
}

enum State {
    /// A request handle that has not yet been seen complete; owned, freed once.
    Pending(RawRequest),
    /// Finished (completed in place, or seen complete and freed).
    Done(Result<(), Status>),
}

impl<'a> Request<'a> {
    /// Wraps the decoded result of a `*_nbx` call made on `ep` (with `rkey`, for a put).
    pub(crate) fn new(
        ep: Endpoint,
        rkey: Option<RemoteKey>,
        op: Op,
        started: Result<Option<RawRequest>, Status>,
    ) -> Result<Request<'a>, Error> {
        let state = match started.op(op)? {
            Some(raw) => State::Pending(raw),
            None => State::Done(Ok(())),
        };
        Ok(Request {
            op,
            state,
            owned: None,
            rkey,
            ep,
            _sources: PhantomData,
        })
    }

    /// Makes the request own the buffers of an owning send.
    pub(crate) fn keep(mut self, header: Vec<u8>, data: Vec<u8>) -> Request<'a> {
        self.owned = Some((header, data));
        self
    }

    /// Forgets the operation if it is still in flight, without waiting for it: the UCX request
    /// is never released, the remote key it uses is never destroyed and buffers it owns are
    /// leaked, as UCX may go on using all three; its handle on the endpoint is released (the
    /// endpoint's close ends the operation). See [`crate::PutWindow::abandon`] for what the
    /// caller must keep alive instead.
    pub(crate) fn abandon(mut self) {
        if matches!(self.state, State::Pending(_)) {
            if let Some(rkey) = &self.rkey {
                rkey.leak();
            }
            std::mem::forget(self.owned.take());
            // Forgets the `RawRequest` (it has no `Drop`), so `Drop::drop` does not wait.
            self.state = State::Done(Err(Status::CANCELED));
        }
    }

    fn worker(&self) -> &Worker {
        self.ep.worker()
    }

    /// The operation this request tracks.
    pub fn op(&self) -> Op {
        self.op
    }

    /// Whether the operation has finished, successfully or not. Does not progress the worker.
    ///
    /// Wraps `ucp_request_check_status`.
    #[doc(alias = "ucp_request_check_status")]
    pub fn is_done(&mut self) -> bool {
        self.poll().is_some()
    }

    /// Progresses the worker until the operation finishes.
    ///
    /// # Errors
    ///
    /// The operation's own failure, as an [`Error`] naming [`Request::op`].
    ///
    /// # Panics
    ///
    /// Resumes an active-message handler's panic, as [`Worker::progress`] does (the request is
    /// then dropped, which still waits for it).
    pub fn wait(mut self) -> Result<(), Error> {
        loop {
            if let Some(result) = self.poll() {
                return result;
            }
            self.worker().progress_or_nap();
        }
    }

    /// Progresses the worker until the operation finishes or `timeout` passes.
    ///
    /// Returns `Ok(true)` if it finished successfully, `Ok(false)` if it is still in flight.
    ///
    /// # Errors
    ///
    /// The operation's own failure, as for [`Request::wait`] (also on later calls).
    ///
    /// # Panics
    ///
    /// As [`Request::wait`].
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<bool, Error> {
        self.wait_until(Instant::now() + timeout)
    }

    /// Progresses the worker until the operation finishes or `deadline` passes (with
    /// [`crate::Worker::progress_or_nap`]: a long wait yields the thread between polls, then
    /// sleeps on the worker's wake-up descriptor).
    ///
    /// Returns `Ok(true)` if it finished successfully, `Ok(false)` if it is still in flight (it
    /// is checked once more after the deadline, so a deadline in the past still polls). A
    /// request still in flight keeps everything it borrows; see [`crate::PutWindow`] on what
    /// to do with one that will not finish.
    ///
    /// # Errors
    ///
    /// The operation's own failure, as for [`Request::wait`] (also on later calls).
    ///
    /// # Panics
    ///
    /// As [`Request::wait`].
    pub fn wait_until(&mut self, deadline: Instant) -> Result<bool, Error> {
        loop {
            if let Some(result) = self.poll() {
                return result.map(|()| true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            self.worker().progress_or_nap();
        }
    }

    /// Progresses the worker until the operation finishes; `Ok(true)` on success.
    pub(crate) fn wait_until_done(&mut self) -> Result<bool, Error> {
        loop {
            if let Some(result) = self.poll() {
                return result.map(|()| true);
            }
            self.worker().progress_or_nap();
        }
    }

    /// Asks UCX to cancel the operation; it still has to be waited for (or dropped, which
    /// waits). A no-op for finished requests, and in UCX 1.13 for sends, puts and flushes.
    ///
    /// Wraps `ucp_request_cancel`.
    #[doc(alias = "ucp_request_cancel")]
    pub fn cancel(&mut self) {
        if let State::Pending(raw) = &self.state {
            // SAFETY: `raw` is a live request of this worker (kept alive by `self.ep`), which is
            // used on this thread only; cancelling leaves it owned by us, to be freed once
            // complete.
            unsafe { sys::ucp_request_cancel(self.worker().as_raw(), raw.as_ptr()) };
        }
    }

    /// The outcome if finished, releasing the UCX request the first time it is seen finished.
    pub(crate) fn poll(&mut self) -> Option<Result<(), Error>> {
        if let State::Pending(raw) = &self.state {
            // SAFETY: `raw` is a live request of this worker (kept alive by `self.ep`), not yet
            // freed.
            let status = unsafe { sys::ucp_request_check_status(raw.as_ptr()) };
            if status == sys::ucs_status_t::UCS_INPROGRESS {
                return None;
            }
            // SAFETY: the request has completed, so UCX no longer uses the buffers it borrows;
            // it is released exactly once, as `state` leaves `Pending` right after.
            unsafe { sys::ucp_request_free(raw.as_ptr()) };
            self.state = State::Done(check(status));
        }
        match self.state {
            State::Done(result) => Some(result.op(self.op)),
            State::Pending(_) => None,
        }
    }
}

impl Request<'static> {
    /// Forgets the operation if it is still in flight, without waiting for it (see
    /// [`crate::PutWindow::abandon`]): its UCX request is never released, and the buffers it
    /// owns and the remote key it uses are leaked, as UCX may go on using them until the
    /// endpoint is closed or its worker destroyed. Safe for a request that borrows nothing
    /// shorter than `'static`: nothing it may read can be freed.
    pub fn forget(self) {
        self.abandon();
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        if matches!(self.state, State::Pending(_)) {
            self.cancel();
            while self.poll().is_none() {
                self.worker().progress_for_drop();
            }
        }
    }
}

impl fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Pending(_) => "in flight".to_owned(),
            State::Done(Ok(())) => "done".to_owned(),
            State::Done(Err(status)) => format!("failed: {status}"),
        };
        f.debug_struct("Request")
            .field("op", &self.op)
            .field("state", &state)
            .finish_non_exhaustive()
    }
}
