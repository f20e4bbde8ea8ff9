//! `kvferry`: list planners, check a deployment, dry-run a transfer plan, serve an instance,
//! run the two-process demo, benchmark the transfer path. The operator commands (`planners`,
//! `check`, `plan`, `conform`, `doctor`) are written here over the `kvferry` facade; `serve`,
//! `demo` and `bench` parse their options here and run in `kvferry-harness`.

#![forbid(unsafe_code)]

mod doctor;
mod plan_dry;
mod progress;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Parser, Subcommand};
use kvferry::agent::{BounceConfig, BounceMode, Integrity};
use kvferry::config::{CONFIG_ENV, FileConfig};
use kvferry::{MemoryKind, Role, TransportSpec};
use kvferry_harness::bench::{self, BenchConfig};
use kvferry_harness::demo::{self, DemoConfig, LoopbackPair};
use kvferry_harness::serve::{InstanceConfig, ServeOptions};
use kvferry_loader::{BoundPlanner, Candidate, Registry};
use kvferry_plan::bounce::{self, BounceLimits};
use kvferry_planner_abi::{Deployment, Mapping, PlanError, RankInfo, TokenRange, TransferPlanner};
use kvferry_testkit::conform::CaseVerdict;
use kvferry_testkit::conform::PlannerUnderTest;
use kvferry_testkit::layout::{
    self, Dtype, LayoutError, ModelShape, ModelSpec, PoolOptions, Preset,
};
use kvferry_testkit::oracle::LocalMemory;
use kvferry_testkit::scenario::{
    Exchange, MemoryBudget, PlannerFactory, ReceiverReport, Scenario, ScenarioError,
};
use kvferry_testkit::units;
use progress::Progress;
use serde_json::json;

/// Moves LLM KV caches from prefill servers to decode servers, planned by plugins.
#[derive(Debug, Parser)]
#[command(name = "kvferry", version, about)]
struct Cli {
    /// Config file, TOML or JSON: `planner` and `plugin_dir`, or an agent's whole configuration
    /// (its `planner` and `plugin_dir` are used); default `$KVFERRY_CONFIG`.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the planners found on the plugin path.
    Planners {
        /// Also list files that were skipped, and why.
        #[arg(long)]
        all: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Which UCX this binary loads and what it can do here: version and files, transports
    /// and devices each --transport selects, memory types it can register, CUDA driver and
    /// GPUs. Exits 1 when it finds a problem.
    Doctor {
        /// Devices for the tcp transport instead of `lo` (UCX_NET_DEVICES syntax: `eth0`,
        /// `mlx5_0:1`, `all`).
        #[arg(long, value_name = "DEVICES")]
        net_devices: Option<String>,
        /// Also fail (exit 1) unless UCX can register CUDA device memory.
        #[arg(long)]
        require_cuda: bool,
        /// Print one JSON object: ucx, cuda, transports, ucx_env, problems.
        #[arg(long)]
        json: bool,
    },
    /// Bind a planner for a model and deployment, or say why it cannot be bound.
    Check {
        /// Model: a preset (deepseek-v3, llama-3-70b, qwen3-next-80b-a3b, gpt-oss-120b) or
        /// the path of a Hugging Face config.json (or of its folder).
        #[arg(long, value_name = "PRESET|CONFIG", value_parser = parse_model)]
        model: ModelShape,
        /// Deployment: tp4, tp4pp2, tp2cp4, dep8, dep8ep8, ...
        #[arg(long, value_name = "SPEC", value_parser = parse_spec)]
        deployment: Mapping,
        #[command(flatten)]
        shape: Shape,
        /// Planner id, or `auto` for the most specific planner that supports the deployment
        /// (default: $KVFERRY_PLANNER, config `planner`, kvferry.default).
        #[arg(long, value_name = "ID")]
        planner: Option<String>,
        /// Print JSON: `deployment`, `selected`, `bound`, `auto`, `candidates`, `error`.
        #[arg(long)]
        json: bool,
    },
    /// Dry-run one request: plan and validate every (sender, receiver) pair from the page
    /// tables alone and count its fragments and bytes; with --verify also execute the plans
    /// in memory and check every destination byte.
    Plan {
        /// Model: a preset (deepseek-v3, llama-3-70b, qwen3-next-80b-a3b, gpt-oss-120b) or
        /// the path of a Hugging Face config.json (or of its folder).
        #[arg(long, value_name = "PRESET|CONFIG", value_parser = parse_model)]
        model: ModelShape,
        /// The prefill instance's deployment.
        #[arg(long = "ctx", visible_alias = "prefill", value_name = "SPEC", value_parser = parse_spec)]
        prefill: Mapping,
        /// The decode instance's deployment.
        #[arg(long = "gen", visible_alias = "decode", value_name = "SPEC", value_parser = parse_spec)]
        decode: Mapping,
        /// Prompt length in tokens.
        #[arg(long, value_name = "N")]
        prompt_len: u64,
        #[command(flatten)]
        shape: Shape,
        #[command(flatten)]
        sides: Sides,
        /// Prefill DP rank serving the request.
        #[arg(long, default_value_t = 0, value_name = "N")]
        ctx_dp_rank: u32,
        /// Decode DP rank receiving it.
        #[arg(long, default_value_t = 0, value_name = "N")]
        gen_dp_rank: u32,
        /// Send in chunks of this many tokens (a multiple of the block size).
        #[arg(long, value_name = "TOKENS")]
        chunk: Option<u64>,
        /// Prompt tokens the receiver already caches.
        #[arg(long, default_value_t = 0, value_name = "TOKENS")]
        cached: u64,
        /// Seed of the random slot placement.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Place each side's slots contiguously instead of at random.
        #[arg(long)]
        contiguous: bool,
        #[command(flatten)]
        bounce: BounceArgs,
        /// Planner id (default: $KVFERRY_PLANNER, config `planner`, kvferry.default).
        #[arg(long, value_name = "ID")]
        planner: Option<String>,
        /// Also move the bytes: back the pools taking part in memory, tag the sources, execute
        /// every plan and check every destination byte (memory and time grow with the
        /// prompt: about 22 s and 6 GB for 8,192 tokens of Llama-3-70B tp4 -> tp8).
        #[arg(long)]
        verify: bool,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Prove a planner: run the oracle matrix (every model preset × prefill/decode
    /// topology pair it accepts) in memory and check every destination byte.
    Conform {
        /// The planner library (`.so`) to prove; or name one on the plugin path with
        /// --planner.
        #[arg(
            value_name = "LIBRARY",
            conflicts_with = "planner",
            required_unless_present = "planner"
        )]
        library: Option<PathBuf>,
        /// A planner id from the plugin path instead of a file.
        #[arg(long, value_name = "ID")]
        planner: Option<String>,
        /// Seed of the matrix (decimal or 0x-hex); the same seed gives the same cases.
        #[arg(long, value_parser = parse_seed, default_value = "0x7ac1e")]
        seed: u64,
        /// Run only the cases whose name contains this text.
        #[arg(long, value_name = "TEXT")]
        case: Option<String>,
        /// Also move each single-writer receiver's pieces through a bounce region as the
        /// agent does (`on`: every case; `auto`: where the agent's default thresholds pass,
        /// 96 blocks; `off`: fragment by fragment).
        #[arg(long, default_value = "off", value_name = "on|off|auto")]
        bounce: BounceMode,
        /// Print one JSON object: planner, cases, passed, failed, refused, failures, results.
        #[arg(long)]
        json: bool,
        /// Print every case as it ends (by default: the failures, then a summary by model).
        #[arg(long, short)]
        verbose: bool,
    },
    /// Run the ranks of one instance (every rank in this process, or one with --rank), one
    /// transfer agent per rank, as a prefill or decode server.
    Serve(ServeArgs),
    /// Start a prefill and a decode server on loopback and stream requests through them,
    /// checking every destination byte.
    Demo(DemoArgs),
    /// Time kvferry's transfer path against a bare UCX put loop over the same fragments (and
    /// optionally `ucx_perftest`), with a prefill and a decode server on loopback.
    Bench(BenchArgs),
}

/// Options of `kvferry serve`.
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Which side this instance is (`context` and `generation` are read too).
    #[arg(long, value_name = "prefill|decode")]
    role: Role,
    /// Model: a preset (deepseek-v3, llama-3-70b, qwen3-next-80b-a3b, gpt-oss-120b) or the
    /// path of a Hugging Face config.json (or of its folder).
    #[arg(long, value_name = "PRESET|CONFIG", value_parser = parse_model)]
    model: ModelShape,
    /// Deployment: tp4, tp4pp2, dep8, ...
    #[arg(long, value_name = "SPEC", value_parser = parse_spec)]
    deployment: Mapping,
    #[command(flatten)]
    shape: Shape,
    /// Planner id (default: $KVFERRY_PLANNER, config `planner`, kvferry.default).
    #[arg(long, value_name = "ID")]
    planner: Option<String>,
    /// Serve this rank of the deployment only (one process per rank, as engines run them).
    #[arg(long, value_name = "N")]
    rank: Option<u32>,
    /// Prefill side: where every rank's agent listens for generation peers (port 0: each a
    /// free port; all endpoints are printed on stdout as `listening on HOST:PORT[,...]`).
    #[arg(long, default_value = "127.0.0.1:0", value_name = "HOST:PORT")]
    listen: String,
    /// Prefill side: the host address to advertise when --listen is unspecified (0.0.0.0).
    #[arg(long, value_name = "IP")]
    advertise: Option<String>,
    /// The deployment's shared secret (at least 16 bytes; a trailing newline is dropped);
    /// else $KVFERRY_SECRET. Both servers of a pair must hold the same one.
    #[arg(long, value_name = "FILE")]
    secret_file: Option<PathBuf>,
    /// The controller's address (`kvferry demo`, `bench`, tests), printed on stdout as
    /// `control on HOST:PORT`. Keep it on loopback: it can shut the server down.
    #[arg(long, default_value = "127.0.0.1:0", value_name = "HOST:PORT")]
    control: String,
    /// Serve the agents' numbers for Prometheus at `http://HOST:PORT/metrics`, and the probes
    /// `/healthz` and `/readyz` (port 0: a free one), printed on stdout as
    /// `metrics on HOST:PORT`.
    #[arg(long, value_name = "HOST:PORT")]
    metrics_listen: Option<String>,
    #[command(flatten)]
    transport: TransportArgs,
    #[command(flatten)]
    bounce: AgentBounceArgs,
    #[command(flatten)]
    memory: MemoryArgs,
    /// PAGED slots per pool of every rank.
    #[arg(long, default_value_t = 256, value_name = "N")]
    slots: u64,
    /// STATE slots per pool of every rank (recurrent-state models).
    #[arg(long, default_value_t = 16, value_name = "N")]
    state_slots: u64,
    /// Fail a request whose writers have not all reported this long after it was expected
    /// (decode) or claimed (prefill).
    #[arg(long, default_value_t = 30_000, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    timeout_ms: u64,
    /// Prefill side: fail a prefilled request nobody claimed after this long.
    #[arg(long, default_value_t = 60_000, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    lease_ms: u64,
    /// Fail the requests of a peer that sent nothing (keep-alives included) for this long.
    #[arg(long, default_value_t = 10_000, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    peer_timeout_ms: u64,
    /// Decode side: ask every writer for a digest of each piece (`xxh3` or `crc32c`) and
    /// check the bytes that landed before a request is received (host memory only).
    #[arg(long, value_name = "DIGEST")]
    integrity: Option<Integrity>,
    /// Salt of the oracle's tags and canaries (both servers of a pair must agree).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Instance name (default: `ctx-PID` or `gen-PID`).
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
    /// Fault injection, prefill side: sleep this long before every flush.
    #[arg(long, default_value_t = 0, hide = true)]
    debug_stall_ms: u64,
    /// Prefill side: peer connections each rank serves at once; one more closes the oldest
    /// that has not proven the secret (refused only when every one has).
    #[arg(long, default_value_t = 256, value_name = "N")]
    max_peer_connections: usize,
    /// Prefill side: keep every written plan until its request is released, so `kvferry
    /// bench` can replay it with a bare put loop.
    #[arg(long, hide = true)]
    record_plans: bool,
    /// Exit when standard input reaches its end (a parent holding the pipe has gone).
    #[arg(long)]
    exit_with_stdin: bool,
}

/// The loopback server pair `demo` and `bench` start.
#[derive(Debug, clap::Args)]
struct PairArgs {
    /// Model: a preset (deepseek-v3, llama-3-70b, qwen3-next-80b-a3b, gpt-oss-120b) or the
    /// path of a Hugging Face config.json (or of its folder). Required, except by `bench
    /// --sweep`, which brings its own.
    #[arg(long, value_name = "PRESET|CONFIG", value_parser = parse_model)]
    model: Option<ModelShape>,
    /// The prefill instance's deployment.
    #[arg(long = "ctx", visible_alias = "prefill", value_name = "SPEC")]
    prefill: String,
    /// The decode instance's deployment.
    #[arg(long = "gen", visible_alias = "decode", value_name = "SPEC")]
    decode: String,
    #[command(flatten)]
    shape: Shape,
    #[command(flatten)]
    sides: Sides,
    #[command(flatten)]
    transport: TransportArgs,
    #[command(flatten)]
    bounce: AgentBounceArgs,
    #[command(flatten)]
    memory: MemoryArgs,
    /// Planner id for both servers (default: $KVFERRY_PLANNER, config `planner`,
    /// kvferry.default).
    #[arg(long, value_name = "ID")]
    planner: Option<String>,
    /// Seed of prompt lengths and slot placement, and the oracle's salt.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Per-request timeout of both servers.
    #[arg(long, default_value_t = 30_000, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    timeout_ms: u64,
    /// End-to-end integrity digests (`xxh3` or `crc32c`): the decode server checks every
    /// piece against its writer's digest (host memory only).
    #[arg(long, value_name = "DIGEST")]
    integrity: Option<Integrity>,
}

impl PairArgs {
    /// Checks the options and resolves the deployments and the executable.
    fn resolve(self, config_file: Option<PathBuf>) -> Result<LoopbackPair> {
        self.memory.check()?;
        let model = self
            .model
            .as_ref()
            .ok_or_else(|| anyhow!("--model is required (a preset or a config.json)"))?;
        let (model, gen_tokens_per_block) = self.sides.models(&self.shape, model);
        let prefill = self
            .prefill
            .parse::<Mapping>()
            .map_err(|e| anyhow!("--ctx: {e}"))?;
        let decode = self
            .decode
            .parse::<Mapping>()
            .map_err(|e| anyhow!("--gen: {e}"))?;
        check_width("--ctx", &prefill)?;
        check_width("--gen", &decode)?;
        Ok(LoopbackPair {
            exe: std::env::current_exe().context("locating the kvferry executable")?,
            config_file,
            model,
            gen_tokens_per_block,
            ctx_spec: self.prefill,
            gen_spec: self.decode,
            prefill,
            decode,
            transport: self.transport.spec(),
            bounce: self.bounce.bounce,
            bounce_arena_mb: self.bounce.bounce_arena_mb,
            memory: self.memory.memory,
            cuda_device: self.memory.cuda_device,
            planner: self.planner,
            seed: self.seed,
            timeout: Duration::from_millis(self.timeout_ms),
            integrity: self.integrity,
        })
    }
}

/// Options of `kvferry demo`.
#[derive(Debug, clap::Args)]
struct DemoArgs {
    #[command(flatten)]
    pair: PairArgs,
    /// Requests to stream.
    #[arg(long, default_value_t = 32, value_name = "N")]
    requests: u64,
    /// Longest prompt; each request's length is drawn from 1..=MAX.
    #[arg(long, default_value_t = 1024, value_name = "MAX")]
    prompt_len: u64,
    /// Send each request in chunks of this many tokens (a multiple of the block size).
    #[arg(long, value_name = "TOKENS")]
    chunk: Option<u64>,
    /// Send each chunk layer-wise in N parts: each part carries the next run of the
    /// prefill ranks' views (page-table order), as an engine sends layers as it computes
    /// them (a model whose views each hold every layer has fewer parts).
    #[arg(long, default_value_t = 1, value_name = "N")]
    layer_wise: u32,
    /// Prompt tokens the receiver already caches.
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    cached: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    in_flight: usize,
    /// Drive prefill servers already running (`kvferry serve --role prefill`, here or on
    /// another host) instead of starting one: their control addresses, one per process.
    #[arg(
        long,
        value_name = "HOST:PORT[,...]",
        value_delimiter = ',',
        requires = "gen_at"
    )]
    ctx_at: Vec<String>,
    /// The decode servers to drive with --ctx-at.
    #[arg(
        long,
        value_name = "HOST:PORT[,...]",
        value_delimiter = ',',
        requires = "ctx_at"
    )]
    gen_at: Vec<String>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Options of `kvferry bench`.
#[derive(Debug, clap::Args)]
struct BenchArgs {
    #[command(flatten)]
    pair: PairArgs,
    /// Tokens of every request (required, except with --sweep).
    #[arg(long, value_name = "N")]
    prompt_len: Option<u64>,
    /// nixlbench's grid instead of one model: for every fragment size and batch size, one
    /// request of BATCH fragments of that size at a time, on a one-layer model whose blocks
    /// are those fragments (one KV head of 128, bf16; use --ctx tp1 --gen tp1), fresh
    /// servers per cell; GB/s of kvferry, the bare put loop and memcpy, and the average and
    /// p99 of each request's time, preparation and posting. With --export-workload DIR,
    /// every cell's workload goes to DIR/SIZE-BATCH.json (`scripts/bench-peers --sweep`).
    #[arg(long, conflicts_with_all = ["layer_compute_us", "export_fragments", "perftest", "prompt_len", "requests"])]
    sweep: bool,
    /// With --sweep: the fragment sizes (bytes; k and m suffixes are KiB and MiB; multiples
    /// of 512; default 4k,16k,64k,256k,1m,4m).
    #[arg(long, value_name = "SIZE[,SIZE...]", value_delimiter = ',', value_parser = parse_size)]
    fragment_sizes: Option<Vec<u64>>,
    /// With --sweep: fragments per request (default 1,4,16,64,256,1024).
    #[arg(long, value_name = "N[,N...]", value_delimiter = ',')]
    batches: Option<Vec<u64>>,
    /// With --sweep: skip the cells whose request would move more than this (k, m and g
    /// suffixes: KiB, MiB, GiB; default 256m).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    max_request_bytes: Option<u64>,
    /// Requests per round, all in flight at once (spread over the DP groups). A comma list
    /// (`1,2,4,8`) runs the bench once per value and adds a table of how the per-request
    /// overhead grows; with `--json` it prints an array of reports instead of one.
    #[arg(
        long,
        default_value = "8",
        value_name = "N[,N...]",
        value_delimiter = ','
    )]
    requests: Vec<u64>,
    /// Counted rounds, after two warm-up rounds. On a loaded 2-core machine the ours/raw
    /// ratio of one Llama shm command spread with a standard deviation of 0.063 over 7 runs
    /// of 5 rounds, 0.048 over 13 runs of 15 (most of the rest is the machine).
    #[arg(long, default_value_t = 15, value_name = "N")]
    rounds: u32,
    /// Also run `ucx_perftest -t ucp_put_bw` (package ucx-utils) with the mean fragment size
    /// and the same UCX transports.
    #[arg(long)]
    perftest: bool,
    /// Write the fragments of round 0's set (the one the oracle checks), exactly as the
    /// prefill server recorded them and the raw loop puts, to FILE as JSON: per (prefill
    /// rank, decode rank) pair its pools' sizes and `[src_pool, src_offset, dst_pool,
    /// dst_offset, len]` per fragment (format `kvferry-fragments/1`; `scripts/bench-peers`).
    #[arg(long, value_name = "FILE")]
    export_fragments: Option<PathBuf>,
    /// Write round 0's set as an engine holds it to FILE as JSON: every rank's configuration
    /// (as its agent reads it) and each request's slot tables on both sides, with the counts
    /// of kvferry's own plans per pair (format `kvferry-workload/1`): another transfer layer
    /// plans it with kvferry's `PairPlanner` and moves the bytes (`scripts/bench-peers`).
    #[arg(long, value_name = "FILE")]
    export_workload: Option<PathBuf>,
    /// Measure layer-wise sends instead: both instances' agents in this process, each layer
    /// in a pool of its own (vLLM's layout), the prefill's compute simulated as US
    /// microseconds per model layer for the batch; reports the time from the last layer's
    /// compute to every byte landed, whole-request sends against layer-wise ones (the first
    /// of --requests, --rounds counted rounds; --transport, --planner and the model options
    /// apply).
    #[arg(long, value_name = "US")]
    layer_compute_us: Option<u64>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Bounce transfers of `serve`, `demo` and `bench` (transfer-semantics §9).
#[derive(Debug, clap::Args)]
struct AgentBounceArgs {
    /// Gather each piece into a staging buffer and put it into the receiver's bounce arena
    /// in large puts, which scatters it by its own plan: `on` for every request that fits,
    /// `auto` where it pays (transports that leave the node, requests of 96 blocks or more,
    /// fragments under 16 KiB on average), `off` never. Both servers of a pair should agree.
    #[arg(long, default_value = "auto", value_name = "on|off|auto")]
    bounce: BounceMode,
    /// Decode side: MiB of each rank's bounce arena (allocated at start when bouncing).
    #[arg(long, default_value_t = 256, value_name = "MIB")]
    bounce_arena_mb: u64,
}

impl AgentBounceArgs {
    fn config(&self) -> Result<BounceConfig> {
        let arena_bytes = self
            .bounce_arena_mb
            .checked_mul(1 << 20)
            .ok_or_else(|| anyhow!("--bounce-arena-mb {} overflows", self.bounce_arena_mb))?;
        Ok(BounceConfig {
            mode: self.bounce,
            arena_bytes,
            ..BounceConfig::default()
        })
    }
}

/// The UCX transports of `serve`, `demo` and `bench`.
#[derive(Debug, clap::Args)]
struct TransportArgs {
    /// UCX transports: `shm` (shared memory), `tcp` (on `lo` unless --net-devices), `auto`
    /// (UCX's own choice, and its UCX_TLS), or a UCX_TLS list such as `rc_x,sm,self`.
    #[arg(long, default_value = "shm", value_name = "shm|tcp|auto|LIST")]
    transport: TransportSpec,
    /// Network devices for UCX (UCX_NET_DEVICES syntax: `eth0`, `mlx5_0:1`, `veth0,veth1`).
    #[arg(long, value_name = "DEV[,DEV]")]
    net_devices: Option<String>,
    /// Open UCX endpoints in peer-failure mode (tcp and non-shm lists): UCX's own error
    /// handler fails the puts to a dead peer; costs tcp its native put (about 3x here).
    #[arg(long)]
    ucx_peer_errors: bool,
}

impl TransportArgs {
    fn spec(&self) -> TransportSpec {
        TransportSpec {
            net_devices: self.net_devices.clone(),
            ucx_peer_errors: self.ucx_peer_errors,
            ..self.transport.clone()
        }
    }
}

/// Where the servers' KV pools live, shared by `serve`, `demo` and `bench`.
#[derive(Debug, clap::Args)]
struct MemoryArgs {
    /// KV pool memory: host DRAM, or CUDA device memory registered with UCX (needs a build
    /// with `--features cuda`, the CUDA driver, and a UCX built with CUDA support).
    #[arg(long, default_value = "host", value_name = "host|cuda")]
    memory: MemoryKind,
    /// With `--memory cuda`: the device of every rank (default: the rank's index modulo the
    /// device count).
    #[arg(long, value_name = "N")]
    cuda_device: Option<usize>,
}

impl MemoryArgs {
    /// Refuses what this build or these flags cannot do, before anything starts.
    fn check(&self) -> Result<()> {
        self.memory.check_built()?;
        if self.cuda_device.is_some() && self.memory != MemoryKind::Cuda {
            bail!("--cuda-device needs --memory cuda");
        }
        Ok(())
    }
}

/// Cache shape options shared by `check` and `plan`.
#[derive(Debug, clap::Args)]
struct Shape {
    /// KV cache element type (default: the preset's, fp8 for deepseek-v3, else bf16; a
    /// config.json's torch_dtype).
    #[arg(long, value_name = "fp8|bf16|fp16|fp32")]
    dtype: Option<Dtype>,
    /// Tokens per cache block.
    #[arg(long, default_value_t = 32, value_name = "N")]
    tokens_per_block: u32,
}

impl Shape {
    fn model(&self, shape: &ModelShape) -> ModelSpec {
        let mut model = ModelSpec::of(shape.clone()).with_tokens_per_block(self.tokens_per_block);
        if let Some(dtype) = self.dtype {
            model = model.with_dtype(dtype);
        }
        model
    }
}

/// Block sizes of the two sides, when they differ (`plan`, `demo`, `bench`): HND caches
/// re-block when one side's size is a multiple of the other's (semantics §3.2 rule 4).
#[derive(Debug, clap::Args)]
struct Sides {
    /// Tokens per block of the prefill instance (default: --tokens-per-block).
    #[arg(long, value_name = "N")]
    ctx_tokens_per_block: Option<u32>,
    /// Tokens per block of the decode instance (default: --tokens-per-block).
    #[arg(long, value_name = "N")]
    gen_tokens_per_block: Option<u32>,
}

impl Sides {
    /// The prefill side's model and the decode side's block size, when it differs.
    fn models(&self, shape: &Shape, model: &ModelShape) -> (ModelSpec, Option<u32>) {
        let mut prefill = shape.model(model);
        if let Some(tpb) = self.ctx_tokens_per_block {
            prefill = prefill.with_tokens_per_block(tpb);
        }
        let decode_tpb = self
            .gen_tokens_per_block
            .filter(|&tpb| tpb != prefill.tokens_per_block);
        (prefill, decode_tpb)
    }
}

/// Bounce-arena limits `plan` checks each receiver's region against (semantics §9.2).
#[derive(Debug, clap::Args)]
struct BounceArgs {
    /// Move each single-writer receiver's pieces through its bounce region where the limits
    /// pass (`auto`), for every request (`on`: no block or byte threshold), or never
    /// (`off`): gathered by the sender's plan, scattered by the receiver's own plan.
    #[arg(long, default_value = "auto", value_name = "on|off|auto")]
    bounce: BounceMode,
    /// Bounce arena size in MiB (default: unbounded, report the size a region needs).
    #[arg(long, value_name = "MIB")]
    bounce_arena_mb: Option<u64>,
    /// Fewest paged blocks worth a bounce, for requests without recurrent state.
    #[arg(long, default_value_t = bounce::DEFAULT_MIN_BLOCKS, value_name = "N")]
    bounce_min_blocks: u64,
    /// Fewest bytes worth a bounce, for requests with recurrent state.
    #[arg(long, default_value_t = 0, value_name = "BYTES")]
    bounce_min_bytes: u64,
    /// Let several uniform writers share one region equally.
    #[arg(long)]
    bounce_fan_in: bool,
}

impl BounceArgs {
    fn limits(&self) -> Result<BounceLimits> {
        let capacity = match self.bounce_arena_mb {
            None => u64::MAX,
            Some(mb) => mb
                .checked_mul(1 << 20)
                .ok_or_else(|| anyhow!("--bounce-arena-mb {mb} overflows 2^64 bytes"))?,
        };
        let thresholds = match self.bounce {
            BounceMode::On => BounceLimits::without_thresholds(),
            _ => BounceLimits {
                min_blocks: self.bounce_min_blocks,
                min_bytes: self.bounce_min_bytes,
                ..BounceLimits::default()
            },
        };
        Ok(BounceLimits {
            capacity,
            fan_in: self.bounce_fan_in,
            ..thresholds
        })
    }
}

fn parse_seed(s: &str) -> Result<u64, String> {
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|e| format!("seed {s:?}: {e}"))
}

fn parse_spec(s: &str) -> Result<Mapping, String> {
    s.parse::<Mapping>().map_err(|e| e.to_string())
}

/// `--model`: a preset's name, else the path of a Hugging Face `config.json` or its folder.
fn parse_model(s: &str) -> Result<ModelShape, String> {
    if let Ok(preset) = s.parse::<Preset>() {
        return Ok(preset.model());
    }
    let path = std::path::Path::new(s);
    if !path.exists() {
        return Err(format!(
            "`{s}` is neither a model preset ({}) nor a config.json or folder that exists",
            Preset::names().join(", ")
        ));
    }
    ModelShape::from_config_file(path).map_err(|e| format!("{s}: {e}"))
}

/// Refuses a deployment wider than an instance may be ([`layout::check_mapping`]), naming
/// the flag that gave it, before anything is sized by its rank count.
fn check_width(flag: &str, mapping: &Mapping) -> Result<()> {
    layout::check_mapping(mapping).with_context(|| format!("{flag} {mapping}"))?;
    Ok(())
}

/// What this process may still allocate, as `serve` checks its pools against it
/// ([`kvferry_harness::HostBudget`]), for the testkit's in-process pools.
fn memory_budget() -> Option<MemoryBudget> {
    kvferry_harness::HostBudget::measure().map(|b| MemoryBudget {
        bytes: b.bytes,
        available: b.to_string(),
    })
}

/// The loaded configuration and plugin registry.
struct Host {
    config: FileConfig,
    registry: Registry,
}

impl Host {
    fn load(config_flag: Option<&std::path::Path>) -> Result<Self> {
        let env = std::env::var(CONFIG_ENV).ok();
        let config = FileConfig::discover(config_flag, env.as_deref())?;
        let dirs = kvferry_loader::plugin_dirs(&config.plugin_dirs);
        let registry = Registry::scan(&dirs);
        Ok(Self { config, registry })
    }

    fn planner_id(&self, flag: Option<&str>) -> String {
        let env = std::env::var(kvferry_loader::PLANNER_ENV).ok();
        kvferry_loader::select_planner_id(flag, env.as_deref(), self.config.planner.as_deref())
            .to_string()
    }

    fn bind(&self, id: &str, model: &ModelSpec, mapping: Mapping) -> Result<BoundPlanner> {
        let deployment = Deployment {
            architecture: model.architecture().into(),
            mapping,
        };
        Ok(self.registry.bind(id, &deployment)?)
    }
}

/// Builds every rank of an instance (pools at dummy addresses) and a planner for each, so a
/// planner that refuses the cache layout is caught here, not at the first request.
/// Every rank of `model` on `mapping`, laid out at addresses only (nothing is allocated), as
/// planner `planner_id` would see them.
fn lay_out(model: &ModelSpec, mapping: &Mapping, planner_id: &str) -> Result<Vec<RankInfo>> {
    let mut space = LocalMemory::new();
    let mut alloc = |rank: u32, pool: usize, bytes: u64| {
        space.reserve(bytes, format!("rank {rank} pool {pool}"))
    };
    let options = PoolOptions::default();
    layout::build_instance(model, mapping, "check", planner_id, &options, &mut alloc)
        .with_context(|| format!("--deployment {mapping}"))
}

fn instantiate_all(
    bound: &BoundPlanner,
    model: &ModelSpec,
    mapping: &Mapping,
) -> Result<Vec<RankInfo>> {
    let ranks = lay_out(model, mapping, bound.id())?;
    for rank in &ranks {
        bound
            .instantiate(rank)
            .map_err(|e| anyhow!("{} refuses rank {}: {e}", bound.id(), rank.instance_rank))?;
    }
    Ok(ranks)
}

fn planners(host: &Host, all: bool, json: bool) -> Result<ExitCode> {
    let r = &host.registry;
    if json {
        let mut out = json!({ "dirs": r.dirs(), "planners": r.planners() });
        if all {
            out["skipped"] = serde_json::to_value(r.skipped())?;
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(found(r));
    }
    if r.planners().is_empty() {
        println!("no planners found in {}", display_dirs(r.dirs()));
        for d in r.dirs().iter().filter(|d| !d.is_dir()) {
            eprintln!("plugin directory {} does not exist", d.display());
        }
    }
    for p in r.planners() {
        println!(
            "{:<32} {:<28} {:<8} {}",
            p.id,
            p.describer_id,
            p.version,
            p.path.display()
        );
    }
    if all {
        for s in r.skipped() {
            println!("skipped {}: {}", s.path.display(), s.reason);
        }
    } else if !r.skipped().is_empty() {
        eprintln!(
            "{} file(s) skipped; `kvferry planners --all` says why",
            r.skipped().len()
        );
    }
    Ok(found(r))
}

/// `planners` fails when it found none: nothing could be bound from that plugin path.
fn found(registry: &Registry) -> ExitCode {
    if registry.planners().is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn display_dirs(dirs: &[PathBuf]) -> String {
    let list: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    if list.is_empty() {
        "(no plugin directory)".into()
    } else {
        list.join(":")
    }
}

/// What one planner says about the deployment, for `kvferry check`.
fn candidate_json(c: &Candidate) -> serde_json::Value {
    let refusal = c.verdict.as_ref().err();
    json!({
        "id": c.info.id,
        "describer_id": c.info.describer_id,
        "version": c.info.version,
        "path": c.info.path,
        "specificity": c.info.specificity.0,
        "accepted": refusal.is_none(),
        "reason": refusal.map(|r| r.to_string()),
        "refusal": refusal.and_then(|r| r.deployment_refusal()).map(|d| json!({
            "field": d.field.as_str(),
            "found": d.found.as_str(),
            "supported": d.supported.as_str(),
            "reason": d.reason.as_str(),
        })),
    })
}

fn check(
    host: &Host,
    model: &ModelSpec,
    mapping: Mapping,
    planner: Option<&str>,
    json: bool,
) -> Result<ExitCode> {
    let deployment = Deployment {
        architecture: model.architecture().into(),
        mapping,
    };
    // Whether the model can be laid out on the mapping at all comes first: listing planners
    // that accept the deployment, then failing on the model, misleads.
    if let Err(e) = lay_out(model, &mapping, "check") {
        let error = format!("{e:#}");
        if json {
            let out = json!({ "deployment": deployment.to_string(), "error": error });
            println!("{}", serde_json::to_string_pretty(&out)?);
            return Ok(ExitCode::FAILURE);
        }
        bail!("{error}");
    }
    let id = host.planner_id(planner);
    let candidates = host.registry.candidates(&deployment);
    let auto = host.registry.bind_auto(&deployment);
    let bound = host
        .bind(&id, model, mapping)
        .and_then(|bound| instantiate_all(&bound, model, &mapping).map(|ranks| (bound, ranks)));
    if json {
        let out = json!({
            "deployment": deployment.to_string(),
            "selected": id,
            "bound": bound.as_ref().ok().map(|(b, _)| b.id()),
            "auto": auto.as_ref().ok().map(|b| b.id()),
            "auto_error": auto.as_ref().err().map(|e| kvferry_plan::error_chain(e)),
            "candidates": candidates.iter().map(candidate_json).collect::<Vec<_>>(),
            "error": bound.as_ref().err().map(|e| format!("{e:#}")),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(if bound.is_ok() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    println!("{deployment}: {} candidate planner(s)", candidates.len());
    for c in &candidates {
        let verdict = match &c.verdict {
            Ok(()) => "accepts".to_string(),
            Err(reason) => format!("refuses: {reason}"),
        };
        println!(
            "  {:<32} {:<12} {verdict}",
            c.info.id,
            c.info.specificity.name()
        );
    }
    match &auto {
        Ok(b) => println!("auto binds {}", b.id()),
        Err(e) => println!("auto binds nothing: {}", kvferry_plan::error_chain(e)),
    }
    let (bound, ranks) = bound?;
    println!(
        "{} {} (version {}, {}) plans {} {mapping} ({} ranks, {} {} tokens per block)",
        bound.id(),
        bound.describer_id(),
        bound.version(),
        bound.path().display(),
        model.architecture(),
        ranks.len(),
        model.dtype,
        model.tokens_per_block,
    );
    Ok(ExitCode::SUCCESS)
}

fn conform(
    config: Option<&std::path::Path>,
    library: Option<&std::path::Path>,
    planner: Option<&str>,
    seed: u64,
    case: Option<&str>,
    bounce: BounceMode,
    output: ConformOutput,
) -> Result<ExitCode> {
    let json = output == ConformOutput::Json;
    let under_test = match (library, planner) {
        (Some(path), _) => PlannerUnderTest::from_file(path).map_err(|e| anyhow!(e))?,
        (None, Some(id)) => {
            let host = Host::load(config)?;
            PlannerUnderTest::from_registry(Arc::new(host.registry), id).map_err(|e| anyhow!(e))?
        }
        (None, None) => bail!("name a planner library, or a planner id with --planner"),
    };
    if !json {
        println!(
            "conform {} ({}), matrix seed {seed:#x}",
            under_test.id(),
            under_test.source().display()
        );
    }
    let limits = match bounce {
        BounceMode::Off => None,
        BounceMode::On => Some(BounceLimits::without_thresholds()),
        _ => Some(BounceLimits::default()),
    };
    let progress = Progress::spinner(!json, "laying out the matrix");
    let mut seen = 0usize;
    let report =
        kvferry_testkit::conform::conform_with(&under_test, seed, case, limits, |outcome| {
            seen += 1;
            progress.set_message(format!("{seen} cases: {}", outcome.name));
            let failed = matches!(outcome.verdict, CaseVerdict::Failed { .. });
            if output == ConformOutput::Verbose || (failed && !json) {
                progress.println(outcome.to_string());
            }
        });
    progress.finish();
    if json {
        let results: Vec<serde_json::Value> = report
            .cases
            .iter()
            .map(|c| {
                let (verdict, reason, first_wrong) = match &c.verdict {
                    CaseVerdict::Passed => ("passed", None, None),
                    CaseVerdict::Failed {
                        reason,
                        first_wrong,
                    } => ("failed", Some(reason.clone()), first_wrong.clone()),
                    CaseVerdict::Refused { reason } => ("refused", Some(reason.clone()), None),
                    _ => ("unknown", None, None),
                };
                json!({
                    "name": c.name,
                    "model": c.model,
                    "prefill": c.prefill.to_string(),
                    "decode": c.decode.to_string(),
                    "fragments": c.fragments,
                    "bytes": c.bytes,
                    "bounced_pieces": c.bounced,
                    "verdict": verdict,
                    "reason": reason,
                    "first_wrong": first_wrong,
                })
            })
            .collect();
        let out = json!({
            "planner": report.planner,
            "source": under_test.source(),
            "seed": report.seed,
            "bounce": bounce.to_string(),
            "cases": report.ran(),
            "passed": report.passed(),
            "failed": report.failed(),
            "refused": report.refused(),
            "deployments": report.deployments.len(),
            "failures": report.failures(),
            "ok": report.is_ok(),
            "results": results,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        if output == ConformOutput::Summary {
            print!("{}", by_model(&report));
        }
        println!("{report}");
        let failures = report.failures();
        if !failures.is_empty() {
            println!(
                "failed ({}), rerun one with --seed {seed:#x} --case '<name>':",
                failures.len()
            );
            for f in &failures {
                println!("  {f}");
            }
        } else if report.ran() == 0 {
            println!("no case ran: a planner that refuses every case proves nothing");
        }
    }
    Ok(if report.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// What `conform` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ConformOutput {
    /// The failures as they happen, then a table by model and the summary line.
    Summary,
    /// Every case as it ends, then the summary line.
    Verbose,
    /// One JSON object.
    Json,
}

/// `conform`'s table of verdicts by model, then the most frequent refusals (their numbers
/// written `N`: the same cause with other sizes counts once).
fn by_model(report: &kvferry_testkit::conform::ConformReport) -> String {
    use std::collections::BTreeMap;
    let mut rows: BTreeMap<&str, [usize; 3]> = BTreeMap::new();
    let mut causes: BTreeMap<String, usize> = BTreeMap::new();
    for case in &report.cases {
        let row = rows.entry(case.model.as_str()).or_default();
        match &case.verdict {
            CaseVerdict::Passed => row[0] += 1,
            CaseVerdict::Failed { .. } => row[1] += 1,
            CaseVerdict::Refused { reason } => {
                row[2] += 1;
                let mut cause = String::with_capacity(reason.len());
                for c in reason.chars() {
                    if !c.is_ascii_digit() {
                        cause.push(c);
                    } else if !cause.ends_with('N') {
                        cause.push('N');
                    }
                }
                *causes.entry(cause).or_default() += 1;
            }
            _ => {}
        }
    }
    let mut out = format!(
        "{:<24} {:>7} {:>7} {:>8}\n",
        "model", "passed", "failed", "refused"
    );
    for (model, [passed, failed, refused]) in &rows {
        out.push_str(&format!(
            "{model:<24} {passed:>7} {failed:>7} {refused:>8}\n"
        ));
    }
    let mut causes: Vec<(String, usize)> = causes.into_iter().collect();
    causes.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    if !causes.is_empty() {
        out.push_str("most frequent refusals:\n");
        for (cause, n) in causes.iter().take(3) {
            out.push_str(&format!("  {n:>4} x {cause}\n"));
        }
    }
    out.push_str("(--verbose prints every case)\n");
    out
}

struct PlanArgs {
    /// The prefill side's model.
    model: ModelSpec,
    /// The decode side's block size, when it differs.
    gen_tokens_per_block: Option<u32>,
    prefill: Mapping,
    decode: Mapping,
    prompt_len: u64,
    ctx_dp_rank: u32,
    gen_dp_rank: u32,
    chunk: Option<u64>,
    cached: u64,
    seed: u64,
    contiguous: bool,
    bounce: BounceLimits,
    /// Move single-writer receivers' pieces through their regions (`--bounce` on or auto).
    bounced: bool,
    planner: Option<String>,
    /// Move and check every byte (the oracle) instead of planning alone.
    verify: bool,
    json: bool,
}

/// `e`, naming the flags that sized the request when it says the request cannot fit (its
/// pools past what one rank may hold, or past what this host has available); a `--verify`
/// run refused for this host's memory says that the dry run needs no pools.
fn plan_error(e: ScenarioError, a: &PlanArgs) -> anyhow::Error {
    let too_large = matches!(
        e,
        ScenarioError::Memory { .. } | ScenarioError::Layout(LayoutError::RankTooLarge(_))
    );
    if !too_large {
        return e.into();
    }
    let backing = matches!(e, ScenarioError::Memory { .. });
    let tpb = a.model.tokens_per_block;
    let sized_by = match a.gen_tokens_per_block {
        Some(g) => format!("--ctx-tokens-per-block {tpb} --gen-tokens-per-block {g}"),
        None => format!("--tokens-per-block {tpb}"),
    };
    let context = format!("--prompt-len {} with {sized_by} cannot fit", a.prompt_len);
    if backing {
        // The hint goes after the numbers, which tests and people read first.
        return anyhow!(
            "{context}: {e}; drop --verify to plan it from the page tables alone, with no \
             pools"
        );
    }
    anyhow::Error::new(e).context(context)
}

/// [`plan_error`] for a [`ScenarioError`] inside `e`; any other error as it is.
fn plan_failure(e: anyhow::Error, a: &PlanArgs) -> anyhow::Error {
    match e.downcast::<ScenarioError>() {
        Ok(e) => plan_error(e, a),
        Err(e) => e,
    }
}

/// `kvferry plan`: binds the planner on both sides, lays the request out, then plans it
/// ([`plan_dry`]) or, with `--verify`, moves and checks every byte ([`plan_verified`]).
fn plan(host: &Host, a: PlanArgs) -> Result<ExitCode> {
    check_width("--ctx", &a.prefill)?;
    check_width("--gen", &a.decode)?;
    let id = host.planner_id(a.planner.as_deref());
    let ctx_bound = host
        .bind(&id, &a.model, a.prefill)
        .context("prefill instance")?;
    let gen_model = match a.gen_tokens_per_block {
        Some(tpb) => a.model.clone().with_tokens_per_block(tpb),
        None => a.model.clone(),
    };
    let gen_bound = host
        .bind(&id, &gen_model, a.decode)
        .context("decode instance")?;
    if ctx_bound.id() != gen_bound.id() {
        bail!(
            "the prefill instance binds {} and the decode instance binds {}: two servers \
             that select different planners refuse each other (name one with --planner)",
            ctx_bound.id(),
            gen_bound.id()
        );
    }
    let budget = memory_budget();
    let mut scenario = Scenario::new(a.model.clone(), a.prefill, a.decode, a.prompt_len);
    scenario.ctx_dp_rank = a.ctx_dp_rank;
    scenario.gen_dp_rank = a.gen_dp_rank;
    scenario.cached_tokens = a.cached;
    scenario.seed = a.seed;
    scenario.contiguous_slots = a.contiguous;
    scenario.bounce_limits = a.bounce;
    scenario.bounce = a.bounced;
    scenario.planner_id = id.clone();
    scenario.gen_tokens_per_block = a.gen_tokens_per_block;
    // Only the oracle backs pools; the dry run checks its own estimate instead.
    scenario.memory_budget = if a.verify { budget.clone() } else { None };
    demo::check_cached(
        a.cached,
        a.gen_tokens_per_block.unwrap_or(a.model.tokens_per_block),
    )
    .map_err(|e| anyhow!(e))?;
    if a.chunk == Some(0) {
        bail!("--chunk must be positive");
    }
    if !a.verify {
        plan_dry::check_before_layout(&scenario, budget.as_ref())
            .map_err(|e| plan_failure(e, &a))?;
    }
    // Laid out (with --verify, the receivers' pools checked against the budget) before the
    // chunks (as many as the prompt's blocks) are listed.
    let started = Instant::now();
    let mut exchange = scenario.exchange().map_err(|e| plan_error(e, &a))?;
    if let Some(chunk) = a.chunk {
        let starts = (0..a.prompt_len).step_by(usize::try_from(chunk).unwrap_or(usize::MAX));
        let chunks: Vec<TokenRange> = starts
            .map(|start| TokenRange {
                start,
                end: start.saturating_add(chunk).min(a.prompt_len),
            })
            .collect();
        exchange.pieces =
            kvferry_plan::pieces(a.prompt_len, a.model.tokens_per_block, Some(&chunks))
                .map_err(|e| anyhow!("--chunk {chunk}: {e}"))?;
    }
    let layout = started.elapsed();
    let ctx_factory =
        |r: &RankInfo| -> Result<Arc<dyn TransferPlanner>, PlanError> { ctx_bound.instantiate(r) };
    let gen_factory =
        |r: &RankInfo| -> Result<Arc<dyn TransferPlanner>, PlanError> { gen_bound.instantiate(r) };
    let outcome = if a.verify {
        plan_verified(&a, &exchange, layout, &ctx_factory, &gen_factory)?
    } else {
        plan_dry_run(
            &a,
            &scenario,
            &exchange,
            &ctx_factory,
            &gen_factory,
            budget.as_ref(),
        )?
    };
    if a.json {
        let mut out = json!({
            "planner": ctx_bound.id(),
            "planner_version": ctx_bound.version(),
            "planner_path": ctx_bound.path(),
            "model": a.model.name(),
            "dtype": a.model.dtype.as_ref(),
            "tokens_per_block": a.model.tokens_per_block,
            "gen_tokens_per_block": a.gen_tokens_per_block.unwrap_or(a.model.tokens_per_block),
            "prefill": a.prefill.to_string(),
            "decode": a.decode.to_string(),
            "prompt_len": a.prompt_len,
            "dry_run": !a.verify,
        });
        if let Some(out) = out.as_object_mut() {
            out.extend(outcome.json);
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "planner {} {} ({})",
            ctx_bound.id(),
            ctx_bound.version(),
            ctx_bound.path().display()
        );
        println!(
            "{} {} tpb {}: prefill {} (DP rank {}) -> decode {} (DP rank {}), prompt {} tokens",
            a.model.name(),
            a.model.dtype,
            match a.gen_tokens_per_block {
                Some(g) => format!("{} -> {g}", a.model.tokens_per_block),
                None => a.model.tokens_per_block.to_string(),
            },
            a.prefill,
            a.ctx_dp_rank,
            a.decode,
            a.gen_dp_rank,
            a.prompt_len
        );
        print!("{}", outcome.text);
    }
    Ok(if outcome.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// What one way of running `kvferry plan` found: its JSON fields past the request's, its text
/// past the two header lines, and whether it exits 0.
struct PlanOutcome {
    ok: bool,
    json: serde_json::Map<String, serde_json::Value>,
    text: String,
}

/// The JSON of each receiver of a plan.
fn receivers_json(receivers: &[ReceiverReport]) -> Vec<serde_json::Value> {
    receivers
        .iter()
        .map(|r| {
            let (bounce_bytes, bounce_skip) = match &r.bounce {
                Ok(b) => (Some(b.total), None),
                Err(skip) => (None, Some(skip.to_string())),
            };
            json!({
                "rank": r.rank,
                "expected_transfers": r.expected_transfers,
                "targets": r.targets,
                "uniform": r.uniform,
                "payload_bytes": r.payload_bytes,
                "bounce_bytes": bounce_bytes,
                "bounce_skip": bounce_skip,
            })
        })
        .collect()
}

/// `serde_json::Value::Object(fields)` as a map (an empty one for anything else).
fn object(value: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    match value {
        serde_json::Value::Object(map) => map,
        _ => serde_json::Map::new(),
    }
}

/// `kvferry plan --verify`: the oracle backs the pools taking part, tags the sources, executes
/// every plan and checks every destination byte.
fn plan_verified(
    a: &PlanArgs,
    exchange: &Exchange,
    layout: Duration,
    ctx_factory: PlannerFactory<'_>,
    gen_factory: PlannerFactory<'_>,
) -> Result<PlanOutcome> {
    let progress = Progress::spinner_after(
        !a.json,
        PROGRESS_AFTER,
        format!(
            "planning {} -> {} for {} tokens and checking every byte",
            a.prefill, a.decode, a.prompt_len
        ),
    );
    let run = exchange.run(ctx_factory, gen_factory);
    progress.finish();
    let mut report = run.map_err(|e| plan_error(e, a))?;
    report.timings.setup += layout;
    let verified = report.is_ok();
    let pairs: Vec<_> = report
        .pairs
        .iter()
        .map(|p| {
            json!({
                "src_rank": p.src_rank,
                "dst_rank": p.dst_rank,
                "fragments": p.fragments,
                "planned_fragments": p.planned_fragments,
                "bytes": p.bytes,
                "bounced_pieces": p.bounced,
            })
        })
        .collect();
    let json = json!({
        "pairs": pairs,
        "receivers": receivers_json(&report.receivers),
        "total_fragments": report.fragments,
        "total_planned_fragments": report.planned_fragments,
        "total_bytes": report.bytes,
        "overlapping_writes": report.overlapping_writes,
        "verified": verified,
        "verify": report.verification.to_string(),
    });
    Ok(PlanOutcome {
        ok: verified,
        json: object(json),
        text: format!("{report}\nverified: {verified}\n"),
    })
}

/// `mean fragment N bytes (size)`, or nothing without fragments.
fn mean_text(bytes: u64, fragments: usize) -> String {
    plan_dry::mean_fragment(bytes, fragments).map_or(String::new(), |m| {
        format!(", mean fragment {}", units::bytes(m))
    })
}

/// `kvferry plan` without `--verify`: every pair planned and validated from the page tables
/// alone, counted, nothing backed or moved ([`plan_dry::run`]).
fn plan_dry_run(
    a: &PlanArgs,
    scenario: &Scenario,
    exchange: &Exchange,
    ctx_factory: PlannerFactory<'_>,
    gen_factory: PlannerFactory<'_>,
    budget: Option<&MemoryBudget>,
) -> Result<PlanOutcome> {
    let progress = Progress::spinner_after(
        !a.json,
        PROGRESS_AFTER,
        format!(
            "planning {} -> {} for {} tokens",
            a.prefill, a.decode, a.prompt_len
        ),
    );
    let run = plan_dry::run(
        scenario,
        exchange,
        ctx_factory,
        gen_factory,
        budget,
        &|i, n, c, g| {
            progress.set_message(format!(
                "planning {} -> {} for {} tokens: ctx {c} -> gen {g}, pair {} of {n}",
                a.prefill,
                a.decode,
                a.prompt_len,
                i + 1
            ));
        },
    );
    progress.finish();
    let report = run.map_err(|e| plan_failure(e, a))?;
    let pairs: Vec<_> = report
        .pairs
        .iter()
        .map(|p| {
            json!({
                "src_rank": p.src_rank,
                "dst_rank": p.dst_rank,
                "pieces": p.pieces,
                "fragments": p.fragments,
                "planned_fragments": p.planned_fragments,
                "patterns": p.patterns,
                "bytes": p.bytes,
                "mean_fragment_bytes": plan_dry::mean_fragment(p.bytes, p.fragments),
                "bounced_pieces": p.bounced,
            })
        })
        .collect();
    let json = json!({
        "pairs": pairs,
        "receivers": receivers_json(&report.receivers),
        "total_fragments": report.fragments(),
        "total_planned_fragments": report.planned_fragments(),
        "total_patterns": report.patterns(),
        "total_bytes": report.bytes(),
        "mean_fragment_bytes": plan_dry::mean_fragment(report.bytes(), report.fragments()),
        "overlapping_writes": report.overlaps.len(),
        "overlaps": report.overlaps,
        "verified": false,
        "verify": plan_dry::NOT_MOVED,
    });
    // The receivers in the oracle's report's words.
    let mut text = String::new();
    for r in &report.receivers {
        text.push_str(&format!(
            "decode rank {}: {} expected transfers from {:?}{}, {} of state; bounce: {}\n",
            r.rank,
            r.expected_transfers,
            r.targets,
            if r.uniform { " (uniform)" } else { "" },
            units::bytes(r.payload_bytes),
            match &r.bounce {
                Ok(b) if b.writers > 1 => format!(
                    "{} ({} per writer)",
                    units::bytes(b.total),
                    units::size(b.share())
                ),
                Ok(b) => units::bytes(b.total),
                Err(skip) => format!("no, {skip}"),
            }
        ));
    }
    let patterns = |p: Option<usize>| p.map_or(String::new(), |n| format!(", {n} patterns"));
    for p in &report.pairs {
        text.push_str(&format!(
            "ctx {} -> gen {}: {} pieces, {} fragments ({} planned{}), {}{}{}\n",
            p.src_rank,
            p.dst_rank,
            p.pieces,
            p.fragments,
            p.planned_fragments,
            patterns(p.patterns),
            units::bytes(p.bytes),
            mean_text(p.bytes, p.fragments),
            if p.bounced > 0 {
                format!(", {} pieces bounced", p.bounced)
            } else {
                String::new()
            }
        ));
    }
    text.push_str(&format!(
        "total: {} fragments ({} planned{}), {}{}\n",
        report.fragments(),
        report.planned_fragments(),
        patterns(report.patterns()),
        units::bytes(report.bytes()),
        mean_text(report.bytes(), report.fragments())
    ));
    if !report.overlaps.is_empty() {
        text.push_str("overlapping writes:\n");
        for o in &report.overlaps {
            text.push_str(&format!("  {o}\n"));
        }
    }
    text.push_str(&format!("{}\n", plan_dry::NOT_MOVED));
    Ok(PlanOutcome {
        ok: report.is_ok(),
        json: object(json),
        text,
    })
}

/// How long `plan` runs before it shows its spinner (on a terminal).
const PROGRESS_AFTER: Duration = Duration::from_secs(2);

/// Stops the server once standard input ends: a parent that holds our stdin pipe (the demo)
/// takes its servers down with it however it ends.
fn stop_with_stdin(stop: std::sync::mpsc::Sender<()>) -> Result<()> {
    std::thread::Builder::new()
        .name("stdin-watch".into())
        .spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            tracing::info!("standard input closed; stopping");
            let _ = stop.send(());
        })?;
    Ok(())
}

fn serve(host: &Host, a: ServeArgs) -> Result<ExitCode> {
    a.memory.check()?;
    let secret = kvferry::agent::load_secret(a.secret_file.as_deref())?;
    let id = host.planner_id(a.planner.as_deref());
    let model = a.shape.model(&a.model);
    let bound = host.bind(&id, &model, a.deployment)?;
    let name = a.name.unwrap_or_else(|| {
        let prefix = match a.role {
            Role::Prefill => "ctx",
            Role::Decode => "gen",
        };
        format!("{prefix}-{}", std::process::id())
    });
    let label = format!("{model} {}", a.deployment);
    let config = InstanceConfig {
        role: a.role,
        name: name.clone(),
        label: label.clone(),
        transport: a.transport.spec(),
        memory: a.memory.memory,
        cuda_device: a.memory.cuda_device,
    };
    let options = ServeOptions {
        listen: a.listen,
        advertise: a.advertise,
        control: a.control,
        timeout: Duration::from_millis(a.timeout_ms),
        lease: Duration::from_millis(a.lease_ms),
        peer_timeout: Duration::from_millis(a.peer_timeout_ms),
        integrity: a.integrity,
        seed: a.seed,
        stall: Duration::from_millis(a.debug_stall_ms),
        max_peer_connections: a.max_peer_connections,
        record_plans: a.record_plans,
        paged_slots: a.slots,
        state_slots: a.state_slots,
        rank: a.rank,
        secret,
        bounce: a.bounce.config()?,
    };
    let running = kvferry_harness::serve::start(config, model, a.deployment, bound, &options)
        .with_context(|| format!("starting {} instance {name}", a.role))?;
    if a.exit_with_stdin {
        stop_with_stdin(running.stopper())?;
    }
    let metrics = match &a.metrics_listen {
        Some(addr) => {
            let listener = std::net::TcpListener::bind(addr)
                .with_context(|| format!("--metrics-listen {addr}: cannot listen"))?;
            let bound = listener.local_addr()?;
            kvferry_harness::metrics_http::spawn(listener, running.metrics_source())?;
            tracing::info!(url = %format!("http://{bound}/metrics"), "serving metrics");
            format!(" {}{bound}", demo::METRICS_ON)
        }
        None => String::new(),
    };
    let control = running.control_addr();
    let endpoints = running.endpoints();
    let peers = if endpoints.is_empty() {
        String::new()
    } else {
        format!(" {}{}", demo::LISTENING, endpoints.join(","))
    };
    let ranks = match a.rank {
        Some(r) => format!("rank {r}"),
        None => "every rank".to_string(),
    };
    tracing::info!(instance = %name, role = %a.role, planner = %id, %control, "serving");
    println!(
        "kvferry serve: {} instance {name} ({label}, {ranks}, planner {id}, {}, {} memory) {}{control}{peers}{metrics}",
        a.role,
        a.transport.spec(),
        a.memory.memory,
        demo::CONTROL_ON
    );
    std::io::stdout().flush()?;
    running.run();
    Ok(ExitCode::SUCCESS)
}

fn run_demo(config_file: Option<PathBuf>, a: DemoArgs) -> Result<ExitCode> {
    let config = DemoConfig {
        pair: a.pair.resolve(config_file)?,
        requests: a.requests,
        max_prompt_len: a.prompt_len,
        chunk: a.chunk,
        layer_parts: a.layer_wise,
        cached: a.cached,
        in_flight: a.in_flight,
        ctx_at: a.ctx_at,
        gen_at: a.gen_at,
    };
    let progress = Progress::spinner(
        !a.json,
        format!(
            "{} requests, {} -> {}, every byte checked",
            config.requests, config.pair.ctx_spec, config.pair.gen_spec
        ),
    );
    let report = demo::run(&config);
    progress.finish();
    let report = report?;
    print_report(&report, a.json, report.verified)
}

fn run_bench(config_file: Option<PathBuf>, a: BenchArgs) -> Result<ExitCode> {
    if let Some(us) = a.layer_compute_us {
        let host = Host::load(config_file.as_deref())?;
        let pair = a.pair.resolve(config_file)?;
        if pair.memory != MemoryKind::Host || pair.gen_tokens_per_block.is_some() {
            bail!("--layer-compute-us measures host memory and one block size on both sides");
        }
        let id = host.planner_id(pair.planner.as_deref());
        let config = kvferry_harness::overlap::OverlapConfig {
            prefill: (pair.prefill, host.bind(&id, &pair.model, pair.prefill)?),
            decode: (pair.decode, host.bind(&id, &pair.model, pair.decode)?),
            model: pair.model,
            transport: pair.transport,
            prompt_len: a
                .prompt_len
                .ok_or_else(|| anyhow!("--prompt-len is required"))?,
            requests: a.requests.first().copied().unwrap_or(0),
            rounds: a.rounds,
            layer_compute: Duration::from_micros(us),
        };
        let progress = Progress::spinner(!a.json, "timing layer-wise against whole sends");
        let report = kvferry_harness::overlap::run(&config);
        progress.finish();
        return print_report(&report?, a.json, true);
    }
    if a.sweep {
        return run_grid(config_file, a);
    }
    if a.fragment_sizes.is_some() || a.batches.is_some() || a.max_request_bytes.is_some() {
        bail!("--fragment-sizes, --batches and --max-request-bytes shape the grid of --sweep");
    }
    let prompt_len = a
        .prompt_len
        .ok_or_else(|| anyhow!("--prompt-len is required (except with --sweep)"))?;
    let config = BenchConfig {
        pair: a.pair.resolve(config_file)?,
        prompt_len,
        requests: a.requests.first().copied().unwrap_or(0),
        rounds: a.rounds,
        perftest: a.perftest,
        export_fragments: a.export_fragments,
        export_workload: a.export_workload,
    };
    // JSON: ours_gbps, raw_gbps, memcpy_gbps, ratio, stages, perftest_gbps, fragments, bytes,
    // mean_fragment_bytes, transport, planner, and the per-round details; an array of those
    // for a sweep.
    let progress = Progress::spinner(
        !a.json,
        format!(
            "timing {} -> {} over {} ({} rounds)",
            config.pair.ctx_spec, config.pair.gen_spec, config.pair.transport, config.rounds
        ),
    );
    if let [_] = a.requests[..] {
        let report = bench::run(&config);
        progress.finish();
        let report = report?;
        return print_report(&report, a.json, report.verified);
    }
    let sweep = bench::sweep(&config, &a.requests);
    progress.finish();
    let sweep = sweep?;
    print_report(&sweep, a.json, sweep.verified())
}

/// `kvferry bench --sweep`: the grid of [`kvferry_harness::grid`].
fn run_grid(config_file: Option<PathBuf>, mut a: BenchArgs) -> Result<ExitCode> {
    if a.pair.model.is_some() {
        bail!("--sweep brings its own one-layer model; leave out --model");
    }
    if a.pair.shape.dtype.is_some()
        || a.pair.sides.ctx_tokens_per_block.is_some()
        || a.pair.sides.gen_tokens_per_block.is_some()
    {
        bail!(
            "--sweep sets the dtype and block size of its model; leave out --dtype and --*-tokens-per-block"
        );
    }
    use kvferry_harness::grid;
    let sizes = a
        .fragment_sizes
        .take()
        .unwrap_or_else(|| grid::DEFAULT_SIZES.to_vec());
    let batches = a
        .batches
        .take()
        .unwrap_or_else(|| grid::DEFAULT_BATCHES.to_vec());
    a.pair.model =
        Some(ModelShape::from_hf_config(grid::GRID_MODEL, "grid").context("the grid's model")?);
    let config = grid::GridConfig {
        base: BenchConfig {
            pair: a.pair.resolve(config_file)?,
            prompt_len: 1,
            requests: 1,
            rounds: a.rounds,
            perftest: false,
            export_fragments: None,
            export_workload: None,
        },
        sizes,
        batches,
        max_request_bytes: a
            .max_request_bytes
            .unwrap_or(grid::DEFAULT_MAX_REQUEST_BYTES),
        export_dir: a.export_workload,
    };
    // The grid makes the export folder itself (it writes its model there first).
    let progress = Progress::spinner(
        !a.json,
        format!(
            "sweeping {} -> {} over {} ({} rounds per cell)",
            config.base.pair.ctx_spec,
            config.base.pair.gen_spec,
            config.base.pair.transport,
            a.rounds
        ),
    );
    let report = grid::run(&config);
    progress.finish();
    let report = report?;
    print_report(&report, a.json, report.verified())
}

/// A byte count with an optional `k`, `m` or `g` suffix (KiB, MiB, GiB).
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 10),
        Some((i, 'm' | 'M')) => (&t[..i], 20),
        Some((i, 'g' | 'G')) => (&t[..i], 30),
        _ => (t, 0),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("`{s}` is not a byte count (such as 4096, 64k or 4m)"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("`{s}` overflows 64 bits"))
}

/// Prints a demo or bench report as text or one JSON object; fails the exit code unless every
/// byte verified.
fn print_report<R: serde::Serialize + std::fmt::Display>(
    report: &R,
    json: bool,
    verified: bool,
) -> Result<ExitCode> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        println!("{report}");
    }
    Ok(if verified {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn run(cli: Cli) -> Result<ExitCode> {
    // demo and bench only start `kvferry serve` children, which load planners themselves.
    let load = || Host::load(cli.config.as_deref());
    match cli.command {
        Command::Demo(args) => run_demo(cli.config, args),
        Command::Bench(args) => run_bench(cli.config, args),
        Command::Serve(args) => serve(&load()?, args),
        Command::Planners { all, json } => planners(&load()?, all, json),
        Command::Doctor {
            net_devices,
            require_cuda,
            json,
        } => doctor(net_devices.as_deref(), require_cuda, json),
        Command::Check {
            model,
            deployment,
            shape,
            planner,
            json,
        } => check(
            &load()?,
            &shape.model(&model),
            deployment,
            planner.as_deref(),
            json,
        ),
        Command::Conform {
            library,
            planner,
            seed,
            case,
            bounce,
            json,
            verbose,
        } => conform(
            cli.config.as_deref(),
            library.as_deref(),
            planner.as_deref(),
            seed,
            case.as_deref(),
            bounce,
            match (json, verbose) {
                (true, _) => ConformOutput::Json,
                (false, true) => ConformOutput::Verbose,
                (false, false) => ConformOutput::Summary,
            },
        ),
        Command::Plan {
            model,
            prefill,
            decode,
            prompt_len,
            shape,
            sides,
            ctx_dp_rank,
            gen_dp_rank,
            chunk,
            cached,
            seed,
            contiguous,
            bounce,
            planner,
            verify,
            json,
        } => plan(
            &load()?,
            PlanArgs {
                model: sides.models(&shape, &model).0,
                gen_tokens_per_block: sides.models(&shape, &model).1,
                prefill,
                decode,
                prompt_len,
                ctx_dp_rank,
                gen_dp_rank,
                chunk,
                cached,
                seed,
                contiguous,
                bounce: bounce.limits()?,
                bounced: bounce.bounce != BounceMode::Off,
                planner,
                verify,
                json,
            },
        ),
    }
}

fn doctor(net_devices: Option<&str>, require_cuda: bool, json: bool) -> Result<ExitCode> {
    let mut report = doctor::diagnose(net_devices);
    if require_cuda && !report.cuda_registrable() {
        report
            .problems
            .push("--require-cuda: no context can register CUDA device memory".into());
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    Ok(if report.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `conform` binds hundreds of deployments and prints its own report: its logs default to
    // warnings. `KVFERRY_LOG` (or `RUST_LOG`) overrides either default.
    let default_filter = match cli.command {
        Command::Conform { .. } => "warn",
        _ => "kvferry=info,warn",
    };
    kvferry::logging::init_stderr(default_filter);
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvferry: {e:#}");
            ExitCode::FAILURE
        }
    }
}
