//! A decode rank that leaves lets its prefill rank close its UCX endpoint to it first: the
//! decode half-closes the side channel and keeps its worker until the prefill rank, having
//! closed the endpoint, has closed its end too. Before, the decode's worker could go first, and
//! the prefill's closing flush then failed over tcp ("error during flush: Connection reset by
//! remote peer" or "Endpoint timeout", logged by UCX as an error for an endpoint without peer
//! error handling; it failed CI once). These tests install the process's tracing subscriber
//! (the suite's other tests log nothing through one) and read what their own prefill rank
//! thread logs.

use crate::support;

use std::fmt;
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use kvferry_transfer::agent::{Agent, Event};
use kvferry_transfer::{Role, Transport};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

use support::*;

/// What the rank threads of this file's prefill agents logged, in order: the thread's name,
/// and the event's level and message.
static LOGGED: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// Where this file's prefill instances are named, and so their rank threads
/// (`{instance}-rank0`).
const PREFIX: &str = "departure-";

/// What the rank thread of prefill `instance` logged so far, as "LEVEL message".
fn logged(instance: &str) -> Vec<String> {
    let thread = format!("{instance}-rank0");
    LOGGED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(t, _)| *t == thread)
        .map(|(_, m)| m.clone())
        .collect()
}

/// Records the events of this file's prefill rank threads.
struct Record;

struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for Record {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let thread = std::thread::current();
        let Some(name) = thread.name().filter(|n| n.starts_with(PREFIX)) else {
            return;
        };
        let mut m = Message(String::new());
        event.record(&mut m);
        let line = format!("{} {}", event.metadata().level(), m.0);
        LOGGED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((name.to_string(), line));
    }
}

/// Installs the recording subscriber (once for the binary).
fn install() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        tracing_subscriber::registry()
            .with(Record)
            .try_init()
            .expect("no other tracing subscriber in this test binary");
    });
}

/// Whether the prefill's rank thread has logged closing its endpoint, cleanly: at once
/// (`forget`), or when a quarantine released the window that held it.
fn closed_cleanly(logged: &[String]) -> bool {
    let clean = [
        "DEBUG endpoint closed",
        "INFO quarantined operations finished; released",
    ];
    logged.iter().any(|m| clean.contains(&m.as_str()))
}

/// Nothing the prefill's rank thread logged says an endpoint closed badly.
fn nothing_unclean(logged: &[String]) {
    assert!(
        logged
            .iter()
            .all(|m| !m.contains("uncleanly") && !m.contains("operation failed")),
        "{logged:?}"
    );
}

/// Prefill agent `instance`, whose every job holds 200 ms before its flush, a decode agent,
/// and request 1 under way between them, held at its flush.
fn held_request(instance: &str, src: &Engine, dst: &Engine) -> (Agent, Agent) {
    install();
    let (gate, entered) = FlushGate::new(Duration::from_millis(200));
    let prefill = start(Role::Prefill, src, secret(), bound(), |c| {
        c.instance = instance.into();
        c.transport = Transport::Tcp.into();
        c.harness.hook = Some(gate);
    });
    let decode = agent(Role::Decode, dst, secret(), Transport::Tcp);
    prefill.send(whole(1, tables(src, &[1]), 16)).unwrap();
    let mut expect = expecting(1, prefill.endpoint().unwrap(), tables(dst, &[2]), 16);
    expect.peer = instance.into();
    decode.expect(expect).unwrap();
    entered
        .recv_timeout(Duration::from_secs(10))
        .expect("the prefill's job reached its flush");
    let before = logged(instance);
    assert!(
        before
            .iter()
            .all(|m| !m.contains("endpoint") && !m.contains("quarantined")),
        "{before:?}"
    );
    (prefill, decode)
}

#[test]
fn a_leaving_decode_rank_outlasts_its_prefill_ranks_endpoint_to_it_over_tcp() {
    let instance = "departure-prefill-a";
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let (prefill, decode) = held_request(instance, &src, &dst);

    // Its worker is destroyed by the time the drop returns: the prefill rank's endpoint to it
    // must have been closed before, and cleanly. The job, whose receiver left while it was
    // held, failed and left its flush quarantined on the endpoint; the endpoint closed when
    // the quarantine released it (were the job done, `forget` would have closed it at once).
    drop(decode);
    let closes = logged(instance);
    assert!(
        closed_cleanly(&closes),
        "no endpoint closed before the decode's worker went: {closes:?}"
    );
    assert_eq!(prefill.connections(), 0);
    // The request ends on the prefill too (its receiver left before it was done).
    let ended = wait(&prefill, 1, Duration::from_secs(10));
    assert!(matches!(ended, Event::Failed { .. }), "{ended:?}");
    drop(prefill);
    nothing_unclean(&logged(instance));
}

/// Both leave, the prefill first: its goodbye ends the decode's link before the prefill has
/// closed its endpoint (its job is held at its flush), and the decode must still keep its
/// worker until the prefill's end of the side channel has closed.
#[test]
fn a_decode_rank_leaving_after_its_prefill_ranks_goodbye_still_waits_for_its_close() {
    let instance = "departure-prefill-b";
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let (prefill, decode) = held_request(instance, &src, &dst);

    std::thread::scope(|scope| {
        let leaving = scope.spawn(move || drop(prefill));
        // The decode hears the prefill's goodbye: its link ends.
        let heard = Instant::now() + Duration::from_secs(5);
        while decode.connections() != 0 {
            assert!(Instant::now() < heard, "the goodbye never came");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(decode);
        let closes = logged(instance);
        assert!(
            closed_cleanly(&closes),
            "no endpoint closed before the decode's worker went: {closes:?}"
        );
        leaving.join().unwrap();
    });
    nothing_unclean(&logged(instance));
}
