//! One rank of a decode engine (one process per rank).
//!
//! It owns its KV pool (its own layout: [`kvferry_examples::engine::DECODE_LAYOUT`]) and
//! block allocator, derives the same requests from `--seed` as the prefill, and keeps up to
//! `--window` of them expected at once through its agent, reaching the prefill's ranks
//! through `--prefill-endpoints`. A request with a cached prefix gets its prefix rows
//! written here first (the decode's own pattern) and nothing before the prefix transferred.
//! Every received request is checked row by row (the prompt's tokens after the prefix hold
//! the prefill's pattern, the prefix still holds the decode's); a request the workload marks
//! is cancelled once a later one arrived (so mid-flight: the prefill holds it back) and
//! must end `Cancelled` (or `Failed`), its blocks never read.
//!
//! Exits 0 only if every request ended so, with exactly one terminal event each; prints a
//! one-line JSON summary.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use kvferry::Transport;
use kvferry_examples::engine::{self, DECODE_WINDOW, DecodeRank, Limits, Mix, Outcome};

/// The least time between a marked request's `expect` and its cancel.
const CANCEL_AFTER: Duration = Duration::from_millis(100);

#[derive(Parser, Debug)]
#[command(about = "One rank of the example decode engine")]
struct Args {
    /// This decode instance's name.
    #[arg(long, default_value = "decode")]
    instance: String,
    /// This process's TP rank.
    #[arg(long, default_value_t = 0)]
    rank: u32,
    /// The instance's TP size (1, 2, 4 or 8).
    #[arg(long, default_value_t = 1)]
    tp: u32,
    /// The workload's seed (the prefill's).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Requests in the workload.
    #[arg(long, default_value_t = 24)]
    requests: usize,
    /// What kind of requests.
    #[arg(long, value_enum, default_value = "mixed")]
    workload: Mix,
    /// The first request id.
    #[arg(long, default_value_t = 0)]
    id_base: u64,
    /// The prefill instance's name.
    #[arg(long, default_value = "prefill")]
    prefill_instance: String,
    /// The prefill ranks' side-channel endpoints, comma-separated, any order.
    #[arg(long, value_delimiter = ',', required = true)]
    prefill_endpoints: Vec<String>,
    /// Requests expected at once.
    #[arg(long, default_value_t = DECODE_WINDOW)]
    window: usize,
    /// UCX transport: tcp or shm.
    #[arg(long, default_value = "tcp")]
    transport: Transport,
    /// The deployment's secret (else KVFERRY_SECRET).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// How long a request may take.
    #[arg(long, default_value_t = 20_000)]
    timeout_ms: u64,
    /// How long a peer may stay silent (both engines should agree).
    #[arg(long, default_value_t = 10_000)]
    peer_timeout_ms: u64,
    /// Give up after this long.
    #[arg(long, default_value_t = 60)]
    deadline_s: u64,
}

#[derive(Default, Debug)]
struct Tally {
    received: u64,
    rows: u64,
    prefix_rows: u64,
    bytes: u64,
    cancelled: u64,
    failed_after_cancel: u64,
    errors: Vec<String>,
}

fn main() -> ExitCode {
    engine::init_logging();
    let args = Args::parse();
    match run(&args) {
        Ok(tally) => {
            let ok = tally.errors.is_empty();
            println!(
                "{}",
                serde_json::json!({
                    "program": "engine_decode",
                    "instance": args.instance,
                    "rank": args.rank,
                    "tp": args.tp,
                    "requests": args.requests,
                    "received": tally.received,
                    "verified_rows": tally.rows,
                    "cached_prefix_rows": tally.prefix_rows,
                    "bytes": tally.bytes,
                    "cancelled": tally.cancelled,
                    "failed_after_cancel": tally.failed_after_cancel,
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
        Err(e) => {
            eprintln!("engine_decode: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &Args) -> Result<Tally> {
    let limits = Limits {
        timeout: Duration::from_millis(args.timeout_ms),
        peer_timeout: Duration::from_millis(args.peer_timeout_ms),
    };
    let mut rank = DecodeRank::start(
        &args.instance,
        args.tp,
        args.rank,
        args.transport,
        engine::secret(args.secret_file.as_deref())?,
        limits,
        args.seed,
    )?;
    let specs = engine::workload(args.seed, args.id_base, args.requests, args.workload);
    // Position in the workload of every request expected and not ended, when it was
    // expected, and whether it was cancelled yet.
    let mut open: BTreeMap<u64, (usize, Instant, bool)> = BTreeMap::new();
    let mut next = 0;
    // The latest position of a request received: a marked request before it is cancelled.
    let mut latest_received: Option<usize> = None;
    let mut tally = Tally::default();
    let deadline = Instant::now() + Duration::from_secs(args.deadline_s);

    while next < specs.len() || !open.is_empty() {
        if Instant::now() > deadline {
            tally.errors.push(format!(
                "deadline: requests {:?} still open, {} not expected",
                open.keys().collect::<Vec<_>>(),
                specs.len() - next
            ));
            break;
        }
        while next < specs.len() && open.len() < args.window {
            let spec = &specs[next];
            if !rank.expect(spec, &args.prefill_instance, &args.prefill_endpoints)? {
                break;
            }
            open.insert(spec.id, (next, Instant::now(), false));
            next += 1;
        }
        for ending in rank.poll() {
            let Some(spec) = ending.spec else {
                tally.errors.push(format!("{:?}", ending.outcome));
                continue;
            };
            let (position, _, cancelled) =
                open.remove(&ending.id)
                    .unwrap_or((0, Instant::now(), false));
            match (ending.outcome, spec.cancel) {
                (
                    Outcome::Verified {
                        rows,
                        prefix_rows,
                        bytes,
                    },
                    false,
                ) => {
                    tally.received += 1;
                    tally.rows += rows;
                    tally.prefix_rows += prefix_rows;
                    tally.bytes += bytes;
                    latest_received = latest_received.max(Some(position));
                }
                (Outcome::Cancelled, true) if cancelled => tally.cancelled += 1,
                (Outcome::Failed { .. }, true) if cancelled => tally.failed_after_cancel += 1,
                (outcome, _) => tally.errors.push(format!(
                    "request {} (cancel: {}, cancelled: {cancelled}): {outcome:?}",
                    spec.id, spec.cancel
                )),
            }
        }
        // Cancel every marked request a later one overtook, and not at once: the agent
        // claims it from the prefill on a thread of its own, and a cancel that overtakes the
        // claim leaves the prefill's send to its lease.
        for (&id, (position, expected, cancelled)) in open.iter_mut() {
            if !*cancelled
                && specs[*position].cancel
                && latest_received.is_some_and(|l| l > *position)
                && expected.elapsed() >= CANCEL_AFTER
            {
                rank.cancel(id)?;
                *cancelled = true;
            }
        }
        engine::wait_for_events(rank.agent(), Duration::from_millis(2));
    }
    rank.stop();
    Ok(tally)
}
