//! A prefill rank that restarts again and again (a new agent, a new epoch, a new port each
//! time): the decode rank links to each anew, drops each stale link when it closes, and
//! nothing piles up — no links, no threads. Alone in its test binary, so the thread count
//! is this test's.

mod support;

use std::time::Duration;

use kvferry_planner_abi::TokenRange;
use kvferry_transfer::agent::{Event, Expect, Send};
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
    let decode = agent(Role::Generation, &dst, secret(), Transport::Tcp);
    let mut baseline = None;
    for round in 0..12u64 {
        let prefill = agent(Role::Context, &src, secret(), Transport::Tcp);
        prefill
            .send(Send {
                request: round,
                tables: tables(&src, &[1]),
                tokens: TokenRange { start: 0, end: 16 },
                prompt_len: 16,
                is_last: true,
                to: None,
            })
            .unwrap();
        decode
            .expect(Expect {
                request: round,
                peer: "prefill".into(),
                endpoints: vec![prefill.endpoint().unwrap().into()],
                ctx_dp_rank: 0,
                prompt_len: 16,
                cached_prefix: None,
                tables: tables(&dst, &[2]),
                excluded_views: Vec::new(),
            })
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
    let (before, after) = (baseline.unwrap(), threads());
    assert!(
        after <= before + 2,
        "threads grew from {before} to {after} over 9 restarts"
    );
}
