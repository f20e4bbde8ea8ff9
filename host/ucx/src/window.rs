//! Many puts over one endpoint with a bounded number in flight, optionally by a deadline.

use std::collections::VecDeque;
use std::time::Instant;

use crate::{Endpoint, Error, MemRegion, Op, RemoteKey, Request, Status};

/// The default number of puts [`PutWindow`] keeps in flight.
const DEFAULT_CAPACITY: usize = 32;

/// Issues many puts over one [`Endpoint`], keeping at most `capacity` of them in flight.
///
/// When the window is full, [`put`](PutWindow::put) progresses the worker and retires finished
/// puts before issuing the next one (every wait here progresses with
/// [`Worker::progress_or_nap`](crate::Worker::progress_or_nap): a long wait yields, then
/// sleeps on the worker's wake-up descriptor). Bounding the outstanding
/// work matters over `tcp`, where UCX emulates puts with active messages: an unbounded queue
/// made the final flush collapse to about 0.3 GB/s against 1.7 GB/s sustained with a window
/// of 32 (platform-notes §2, §4d).
///
/// The window borrows every source buffer for `'a`, like [`Endpoint::put`], and nothing else:
/// it holds a handle on the endpoint, and each put in flight one on its remote key, so a window
/// may outlive the caller's [`Endpoint`] and [`RemoteKey`] values (they are closed and
/// destroyed once the window no longer needs them). [`finish`](PutWindow::finish) (or
/// [`flush`](PutWindow::flush)) waits and flushes, for remote completion.
///
/// # Deadline
///
/// Without a deadline every wait lasts until UCX finishes, which is for ever if the peer is
/// gone or stopped progressing (every put over `tcp`, and every put into registered memory,
/// needs the target to progress). With one ([`set_deadline`](PutWindow::set_deadline)),
/// [`put`](PutWindow::put), [`put_region`](PutWindow::put_region),
/// [`wait_all`](PutWindow::wait_all) and [`flush`](PutWindow::flush) give up once it has passed
/// and return an [`Error`] with [`Status::TIMED_OUT`] ([`Op::Put`] while waiting for puts,
/// [`Op::Flush`] while waiting for the flush). A put refused this way was not issued, and no
/// new put is issued after the deadline.
///
/// **Giving up does not release anything.** Puts still in flight may be read by UCX at any
/// later progress of the worker, so the window keeps their [`Request`]s, and with them its
/// borrows of the sources and its handles on the remote keys and the endpoint: the caller
/// cannot free or reuse the sources while the window exists, and the keys and endpoint stay
/// open whatever the caller does with its own values. What the caller can do with a window
/// that timed out:
///
/// - **keep it** (the sound default): set a later deadline and call the same method again, or
///   [`poll`](PutWindow::poll) it from a loop that progresses the worker anyway, and drop it
///   once `poll` says it is idle. This is what a long-lived executor does: it parks the
///   window (which owns what it uses but its sources, which outlive the executor) in a
///   quarantine, and may forget the peer meanwhile;
/// - **drop it**: dropping a window with work in flight drops the [`Request`]s, each of which
///   waits, progressing the worker, until UCX is done with it; that is sound but may wait for
///   ever on a dead peer. [`finish`](PutWindow::finish) is [`flush`](PutWindow::flush)
///   followed by such a drop, so a caller that must never hang uses `flush` and keeps the
///   window on error;
/// - **abandon it** ([`abandon`](PutWindow::abandon), `unsafe`): forget the in-flight
///   requests, for code that guarantees by other means that their sources stay valid until
///   the endpoint is closed (for example a thread about to drop every handle on the worker,
///   with the sources kept alive past that).
///
/// There is no safe way to hand the borrowed sources back while UCX may still read them; a
/// window over `'static` (or leaked) sources can be abandoned soundly, which is the "owned
/// sources" variant of the same rule.
///
/// ```compile_fail
/// # use kvferry_ucx::{Endpoint, PutWindow, RemoteKey};
/// # use std::time::{Duration, Instant};
/// fn give_up(ep: &Endpoint, rkey: &RemoteKey) {
///     let src = vec![1u8; 64];
///     let mut window = PutWindow::new(ep);
///     window.set_deadline(Some(Instant::now() + Duration::from_millis(10)));
///     window.put(&src, 0, rkey).unwrap();
///     if window.flush().is_err() {
///         drop(src); // error: `src` is still borrowed by the window's in-flight put
///     }
///     drop(window);
/// }
/// ```
#[derive(Debug)]
pub struct PutWindow<'a> {
    ep: Endpoint,
    capacity: usize,
    in_flight: VecDeque<Request<'a>>,
    /// A flush that was started and not yet seen finished (kept across a timeout).
    flushing: Option<Request<'a>>,
    /// Puts were issued since `flushing` (or the last finished flush) started.
    dirty: bool,
    deadline: Option<Instant>,
    /// A wait gave up at the deadline with work in flight (reported if the window is dropped
    /// with work still in flight).
    timed_out: bool,
}

impl<'a> PutWindow<'a> {
    /// A window of 32 puts over `ep` (it keeps a handle on `ep`).
    pub fn new(ep: &Endpoint) -> PutWindow<'a> {
        PutWindow::with_capacity(ep, DEFAULT_CAPACITY)
    }

    /// A window of `capacity` puts (at least 1) over `ep`.
    pub fn with_capacity(ep: &Endpoint, capacity: usize) -> PutWindow<'a> {
        let capacity = capacity.max(1);
        PutWindow {
            ep: ep.share(),
            capacity,
            in_flight: VecDeque::with_capacity(capacity),
            flushing: None,
            dirty: false,
            deadline: None,
            timed_out: false,
        }
    }

    /// The same window with a deadline (see [Deadline](PutWindow#deadline)).
    #[must_use]
    pub fn with_deadline(mut self, deadline: Instant) -> PutWindow<'a> {
        self.deadline = Some(deadline);
        self
    }

    /// Sets or clears the deadline; later waits use the new one. Puts already in flight are
    /// unaffected.
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    /// The endpoint the window puts over (a handle it keeps), e.g. to ask for its
    /// [`failure`](Endpoint::failure) after an operation failed.
    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    /// The deadline, if any.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The most puts kept in flight.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Puts issued and not yet seen finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether a flush is in flight (one that timed out, kept for the next
    /// [`flush`](PutWindow::flush)).
    pub fn is_flushing(&self) -> bool {
        self.flushing.is_some()
    }

    /// Whether nothing is in flight: no put and no flush.
    pub fn is_idle(&self) -> bool {
        self.in_flight.is_empty() && self.flushing.is_none()
    }

    /// Issues [`Endpoint::put`]`(src, remote_addr, rkey)`, first waiting for room.
    ///
    /// # Errors
    ///
    /// The first failure among earlier puts retired while making room, or this put's own
    /// failure to start, or [`Status::TIMED_OUT`] ([`Op::Put`]) if the deadline passed before
    /// there was room (the put is then not issued). The window stays usable; puts still in
    /// flight are unaffected.
    ///
    /// # Panics
    ///
    /// Resumes an active-message handler's panic, as [`crate::Worker::progress`] does.
    pub fn put(&mut self, src: &'a [u8], remote_addr: u64, rkey: &RemoteKey) -> Result<(), Error> {
        self.make_room()?;
        let request = self.ep.put(src, remote_addr, rkey)?;
        self.track(request)
    }

    /// Issues [`Endpoint::put_region`]`(src, offset, len, remote_addr, rkey)`, first waiting
    /// for room.
    ///
    /// # Errors
    ///
    /// As [`PutWindow::put`].
    ///
    /// # Panics
    ///
    /// As [`PutWindow::put`].
    pub fn put_region(
        &mut self,
        src: &'a MemRegion,
        offset: usize,
        len: usize,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<(), Error> {
        self.make_room()?;
        let request = self.ep.put_region(src, offset, len, remote_addr, rkey)?;
        self.track(request)
    }

    /// Waits until every put has finished locally (its source is reusable).
    ///
    /// # Errors
    ///
    /// The first failure among the retired puts (all finished puts are retired regardless), or
    /// [`Status::TIMED_OUT`] ([`Op::Put`]) if the deadline passed with puts still in flight;
    /// those stay in the window.
    ///
    /// # Panics
    ///
    /// As [`PutWindow::put`].
    pub fn wait_all(&mut self) -> Result<(), Error> {
        let mut result = self.retire();
        while !self.in_flight.is_empty() {
            if self.past_deadline() {
                return result.and(Err(self.timeout(Op::Put)));
            }
            self.ep.worker().progress_or_nap();
            result = result.and(self.retire());
        }
        result
    }

    /// Waits for every put, then flushes the endpoint: when this returns `Ok`, all the
    /// window's puts are visible in the peer's memory. The window stays usable.
    ///
    /// Wraps `ucp_ep_flush_nbx`.
    ///
    /// # Errors
    ///
    /// The first failure among the puts, else the flush's; or [`Status::TIMED_OUT`]
    /// ([`Op::Put`] or [`Op::Flush`]) if the deadline passed first. A flush that timed out
    /// stays in the window; calling `flush` again (with a later deadline) waits for it, and
    /// starts a new one if puts were issued since.
    ///
    /// # Panics
    ///
    /// As [`PutWindow::put`].
    pub fn flush(&mut self) -> Result<(), Error> {
        self.wait_all()?;
        loop {
            let flushing = match &mut self.flushing {
                Some(request) => request,
                None => {
                    let request = self.ep.flush()?;
                    self.dirty = false;
                    self.flushing.insert(request)
                }
            };
            let finished = match self.deadline {
                Some(deadline) => flushing.wait_until(deadline),
                None => flushing.wait_until_done(),
            };
            match finished {
                Ok(true) => {
                    self.flushing = None;
                    if !self.dirty {
                        return Ok(());
                    }
                }
                Ok(false) => return Err(self.timeout(Op::Flush)),
                Err(e) => {
                    self.flushing = None;
                    return Err(e);
                }
            }
        }
    }

    /// [`flush`](PutWindow::flush), then drops the window.
    ///
    /// If the flush fails with work still in flight (with a deadline, a timeout), the drop
    /// waits for that work without a deadline; see [Deadline](PutWindow#deadline) for the
    /// alternatives.
    ///
    /// # Errors
    ///
    /// As [`PutWindow::flush`].
    ///
    /// # Panics
    ///
    /// As [`PutWindow::put`].
    pub fn finish(mut self) -> Result<(), Error> {
        self.flush()
    }

    /// Retires the puts (and the flush) that have finished, without progressing the worker;
    /// returns whether the window is now idle (nothing in flight, so dropping it cannot wait).
    ///
    /// For a window parked after a timeout, polled from a loop that progresses the worker
    /// anyway.
    ///
    /// # Errors
    ///
    /// The first failure among the retired puts or the flush (they are retired regardless).
    pub fn poll(&mut self) -> Result<bool, Error> {
        let mut result = self.retire();
        if let Some(flushing) = &mut self.flushing {
            if let Some(outcome) = flushing.poll() {
                self.flushing = None;
                result = result.and(outcome);
            }
        }
        result.map(|()| self.is_idle())
    }

    /// Whether every put issued through the window is known to be **remotely** complete:
    /// nothing is in flight and a flush finished after the last put.
    ///
    /// A put's own completion is local (its source may be reused); over transports that
    /// emulate RMA (tcp) its bytes may still be on the way. Only a flush that completes after
    /// it proves they landed.
    pub fn is_settled(&self) -> bool {
        self.is_idle() && !self.dirty
    }

    /// Moves a parked window toward [`is_settled`](Self::is_settled) without blocking:
    /// retires what finished and, once no put is in flight and puts were issued since the
    /// last flush, starts a flush. Returns whether the window is settled.
    ///
    /// For a window parked after a timeout whose owner must not report "nothing more will
    /// land" before it is true; polled from a loop that progresses the worker anyway.
    ///
    /// # Errors
    ///
    /// As [`poll`](Self::poll), or the flush's failure to start. A failed flush leaves the
    /// window idle and not settled: the endpoint is broken and delivers nothing more.
    pub fn settle(&mut self) -> Result<bool, Error> {
        // Even after a failed put, flush: puts that completed before it may still be in
        // transit, and only a flush says whether they landed.
        let retired = self.poll();
        if self.is_idle() && self.dirty {
            let request = self.ep.flush()?;
            self.dirty = false;
            self.flushing = Some(request);
            self.poll()?;
        }
        retired?;
        Ok(self.is_settled())
    }

    /// Forgets every put and flush still in flight without waiting for them, and drops the
    /// window.
    ///
    /// The UCX requests are never released (their memory returns to UCX when the worker is
    /// destroyed), and the remote keys the abandoned puts use are never destroyed
    /// (`ucp_rkey_destroy` is skipped when their last handle goes), since UCX may use them for
    /// as long as it knows the requests. Their handles on the endpoint are released as usual:
    /// the endpoint is closed once its last handle goes (here, if this window held it), and
    /// that close ends the abandoned operations: graceful only after a flush that completed
    /// them, otherwise forced, which discards them.
    ///
    /// # Safety
    ///
    /// UCX may go on reading the sources of the abandoned puts at any later progress of the
    /// worker and during the endpoint's close. The caller guarantees that every source buffer
    /// of the abandoned puts stays valid (not freed, not unmapped) and its bytes
    /// unchanged-or-irrelevant until one of: the endpoint has been closed, that is every handle
    /// on it is gone (the [`Endpoint`], the [`RemoteKey`]s unpacked on it, the requests and
    /// windows issued on it; the last one's drop closes it), or the operations are known to
    /// have completed. Sources borrowed for `'static` satisfy this trivially.
    pub unsafe fn abandon(mut self) {
        let requests = std::mem::take(&mut self.in_flight);
        let flushing = self.flushing.take();
        tracing::warn!(
            puts = requests.len(),
            flush = flushing.is_some(),
            "abandoning a put window with operations in flight"
        );
        for request in requests.into_iter().chain(flushing) {
            request.abandon();
        }
        // The window drops here, with its handle on the endpoint.
    }

    /// Whether a deadline is set and has passed.
    fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Records a timeout and returns its error.
    fn timeout(&mut self, op: Op) -> Error {
        self.timed_out = true;
        Error::new(op, Status::TIMED_OUT)
    }

    /// Progresses until fewer than `capacity` puts are in flight; refuses past the deadline.
    fn make_room(&mut self) -> Result<(), Error> {
        let mut result = self.retire();
        if self.past_deadline() {
            return result.and(Err(self.timeout(Op::Put)));
        }
        while self.in_flight.len() >= self.capacity {
            self.ep.worker().progress_or_nap();
            result = result.and(self.retire());
            if self.in_flight.len() >= self.capacity && self.past_deadline() {
                return result.and(Err(self.timeout(Op::Put)));
            }
        }
        result
    }

    /// Drops every finished put; returns the first failure among them.
    fn retire(&mut self) -> Result<(), Error> {
        let mut result = Ok(());
        self.in_flight.retain_mut(|request| match request.poll() {
            None => true,
            Some(outcome) => {
                result = result.and(outcome);
                false
            }
        });
        result
    }

    fn track(&mut self, mut request: Request<'a>) -> Result<(), Error> {
        self.dirty = true;
        match request.poll() {
            Some(outcome) => outcome,
            None => {
                self.in_flight.push_back(request);
                Ok(())
            }
        }
    }
}

impl Drop for PutWindow<'_> {
    fn drop(&mut self) {
        if self.timed_out && !self.is_idle() {
            tracing::warn!(
                puts = self.in_flight.len(),
                flush = self.flushing.is_some(),
                "dropping a put window that timed out with operations in flight: waiting for \
                 them without a deadline"
            );
        }
        // The fields drop next: each in-flight request waits for UCX to finish with it.
    }
}
