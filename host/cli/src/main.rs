//! `kvferry`: list planners, check a deployment, dry-run a transfer plan, serve an instance,
//! run the two-process demo, benchmark the transfer path. Every command's options are parsed
//! here. The operator commands (`planners`, `check`, `plan`, `conform`, `doctor`) are written
//! over the `kvferry` facade: `planners` and `check` here, the others in their modules
//! ([`plan`], [`conform`], [`doctor`]); `serve`, `demo` and `bench` run in `kvferry-harness`.

#![forbid(unsafe_code)]

mod conform;
mod doctor;
mod plan;
mod progress;
mod shape;
mod skipped;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Parser, Subcommand};
use kvferry::agent::{BounceConfig, BounceMode, Integrity};
use kvferry::config::{CONFIG_ENV, FileConfig};
use kvferry::{MemoryKind, Role, TransportSpec};
use kvferry_harness::bench::{self, BenchConfig};
use kvferry_harness::demo::{self, DemoConfig, LoopbackPair};
use kvferry_harness::serve::{InstanceConfig, ServeOptions};
use kvferry_loader::{BindError, BoundPlanner, Candidate, LoadError, Registry};
use kvferry_plan::bounce::{self, BounceLimits};
use kvferry_planner_abi::{Deployment, Mapping, RankInfo};
use kvferry_testkit::layout::{self, Dtype, ModelShape, ModelSpec, PoolOptions, Preset};
use kvferry_testkit::oracle::LocalMemory;
use kvferry_testkit::scenario::MemoryBudget;
use kvferry_testkit::units;
use progress::Progress;
use serde_json::json;

/// Moves LLM KV caches from prefill servers to decode servers, planned by plugins.
#[derive(Debug, Parser)]
#[command(name = "kvferry", version, about)]
struct Cli {
    /// Config file, TOML or JSON: `planner` and `plugin_dir`, or an agent's whole configuration
    /// (its `planner` and `plugin_dir` are used; `serve` refuses one that sets anything else,
    /// naming the keys); default `$KVFERRY_CONFIG`.
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
    /// Prefill side: give up a receiver, still registered, whose puts left in flight by a
    /// failed write finished nothing for this long (its endpoint is closed by force).
    #[arg(long, default_value_t = 10_000, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    stall_limit_ms: u64,
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
    /// The secret of the servers --ctx-at and --gen-at name (the file their `serve
    /// --secret-file` reads); else $KVFERRY_SECRET.
    #[arg(long, value_name = "FILE", requires = "ctx_at")]
    secret_file: Option<PathBuf>,
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
    /// Tokens per cache block (at least 1).
    #[arg(long, default_value_t = 32, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
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
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    ctx_tokens_per_block: Option<u32>,
    /// Tokens per block of the decode instance (default: --tokens-per-block).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
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
/// ([`kvferry_harness::HostBudget`]), for the testkit's in-process pools; the figure in
/// binary units, as the CLI writes every size ([`units::bytes`]).
fn memory_budget() -> Option<MemoryBudget> {
    kvferry_harness::HostBudget::measure().map(|b| MemoryBudget {
        bytes: b.bytes,
        available: format!("{} available ({})", units::bytes(b.bytes), b.limit),
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
        self.registry.bind(id, &deployment).map_err(bind_error)
    }
}

/// A planner that could not be bound, as the CLI says it: an id no planner on the plugin
/// path has is named as not found, with the planners that were found.
fn bind_error(e: BindError) -> anyhow::Error {
    match e {
        BindError::UnknownPlanner {
            id,
            known,
            dirs,
            skipped,
        } => {
            let found = if known.is_empty() {
                format!("no planner was found in {}", display_dirs(&dirs))
            } else {
                format!(
                    "the planners found are {} (in {})",
                    known.join(", "),
                    display_dirs(&dirs)
                )
            };
            let skipped = match skipped {
                0 => String::new(),
                n => format!("; {n} file(s) skipped, `kvferry planners --all` says why"),
            };
            anyhow!("planner `{id}` not found: {found}{skipped}")
        }
        e => e.into(),
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
            let mut skipped = serde_json::to_value(r.skipped())?;
            for (entry, s) in skipped
                .as_array_mut()
                .into_iter()
                .flatten()
                .zip(r.skipped())
            {
                if matches!(s.reason, LoadError::NotAPlanner { .. }) {
                    entry["message"] =
                        json!(format!("{}: {}", s.path.display(), skipped::reason(s)));
                }
            }
            out["skipped"] = skipped;
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
            println!("skipped {}: {}", s.path.display(), skipped::reason(s));
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
    let asked_auto = id == kvferry_loader::AUTO_PLANNER_ID;
    let binding = host.registry.bind(&id, &deployment);
    // What `auto` binds (its planner id, or why none): the binding itself when `auto` was
    // asked, else a what-if beside the planner asked for, which logs nothing (the log names
    // the planner bound, once).
    let id_or_why = |r: Result<&BoundPlanner, &BindError>| {
        r.map(|b| b.id().to_string())
            .map_err(|e| kvferry_plan::error_chain(e))
    };
    let auto = if asked_auto {
        id_or_why(binding.as_ref())
    } else {
        tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::default(), || {
            id_or_why(host.registry.bind_auto(&deployment).as_ref())
        })
    };
    let not_found = matches!(binding, Err(BindError::UnknownPlanner { .. }));
    let bound = binding
        .map_err(bind_error)
        .and_then(|bound| instantiate_all(&bound, model, &mapping).map(|ranks| (bound, ranks)));
    if json {
        let out = json!({
            "deployment": deployment.to_string(),
            "selected": id,
            "bound": bound.as_ref().ok().map(|(b, _)| b.id()),
            "auto": auto.as_ref().ok(),
            "auto_error": auto.as_ref().err(),
            "candidates": candidates.iter().map(candidate_json).collect::<Vec<_>>(),
            "error": bound.as_ref().err().map(|e| format!("{e:#}")),
            "cache": shape::model_line(model),
            "ranks": bound.as_ref().ok().map(|(_, ranks)| {
                ranks.iter().map(|r| shape::rank_groups(r).1).collect::<Vec<_>>()
            }),
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
    // What `auto` does is the answer when it was asked; beside a named planner it is a hint,
    // and none beside one that does not exist (the error names it and the planners found).
    let verb = if asked_auto { "binds" } else { "would bind" };
    match &auto {
        _ if not_found => {}
        Ok(auto) => println!("auto {verb} {auto}"),
        Err(why) => println!("auto {verb} nothing: {why}"),
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
    println!("cache: {}", shape::model_line(model));
    // Ranks that hold the same groups (every rank but where PP stages differ) are one entry.
    let mut runs: Vec<(usize, usize, Vec<String>)> = Vec::new();
    for (i, rank) in ranks.iter().enumerate() {
        let (lines, _) = shape::rank_groups(rank);
        match runs.last_mut() {
            Some((_, last, held)) if *held == lines => *last = i,
            _ => runs.push((i, i, lines)),
        }
    }
    for (first, last, lines) in runs {
        let who = if first == last {
            format!("rank {first}")
        } else {
            format!("ranks {first}-{last}")
        };
        for line in lines {
            println!("  {who}: {line}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

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
    if !host.config.unread.is_empty() {
        // An agent's whole configuration names a transport, an instance, a secret...: serve
        // takes those from its flags, and running without them would look like obeying.
        bail!(
            "serve takes only `planner` and `plugin_dir` from --config; this file is an agent's \
             whole configuration and also sets {}, which serve does not read from it: give \
             them as flags (serve --help: --transport, --name, --secret-file, ...) or remove \
             them",
            host.config
                .unread
                .iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
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
        stall_limit: Duration::from_millis(a.stall_limit_ms),
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
        secret_file: a.secret_file,
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
        } => conform::conform(
            cli.config.as_deref(),
            library.as_deref(),
            planner.as_deref(),
            seed,
            case.as_deref(),
            bounce,
            match (json, verbose) {
                (true, _) => conform::ConformOutput::Json,
                (false, true) => conform::ConformOutput::Verbose,
                (false, false) => conform::ConformOutput::Summary,
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
        } => plan::plan(
            &load()?,
            plan::PlanArgs {
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
