//! Failures between real processes: refused peers, a context server killed mid-transfer, a
//! hung one, requests that arrive before their prefill, forged registrations. In every case
//! only the requests addressed to the bad peer fail, with an error naming it, and the
//! servers keep serving.

mod support;

use std::thread;
use std::time::{Duration, Instant};

use kvferry_cli::Client;
use kvferry_cli::control::ControlMessage as Message;
use kvferry_protocol::{InstanceInfo, PeerMessage, Role};
use kvferry_transfer::RequestStats;
use support::transfer::{
    REPLY, Server, exchange, prefill, release, start, submit, verify, verify_idle, wait_done,
};

const DEEPSEEK: &str = "deepseek-v3";
const MLA: &str = "kvferry.deepseek_mla_latent";

fn deepseek(role: &'static str, spec: &str, transport: &str, extra: &[&str]) -> Server {
    let mut args = vec!["--planner", MLA];
    args.extend_from_slice(extra);
    Server::start(role, DEEPSEEK, spec, transport, &args)
}

/// A generation server with three context peers: one compatible, one bound to another
/// planner, one whose cache blocks differ (refused by the planner's `check_peer`, naming the
/// field). Refusals are cached and fail only the requests addressed to those peers.
#[test]
fn incompatible_peers_are_refused_with_their_reason_while_a_compatible_peer_works() {
    let r#gen = deepseek("generation", "dep4", "shm", &[]);
    let good = deepseek("context", "dep2", "shm", &[]);
    let other_planner = Server::start(
        "context",
        DEEPSEEK,
        "dep2",
        "shm",
        &["--planner", "kvferry.default"],
    );
    let other_blocks = deepseek("context", "dep2", "shm", &["--tokens-per-block", "64"]);
    let g = r#gen.client();

    let fail = |peer: &Server, id: u64| -> String {
        let s = submit(id, 100);
        let _ = prefill(&peer.client(), &s);
        start(&g, &s, &peer.addr);
        let (_, result) = wait_done(&g, &[id]).remove(0);
        result.expect_err("a request to an incompatible peer must fail")
    };

    let planner = fail(&other_planner, 1);
    assert!(planner.contains(&other_planner.addr), "{planner}");
    assert!(planner.contains("refused"), "{planner}");
    assert!(
        planner.contains("kvferry.default") && planner.contains(MLA),
        "{planner}"
    );

    // The compatible peer is unaffected, before and after.
    exchange(&good, &r#gen, &[submit(2, 120), submit(3, 33)]);

    // The verdict is cached: the same reason again, without a new registration.
    let again = fail(&other_planner, 4);
    assert_eq!(
        again.replace("request 4", "request 1"),
        planner,
        "a cached refusal repeats its reason"
    );

    let blocks = fail(&other_blocks, 5);
    assert!(blocks.contains(&other_blocks.addr), "{blocks}");
    assert!(blocks.contains("tokens_per_block"), "{blocks}");
    assert!(blocks.contains("ours 32, theirs 64"), "{blocks}");

    exchange(&good, &r#gen, &[submit(6, 64)]);
}

/// A refusal belongs to the instance that earned it, not to its address: a context server
/// restarted on the same address with a compatible planner is vetted anew and serves.
#[test]
fn a_refused_peer_restarted_compatible_on_the_same_address_is_accepted() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let listen = format!("127.0.0.1:{port}");
    let r#gen = deepseek("generation", "dep4", "shm", &[]);
    let g = r#gen.client();
    let wrong = Server::start(
        "context",
        DEEPSEEK,
        "dep2",
        "shm",
        &["--planner", "kvferry.default", "--listen", &listen],
    );
    assert_eq!(wrong.addr, listen);
    let s = submit(1, 100);
    let _ = prefill(&wrong.client(), &s);
    start(&g, &s, &wrong.addr);
    let (_, result) = wait_done(&g, &[1]).remove(0);
    let error = result.expect_err("a peer bound to another planner must be refused");
    assert!(error.contains("refused"), "{error}");
    release(&g, 1);
    drop(wrong);

    // The same address, now a compatible instance.
    let right = deepseek("context", "dep2", "shm", &["--listen", &listen]);
    assert_eq!(right.addr, listen);
    exchange(&right, &r#gen, &[submit(2, 120)]);
}

/// The context server is killed while its rank threads hold issued puts (stalled before the
/// flush): the generation side fails that request as soon as the control connection drops,
/// long before its timeout, names the peer, and keeps serving another peer.
fn killed_mid_transfer(transport: &str) {
    let timeout_ms = 30_000;
    let r#gen = deepseek(
        "generation",
        "dep4",
        transport,
        &["--timeout-ms", &timeout_ms.to_string()],
    );
    let live = deepseek("context", "dep2", transport, &[]);
    let mut doomed = deepseek("context", "dep2", transport, &["--debug-stall-ms", "20000"]);
    let g = r#gen.client();

    let s = submit(1, 300);
    let _ = prefill(&doomed.client(), &s);
    start(&g, &s, &doomed.addr);
    thread::sleep(Duration::from_millis(500));
    let killed = Instant::now();
    doomed.child.kill().unwrap();
    let (_, result) = wait_done(&g, &[1]).remove(0);
    let waited = killed.elapsed();
    let error = result.expect_err("a request to a killed peer must fail");
    assert!(error.contains(&doomed.addr), "{error}");
    assert!(error.contains("closed its control connection"), "{error}");
    assert!(
        waited < Duration::from_millis(timeout_ms / 2),
        "failed after {waited:?}"
    );
    release(&g, 1);

    // Later requests to a live peer succeed; the dead one is reported as unreachable.
    exchange(&live, &r#gen, &[submit(2, 200), submit(3, 77)]);
    let s = submit(4, 50);
    start(&g, &s, &doomed.addr);
    let (_, result) = wait_done(&g, &[4]).remove(0);
    let error = result.expect_err("the dead peer cannot be reached");
    assert!(error.contains(&doomed.addr), "{error}");
    assert!(error.contains("cannot connect"), "{error}");
    let idle = verify_idle(&g);
    assert!(idle.ok, "{}", idle.detail);
}

#[test]
fn context_killed_mid_transfer_fails_only_its_requests_shm() {
    killed_mid_transfer("shm");
}

#[test]
fn context_killed_mid_transfer_fails_only_its_requests_tcp() {
    killed_mid_transfer("tcp");
}

/// A context server that never completes (stalled past the deadline): the request times out
/// naming the missing writers, its slots stay quarantined until the late completions
/// arrive, and a live peer keeps working meanwhile.
#[test]
fn hung_peer_times_out_and_its_slots_are_quarantined() {
    let r#gen = deepseek("generation", "dep4", "shm", &["--timeout-ms", "1000"]);
    let live = deepseek("context", "dep2", "shm", &[]);
    let slow = deepseek("context", "dep2", "shm", &["--debug-stall-ms", "6000"]);
    let g = r#gen.client();

    let s = submit(1, 100);
    let _ = prefill(&slow.client(), &s);
    start(&g, &s, &slow.addr);
    let (_, result) = wait_done(&g, &[1]).remove(0);
    let error = result.expect_err("a hung peer's request must time out");
    assert!(error.contains("timed out after 1000 ms"), "{error}");
    assert!(error.contains(&slow.addr), "{error}");
    // The deadline, not the stalled writer (which would have completed the request after
    // 6 s), ended it: the error names the timeout.
    assert!(error.contains("ctx rank 0 -> gen rank 0"), "{error}");
    release(&g, 1);

    exchange_without_idle_check(&live, &r#gen, 2);

    // The late writer reports after its stall; only then are the slots free again.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match g.call(Message::VerifyIdle, REPLY).unwrap() {
            Message::IdleVerified { result: Ok(s) } => {
                assert!(s.ok, "{}", s.detail);
                break;
            }
            Message::IdleVerified { result: Err(e) } => {
                assert!(e.contains("hold slots"), "{e}");
                assert!(
                    Instant::now() < deadline,
                    "slots never left quarantine: {e}"
                );
                thread::sleep(Duration::from_millis(200));
            }
            other => panic!("{other:?}"),
        }
    }
}

fn exchange_without_idle_check(ctx: &Server, r#gen: &Server, id: u64) {
    let (c, g) = (ctx.client(), r#gen.client());
    let s = submit(id, 150);
    let tables = prefill(&c, &s);
    start(&g, &s, &ctx.addr);
    let (_, result) = wait_done(&g, &[id]).remove(0);
    result.unwrap();
    let summary = verify(&g, id, &tables);
    assert!(summary.ok, "{}", summary.detail);
    release(&g, id);
    release(&c, id);
}

/// `RequestData` that reaches the context server before the request's prefill is stashed
/// and served once the prefill comes.
#[test]
fn request_data_before_prefill_is_served_after_it_tcp() {
    let r#gen = deepseek("generation", "dep4", "tcp", &[]);
    let ctx = deepseek("context", "dep2", "tcp", &[]);
    let (c, g) = (ctx.client(), r#gen.client());
    let mut s = submit(7, 250);
    s.ctx_dp_rank = 1;
    s.gen_dp_rank = 3;
    start(&g, &s, &ctx.addr);
    thread::sleep(Duration::from_millis(300));
    let tables = prefill(&c, &s);
    let (_, result) = wait_done(&g, &[7]).remove(0);
    let stats = result.unwrap();
    assert_eq!(stats.writers, 1);
    let summary = verify(&g, 7, &tables);
    assert!(summary.ok, "{}", summary.detail);
    assert!(summary.bytes_covered > 0);
}

/// What a context server advertises to its peers, asked on its peer listener.
fn instance_info(server: &Server) -> InstanceInfo {
    match peer_client(server)
        .call(PeerMessage::InstanceInfoRequest, REPLY)
        .unwrap()
    {
        PeerMessage::InstanceInfo(info) => info,
        other => panic!("{other:?}"),
    }
}

fn peer_client(server: &Server) -> Client<PeerMessage> {
    Client::connect(&server.addr).expect("connect to the peer listener")
}

/// The context side runs its own `check_peer` per generation rank and refuses with the
/// planner's field-level reason; it also refuses another planner id outright.
#[test]
fn context_refuses_a_forged_registration_with_the_planners_reason() {
    let ctx = deepseek("context", "dep2", "shm", &[]);
    let info = instance_info(&ctx);

    let mut forged = info.clone();
    forged.instance_name = "forged".into();
    forged.role = Role::Generation;
    for d in &mut forged.ranks {
        d.info.instance_name = "forged".into();
        d.info.page_table.tokens_per_block = 64;
    }
    let reply = peer_client(&ctx)
        .call(PeerMessage::Register(forged.clone()), REPLY)
        .unwrap();
    let PeerMessage::Refused { reason } = reply else {
        panic!("expected Refused, got {reply:?}");
    };
    assert!(
        reason.contains("refuses generation instance forged rank 0"),
        "{reason}"
    );
    assert!(reason.contains("tokens_per_block"), "{reason}");

    let mut other = forged;
    other.planner_id = "acme.other".into();
    let reply = peer_client(&ctx)
        .call(PeerMessage::Register(other), REPLY)
        .unwrap();
    let PeerMessage::Refused { reason } = reply else {
        panic!("expected Refused, got {reply:?}");
    };
    assert!(reason.contains("acme.other"), "{reason}");

    // Still serving.
    assert_eq!(instance_info(&ctx).instance_name, info.instance_name);
}

/// A receiver that caches the whole prompt gets empty plans; every writer still reports its
/// (empty) last piece and the request completes with nothing moved. A cancelled request
/// fails at once with the controller's reason.
#[test]
fn empty_plans_complete_and_cancel_fails_a_request() {
    let r#gen = deepseek("generation", "dep4", "shm", &[]);
    let ctx = deepseek("context", "dep2", "shm", &[]);
    let slow = deepseek("context", "dep2", "shm", &["--debug-stall-ms", "2000"]);
    let g = r#gen.client();

    let mut s = submit(1, 96);
    s.cached = 96;
    let stats = exchange(&ctx, &r#gen, &[s]);
    assert_eq!(stats[0].bytes, 0);
    assert_eq!(stats[0].writers, 1);

    let s = submit(2, 64);
    let _ = prefill(&slow.client(), &s);
    start(&g, &s, &slow.addr);
    g.send(Message::Cancel {
        request: 2,
        reason: "client went away".into(),
    })
    .unwrap();
    let (_, result) = wait_done(&g, &[2]).remove(0);
    let error = result.expect_err("a cancelled request fails");
    assert!(error.contains("cancelled: client went away"), "{error}");
}

/// Several controllers submit one request id at the same instant: exactly one is taken and
/// completes verified, the others are refused as duplicates, and no slot leaks — a request
/// needing almost every slot runs afterwards.
#[test]
fn racing_submits_of_one_id_take_one_and_leak_nothing() {
    let r#gen = deepseek("generation", "dep2", "shm", &[]);
    let ctx = deepseek("context", "dep2", "shm", &[]);
    // 1,400 tokens: 44 of each pool's 48 slots, so a leaked allocation starves the next.
    let s = submit(7, 1400);
    let tables = prefill(&ctx.client(), &s);
    let clients: Vec<Client> = (0..4).map(|_| r#gen.client()).collect();
    let barrier = std::sync::Barrier::new(clients.len());
    let results: Vec<Result<RequestStats, String>> = thread::scope(|scope| {
        let handles: Vec<_> = clients
            .into_iter()
            .map(|g| {
                let (s, barrier, addr) = (&s, &barrier, &ctx.addr);
                scope.spawn(move || {
                    barrier.wait();
                    start(&g, s, addr);
                    wait_done(&g, &[7]).remove(0).1
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let taken: Vec<_> = results.iter().filter(|r| r.is_ok()).collect();
    assert_eq!(taken.len(), 1, "{results:?}");
    for refused in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(
            refused.contains("already exists") || refused.contains("duplicate"),
            "{refused}"
        );
    }
    let g = r#gen.client();
    verify(&g, 7, &tables);
    release(&g, 7);
    release(&ctx.client(), 7);
    verify_idle(&g);
    // Every slot came back: another request of 44 blocks is served.
    exchange(&ctx, &r#gen, &[submit(8, 1400)]);
}
