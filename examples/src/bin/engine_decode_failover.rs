//! A one-rank decode engine fed by several independent prefill instances, for the failover
//! test: their requests are interleaved on one rank, and what happens to one instance must
//! touch only its own requests.
//!
//! `--peer NAME=ENDPOINT` names each prefill instance (one rank each); the `i`-th serves ids
//! from `1000 × (i + 1)`. Phase 1 expects every instance's `--requests` (each in two chunks
//! or more; the test kills or stops some instances meanwhile), prints one JSON line per
//! terminal event (`{"phase":1,"id":..,"instance":..,"outcome":..}`) and
//! `{"phase":1,"done":true}` once they all ended. Phase 2 then expects every instance's
//! `--fresh` requests, expecting a request again while it fails for want of its peer, for up
//! to `--retry-s` (a killed instance is being restarted, a stopped one resumed), and prints
//! their lines the same way.
//!
//! Every received request is checked row by row. Exits 0 only if no received row was wrong,
//! no request had two terminal events and every phase-2 request was received; which phase-1
//! requests had to fail is the test's to say. The last line is a JSON summary.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use clap::Parser;
use kvferry::Transport;
use kvferry::agent::FailureKind;
use kvferry_examples::engine::{self, DecodeRank, Limits, Mix, Outcome, RequestSpec};

#[derive(Parser, Debug)]
#[command(about = "A one-rank decode engine over several prefill instances")]
struct Args {
    /// This decode instance's name.
    #[arg(long, default_value = "decode")]
    instance: String,
    /// A prefill instance: NAME=ENDPOINT (one rank; repeat for each).
    #[arg(long = "peer", required = true)]
    peers: Vec<String>,
    /// The workloads' seed (the prefills').
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Phase-1 requests per instance.
    #[arg(long, default_value_t = 3)]
    requests: usize,
    /// Phase-2 requests per instance.
    #[arg(long, default_value_t = 2)]
    fresh: usize,
    /// UCX transport: tcp or shm.
    #[arg(long, default_value = "tcp")]
    transport: Transport,
    /// The deployment's secret (else KVFERRY_SECRET).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// How long a request may take.
    #[arg(long, default_value_t = 15_000)]
    timeout_ms: u64,
    /// How long a peer may stay silent (the prefills must agree).
    #[arg(long, default_value_t = 1_000)]
    peer_timeout_ms: u64,
    /// How long phase 2 keeps expecting a request whose peer is not back.
    #[arg(long, default_value_t = 15)]
    retry_s: u64,
    /// Give up after this long.
    #[arg(long, default_value_t = 60)]
    deadline_s: u64,
}

/// A prefill instance this rank is fed by.
#[derive(Debug)]
struct Peer {
    name: String,
    endpoints: Vec<String>,
}

#[derive(Default, Debug)]
struct Tally {
    verified: u64,
    rows: u64,
    failed: u64,
    retries: u64,
    errors: Vec<String>,
}

fn main() -> ExitCode {
    engine::init_logging();
    let args = Args::parse();
    let mut tally = Tally::default();
    if let Err(e) = run(&args, &mut tally) {
        tally.errors.push(format!("{e:#}"));
    }
    let ok = tally.errors.is_empty();
    println!(
        "{}",
        serde_json::json!({
            "program": "engine_decode_failover",
            "verified": tally.verified,
            "verified_rows": tally.rows,
            "failed": tally.failed,
            "retries": tally.retries,
            "ok": ok,
            "errors": tally.errors.iter().take(10).collect::<Vec<_>>(),
        })
    );
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn run(args: &Args, tally: &mut Tally) -> Result<()> {
    let peers: Vec<Peer> = args
        .peers
        .iter()
        .map(|p| {
            let (name, endpoint) = p
                .split_once('=')
                .ok_or_else(|| anyhow!("--peer {p}: expected NAME=ENDPOINT"))?;
            Ok(Peer {
                name: name.to_string(),
                endpoints: vec![endpoint.to_string()],
            })
        })
        .collect::<Result<_>>()?;
    let limits = Limits {
        timeout: Duration::from_millis(args.timeout_ms),
        peer_timeout: Duration::from_millis(args.peer_timeout_ms),
    };
    let mut rank = DecodeRank::start(
        &args.instance,
        1,
        0,
        args.transport,
        engine::secret(args.secret_file.as_deref())?,
        limits,
        args.seed,
    )?;
    let deadline = Instant::now() + Duration::from_secs(args.deadline_s);
    let base = |i: usize| 1000 * (i as u64 + 1);

    // Phase 1: every instance's requests, interleaved.
    let per_peer: Vec<Vec<RequestSpec>> = (0..peers.len())
        .map(|i| engine::workload(args.seed, base(i), args.requests, Mix::Chunked))
        .collect();
    let phase1 = interleave(&per_peer);
    run_phase(1, &mut rank, &peers, phase1, None, deadline, tally)?;
    println!("{}", serde_json::json!({"phase": 1, "done": true}));

    // Phase 2: fresh requests; a request whose peer is not back yet is expected again.
    let per_peer: Vec<Vec<RequestSpec>> = (0..peers.len())
        .map(|i| engine::fresh_workload(args.seed, base(i), args.fresh))
        .collect();
    let retry_until = Instant::now() + Duration::from_secs(args.retry_s);
    run_phase(
        2,
        &mut rank,
        &peers,
        interleave(&per_peer),
        Some(retry_until),
        deadline,
        tally,
    )?;
    rank.stop();
    Ok(())
}

/// `(instance index, request)` round robin over the instances.
fn interleave(per_peer: &[Vec<RequestSpec>]) -> VecDeque<(usize, RequestSpec)> {
    let longest = per_peer.iter().map(Vec::len).max().unwrap_or(0);
    (0..longest)
        .flat_map(|k| {
            per_peer
                .iter()
                .enumerate()
                .filter_map(move |(i, specs)| specs.get(k).map(|s| (i, s.clone())))
        })
        .collect()
}

/// Expects `queue` and waits until every request ended. With `retry_until`, a request that
/// fails for want of its peer is expected again (after 200 ms) until then, and every request
/// must be received.
fn run_phase(
    phase: u32,
    rank: &mut DecodeRank,
    peers: &[Peer],
    mut queue: VecDeque<(usize, RequestSpec)>,
    retry_until: Option<Instant>,
    deadline: Instant,
    tally: &mut Tally,
) -> Result<()> {
    let mut open: BTreeMap<u64, usize> = BTreeMap::new();
    let mut retry: Vec<(Instant, usize, RequestSpec)> = Vec::new();
    while !queue.is_empty() || !open.is_empty() || !retry.is_empty() {
        if Instant::now() > deadline {
            tally.errors.push(format!(
                "phase {phase} deadline: requests {:?} still open",
                open.keys().collect::<Vec<_>>()
            ));
            return Ok(());
        }
        let now = Instant::now();
        retry.retain(|(at, peer, spec)| {
            let due = *at <= now;
            if due {
                queue.push_back((*peer, spec.clone()));
            }
            !due
        });
        while let Some((peer, spec)) = queue.front() {
            let p = &peers[*peer];
            if !rank.expect(spec, &p.name, &p.endpoints)? {
                break;
            }
            open.insert(spec.id, *peer);
            queue.pop_front();
        }
        for ending in rank.poll() {
            let (Some(spec), Some(peer)) = (ending.spec, open.remove(&ending.id)) else {
                tally.errors.push(format!("{:?}", ending.outcome));
                continue;
            };
            let instance = &peers[peer].name;
            let line = match &ending.outcome {
                Outcome::Verified { rows, .. } => {
                    tally.verified += 1;
                    tally.rows += rows;
                    serde_json::json!({"phase": phase, "id": spec.id, "instance": instance,
                        "outcome": "verified", "rows": rows})
                }
                Outcome::Failed { kind, .. }
                    if *kind == FailureKind::Peer
                        && retry_until.is_some_and(|t| Instant::now() < t) =>
                {
                    tally.retries += 1;
                    retry.push((
                        Instant::now() + Duration::from_millis(200),
                        peer,
                        spec.clone(),
                    ));
                    continue;
                }
                Outcome::Failed { peer, kind, detail } => {
                    tally.failed += 1;
                    if retry_until.is_some() {
                        tally.errors.push(format!(
                            "phase {phase} request {} failed: {detail}",
                            spec.id
                        ));
                    }
                    serde_json::json!({"phase": phase, "id": spec.id, "instance": instance,
                        "outcome": "failed", "kind": kind.to_string(), "peer": peer,
                        "detail": detail})
                }
                other => {
                    tally
                        .errors
                        .push(format!("phase {phase} request {}: {other:?}", spec.id));
                    serde_json::json!({"phase": phase, "id": spec.id, "instance": instance,
                        "outcome": format!("{other:?}")})
                }
            };
            println!("{line}");
        }
        engine::wait_for_events(rank.agent(), Duration::from_millis(5));
    }
    Ok(())
}
