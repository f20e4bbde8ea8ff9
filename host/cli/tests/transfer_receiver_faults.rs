//! Receivers that die or hang while a prefill server writes into them, over tcp (where every
//! put needs the receiver to progress). The prefill rank's agent gives up on that request —
//! at its deadline (or the peer timeout) for a hung receiver, as soon as UCX or the side
//! channel reports the peer gone for a killed one — names the receiver, and goes on serving
//! other decode servers on the same rank thread.
//!
//! To hang the writer deterministically the receiver is frozen (SIGSTOP) *before* any UCX
//! traffic: its claim reaches the prefill rank ahead of the prefill (and is stashed), the
//! receiver is stopped, then the prefill makes the prefill rank write to a worker that
//! cannot answer.

use crate::support;

use std::process::Command;
use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_harness::Client;
use kvferry_harness::control::Submit;
use support::transfer::{
    REPLY, Server, chunked, exchange, prefill, release, serve, start, submit, wait_done,
};

const DEEPSEEK: &str = "deepseek-v3";
const MLA: &str = "kvferry.deepseek_mla_latent";

/// A `kvferry serve` child whose log lines (stderr) are readable by the test.
struct Logged {
    server: Server,
    lines: Receiver<String>,
}

impl Logged {
    /// Starts a server like [`Server::start`], logging `filter` to the test.
    fn start(role: &'static str, spec: &str, extra: &[&str], filter: &str) -> Logged {
        let args = [&["--planner", MLA][..], extra].concat();
        let (tx, lines) = mpsc::channel();
        let server = Server::start_logged(
            role,
            serve(role, DEEPSEEK, spec, "tcp", &args).log(filter),
            move |line| {
                eprintln!("[{role}] {line}");
                let _ = tx.send(line.to_string());
            },
        );
        Logged { server, lines }
    }

    /// The first log line (from now on) containing every one of `needles`.
    fn wait_for(&self, needles: &[&str], within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if needles.iter().all(|n| line.contains(n)) => return line,
                Ok(_) => {}
                Err(_) => panic!("no log line with {needles:?} within {within:?}"),
            }
        }
    }
}

fn signal(server: &Server, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &server.child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} failed");
}

/// The instance name a server picks by default.
fn gen_name(server: &Server) -> String {
    format!("gen-{}", server.child.id())
}

/// Request `s`, submitted on `client` (a connection to `decode`, which gets its `Done`),
/// reaches the prefill server before its prefill (its claim is stashed); then `decode` is
/// frozen, and the prefill on `ctx_client` (a connection to `ctx`, the only one that may
/// release it) starts the write.
fn freeze_then_prefill(
    ctx: &Logged,
    ctx_client: &Client,
    decode: &Server,
    client: &Client,
    s: &Submit,
) -> Instant {
    start(client, s, &ctx.server);
    ctx.wait_for(&["claim stashed until its send"], REPLY);
    signal(decode, "-STOP");
    let _ = prefill(ctx_client, s);
    Instant::now()
}

/// A prefill server (dep2, its extra flags `ctx_args`) and a decode server (dep4) whose
/// request 1 (300 tokens in chunks of 64) is prefilled once the decode server is frozen.
struct Frozen {
    ctx: Logged,
    decode: Server,
    /// Connections to the generation and the prefill server.
    g: Client,
    c: Client,
    /// The decode server's instance name.
    name: String,
    /// When the prefill started the write.
    since: Instant,
}

impl Frozen {
    fn start(ctx_args: &[&str]) -> Frozen {
        let ctx = Logged::start(
            "context",
            "dep2",
            ctx_args,
            "kvferry=info,kvferry_transfer::agent=debug",
        );
        let decode = Server::start(
            "generation",
            DEEPSEEK,
            "dep4",
            "tcp",
            &["--planner", MLA, "--timeout-ms", "60000"],
        );
        let (g, c) = (decode.client(), ctx.server.client());
        let name = gen_name(&decode);
        let since = freeze_then_prefill(&ctx, &c, &decode, &g, &chunked(submit(1, 300), 64));
        Frozen {
            ctx,
            decode,
            g,
            c,
            name,
            since,
        }
    }
}

/// A hung receiver that stays registered (its keep-alives still flow, as from a peer that
/// stopped reading only its UCX socket) is modelled by a peer timeout longer than the test:
/// the write times out at the context's deadline naming the receiver, its puts quarantined;
/// a second decode server is served by the same prefill rank meanwhile; once the
/// receiver runs again the puts drain, the send fails (only now: until then they may read
/// its source slots), the receiver hears of the failure, and it is served again.
#[test]
fn hung_receiver_times_out_and_the_context_moves_on_tcp() {
    const TIMEOUT_MS: u64 = 1500;
    let Frozen {
        ctx,
        decode: hung,
        g,
        c,
        name,
        since: queued,
    } = Frozen::start(&[
        "--timeout-ms",
        &TIMEOUT_MS.to_string(),
        "--peer-timeout-ms",
        "120000",
    ]);
    let line = ctx.wait_for(&["write job failed", &name, "timed out"], REPLY);
    let waited = queued.elapsed();
    // Its puts may still read the source slots: the request ends once they drain.
    assert!(line.contains("once the quarantine drains"), "{line}");
    assert!(
        waited >= Duration::from_millis(TIMEOUT_MS / 2) && waited < Duration::from_secs(20),
        "gave up after {waited:?} with a {TIMEOUT_MS} ms deadline: {line}"
    );

    // The same prefill rank serves another decode server while the receiver is frozen.
    let other = Server::start("generation", DEEPSEEK, "dep4", "tcp", &["--planner", MLA]);
    exchange(&ctx.server, &other, &[submit(2, 200), submit(3, 64)]);

    // The receiver comes back: the quarantined puts drain, the send fails naming it, and
    // the receiver hears that its request failed.
    signal(&hung, "-CONT");
    ctx.wait_for(&["send failed", &name], REPLY);
    let (_, result) = wait_done(&g, &[1]).remove(0);
    let error = result.expect_err("the timed-out write must fail the request");
    assert!(error.contains(&ctx.server.info().instance), "{error}");
    release(&g, 1);
    release(&c, 1);

    // And it is served again.
    exchange(&ctx.server, &hung, &[submit(4, 128)]);
}

/// A receiver that stays stopped: the context declares it gone at the peer timeout, cuts the
/// puts stuck on it `ExecConfig::gone_drain_grace` later — under UCX's peer error mode
/// (`--ucx-peer-errors`) by closing that endpoint by force, in the default mode (where UCX
/// allows no forced close) by replacing the rank's worker — and the send fails, its source
/// slots back, within the peer timeout plus that grace, while the receiver is still stopped
/// and long before the write's own deadline. Once the receiver runs again it has lost its
/// link (its request failed, after the bytes still on the way landed: the oracle checks the
/// idle pools) and is served afresh.
fn stopped_receiver_gives_the_context_slots_back(mode: &[&str], cut: &str) {
    const PEER_TIMEOUT_MS: u64 = 2000;
    let peer_timeout = PEER_TIMEOUT_MS.to_string();
    let args = [
        &["--timeout-ms", "60000", "--peer-timeout-ms", &peer_timeout][..],
        mode,
    ]
    .concat();
    let Frozen {
        ctx,
        decode: stopped,
        g,
        c,
        name,
        since: frozen,
    } = Frozen::start(&args);
    let cut_line = ctx.wait_for(&[cut, &name], REPLY);
    let line = ctx.wait_for(&["send failed", &name], REPLY);
    let waited = frozen.elapsed();
    assert!(
        cut_line.contains("registration ended") || cut_line.contains("replacing"),
        "{cut_line}"
    );
    // The bound: the peer timeout, the grace, and a loaded 2-core machine's slack.
    let bound = Duration::from_millis(PEER_TIMEOUT_MS) + Duration::from_millis(500);
    assert!(
        waited >= Duration::from_millis(PEER_TIMEOUT_MS) && waited < bound + Duration::from_secs(4),
        "the send ended {waited:?} after the receiver stopped (bound {bound:?}): {line}"
    );
    eprintln!(
        "{mode:?}: send failed {waited:?} after the receiver stopped (peer timeout \
         {PEER_TIMEOUT_MS} ms)"
    );
    release(&c, 1);

    // The rank thread goes on: another decode server is served meanwhile.
    let other = Server::start("generation", DEEPSEEK, "dep4", "tcp", &["--planner", MLA]);
    exchange(&ctx.server, &other, &[submit(2, 200)]);

    // The stopped receiver comes back: its request failed (its link ended), and it is served
    // again over a fresh connection.
    signal(&stopped, "-CONT");
    let (_, result) = wait_done(&g, &[1]).remove(0);
    assert!(result.is_err(), "request 1 cannot have completed");
    release(&g, 1);
    exchange(&ctx.server, &stopped, &[submit(3, 128)]);
}

#[test]
fn stopped_receiver_gives_the_context_slots_back_at_the_peer_timeout_tcp() {
    stopped_receiver_gives_the_context_slots_back(
        &[],
        "cutting quarantined puts: replacing this rank's worker",
    );
}

#[test]
fn stopped_receiver_gives_the_context_slots_back_at_the_peer_timeout_peer_errors_tcp() {
    stopped_receiver_gives_the_context_slots_back(
        &["--ucx-peer-errors"],
        "closing the endpoint of a quarantined window by force",
    );
}

/// A receiver that stopped draining while its registration stays up (modelled, as above, by
/// a peer timeout longer than the test), under peer error mode: once nothing in the stuck
/// window finished for the stall limit (`--stall-limit-ms`, `ExecConfig::stall_limit`; 10 s
/// by default, 2 s here) after the write's own deadline, the context gives the receiver up,
/// closes the endpoint by force and the send fails, its source slots back, while the receiver
/// is still stopped. When it runs again its next keep-alive is answered with an error naming
/// why, and it is served afresh. The rule itself is checked on a simulated clock in
/// `kvferry-protocol`'s `exec_machine` tests.
#[test]
fn stalled_receiver_is_given_up_after_the_stall_limit_tcp() {
    const TIMEOUT_MS: u64 = 1000;
    const STALL_MS: u64 = 2000;
    let Frozen {
        ctx,
        decode: stalled,
        g,
        c,
        name,
        since: frozen,
    } = Frozen::start(&[
        "--timeout-ms",
        &TIMEOUT_MS.to_string(),
        "--peer-timeout-ms",
        "120000",
        "--stall-limit-ms",
        &STALL_MS.to_string(),
        "--ucx-peer-errors",
    ]);
    let forced = ctx.wait_for(
        &[
            "closing the endpoint of a quarantined window by force",
            &name,
        ],
        REPLY,
    );
    ctx.wait_for(&["send failed", &name], REPLY);
    let waited = frozen.elapsed();
    assert!(forced.contains("not draining"), "{forced}");
    assert!(
        waited >= Duration::from_millis(STALL_MS) && waited < Duration::from_secs(15),
        "the send ended {waited:?} after the receiver stopped (deadline {TIMEOUT_MS} ms, \
         stall limit {STALL_MS} ms)"
    );
    eprintln!("send failed {waited:?} after the receiver stopped draining");
    release(&c, 1);

    signal(&stalled, "-CONT");
    let (_, result) = wait_done(&g, &[1]).remove(0);
    assert!(result.is_err(), "request 1 cannot have completed");
    release(&g, 1);
    exchange(&ctx.server, &stalled, &[submit(3, 128)]);
}

/// A receiver killed while the context writes into it: the job fails long before the
/// deadline, naming the receiver, and the context keeps serving another decode server.
#[test]
fn killed_receiver_fails_its_job_and_the_context_moves_on_tcp() {
    let ctx = Logged::start(
        "context",
        "dep2",
        &["--timeout-ms", "30000"],
        "kvferry=info,kvferry_transfer::agent=debug",
    );
    let mut doomed = Server::start("generation", DEEPSEEK, "dep4", "tcp", &["--planner", MLA]);
    let name = gen_name(&doomed);

    let c = ctx.server.client();
    freeze_then_prefill(&ctx, &c, &doomed, &doomed.client(), &submit(1, 300));
    thread::sleep(Duration::from_millis(200));
    doomed.child.kill().unwrap();
    let killed = Instant::now();
    let _ = doomed.child.wait();
    let line = ctx.wait_for(&["send failed", &name], REPLY);
    let waited = killed.elapsed();
    assert!(
        waited < Duration::from_secs(15),
        "failed {waited:?} after the kill (deadline 30 s): {line}"
    );
    release(&c, 1);

    let other = Server::start("generation", DEEPSEEK, "dep4", "tcp", &["--planner", MLA]);
    exchange(&ctx.server, &other, &[submit(2, 200), submit(3, 77)]);
}
