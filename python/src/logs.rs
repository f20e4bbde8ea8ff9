//! kvferry's `tracing` events as records of Python's `logging`, so an engine's handlers,
//! formats and levels apply to them as to its own.
//!
//! An event becomes a record of the logger `kvferry.<crate>.<module>` (the target with its
//! `kvferry_` prefix dropped: `kvferry.transfer.agent.prefill`). Events are raised on
//! kvferry's own threads, which must never wait for the GIL (the thread holding it may be
//! waiting for them), so each goes into a bounded queue and one forwarding thread hands it to
//! Python; when the queue is full the record is dropped and counted, and the next one
//! delivered says how many went missing. [`flush`] waits until what was queued is delivered
//! (the package calls it at exit).
//!
//! What is forwarded is chosen as everywhere else (`kvferry_transfer::logging`): `KVFERRY_LOG`
//! or `RUST_LOG` when set, otherwise the effective level of the `kvferry` logger, read again
//! at every agent start.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::reload;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Records waiting for the forwarding thread; beyond this they are dropped and counted.
const QUEUE: usize = 4096;

/// One event, formatted, on its way to Python.
struct Record {
    /// Python's level number (`logging.DEBUG` = 10 ... `logging.ERROR` = 40).
    level: u8,
    logger: String,
    message: String,
}

/// How many records were queued and how many of those Python has had (delivered or
/// refused), so [`flush`] can wait for the ones queued before it.
#[derive(Default)]
struct Progress {
    queued: u64,
    done: u64,
}

struct Shared {
    progress: Mutex<Progress>,
    delivered: Condvar,
    dropped: AtomicU64,
}

/// The process's forwarding: its counters and the filter's reload handle.
struct Installed {
    shared: &'static Shared,
    reload: Option<reload::Handle<EnvFilter, tracing_subscriber::Registry>>,
}

static INSTALLED: OnceLock<Option<Installed>> = OnceLock::new();

/// Forwards events into the queue.
struct Forward {
    tx: SyncSender<Record>,
    shared: &'static Shared,
}

impl<S: Subscriber> tracing_subscriber::Layer<S> for Forward {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut text = Text::default();
        event.record(&mut text);
        let record = Record {
            level: python_level(*meta.level()),
            logger: logger_name(meta.target()),
            message: text.finish(),
        };
        // Counted before it can be delivered, so `done` never passes `queued`.
        self.shared
            .progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .queued += 1;
        // Full, or the forwarding thread is gone: dropped, and counted.
        if self.tx.try_send(record).is_err() {
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            mark_done(self.shared);
        }
    }
}

/// One queued record has reached Python, or never will.
fn mark_done(shared: &Shared) {
    shared
        .progress
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .done += 1;
    shared.delivered.notify_all();
}

/// An event's message, then its fields as `name=value`.
#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl Visit for Text {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

impl Text {
    fn finish(mut self) -> String {
        self.message.push_str(&self.fields);
        self.message
    }
}

fn python_level(level: Level) -> u8 {
    match level {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        // logging.DEBUG; TRACE has no level of its own in Python, and 5 would show under
        // handlers set to NOTSET only.
        Level::DEBUG | Level::TRACE => 10,
    }
}

/// `kvferry_transfer::agent::prefill` → `kvferry.transfer.agent.prefill`; any other target
/// goes under `kvferry.` with `::` as `.`.
fn logger_name(target: &str) -> String {
    let dotted = target.replace("::", ".");
    match dotted.strip_prefix("kvferry_") {
        Some(rest) => format!("kvferry.{rest}"),
        None if dotted == "kvferry" || dotted.starts_with("kvferry.") => dotted,
        None => format!("kvferry.{dotted}"),
    }
}

/// The filter when the environment chooses none: the `kvferry` logger's effective level.
fn filter_for_python(py: Python<'_>) -> (EnvFilter, Option<String>) {
    if kvferry::logging::from_env().is_some() {
        return kvferry::logging::filter("warn");
    }
    let level = py
        .import("logging")
        .and_then(|m| m.call_method1("getLogger", ("kvferry",)))
        .and_then(|l| l.call_method0("getEffectiveLevel"))
        .and_then(|l| l.extract::<i64>())
        .unwrap_or(30);
    let directives = match level {
        ..=10 => "kvferry=debug,warn",
        11..=20 => "kvferry=info,warn",
        21..=30 => "warn",
        _ => "error",
    };
    kvferry::logging::filter(directives)
}

/// Starts forwarding (once per process) or, when it runs, chooses the filter again from the
/// environment or the `kvferry` logger's level. Called at every agent start, with the GIL.
pub fn init(py: Python<'_>) {
    let (filter, warning) = filter_for_python(py);
    let mut filter = Some(filter);
    let installed = INSTALLED.get_or_init(|| {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            progress: Mutex::new(Progress::default()),
            delivered: Condvar::new(),
            dropped: AtomicU64::new(0),
        }));
        let (tx, rx) = sync_channel(QUEUE);
        let spawned = std::thread::Builder::new()
            .name("kvferry-log".into())
            .spawn(move || forward(rx, shared));
        if spawned.is_err() {
            // No thread to hand records to Python: they go to stderr as the C library's do.
            kvferry::logging::init_stderr("warn");
            return None;
        }
        let (layer, handle) = reload::Layer::new(filter.take().expect("taken once"));
        let subscriber = tracing_subscriber::registry()
            .with(layer)
            .with(Forward { tx, shared });
        // The process may have its own logger already (an embedding Rust program): it keeps it.
        let reload = subscriber.try_init().is_ok().then_some(handle);
        Some(Installed { shared, reload })
    });
    if let (
        Some(filter),
        Some(Installed {
            reload: Some(handle),
            ..
        }),
    ) = (filter, installed)
    {
        let _ = handle.reload(filter);
    }
    if let Some(warning) = warning {
        tracing::warn!("{warning}");
    }
}

/// The forwarding thread: each record to `logging.getLogger(name).log(level, "%s", message)`.
fn forward(rx: Receiver<Record>, shared: &'static Shared) {
    let mut reported = 0;
    while let Ok(mut record) = rx.recv() {
        let dropped = shared.dropped.load(Ordering::Relaxed);
        if dropped > reported {
            let _ = write!(
                record.message,
                " ({} earlier kvferry log records dropped: the queue to Python was full)",
                dropped - reported
            );
            reported = dropped;
        }
        let attached = Python::try_attach(|py| {
            let logger = py
                .import("logging")?
                .call_method1("getLogger", (record.logger.as_str(),))?;
            logger.call_method1("log", (record.level, "%s", record.message.as_str()))?;
            Ok::<(), PyErr>(())
        });
        mark_done(shared);
        if attached.is_none() {
            // The interpreter is gone (or going): nobody is left to hear.
            break;
        }
    }
}

/// Waits, without the GIL, until every record queued before the call has reached Python (at
/// most `timeout`); returns whether they all did.
pub fn flush(py: Python<'_>, timeout: Duration) -> bool {
    let Some(Some(installed)) = INSTALLED.get() else {
        return true;
    };
    let shared = installed.shared;
    py.detach(|| {
        let deadline = Instant::now() + timeout;
        let mut progress = shared
            .progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let target = progress.queued;
        while progress.done < target {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            progress = shared
                .delivered
                .wait_timeout(progress, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    })
}
