//! `kvferry bench --layer-compute-us T`: how much of a transfer layer-wise sends hide behind
//! the prefill's compute.
//!
//! Both instances' agents run in this process (every rank of each, over host memory this
//! module allocates, each layer in a pool of its own as vLLM keeps its cache), on the
//! transport asked for. Each round prefills `requests` requests of `prompt_len` tokens at
//! once, twice: the compute is simulated as `T` per model layer for the whole batch (layer
//! `l` of every request is computed at `t0 + (l + 1) T`, deadlines on one clock, so a late
//! wake-up does not shift the later layers; the thread sleeps meanwhile, as an engine's does
//! while its GPU computes), and
//!
//! - **whole-request**: every prefill rank sends each request whole once the last layer is
//!   computed;
//! - **layer-wise**: each prefill rank sends each request's layer `l` as soon as it is
//!   computed ([`kvferry_transfer::agent::SendChunk::views`]), the last layer marked last.
//!
//! The measure is the **tail**: from the end of the last layer's compute (its deadline, or the
//! moment the thread woke up after it if that was later) to the moment every
//! decode rank has reported every request `Received` (each decode rank checks that
//! its writers' byte counts match its own plan of the request before it does). Rounds
//! alternate which mode goes first. The report gives each mode's tail over the rounds (min /
//! median / max), the ratio of the medians (whole / layer-wise) and the spread of each
//! round's own ratio. Byte-for-byte correctness of layer-wise sends is the oracle tests'
//! business (`tests/agent_layers.rs`, the `layer_wise_sends_move_every_byte` demo test);
//! this measures time.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use kvferry_loader::BoundPlanner;
use kvferry_planner_abi::{
    GroupKind, Mapping, MemoryType, RankInfo, SlotTable, TokenRange, ViewId,
};
use kvferry_testkit::layout::{self, ModelSpec, PoolOptions};
use kvferry_transfer::Role;
use kvferry_transfer::TransportSpec;
use kvferry_transfer::agent::{Agent, AgentConfig, Event, Expect, Secret, SendChunk};
use serde::Serialize;

use crate::bench::Spread;

/// Rounds run before the counted ones (connections, first touch of the slots).
pub const WARMUP_ROUNDS: u32 = 1;

/// What to measure.
#[derive(Clone, Debug)]
pub struct OverlapConfig {
    /// The model (laid out a pool per layer whatever this says).
    pub model: ModelSpec,
    /// The prefill instance's deployment and its bound planner.
    pub prefill: (Mapping, BoundPlanner),
    /// The decode instance's.
    pub decode: (Mapping, BoundPlanner),
    /// UCX transports.
    pub transport: TransportSpec,
    /// Tokens of every request.
    pub prompt_len: u64,
    /// Requests per round, prefilled together.
    pub requests: u64,
    /// Counted rounds.
    pub rounds: u32,
    /// Simulated compute per model layer (for the whole batch).
    pub layer_compute: Duration,
}

/// One mode's tails.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TailReport {
    /// Milliseconds from the last layer's compute to every byte landed, per counted round.
    pub rounds_ms: Vec<f64>,
    /// Over the rounds.
    pub ms: Spread,
}

/// What `kvferry bench --layer-compute-us` prints.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OverlapReport {
    /// The model preset.
    pub model: String,
    /// Deployments, `prefill -> gen`.
    pub pair: String,
    /// The transport.
    pub transport: String,
    /// Model layers (compute steps).
    pub layers: u32,
    /// Tokens per request.
    pub prompt_len: u64,
    /// Requests per round.
    pub requests: u64,
    /// Simulated compute per layer, microseconds.
    pub layer_compute_us: u64,
    /// The simulated compute of a round (all layers), milliseconds.
    pub compute_ms: f64,
    /// Bytes moved per round (each mode).
    pub bytes_per_round: u64,
    /// Layer-wise sends per round (all prefill ranks).
    pub sends_per_round: u64,
    /// Whole-request sends.
    pub whole: TailReport,
    /// Layer-wise sends.
    pub layer_wise: TailReport,
    /// Median whole tail / median layer-wise tail.
    pub ratio: f64,
    /// Each round's own whole / layer-wise tail.
    pub ratio_rounds: Spread,
}

/// One instance: its ranks' agents and the memory under them (dropped after the agents).
struct Side {
    agents: Vec<Agent>,
    infos: Vec<RankInfo>,
    _memory: Vec<Vec<u64>>,
}

impl Drop for Side {
    fn drop(&mut self) {
        // The agents first: their pools are `_memory`.
        self.agents.clear();
    }
}

fn start_side(
    config: &OverlapConfig,
    name: &str,
    role: Role,
    (mapping, bound): &(Mapping, BoundPlanner),
    secret: &Secret,
) -> Result<Side> {
    let model = config.model.clone().with_pool_per_layer();
    let blocks = config
        .prompt_len
        .div_ceil(u64::from(model.tokens_per_block));
    let options = PoolOptions {
        paged_slots: blocks * config.requests,
        state_slots: config.requests,
        slot_padding: 0,
        memory_type: MemoryType::DRAM,
    };
    let mut memory: Vec<Vec<u64>> = Vec::new();
    let mut alloc = |_rank: u32, _pool: usize, bytes: u64| {
        // Written through, so no page is first touched inside a measured round.
        let mut b = vec![0x5a5a_5a5a_5a5a_5a5au64; bytes.div_ceil(8) as usize];
        let base = b.as_mut_ptr() as u64;
        memory.push(b);
        base
    };
    let infos = layout::build_instance(&model, mapping, name, bound.id(), &options, &mut alloc)
        .with_context(|| format!("{name} {mapping}"))?;
    let mut side = Side {
        agents: Vec::new(),
        infos: infos.clone(),
        _memory: memory,
    };
    for info in infos {
        let rank = info.instance_rank;
        let mut agent = AgentConfig::new(name, role, info, secret.clone());
        agent.transport = config.transport.clone();
        agent.listen = "127.0.0.1:0".into();
        agent.timeout = Duration::from_secs(120);
        agent.lease = Duration::from_secs(120);
        // SAFETY: every pool of the page table is one live allocation of `side._memory`
        // (host memory, initialised), which outlives the agents (`Side::drop` drops them
        // first) and which nothing else reads or writes while they run.
        let started = unsafe { Agent::start(agent, bound.clone()) }
            .with_context(|| format!("starting {name} rank {rank}"))?;
        side.agents.push(started);
    }
    Ok(side)
}

/// Rank `info`'s slot tables for request `k` of a round: PAGED groups its blocks, STATE
/// groups one slot.
fn tables(info: &RankInfo, k: u64, blocks: u64) -> Vec<SlotTable> {
    info.page_table
        .groups
        .iter()
        .map(|g| {
            if g.kind == GroupKind::STATE {
                SlotTable::new([k as i64])
            } else {
                SlotTable::new((k * blocks..(k + 1) * blocks).map(|s| s as i64))
            }
        })
        .collect()
}

/// Rank `info`'s views by the global layer they hold, in compute order.
fn views_by_layer(info: &RankInfo) -> BTreeMap<u32, Vec<ViewId>> {
    let mut out: BTreeMap<u32, Vec<ViewId>> = BTreeMap::new();
    for (g, group) in info.page_table.groups.iter().enumerate() {
        let layer = group.layers.iter().map(|l| l.global).min().unwrap_or(0);
        for v in 0..group.views.len() {
            out.entry(layer).or_default().push(ViewId {
                group: g as u32,
                view: v as u32,
            });
        }
    }
    out
}

/// Sleeps until `deadline` (never spins: a GPU computes while the engine's thread waits, and
/// on a small host a spinning thread would take the core kvferry's threads need).
fn wait_until(deadline: Instant) {
    let now = Instant::now();
    if deadline > now {
        std::thread::sleep(deadline - now);
    }
}

/// One mode of one round; returns (tail, bytes received).
fn round(
    config: &OverlapConfig,
    prefill: &Side,
    decode: &Side,
    endpoints: &[String],
    first_id: u64,
    layer_wise: bool,
) -> Result<(Duration, u64)> {
    let blocks = config
        .prompt_len
        .div_ceil(u64::from(config.model.tokens_per_block));
    let prompt = config.prompt_len;
    let all = TokenRange {
        start: 0,
        end: prompt,
    };
    for (agent, info) in decode.agents.iter().zip(&decode.infos) {
        for k in 0..config.requests {
            agent.expect(Expect {
                request: first_id + k,
                peer: "ctx".into(),
                endpoints: endpoints.to_vec(),
                ctx_dp_rank: 0,
                prompt_len: prompt,
                cached_prefix: None,
                tables: tables(info, k, blocks),
                excluded_views: Vec::new(),
            })?;
        }
    }
    let layers = config.model.num_layers();
    let per_rank: Vec<BTreeMap<u32, Vec<ViewId>>> =
        prefill.infos.iter().map(views_by_layer).collect();
    let send = |agent: &Agent, info: &RankInfo, views: Option<Vec<ViewId>>, last: bool| {
        for k in 0..config.requests {
            agent.send(SendChunk {
                request: first_id + k,
                tables: tables(info, k, blocks),
                tokens: all,
                prompt_len: prompt,
                is_last: last,
                to: None,
                views: views.clone(),
            })?;
        }
        Ok::<(), anyhow::Error>(())
    };
    let t0 = Instant::now();
    for l in 0..layers {
        wait_until(t0 + config.layer_compute * (l + 1));
        if !layer_wise {
            continue;
        }
        for ((agent, info), views) in prefill.agents.iter().zip(&prefill.infos).zip(&per_rank) {
            if let Some(v) = views.get(&l) {
                let last = views.keys().next_back() == Some(&l);
                send(agent, info, Some(v.clone()), last)?;
            }
        }
    }
    // The end of the last layer's compute: its deadline, or later when the wake-up was late
    // (the layer-wise sends of earlier layers happen on this thread, as in an engine).
    let computed = Instant::now().max(t0 + config.layer_compute * layers);
    if !layer_wise {
        for (agent, info) in prefill.agents.iter().zip(&prefill.infos) {
            send(agent, info, None, true)?;
        }
    }
    // Every decode rank's Received for every request.
    let want = decode.agents.len() as u64 * config.requests;
    let (mut got, mut bytes) = (0u64, 0u64);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut landed = computed;
    while got < want {
        for agent in &decode.agents {
            for e in agent.poll() {
                match e {
                    Event::Received { stats, .. } => {
                        got += 1;
                        bytes += stats.bytes;
                        landed = Instant::now();
                    }
                    other => bail!("a decode rank: {other:?}"),
                }
            }
        }
        if Instant::now() > deadline {
            bail!("{got} of {want} receptions after 120 s");
        }
        std::thread::sleep(Duration::from_micros(20));
    }
    // The prefill side's ends, so the next round starts clean.
    let want = prefill.agents.len() as u64 * config.requests;
    let mut sent = 0;
    while sent < want {
        for agent in &prefill.agents {
            for e in agent.poll() {
                match e {
                    Event::Sent { .. } => sent += 1,
                    other => bail!("a prefill rank: {other:?}"),
                }
            }
        }
        if Instant::now() > deadline {
            bail!("{sent} of {want} sends ended after 120 s");
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    Ok((landed.saturating_duration_since(computed), bytes))
}

/// Runs the measurement (see the module docs).
///
/// # Errors
///
/// A layout or agent that cannot be made, a request that does not end well.
pub fn run(config: &OverlapConfig) -> Result<OverlapReport> {
    if config.prefill.0.attention_dp || config.decode.0.attention_dp {
        bail!("--layer-compute-us: attention DP deployments are not measured (one DP group)");
    }
    if config.requests == 0 || config.prompt_len == 0 || config.rounds == 0 {
        bail!("--layer-compute-us needs requests, prompt length and rounds above 0");
    }
    let secret = Secret::new(format!(
        "kvferry overlap bench, process {}",
        std::process::id()
    ))
    .map_err(|e| anyhow!("{e}"))?;
    let prefill = start_side(config, "ctx", Role::Prefill, &config.prefill, &secret)?;
    let endpoints: Vec<String> = prefill
        .agents
        .iter()
        .filter_map(|a| a.endpoint().map(str::to_string))
        .collect();
    let decode = start_side(config, "gen", Role::Decode, &config.decode, &secret)?;
    let sends_per_round = prefill
        .infos
        .iter()
        .map(|i| views_by_layer(i).len() as u64 * config.requests)
        .sum();
    let mut whole = Vec::new();
    let mut layer_wise = Vec::new();
    let mut ratios = Vec::new();
    let mut bytes_per_round = 0;
    let mut next_id = 1u64;
    for r in 0..WARMUP_ROUNDS + config.rounds {
        let mut tails = [Duration::ZERO; 2];
        let order = if r % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for mode in order {
            let (tail, bytes) = round(config, &prefill, &decode, &endpoints, next_id, mode)?;
            next_id += config.requests;
            tails[usize::from(mode)] = tail;
            bytes_per_round = bytes;
        }
        if r >= WARMUP_ROUNDS {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            whole.push(ms(tails[0]));
            layer_wise.push(ms(tails[1]));
            ratios.push(ms(tails[0]) / ms(tails[1]).max(1e-6));
        }
    }
    let layers = config.model.num_layers();
    let (w, l) = (Spread::of(&whole), Spread::of(&layer_wise));
    Ok(OverlapReport {
        model: config.model.name().to_string(),
        pair: format!("{} -> {}", config.prefill.0, config.decode.0),
        transport: config.transport.to_string(),
        layers,
        prompt_len: config.prompt_len,
        requests: config.requests,
        layer_compute_us: config.layer_compute.as_micros() as u64,
        compute_ms: (config.layer_compute * layers).as_secs_f64() * 1e3,
        bytes_per_round,
        sends_per_round,
        whole: TailReport {
            rounds_ms: whole,
            ms: w,
        },
        layer_wise: TailReport {
            rounds_ms: layer_wise,
            ms: l,
        },
        ratio: w.median / l.median.max(1e-6),
        ratio_rounds: Spread::of(&ratios),
    })
}

impl std::fmt::Display for OverlapReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "overlap {} {} over {}: {} requests x {} tokens, {} per round, {} layers x {} us \
             of compute ({:.1} ms)",
            self.model,
            self.pair,
            self.transport,
            self.requests,
            self.prompt_len,
            kvferry_platform::units::size(self.bytes_per_round),
            self.layers,
            self.layer_compute_us,
            self.compute_ms
        )?;
        writeln!(
            f,
            "  tail after the last layer (ms, min/median/max over {} rounds):",
            self.whole.rounds_ms.len()
        )?;
        for (name, t) in [
            ("whole-request", &self.whole),
            ("layer-wise", &self.layer_wise),
        ] {
            writeln!(
                f,
                "    {name:<14} {:>9.3} {:>9.3} {:>9.3}",
                t.ms.min, t.ms.median, t.ms.max
            )?;
        }
        write!(
            f,
            "  whole / layer-wise: {:.2}x (per round {:.2}..{:.2}x); {} layer-wise sends per round",
            self.ratio, self.ratio_rounds.min, self.ratio_rounds.max, self.sends_per_round
        )
    }
}
