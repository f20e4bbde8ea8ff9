#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
// The exported names are the C names (`kvferry_agent`, `kvferry_status::KVFERRY_OK`), so the
// header and the Rust items read the same.
#![allow(non_camel_case_types)]

mod error;

use std::collections::VecDeque;
use std::ffi::{CStr, c_char, c_int};
use std::sync::Mutex;

use kvferry::abi::{SlotTable, TokenRange, ViewId};
use kvferry::agent::{
    Agent, Event, Expect, FAILURE_KINDS, FailureKind, LATENCY_BUCKETS, SendChunk,
};
use kvferry::{config, init_logging, planning};

pub use error::kvferry_status;

use error::{Failure, guard};
use kvferry_status::*;

/// The configuration version `kvferry_agent_start` reads (`"version": 1`).
pub const KVFERRY_CONFIG_VERSION: u32 = 1;
const _: () = assert!(KVFERRY_CONFIG_VERSION == kvferry::CONFIG_VERSION);

/// Bytes of `kvferry_event::peer`, its terminating NUL included.
pub const KVFERRY_EVENT_PEER_LEN: usize = 128;

/// Bytes of `kvferry_event::detail`, its terminating NUL included.
pub const KVFERRY_EVENT_DETAIL_LEN: usize = 512;

/// `kvferry_event::flags`: `peer` was cut to fit (at a UTF-8 character boundary).
pub const KVFERRY_EVENT_PEER_TRUNCATED: u32 = 1;

/// `kvferry_event::flags`: `detail` was cut to fit (at a UTF-8 character boundary).
pub const KVFERRY_EVENT_DETAIL_TRUNCATED: u32 = 2;

/// One rank's transfer agent: an opaque handle from `kvferry_agent_start`, freed by
/// `kvferry_agent_destroy`.
pub struct kvferry_agent {
    agent: Agent,
    /// Events drained from the agent that did not fit the caller's array yet.
    pending: Mutex<VecDeque<Event>>,
}

// The docs promise C callers that one handle may be used from any thread at once.
const _: () = {
    const fn shared_across_threads<T: std::marker::Send + Sync>() {}
    shared_across_threads::<kvferry_agent>();
};

impl std::fmt::Debug for kvferry_agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("kvferry_agent")
            .field("agent", &self.agent)
            .finish_non_exhaustive()
    }
}

/// A request's slots in one layer group, by block ordinal: `slots[o]` holds tokens
/// `[o × tokens_per_block, (o + 1) × tokens_per_block)`, or is -1 where this side holds nothing
/// (outside a window, not allocated, or — decode side — cached). A STATE group's table is one
/// slot, or empty. `slots` may be NULL when `len` is 0; it is read during the call only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvferry_slot_table {
    /// Slot ids, `len` of them.
    pub slots: *const i32,
    /// Entries in `slots`.
    pub len: usize,
}

/// A (layer group, view) pair by index into this rank's page table.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct kvferry_view_id {
    /// Index into the page table's `groups`.
    pub group: u32,
    /// Index into that group's `views`.
    pub view: u32,
}

/// What an event says happened. New kinds may be added; skip kinds you do not know.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvferry_event_kind {
    /// An event this version of the C API does not know (`detail` describes it).
    KVFERRY_EVENT_UNKNOWN = 0,
    /// Prefill side: every receiver has the request's bytes; its source slots are the
    /// engine's again. `bytes`: written to all receivers.
    KVFERRY_EVENT_SENT = 1,
    /// Decode side: every expected writer's last piece landed. `bytes`, `fragments`,
    /// `writers`, `pieces`, `latency_us` describe the transfer.
    KVFERRY_EVENT_RECEIVED = 2,
    /// The engine's cancel took effect: no write reads or lands in the slots any more.
    KVFERRY_EVENT_CANCELLED = 3,
    /// It failed (`failure`, `peer`, `detail`); no write reads or lands in its slots any more.
    KVFERRY_EVENT_FAILED = 4,
}

/// Why a request failed (`KVFERRY_EVENT_FAILED`). New kinds may be added.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvferry_failure_kind {
    /// Not a failure (every other event kind).
    KVFERRY_FAILURE_NONE = 0,
    /// The request's own parameters are wrong (slots outside the pool, a token range outside
    /// the prompt, a chunk out of order).
    KVFERRY_FAILURE_INVALID = 1,
    /// A peer is unreachable, or its connection ended or went silent.
    KVFERRY_FAILURE_PEER = 2,
    /// A peer was refused (secret, planner, `check_peer`), or it refused this rank.
    KVFERRY_FAILURE_REFUSED = 3,
    /// The planner failed or did not return within its deadline.
    KVFERRY_FAILURE_PLANNER = 4,
    /// Not every writer reported in time.
    KVFERRY_FAILURE_TIMEOUT = 5,
    /// A `send` nobody claimed within the lease.
    KVFERRY_FAILURE_LEASE = 6,
    /// A peer broke the protocol (completions out of order, byte counts that disagree).
    KVFERRY_FAILURE_PROTOCOL = 7,
    /// Writing failed (UCX, a key that does not cover its pool, a quarantined peer).
    KVFERRY_FAILURE_WRITE = 8,
    /// The peer cancelled it.
    KVFERRY_FAILURE_CANCELLED_BY_PEER = 9,
    /// A piece's bytes in this rank's slots do not match its writer's digest (`integrity`).
    KVFERRY_FAILURE_INTEGRITY = 10,
    /// A kind this version of the C API does not know (`detail` has the text).
    KVFERRY_FAILURE_OTHER = 255,
}

/// One event, flat: every field is plain data, text is copied into the event itself (so an
/// event needs nothing freed and stays valid as long as the caller's array does). Fields a
/// kind does not use are 0 (text: empty).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvferry_event {
    /// What happened.
    pub kind: kvferry_event_kind,
    /// Why it failed (`KVFERRY_FAILURE_NONE` unless `kind` is `KVFERRY_EVENT_FAILED`).
    pub failure: kvferry_failure_kind,
    /// The request the event is about.
    pub request: u64,
    /// `SENT`: bytes written to all receivers; `RECEIVED`: bytes written into this rank.
    pub bytes: u64,
    /// `RECEIVED`: fragments written.
    pub fragments: u64,
    /// `RECEIVED`: from the first request description sent to the last completion, in µs.
    pub latency_us: u64,
    /// `RECEIVED`: (writer, this rank) pairs that reported.
    pub writers: u32,
    /// `RECEIVED`: pieces reported over all writers.
    pub pieces: u32,
    /// `KVFERRY_EVENT_PEER_TRUNCATED`, `KVFERRY_EVENT_DETAIL_TRUNCATED`.
    pub flags: u32,
    /// Zero; room for later fields.
    pub reserved: u32,
    /// `FAILED`: the peer concerned (`instance rank N (epoch ...)`), or empty. NUL-terminated.
    pub peer: [c_char; KVFERRY_EVENT_PEER_LEN],
    /// `FAILED`: what happened, in words; `UNKNOWN`: the event. NUL-terminated.
    pub detail: [c_char; KVFERRY_EVENT_DETAIL_LEN],
}

impl kvferry_event {
    fn empty(kind: kvferry_event_kind, request: u64) -> Self {
        Self {
            kind,
            failure: kvferry_failure_kind::KVFERRY_FAILURE_NONE,
            request,
            bytes: 0,
            fragments: 0,
            latency_us: 0,
            writers: 0,
            pieces: 0,
            flags: 0,
            reserved: 0,
            peer: [0; KVFERRY_EVENT_PEER_LEN],
            detail: [0; KVFERRY_EVENT_DETAIL_LEN],
        }
    }

    fn from_event(event: &Event) -> Self {
        use kvferry_event_kind::*;
        match event {
            Event::Sent { request, bytes, .. } => Self {
                bytes: *bytes,
                ..Self::empty(KVFERRY_EVENT_SENT, *request)
            },
            Event::Received { request, stats } => Self {
                bytes: stats.bytes,
                fragments: stats.fragments,
                latency_us: stats.latency_us,
                writers: stats.writers,
                pieces: stats.pieces,
                ..Self::empty(KVFERRY_EVENT_RECEIVED, *request)
            },
            Event::Cancelled { request } => Self::empty(KVFERRY_EVENT_CANCELLED, *request),
            Event::Failed {
                request,
                peer,
                kind,
                detail,
            } => {
                let mut e = Self::empty(KVFERRY_EVENT_FAILED, *request);
                e.failure = failure_kind(*kind);
                if copy_text(&mut e.peer, peer.as_deref().unwrap_or("")) {
                    e.flags |= KVFERRY_EVENT_PEER_TRUNCATED;
                }
                if copy_text(&mut e.detail, detail) {
                    e.flags |= KVFERRY_EVENT_DETAIL_TRUNCATED;
                }
                e
            }
            other => {
                let mut e = Self::empty(KVFERRY_EVENT_UNKNOWN, other.request());
                if copy_text(&mut e.detail, &format!("{other:?}")) {
                    e.flags |= KVFERRY_EVENT_DETAIL_TRUNCATED;
                }
                e
            }
        }
    }
}

/// Entries of [`kvferry_agent_stats::failed`]: one per `kvferry_failure_kind` value up to
/// 15 (`KVFERRY_FAILURE_OTHER` is not counted there).
pub const KVFERRY_STATS_FAILURE_SLOTS: usize = 16;
/// Entries of [`kvferry_agent_stats::latency_us_log2`].
pub const KVFERRY_STATS_LATENCY_BUCKETS: usize = 28;
const _: () = assert!(KVFERRY_STATS_LATENCY_BUCKETS == LATENCY_BUCKETS);

/// What an agent did since it started (`kvferry_agent_get_stats`): counters over its requests'
/// terminal events, and what it holds now. Plain data.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvferry_agent_stats {
    /// Requests that ended `SENT` (prefill ranks).
    pub sent: u64,
    /// Requests that ended `RECEIVED` (decode ranks).
    pub received: u64,
    /// Requests that ended `CANCELLED`.
    pub cancelled: u64,
    /// Requests that ended `FAILED`, indexed by their `kvferry_failure_kind` value.
    pub failed: [u64; KVFERRY_STATS_FAILURE_SLOTS],
    /// Bytes of the requests that ended well (written by this rank, or into it).
    pub bytes: u64,
    /// Fragments written into this rank (decode ranks).
    pub fragments: u64,
    /// Pieces that landed in this rank (decode ranks: a chunk or a layer-wise send each).
    pub pieces: u64,
    /// Puts this rank issued (prefill ranks).
    pub puts: u64,
    /// Nanoseconds spent planning and validating the requests that ended well.
    pub plan_ns: u64,
    /// Nanoseconds of puts and flushes for them (prefill ranks).
    pub write_ns: u64,
    /// Requests that ended well by time: entry `k` counts those under `2^k` microseconds
    /// (and at least `2^(k-1)`), the last one every longer one. Decode: `expect` to
    /// `RECEIVED`; prefill: the claim to `SENT`.
    pub latency_us_log2: [u64; KVFERRY_STATS_LATENCY_BUCKETS],
    /// Requests held now.
    pub in_flight: u64,
    /// Vetted peer connections now.
    pub peers: u64,
}

/// Fills `*out` with what the agent did since it started (see `kvferry_agent_stats`).
///
/// # Safety
///
/// `agent` is NULL or a live handle; `out` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_get_stats(
    agent: *mut kvferry_agent,
    out: *mut kvferry_agent_stats,
) -> c_int {
    guard("kvferry_agent_get_stats", || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let a = unsafe { deref(agent, "agent") }?;
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let s = a.agent.stats();
        let mut failed = [0u64; KVFERRY_STATS_FAILURE_SLOTS];
        for (kind, count) in FAILURE_KINDS.iter().zip(s.failed) {
            if let Some(slot) = failed.get_mut(failure_kind(*kind) as usize) {
                *slot += count;
            }
        }
        let mut latency_us_log2 = [0u64; KVFERRY_STATS_LATENCY_BUCKETS];
        for (to, from) in latency_us_log2.iter_mut().zip(s.latency_us) {
            *to = from;
        }
        let stats = kvferry_agent_stats {
            sent: s.sent,
            received: s.received,
            cancelled: s.cancelled,
            failed,
            bytes: s.bytes,
            fragments: s.fragments,
            pieces: s.pieces,
            puts: s.puts,
            plan_ns: s.plan_ns,
            write_ns: s.write_ns,
            latency_us_log2,
            in_flight: s.in_flight,
            peers: s.peers,
        };
        // SAFETY: non-NULL and writable (the caller's contract).
        unsafe { out.write(stats) };
        Ok(())
    })
}

fn failure_kind(kind: FailureKind) -> kvferry_failure_kind {
    use kvferry_failure_kind::*;
    match kind {
        FailureKind::Invalid => KVFERRY_FAILURE_INVALID,
        FailureKind::Peer => KVFERRY_FAILURE_PEER,
        FailureKind::Refused => KVFERRY_FAILURE_REFUSED,
        FailureKind::Planner => KVFERRY_FAILURE_PLANNER,
        FailureKind::Timeout => KVFERRY_FAILURE_TIMEOUT,
        FailureKind::Lease => KVFERRY_FAILURE_LEASE,
        FailureKind::Protocol => KVFERRY_FAILURE_PROTOCOL,
        FailureKind::Write => KVFERRY_FAILURE_WRITE,
        FailureKind::CancelledByPeer => KVFERRY_FAILURE_CANCELLED_BY_PEER,
        FailureKind::Integrity => KVFERRY_FAILURE_INTEGRITY,
        _ => KVFERRY_FAILURE_OTHER,
    }
}

/// Copies `text` into `out` NUL-terminated, cut at a character boundary to fit; whether it
/// was cut.
fn copy_text(out: &mut [c_char], text: &str) -> bool {
    let room = out.len().saturating_sub(1);
    let mut n = text.len().min(room);
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    for (o, b) in out.iter_mut().zip(&text.as_bytes()[..n]) {
        *o = *b as c_char;
    }
    if let Some(end) = out.get_mut(n) {
        *end = 0;
    }
    n < text.len()
}

// ---------------------------------------------------------------------------------------
// Argument checks.

/// `ptr` as a reference, or the NULL failure naming `what`.
///
/// # Safety
///
/// `ptr` is NULL or points at a live `T` for `'a`.
unsafe fn deref<'a, T>(ptr: *const T, what: &str) -> Result<&'a T, Failure> {
    // SAFETY: the caller's contract: NULL or a live `T`.
    unsafe { ptr.as_ref() }.ok_or_else(|| Failure::null(what))
}

/// A NUL-terminated UTF-8 argument.
///
/// # Safety
///
/// `ptr` is NULL or a NUL-terminated string, valid for the call.
unsafe fn text<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if ptr.is_null() {
        return Err(Failure::null(what));
    }
    // SAFETY: non-NULL, and the caller's contract makes it NUL-terminated and live.
    let s = unsafe { CStr::from_ptr(ptr) };
    s.to_str()
        .map_err(|e| Failure::new(KVFERRY_ERR_INVALID_ARGUMENT, format!("{what}: {e}")))
}

/// An array argument: NULL allowed only when `len` is 0.
///
/// # Safety
///
/// `ptr` is NULL or valid for `len` reads of `T`, for `'a`.
unsafe fn array<'a, T>(ptr: *const T, len: usize, what: &str) -> Result<&'a [T], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Failure::null(&format!("{what} (with {len} entries)")));
    }
    if len > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(Failure::new(
            KVFERRY_ERR_INVALID_ARGUMENT,
            format!("{what}: {len} entries cannot be addressed"),
        ));
    }
    // SAFETY: non-NULL, the size fits in `isize`, and the caller's contract makes `len`
    // entries readable for `'a`.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// A peer instance's name and its ranks' endpoints, as `expect` and `hold` take them.
///
/// # Safety
///
/// `peer` is NULL or a NUL-terminated string; `endpoints` is NULL or readable for
/// `n_endpoints` pointers, each NULL or to a NUL-terminated string; read during the call.
unsafe fn peer_and_endpoints(
    peer: *const c_char,
    endpoints: *const *const c_char,
    n_endpoints: usize,
) -> Result<(String, Vec<String>), Failure> {
    // SAFETY: NULL or NUL-terminated (the caller's contract).
    let peer = unsafe { text(peer, "peer") }?.to_string();
    // SAFETY: the caller's contract for the endpoint array.
    let list = unsafe { array(endpoints, n_endpoints, "endpoints") }?;
    let endpoints = list
        .iter()
        .enumerate()
        // SAFETY: each entry is NULL or NUL-terminated (the caller's contract).
        .map(|(i, &e)| unsafe { text(e, &format!("endpoints[{i}]")) }.map(str::to_string))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((peer, endpoints))
}

/// The ABI's view ids of a C array of them.
fn view_ids(list: &[kvferry_view_id]) -> Vec<ViewId> {
    list.iter()
        .map(|v| ViewId {
            group: v.group,
            view: v.view,
        })
        .collect()
}

/// The slot tables argument, copied into the ABI's tables.
///
/// # Safety
///
/// `tables` is NULL or valid for `n` reads, and each table's `slots` for its `len`.
unsafe fn slot_tables(
    tables: *const kvferry_slot_table,
    n: usize,
) -> Result<Vec<SlotTable>, Failure> {
    // SAFETY: the caller's contract.
    let tables = unsafe { array(tables, n, "tables") }?;
    tables
        .iter()
        .enumerate()
        .map(|(i, t)| {
            // SAFETY: the caller's contract, for each table's slots.
            let slots = unsafe { array(t.slots, t.len, &format!("tables[{i}].slots")) }?;
            Ok(SlotTable::new(slots.iter().map(|&s| i64::from(s))))
        })
        .collect()
}

/// Writes `bytes` to `buf` under the size-query convention.
///
/// # Safety
///
/// `buf` is NULL or valid for `cap` bytes of writes; `len_out` is NULL or writable.
unsafe fn copy_out(
    bytes: &[u8],
    nul: bool,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> Result<(), Failure> {
    if len_out.is_null() {
        return Err(Failure::null("len_out"));
    }
    // SAFETY: non-NULL, and writable by the caller's contract.
    unsafe { len_out.write(bytes.len()) };
    if buf.is_null() && cap == 0 {
        return Ok(());
    }
    if buf.is_null() {
        return Err(Failure::null(&format!("buf (with cap {cap})")));
    }
    let need = bytes.len() + usize::from(nul);
    if cap < need {
        return Err(Failure::new(
            KVFERRY_ERR_BUFFER_TOO_SMALL,
            format!("{need} bytes needed, the buffer has {cap}"),
        ));
    }
    // SAFETY: `buf` is writable for `cap >= need` bytes (the caller's contract), and our
    // `bytes` cannot overlap it.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len());
        if nul {
            *buf.add(bytes.len()) = 0;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The entry points.

/// Starts one rank's agent from a configuration, JSON or TOML (version 1; `host/capi/README.md`
/// lists every field and the environment variables that fill what it leaves out), and stores
/// its handle in `*out` (NULL on failure).
///
/// This is where the engine makes its memory promise: from this call until
/// `kvferry_agent_destroy` returns, every pool the page table names stays one live allocation
/// of its memory type at the address given (not freed, not remapped); source slots stay
/// unchanged from `kvferry_agent_send` until the request's terminal event; destination slots
/// are not the engine's from `kvferry_agent_expect` until its terminal event. kvferry
/// registers the pools with UCX and writes nowhere else; it never allocates, fills or primes
/// them.
///
/// Returns `KVFERRY_OK`, `KVFERRY_ERR_CONFIG`, `KVFERRY_ERR_PLANNER`, `KVFERRY_ERR_UCX`,
/// `KVFERRY_ERR_MEMORY`, `KVFERRY_ERR_LISTEN`, `KVFERRY_ERR_RESOURCES`, ...
///
/// # Safety
///
/// `config_json` is NULL or a NUL-terminated string; `out` is NULL or writable. The pools the
/// configuration names satisfy the memory promise above, which no check here can verify.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_start(
    config_json: *const c_char,
    out: *mut *mut kvferry_agent,
) -> c_int {
    guard("kvferry_agent_start", || {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        // SAFETY: `out` is non-NULL and writable (the caller's contract).
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: NULL or NUL-terminated (the caller's contract).
        let json = unsafe { text(config_json, "config_json") }?;
        init_logging();
        let (config, bound) = config::load(json)?;
        // SAFETY: the caller promised the pools the configuration names for the agent's life
        // (this function's `# Safety`), which is `Agent::start`'s contract.
        let agent = unsafe { Agent::start(config, bound) }?;
        let handle = Box::new(kvferry_agent {
            agent,
            pending: Mutex::new(VecDeque::new()),
        });
        // SAFETY: as above; the caller owns the handle from here and frees it with
        // `kvferry_agent_destroy`.
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(())
    })
}

/// Stops the agent and frees the handle: it stops taking work, tells every peer, ends every
/// connection, and waits (up to 2 s) until its threads let go, so UCX is torn down before it
/// returns and the engine may free its pools right after. Requests still in flight end
/// without events. NULL is ignored.
///
/// # Safety
///
/// `agent` is NULL or a handle from `kvferry_agent_start` not yet destroyed, and no other
/// call on it runs or follows.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_destroy(agent: *mut kvferry_agent) {
    guard("kvferry_agent_destroy", || {
        if !agent.is_null() {
            // SAFETY: a live handle from `kvferry_agent_start`, destroyed once, with no
            // other call on it (the caller's contract).
            drop(unsafe { Box::from_raw(agent) });
        }
        Ok(())
    });
}

/// Copies a prefill rank's side-channel endpoint (`host:port`, what decode ranks pass to
/// `kvferry_agent_expect`) into `buf`, NUL-terminated; `*len_out` gets its length without the
/// NUL. Size query: `buf` NULL and `cap` 0. Decode ranks have none: `KVFERRY_ERR_ROLE`.
///
/// # Safety
///
/// `agent` is NULL or a live handle; `buf` is NULL or writable for `cap` bytes; `len_out` is
/// NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_endpoint(
    agent: *const kvferry_agent,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> c_int {
    guard("kvferry_agent_endpoint", || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let a = unsafe { deref(agent, "agent") }?;
        let Some(endpoint) = a.agent.endpoint() else {
            return Err(Failure::new(
                KVFERRY_ERR_ROLE,
                "a decode rank does not listen, so it has no endpoint",
            ));
        };
        // SAFETY: the caller's contract for `buf`, `cap` and `len_out`.
        unsafe { copy_out(endpoint.as_bytes(), true, buf.cast(), cap, len_out) }
    })
}

/// Copies the agent's numbers in the Prometheus text format (version 0.0.4: the series of
/// `kvferry_agent_stats`, labelled with the agent's instance, rank and role;
/// `kvferry::metrics` lists them) into `buf`, NUL-terminated; `*len_out` gets its length without the
/// NUL. Size query: `buf` NULL and `cap` 0. The text can grow between two calls (numbers get
/// longer): give it room to spare, or ask again on `KVFERRY_ERR_BUFFER_TOO_SMALL`.
///
/// # Safety
///
/// `agent` is NULL or a live handle; `buf` is NULL or writable for `cap` bytes; `len_out` is
/// NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_metrics(
    agent: *const kvferry_agent,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> c_int {
    guard("kvferry_agent_metrics", || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let a = unsafe { deref(agent, "agent") }?;
        let text = kvferry::metrics::encode(&[kvferry::metrics::Sample::of(&a.agent)]);
        // SAFETY: the caller's contract for `buf`, `cap` and `len_out`.
        unsafe { copy_out(text.as_bytes(), true, buf.cast(), cap, len_out) }
    })
}

/// Copies this rank's metadata (bytes, for engines that exchange it on their own channel:
/// the decode rank passes them to `kvferry_agent_add_peer`) into `buf`; `*len_out` gets its
/// length. Size query: `buf` NULL and `cap` 0.
///
/// # Safety
///
/// `agent` is NULL or a live handle; `buf` is NULL or writable for `cap` bytes; `len_out` is
/// NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_local_metadata(
    agent: *const kvferry_agent,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> c_int {
    guard("kvferry_agent_local_metadata", || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let a = unsafe { deref(agent, "agent") }?;
        let bytes = a.agent.local_metadata()?;
        // SAFETY: the caller's contract for `buf`, `cap` and `len_out`.
        unsafe { copy_out(&bytes, false, buf, cap, len_out) }
    })
}

/// Decode ranks: adds a prefill rank's metadata (`len` bytes of its
/// `kvferry_agent_local_metadata`) to this rank's directory; the connection is made when a
/// request needs it. A newer start of the same rank replaces the old one.
///
/// # Safety
///
/// `agent` is NULL or a live handle; `bytes` is NULL or readable for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_add_peer(
    agent: *mut kvferry_agent,
    bytes: *const u8,
    len: usize,
) -> c_int {
    guard("kvferry_agent_add_peer", || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let a = unsafe { deref(agent, "agent") }?;
        if bytes.is_null() {
            return Err(Failure::null("bytes"));
        }
        // SAFETY: the caller's contract for `bytes` and `len`.
        let bytes = unsafe { array(bytes, len, "bytes") }?;
        a.agent.add_peer(bytes)?;
        Ok(())
    })
}

/// Prefill ranks: makes (a chunk of) request `request` available: tokens
/// `[token_start, token_end)` of a `prompt_len`-token prompt, in the slots of `tables` (one
/// per layer group of this rank's page table, each with an entry, or -1 for a block this
/// rank does not hold, for every block up to `token_end`: a shorter table is refused with
/// `KVFERRY_ERR_INVALID_REQUEST`, as is a slot past its pool or named twice). Chunked prefill is a sequence of sends, each starting where the previous ended, the last
/// with `is_last`. `to`: only this decode instance may claim it (NULL: the first to claim it
/// owns it). Ends in `SENT`, `CANCELLED` or `FAILED`. The same as `kvferry_agent_send_views`
/// with no views named.
///
/// # Safety
///
/// `agent` is NULL or a live handle; `tables` is NULL or readable for `n_tables` entries,
/// each `slots` for its `len`; `to` is NULL or a NUL-terminated string. All are read during
/// the call only.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_send(
    agent: *mut kvferry_agent,
    request: u64,
    tables: *const kvferry_slot_table,
    n_tables: usize,
    token_start: u64,
    token_end: u64,
    prompt_len: u64,
    is_last: bool,
    to: *const c_char,
) -> c_int {
    // SAFETY: the same contract, with no views.
    unsafe {
        send_views(
            "kvferry_agent_send",
            agent,
            request,
            (tables, n_tables),
            (token_start, token_end, prompt_len),
            is_last,
            to,
            None,
        )
    }
}

/// Prefill ranks: a layer-wise send — as `kvferry_agent_send`, carrying only the views
/// `views` (`n_views` of them; NULL with 0: every view not sent yet for these tokens), the
/// layers computed so far. The next sends repeat the same tokens with views not sent yet
/// until every view went; then the next chunk may start. `is_last` marks the send that ends
/// the prompt and carries the last of its views. Each send leaves as soon as it is claimed;
/// the decode rank completes once every view of every chunk landed.
///
/// # Safety
///
/// As `kvferry_agent_send`; `views` is NULL or readable for `n_views` entries, read during
/// the call only.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_send_views(
    agent: *mut kvferry_agent,
    request: u64,
    tables: *const kvferry_slot_table,
    n_tables: usize,
    token_start: u64,
    token_end: u64,
    prompt_len: u64,
    is_last: bool,
    to: *const c_char,
    views: *const kvferry_view_id,
    n_views: usize,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe {
        send_views(
            "kvferry_agent_send_views",
            agent,
            request,
            (tables, n_tables),
            (token_start, token_end, prompt_len),
            is_last,
            to,
            Some((views, n_views)),
        )
    }
}

/// Both sends; `views` NULL with 0 entries is every view not sent yet.
///
/// # Safety
///
/// As `kvferry_agent_send_views`.
#[allow(clippy::too_many_arguments)]
unsafe fn send_views(
    call: &'static str,
    agent: *mut kvferry_agent,
    request: u64,
    (tables, n_tables): (*const kvferry_slot_table, usize),
    (token_start, token_end, prompt_len): (u64, u64, u64),
    is_last: bool,
    to: *const c_char,
    views: Option<(*const kvferry_view_id, usize)>,
) -> c_int {
    guard(call, || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let a = unsafe { deref(agent, "agent") }?;
        // SAFETY: the caller's contract for the tables.
        let tables = unsafe { slot_tables(tables, n_tables) }?;
        let to = if to.is_null() {
            None
        } else {
            // SAFETY: non-NULL and NUL-terminated (the caller's contract).
            Some(unsafe { text(to, "to") }?.to_string())
        };
        let views = match views {
            Some((views, n)) if !(views.is_null() && n == 0) => {
                // SAFETY: the caller's contract for the views.
                Some(view_ids(unsafe { array(views, n, "views") }?))
            }
            _ => None,
        };
        a.agent.send(SendChunk {
            request,
            tables,
            tokens: TokenRange {
                start: token_start,
                end: token_end,
            },
            prompt_len,
            is_last,
            to,
            views,
        })?;
        Ok(())
    })
}

/// Decode ranks: expects request `request` from prefill instance `peer` into this rank's
/// slots `tables` (one per layer group, each with an entry, or -1, for every block of the
/// prompt: a shorter table is refused with `KVFERRY_ERR_INVALID_REQUEST`, before anything
/// moves). `endpoints`: the side-channel endpoints of that
/// instance's ranks, any order (`n_endpoints` may be 0 when their metadata was added with
/// `kvferry_agent_add_peer`). `ctx_dp_rank`: the prefill DP group that holds it.
/// `cached_prefix`: tokens already cached here (block-aligned; 0 = none), which nothing
/// writes. `excluded`: views of this rank that must not be written. Ends in `RECEIVED`,
/// `CANCELLED` or `FAILED`.
///
/// # Safety
///
/// `agent` is NULL or a live handle; `peer` is NULL or a NUL-terminated string; `endpoints`
/// is NULL or readable for `n_endpoints` pointers to NUL-terminated strings; `tables` is NULL
/// or readable for `n_tables` entries, each `slots` for its `len`; `excluded` is NULL or
/// readable for `n_excluded` entries. All are read during the call only.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_expect(
    agent: *mut kvferry_agent,
    request: u64,
    peer: *const c_char,
    endpoints: *const *const c_char,
    n_endpoints: usize,
    ctx_dp_rank: u32,
    prompt_len: u64,
    cached_prefix: u64,
    tables: *const kvferry_slot_table,
    n_tables: usize,
    excluded: *const kvferry_view_id,
    n_excluded: usize,
) -> c_int {
    guard("kvferry_agent_expect", || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let a = unsafe { deref(agent, "agent") }?;
        // SAFETY: the caller's contract for the peer and the endpoint array.
        let (peer, endpoints) = unsafe { peer_and_endpoints(peer, endpoints, n_endpoints) }?;
        // SAFETY: the caller's contract for the tables.
        let tables = unsafe { slot_tables(tables, n_tables) }?;
        // SAFETY: the caller's contract for the excluded views.
        let excluded = unsafe { array(excluded, n_excluded, "excluded") }?;
        a.agent.expect(Expect {
            request,
            peer,
            endpoints,
            ctx_dp_rank,
            prompt_len,
            cached_prefix: (cached_prefix != 0).then_some(cached_prefix),
            tables,
            excluded_views: view_ids(excluded),
        })?;
        Ok(())
    })
}

/// Decode ranks: tells prefill instance `peer` that this instance still wants `requests`
/// (`n_requests` ids), which it has not expected yet because the engine queued them: each of
/// that instance's ranks reached through `endpoints` (or, with none, those added with
/// `kvferry_agent_add_peer`) that holds one unclaimed runs its lease from now again, up to ten
/// leases after its send. Returns at once; nothing is reported. Call it periodically, well
/// within the lease, while requests stay queued.
///
/// # Safety
///
/// `agent` is NULL or a live handle; `peer` is NULL or a NUL-terminated string; `endpoints`
/// is NULL or readable for `n_endpoints` pointers to NUL-terminated strings; `requests` is
/// NULL or readable for `n_requests` ids. All are read during the call only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_hold(
    agent: *mut kvferry_agent,
    peer: *const c_char,
    endpoints: *const *const c_char,
    n_endpoints: usize,
    requests: *const u64,
    n_requests: usize,
) -> c_int {
    guard("kvferry_agent_hold", || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let a = unsafe { deref(agent, "agent") }?;
        // SAFETY: the caller's contract for the peer and the endpoint array.
        let (peer, endpoints) = unsafe { peer_and_endpoints(peer, endpoints, n_endpoints) }?;
        // SAFETY: the caller's contract for the ids.
        let requests = unsafe { array(requests, n_requests, "requests") }?;
        a.agent.hold(&peer, &endpoints, requests)?;
        Ok(())
    })
}

/// Cancels a request; accepted while it has not ended, and answered by its terminal event
/// (`CANCELLED`, or the event that beat the cancel). On a decode rank that event comes only
/// once every writer acknowledged or is gone. `KVFERRY_ERR_UNKNOWN_REQUEST` if the request is
/// unknown or has ended.
///
/// # Safety
///
/// `agent` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_cancel(agent: *mut kvferry_agent, request: u64) -> c_int {
    guard("kvferry_agent_cancel", || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let a = unsafe { deref(agent, "agent") }?;
        a.agent.cancel(request)?;
        Ok(())
    })
}

/// Moves up to `cap` events, oldest first, into `events`; `*n_out` gets how many. Events
/// that do not fit stay queued for the next call, and the wake descriptor stays readable
/// while any wait. `events` may be NULL when `cap` is 0.
///
/// # Safety
///
/// `agent` is NULL or a live handle; `events` is NULL or writable for `cap` entries;
/// `n_out` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_poll(
    agent: *mut kvferry_agent,
    events: *mut kvferry_event,
    cap: usize,
    n_out: *mut usize,
) -> c_int {
    guard("kvferry_agent_poll", || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let a = unsafe { deref(agent, "agent") }?;
        if n_out.is_null() {
            return Err(Failure::null("n_out"));
        }
        // SAFETY: non-NULL and writable (the caller's contract).
        unsafe { n_out.write(0) };
        if cap > 0 && events.is_null() {
            return Err(Failure::null(&format!("events (with cap {cap})")));
        }
        let mut pending = a.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.extend(a.agent.poll());
        let n = cap.min(pending.len());
        for (i, event) in pending.drain(..n).enumerate() {
            // SAFETY: `i < n <= cap`, and `events` is writable for `cap` entries (the
            // caller's contract); `write` does not read the (maybe uninitialised) old value.
            unsafe { events.add(i).write(kvferry_event::from_event(&event)) };
        }
        // SAFETY: as above.
        unsafe { n_out.write(n) };
        if !pending.is_empty() {
            // The agent's poll cleared its eventfd; what is left here must keep it readable.
            a.agent.rewake();
        }
        Ok(())
    })
}

/// A descriptor that is readable while events wait (an eventfd: add it to `poll`/`epoll`;
/// `kvferry_agent_poll` clears it). Owned by the agent: do not close or read it. -1 if
/// `agent` is NULL.
///
/// # Safety
///
/// `agent` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_agent_wake_fd(agent: *const kvferry_agent) -> c_int {
    let mut fd = -1;
    let status = guard("kvferry_agent_wake_fd", || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let a = unsafe { deref(agent, "agent") }?;
        fd = a.agent.wake_fd();
        Ok(())
    });
    if status == KVFERRY_OK as c_int {
        fd
    } else {
        -1
    }
}

/// Copies the text of this thread's last failed call into `buf` (NUL-terminated, cut to
/// `cap - 1` bytes, like `snprintf`) and returns its full length without the NUL: 0 when the
/// last call succeeded. `buf` may be NULL when `cap` is 0, to ask for the length.
///
/// # Safety
///
/// `buf` is NULL or writable for `cap` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_last_error(buf: *mut c_char, cap: usize) -> usize {
    // SAFETY: the caller's contract for `buf` and `cap`.
    std::panic::catch_unwind(|| unsafe { error::copy_last_error(buf, cap) }).unwrap_or(0)
}

/// The name of a status code (`"KVFERRY_ERR_CONFIG"`), or `"KVFERRY_UNKNOWN_STATUS"`. A
/// static string: never free it.
#[unsafe(no_mangle)]
pub extern "C" fn kvferry_status_name(status: c_int) -> *const c_char {
    kvferry_status::ALL
        .iter()
        .find(|s| **s as c_int == status)
        .map_or(c"KVFERRY_UNKNOWN_STATUS", |s| s.name())
        .as_ptr()
}

/// The library's version (`"0.1.0"`). A static string: never free it.
#[unsafe(no_mangle)]
pub extern "C" fn kvferry_version() -> *const c_char {
    const VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => c"unknown",
        };
    VERSION.as_ptr()
}

// ---------------------------------------------------------------------------------------
// Planning without moving (`planning`): kvferry's plans for another transfer layer.

/// kvferry's planner for one (prefill rank, decode rank) pair, without an agent: an opaque
/// handle from `kvferry_pair_planner_new`, freed by `kvferry_pair_planner_destroy`. Plans
/// come out as addresses in the two ranks' pools, validated as the agent validates them, for
/// an engine that moves the bytes with another transfer layer (NIXL, Mooncake, its own copy
/// loop). Nothing is connected, registered or started.
pub struct kvferry_pair_planner {
    planner: planning::PairPlanner,
}

/// A validated plan from `kvferry_pair_planner_plan`, freed by `kvferry_plan_destroy`.
pub struct kvferry_plan {
    /// Per pattern: fragments and row pairs, as structures of arrays.
    patterns: Vec<PatternArrays>,
    fragments: usize,
    bytes: u64,
}

#[derive(Debug, Default)]
struct PatternArrays {
    src_offsets: Vec<u64>,
    dst_offsets: Vec<u64>,
    lengths: Vec<u64>,
    src_rows: Vec<u64>,
    dst_rows: Vec<u64>,
}

impl std::fmt::Debug for kvferry_pair_planner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.planner.fmt(f)
    }
}

impl std::fmt::Debug for kvferry_plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("kvferry_plan")
            .field("patterns", &self.patterns.len())
            .field("fragments", &self.fragments)
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// One pattern of a `kvferry_plan` (`kvferry_plan_get_pattern`): each of its `n_fragments`
/// fragments `k` lands once per row pair `r`, moving `lengths[k]` bytes from
/// `src_rows[r] + src_offsets[k]` (prefill rank) to `dst_rows[r] + dst_offsets[k]` (decode
/// rank). A flat plan is one pattern whose only row pair is `(0, 0)`: its offsets are the
/// addresses. The arrays belong to the plan and live until `kvferry_plan_destroy`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvferry_plan_pattern {
    /// Source offset of each fragment inside its source row.
    pub src_offsets: *const u64,
    /// Destination offset of each fragment inside its destination row.
    pub dst_offsets: *const u64,
    /// Bytes of each fragment.
    pub lengths: *const u64,
    /// Fragments in the three arrays above.
    pub n_fragments: usize,
    /// Source row address of each row pair.
    pub src_rows: *const u64,
    /// Destination row address of each row pair.
    pub dst_rows: *const u64,
    /// Row pairs in the two arrays above.
    pub n_rows: usize,
}

impl From<planning::PlanningError> for Failure {
    fn from(e: planning::PlanningError) -> Self {
        let status = match &e {
            planning::PlanningError::Config { error, .. } => match error {
                config::ConfigError::Planner(_) => KVFERRY_ERR_PLANNER,
                _ => KVFERRY_ERR_CONFIG,
            },
            planning::PlanningError::Planner(_) => KVFERRY_ERR_PLANNER,
            _ => KVFERRY_ERR_INVALID_REQUEST,
        };
        Self::new(status, e.to_string())
    }
}

/// Builds kvferry's planner for one (prefill rank, decode rank) pair from the configurations
/// their agents would read (`role` `"context"` and `"generation"`; the same JSON as
/// `kvferry_agent_start`, whose secret and transport settings are not needed here): each
/// side's planner is bound and started on its rank, and each vets the other.
///
/// Returns `KVFERRY_OK`, `KVFERRY_ERR_CONFIG`, `KVFERRY_ERR_PLANNER`,
/// `KVFERRY_ERR_INVALID_REQUEST` (a configuration of the wrong role), ...
///
/// # Safety
///
/// `prefill_config` and `decode_config` are NULL or NUL-terminated strings; `out` is NULL or
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_pair_planner_new(
    prefill_config: *const c_char,
    decode_config: *const c_char,
    out: *mut *mut kvferry_pair_planner,
) -> c_int {
    guard("kvferry_pair_planner_new", || {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        // SAFETY: `out` is non-NULL and writable (the caller's contract).
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: NULL or NUL-terminated (the caller's contract).
        let prefill = unsafe { text(prefill_config, "prefill_config") }?;
        // SAFETY: as above.
        let decode = unsafe { text(decode_config, "decode_config") }?;
        init_logging();
        let planner = planning::PairPlanner::new(prefill, decode)?;
        let handle = Box::new(kvferry_pair_planner { planner });
        // SAFETY: as above; the caller owns the handle from here and frees it with
        // `kvferry_pair_planner_destroy`.
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(())
    })
}

/// Frees a pair planner. NULL is ignored.
///
/// # Safety
///
/// `planner` is NULL or a handle from `kvferry_pair_planner_new` not yet destroyed, and no
/// other call on it runs or follows.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_pair_planner_destroy(planner: *mut kvferry_pair_planner) {
    guard("kvferry_pair_planner_destroy", || {
        if !planner.is_null() {
            // SAFETY: a live handle, destroyed once (the caller's contract).
            drop(unsafe { Box::from_raw(planner) });
        }
        Ok(())
    });
}

/// `*out` gets whether the prefill rank writes the decode rank at all (the planner's targets
/// for the decode rank's DP group); a pair it does not write has nothing to plan.
///
/// # Safety
///
/// `planner` is NULL or a live handle; `out` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_pair_planner_writes(
    planner: *const kvferry_pair_planner,
    out: *mut bool,
) -> c_int {
    guard("kvferry_pair_planner_writes", || {
        // SAFETY: NULL or a live handle (the caller's contract).
        let p = unsafe { deref(planner, "planner") }?;
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        // SAFETY: non-NULL and writable (the caller's contract).
        unsafe { out.write(p.planner.writes()) };
        Ok(())
    })
}

/// Plans one piece of a request from the prefill rank to the decode rank and validates it
/// (every source inside the prefill rank's slots for the request, every destination inside
/// the decode rank's, no destination byte written twice): `prefill_tables` and
/// `decode_tables` are each side's slot tables (one per layer group), `token_start` ..
/// `token_end` the piece's tokens of a `prompt_len`-token prompt, `dst_start_token` where the
/// decode side's copy starts (a cached prefix; `UINT64_MAX`: none; each side's tables must
/// have an entry, or -1, for every block up to `token_end`), `views` the prefill
/// rank's views the piece carries (layer-wise; NULL with 0: every view). `*out` gets the plan.
///
/// Returns `KVFERRY_OK`, `KVFERRY_ERR_INVALID_REQUEST` (tables, tokens, views, a pair the
/// prefill rank does not write), `KVFERRY_ERR_PLANNER` (the planner refused, or its plan
/// broke a rule: the text names which), ...
///
/// # Safety
///
/// `planner` is NULL or a live handle; each table array is NULL or readable for its count,
/// each `slots` for its `len`; `views` is NULL or readable for `n_views` entries; `out` is
/// NULL or writable. The arrays are read during the call only.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_pair_planner_plan(
    planner: *const kvferry_pair_planner,
    prefill_tables: *const kvferry_slot_table,
    n_prefill_tables: usize,
    decode_tables: *const kvferry_slot_table,
    n_decode_tables: usize,
    token_start: u64,
    token_end: u64,
    prompt_len: u64,
    dst_start_token: u64,
    views: *const kvferry_view_id,
    n_views: usize,
    out: *mut *mut kvferry_plan,
) -> c_int {
    guard("kvferry_pair_planner_plan", || {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        // SAFETY: `out` is non-NULL and writable (the caller's contract).
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: NULL or a live handle (the caller's contract).
        let p = unsafe { deref(planner, "planner") }?;
        // SAFETY: the caller's contract for the tables.
        let prefill_tables = unsafe { slot_tables(prefill_tables, n_prefill_tables) }?;
        // SAFETY: as above.
        let decode_tables = unsafe { slot_tables(decode_tables, n_decode_tables) }?;
        let views = if views.is_null() && n_views == 0 {
            None
        } else {
            // SAFETY: the caller's contract for the views.
            Some(view_ids(unsafe { array(views, n_views, "views") }?))
        };
        let plan = p.planner.plan(&planning::Piece {
            prefill_tables,
            decode_tables,
            tokens: TokenRange {
                start: token_start,
                end: token_end,
            },
            prompt_len,
            dst_start_token: (dst_start_token != u64::MAX).then_some(dst_start_token),
            views,
        })?;
        let patterns = plan
            .patterns()
            .into_iter()
            .map(|pattern| PatternArrays {
                src_offsets: pattern.fragments.iter().map(|f| f.0).collect(),
                dst_offsets: pattern.fragments.iter().map(|f| f.1).collect(),
                lengths: pattern.fragments.iter().map(|f| f.2).collect(),
                src_rows: pattern.rows.iter().map(|r| r.0).collect(),
                dst_rows: pattern.rows.iter().map(|r| r.1).collect(),
            })
            .collect::<Vec<PatternArrays>>();
        // Counted from the arrays `kvferry_plan_expand` walks, so its writes stay within the
        // count it checked the caller's room against.
        let fragments = patterns
            .iter()
            .map(|a| a.lengths.len() * a.src_rows.len())
            .sum();
        let handle = Box::new(kvferry_plan {
            patterns,
            fragments,
            bytes: plan.total_bytes(),
        });
        // SAFETY: as above; the caller owns the plan from here and frees it with
        // `kvferry_plan_destroy`.
        unsafe { out.write(Box::into_raw(handle)) };
        Ok(())
    })
}

/// Frees a plan. NULL is ignored.
///
/// # Safety
///
/// `plan` is NULL or a plan from `kvferry_pair_planner_plan` not yet destroyed, whose
/// pattern arrays are not read any more.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_plan_destroy(plan: *mut kvferry_plan) {
    guard("kvferry_plan_destroy", || {
        if !plan.is_null() {
            // SAFETY: a live plan, destroyed once (the caller's contract).
            drop(unsafe { Box::from_raw(plan) });
        }
        Ok(())
    });
}

/// The plan's size: `*patterns` its patterns, `*fragments` its fragments once expanded (each
/// pattern's fragments times its row pairs, summed), `*bytes` the bytes it moves. Any of the
/// three may be NULL.
///
/// # Safety
///
/// `plan` is NULL or a live plan; each output is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_plan_size(
    plan: *const kvferry_plan,
    patterns: *mut usize,
    fragments: *mut usize,
    bytes: *mut u64,
) -> c_int {
    guard("kvferry_plan_size", || {
        // SAFETY: NULL or a live plan (the caller's contract).
        let p = unsafe { deref(plan, "plan") }?;
        // SAFETY: each is NULL or writable (the caller's contract).
        unsafe {
            if !patterns.is_null() {
                patterns.write(p.patterns.len());
            }
            if !fragments.is_null() {
                fragments.write(p.fragments);
            }
            if !bytes.is_null() {
                bytes.write(p.bytes);
            }
        }
        Ok(())
    })
}

/// `*out` gets pattern `index` of the plan (its arrays live as long as the plan).
/// `KVFERRY_ERR_INVALID_ARGUMENT` for an index past the last pattern.
///
/// # Safety
///
/// `plan` is NULL or a live plan; `out` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_plan_get_pattern(
    plan: *const kvferry_plan,
    index: usize,
    out: *mut kvferry_plan_pattern,
) -> c_int {
    guard("kvferry_plan_get_pattern", || {
        // SAFETY: NULL or a live plan (the caller's contract).
        let p = unsafe { deref(plan, "plan") }?;
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let Some(a) = p.patterns.get(index) else {
            return Err(Failure::new(
                KVFERRY_ERR_INVALID_ARGUMENT,
                format!("pattern {index} of a plan with {}", p.patterns.len()),
            ));
        };
        let pattern = kvferry_plan_pattern {
            src_offsets: a.src_offsets.as_ptr(),
            dst_offsets: a.dst_offsets.as_ptr(),
            lengths: a.lengths.as_ptr(),
            n_fragments: a.lengths.len(),
            src_rows: a.src_rows.as_ptr(),
            dst_rows: a.dst_rows.as_ptr(),
            n_rows: a.src_rows.len(),
        };
        // SAFETY: non-NULL and writable (the caller's contract).
        unsafe { out.write(pattern) };
        Ok(())
    })
}

/// Expands the plan into `src`, `dst` and `len` (absolute addresses and lengths, in plan
/// order: pattern by pattern, row pair by row pair, fragment by fragment), each with room for
/// `cap` entries; `*n_out` gets the fragment count. Size query: all three NULL with `cap` 0.
/// A `cap` below the count gives `KVFERRY_ERR_BUFFER_TOO_SMALL` and writes nothing.
///
/// # Safety
///
/// `plan` is NULL or a live plan; `src`, `dst` and `len` are NULL or writable for `cap`
/// entries each; `n_out` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvferry_plan_expand(
    plan: *const kvferry_plan,
    src: *mut u64,
    dst: *mut u64,
    len: *mut u64,
    cap: usize,
    n_out: *mut usize,
) -> c_int {
    guard("kvferry_plan_expand", || {
        // SAFETY: NULL or a live plan (the caller's contract).
        let p = unsafe { deref(plan, "plan") }?;
        if n_out.is_null() {
            return Err(Failure::null("n_out"));
        }
        // SAFETY: non-NULL and writable (the caller's contract).
        unsafe { n_out.write(p.fragments) };
        if cap == 0 && src.is_null() && dst.is_null() && len.is_null() {
            return Ok(());
        }
        if cap < p.fragments {
            return Err(Failure::new(
                KVFERRY_ERR_BUFFER_TOO_SMALL,
                format!(
                    "the plan has {} fragments, the arrays room for {cap}",
                    p.fragments
                ),
            ));
        }
        if p.fragments > 0 && (src.is_null() || dst.is_null() || len.is_null()) {
            return Err(Failure::null("src, dst or len"));
        }
        let mut k = 0;
        for a in &p.patterns {
            for (&src_row, &dst_row) in a.src_rows.iter().zip(&a.dst_rows) {
                for f in 0..a.lengths.len() {
                    // SAFETY: `k < p.fragments <= cap`, and each array is writable for
                    // `cap` entries (the caller's contract).
                    unsafe {
                        src.add(k).write(src_row + a.src_offsets[f]);
                        dst.add(k).write(dst_row + a.dst_offsets[f]);
                        len.add(k).write(a.lengths[f]);
                    }
                    k += 1;
                }
            }
        }
        debug_assert_eq!(k, p.fragments);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_cut_at_a_character_boundary() {
        let mut out = [1 as c_char; 5];
        assert!(!copy_text(&mut out, "abc"));
        assert_eq!(
            &out[..4],
            &[b'a' as c_char, b'b' as c_char, b'c' as c_char, 0]
        );
        // "aé" is 3 bytes; with room for 2 the é (2 bytes) would be split, so only "a" fits.
        let mut out = [1 as c_char; 3];
        assert!(copy_text(&mut out, "aéz"));
        assert_eq!(&out[..2], &[b'a' as c_char, 0]);
    }

    #[test]
    fn an_event_is_696_bytes_as_the_cpp_check_expects() {
        assert_eq!(std::mem::size_of::<kvferry_event>(), 696);
        assert_eq!(std::mem::align_of::<kvferry_event>(), 8);
    }

    #[test]
    fn the_stats_are_plain_u64s_and_hold_every_failure_kind() {
        assert_eq!(
            std::mem::size_of::<kvferry_agent_stats>(),
            (11 + 16 + 28) * 8
        );
        for kind in FAILURE_KINDS {
            assert!(
                (failure_kind(kind) as usize) < KVFERRY_STATS_FAILURE_SLOTS,
                "{kind}"
            );
        }
    }

    #[test]
    fn every_status_has_its_name() {
        for s in kvferry_status::ALL {
            // SAFETY: a static C string.
            let name = unsafe { CStr::from_ptr(kvferry_status_name(s as c_int)) };
            assert!(name.to_str().unwrap().starts_with("KVFERRY_"), "{name:?}");
            assert!(format!("{s:?}") == name.to_str().unwrap());
        }
        // SAFETY: a static C string.
        let unknown = unsafe { CStr::from_ptr(kvferry_status_name(-5)) };
        assert_eq!(unknown, c"KVFERRY_UNKNOWN_STATUS");
        // SAFETY: a static C string.
        let version = unsafe { CStr::from_ptr(kvferry_version()) };
        assert_eq!(version.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
