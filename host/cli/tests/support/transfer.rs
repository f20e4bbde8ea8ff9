//! Helpers of the two-process transfer tests: `kvferry serve` children and a controller.

use std::process::Child;
use std::time::{Duration, Instant};

use kvferry_harness::Client;
use kvferry_harness::control::{
    ControlMessage as Message, PeerRef, RankTables, ServerInfo, Submit, VerifySummary,
};
use kvferry_harness::demo::{DemoError, ServerAddrs, spawn_serve_command, spawn_serve_logged};
use kvferry_plan::chunk_ranges;
use kvferry_transfer::RequestStats;
use serde_json::Value;

use super::Kvferry;

/// How long any reply may take before a test fails instead of hanging.
pub const REPLY: Duration = Duration::from_secs(60);

/// A `kvferry serve` child, killed when dropped.
pub struct Server {
    pub child: Child,
    /// A prefill server's agent endpoints, comma-separated (a decode server's control
    /// address otherwise).
    pub addr: String,
    /// The control address.
    pub control: String,
    /// The `/metrics` listener (`--metrics-listen`).
    pub metrics: Option<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `kvferry serve --role ROLE --model MODEL --deployment SPEC --transport T` plus
    /// `extra` ([`serve`]), logging warnings only.
    pub fn start(
        role: &'static str,
        model: &str,
        spec: &str,
        transport: &str,
        extra: &[&str],
    ) -> Server {
        let cmd = serve(role, model, spec, transport, extra).quiet().command();
        Server::started(spawn_serve_command(cmd, role))
    }

    /// Starts `command` (a [`serve`] command) as the `role` server, handing each line of
    /// its log to `log`.
    pub fn start_logged(
        role: &'static str,
        command: Kvferry,
        log: impl FnMut(&str) + Send + 'static,
    ) -> Server {
        Server::started(spawn_serve_logged(command.command(), role, log))
    }

    fn started(spawned: Result<(Child, ServerAddrs), DemoError>) -> Server {
        let (child, addrs) = spawned.unwrap_or_else(|e| panic!("{e}"));
        Server {
            child,
            addr: addrs.peer.unwrap_or_else(|| addrs.control.clone()),
            control: addrs.control,
            metrics: addrs.metrics,
        }
    }

    /// A controller holding the tests' secret.
    pub fn client(&self) -> Client {
        self.client_with(super::SECRET)
    }

    /// A controller holding `secret`.
    pub fn client_with(&self, secret: &str) -> Client {
        let secret = kvferry_protocol::Secret::new(secret).expect("a usable secret");
        Client::connect(&self.control, &secret).expect("connect to the server")
    }

    /// What the server says it is and serves.
    pub fn info(&self) -> ServerInfo {
        match self.client().call(Message::InfoRequest, REPLY).unwrap() {
            Message::Info(info) => info,
            other => panic!("InfoRequest: {other:?}"),
        }
    }

    /// How a decode server reaches this prefill server's instance.
    pub fn peer(&self) -> PeerRef {
        let info = self.info();
        PeerRef {
            instance: info.instance,
            endpoints: info.ranks.into_iter().filter_map(|r| r.endpoint).collect(),
        }
    }
}

/// `kvferry serve --role ROLE --model MODEL --deployment SPEC --transport T` on free ports,
/// with 48 PAGED and 4 STATE slots per pool, plus `extra`.
pub fn serve(role: &str, model: &str, spec: &str, transport: &str, extra: &[&str]) -> Kvferry {
    // A free loopback port, unless the test names its own.
    let listen = if extra.contains(&"--listen") {
        &[][..]
    } else {
        &["--listen", "127.0.0.1:0"][..]
    };
    Kvferry::new()
        .args([
            "serve",
            "--role",
            role,
            "--model",
            model,
            "--deployment",
            spec,
            "--transport",
            transport,
            "--slots",
            "48",
            "--state-slots",
            "4",
        ])
        .args(listen)
        .args(extra)
}

/// A request of `prompt_len` tokens for DP ranks 0.
pub fn submit(request: u64, prompt_len: u64) -> Submit {
    Submit {
        request,
        prompt_len,
        ctx_dp_rank: 0,
        gen_dp_rank: 0,
        chunks: None,
        layer_parts: 0,
        cached: 0,
        peer: None,
    }
}

/// The same request sent in chunks of `chunk` tokens.
pub fn chunked(mut s: Submit, chunk: u64) -> Submit {
    s.chunks = Some(chunk_ranges(s.prompt_len, chunk));
    s
}

/// Prefills on the prefill server; returns its tables.
pub fn prefill(ctx: &Client, s: &Submit) -> Vec<RankTables> {
    match ctx.call(Message::Submit(s.clone()), REPLY).unwrap() {
        Message::Submitted {
            result: Ok(tables), ..
        } => tables,
        other => panic!("prefill of request {}: {other:?}", s.request),
    }
}

/// Submits on the decode server (from the prefill server `ctx`), without waiting.
pub fn start(decode: &Client, s: &Submit, ctx: &Server) {
    start_from(decode, s, &ctx.peer());
}

/// Submits on the decode server (from the prefill instance `peer`), without waiting.
pub fn start_from(decode: &Client, s: &Submit, peer: &PeerRef) {
    let mut s = s.clone();
    s.peer = Some(peer.clone());
    decode.send(Message::Submit(s)).unwrap();
}

/// Waits for the `Done` of every request in `ids` (in any order).
pub fn wait_done(decode: &Client, ids: &[u64]) -> Vec<(u64, Result<RequestStats, String>)> {
    let mut out = Vec::new();
    while out.len() < ids.len() {
        match decode.recv(REPLY).unwrap() {
            Message::Done { request, result } => {
                assert!(
                    ids.contains(&request),
                    "Done for unexpected request {request}"
                );
                out.push((request, result));
            }
            other => panic!("expected Done, got {other:?}"),
        }
    }
    out.sort_by_key(|(id, _)| *id);
    out
}

/// Verifies a completed request on the decode server.
pub fn verify(decode: &Client, request: u64, context: &[RankTables]) -> VerifySummary {
    match decode
        .call(
            Message::Verify {
                request,
                context: context.to_vec(),
            },
            REPLY,
        )
        .unwrap()
    {
        Message::Verified {
            result: Ok(summary),
            ..
        } => summary,
        other => panic!("verify of request {request}: {other:?}"),
    }
}

/// Releases a request on one server.
pub fn release(client: &Client, request: u64) {
    match client.call(Message::Release { request }, REPLY).unwrap() {
        Message::Released { .. } => {}
        other => panic!("release of request {request}: {other:?}"),
    }
}

/// Checks that the decode server's pools hold only their canary.
pub fn verify_idle(decode: &Client) -> VerifySummary {
    match decode.call(Message::VerifyIdle, REPLY).unwrap() {
        Message::IdleVerified { result: Ok(s) } => s,
        other => panic!("idle verification: {other:?}"),
    }
}

/// Runs `submits` through a prefill and a decode server, all in flight at once, and
/// checks every byte of every request, then the idle pools. Returns the stats.
pub fn exchange(ctx: &Server, decode: &Server, submits: &[Submit]) -> Vec<RequestStats> {
    let (c, g) = (ctx.client(), decode.client());
    let tables: Vec<Vec<RankTables>> = submits.iter().map(|s| prefill(&c, s)).collect();
    let peer = ctx.peer();
    for s in submits {
        start_from(&g, s, &peer);
    }
    let ids: Vec<u64> = submits.iter().map(|s| s.request).collect();
    let done = wait_done(&g, &ids);
    let mut stats = Vec::new();
    for ((id, result), (s, t)) in done.into_iter().zip(submits.iter().zip(&tables)) {
        assert_eq!(id, s.request);
        let st = result.unwrap_or_else(|e| panic!("request {id} failed: {e}"));
        let summary = verify(&g, id, t);
        assert!(summary.ok, "request {id}: {}", summary.detail);
        assert!(summary.bytes_covered > 0 || s.cached >= s.prompt_len);
        release(&g, id);
        release(&c, id);
        stats.push(st);
    }
    let idle = verify_idle(&g);
    assert!(idle.ok, "idle pools: {}", idle.detail);
    stats
}

/// `kvferry demo ... --json` with no planner configuration from the environment.
pub fn demo(args: &[&str]) -> Value {
    let started = Instant::now();
    let v = Kvferry::new()
        .quiet()
        .arg("demo")
        .args(args)
        .arg("--json")
        .json();
    eprintln!(
        "demo {args:?}: {} bytes, {:.2} GB/s, {:?}",
        v["bytes"],
        v["gbps"].as_f64().unwrap_or(0.0),
        started.elapsed()
    );
    v
}
