//! A decode rank that leaves lets its prefill rank close its UCX endpoint to it first: its
//! agent's drop half-closes the side channel and returns only once the prefill rank, having
//! closed the endpoint, closed its end too. Before, the decode's worker could go first, and the
//! prefill's closing flush then failed over tcp ("error during flush: Connection reset by
//! remote peer", logged by UCX as an error for an endpoint without peer error handling; it
//! failed CI once). It installs the process's tracing subscriber (the suite's other tests log
//! nothing through one) and reads what its own prefill rank thread logs.

use crate::support;

use std::fmt;
use std::sync::{Mutex, Once};
use std::time::Duration;

use kvferry_transfer::agent::Event;
use kvferry_transfer::{Role, Transport};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

use support::*;

/// The prefill agent's instance, and so its rank thread's name (`{instance}-rank0`).
const PREFILL: &str = "departure-prefill";

/// What the prefill's rank thread logged, in order: level and message.
static CLOSES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The record, whatever a panicking holder left.
fn logged() -> std::sync::MutexGuard<'static, Vec<String>> {
    CLOSES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records the events of the prefill's rank thread.
struct Closes;

struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for Closes {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if std::thread::current().name() != Some(&format!("{PREFILL}-rank0")) {
            return;
        }
        let mut m = Message(String::new());
        event.record(&mut m);
        logged().push(format!("{} {}", event.metadata().level(), m.0));
    }
}

#[test]
fn a_leaving_decode_rank_outlasts_its_prefill_ranks_endpoint_to_it_over_tcp() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        tracing_subscriber::registry()
            .with(Closes)
            .try_init()
            .expect("no other tracing subscriber in this test binary");
    });
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    // The prefill's rank thread is busy when the decode leaves: its job holds 200 ms before
    // its flush, and the endpoint can be closed only after.
    let (gate, entered) = FlushGate::new(Duration::from_millis(200));
    let prefill = start(Role::Prefill, &src, secret(), bound(), |c| {
        c.instance = PREFILL.into();
        c.transport = Transport::Tcp.into();
        c.harness.hook = Some(gate);
    });
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    prefill.send(whole(1, tables(&src, &[1]), 16)).unwrap();
    let mut expect = expecting(1, prefill.endpoint().unwrap(), tables(&dst, &[2]), 16);
    expect.peer = PREFILL.into();
    decode.expect(expect).unwrap();
    entered
        .recv_timeout(Duration::from_secs(10))
        .expect("the prefill's job reached its flush");
    let before = std::mem::take(&mut *logged());
    assert!(
        before
            .iter()
            .all(|m| !m.contains("endpoint") && !m.contains("quarantined")),
        "{before:?}"
    );

    // Its worker is destroyed by the time the drop returns: the prefill rank's endpoint to it
    // must have been closed before, and cleanly. The job, whose receiver left while it was
    // held, failed and left its flush quarantined on the endpoint; the endpoint closed when
    // the quarantine released it (were the job done, `forget` would have closed it at once).
    drop(decode);
    let closes = logged().clone();
    let clean = [
        "DEBUG endpoint closed",
        "INFO quarantined operations finished; released",
    ];
    assert!(
        closes.iter().any(|m| clean.contains(&m.as_str())),
        "no endpoint closed before the decode's worker went: {closes:?}"
    );
    assert_eq!(prefill.connections(), 0);
    // The request ends on the prefill too (its receiver left before it was done).
    let ended = wait(&prefill, 1, Duration::from_secs(10));
    assert!(matches!(ended, Event::Failed { .. }), "{ended:?}");
    drop(prefill);
    let closes = logged().clone();
    assert!(
        closes
            .iter()
            .all(|m| !m.contains("uncleanly") && !m.contains("operation failed")),
        "{closes:?}"
    );
}
