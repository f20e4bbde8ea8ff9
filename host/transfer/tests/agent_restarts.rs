//! A prefill rank that restarts again and again (a new agent, a new epoch, a new port each
//! time): the decode rank links to each anew, drops each stale link when it closes, and
//! nothing piles up — no links, no threads. Alone in its test binary, so the thread count
//! is this test's.

mod support;

use std::time::Duration;

use kvferry_transfer::agent::Event;
use kvferry_transfer::{Role, Transport};

use support::*;

/// Threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

#[test]
fn a_prefill_that_restarts_again_and_again_is_linked_anew_and_nothing_piles_up() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let mut baseline = None;
    for round in 0..12u64 {
        let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
        prefill.send(whole(round, tables(&src, &[1]), 16)).unwrap();
        decode
            .expect(expecting(
                round,
                prefill.endpoint().unwrap(),
                tables(&dst, &[2]),
                16,
            ))
            .unwrap();
        let got = wait(&decode, round, Duration::from_secs(10));
        assert!(
            matches!(got, Event::Received { .. }),
            "round {round}: {got:?}"
        );
        drop(prefill);
        // The decode notices the restart when the old link closes.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while decode.connections() != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: a stale link stays"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        if round == 2 {
            baseline = Some(threads());
        }
    }
    // A dropped agent's connection threads exit on their own once their sockets close:
    // give them a moment (a leak of one per restart would be 9 or more, and stays).
    let before = baseline.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut after = threads();
    while after > before + 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        after = threads();
    }
    assert!(
        after <= before + 2,
        "threads grew from {before} to {after} over 9 restarts"
    );
}
