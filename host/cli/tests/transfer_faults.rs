//! Failures between real processes: refused peers, a prefill server killed mid-transfer, a
//! hung one, requests that arrive before their prefill, forged registrations. In every case
//! only the requests addressed to the bad peer fail, with an error naming it, and the
//! servers keep serving.

use crate::support;

use std::thread;
use std::time::{Duration, Instant};

use kvferry_harness::Client;
use kvferry_harness::control::ControlMessage as Message;
use kvferry_transfer::RequestStats;
use support::transfer::{
    Server, exchange, prefill, release, start, start_from, submit, verify, verify_idle, wait_done,
};

const DEEPSEEK: &str = "deepseek-v3";
const MLA: &str = "kvferry.deepseek_mla_latent";

fn deepseek(role: &'static str, spec: &str, transport: &str, extra: &[&str]) -> Server {
    let mut args = vec!["--planner", MLA];
    args.extend_from_slice(extra);
    Server::start(role, DEEPSEEK, spec, transport, &args)
}

/// Whether `error` names the prefill server `peer`: its instance, or one of its endpoints.
fn names(error: &str, peer: &Server) -> bool {
    error.contains(&peer.info().instance) || peer.addr.split(',').any(|ep| error.contains(ep))
}

/// A decode server with three context peers: one compatible, one bound to another
/// planner, one whose cache blocks differ (refused by the planner's `check_peer`, naming the
/// field). Refusals are cached and fail only the requests addressed to those peers.
#[test]
fn incompatible_peers_are_refused_with_their_reason_while_a_compatible_peer_works() {
    let decode = deepseek("generation", "dep4", "shm", &[]);
    let good = deepseek("context", "dep2", "shm", &[]);
    let other_planner = Server::start(
        "context",
        DEEPSEEK,
        "dep2",
        "shm",
        &["--planner", "kvferry.default"],
    );
    let other_blocks = deepseek("context", "dep2", "shm", &["--tokens-per-block", "64"]);
    let g = decode.client();

    let fail = |peer: &Server, id: u64| -> String {
        let s = submit(id, 100);
        // The request is this connection's: only it may release it.
        let c = peer.client();
        let _ = prefill(&c, &s);
        start(&g, &s, peer);
        let (_, result) = wait_done(&g, &[id]).remove(0);
        release(&g, id);
        release(&c, id);
        result.expect_err("a request to an incompatible peer must fail")
    };

    let planner = fail(&other_planner, 1);
    assert!(names(&planner, &other_planner), "{planner}");
    assert!(planner.contains("refused"), "{planner}");
    assert!(
        planner.contains("kvferry.default") && planner.contains(MLA),
        "{planner}"
    );

    // The compatible peer is unaffected, before and after.
    exchange(&good, &decode, &[submit(2, 120), submit(3, 33)]);

    // The verdict is cached: the same reason again, without a new registration.
    let again = fail(&other_planner, 4);
    assert_eq!(
        again.replace("request 4", "request 1"),
        planner,
        "a cached refusal repeats its reason"
    );

    let blocks = fail(&other_blocks, 5);
    assert!(names(&blocks, &other_blocks), "{blocks}");
    assert!(blocks.contains("tokens_per_block"), "{blocks}");
    // Whichever side's check_peer spoke first, it names both block sizes.
    assert!(
        blocks.contains("ours 32, theirs 64") || blocks.contains("ours 64, theirs 32"),
        "{blocks}"
    );

    exchange(&good, &decode, &[submit(6, 64)]);
}

/// A refusal belongs to the rank that earned it (its identity: instance, rank, epoch), not to
/// its address: a prefill rank restarted under the same name on the same address with a
/// compatible planner is vetted anew and serves. One process per rank (`--rank`), as
/// engines run them, so the rank can keep a fixed port.
#[test]
fn a_refused_peer_restarted_compatible_on_the_same_address_is_accepted() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let listen = format!("127.0.0.1:{port}");
    let decode = deepseek("generation", "dep4", "shm", &[]);
    let g = decode.client();
    let rank0 = |planner: &str| {
        Server::start(
            "context",
            DEEPSEEK,
            "dep2",
            "shm",
            &[
                "--planner",
                planner,
                "--listen",
                &listen,
                "--rank",
                "0",
                "--name",
                "ctx-restarted",
            ],
        )
    };
    let wrong = rank0("kvferry.default");
    assert_eq!(wrong.addr, listen);
    let s = submit(1, 100);
    let _ = prefill(&wrong.client(), &s);
    start(&g, &s, &wrong);
    let (_, result) = wait_done(&g, &[1]).remove(0);
    let error = result.expect_err("a peer bound to another planner must be refused");
    assert!(error.contains("refused"), "{error}");
    release(&g, 1);
    drop(wrong);

    // The same name and address, now a compatible rank.
    let right = rank0(MLA);
    assert_eq!(right.addr, listen);
    exchange(&right, &decode, &[submit(2, 120)]);
}

/// The prefill server is killed while its rank threads hold issued puts (stalled before the
/// flush): the decode side fails that request as soon as the control connection drops,
/// long before its timeout, names the peer, and keeps serving another peer.
fn killed_mid_transfer(transport: &str) {
    let timeout_ms = 30_000;
    let decode = deepseek(
        "generation",
        "dep4",
        transport,
        &["--timeout-ms", &timeout_ms.to_string()],
    );
    let live = deepseek("context", "dep2", transport, &[]);
    let mut doomed = deepseek("context", "dep2", transport, &["--debug-stall-ms", "20000"]);
    let g = decode.client();

    let s = submit(1, 300);
    let _ = prefill(&doomed.client(), &s);
    let peer = doomed.peer();
    start_from(&g, &s, &peer);
    thread::sleep(Duration::from_millis(500));
    let killed = Instant::now();
    doomed.child.kill().unwrap();
    let (_, result) = wait_done(&g, &[1]).remove(0);
    let waited = killed.elapsed();
    let error = result.expect_err("a request to a killed peer must fail");
    assert!(error.contains(&peer.instance), "{error}");
    assert!(error.contains("closed its connection"), "{error}");
    assert!(
        waited < Duration::from_millis(timeout_ms / 2),
        "failed after {waited:?}"
    );
    release(&g, 1);

    // Later requests to a live peer succeed; the dead one is reported as unreachable.
    exchange(&live, &decode, &[submit(2, 200), submit(3, 77)]);
    let s = submit(4, 50);
    start_from(&g, &s, &peer);
    let (_, result) = wait_done(&g, &[4]).remove(0);
    let error = result.expect_err("the dead peer cannot be reached");
    assert!(
        peer.endpoints.iter().any(|ep| error.contains(ep)) || error.contains(&peer.instance),
        "{error}"
    );
    assert!(error.contains("connect"), "{error}");
    release(&g, 4);
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

/// A prefill server whose writer stalls past the deadline: a live peer keeps working
/// meanwhile; the request times out naming the missing writer, and its `Done` comes only
/// once that writer answered the cancel (its stalled puts flushed), so the slots are free —
/// every pool holds its canary — as soon as it is released.
#[test]
fn hung_peer_times_out_and_its_slots_are_quarantined() {
    let decode = deepseek("generation", "dep4", "shm", &["--timeout-ms", "1000"]);
    let live = deepseek("context", "dep2", "shm", &[]);
    let slow = deepseek("context", "dep2", "shm", &["--debug-stall-ms", "4000"]);
    let g = decode.client();

    let s = submit(1, 100);
    let _ = prefill(&slow.client(), &s);
    let started = Instant::now();
    start(&g, &s, &slow);
    // The live peer is served while the slow one holds request 1.
    exchange_without_idle_check(&live, &decode, 2);
    let (_, result) = wait_done(&g, &[1]).remove(0);
    let waited = started.elapsed();
    let error = result.expect_err("a hung peer's request must time out");
    assert!(error.contains("timed out after 1000 ms"), "{error}");
    assert!(names(&error, &slow), "{error}");
    assert!(error.contains("prefill rank 0 -> decode rank 0"), "{error}");
    // Not before the writer let go of the slots (its stall ends after 4 s).
    assert!(waited >= Duration::from_secs(3), "Done after {waited:?}");
    release(&g, 1);
    let idle = verify_idle(&g);
    assert!(idle.ok, "{}", idle.detail);
}

fn exchange_without_idle_check(ctx: &Server, decode: &Server, id: u64) {
    let (c, g) = (ctx.client(), decode.client());
    let s = submit(id, 150);
    let tables = prefill(&c, &s);
    start(&g, &s, ctx);
    let (_, result) = wait_done(&g, &[id]).remove(0);
    result.unwrap();
    let summary = verify(&g, id, &tables);
    assert!(summary.ok, "{}", summary.detail);
    release(&g, id);
    release(&c, id);
}

/// `RequestData` that reaches the prefill server before the request's prefill is stashed
/// and served once the prefill comes.
#[test]
fn request_data_before_prefill_is_served_after_it_tcp() {
    let decode = deepseek("generation", "dep4", "tcp", &[]);
    let ctx = deepseek("context", "dep2", "tcp", &[]);
    let (c, g) = (ctx.client(), decode.client());
    let mut s = submit(7, 250);
    s.ctx_dp_rank = 1;
    s.gen_dp_rank = 3;
    start(&g, &s, &ctx);
    thread::sleep(Duration::from_millis(300));
    let tables = prefill(&c, &s);
    let (_, result) = wait_done(&g, &[7]).remove(0);
    let stats = result.unwrap();
    assert_eq!(stats.writers, 1);
    let summary = verify(&g, 7, &tables);
    assert!(summary.ok, "{}", summary.detail);
    assert!(summary.bytes_covered > 0);
}

/// Peers prove the deployment's secret before anything else: a decode server holding
/// another secret is refused by the prefill ranks (nothing moves, its request fails naming
/// the refusal), while a decode server with the right one is served by the same ranks.
#[test]
fn a_generation_server_with_another_secret_is_refused_and_nothing_moves() {
    let ctx = deepseek("context", "dep2", "shm", &[]);
    let stranger = Server::start_logged(
        "generation",
        support::transfer::serve(
            "generation",
            DEEPSEEK,
            "dep4",
            "shm",
            &["--planner", MLA, "--timeout-ms", "5000"],
        )
        .quiet()
        .env("KVFERRY_SECRET", "not the deployment's secret at all"),
        |line| eprintln!("[stranger] {line}"),
    );
    let g = stranger.client_with("not the deployment's secret at all");
    let s = submit(1, 100);
    let c = ctx.client();
    let _ = prefill(&c, &s);
    start(&g, &s, &ctx);
    let (_, result) = wait_done(&g, &[1]).remove(0);
    let error = result.expect_err("a peer without the secret must be refused");
    assert!(
        error.contains("secret") || error.contains("proof"),
        "{error}"
    );
    release(&g, 1);
    release(&c, 1);
    let idle = verify_idle(&g);
    assert!(
        idle.ok,
        "a refused peer's slots were written: {}",
        idle.detail
    );

    let friend = deepseek("generation", "dep4", "shm", &[]);
    exchange(&ctx, &friend, &[submit(2, 120)]);
}

/// A receiver that caches the whole prompt gets empty plans; every writer still reports its
/// (empty) last piece and the request completes with nothing moved. A cancelled request
/// fails at once with the controller's reason.
#[test]
fn empty_plans_complete_and_cancel_fails_a_request() {
    let decode = deepseek("generation", "dep4", "shm", &[]);
    let ctx = deepseek("context", "dep2", "shm", &[]);
    let slow = deepseek("context", "dep2", "shm", &["--debug-stall-ms", "2000"]);
    let g = decode.client();

    let mut s = submit(1, 96);
    s.cached = 96;
    let stats = exchange(&ctx, &decode, &[s]);
    assert_eq!(stats[0].bytes, 0);
    assert_eq!(stats[0].writers, 1);

    let s = submit(2, 64);
    let _ = prefill(&slow.client(), &s);
    start(&g, &s, &slow);
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
    let decode = deepseek("generation", "dep2", "shm", &[]);
    let ctx = deepseek("context", "dep2", "shm", &[]);
    // 1,400 tokens: 44 of each pool's 48 slots, so a leaked allocation starves the next.
    let s = submit(7, 1400);
    let c = ctx.client();
    let tables = prefill(&c, &s);
    let clients: Vec<Client> = (0..4).map(|_| decode.client()).collect();
    let peer = ctx.peer();
    let barrier = std::sync::Barrier::new(clients.len());
    let results: Vec<(Client, Result<RequestStats, String>)> = thread::scope(|scope| {
        let handles: Vec<_> = clients
            .into_iter()
            .map(|g| {
                let (s, barrier, peer) = (&s, &barrier, &peer);
                scope.spawn(move || {
                    barrier.wait();
                    start_from(&g, s, peer);
                    let result = wait_done(&g, &[7]).remove(0).1;
                    (g, result)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let taken: Vec<_> = results.iter().filter(|(_, r)| r.is_ok()).collect();
    assert_eq!(taken.len(), 1, "{results:?}");
    for refused in results.iter().filter_map(|(_, r)| r.as_ref().err()) {
        assert!(
            refused.contains("already exists") || refused.contains("duplicate"),
            "{refused}"
        );
    }
    // The request belongs to the connection that took it.
    let g = &taken[0].0;
    verify(g, 7, &tables);
    release(g, 7);
    release(&c, 7);
    verify_idle(g);
    // Every slot came back: another request of 44 blocks is served.
    exchange(&ctx, &decode, &[submit(8, 1400)]);
}

/// Two writers whose plans fill the same bytes of the receiver's slots (and leave the rest
/// unwritten) pass every writer's own checks and the receiver's byte count: the receiver
/// compares its plans of all the writers and refuses the request, naming both writers,
/// instead of reporting it received (`tests/fixtures/colliding-writers`).
#[test]
fn a_receiver_refuses_writers_whose_plans_overlap() {
    let fixtures = kvferry_testkit::conform::build_out_of_tree("tests/fixtures");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixtures.join("libfixture_colliding_writers.so"),
        dir.path().join("libfixture_colliding_writers.so"),
    )
    .unwrap();
    let out = support::Kvferry::new()
        .plugin_dir(dir.path())
        .planner("fixture.colliding_writers")
        .args([
            "demo",
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp2",
            "--gen",
            "tp1",
            "--requests",
            "1",
            "--prompt-len",
            "64",
            "--timeout-ms",
            "5000",
            "--json",
        ])
        .output();
    assert!(!out.status.success());
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(report["failed"], 1, "{report}");
    assert_eq!(report["bytes"], 0, "{report}");
    let errors = report["errors"].to_string();
    assert!(
        errors.contains("rank 0 and ") && errors.contains("rank 1 both write"),
        "{errors}"
    );
    assert!(errors.contains("refusing the request"), "{errors}");
}
