//! `kvferry._kvferry`: the Python binding of kvferry's per-rank transfer agent
//! (`kvferry::agent::Agent`), re-exported by the `kvferry` package
//! (`python/kvferry/__init__.py`; `python/README.md` shows it in use).
//!
//! It takes the versioned configuration, JSON or TOML (`kvferry::config::load`, the same
//! parser `kvferry_agent_start` calls), releases the GIL around every agent call, reads slot
//! tables through the buffer protocol (a `memoryview`, copied once: the stable ABI of CPython
//! 3.9, which the extension targets, has no `Py_buffer`) without converting them to Python
//! lists, and turns every refusal, and any panic, into a `kvferry.Error` carrying `kind`,
//! `peer` and `detail`. Nothing here exits the process.

mod logs;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, PoisonError, RwLock};

use kvferry::abi::{SlotTable, TokenRange, ViewId};
use kvferry::agent::{
    Agent as RustAgent, CallError, Event as RustEvent, Expect, FAILURE_KINDS, SendChunk, StartError,
};
use kvferry::config::{ConfigError, error_chain, load};
use kvferry::planning::{PairPlanner as PlannerCore, Piece, PlanningError};
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyMemoryView, PyString};

pyo3::create_exception!(
    kvferry,
    Error,
    PyException,
    "A refused kvferry call: `kind` (config, planner, ucx, memory, listen, resources, role, \
     invalid, duplicate, unknown, metadata, stopped, panic, internal), `peer` (or None) and \
     `detail` (the text)."
);

/// A refusal on its way to Python: the `kind` of `kvferry.Error` and its text.
#[derive(Debug)]
struct Failure {
    kind: &'static str,
    peer: Option<String>,
    detail: String,
}

impl Failure {
    fn new(kind: &'static str, detail: impl Into<String>) -> Self {
        Self {
            kind,
            peer: None,
            detail: detail.into(),
        }
    }

    /// `kvferry.Error(f"{call}: {detail}")` with its attributes.
    fn into_py(self, py: Python<'_>, call: &str) -> PyErr {
        let err = Error::new_err(format!("{call}: {}", self.detail));
        let value = err.value(py);
        let set = value
            .setattr("kind", self.kind)
            .and_then(|()| value.setattr("peer", self.peer))
            .and_then(|()| value.setattr("detail", self.detail));
        match set {
            Ok(()) => err,
            Err(e) => e,
        }
    }
}

impl From<ConfigError> for Failure {
    fn from(e: ConfigError) -> Self {
        match e {
            ConfigError::Invalid(m) => Self::new("config", m),
            ConfigError::Planner(m) => Self::new("planner", m),
        }
    }
}

impl From<StartError> for Failure {
    fn from(e: StartError) -> Self {
        let kind = match &e {
            StartError::Config(_) => "config",
            StartError::Context { .. } | StartError::Worker(_) => "ucx",
            StartError::Memory(_) => "memory",
            StartError::Planner { .. } => "planner",
            StartError::Listen(_) => "listen",
            StartError::Spawn(_) | StartError::Io(_) => "resources",
            _ => "internal",
        };
        Self::new(kind, error_chain(&e))
    }
}

impl From<CallError> for Failure {
    fn from(e: CallError) -> Self {
        let kind = match &e {
            CallError::Role { .. } => "role",
            CallError::Invalid { .. } => "invalid",
            CallError::Duplicate { .. } => "duplicate",
            CallError::Unknown { .. } => "unknown",
            CallError::Metadata(_) => "metadata",
            CallError::Stopped => "stopped",
            _ => "internal",
        };
        Self::new(kind, error_chain(&e))
    }
}

/// Runs `body` with panics caught: an internal panic is a `Failure` of kind `panic`, never an
/// unwind through pyo3.
fn guarded<T>(body: impl FnOnce() -> Result<T, Failure>) -> Result<T, Failure> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(outcome) => outcome,
        Err(panic) => {
            let text = if let Some(s) = panic.downcast_ref::<&str>() {
                (*s).to_string()
            } else if let Some(s) = panic.downcast_ref::<String>() {
                s.clone()
            } else {
                "(no message)".into()
            };
            Err(Failure::new("panic", format!("panicked: {text}")))
        }
    }
}

/// A request's slot tables: a sequence (one per layer group) of 1-D, C-contiguous buffers of
/// native int32 (numpy `int32` arrays, `array.array('i')`, ...) or of sequences of ints.
fn slot_tables(tables: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<SlotTable>> {
    if tables.is_instance_of::<PyString>() || tables.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{what}: expected a sequence of slot tables (one per layer group), got {}",
            tables.get_type().name()?
        )));
    }
    if let Ok(view) = PyMemoryView::from(tables) {
        let one_buffer = view.getattr("ndim")?.extract::<usize>()? <= 1;
        view.call_method0("release")?;
        if one_buffer {
            return Err(PyTypeError::new_err(format!(
                "{what}: expected a sequence of slot tables (one per layer group), got one \
                 buffer (wrap a single table in a list: [table])"
            )));
        }
    }
    let iter = tables.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what}: expected a sequence of slot tables (one per layer group), got {}",
            tables
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    iter.enumerate()
        .map(|(i, table)| slot_table(&table?, &format!("{what}[{i}]")))
        .collect()
}

fn slot_table(table: &Bound<'_, PyAny>, what: &str) -> PyResult<SlotTable> {
    let Ok(view) = PyMemoryView::from(table) else {
        if table.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(format!(
                "{what}: a str is not a slot table"
            )));
        }
        let slots: Vec<i32> = table.extract().map_err(|e| {
            PyTypeError::new_err(format!(
                "{what}: expected an int32 buffer (numpy int32 array) or a sequence of ints \
                 within int32, got {} ({e})",
                table
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        return Ok(SlotTable::new(slots.into_iter().map(i64::from)));
    };
    let slots = buffer_slots(&view, what);
    // Unlocks the exporter (a bytearray cannot be resized while a view holds it).
    view.call_method0("release")?;
    Ok(SlotTable::new(slots?.into_iter().map(i64::from)))
}

/// The native int32 items of a 1-D, C-contiguous buffer, read through a `memoryview` (the
/// stable ABI before CPython 3.11 has no `Py_buffer`): one copy, `memoryview.tobytes()`.
fn buffer_slots(view: &Bound<'_, PyMemoryView>, what: &str) -> PyResult<Vec<i32>> {
    let ndim: usize = view.getattr("ndim")?.extract()?;
    if ndim != 1 {
        let shape: Vec<usize> = view.getattr("shape")?.extract()?;
        return Err(PyTypeError::new_err(format!(
            "{what}: a slot table must be 1-dimensional, this buffer has {ndim} dimensions \
             (shape {shape:?})"
        )));
    }
    let format: String = view.getattr("format")?.extract()?;
    let itemsize: usize = view.getattr("itemsize")?.extract()?;
    if itemsize != size_of::<i32>() || !is_native_i32(&format) {
        return Err(PyTypeError::new_err(format!(
            "{what}: a slot table must hold native int32 items (numpy dtype int32, buffer \
             format 'i'); this buffer's format is {format:?}"
        )));
    }
    if !view.getattr("c_contiguous")?.is_truthy()? {
        let strides: Vec<isize> = view.getattr("strides")?.extract()?;
        return Err(PyTypeError::new_err(format!(
            "{what}: a slot table must be C-contiguous (numpy: np.ascontiguousarray(table)); \
             this buffer's strides are {strides:?}"
        )));
    }
    let bytes = view.call_method0("tobytes")?;
    let bytes = bytes.cast::<PyBytes>()?.as_bytes();
    Ok(bytes
        .chunks_exact(size_of::<i32>())
        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// Whether a buffer format (`struct` syntax) names one native-endian 4-byte signed integer:
/// `i` (or `l` where a C `long` is 4 bytes) in native size, or `i`/`l` in standard size
/// with native byte order.
fn is_native_i32(format: &str) -> bool {
    let native_char = |c: char| match c {
        'i' => size_of::<std::ffi::c_int>() == 4,
        'l' => size_of::<std::ffi::c_long>() == 4,
        _ => false,
    };
    let native_order = |c: char| {
        c == '='
            || (cfg!(target_endian = "little") && c == '<')
            || (cfg!(target_endian = "big") && (c == '>' || c == '!'))
    };
    let mut chars = format.chars();
    match (chars.next(), chars.next(), chars.next()) {
        (Some(c), None, None) | (Some('@'), Some(c), None) => native_char(c),
        (Some(order), Some('i' | 'l'), None) => native_order(order),
        _ => false,
    }
}

/// What happened to a request: one terminal event per request and side.
#[pyclass(module = "kvferry", frozen, get_all)]
#[derive(Clone, Debug)]
struct Event {
    /// `"sent"`, `"received"`, `"cancelled"` or `"failed"` (`"unknown"`: a newer agent's).
    kind: &'static str,
    /// The request id.
    request: u64,
    /// `sent`: bytes written to all receivers; `received`: into this rank; else 0.
    bytes: u64,
    /// `received`: fragments written into this rank; else 0.
    fragments: u64,
    /// `received`: from `expect` to the last piece, in microseconds; else 0.
    latency_us: u64,
    /// `received`: the prefill ranks that wrote; else 0.
    writers: u32,
    /// `received`: the pieces that landed; else 0.
    pieces: u32,
    /// `failed`: why (`invalid`, `peer`, `refused`, `planner`, `timeout`, `lease`,
    /// `protocol`, `write`, `cancelled_by_peer`, `integrity`, `other`); else None.
    failure_kind: Option<String>,
    /// `failed`: the peer concerned (`instance rank N (epoch ...)`), if one is.
    peer: Option<String>,
    /// `failed`: what happened, in words; else None.
    detail: Option<String>,
}

impl Event {
    fn empty(kind: &'static str, request: u64) -> Self {
        Self {
            kind,
            request,
            bytes: 0,
            fragments: 0,
            latency_us: 0,
            writers: 0,
            pieces: 0,
            failure_kind: None,
            peer: None,
            detail: None,
        }
    }

    fn from_event(event: RustEvent) -> Self {
        match event {
            RustEvent::Sent { request, bytes, .. } => Self {
                bytes,
                ..Self::empty("sent", request)
            },
            RustEvent::Received { request, stats } => Self {
                bytes: stats.bytes,
                fragments: stats.fragments,
                latency_us: stats.latency_us,
                writers: stats.writers,
                pieces: stats.pieces,
                ..Self::empty("received", request)
            },
            RustEvent::Cancelled { request } => Self::empty("cancelled", request),
            RustEvent::Failed {
                request,
                peer,
                kind,
                detail,
            } => Self {
                failure_kind: Some(kind.to_string().replace('-', "_")),
                peer,
                detail: Some(detail),
                ..Self::empty("failed", request)
            },
            other => Self {
                detail: Some(format!("{other:?}")),
                ..Self::empty("unknown", other.request())
            },
        }
    }
}

#[pymethods]
impl Event {
    fn __repr__(&self) -> String {
        match self.kind {
            "failed" => format!(
                "Event(kind='failed', request={}, failure_kind={:?}, peer={:?}, detail={:?})",
                self.request,
                self.failure_kind.as_deref().unwrap_or(""),
                self.peer.as_deref().unwrap_or(""),
                self.detail.as_deref().unwrap_or(""),
            ),
            "received" => format!(
                "Event(kind='received', request={}, bytes={}, fragments={}, writers={}, \
                 pieces={}, latency_us={})",
                self.request,
                self.bytes,
                self.fragments,
                self.writers,
                self.pieces,
                self.latency_us
            ),
            kind => format!(
                "Event(kind='{kind}', request={}, bytes={})",
                self.request, self.bytes
            ),
        }
    }
}

/// One engine rank's transfer agent (see `kvferry/__init__.pyi`).
#[pyclass(module = "kvferry", frozen)]
struct Agent {
    /// `None` once closed. Calls hold the read lock while they run (with the GIL released),
    /// `close` takes the write lock, so it waits for them and the agent is gone when it returns.
    agent: RwLock<Option<RustAgent>>,
    /// Objects the engine asked the agent to keep referenced (its pools), until `close`.
    keep_alive: Mutex<Vec<Py<PyAny>>>,
}

impl Agent {
    /// Runs `f` on the live agent with the GIL released and panics caught.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        call: &str,
        f: impl FnOnce(&RustAgent) -> Result<T, Failure> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            guarded(|| {
                let guard = self.agent.read().unwrap_or_else(PoisonError::into_inner);
                match guard.as_ref() {
                    Some(agent) => f(agent),
                    None => Err(Failure::new("stopped", "the agent is closed")),
                }
            })
        })
        .map_err(|f| f.into_py(py, call))
    }

    fn shut(&self, py: Python<'_>) {
        py.detach(|| {
            let _ = guarded(|| {
                let taken = self
                    .agent
                    .write()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take();
                // Dropping quiesces: peers are told, connections end, the agent's threads
                // are joined (up to 2 s), so UCX lets go of the pools before this returns.
                drop(taken);
                Ok(())
            });
        });
        self.keep_alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

impl Drop for Agent {
    /// Collected without `close()`: the same quiesce, with the GIL released while it waits
    /// (up to 2 s) so other Python threads run; at interpreter shutdown, with it held.
    fn drop(&mut self) {
        let taken = self
            .agent
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(agent) = taken else { return };
        let _ = catch_unwind(AssertUnwindSafe(move || {
            let mut agent = Some(agent);
            Python::try_attach(|py| {
                let agent = agent.take();
                py.detach(move || drop(agent));
            });
            drop(agent);
        }));
    }
}

#[pymethods]
impl Agent {
    /// Starts one rank's agent from the configuration, JSON or TOML (version 1, the C API's).
    #[new]
    #[pyo3(signature = (config_json, keep_alive = None))]
    fn new(
        py: Python<'_>,
        config_json: &str,
        keep_alive: Option<Vec<Py<PyAny>>>,
    ) -> PyResult<Self> {
        let json = config_json.to_owned();
        logs::init(py);
        let agent = py
            .detach(move || {
                guarded(|| {
                    let (config, bound) = load(&json)?;
                    // SAFETY: the engine's promise, documented on `Agent` in the stubs and
                    // README as it is on `kvferry_agent_start`: every pool the page table
                    // names stays one live allocation at its address until `close()` (or
                    // the agent's collection) returns; kvferry writes nowhere else.
                    Ok(unsafe { RustAgent::start(config, bound) }?)
                })
            })
            .map_err(|f| f.into_py(py, "kvferry.Agent"))?;
        Ok(Self {
            agent: RwLock::new(Some(agent)),
            keep_alive: Mutex::new(keep_alive.unwrap_or_default()),
        })
    }

    /// A prefill rank's side-channel endpoint (`host:port`); None on decode ranks.
    fn endpoint(&self, py: Python<'_>) -> PyResult<Option<String>> {
        self.with(py, "Agent.endpoint", |a| {
            Ok(a.endpoint().map(str::to_owned))
        })
    }

    /// This rank's metadata, for a decode rank's `add_peer`.
    fn local_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.with(py, "Agent.local_metadata", |a| Ok(a.local_metadata()?))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Decode ranks: adds a prefill rank's metadata; returns the peer's identity.
    fn add_peer(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<String> {
        let bytes = metadata.to_vec();
        self.with(py, "Agent.add_peer", move |a| {
            Ok(a.add_peer(&bytes)?.to_string())
        })
    }

    /// Prefill ranks: makes tokens `[token_start, token_end)` of request `request` available.
    /// `views`: a layer-wise send carries only these `(group, view)` pairs (the layers
    /// computed so far); the next sends repeat the tokens with the views not sent yet, and
    /// `is_last` marks the one that ends the prompt and its views. None: every view not sent
    /// yet for these tokens.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (
        request, tables, token_start, token_end, prompt_len, is_last, to = None, views = None
    ))]
    fn send(
        &self,
        py: Python<'_>,
        request: u64,
        tables: &Bound<'_, PyAny>,
        token_start: u64,
        token_end: u64,
        prompt_len: u64,
        is_last: bool,
        to: Option<String>,
        views: Option<Vec<(u32, u32)>>,
    ) -> PyResult<()> {
        let tables = slot_tables(tables, "tables")?;
        let views = views.map(|v| {
            v.into_iter()
                .map(|(group, view)| ViewId { group, view })
                .collect()
        });
        self.with(py, "Agent.send", move |a| {
            Ok(a.send(SendChunk {
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
            })?)
        })
    }

    /// What the agent did since it started, as a dict: `sent`, `received`, `cancelled`,
    /// `failed` (kind name -> count, every kind), `bytes`, `fragments`, `pieces`, `puts`,
    /// `plan_ns`, `write_ns`, `queue_ns`, `latency_us` (a list: entry k counts requests that
    /// took under 2**k microseconds, the last one every longer one), `latency_sum_us`,
    /// `plan_us` and `queue_us` (the same requests by planning and by queueing time, bucketed
    /// alike), `in_flight` and `peers` (now).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(py, "Agent.stats", |a| Ok(a.stats()))?;
        let d = PyDict::new(py);
        d.set_item("sent", s.sent)?;
        d.set_item("received", s.received)?;
        d.set_item("cancelled", s.cancelled)?;
        let failed = PyDict::new(py);
        for (kind, count) in FAILURE_KINDS.iter().zip(s.failed) {
            failed.set_item(kind.as_ref(), count)?;
        }
        d.set_item("failed", failed)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("fragments", s.fragments)?;
        d.set_item("pieces", s.pieces)?;
        d.set_item("puts", s.puts)?;
        d.set_item("plan_ns", s.plan_ns)?;
        d.set_item("write_ns", s.write_ns)?;
        d.set_item("queue_ns", s.queue_ns)?;
        d.set_item("latency_us", s.latency_us.to_vec())?;
        d.set_item("latency_sum_us", s.latency_sum_us)?;
        d.set_item("plan_us", s.plan_us.to_vec())?;
        d.set_item("queue_us", s.queue_us.to_vec())?;
        d.set_item("in_flight", s.in_flight)?;
        d.set_item("peers", s.peers)?;
        Ok(d)
    }

    /// The same numbers in the Prometheus text format (version 0.0.4), labelled with this
    /// agent's instance, rank and role: `kvferry_requests_total{outcome}`,
    /// `kvferry_transfer_bytes_total`, `kvferry_transfer_duration_seconds`, ... for an engine
    /// to serve beside its own metrics.
    fn metrics_text(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, "Agent.metrics_text", |a| {
            Ok(kvferry::metrics::encode(&[kvferry::metrics::Sample::of(a)]))
        })
    }

    /// Decode ranks: tells prefill instance `peer` (through `endpoints`, or the ranks added
    /// with `add_peer` when empty) that this instance still wants `requests`, which its engine
    /// queued: their leases run again from now, up to ten leases after their send. Returns at
    /// once.
    fn hold(
        &self,
        py: Python<'_>,
        peer: String,
        endpoints: Vec<String>,
        requests: Vec<u64>,
    ) -> PyResult<()> {
        self.with(py, "Agent.hold", move |a| {
            Ok(a.hold(&peer, &endpoints, &requests)?)
        })
    }

    /// Decode ranks: expects request `request` from prefill instance `peer` into `tables`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (
        request, peer, endpoints, ctx_dp_rank, prompt_len, tables, cached_prefix = None,
        excluded_views = Vec::new()
    ))]
    fn expect(
        &self,
        py: Python<'_>,
        request: u64,
        peer: String,
        endpoints: Vec<String>,
        ctx_dp_rank: u32,
        prompt_len: u64,
        tables: &Bound<'_, PyAny>,
        cached_prefix: Option<u64>,
        excluded_views: Vec<(u32, u32)>,
    ) -> PyResult<()> {
        let tables = slot_tables(tables, "tables")?;
        self.with(py, "Agent.expect", move |a| {
            Ok(a.expect(Expect {
                request,
                peer,
                endpoints,
                ctx_dp_rank,
                prompt_len,
                cached_prefix: cached_prefix.filter(|&c| c != 0),
                tables,
                excluded_views: excluded_views
                    .into_iter()
                    .map(|(group, view)| ViewId { group, view })
                    .collect(),
            })?)
        })
    }

    /// Cancels a request; its terminal event answers.
    fn cancel(&self, py: Python<'_>, request: u64) -> PyResult<()> {
        self.with(py, "Agent.cancel", move |a| Ok(a.cancel(request)?))
    }

    /// Drains the events that wait, oldest first, and clears the wake descriptor.
    fn poll(&self, py: Python<'_>) -> PyResult<Vec<Event>> {
        self.with(py, "Agent.poll", |a| {
            Ok(a.poll().into_iter().map(Event::from_event).collect())
        })
    }

    /// A descriptor readable while events wait (owned by the agent: never close or read it).
    fn wake_fd(&self, py: Python<'_>) -> PyResult<i32> {
        self.with(py, "Agent.wake_fd", |a| Ok(a.wake_fd()))
    }

    /// Whether `close()` has run.
    #[getter]
    fn closed(&self) -> bool {
        self.agent
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    /// Stops the agent and waits until it let go of the pools (idempotent).
    fn close(&self, py: Python<'_>) {
        self.shut(py);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.shut(py);
        false
    }

    fn __repr__(&self) -> String {
        match self
            .agent
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            Some(a) => {
                // The endpoint when there is one (prefill ranks), never a Rust `Some(...)`.
                let me = a.identity();
                let endpoint = a
                    .endpoint()
                    .map(|e| format!(" endpoint='{e}'"))
                    .unwrap_or_default();
                format!(
                    "<kvferry.Agent instance='{}' rank={} role='{}'{endpoint}>",
                    me.instance,
                    me.rank,
                    a.role()
                )
            }
            None => "<kvferry.Agent closed>".into(),
        }
    }
}

impl From<PlanningError> for Failure {
    fn from(e: PlanningError) -> Self {
        let kind = match &e {
            PlanningError::Config { error, .. } => match error {
                ConfigError::Planner(_) => "planner",
                _ => "config",
            },
            PlanningError::Planner(_) => "planner",
            _ => "invalid",
        };
        Self::new(kind, e.to_string())
    }
}

/// kvferry's planner for one (prefill rank, decode rank) pair, without an agent: for an
/// engine that moves the bytes with another transfer layer (NIXL, Mooncake, its own copies).
/// Built from the JSON configurations the two ranks' agents would read (roles `context` and
/// `generation`; no secret needed); each side's planner is bound and started on its rank and
/// vets the other. Plans are validated as the agent validates them before a byte moves.
#[pyclass(module = "kvferry", frozen)]
struct PairPlanner {
    planner: kvferry::planning::PairPlanner,
}

#[pymethods]
impl PairPlanner {
    #[new]
    fn new(py: Python<'_>, prefill_config: &str, decode_config: &str) -> PyResult<Self> {
        let (prefill, decode) = (prefill_config.to_owned(), decode_config.to_owned());
        logs::init(py);
        let planner = py
            .detach(move || guarded(|| Ok(PlannerCore::new(&prefill, &decode)?)))
            .map_err(|f| f.into_py(py, "kvferry.PairPlanner"))?;
        Ok(Self { planner })
    }

    /// Whether the prefill rank writes the decode rank at all (the planner's targets for
    /// the decode rank's DP group); a pair it does not write has nothing to plan.
    #[getter]
    fn writes(&self) -> bool {
        self.planner.writes()
    }

    /// The bound planner's id.
    #[getter]
    fn planner_id(&self) -> String {
        self.planner.planner_id().to_string()
    }

    /// Plans tokens `[token_start, token_end)` of a `prompt_len`-token prompt from the
    /// prefill rank's slots (`prefill_tables`, one per layer group) to the decode rank's
    /// (`decode_tables`) and validates the plan. `dst_start_token`: where the decode side's
    /// copy starts (a cached prefix). `views`: the prefill rank's `(group, view)` pairs this
    /// piece carries (layer-wise); None: every view.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (
        prefill_tables, decode_tables, token_start, token_end, prompt_len,
        dst_start_token = None, views = None
    ))]
    fn plan(
        &self,
        py: Python<'_>,
        prefill_tables: &Bound<'_, PyAny>,
        decode_tables: &Bound<'_, PyAny>,
        token_start: u64,
        token_end: u64,
        prompt_len: u64,
        dst_start_token: Option<u64>,
        views: Option<Vec<(u32, u32)>>,
    ) -> PyResult<Plan> {
        let piece = Piece {
            prefill_tables: slot_tables(prefill_tables, "prefill_tables")?,
            decode_tables: slot_tables(decode_tables, "decode_tables")?,
            tokens: TokenRange {
                start: token_start,
                end: token_end,
            },
            prompt_len,
            dst_start_token,
            views: views.map(|v| {
                v.into_iter()
                    .map(|(group, view)| ViewId { group, view })
                    .collect()
            }),
        };
        let planner = &self.planner;
        let plan = py
            .detach(|| guarded(|| Ok(planner.plan(&piece)?)))
            .map_err(|f| f.into_py(py, "PairPlanner.plan"))?;
        let patterns = plan.patterns();
        Ok(Plan {
            bytes: plan.total_bytes(),
            // What `expand` yields: each pattern's fragments once per row pair.
            fragments: patterns
                .iter()
                .map(|p| p.fragments.len() * p.rows.len())
                .sum(),
            patterns,
        })
    }

    fn __repr__(&self) -> String {
        format!("<kvferry.PairPlanner {:?}>", self.planner)
    }
}

/// A plan pattern as Python lists: `(src offset, dst offset, length)` fragments, then
/// `(src row, dst row)` pairs.
type PatternLists = (Vec<(u64, u64, u64)>, Vec<(u64, u64)>);

/// A validated plan (`PairPlanner.plan`): addresses in the two ranks' pools as their
/// configurations declare them.
#[pyclass(module = "kvferry", frozen)]
struct Plan {
    /// Bytes it moves.
    #[pyo3(get)]
    bytes: u64,
    /// Fragments once expanded.
    #[pyo3(get)]
    fragments: usize,
    patterns: Vec<kvferry::planning::Pattern>,
}

#[pymethods]
impl Plan {
    /// The plan as patterns: a list of `(fragments, rows)`, where `fragments` is a list of
    /// `(src_offset, dst_offset, length)` and `rows` a list of `(src_row, dst_row)`; every
    /// fragment lands once per row pair at `(src_row + src_offset, dst_row + dst_offset)`. A
    /// flat plan is one pattern whose only row pair is `(0, 0)`.
    fn patterns(&self) -> Vec<PatternLists> {
        self.patterns
            .iter()
            .map(|p| (p.fragments.clone(), p.rows.clone()))
            .collect()
    }

    /// Every fragment as `(src_address, dst_address, length)`, in plan order (pattern by
    /// pattern, row pair by row pair): the descriptor lists another transfer layer takes.
    fn expand(&self) -> Vec<(u64, u64, u64)> {
        let mut out = Vec::with_capacity(self.fragments);
        for p in &self.patterns {
            for &(src_row, dst_row) in &p.rows {
                out.extend(
                    p.fragments
                        .iter()
                        .map(|&(s, d, len)| (src_row + s, dst_row + d, len)),
                );
            }
        }
        out
    }

    fn __len__(&self) -> usize {
        self.fragments
    }

    fn __repr__(&self) -> String {
        format!(
            "<kvferry.Plan {} bytes, {} fragments in {} pattern(s)>",
            self.bytes,
            self.fragments,
            self.patterns.len()
        )
    }
}

/// Waits until every kvferry log record raised so far has reached Python's `logging` (at
/// most `timeout` seconds); returns whether they all did. The package calls it at exit.
#[pyfunction]
#[pyo3(signature = (timeout = 1.0))]
fn flush_logs(py: Python<'_>, timeout: f64) -> PyResult<bool> {
    let timeout = std::time::Duration::try_from_secs_f64(timeout).map_err(|_| {
        PyValueError::new_err(format!(
            "flush_logs: timeout {timeout} is not a duration in seconds"
        ))
    })?;
    Ok(logs::flush(py, timeout))
}

/// What this process runs, as `kvferry doctor` reports it for the command: `kvferry` and
/// `planner_abi` (versions), `extension` (the file of this module), `ucx` (the loaded
/// library's version) and `ucx_libraries` (its files mapped into the process), `plugin_dirs`
/// (where an agent whose configuration names no `plugin_dir` looks) and `planners` (what
/// loads from there: `id`, `version`, `file`), `skipped` (files there that did not load, and
/// why).
#[pyfunction]
fn doctor(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let (dirs, registry) = py.detach(|| {
        let dirs = kvferry::default_plugin_dirs();
        let registry = kvferry::registry::Registry::scan(&dirs);
        (dirs, registry)
    });
    let d = PyDict::new(py);
    d.set_item("kvferry", env!("CARGO_PKG_VERSION"))?;
    d.set_item("planner_abi", kvferry::abi::ABI_VERSION)?;
    d.set_item(
        "extension",
        kvferry::library_file().map(|p| p.display().to_string()),
    )?;
    let (major, minor, release) = kvferry::ucx_library::release();
    d.set_item("ucx", format!("{major}.{minor}.{release}"))?;
    let loaded: Vec<String> = kvferry::ucx_library::loaded_libraries()
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    d.set_item("ucx_libraries", loaded)?;
    let shown: Vec<String> = dirs.iter().map(|p| p.display().to_string()).collect();
    d.set_item("plugin_dirs", shown)?;
    let planners = pyo3::types::PyList::empty(py);
    for p in registry.planners() {
        let entry = PyDict::new(py);
        entry.set_item("id", &p.id)?;
        entry.set_item("version", &p.version)?;
        entry.set_item("file", p.path.display().to_string())?;
        planners.append(entry)?;
    }
    d.set_item("planners", planners)?;
    let skipped: Vec<(String, String)> = registry
        .skipped()
        .iter()
        .map(|s| (s.path.display().to_string(), error_chain(&s.reason)))
        .collect();
    d.set_item("skipped", skipped)?;
    Ok(d)
}

/// The extension module.
#[pymodule]
fn _kvferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(flush_logs, m)?)?;
    m.add_function(wrap_pyfunction!(doctor, m)?)?;
    m.add_class::<Agent>()?;
    m.add_class::<Event>()?;
    m.add_class::<PairPlanner>()?;
    m.add_class::<Plan>()?;
    m.add("Error", m.py().get_type::<Error>())?;
    m.add("CONFIG_VERSION", kvferry::CONFIG_VERSION)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
