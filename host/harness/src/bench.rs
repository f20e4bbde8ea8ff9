//! `kvferry bench`: kvferry's transfer path against a bare UCX put loop over the same
//! fragments, in the same processes, on the same endpoints and memory, and against the same
//! fragments copied with memcpy in one process; per request, where the agent path's time goes;
//! optionally against `ucx_perftest` too.
//!
//! The controller starts a prefill server (with `--record-plans`) and a decode server
//! as `kvferry serve` children, like the demo, then runs rounds. Each round prefills a fresh
//! set of `requests` requests of exactly `prompt_len` tokens, spread over the DP groups, and
//! takes one sample of each path:
//!
//! - **ours**: the requests go through the agents, all in flight at once — `Submit` to the
//!   decode server, whose agents `expect` them and send `RequestData` to the prefill
//!   agents (which `send` them at prefill), planning, validation, coalescing, windowed puts,
//!   flush, `Completion`s, the decode side's own byte check, `Received`, `Done`. Timed by
//!   the controller from the first `Submit` to the last `Done`; beside it, **agent**: the same
//!   requests as the decode agents time them (each from its first claim to its last
//!   completion, the longest of the round), without the controller's control round trips and
//!   the decode server's own handling — what an engine embedding the agent would see.
//! - **raw**: [`ControlMessage::Bench`](crate::control::ControlMessage::Bench) makes the prefill server's agents write the plans they
//!   recorded for a set again ([`kvferry_transfer::agent::Agent::replay`]), every rank at
//!   once, on the same rank threads and endpoints, with a bare loop: fragments resolved before the clock
//!   starts, then per plan a `kvferry_ucx::PutWindow` of the same size, the same splitting
//!   and one flush — no control plane, no planning, no checks. Timed by the prefill server
//!   from the first put to the last flush.
//!
//! - **memcpy**: [`ControlMessage::Memcpy`](crate::control::ControlMessage::Memcpy) makes the
//!   prefill server copy the same recorded fragments with `memcpy` between host buffers
//!   shaped like both sides' pools, in its own process, one thread per prefill rank
//!   (`kvferry_transfer::harness::copy`): on shared memory the ceiling of this machine for that
//!   fragment list. Its buffers are allocated and written through at its first run and
//!   kept; timed from the first copy to the last.
//!
//! Rounds alternate the order: even rounds run ours then raw and memcpy on the new set, odd
//! rounds run raw and memcpy on the previous round's set (same shape, still held) then ours on
//! the new one, so neither path always runs on warm caches. The first [`WARMUP_ROUNDS`] rounds
//! are not counted: they do the wire-up and the first touch of both sets' slots (over shm the
//! first round on fresh slots ran about 3x slower, most likely the sender's first-touch page
//! faults in its mapping of the peer's pool). Round 0's destination bytes are checked by the
//! oracle after ours and raw. Rates are reported as min / median / max over the counted
//! rounds; the ratio is ours / raw of the medians, and beside it the spread of each round's
//! own ours / raw (`ratio_rounds`).
//!
//! **Stages**: each request's [`Stages`] (plan, validate, gather, puts, flush, scatter,
//! digest, control, queue; see there) come from both sides' agents — the decode side's in `Done`, the
//! prefill side's fetched with [`ControlMessage::Stats`](crate::control::ControlMessage::Stats)
//! — merged per request; per stage the report gives the median over the rounds of the median
//! over each round's requests. The raw loop's puts and flush and memcpy's copies are
//! per request on average (the round's sum over the requests). `overhead_per_request_s` is
//! (ours − raw, median seconds) / requests.
//!
//! **Sweep**: [`sweep`] runs the whole bench once per number of requests (`--requests
//! 1,2,4,8`), fresh servers each, and tabulates how the per-request overhead grows.
//!
//! With `--export-fragments FILE`, the fragments of round 0's set (the one the oracle checks)
//! are written to `FILE` as JSON ([`FRAGMENTS_FORMAT`]), so that another transfer library can
//! move exactly the same bytes (`scripts/bench-peers` runs NIXL on them). They are what the
//! prefill server recorded and the raw loop puts — validated, coalesced, relative to the
//! pools — fetched from it with [`ControlMessage::Fragments`](crate::control::ControlMessage::Fragments) rather than planned again in the
//! controller, so they cannot drift from what was measured; the export's fragment and byte
//! counts are checked against that round's raw replay.
//!
//! With `--export-workload FILE`, round 0's set is written as what an engine holds instead
//! ([`WORKLOAD_FORMAT`]): every rank's configuration as its agent reads it
//! ([`kvferry::config::rank_config`], pools at the addresses the servers allocated) and each
//! request's slot tables on both sides (the decode side's fetched with
//! [`ControlMessage::Tables`](crate::control::ControlMessage::Tables)), with the fragment and
//! byte counts of kvferry's own plans of each pair. Another transfer layer then plans the set
//! itself with kvferry's planners (`PairPlanner` in Rust, C or Python) and must arrive at
//! those counts: `scripts/bench-peers` drives NIXL and Mooncake that way.
//!
//! With `--perftest`, once the servers are down, `ucx_perftest -t ucp_put_bw` runs between two
//! processes on a free port with the same `UCX_TLS`, puts of the mean fragment size, at most
//! [`PUT_WINDOW`] outstanding (`-O`), and an explicit warm-up (`-w`).

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write as _};
use std::net::TcpListener;
use std::path::PathBuf;

use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::demo::{Children, DemoError, LoopbackPair, serve_args, spawn_server};
use crate::drive::Side;

use kvferry_transfer::harness::rank::PUT_WINDOW;
use kvferry_transfer::harness::{BenchStats, PairFragments};
use kvferry_transfer::{MemoryKind, RequestStats, Role, Stages, TransportSpec};

use crate::control::{PeerRef, RankTables, Submit};

/// Rounds run before the counted ones: one of each order, so both slot sets are touched.
pub const WARMUP_ROUNDS: u32 = 2;
/// The `ucx_perftest` executable on `PATH` (Debian package `ucx-utils`), used when the UCX
/// this binary links against ships none of its own.
pub const PERFTEST: &str = "ucx_perftest";
/// The `format` field of a `--export-fragments` file.
pub const FRAGMENTS_FORMAT: &str = "kvferry-fragments/1";
/// The `format` field of a `--export-workload` file.
pub const WORKLOAD_FORMAT: &str = "kvferry-workload/1";

/// The `ucx_perftest` of the UCX this binary links against (`bin/` beside its `lib/`, as the
/// wheel in `.ucx/` and most prefixes have it), with the `LD_LIBRARY_PATH` it needs; else
/// [`PERFTEST`] from `PATH`. Measuring our puts against another UCX build's perftest would
/// compare two libraries, not two callers.
pub fn perftest_command() -> Command {
    let lib_dir = std::path::Path::new(kvferry_ucx::library::linked().lib_dir);
    let own = lib_dir
        .parent()
        .map(|prefix| prefix.join("bin").join(PERFTEST));
    match own.filter(|p| p.is_file()) {
        Some(program) => {
            let mut cmd = Command::new(program);
            cmd.env("LD_LIBRARY_PATH", lib_dir);
            cmd
        }
        None => Command::new(PERFTEST),
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// The servers.
    pub pair: LoopbackPair,
    /// Tokens of every request.
    pub prompt_len: u64,
    /// Requests per round, all in flight at once.
    pub requests: u64,
    /// Counted rounds (after [`WARMUP_ROUNDS`] warm-up rounds).
    pub rounds: u32,
    /// Also run `ucx_perftest`.
    pub perftest: bool,
    /// Write round 0's fragments here (see the module docs).
    pub export_fragments: Option<PathBuf>,
    /// Write round 0's workload here: both sides' rank configurations and every request's
    /// slot tables (see the module docs).
    pub export_workload: Option<PathBuf>,
}

/// Min, median and max of per-round values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Spread {
    /// The lowest.
    pub min: f64,
    /// The median (mean of the middle two for an even count).
    pub median: f64,
    /// The highest.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (all zero when empty).
    pub fn of(values: &[f64]) -> Spread {
        if values.is_empty() {
            return Spread::default();
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Spread {
            min: v[0],
            median,
            max: v[n - 1],
        }
    }
}

/// One path's samples.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PathReport {
    /// GB/s (10^9 bytes) of every counted round, in round order.
    pub rounds_gbps: Vec<f64>,
    /// Seconds of every counted round.
    pub rounds_seconds: Vec<f64>,
    /// GB/s over the rounds.
    pub gbps: Spread,
    /// Fragments per second over the rounds.
    pub fragments_per_s: Spread,
    /// Seconds per round over the rounds.
    pub seconds: Spread,
    /// Where one request's time went: per stage the median over the rounds of (ours) the
    /// median over the round's requests, (raw, memcpy) the round's time in that stage over
    /// its requests.
    pub stages: StageSeconds,
    /// Every counted round's stages, in round order (ours: the median over the round's
    /// requests, which is the request's own with one request per round, as
    /// [`crate::grid`] runs it; raw, memcpy: per request on average).
    pub rounds_stages: Vec<StageSeconds>,
}

/// [`Stages`] in seconds, as the report prints them (see [`Stages`] for what each counts:
/// summed over the (prefill rank, decode rank) pairs of the request).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StageSeconds {
    /// Describing both sides' rows and the planner's `pair`.
    pub plan_s: f64,
    /// Validation and coalescing.
    pub validate_s: f64,
    /// Waiting for the gather of bounced pieces (0 per fragment).
    pub gather_s: f64,
    /// Issuing the puts.
    pub puts_s: f64,
    /// Waiting for the flush.
    pub flush_s: f64,
    /// Scattering bounced pieces into the slots (0 per fragment), and checking the pieces'
    /// integrity digests (`--integrity`).
    pub scatter_s: f64,
    /// The sender's integrity digests of its pieces (`--integrity`).
    pub digest_s: f64,
    /// Side-channel work: claims, `targets`, connects, completions, `expect` to claim.
    pub control_s: f64,
    /// Waiting for a planner worker or the rank thread.
    pub queue_s: f64,
    /// The memcpy baseline's copies.
    pub copy_s: f64,
}

impl StageSeconds {
    /// `stages` divided by `per` (1 for one request's), in seconds.
    pub fn of(stages: &Stages, per: u64) -> StageSeconds {
        let s = |ns: u64| ns as f64 / 1e9 / per.max(1) as f64;
        StageSeconds {
            plan_s: s(stages.plan_ns),
            validate_s: s(stages.validate_ns),
            gather_s: s(stages.gather_ns),
            puts_s: s(stages.puts_ns),
            flush_s: s(stages.flush_ns),
            scatter_s: s(stages.scatter_ns),
            digest_s: s(stages.digest_ns),
            control_s: s(stages.control_ns),
            queue_s: s(stages.queue_ns),
            copy_s: s(stages.copy_ns),
        }
    }

    /// Stage by stage, the median of `all` (zero when empty).
    pub fn median(all: &[StageSeconds]) -> StageSeconds {
        let m =
            |f: fn(&StageSeconds) -> f64| Spread::of(&all.iter().map(f).collect::<Vec<_>>()).median;
        StageSeconds {
            plan_s: m(|s| s.plan_s),
            validate_s: m(|s| s.validate_s),
            gather_s: m(|s| s.gather_s),
            puts_s: m(|s| s.puts_s),
            flush_s: m(|s| s.flush_s),
            scatter_s: m(|s| s.scatter_s),
            digest_s: m(|s| s.digest_s),
            control_s: m(|s| s.control_s),
            queue_s: m(|s| s.queue_s),
            copy_s: m(|s| s.copy_s),
        }
    }

    /// The stages, named, in report order.
    pub fn named(&self) -> [(&'static str, f64); 10] {
        [
            ("plan", self.plan_s),
            ("validate", self.validate_s),
            ("gather", self.gather_s),
            ("puts", self.puts_s),
            ("flush", self.flush_s),
            ("scatter", self.scatter_s),
            ("digest", self.digest_s),
            ("control", self.control_s),
            ("queue", self.queue_s),
            ("copy", self.copy_s),
        ]
    }

    /// What the agent path spends besides moving bytes: plan, validate, control and queue.
    pub fn overhead_s(&self) -> f64 {
        self.plan_s + self.validate_s + self.control_s + self.queue_s
    }
}

/// The `ucx_perftest` run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PerftestReport {
    /// The UCX environment it ran with (`UCX_TLS=...`).
    pub tls: String,
    /// The executable that ran.
    pub program: String,
    /// Bytes per put (`-s`).
    pub size: u64,
    /// Measured iterations (`-n`).
    pub iterations: u64,
    /// Warm-up iterations (`-w`).
    pub warmup: u64,
    /// Outstanding puts allowed (`-O`).
    pub outstanding: usize,
    /// The `Final:` overall bandwidth as printed, in MB/s of 2^20 bytes.
    pub mib_per_s: f64,
    /// The same in GB/s (10^9 bytes).
    pub gbps: f64,
}

/// What `--export-fragments` wrote.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ExportReport {
    /// The file.
    pub path: String,
    /// The round whose set it holds.
    pub round: u32,
    /// (prefill rank, decode rank) pairs.
    pub pairs: usize,
    /// Fragments over all pairs.
    pub fragments: u64,
    /// Bytes over all pairs.
    pub bytes: u64,
    /// Fragments the raw replay of the same set put (equal to `fragments`, else the run
    /// reports an error).
    pub replay_fragments: u64,
    /// Bytes the raw replay of the same set put.
    pub replay_bytes: u64,
}

/// What both export files say of the run they come from.
#[derive(Debug, Serialize)]
struct ExportHeader<'a> {
    format: &'static str,
    model: &'a str,
    planner: &'a str,
    planner_version: &'a str,
    prefill: &'a str,
    decode: &'a str,
    /// `shm`, `tcp`, `auto` or a UCX_TLS list (and its devices), and the UCX settings it pins.
    transport: &'a str,
    ucx_env: BTreeMap<String, String>,
    memory: &'a str,
    prompt_len: u64,
    /// The round whose set it holds (always 0: the one the oracle checks).
    round: u32,
}

impl<'a> ExportHeader<'a> {
    fn new(format: &'static str, config: &BenchConfig, report: &'a BenchReport) -> Self {
        ExportHeader {
            format,
            model: &report.model,
            planner: &report.planner,
            planner_version: &report.planner_version,
            prefill: &report.prefill,
            decode: &report.decode,
            transport: &report.transport,
            ucx_env: ucx_env(&config.pair.transport).into_iter().collect(),
            memory: &report.memory,
            prompt_len: config.prompt_len,
            round: 0,
        }
    }
}

/// Fragments and bytes over `pairs`.
fn totals(pairs: &[PairFragments]) -> (u64, u64) {
    (
        pairs.iter().map(|p| p.fragments.len() as u64).sum(),
        pairs.iter().map(|p| p.bytes).sum(),
    )
}

/// Writes `value` to `path` as one line of JSON.
fn write_json(path: &std::path::Path, value: &impl Serialize) -> Result<(), DemoError> {
    let failed =
        |e: &dyn fmt::Display| DemoError::Invalid(format!("cannot write {}: {e}", path.display()));
    let mut out = BufWriter::new(File::create(path).map_err(|e| failed(&e))?);
    serde_json::to_writer(&mut out, value).map_err(|e| failed(&e))?;
    out.write_all(b"\n").map_err(|e| failed(&e))?;
    out.flush().map_err(|e| failed(&e))
}

/// A `--export-fragments` file: one round's set of every (prefill rank, decode rank)
/// pair, each fragment `[src_pool, src_offset, dst_pool, dst_offset, len]` relative to the
/// pools of its pair's ranks (`src_pools` and `dst_pools` give their sizes).
#[derive(Debug, Serialize)]
struct FragmentFile<'a> {
    #[serde(flatten)]
    header: ExportHeader<'a>,
    requests: Vec<u64>,
    fragments: u64,
    bytes: u64,
    pairs: &'a [PairFragments],
}

/// What the benchmark measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BenchReport {
    /// The planner both servers bound.
    pub planner: String,
    /// Its library version.
    pub planner_version: String,
    /// Model, dtype and block size.
    pub model: String,
    /// Context deployment.
    pub prefill: String,
    /// Generation deployment.
    pub decode: String,
    /// `shm` or `tcp`.
    pub transport: String,
    /// `host` or `cuda`: where the pools lived.
    pub memory: String,
    /// Tokens per request.
    pub prompt_len: u64,
    /// Requests per round.
    pub requests: u64,
    /// Counted rounds.
    pub rounds: u32,
    /// Fragments (after coalescing) of one round's transfer set.
    pub fragments: u64,
    /// Puts of one round of the bare loop (fragments split at the executor's largest put).
    pub puts: u64,
    /// `--bounce` of both servers.
    pub bounce: String,
    /// Writes of one round on kvferry's path: UCX puts (fragments split at the largest put;
    /// bounced pieces: one per MiB of packed image), or over shared memory one copy per
    /// fragment straight into the receiver's mapping.
    pub ours_puts: u64,
    /// Pieces of one round: (prefill rank, decode rank) pairs × chunks.
    pub pieces: u64,
    /// `ours_puts / pieces`: puts per (pair, chunk) on kvferry's path.
    pub puts_per_piece: f64,
    /// Bytes of one round.
    pub bytes: u64,
    /// `bytes / fragments`.
    pub mean_fragment_bytes: f64,
    /// `bytes / puts`.
    pub mean_put_bytes: f64,
    /// Median GB/s of kvferry's path.
    pub ours_gbps: f64,
    /// Median GB/s of the bare put loop.
    pub raw_gbps: f64,
    /// Median GB/s of the same fragments copied with memcpy between buffers shaped like the
    /// pools, in one process (the prefill server's); 0 when that server refused it (its
    /// buffers would not fit: `errors` says why).
    pub memcpy_gbps: f64,
    /// `ours_gbps / raw_gbps`.
    pub ratio: f64,
    /// Ours / raw GB/s of each counted round (the two paths of a round run back to back, so
    /// a machine that slows down for a while slows both): how far the ratio of the medians
    /// can be trusted on a noisy machine.
    pub ratio_rounds: Spread,
    /// Where one request's time went on kvferry's path (= `ours.stages`).
    pub stages: StageSeconds,
    /// (median seconds of ours − median seconds of raw) / requests: what the agent path
    /// adds per request over the bare loop.
    pub overhead_per_request_s: f64,
    /// `ucx_perftest`'s GB/s, if it ran.
    pub perftest_gbps: Option<f64>,
    /// kvferry's path, every round, timed by the controller (its control round trips to the
    /// decode server included).
    pub ours: PathReport,
    /// kvferry's path as the decode agents time it (first claim to last completion, the
    /// longest request of the round): `ours` without the harness's round trips.
    pub agent: PathReport,
    /// The bare loop, every round.
    pub raw: PathReport,
    /// The memcpy baseline, every round.
    pub memcpy: PathReport,
    /// The `ucx_perftest` run, if any.
    pub perftest: Option<PerftestReport>,
    /// The `--export-fragments` file, if one was written.
    pub export: Option<ExportReport>,
    /// Whether the oracle found every destination byte right after both paths of the first
    /// warm-up round.
    pub verified: bool,
    /// Problems that did not stop the run (a failed verification, perftest errors, a refused
    /// memcpy baseline).
    pub errors: Vec<String>,
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvferry bench: {}, prefill {} -> decode {} over {}, {} memory",
            self.model, self.prefill, self.decode, self.transport, self.memory
        )?;
        writeln!(f, "planner     {} {}", self.planner, self.planner_version)?;
        writeln!(
            f,
            "workload    {} requests x {} tokens per round, {} rounds after {WARMUP_ROUNDS} \
             warm-up rounds, alternating order",
            self.requests, self.prompt_len, self.rounds
        )?;
        writeln!(
            f,
            "transfer    {} in {} fragments / {} puts per round; mean fragment {:.0} B, mean \
             put {:.0} B",
            kvferry_platform::units::bytes(self.bytes),
            self.fragments,
            self.puts,
            self.mean_fragment_bytes,
            self.mean_put_bytes
        )?;
        writeln!(
            f,
            "ours        bounce {}: {} puts per round over {} pieces ({:.1} puts per pair and \
             chunk)",
            self.bounce, self.ours_puts, self.pieces, self.puts_per_piece
        )?;
        writeln!(
            f,
            "path        GB/s median [min - max]   fragments/s   ms/round median [min - max]"
        )?;
        for (name, path) in [
            ("ours", &self.ours),
            ("  agent", &self.agent),
            ("raw", &self.raw),
            ("memcpy", &self.memcpy),
        ] {
            writeln!(
                f,
                "{name:<10}  {:>6.3} [{:.3} - {:.3}]   {:>11.0}   {:>8.3} [{:.3} - {:.3}]",
                path.gbps.median,
                path.gbps.min,
                path.gbps.max,
                path.fragments_per_s.median,
                path.seconds.median * 1e3,
                path.seconds.min * 1e3,
                path.seconds.max * 1e3,
            )?;
        }
        writeln!(
            f,
            "ratio       {:.3} (ours / raw, medians); per round {:.3} [{:.3} - {:.3}]; \
             memcpy / raw {:.3}",
            self.ratio,
            self.ratio_rounds.median,
            self.ratio_rounds.min,
            self.ratio_rounds.max,
            if self.raw_gbps > 0.0 {
                self.memcpy_gbps / self.raw_gbps
            } else {
                0.0
            }
        )?;
        write!(f, "stages      ms per request")?;
        for (name, _) in self.ours.stages.named() {
            write!(f, " {name:>8}")?;
        }
        writeln!(f)?;
        for (name, path) in [
            ("ours", &self.ours),
            ("raw", &self.raw),
            ("memcpy", &self.memcpy),
        ] {
            write!(f, "  {name:<10}              ")?;
            for (_, s) in path.stages.named() {
                write!(f, " {:>8.3}", s * 1e3)?;
            }
            writeln!(f)?;
        }
        writeln!(
            f,
            "overhead    {:.3} ms per request (ours - raw, medians, over {} requests)",
            self.overhead_per_request_s * 1e3,
            self.requests
        )?;
        match &self.perftest {
            Some(p) => writeln!(
                f,
                "perftest    {:.3} GB/s ({:.2} MB/s as printed): ucp_put_bw -s {} -n {} -w {} \
                 -O {}, {}",
                p.gbps, p.mib_per_s, p.size, p.iterations, p.warmup, p.outstanding, p.tls
            )?,
            None => writeln!(f, "perftest    not run")?,
        }
        if let Some(e) = &self.export {
            writeln!(
                f,
                "exported    {} fragments, {} bytes in {} pairs (round {}) to {}",
                e.fragments, e.bytes, e.pairs, e.round, e.path
            )?;
        }
        write!(
            f,
            "verified    {} (first warm-up round, after each path)",
            if self.verified { "yes" } else { "NO" }
        )?;
        for e in &self.errors {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

/// One set of prefilled requests.
struct Set {
    submits: Vec<Submit>,
    context: Vec<Vec<RankTables>>,
}

impl Set {
    fn ids(&self) -> Vec<u64> {
        self.submits.iter().map(|s| s.request).collect()
    }
}

/// Puts, pieces and the agent-timed seconds of one round on kvferry's path.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    puts: u64,
    pieces: u64,
    /// The longest agent-timed latency of the set (a decode agent's clock, from its first
    /// claim to the last completion): the set's time without this controller's round trips.
    agent_seconds: f64,
}

/// One sample of one path.
#[derive(Clone, Copy, Debug)]
struct Sample {
    seconds: f64,
    bytes: u64,
    fragments: u64,
}

impl Sample {
    fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9) / 1e9
    }

    fn fragments_per_s(&self) -> f64 {
        self.fragments as f64 / self.seconds.max(1e-9)
    }
}

/// The servers and the controller's connections to them.
struct Pair {
    prefill: Side,
    decode: Side,
    peer: PeerRef,
    wait: Duration,
    next_id: u64,
}

impl Pair {
    /// Prefills `n` new requests on the prefill side.
    fn prefill(&mut self, config: &BenchConfig, groups: (u32, u32)) -> Result<Set, DemoError> {
        let submits: Vec<Submit> = (0..config.requests)
            .map(|k| {
                let id = self.next_id + k;
                Submit {
                    request: id,
                    prompt_len: config.prompt_len,
                    ctx_dp_rank: (k % u64::from(groups.0)) as u32,
                    gen_dp_rank: (k % u64::from(groups.1)) as u32,
                    chunks: None,
                    layer_parts: 0,
                    cached: 0,
                    peer: None,
                }
            })
            .collect();
        self.next_id += config.requests;
        let mut context = Vec::with_capacity(submits.len());
        for (s, result) in submits.iter().zip(self.prefill.prefill(&submits)?) {
            context.push(result.map_err(|e| {
                DemoError::Protocol(format!("request {}: prefill: {e}", s.request))
            })?);
        }
        Ok(Set { submits, context })
    }

    /// kvferry's path: every request of `set` through the agents at once, timed by this
    /// controller (its control round trips to the decode server included); and each request's
    /// stages, both sides' merged, and the decode agents' own time for the set
    /// ([`Counts::agent_seconds`]).
    fn ours(&self, set: &Set) -> Result<(Sample, Vec<Stages>, Counts), DemoError> {
        let started = Instant::now();
        let results = self.decode.transfer(&set.submits, &self.peer, self.wait)?;
        let seconds = started.elapsed().as_secs_f64();
        let sent = self.prefill.stats(&set.ids())?;
        let (mut bytes, mut fragments) = (0, 0);
        let mut counts = Counts::default();
        let mut stages = Vec::with_capacity(results.len());
        for ((s, result), sent) in set.submits.iter().zip(results).zip(sent) {
            let stats: RequestStats = result
                .map_err(|e| DemoError::Protocol(format!("request {} failed: {e}", s.request)))?;
            bytes += stats.bytes;
            fragments += stats.fragments;
            counts.puts += sent.puts;
            counts.pieces += u64::from(stats.pieces);
            counts.agent_seconds = counts.agent_seconds.max(stats.latency_us as f64 / 1e6);
            let mut both = stats.stages;
            both.merge(&sent.stages);
            stages.push(both);
        }
        Ok((
            Sample {
                seconds,
                bytes,
                fragments,
            },
            stages,
            counts,
        ))
    }

    /// The memcpy baseline over the fragments recorded for `set`, or the prefill server's
    /// refusal (its buffers would not fit in memory, say).
    fn memcpy(&self, set: &Set) -> Result<Result<(Sample, BenchStats), String>, DemoError> {
        Ok(self.prefill.memcpy(&set.ids(), self.wait)?.map(|stats| {
            (
                Sample {
                    seconds: stats.elapsed_ns as f64 / 1e9,
                    bytes: stats.bytes,
                    fragments: stats.fragments,
                },
                stats,
            )
        }))
    }

    /// The bare loop over the plans recorded for `set`.
    fn raw(&self, set: &Set) -> Result<(Sample, BenchStats), DemoError> {
        let stats = self.prefill.replay(&set.ids(), self.wait)?;
        Ok((
            Sample {
                seconds: stats.elapsed_ns as f64 / 1e9,
                bytes: stats.bytes,
                fragments: stats.fragments,
            },
            stats,
        ))
    }

    /// The recorded fragments of `set`, per pair.
    fn fragments(&self, set: &Set) -> Result<Vec<PairFragments>, DemoError> {
        self.prefill.fragments(&set.ids())
    }

    /// Checks every request of `set` with the oracle; returns the problems found.
    fn verify(&self, set: &Set) -> Result<Vec<String>, DemoError> {
        let mut problems = Vec::new();
        for (s, context) in set.submits.iter().zip(&set.context) {
            match self.decode.verify(s, context)? {
                Ok(summary) if summary.ok => {}
                Ok(summary) => problems.push(format!("request {}: {}", s.request, summary.detail)),
                Err(e) => problems.push(format!("request {}: verify: {e}", s.request)),
            }
        }
        Ok(problems)
    }

    fn release(&self, set: &Set) -> Result<(), DemoError> {
        for s in &set.submits {
            self.decode.release(s)?;
            self.prefill.release(s)?;
        }
        Ok(())
    }
}

/// Runs the benchmark.
///
/// # Errors
///
/// A child that does not start, a control connection that fails, a request that fails, or a
/// server that answers out of protocol. A failed verification or perftest run is in the
/// report.
pub fn run(config: &BenchConfig) -> Result<BenchReport, DemoError> {
    if config.requests == 0 || config.prompt_len == 0 || config.rounds == 0 {
        return Err(DemoError::Invalid(
            "--requests, --prompt-len and --rounds must be positive".into(),
        ));
    }
    let tpb = u64::from(config.pair.smallest_block());
    let groups = (
        config.pair.prefill.dp_groups(),
        config.pair.decode.dp_groups(),
    );
    // Requests go round-robin over each side's DP groups, and two sets are held at once (odd
    // rounds replay the previous set).
    let sized_by = format!(
        "--prompt-len {} with --requests {}",
        config.prompt_len, config.requests
    );
    let sizing = |dp_groups: u32| {
        let held = config
            .requests
            .div_ceil(u64::from(dp_groups.max(1)))
            .saturating_mul(2);
        let slots = held
            .checked_mul(config.prompt_len.div_ceil(tpb))
            .and_then(|n| n.checked_add(4))
            .ok_or_else(|| {
                DemoError::Invalid(format!(
                    "{sized_by}: more than 2^64 slots per pool ({tpb} tokens per block)"
                ))
            })?;
        Ok::<_, DemoError>((slots, held.saturating_add(2)))
    };
    let (ctx_slots, ctx_state) = sizing(groups.0)?;
    let (gen_slots, gen_state) = sizing(groups.1)?;
    config
        .pair
        .check_pools((ctx_slots, ctx_state), (gen_slots, gen_state), &sized_by)?;
    let mut ctx_args = serve_args(
        &config.pair,
        "prefill",
        &config.pair.ctx_spec,
        ctx_slots,
        ctx_state,
    );
    ctx_args.push("--record-plans".into());
    let gen_args = serve_args(
        &config.pair,
        "decode",
        &config.pair.gen_spec,
        gen_slots,
        gen_state,
    );

    let mut children = Children(Vec::new());
    let (ctx_child, ctx_addr) = spawn_server(&config.pair.exe, &ctx_args, "prefill")?;
    children.0.push(ctx_child);
    let (gen_child, gen_addr) = spawn_server(&config.pair.exe, &gen_args, "decode")?;
    children.0.push(gen_child);
    let secret = crate::demo::controller_secret(None)?;
    let prefill = Side::connect(Role::Prefill, &[ctx_addr.control], &secret)?;
    let decode = Side::connect(Role::Decode, &[gen_addr.control], &secret)?;
    let mut pair = Pair {
        peer: prefill.peer(),
        prefill,
        decode,
        wait: config.pair.timeout + Duration::from_secs(30),
        next_id: 0,
    };

    let mut report = BenchReport {
        model: config.pair.model_label(),
        prefill: config.pair.ctx_spec.clone(),
        decode: config.pair.gen_spec.clone(),
        transport: config.pair.transport.to_string(),
        bounce: config.pair.bounce.to_string(),
        memory: config.pair.memory.to_string(),
        prompt_len: config.prompt_len,
        requests: config.requests,
        rounds: config.rounds,
        planner: pair.decode.info().planner_id.clone(),
        planner_version: pair.decode.info().planner_version.clone(),
        ..BenchReport::default()
    };

    let mut ours = Vec::new();
    let mut agent = Vec::new();
    let mut raw = Vec::new();
    let mut memcpy = Vec::new();
    // The memcpy baseline's refusal: it is not run again, and the report says why.
    let mut memcpy_refused: Option<String> = None;
    // Per counted round: per request (ours) or per request on average (raw, memcpy).
    let (mut ours_stages, mut raw_stages, mut memcpy_stages) = (Vec::new(), Vec::new(), Vec::new());
    let mut total_puts = 0;
    let mut ours_counts = Counts::default();
    let mut previous: Option<Set> = None;
    let mut problems = Vec::new();
    let total = WARMUP_ROUNDS + config.rounds;
    let n = config.requests;
    for round in 0..total {
        let counted = round >= WARMUP_ROUNDS;
        let set = pair.prefill(config, groups)?;
        let ((ours_sample, stages, counts), (raw_sample, stats), copy) = match previous.take() {
            // Odd rounds: raw and memcpy on the previous set first, then ours on the new one.
            Some(prev) => {
                let r = pair.raw(&prev)?;
                let m = baseline(&pair, &prev, &mut memcpy_refused)?;
                let o = pair.ours(&set)?;
                pair.release(&prev)?;
                pair.release(&set)?;
                (o, r, m)
            }
            // Even rounds: ours on the new set, then raw and memcpy on the same set, which
            // stays held.
            None => {
                let o = pair.ours(&set)?;
                if round == 0 {
                    problems.extend(pair.verify(&set)?);
                }
                let (r, stats) = pair.raw(&set)?;
                if round == 0 {
                    problems.extend(pair.verify(&set)?);
                    if let Some(path) = &config.export_fragments {
                        let pairs = pair.fragments(&set)?;
                        let mut export = write_fragments(path, config, &report, &set, &pairs)?;
                        export.replay_fragments = stats.fragments;
                        export.replay_bytes = stats.bytes;
                        if export.fragments != stats.fragments || export.bytes != stats.bytes {
                            problems.push(format!(
                                "exported {} fragments and {} bytes, the raw replay of the \
                                     same set put {} and {}",
                                export.fragments, export.bytes, stats.fragments, stats.bytes
                            ));
                        }
                        report.export = Some(export);
                    }
                    if let Some(path) = &config.export_workload {
                        let pairs = pair.fragments(&set)?;
                        let decode = set
                            .submits
                            .iter()
                            .map(|s| pair.decode.tables(s))
                            .collect::<Result<Vec<_>, _>>()?;
                        write_workload(path, config, &report, &set, &decode, &pairs)?;
                    }
                }
                let m = baseline(&pair, &set, &mut memcpy_refused)?;
                if round + 1 < total {
                    previous = Some(set);
                } else {
                    pair.release(&set)?;
                }
                (o, (r, stats), m)
            }
        };
        tracing::debug!(
            round,
            ours_gbps = ours_sample.gbps(),
            raw_gbps = raw_sample.gbps(),
            memcpy_gbps = copy.as_ref().map_or(0.0, |(s, _)| s.gbps()),
            "bench round"
        );
        // The baselines run on one set: they must move what its replay moved.
        if let Some((c, _)) = &copy {
            if c.bytes != raw_sample.bytes || c.fragments != raw_sample.fragments {
                problems.push(format!(
                    "round {round}: memcpy copied {} bytes in {} fragments, raw put {} in {}",
                    c.bytes, c.fragments, raw_sample.bytes, raw_sample.fragments
                ));
            }
        }
        // Even rounds time both paths on the same set, so they must move the same fragments.
        let same_set = round % 2 == 0;
        if same_set
            && (ours_sample.bytes != raw_sample.bytes
                || ours_sample.fragments != raw_sample.fragments)
        {
            problems.push(format!(
                "round {round}: ours moved {} bytes in {} fragments, raw {} in {}",
                ours_sample.bytes, ours_sample.fragments, raw_sample.bytes, raw_sample.fragments
            ));
        }
        if counted {
            total_puts += stats.puts;
            ours_counts.puts += counts.puts;
            ours_counts.pieces += counts.pieces;
            ours.push(ours_sample);
            agent.push(Sample {
                seconds: counts.agent_seconds,
                ..ours_sample
            });
            raw.push(raw_sample);
            let per_request: Vec<StageSeconds> =
                stages.iter().map(|s| StageSeconds::of(s, 1)).collect();
            ours_stages.push(StageSeconds::median(&per_request));
            raw_stages.push(StageSeconds::of(&stats.stages, n));
            if let Some((sample, copied)) = copy {
                memcpy.push(sample);
                memcpy_stages.push(StageSeconds::of(&copied.stages, n));
            }
        }
    }
    if let Some(prev) = previous.take() {
        pair.release(&prev)?;
    }

    pair.decode.shutdown();
    pair.prefill.shutdown();
    children.wait_exit(Duration::from_secs(5));
    drop(children);

    // Every set has the same shape; fragment counts differ slightly with slot placement
    // (adjacent slots coalesce), so report the means per round.
    let counted = ours.len().max(1) as u64;
    let total_bytes: u64 = ours.iter().map(|s| s.bytes).sum();
    let total_fragments: u64 = ours.iter().map(|s| s.fragments).sum();
    report.bytes = total_bytes / counted;
    report.fragments = total_fragments / counted;
    report.puts = total_puts / counted;
    report.ours_puts = ours_counts.puts / counted;
    report.pieces = ours_counts.pieces / counted;
    report.puts_per_piece = ours_counts.puts as f64 / ours_counts.pieces.max(1) as f64;
    report.mean_fragment_bytes = total_bytes as f64 / total_fragments.max(1) as f64;
    report.mean_put_bytes = total_bytes as f64 / total_puts.max(1) as f64;
    report.ours = path_report(&ours, &ours_stages);
    report.agent = path_report(&agent, &ours_stages);
    report.raw = path_report(&raw, &raw_stages);
    report.memcpy = path_report(&memcpy, &memcpy_stages);
    report.ours_gbps = report.ours.gbps.median;
    report.raw_gbps = report.raw.gbps.median;
    report.memcpy_gbps = report.memcpy.gbps.median;
    report.stages = report.ours.stages;
    report.overhead_per_request_s =
        (report.ours.seconds.median - report.raw.seconds.median) / n as f64;
    report.ratio = if report.raw_gbps > 0.0 {
        report.ours_gbps / report.raw_gbps
    } else {
        0.0
    };
    let per_round: Vec<f64> = ours
        .iter()
        .zip(&raw)
        .map(|(o, r)| o.gbps() / r.gbps().max(1e-9))
        .collect();
    report.ratio_rounds = Spread::of(&per_round);
    report.verified = problems.is_empty();
    report.errors = problems;

    if let Some(e) = memcpy_refused {
        report.errors.push(format!("memcpy baseline not run: {e}"));
    }
    if config.perftest {
        let size = report.mean_fragment_bytes.round().max(1.0) as u64;
        match perftest(&config.pair.transport, size, report.bytes) {
            Ok(p) => {
                report.perftest_gbps = Some(p.gbps);
                report.perftest = Some(p);
            }
            Err(e) => report.errors.push(format!("ucx_perftest: {e}")),
        }
    }
    Ok(report)
}

/// The bench run once per number of requests in flight (`--requests 1,2,4,8`): one
/// report each, in the order given; JSON: an array of those reports.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(transparent)]
pub struct Sweep(pub Vec<BenchReport>);

impl Sweep {
    /// Whether every run verified.
    pub fn verified(&self) -> bool {
        self.0.iter().all(|r| r.verified)
    }
}

impl fmt::Display for Sweep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for r in &self.0 {
            writeln!(f, "{r}\n")?;
        }
        writeln!(
            f,
            "sweep       requests in flight against GB/s (medians) and per-request overhead"
        )?;
        writeln!(
            f,
            "requests   ours GB/s    raw GB/s  memcpy GB/s   ours-raw ms/req   plan+validate+control+queue ms/req"
        )?;
        for r in &self.0 {
            writeln!(
                f,
                "{:>8}   {:>9.3}   {:>9.3}   {:>10.3}   {:>15.3}   {:>34.3}",
                r.requests,
                r.ours_gbps,
                r.raw_gbps,
                r.memcpy_gbps,
                r.overhead_per_request_s * 1e3,
                r.stages.overhead_s() * 1e3
            )?;
        }
        Ok(())
    }
}

/// Runs the benchmark once per entry of `requests` (fresh servers each time), with
/// `config`'s other settings.
///
/// # Errors
///
/// As for [`run`]; `--export-fragments` with more than one entry (each run would overwrite
/// the file).
pub fn sweep(config: &BenchConfig, requests: &[u64]) -> Result<Sweep, DemoError> {
    if requests.is_empty() {
        return Err(DemoError::Invalid(
            "--requests needs at least one number".into(),
        ));
    }
    if requests.len() > 1 && config.export_fragments.is_some() {
        return Err(DemoError::Invalid(
            "--export-fragments takes one --requests value, not a sweep".into(),
        ));
    }
    if requests.len() > 1 && config.export_workload.is_some() {
        return Err(DemoError::Invalid(
            "--export-workload takes one --requests value, not a sweep".into(),
        ));
    }
    let mut reports = Vec::with_capacity(requests.len());
    for &n in requests {
        let one = BenchConfig {
            requests: n,
            ..config.clone()
        };
        reports.push(run(&one)?);
    }
    Ok(Sweep(reports))
}

/// The memcpy baseline on `set`, unless the prefill server refused it before (then `None`);
/// a refusal is kept in `refused`, and the run goes on without that column.
fn baseline(
    pair: &Pair,
    set: &Set,
    refused: &mut Option<String>,
) -> Result<Option<(Sample, BenchStats)>, DemoError> {
    if refused.is_some() {
        return Ok(None);
    }
    match pair.memcpy(set)? {
        Ok(done) => Ok(Some(done)),
        Err(e) => {
            tracing::warn!(error = %e, "the memcpy baseline was refused; going on without it");
            *refused = Some(e);
            Ok(None)
        }
    }
}

/// Writes the `--export-fragments` file of round 0's `set`.
fn write_fragments(
    path: &std::path::Path,
    config: &BenchConfig,
    report: &BenchReport,
    set: &Set,
    pairs: &[PairFragments],
) -> Result<ExportReport, DemoError> {
    let (fragments, bytes) = totals(pairs);
    let file = FragmentFile {
        header: ExportHeader::new(FRAGMENTS_FORMAT, config, report),
        requests: set.ids(),
        fragments,
        bytes,
        pairs,
    };
    write_json(path, &file)?;
    Ok(ExportReport {
        path: path.display().to_string(),
        round: 0,
        pairs: pairs.len(),
        fragments,
        bytes,
        ..ExportReport::default()
    })
}

/// A `--export-workload` file: what another transfer layer needs to move round 0's set with
/// kvferry's plans, made by its own planner calls (`kvferry::planning::PairPlanner`, the
/// Python and C `PairPlanner`): every rank's configuration as an agent reads it (its pools at
/// the addresses the servers allocated: a runner maps plan addresses to pool offsets) and
/// each request's slot tables on both sides. `pairs` holds kvferry's own plans' counts of the
/// same set, for the runner to check its plans against.
#[derive(Debug, Serialize)]
struct WorkloadFile<'a> {
    #[serde(flatten)]
    header: ExportHeader<'a>,
    prefill_ranks: BTreeMap<u32, serde_json::Value>,
    decode_ranks: BTreeMap<u32, serde_json::Value>,
    requests: Vec<WorkloadRequest>,
    fragments: u64,
    bytes: u64,
    pairs: Vec<WorkloadPair>,
}

/// One request of a workload: its slot tables (one per layer group) on each rank holding it.
#[derive(Debug, Serialize)]
struct WorkloadRequest {
    request: u64,
    prompt_len: u64,
    prefill: BTreeMap<u32, Vec<Vec<i64>>>,
    decode: BTreeMap<u32, Vec<Vec<i64>>>,
}

/// kvferry's plans of one (prefill rank, decode rank) pair over the set.
#[derive(Debug, Serialize)]
struct WorkloadPair {
    ctx_rank: u32,
    gen_rank: u32,
    /// Fragments of each recorded plan, in the order they ran.
    plans: Vec<u64>,
    fragments: u64,
    bytes: u64,
}

fn write_workload(
    path: &std::path::Path,
    config: &BenchConfig,
    report: &BenchReport,
    set: &Set,
    decode: &[Vec<RankTables>],
    pairs: &[PairFragments],
) -> Result<(), DemoError> {
    let architecture = config.pair.model.architecture();
    let planner = Some(report.planner.as_str());
    let tables = |ranks: &[RankTables]| -> BTreeMap<u32, Vec<Vec<i64>>> {
        ranks
            .iter()
            .map(|r| (r.rank, r.tables.iter().map(|t| t.slots.to_vec()).collect()))
            .collect()
    };
    let mut prefill_ranks = BTreeMap::new();
    let mut decode_ranks = BTreeMap::new();
    for (context, landed) in set.context.iter().zip(decode) {
        for r in context {
            prefill_ranks.entry(r.rank).or_insert_with(|| {
                kvferry::config::rank_config(
                    Role::Prefill,
                    architecture,
                    planner,
                    &config.pair.prefill,
                    &r.info,
                )
            });
        }
        for r in landed {
            decode_ranks.entry(r.rank).or_insert_with(|| {
                kvferry::config::rank_config(
                    Role::Decode,
                    architecture,
                    planner,
                    &config.pair.decode,
                    &r.info,
                )
            });
        }
    }
    let requests = set
        .submits
        .iter()
        .zip(&set.context)
        .zip(decode)
        .map(|((s, context), landed)| WorkloadRequest {
            request: s.request,
            prompt_len: s.prompt_len,
            prefill: tables(context),
            decode: tables(landed),
        })
        .collect();
    let (fragments, bytes) = totals(pairs);
    let file = WorkloadFile {
        header: ExportHeader::new(WORKLOAD_FORMAT, config, report),
        prefill_ranks,
        decode_ranks,
        requests,
        fragments,
        bytes,
        pairs: pairs
            .iter()
            .map(|p| WorkloadPair {
                ctx_rank: p.ctx_rank,
                gen_rank: p.gen_rank,
                plans: p.plans.clone(),
                fragments: p.fragments.len() as u64,
                bytes: p.bytes,
            })
            .collect(),
    };
    write_json(path, &file)
}

fn path_report(samples: &[Sample], stages: &[StageSeconds]) -> PathReport {
    let gbps: Vec<f64> = samples.iter().map(Sample::gbps).collect();
    let fps: Vec<f64> = samples.iter().map(Sample::fragments_per_s).collect();
    let seconds: Vec<f64> = samples.iter().map(|s| s.seconds).collect();
    PathReport {
        gbps: Spread::of(&gbps),
        fragments_per_s: Spread::of(&fps),
        seconds: Spread::of(&seconds),
        stages: StageSeconds::median(stages),
        rounds_gbps: gbps,
        rounds_seconds: seconds,
        rounds_stages: stages.to_vec(),
    }
}

/// The `UCX_*` settings `transport` pins for host pools, as its contexts set them (what it
/// does not pin, UCX takes from the environment, which `ucx_perftest` inherits too).
pub fn ucx_env(transport: &TransportSpec) -> Vec<(String, String)> {
    transport
        .ucx_settings(MemoryKind::Host)
        .into_iter()
        .map(|(k, v)| (format!("UCX_{k}"), v))
        .collect()
}

/// A port that was free a moment ago on 127.0.0.1.
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Runs `ucx_perftest -t ucp_put_bw` with puts of `size` bytes, about `bytes` in total (at
/// least 1000 and at most 200 000 iterations, at most 4 GiB), between a server and a client
/// process on a fresh free port.
///
/// # Errors
///
/// The executable is missing, a process fails, or no `Final:` line is printed.
pub fn perftest(
    transport: &TransportSpec,
    size: u64,
    bytes: u64,
) -> Result<PerftestReport, String> {
    let size = size.max(1);
    let iterations = (bytes / size)
        .clamp(1000, 200_000)
        .min((4u64 << 30) / size)
        .max(1);
    let warmup = (iterations / 10).max(1);
    let env = ucx_env(transport);
    let tls = env
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ");
    let mut last_error = String::new();
    // The server may not listen yet when the client connects; retry on a new port.
    for _ in 0..4 {
        let port = free_port()
            .map_err(|e| format!("no free port: {e}"))?
            .to_string();
        let mut server = perftest_command();
        server
            .args(["-p", &port])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let server = server
            .spawn()
            .map_err(|e| format!("cannot start {PERFTEST} (package ucx-utils): {e}"))?;
        let mut server = Children(vec![server]);
        thread::sleep(Duration::from_millis(500));
        let out = perftest_command()
            .args(["127.0.0.1", "-p", &port, "-t", "ucp_put_bw"])
            .args(["-s", &size.to_string(), "-n", &iterations.to_string()])
            .args(["-w", &warmup.to_string(), "-O", &PUT_WINDOW.to_string()])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot start {PERFTEST} (package ucx-utils): {e}"))?;
        server.wait_exit(Duration::from_secs(5));
        let stdout = String::from_utf8_lossy(&out.stdout);
        if let Some(mib) = final_bandwidth(&stdout) {
            return Ok(PerftestReport {
                tls,
                program: perftest_command()
                    .get_program()
                    .to_string_lossy()
                    .into_owned(),
                size,
                iterations,
                warmup,
                outstanding: PUT_WINDOW,
                mib_per_s: mib,
                gbps: mib * (1u64 << 20) as f64 / 1e9,
            });
        }
        last_error = format!(
            "client exited with {} and printed no Final line: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Err(last_error)
}

/// The overall bandwidth (MB/s of 2^20 bytes) of `ucx_perftest`'s `Final:` line:
/// `Final: iters p50 avg overall bw_avg bw_overall rate_avg rate_overall`.
pub fn final_bandwidth(stdout: &str) -> Option<f64> {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("Final:"))?;
    line.split_whitespace().nth(6)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_odd_and_even_counts() {
        assert_eq!(
            Spread::of(&[3.0, 1.0, 2.0]),
            Spread {
                min: 1.0,
                median: 2.0,
                max: 3.0
            }
        );
        assert_eq!(Spread::of(&[4.0, 1.0, 2.0, 3.0]).median, 2.5);
        assert_eq!(Spread::of(&[]), Spread::default());
    }

    #[test]
    fn parses_the_final_line() {
        let out = "+---+\nFinal:                 20000      1.182    33.628    33.628     \
                   1858.56    1858.56       29737       29737\n\n| Data layout: x |";
        assert_eq!(final_bandwidth(out), Some(1858.56));
        assert_eq!(final_bandwidth("no final line"), None);
    }
}
