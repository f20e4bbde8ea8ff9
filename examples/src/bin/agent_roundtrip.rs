//! Per-request overhead of the agent from Rust: one prefill and one decode agent in this
//! process over shared memory, configured from the same versioned JSON the C API and the
//! Python package take (`kvferry::config::load`), and `requests` requests of `blocks`
//! blocks each run one after another: `expect`, `send`, then wait (on both wake descriptors)
//! for both terminal events. Prints the median, p90 and p99 of that time in microseconds.
//! `python/bench/roundtrip.py` runs the same transfer from Python, so the two medians compare
//! the bindings' cost on the same path.
//!
//! ```text
//! cargo run --release -p kvferry-examples --bin agent_roundtrip -- --requests 2000 --blocks 6
//! ```

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use kvferry::abi::{SlotTable, TokenRange};
use kvferry::agent::{Agent, DecodeAgent, Event, Expect, PrefillAgent, SendChunk};

/// The layout of python/tests/test_agent.py (and the C test): 2 layers x 2 KV heads x 32
/// bf16, K and V, 16 tokens per block, one pool, one HND view.
const LAYERS: u64 = 2;
const HEADS: u64 = 2;
const ROW: u64 = 32 * 2;
const TPB: u64 = 16;
const BUFFER: u64 = HEADS * TPB * ROW;
const SLOT: u64 = LAYERS * 2 * BUFFER;

#[derive(Parser)]
struct Args {
    /// Requests, one after another (the first tenth are warm-up, not counted).
    #[arg(long, default_value_t = 2000)]
    requests: u64,
    /// Blocks per request (8 KiB each).
    #[arg(long, default_value_t = 6)]
    blocks: u64,
    /// Where libkvferry_planner_default.so is (default: next to this binary).
    #[arg(long)]
    plugin_dir: Option<std::path::PathBuf>,
    /// UCX transports.
    #[arg(long, default_value = "shm")]
    transport: String,
}

/// The JSON configuration of one side over `pool` (`slots` slots).
fn config(
    name: &str,
    role: &str,
    pool: &[u8],
    slots: u64,
    plugin_dir: &str,
    transport: &str,
) -> String {
    let entries: Vec<_> = (0..LAYERS)
        .flat_map(|l| {
            (0..2).map(move |kv| {
                serde_json::json!({"local_layer": l, "offset": (l * 2 + kv) * BUFFER, "size": BUFFER})
            })
        })
        .collect();
    serde_json::json!({
        "version": 1,
        "instance": name,
        "role": role,
        "architecture": "LlamaForCausalLM",
        "planner": "kvferry.default",
        "plugin_dir": plugin_dir,
        "transport": transport,
        "listen": "127.0.0.1:0",
        "secret": "kvferry roundtrip bench secret",
        "rank": {
            "mapping": "tp1",
            "instance_rank": 0,
            "layers_per_pp": [LAYERS],
            "page_table": {
                "tokens_per_block": TPB,
                "pools": [{
                    "base": pool.as_ptr() as u64,
                    "slot_bytes": SLOT,
                    "slot_stride": SLOT,
                    "num_slots": slots,
                    "memory_type": "dram",
                }],
                "groups": [{
                    "kind": "paged",
                    "layers": (0..LAYERS).map(|i| serde_json::json!({"local": i, "global": i})).collect::<Vec<_>>(),
                    "views": [{
                        "pool": 0,
                        "roles": ["key", "value"],
                        "entries": entries,
                        "layout": {"kind": "hnd", "dtype": "bf16", "elem_bits": 16, "shard_unit_bytes": TPB * ROW},
                    }],
                }],
            },
        },
    })
    .to_string()
}

/// Waits until `agent` reports the terminal event of `request`.
fn wait_terminal(agent: &Agent, request: u64) -> Result<Event> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(e) = agent
            .poll()
            .into_iter()
            .find(|e| e.request() == request && e.is_terminal())
        {
            return Ok(e);
        }
        if Instant::now() > deadline {
            bail!("request {request}: no terminal event within 30 s");
        }
        let mut fd = libc::pollfd {
            fd: agent.wake_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; the agent owns the descriptor and outlives the call.
        unsafe { libc::poll(&mut fd, 1, 100) };
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let plugin_dir = match args.plugin_dir {
        Some(d) => d,
        None => std::env::current_exe()?
            .parent()
            .context("the binary's directory")?
            .to_path_buf(),
    };
    let plugin_dir = plugin_dir.display().to_string();
    let slots = args.blocks.max(1);
    let src = vec![7u8; (slots * SLOT) as usize];
    let dst = vec![0u8; (slots * SLOT) as usize];
    let (ctx_config, ctx_bound) = kvferry::config::load(&config(
        "rt-prefill",
        "context",
        &src,
        slots,
        &plugin_dir,
        &args.transport,
    ))?;
    let (gen_config, gen_bound) = kvferry::config::load(&config(
        "rt-decode",
        "generation",
        &dst,
        slots,
        &plugin_dir,
        &args.transport,
    ))?;
    // SAFETY: `src` and `dst` are live, initialised allocations of the sizes the page tables
    // name, kept until the agents are dropped at the end of `main`; this program touches
    // neither while a request is in flight.
    let prefill = unsafe { PrefillAgent::start(ctx_config, ctx_bound) }?;
    // SAFETY: as above.
    let decode = unsafe { DecodeAgent::start(gen_config, gen_bound) }?;
    let endpoint = prefill.endpoint().to_string();
    let tables = vec![SlotTable::new((0..args.blocks as i64).collect::<Vec<_>>())];
    let prompt = args.blocks * TPB;
    let warmup = args.requests / 10;
    let mut times = Vec::with_capacity(args.requests as usize);
    for id in 0..args.requests {
        let started = Instant::now();
        decode.expect(Expect {
            request: id,
            peer: "rt-prefill".into(),
            endpoints: vec![endpoint.clone()],
            ctx_dp_rank: 0,
            prompt_len: prompt,
            cached_prefix: None,
            tables: tables.clone(),
            excluded_views: Vec::new(),
        })?;
        prefill.send(SendChunk {
            request: id,
            tables: tables.clone(),
            tokens: TokenRange {
                start: 0,
                end: prompt,
            },
            prompt_len: prompt,
            is_last: true,
            to: None,
            views: None,
        })?;
        let received = wait_terminal(decode.as_agent(), id)?;
        let sent = wait_terminal(prefill.as_agent(), id)?;
        if !matches!(received, Event::Received { .. }) || !matches!(sent, Event::Sent { .. }) {
            bail!("request {id}: {received:?} / {sent:?}");
        }
        if id >= warmup {
            times.push(started.elapsed().as_secs_f64() * 1e6);
        }
    }
    if dst != src {
        bail!("the destination does not hold the source's bytes");
    }
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((q * times.len() as f64) as usize).min(times.len() - 1)];
    println!(
        "rust: {} requests of {} bytes over {}: median {:.1} us, p90 {:.1} us, p99 {:.1} us",
        times.len(),
        args.blocks * SLOT,
        args.transport,
        at(0.5),
        at(0.9),
        at(0.99)
    );
    Ok(())
}
