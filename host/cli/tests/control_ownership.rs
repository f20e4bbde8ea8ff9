//! What `kvferry serve` lets a controller do to requests, and when it lets their slots go:
//! a request belongs to the control connection that submitted it (another controller holding
//! the same secret cannot release, cancel, verify, time or replay it, also once its owner has
//! gone), and slots whose request an agent ended on every rank come back without a release.

use crate::support;

use std::time::Duration;

use kvferry_harness::Client;
use kvferry_harness::control::{ControlMessage as Message, Submit};
use support::transfer::{
    REPLY, Server, prefill, release, start, submit, verify, verify_idle, wait_done,
};

const DEEPSEEK: &str = "deepseek-v3";
const MLA: &str = "kvferry.deepseek_mla_latent";
/// DeepSeek-V3 keeps 32 tokens per block: 1,400 tokens take 44 of each pool's 48 slots, so
/// two such requests cannot be held at once.
const BIG: u64 = 1400;

fn deepseek(role: &'static str, spec: &str, extra: &[&str]) -> Server {
    let mut args = vec!["--planner", MLA];
    args.extend_from_slice(extra);
    Server::start(role, DEEPSEEK, spec, "shm", &args)
}

/// Asserts that `error` refuses request `id` as another controller's.
#[track_caller]
fn assert_foreign(error: &str, id: u64) {
    assert!(
        error.contains(&format!("request {id} "))
            && error.contains("belongs to another controller"),
        "{error}"
    );
}

/// `message` about request `id`, answered with `Refused`: its reason.
#[track_caller]
fn refused(client: &Client, id: u64, message: Message) -> String {
    match client.call(message, REPLY).unwrap() {
        Message::Refused { request, message } => {
            assert_eq!(request, id);
            message
        }
        other => panic!("expected Refused for request {id}, got {other:?}"),
    }
}

/// The reasons a prefill server gives `client` for `Stats`, `Bench`, `Fragments`, `Memcpy`
/// and a `Submit` of request `s`, in that order.
fn context_refusals(client: &Client, s: &Submit) -> Vec<String> {
    let requests = vec![s.request];
    let mut errors = Vec::new();
    let asks = [
        Message::Stats {
            requests: requests.clone(),
        },
        Message::Bench {
            requests: requests.clone(),
        },
        Message::Fragments {
            requests: requests.clone(),
        },
        Message::Memcpy { requests },
        Message::Submit(s.clone()),
    ];
    for ask in asks {
        let kind = format!("{ask:?}");
        match client.call(ask, REPLY).unwrap() {
            Message::StatsDone { result: Err(e) }
            | Message::BenchDone { result: Err(e) }
            | Message::FragmentsDone { result: Err(e) }
            | Message::MemcpyDone { result: Err(e) }
            | Message::Submitted { result: Err(e), .. } => errors.push(e),
            other => panic!("{kind}: expected a refusal, got {other:?}"),
        }
    }
    errors
}

/// Two controllers holding the secret share a server pair: B's release, cancel, verify,
/// statistics, replays and duplicate submits of A's request are refused by name while it is
/// in flight, B's connection keeps serving B's own request (which A cannot touch either), and
/// A's request completes with every byte verified. A request whose controller has gone stays
/// its own.
#[test]
fn a_controller_cannot_touch_another_controllers_request() {
    // Every flush sleeps, so A's request is still in flight while B tries to cancel it.
    let ctx = deepseek(
        "context",
        "dep2",
        &["--record-plans", "--debug-stall-ms", "1500"],
    );
    let decode = deepseek("generation", "dep4", &[]);
    let (ca, ga) = (ctx.client(), decode.client());
    let (cb, gb) = (ctx.client(), decode.client());

    let a = submit(1, 200);
    let tables = prefill(&ca, &a);
    start(&ga, &a, &ctx);
    // Once the decode server holds A's request, B is told whose it is (before that, it
    // is not held there).
    let mut waited = Duration::ZERO;
    let error = loop {
        let reply = gb.call(
            Message::Verify {
                request: 1,
                context: tables.clone(),
            },
            REPLY,
        );
        match reply.unwrap() {
            Message::Verified {
                result: Err(e),
                request: 1,
            } if e.contains("not held here") && waited < REPLY => {
                std::thread::sleep(Duration::from_millis(10));
                waited += Duration::from_millis(10);
            }
            Message::Verified {
                result: Err(e),
                request: 1,
            } => break e,
            other => panic!("B's Verify of A's request: {other:?}"),
        }
    };
    assert_foreign(&error, 1);

    // Decode side: cancel, release and a second submit of the id.
    let cancel = Message::Cancel {
        request: 1,
        reason: "B wants it gone".into(),
    };
    assert_foreign(&refused(&gb, 1, cancel), 1);
    assert_foreign(&refused(&gb, 1, Message::Release { request: 1 }), 1);
    let mut dup = a.clone();
    dup.peer = Some(ctx.peer());
    match gb.call(Message::Submit(dup), REPLY).unwrap() {
        Message::Done {
            request: 1,
            result: Err(e),
        } => {
            assert!(e.contains("already exists"), "{e}");
            assert_foreign(&e, 1);
        }
        other => panic!("B's Submit of A's id: {other:?}"),
    }
    // Prefill side: release, statistics, the bench's replays, a second prefill of the id.
    assert_foreign(&refused(&cb, 1, Message::Release { request: 1 }), 1);
    for e in context_refusals(&cb, &a) {
        assert_foreign(&e, 1);
    }

    // B's connection still serves B's own request, and A cannot touch that one either.
    let b = submit(2, 100);
    let b_tables = prefill(&cb, &b);
    start(&gb, &b, &ctx);
    assert_foreign(&refused(&ca, 2, Message::Release { request: 2 }), 2);
    let (_, result) = wait_done(&gb, &[2]).remove(0);
    result.unwrap_or_else(|e| panic!("B's request failed: {e}"));
    let summary = verify(&gb, 2, &b_tables);
    assert!(
        summary.ok && summary.bytes_covered > 0,
        "{}",
        summary.detail
    );

    // A's request is unharmed: complete, every byte as the oracle says.
    let (_, result) = wait_done(&ga, &[1]).remove(0);
    let stats = result.unwrap_or_else(|e| panic!("A's request failed: {e}"));
    assert!(stats.bytes > 0);
    let summary = verify(&ga, 1, &tables);
    assert!(summary.ok, "{}", summary.detail);
    assert!(summary.bytes_covered > 0);
    match ca
        .call(Message::Stats { requests: vec![1] }, REPLY)
        .unwrap()
    {
        Message::StatsDone { result: Ok(s) } => assert!(s[0].bytes > 0, "{s:?}"),
        other => panic!("A's Stats: {other:?}"),
    }
    for (c, g, id) in [(&ca, &ga, 1), (&cb, &gb, 2)] {
        release(g, id);
        release(c, id);
    }
    let idle = verify_idle(&gb);
    assert!(idle.ok, "{}", idle.detail);

    // A request outlives its controller's connection and stays its own.
    let gone = ctx.client();
    let _ = prefill(&gone, &submit(3, 64));
    drop(gone);
    let mut error = String::new();
    for _ in 0..500 {
        error = refused(&cb, 3, Message::Release { request: 3 });
        if error.contains("its connection has closed") {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_foreign(&error, 3);
    assert!(error.contains("its connection has closed"), "{error}");
}

/// A context request nobody claims fails at its lease: its slots come back then, without a
/// release (the record stays for its statistics and its release), and a new request takes
/// them and is delivered intact. The later release of the lapsed request frees nothing twice,
/// and a request's slots also come back once it is sent.
#[test]
fn a_lapsed_lease_frees_the_prefilled_slots() {
    let ctx = deepseek("context", "dep2", &["--lease-ms", "2000"]);
    let decode = deepseek("generation", "dep4", &[]);
    let (c, g) = (ctx.client(), decode.client());
    let prefill_error = |id: u64| match c.call(Message::Submit(submit(id, BIG)), REPLY).unwrap() {
        Message::Submitted { result: Err(e), .. } => e,
        other => panic!("prefill of request {id} should not fit: {other:?}"),
    };
    let stats = |id: u64| match c
        .call(Message::Stats { requests: vec![id] }, REPLY)
        .unwrap()
    {
        Message::StatsDone { result: Ok(s) } => s[0].clone(),
        other => panic!("Stats of request {id}: {other:?}"),
    };

    let _ = prefill(&c, &submit(1, BIG));
    // The pool is full while request 1 is held.
    let e = prefill_error(2);
    assert!(e.contains("slots wanted"), "{e}");
    // Its lease lapses (Stats answers once every rank here ended it): nothing was sent, and
    // its slots are free again.
    assert_eq!(stats(1).bytes, 0);
    let s2 = submit(2, BIG);
    let tables = prefill(&c, &s2);
    // Releasing the lapsed request now must not free the slots request 2 holds.
    release(&c, 1);
    let e = prefill_error(3);
    assert!(e.contains("slots wanted"), "{e}");
    // Request 2 is delivered from the reused slots, every byte intact.
    start(&g, &s2, &ctx);
    let (_, result) = wait_done(&g, &[2]).remove(0);
    result.unwrap_or_else(|e| panic!("request 2 failed: {e}"));
    let summary = verify(&g, 2, &tables);
    assert!(
        summary.ok && summary.bytes_covered > 0,
        "{}",
        summary.detail
    );
    // Sent: its source slots are free again before its release.
    assert!(stats(2).bytes > 0);
    let _ = prefill(&c, &submit(3, BIG));
    for id in [2, 3] {
        release(&c, id);
    }
    release(&g, 2);
    let idle = verify_idle(&g);
    assert!(idle.ok, "{}", idle.detail);
}

/// A generation request that fails (its writer never comes: it times out) gives its slots
/// the canary back and frees them before its `Done`, without a release: a request needing
/// nearly every slot is served next, and the pools hold only their canary.
#[test]
fn a_failed_generation_request_frees_its_slots() {
    let ctx = deepseek("context", "dep2", &[]);
    let decode = deepseek("generation", "dep2", &["--timeout-ms", "1000"]);
    let (c, g) = (ctx.client(), decode.client());

    // Never prefilled: the prefill side stashes the claim, the decode side times out.
    start(&g, &submit(1, BIG), &ctx);
    let (_, result) = wait_done(&g, &[1]).remove(0);
    let error = result.expect_err("a request nobody writes must fail");
    assert!(error.contains("timed out"), "{error}");
    // Its record stays (the verdict names the failure), its slots do not.
    match g
        .call(
            Message::Verify {
                request: 1,
                context: vec![],
            },
            REPLY,
        )
        .unwrap()
    {
        Message::Verified { result: Err(e), .. } => assert!(e.contains("failed"), "{e}"),
        other => panic!("Verify of a failed request: {other:?}"),
    }
    let idle = verify_idle(&g);
    assert!(idle.ok, "{}", idle.detail);

    let s = submit(2, BIG);
    let tables = prefill(&c, &s);
    start(&g, &s, &ctx);
    let (_, result) = wait_done(&g, &[2]).remove(0);
    result.unwrap_or_else(|e| panic!("request 2 failed: {e}"));
    let summary = verify(&g, 2, &tables);
    assert!(
        summary.ok && summary.bytes_covered > 0,
        "{}",
        summary.detail
    );
    release(&g, 1);
    release(&g, 2);
    release(&c, 2);
    let idle = verify_idle(&g);
    assert!(idle.ok, "{}", idle.detail);
}
