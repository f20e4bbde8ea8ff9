//! Leases held by the receiver: a decode instance whose engine queued a request longer than
//! the prefill's lease keeps its data by holding it (`Agent::hold`), and then gets every
//! byte; a hold from an instance the send is not for, or past ten leases, does not keep it.

use crate::support;

use std::time::{Duration, Instant};

use kvferry_transfer::Role;
use kvferry_transfer::agent::{Agent, Event, FailureKind};

use support::*;

const LEASE: Duration = Duration::from_millis(300);

/// A prefill engine (patterned) and a decode engine (canaries) of the test model.
fn engines() -> (Engine, Engine) {
    let model = model();
    (
        Engine::new("prefill", &model, pattern),
        Engine::new("decode", &model, |_, _| CANARY),
    )
}

/// A prefill agent (lease [`LEASE`]) over `src` and a decode agent over `dst`, linked.
fn linked_pair(src: &Engine, dst: &Engine) -> (Agent, Agent) {
    let prefill = start(Role::Prefill, src, secret(), bound(), |c| c.lease = LEASE);
    let decode = agent(
        Role::Decode,
        dst,
        secret(),
        kvferry_transfer::Transport::Tcp,
    );
    linked(&prefill, &decode, src, dst);
    (prefill, decode)
}

/// Moves request 100 (slot 7 to slot 7) first, so the decode rank's link to the prefill rank
/// exists before the clock of a lease matters (a first dial on a loaded host can take longer
/// than a short lease).
fn linked(prefill: &Agent, decode: &Agent, src: &Engine, dst: &Engine) {
    let endpoint = prefill.endpoint().unwrap().to_string();
    prefill.send(whole(100, tables(src, &[7]), 16)).unwrap();
    decode
        .expect(expecting(100, &endpoint, tables(dst, &[7]), 16))
        .unwrap();
    assert!(matches!(
        wait(decode, 100, Duration::from_secs(10)),
        Event::Received { .. }
    ));
    assert!(matches!(
        wait(prefill, 100, Duration::from_secs(10)),
        Event::Sent { .. }
    ));
}

/// Holds `request` every 100 ms for `span`, checking the prefill never ended it meanwhile.
fn hold_for(decode: &Agent, prefill: &Agent, request: u64, span: Duration) {
    let endpoint = prefill.endpoint().unwrap().to_string();
    let until = Instant::now() + span;
    while Instant::now() < until {
        decode
            .hold("prefill", std::slice::from_ref(&endpoint), &[request])
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            prefill.poll().is_empty(),
            "the prefill ended a held request"
        );
    }
}

#[test]
fn a_held_request_outlives_its_lease_and_lands_byte_for_byte() {
    let (src, dst) = engines();
    let (prefill, decode) = linked_pair(&src, &dst);
    prefill.send(whole(1, tables(&src, &[3, 6]), 20)).unwrap();
    // Queued at the decode for three leases, held meanwhile.
    hold_for(&decode, &prefill, 1, LEASE * 3);
    let endpoint = prefill.endpoint().unwrap().to_string();
    decode
        .expect(expecting(1, &endpoint, tables(&dst, &[4, 2]), 20))
        .unwrap();
    let got = wait(&decode, 1, Duration::from_secs(10));
    assert!(matches!(got, Event::Received { .. }), "{got:?}");
    assert!(matches!(
        wait(&prefill, 1, Duration::from_secs(10)),
        Event::Sent { .. }
    ));
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[3, 7], &[4, 7], Some((6, 2)));
}

#[test]
fn holds_keep_only_what_they_may_and_only_for_ten_leases() {
    let (src, dst) = engines();
    let (prefill, decode) = linked_pair(&src, &dst);
    let endpoint = prefill.endpoint().unwrap().to_string();
    // Request 1 is for another decode instance: this one's holds do not count.
    let mut other = whole(1, tables(&src, &[0]), 16);
    other.to = Some("another-decode".into());
    prefill.send(other).unwrap();
    // Request 2 is held without end: it ends ten leases after its send.
    prefill.send(whole(2, tables(&src, &[1]), 16)).unwrap();
    let sent = Instant::now();
    let mut ended = std::collections::BTreeMap::new();
    while ended.len() < 2 {
        decode
            .hold("prefill", std::slice::from_ref(&endpoint), &[1, 2])
            .unwrap();
        for e in prefill.poll() {
            ended.insert(e.request(), (e, sent.elapsed()));
        }
        assert!(sent.elapsed() < LEASE * 20, "{ended:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    for (request, (event, after)) in &ended {
        let Event::Failed { kind, detail, .. } = event else {
            panic!("{event:?}");
        };
        assert_eq!(*kind, FailureKind::Lease, "{event:?}");
        if *request == 1 {
            assert!(*after < LEASE * 3, "request 1 was held: {after:?}");
        } else {
            assert!(*after >= LEASE * 10, "request 2 ended early: {after:?}");
            assert!(
                detail.contains("held by its receiver for 3000 ms"),
                "{detail}"
            );
        }
    }
    // Both counted as lease failures.
    let stats = prefill.stats();
    assert_eq!(stats.failed_of(FailureKind::Lease), 2, "{stats:?}");
    assert_eq!(
        (stats.sent, stats.failed_total(), stats.in_flight),
        (1, 2, 0)
    );
    // A prefill rank holds nothing.
    assert!(prefill.hold("decode", &[], &[1]).is_err());
}
