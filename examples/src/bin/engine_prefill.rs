//! One rank of a prefill engine (one process per rank, as engines run one per GPU).
//!
//! It owns its KV pool and block allocator, "computes" each request's KV (writes the
//! pattern of [`kvferry_examples::engine`] into the request's blocks, chunk by chunk) and
//! hands every chunk to its agent with `send`; a request's blocks go back to the allocator
//! only on its terminal event. The requests come from `--seed`, the same list the decode
//! derives, so nothing but the endpoint has to be exchanged: it is printed, and written to
//! `--endpoint-file`.
//!
//! A request the decode will cancel (the workload says which) is held back before its last
//! chunk — a long prefill the user abandons — so the cancel always lands mid-flight; it may
//! end as `Failed { CancelledByPeer }`, `Sent` should the cancel lose, or `Failed { Lease }`
//! should the decode cancel it before its agent claimed it here. With
//! `--hold-last` every first request is held so (used by the failover test, which kills or
//! stops this process meanwhile); they may end only by a failure. `--fresh N` adds N plain
//! requests that are never held (ids from `--id-base` + 500).
//!
//! Exits 0 once every request ended as expected, with exactly one terminal event each (and,
//! with `--until-stdin-closes`, once stdin is closed), after `--linger-ms` (so the last
//! completions leave before the process does); prints a one-line JSON summary.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use kvferry::abi::TokenRange;
use kvferry::agent::{AgentConfig, CallError, Event, FailureKind, PrefillAgent, SendChunk};
use kvferry::{Role, Transport};
use kvferry_examples::engine::{
    self, BlockAllocator, Mix, PREFILL_LAYOUT, RankCache, RequestSpec, SALT_PREFILL, blocks,
};

#[derive(Parser, Debug)]
#[command(about = "One rank of the example prefill engine")]
struct Args {
    /// This prefill instance's name.
    #[arg(long, default_value = "prefill")]
    instance: String,
    /// This process's TP rank.
    #[arg(long, default_value_t = 0)]
    rank: u32,
    /// The instance's TP size (1, 2, 4 or 8).
    #[arg(long, default_value_t = 1)]
    tp: u32,
    /// The workload's seed (the decode must use the same).
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
    /// Plain requests after the workload, never held (ids from id-base + 500).
    #[arg(long, default_value_t = 0)]
    fresh: usize,
    /// Hold back the last chunk of every workload request until it ends.
    #[arg(long)]
    hold_last: bool,
    /// UCX transport: tcp or shm.
    #[arg(long, default_value = "tcp")]
    transport: Transport,
    /// Side-channel listen address.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Where to write the advertised endpoint.
    #[arg(long)]
    endpoint_file: Option<PathBuf>,
    /// The deployment's secret (else KVFERRY_SECRET).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// How long a send waits for its receiver.
    #[arg(long, default_value_t = 15_000)]
    lease_ms: u64,
    /// How long a request may take once claimed.
    #[arg(long, default_value_t = 20_000)]
    timeout_ms: u64,
    /// How long a peer may stay silent (both engines should agree).
    #[arg(long, default_value_t = 10_000)]
    peer_timeout_ms: u64,
    /// How long to stay up after the last request ended (so the last completions leave).
    #[arg(long, default_value_t = 500)]
    linger_ms: u64,
    /// After the last request ended, keep serving until stdin is closed (as an engine
    /// serves until told to stop), then linger.
    #[arg(long)]
    until_stdin_closes: bool,
    /// Give up after this long.
    #[arg(long, default_value_t = 60)]
    deadline_s: u64,
}

/// A request being prefilled.
struct Active {
    spec: RequestSpec,
    slots: Vec<i64>,
    chunks: Vec<std::ops::Range<u64>>,
    /// The next chunk to send.
    next: usize,
    /// Its last chunk waits for its end (the decode cancels it, or this engine's peer dies).
    held: bool,
}

#[derive(Default, Debug)]
struct Tally {
    sent: u64,
    cancelled_by_peer: u64,
    /// Of those, never claimed (see `judge`).
    unclaimed: u64,
    failed: u64,
    bytes: u64,
    chunks: u64,
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
                    "program": "engine_prefill",
                    "instance": args.instance,
                    "rank": args.rank,
                    "tp": args.tp,
                    "requests": args.requests + args.fresh,
                    "sent": tally.sent,
                    "cancelled_by_peer": tally.cancelled_by_peer,
                    "cancelled_unclaimed": tally.unclaimed,
                    "failed": tally.failed,
                    "bytes": tally.bytes,
                    "chunks": tally.chunks,
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
            eprintln!("engine_prefill: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &Args) -> Result<Tally> {
    let mut cache = RankCache::new(args.tp, args.rank, PREFILL_LAYOUT)?;
    let mut free = BlockAllocator::new(
        cache.slots(),
        engine::mix(args.seed ^ 0x9EF1 ^ u64::from(args.rank)),
    );
    let mut config = AgentConfig::new(
        &args.instance,
        Role::Prefill,
        cache.rank_info(&args.instance),
        engine::secret(args.secret_file.as_deref())?,
    );
    config.label = format!("gqa 4x8x128 tp{}", args.tp);
    config.transport = args.transport.into();
    config.listen = args.listen.clone();
    config.lease = Duration::from_millis(args.lease_ms);
    config.timeout = Duration::from_millis(args.timeout_ms);
    config.peer_timeout = Duration::from_millis(args.peer_timeout_ms);
    // SAFETY: the pool is one live allocation owned by `cache`, declared before the agent and
    // so dropped after it. This engine writes a block only before the chunk that covers it
    // is sent, and reuses it only after its request's terminal event.
    let agent = unsafe { PrefillAgent::start(config, engine::bind_planner(args.tp)?) }?;
    let endpoint = agent.endpoint().to_string();
    eprintln!(
        "engine_prefill {} rank {}/{}: endpoint {endpoint}",
        args.instance, args.rank, args.tp
    );
    if let Some(path) = &args.endpoint_file {
        engine::write_atomically(path, &endpoint)?;
    }

    let mut pending: VecDeque<(RequestSpec, bool)> =
        engine::workload(args.seed, args.id_base, args.requests, args.workload)
            .into_iter()
            .map(|spec| {
                let held = args.hold_last || spec.cancel;
                (spec, held)
            })
            .chain(
                engine::fresh_workload(args.seed, args.id_base, args.fresh)
                    .into_iter()
                    .map(|spec| (spec, false)),
            )
            .collect();
    let mut active: BTreeMap<u64, Active> = BTreeMap::new();
    let mut tally = Tally::default();
    let deadline = Instant::now() + Duration::from_secs(args.deadline_s);

    while !pending.is_empty() || !active.is_empty() {
        if Instant::now() > deadline {
            tally.errors.push(format!(
                "deadline: requests {:?} still open, {} not started",
                active.keys().collect::<Vec<_>>(),
                pending.len()
            ));
            break;
        }
        for event in agent.poll() {
            let id = event.request();
            let Some(a) = active.remove(&id) else {
                tally
                    .errors
                    .push(format!("an event for no open request: {event:?}"));
                continue;
            };
            judge(&a, &event, &mut tally);
            free.free(a.slots);
        }
        // Start what fits, in order.
        while let Some((spec, _)) = pending.front() {
            let Some(slots) = free.alloc(blocks(spec.prompt_len)) else {
                break;
            };
            let (spec, held) = pending.pop_front().expect("front exists");
            active.insert(
                spec.id,
                Active {
                    chunks: spec.chunks(),
                    spec,
                    slots,
                    next: 0,
                    held,
                },
            );
        }
        // Compute and send one chunk of every request that has one due.
        for a in active.values_mut() {
            if a.next >= a.chunks.len() || (a.held && a.next + 1 == a.chunks.len()) {
                continue;
            }
            let tokens = a.chunks[a.next].clone();
            // SAFETY: these tokens' blocks were never in a sent table (chunks end on block
            // boundaries), so the agent does not read them yet.
            unsafe { cache.write_tokens(&a.slots, a.spec.id, tokens.clone(), SALT_PREFILL) };
            let send = SendChunk {
                request: a.spec.id,
                tables: engine::tables(&a.slots[..blocks(tokens.end)]),
                tokens: TokenRange {
                    start: tokens.start,
                    end: tokens.end,
                },
                prompt_len: a.spec.prompt_len,
                is_last: tokens.end == a.spec.prompt_len,
                to: None,
                views: None,
            };
            a.next += 1;
            match agent.send(send) {
                Ok(()) => tally.chunks += 1,
                // It ended already (its terminal event is queued): nothing more to send.
                Err(CallError::Unknown { .. }) => a.next = a.chunks.len(),
                Err(e) => {
                    tally.errors.push(format!("send {}: {e}", a.spec.id));
                    a.next = a.chunks.len();
                }
            }
        }
        engine::wait_for_events(agent.as_agent(), Duration::from_millis(2));
    }
    if args.until_stdin_closes {
        std::io::copy(&mut std::io::stdin(), &mut std::io::sink())?;
        for event in agent.poll() {
            tally
                .errors
                .push(format!("an event after the last request ended: {event:?}"));
        }
    }
    std::thread::sleep(Duration::from_millis(args.linger_ms));
    engine::stop_agent(agent.into());
    drop(cache);
    Ok(tally)
}

/// Counts a terminal event, and says what was wrong with it.
fn judge(a: &Active, event: &Event, tally: &mut Tally) {
    let id = a.spec.id;
    match event {
        Event::Sent { bytes, .. } => {
            tally.sent += 1;
            tally.bytes += bytes;
            if a.held && !a.spec.cancel {
                tally
                    .errors
                    .push(format!("request {id} was held, yet Sent"));
            }
        }
        Event::Failed {
            kind: FailureKind::CancelledByPeer,
            ..
        } if a.held => tally.cancelled_by_peer += 1,
        // The decode's cancel overtook its own claim (the decode agent claims on a thread of
        // its own): no receiver ever asked for it here, and the lease ends it.
        Event::Failed {
            kind: FailureKind::Lease,
            ..
        } if a.spec.cancel => {
            tally.cancelled_by_peer += 1;
            tally.unclaimed += 1;
        }
        // A held request of a peer that vanished (the failover test).
        Event::Failed {
            kind: FailureKind::Peer,
            ..
        } if a.held && !a.spec.cancel => tally.failed += 1,
        other => {
            tally.failed += 1;
            tally
                .errors
                .push(format!("request {id} ended unexpectedly: {other:?}"));
        }
    }
}
