//! The rank thread's body: its loop, and the executor that runs its commands — connections,
//! the jobs' puts and copies, and what [`ExecMachine`] decides about the windows a failed job
//! left in flight.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use kvferry_platform::{EventFd, wait_any_readable};
use kvferry_protocol::exec::{
    Action as ExecAction, Admit, ExecConfig, ExecMachine, JobEnd, Look, Target, WindowId,
};
use kvferry_ucx::{
    Endpoint, ErrorMode, PeerProcess, PutWindow, RemoteKey, Request, Status, Worker,
};

use super::error::{gone, peer_failed};
use super::keys::{check_key_range, in_own_segment, own_files, refuse_own_file};
use super::thread::{Activity, Command};
use super::{
    FALLBACK_SLEEP, FORGET_CLOSE_TIMEOUT, Forgotten, IDLE_SLEEP, PUT_WINDOW, PeerId, RemoteRank,
    SPIN_ROUNDS, WriteError, WriteJob, WriteStats,
};
use crate::bounce::{Gatherer, Staging};
use crate::memory::RankPools;
use crate::streaming::CopyHelper;
use write::Waiter;

#[cfg(feature = "harness")]
mod replay;
mod write;

pub(super) fn run(
    rank: u32,
    worker: Worker,
    (errors, config): (ErrorMode, ExecConfig),
    pools: &RankPools,
    staging: Option<(&Staging, Gatherer)>,
    (rx, wake): (Receiver<Command>, &EventFd),
    activity: &Activity,
) {
    // Every event of this thread carries its rank.
    let _span = tracing::info_span!("rank", rank).entered();
    // Its `Drop` abandons what is still quarantined, then its connections close their
    // endpoints; the UCX worker goes with the last handle on it.
    let mut exec = Executor {
        rank,
        worker,
        errors,
        pools,
        staging,
        conns: HashMap::new(),
        machine: ExecMachine::new(config),
        parked: HashMap::new(),
        next_window: 0,
        challenges: Vec::new(),
        own_files: std::cell::OnceCell::new(),
        copier: std::cell::OnceCell::new(),
    };
    let mut idle = 0u32;
    loop {
        let command = match rx.try_recv() {
            Ok(c) => Some(c),
            Err(TryRecvError::Disconnected) => return,
            Err(TryRecvError::Empty) => {
                if exec.worker.progress_or_yield() {
                    activity.busy.store(activity.now(), Ordering::Release);
                    exec.poll_stuck();
                    idle = 0;
                    continue;
                }
                idle = idle.saturating_add(1);
                if idle < SPIN_ROUNDS {
                    continue;
                }
                let now = activity.now();
                // A run of idle rounds: quiet as of now, whether it sleeps or stays awake.
                activity.idle.store(now, Ordering::Release);
                exec.poll_stuck();
                if now < activity.awake_until.load(Ordering::Acquire) {
                    continue;
                }
                match exec.sleep(&rx, wake, activity) {
                    Ok(c) => c,
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
        };
        let Some(command) = command else { continue };
        idle = 0;
        match command {
            Command::Forget(peer, then) => {
                exec.forget(peer);
                if let Some(then) = then {
                    exec.once_released(peer, then);
                }
            }
            Command::Vet(dest, challenge, reply) => {
                let result = exec
                    .connect(&dest)
                    .map(|_| ())
                    .and_then(|()| match challenge {
                        Some(payload) => exec.challenge(&dest, payload),
                        None => Ok(()),
                    });
                if let Err(e) = &result {
                    tracing::warn!(
                        peer = %dest.instance,
                        peer_rank = dest.rank,
                        error = %kvferry_plan::error_chain(&e),
                        "peer rank refused"
                    );
                }
                reply.send(result);
            }
            Command::Write(job) => exec.execute(job),
            #[cfg(feature = "harness")]
            Command::Replay(mut job) => {
                let result = exec.replay(&mut job);
                if let Err(e) = &result {
                    tracing::warn!(error = %kvferry_plan::error_chain(&e), "replay failed");
                }
                (job.done)(result);
            }
        }
    }
}

/// The remote keys of one peer rank's pools, unpacked on its endpoint, in pool order; shared
/// with the jobs that use them (each put in flight holds its own handle on its key).
type Keys = Rc<[RemoteKey]>;

/// Where each of a peer rank's pools lies in this process when its key maps it into a shared
/// host mapping here (the shared-memory transports): the local address of the pool's declared
/// base, valid for the whole declared range while the pool's key lives
/// ([`RemoteKey::check_range`] found the range contiguous inside one shared, writable mapping).
/// `None` for a pool only UCX's puts reach (tcp, device memory). In pool order, like [`Keys`].
type Mapped = Rc<[Option<NonNull<u8>>]>;

/// An endpoint to a peer rank and the keys of its pools, owned by the connection cache. When
/// it is dropped (the peer forgotten), a quarantined window with puts to the peer still holds
/// the endpoint and the keys those puts use, so the endpoint closes once the window drains.
struct Conn {
    ep: Endpoint,
    keys: Keys,
    mapped: Mapped,
}

/// A job's outcome, and the window it left in flight, if any.
type Written<'a> = (Result<WriteStats, WriteError>, Option<PutWindow<'a>>);

/// A window that gave up with operations in flight, parked until the executor's machine
/// releases it or the worker is replaced. It holds the endpoint and the remote keys those use,
/// and borrows their sources from the pools.
struct Parked<'a> {
    /// Dropped only once settled (or its endpoint broken), or abandoned with the worker.
    window: PutWindow<'a>,
    instance: String,
    rank: u32,
    since: Instant,
    /// The peer's registration flag ([`RemoteRank::alive`]).
    alive: Arc<AtomicBool>,
}

/// What the executor's machine runs when its rules say: a job's report, or a forgotten
/// peer's follow-up.
type Then = Box<dyn FnOnce()>;

/// A rank thread's executor state. `'a` is the life of the worker value and of the pools,
/// which puts borrow their sources from.
struct Executor<'a> {
    rank: u32,
    /// Replaced when stuck puts without peer error mode must be cut
    /// ([`replace_worker`](Self::replace_worker)).
    worker: Worker,
    /// The mode new endpoints are created in (falling back to `None` where UCX refuses it).
    errors: ErrorMode,
    pools: &'a RankPools,
    /// The staging buffer and its gather thread, if the rank bounces.
    staging: Option<(&'a Staging, Gatherer)>,
    conns: HashMap<(PeerId, u32), Conn>,
    /// The decisions: which jobs write, when parked windows are released or cut, in which
    /// order jobs report (see [`kvferry_protocol::exec`]).
    machine: ExecMachine<Then>,
    /// Quarantined windows (see the module docs), by the machine's number; never dropped
    /// while not idle.
    parked: HashMap<WindowId, Parked<'a>>,
    /// The number of the next parked window.
    next_window: WindowId,
    /// Worker challenges still being sent (each owns its payload).
    challenges: Vec<Request<'static>>,
    /// The shared files this rank's own pools and staging buffer are mappings of (a peer's
    /// key that maps one of them is refused), read once.
    own_files: std::cell::OnceCell<Vec<(String, u64)>>,
    /// The thread that copies half of a large job's direct copies
    /// ([`SHARE_MIN_JOB_BYTES`]), started with the first such job (`None` inside if it could
    /// not start: this thread copies alone).
    copier: std::cell::OnceCell<Option<CopyHelper>>,
}

impl<'a> Executor<'a> {
    /// The cached connection to `dest`, or a new one, once every pool's declared range has
    /// passed [`check_key_range`]. A cached endpoint that UCX reported failed is dropped and
    /// replaced (a job finds out first, in [`window`](Self::window)).
    fn connect(&mut self, dest: &RemoteRank) -> Result<&Conn, WriteError> {
        let key = (dest.peer, dest.rank);
        if self
            .conns
            .get(&key)
            .is_some_and(|c| c.ep.failure().is_some())
        {
            self.drop_conn(key);
        }
        let errors = self.errors;
        let worker = &self.worker;
        let slot = match self.conns.entry(key) {
            Entry::Occupied(e) => return Ok(e.into_mut()),
            Entry::Vacant(slot) => slot,
        };
        // Whose memory the peer's keys may name: the process its worker address names
        // (checked before UCX maps anything the address or a key names).
        let owner_refused = |pool, reason: String| WriteError::KeyOwner {
            instance: dest.instance.clone(),
            rank: dest.rank,
            pool,
            reason,
        };
        let peer = PeerProcess::of_address(&dest.worker_address)
            .map_err(|e| owner_refused(None, e.to_string()))?;
        for (pool, k) in dest.pools.iter().chain(dest.bounce.iter()).enumerate() {
            // A malformed key is refused by name where it is unpacked, below.
            let layout = kvferry_ucx::KeyLayout::loaded();
            if kvferry_ucx::rkey_format::check_packed_rkey(&k.rkey, layout).is_ok() {
                peer.check_key(&k.rkey)
                    .map_err(|e| owner_refused(Some(pool), e.to_string()))?;
            }
        }
        let (pools, staging) = (self.pools, self.staging.as_ref().map(|(s, _)| *s));
        let own_files = self.own_files.get_or_init(|| own_files(pools, staging));
        let connect = |mode| worker.connect_with(&dest.worker_address, mode);
        let ep = match connect(errors) {
            Err(e) if errors != ErrorMode::None => {
                tracing::warn!(
                    peer = %dest.instance,
                    peer_rank = dest.rank,
                    mode = ?errors,
                    status = %e.status(),
                    "ucx refuses an endpoint with peer error handling; connecting without it"
                );
                connect(ErrorMode::None)
            }
            other => other,
        }
        .map_err(|source| WriteError::Connect {
            instance: dest.instance.clone(),
            rank: dest.rank,
            source,
        })?;
        // The bounce arena's key comes last, after the pools' (its index: the pool count).
        let (keys, mapped): (Vec<_>, Vec<_>) = dest
            .pools
            .iter()
            .chain(dest.bounce.iter())
            .enumerate()
            .map(|(pool, k)| {
                let key = ep
                    .unpack_rkey(&k.rkey)
                    .map_err(|source| WriteError::UnpackKey {
                        instance: dest.instance.clone(),
                        rank: dest.rank,
                        pool,
                        source,
                    })?;
                let local = check_key_range(dest, pool, k, &key)?;
                if let Some(at) = local {
                    refuse_own_file(own_files, at)
                        .and_then(|()| in_own_segment(&peer, &k.rkey, &key, at))
                        .map_err(|reason| owner_refused(Some(pool), reason))?;
                }
                Ok((key, local))
            })
            .collect::<Result<Vec<_>, WriteError>>()?
            .into_iter()
            .unzip();
        tracing::debug!(
            peer = %dest.instance,
            peer_rank = dest.rank,
            mapped = mapped.iter().filter(|m| m.is_some()).count(),
            "connected"
        );
        Ok(slot.insert(Conn {
            ep,
            keys: Rc::from(keys),
            mapped: Rc::from(mapped),
        }))
    }

    /// A window of [`PUT_WINDOW`] puts to `dest` (connecting first if need be), and the keys
    /// of its pools.
    ///
    /// A cached endpoint that UCX reported failed fails the job
    /// ([`WriteError::PeerFailed`]) and is dropped, so the next job connects afresh.
    fn window(&mut self, dest: &RemoteRank) -> Result<(PutWindow<'a>, Keys, Mapped), WriteError> {
        let key = (dest.peer, dest.rank);
        if let Some(status) = self.conns.get(&key).and_then(|c| c.ep.failure()) {
            self.drop_conn(key);
            return Err(peer_failed(dest, status, None));
        }
        let conn = self.connect(dest)?;
        let window = PutWindow::with_capacity(&conn.ep, PUT_WINDOW);
        Ok((window, Rc::clone(&conn.keys), Rc::clone(&conn.mapped)))
    }

    /// Drops the connections to `peer` (see [`RankThread::forget`]).
    fn forget(&mut self, peer: PeerId) {
        let ranks: Vec<(PeerId, u32)> = self
            .conns
            .keys()
            .filter(|(p, _)| *p == peer)
            .copied()
            .collect();
        for key in ranks {
            self.drop_conn(key);
        }
    }

    /// Drops the connection to `key` from the cache and closes its endpoint, or leaves it to
    /// close once the quarantined windows that hold it have drained.
    fn drop_conn(&mut self, key: (PeerId, u32)) {
        let (peer, peer_rank) = key;
        let Some(Conn { ep, keys, mapped }) = self.conns.remove(&key) else {
            return;
        };
        // The keys first: while they exist they keep the endpoint open (and the local
        // addresses of their mappings mean nothing without them).
        drop(mapped);
        drop(keys);
        match ep.close(FORGET_CLOSE_TIMEOUT) {
            Ok(()) => tracing::debug!(peer, peer_rank, "endpoint closed"),
            Err(e) if e.status() == Status::BUSY => tracing::debug!(
                peer,
                peer_rank,
                "endpoint closes once its quarantined puts have drained"
            ),
            Err(e) => tracing::debug!(
                peer,
                peer_rank,
                error = %e,
                status = %e.status(),
                "endpoint closed uncleanly"
            ),
        }
    }

    /// Releases quarantined windows whose operations have all finished.
    /// Sends `payload` to `dest`'s worker as a worker challenge, on the connection
    /// [`connect`](Self::connect) made; the send is kept until it completes.
    fn challenge(&mut self, dest: &RemoteRank, payload: Vec<u8>) -> Result<(), WriteError> {
        let Some(conn) = self.conns.get(&(dest.peer, dest.rank)) else {
            return Err(WriteError::Stopped { rank: self.rank });
        };
        let mut send = conn
            .ep
            .am_send_owned(
                kvferry_protocol::agent::WORKER_CHALLENGE_AM,
                Vec::new(),
                payload,
            )
            .map_err(|source| WriteError::Connect {
                instance: dest.instance.clone(),
                rank: dest.rank,
                source,
            })?;
        if !send.is_done() {
            self.challenges.push(send);
        }
        Ok(())
    }

    /// The idle loop's sleep, once a run of progress rounds found nothing: arms the worker
    /// and sleeps until it or the command eventfd `wake` is readable (at most [`IDLE_SLEEP`],
    /// or until the machine next looks at a quarantined window). A command already queued is
    /// returned without sleeping. A worker with events still to progress, or one whose
    /// transports cannot signal them, gets the short timed wait for a command instead.
    fn sleep(
        &mut self,
        rx: &Receiver<Command>,
        wake: &EventFd,
        activity: &Activity,
    ) -> Result<Option<Command>, RecvTimeoutError> {
        let armed = self
            .worker
            .event_fd()
            .and_then(|efd| Ok((efd, self.worker.arm()?)));
        let efd = match armed {
            Ok((efd, true)) => efd,
            Ok((_, false)) => return rx.recv_timeout(FALLBACK_SLEEP).map(Some),
            Err(e) => {
                tracing::debug!(error = %e, "no UCX wake-up descriptor; polling for commands");
                return rx.recv_timeout(FALLBACK_SLEEP).map(Some);
            }
        };
        // Cleared before the channel is looked at: a command sent after this look signals
        // the descriptor again, so the poll below cannot miss it.
        wake.clear();
        match rx.try_recv() {
            Ok(c) => return Ok(Some(c)),
            Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
            Err(TryRecvError::Empty) => {}
        }
        // Parked windows are looked at again when the machine asks.
        let timeout = self.machine.poll_timeout().map_or(IDLE_SLEEP, |at| {
            at.saturating_duration_since(Instant::now()).min(IDLE_SLEEP)
        });
        activity.efd.store(efd, Ordering::Release);
        activity.asleep.store(true, Ordering::SeqCst);
        // `keep_awake` stores its deadline, then reads `asleep` (both sequentially
        // consistent): either it sees this thread asleep and signals `wake`, or this load
        // sees its deadline and the thread does not sleep.
        if activity.now() < activity.awake_until.load(Ordering::SeqCst) {
            activity.asleep.store(false, Ordering::Release);
            return Ok(None);
        }
        let woke = wait_any_readable(&[wake.as_raw_fd(), efd], timeout);
        activity.asleep.store(false, Ordering::Release);
        if let Err(e) = woke {
            tracing::debug!(error = %e, "poll on the wake-up descriptors failed");
            return rx.recv_timeout(FALLBACK_SLEEP).map(Some);
        }
        Ok(None)
    }

    /// Looks at every parked window (has it settled, how much is in flight, is its receiver
    /// still registered) and carries out what the machine decides.
    fn poll_stuck(&mut self) {
        self.challenges.retain_mut(|send| !send.is_done());
        if !self.machine.is_quarantining() {
            return;
        }
        let now = Instant::now();
        for (&id, p) in &mut self.parked {
            // Settled, not merely idle: a put completes locally, and over tcp its bytes may
            // still be on the way; reporting the failure before a flush proves they landed
            // would let the receiver reuse slots those bytes are about to overwrite. A failed
            // flush means the endpoint is broken and delivers nothing more.
            let settled = match p.window.settle() {
                Ok(settled) => settled,
                Err(e) => {
                    tracing::debug!(peer = %p.instance, peer_rank = p.rank, error = %e, "quarantined operation failed");
                    p.window.is_idle()
                }
            };
            let look = Look {
                in_flight: p.window.in_flight() + usize::from(p.window.is_flushing()),
                settled,
                alive: p.alive.load(Ordering::Acquire),
            };
            self.machine.handle_look(now, id, look);
        }
        self.machine.handle_tick(now);
        self.drive();
    }

    /// Carries out what the machine asked, in order.
    fn drive(&mut self) {
        while let Some(action) = self.machine.poll_action() {
            match action {
                ExecAction::Run(then) => then(),
                ExecAction::Release { window } => {
                    if let Some(p) = self.parked.remove(&window) {
                        tracing::info!(
                            peer = %p.instance,
                            peer_rank = p.rank,
                            after_ms = p.since.elapsed().as_millis(),
                            "quarantined operations finished; released"
                        );
                    }
                }
                ExecAction::EndRegistration { window } => {
                    if let Some(p) = self.parked.get(&window) {
                        p.alive.store(false, Ordering::Release);
                    }
                }
                ExecAction::ForceClose {
                    window,
                    target,
                    reason,
                } => {
                    let Some(p) = self.parked.get(&window) else {
                        continue;
                    };
                    tracing::warn!(
                        peer = %p.instance,
                        peer_rank = p.rank,
                        in_flight = p.window.in_flight(),
                        quarantined_ms = p.since.elapsed().as_millis(),
                        reason = %reason,
                        "closing the endpoint of a quarantined window by force"
                    );
                    if let Err(e) = p.window.endpoint().force_close() {
                        tracing::warn!(
                            peer = %p.instance,
                            peer_rank = p.rank,
                            error = %e,
                            "forced endpoint close failed"
                        );
                    }
                    // Connect afresh next time: the cached endpoint may be the one closed.
                    self.drop_conn((target.peer, target.rank));
                }
                ExecAction::CutDue { window, reason } => {
                    if let Some(p) = self.parked.get(&window) {
                        tracing::warn!(
                            peer = %p.instance,
                            peer_rank = p.rank,
                            in_flight = p.window.in_flight(),
                            quarantined_ms = p.since.elapsed().as_millis(),
                            reason = %reason,
                            "a quarantined window cannot be closed by force without peer error \
                             mode: the worker is replaced once every quarantined window's peer \
                             is gone"
                        );
                    }
                }
                ExecAction::ReplaceWorker { windows } => {
                    let replaced = self.replace_worker(&windows);
                    self.machine.handle_replaced(replaced);
                }
            }
        }
    }

    /// Runs `then` once no quarantined window of `peer` is left: at once, or when the last of
    /// them is released or cut.
    fn once_released(&mut self, peer: PeerId, then: Forgotten) {
        self.machine.forget_then(peer, then);
        self.drive();
    }

    /// Cuts the quarantined `windows` (every parked one) by replacing the worker, for windows
    /// whose endpoints cannot be closed by force (no peer error mode) and whose peers are all
    /// gone: every endpoint of the old worker is left to it ([`Endpoint::leave_to_worker`]),
    /// the windows and worker challenges abandoned, the connection cache emptied (live peers
    /// are connected afresh by their next job), and the old worker destroyed, which closes its
    /// connections and ends what was in flight. Returns whether it did; the machine then
    /// reports the quarantined jobs, in order. Receivers never dial a sender's worker, so its
    /// new address matters to no one.
    fn replace_worker(&mut self, windows: &[WindowId]) -> bool {
        let fresh = match Worker::new(self.worker.context()) {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot make a new worker: quarantined puts stay");
                return false;
            }
        };
        for conn in self.conns.values() {
            let _ = conn.ep.leave_to_worker();
        }
        let parked: Vec<Parked<'a>> = windows
            .iter()
            .filter_map(|id| self.parked.remove(id))
            .collect();
        for p in &parked {
            let _ = p.window.endpoint().leave_to_worker();
        }
        self.conns.clear();
        for send in self.challenges.drain(..) {
            send.forget();
        }
        let old = std::mem::replace(&mut self.worker, fresh);
        for p in parked {
            tracing::warn!(
                peer = %p.instance,
                peer_rank = p.rank,
                puts = p.window.in_flight(),
                quarantined_ms = p.since.elapsed().as_millis(),
                "cutting quarantined puts: replacing this rank's worker"
            );
            // SAFETY: the abandoned puts read this rank's pools or its staging buffer, which
            // outlive this thread. The worker they were issued on is destroyed just below,
            // before this thread does anything else: its last handles are this window's
            // (released by `abandon`), the cached connections' (dropped above; every endpoint
            // left to the worker, so none is closed on its own) and `old`. Its destruction
            // destroys the endpoints and ends the operations.
            unsafe { p.window.abandon() };
        }
        drop(old);
        true
    }

    /// Looks at the parked windows, then asks the machine whether a job to `dest` writes:
    /// `Ok(false)` when it has nothing to write, an error when it may not.
    fn admit(&mut self, dest: &RemoteRank, empty: bool) -> Result<bool, WriteError> {
        self.poll_stuck();
        let alive = dest.alive.load(Ordering::Acquire);
        match self.machine.admit(target_of(dest), alive, empty) {
            Admit::Gone => Err(gone(dest)),
            Admit::Nothing => Ok(false),
            Admit::Behind { in_flight, since } => Err(WriteError::Stuck {
                instance: dest.instance.clone(),
                rank: dest.rank,
                in_flight,
                stuck_ms: since.elapsed().as_millis(),
            }),
            Admit::Write => Ok(true),
        }
    }

    /// Parks `window`, which has operations in flight, in the quarantine, and tells the
    /// machine; `report` runs once they have all finished (or were cut).
    fn quarantine(
        &mut self,
        window: PutWindow<'a>,
        dest: &RemoteRank,
        bounced: bool,
        report: Then,
    ) {
        tracing::warn!(
            peer = %dest.instance,
            peer_rank = dest.rank,
            puts = window.in_flight(),
            "quarantining a window with operations in flight"
        );
        let (id, now) = (self.next_window, Instant::now());
        self.next_window += 1;
        let end = JobEnd::Left {
            window: id,
            in_flight: window.in_flight() + usize::from(window.is_flushing()),
            bounced,
            forcible: window.endpoint().error_mode() == ErrorMode::Peer,
        };
        self.parked.insert(
            id,
            Parked {
                window,
                instance: dest.instance.clone(),
                rank: dest.rank,
                since: now,
                alive: Arc::clone(&dest.alive),
            },
        );
        self.machine.handle_job(now, target_of(dest), end, report);
        self.drive();
    }

    /// Runs one job and reports it: release (its sources are free) then done, at once; or,
    /// when it gave up with puts in flight, quarantines them and reports only once they have
    /// drained, so the receiver hears of the failure only when no more of its bytes can land.
    fn execute(&mut self, mut job: WriteJob) {
        let _span = tracing::debug_span!(
            "write",
            request = job.request,
            peer = %job.dest.instance,
            peer_rank = job.dest.rank
        )
        .entered();
        let release = job.release.take();
        let (result, stuck) = self.write(&job);
        if matches!(result, Err(WriteError::PeerFailed { .. })) {
            // Connect afresh next time; a window quarantined on it keeps the endpoint until
            // UCX has failed its operations too.
            self.drop_conn((job.dest.peer, job.dest.rank));
        }
        let behind = matches!(result, Err(WriteError::Stuck { .. }));
        if let Err(e) = &result {
            let reported = if stuck.is_some() || behind {
                "once the quarantine drains"
            } else {
                "now"
            };
            tracing::warn!(error = %kvferry_plan::error_chain(&e), reported, "write job failed");
        }
        let done = job.done;
        let report: Then = Box::new(move || {
            if let Some(release) = release {
                release();
            }
            done(result);
        });
        match stuck {
            Some(window) => {
                let bounced = job.bounce.is_some();
                self.quarantine(window, &job.dest, bounced, report);
            }
            // Refused behind a quarantined window (or nothing written while one is parked):
            // reported after it, so the receiver does not hear of this piece's end while an
            // earlier piece's bytes may still land.
            None => {
                self.machine
                    .handle_job(Instant::now(), target_of(&job.dest), JobEnd::Done, report);
                self.drive();
            }
        }
    }

    /// Writes one job's plan and flushes. Returns the outcome and, if it gave up with
    /// operations in flight, their window (which holds the endpoint and keys they use).
    fn write(&mut self, job: &WriteJob) -> Written<'a> {
        let taken = Instant::now();
        let (window, keys, mapped) = match self.prepare(job) {
            Ok(Some(conn)) => conn,
            Ok(None) => return (Ok(WriteStats::default()), None),
            Err(e) => return (Err(e), None),
        };
        let dest = &*job.dest;
        let started = Instant::now();
        let deadline = started + job.timeout;
        let alive_check = self.machine.config().alive_check;
        let mut window = window.with_deadline(deadline.min(started + alive_check));
        let mut waiter = Waiter {
            dest,
            started,
            deadline,
            alive_check,
        };
        let result = self
            .write_plan(&mut window, &mut waiter, &keys, &mapped, job)
            .map(|mut stats| {
                stats.busy_ns = nanos(taken.elapsed());
                stats
            });
        if result.is_err() && !window.is_idle() {
            let hopeless = matches!(
                result,
                Err(WriteError::TimedOut { .. }
                    | WriteError::PeerGone { .. }
                    | WriteError::PeerFailed { .. })
            );
            if !hopeless {
                // A local refusal mid-plan: let what was issued finish, within the deadline.
                let _ = waiter.wait(&mut window, PutWindow::flush);
            }
        }
        if window.is_idle() {
            drop(window);
            (result, None)
        } else {
            (result, Some(window))
        }
    }

    /// The window and keys a job writes with, `None` for an empty plan (nothing to write, so
    /// nothing to flush: earlier pieces were flushed before their own completions).
    #[allow(clippy::type_complexity)]
    fn prepare(
        &mut self,
        job: &WriteJob,
    ) -> Result<Option<(PutWindow<'a>, Keys, Mapped)>, WriteError> {
        let dest = &*job.dest;
        if self.admit(dest, job.plan.is_empty())? {
            self.window(dest).map(Some)
        } else {
            Ok(None)
        }
    }
}

impl Drop for Executor<'_> {
    fn drop(&mut self) {
        for mut send in self.challenges.drain(..) {
            if !send.is_done() {
                // A challenge to a worker that never took it: forgotten rather than waited
                // for (its drop would wait for the peer). Sound: the request owns its
                // payload and holds its endpoint, both leaked with it, so nothing UCX may
                // still read is freed.
                std::mem::forget(send);
            }
        }
        for (_, parked) in self.parked.drain() {
            let Parked {
                mut window,
                instance,
                rank,
                ..
            } = parked;
            let _ = window.poll();
            if window.is_idle() {
                drop(window);
                continue;
            }
            tracing::warn!(
                peer = %instance,
                peer_rank = rank,
                puts = window.in_flight(),
                "rank thread ending with quarantined puts in flight: abandoning them"
            );
            // SAFETY: the abandoned puts read this rank's pools, which the thread's closure
            // keeps alive until after `run` has returned. By then every handle on their
            // endpoint is gone: `abandon` releases the window's, the connection cache's go when
            // the executor's fields drop right after this, and no other window on it is left
            // (each was abandoned or dropped idle here). So the endpoint has been closed, which
            // ends the operations (gracefully only after a flush that completed them, else by
            // force), and the worker destroyed, before the pools go.
            unsafe { window.abandon() };
        }
    }
}

/// `d` in whole nanoseconds (saturating: 584 years).
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The machine's name for a receiver rank.
fn target_of(dest: &RemoteRank) -> Target {
    Target {
        peer: dest.peer,
        rank: dest.rank,
    }
}
