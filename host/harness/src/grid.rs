//! `kvferry bench --sweep`: nixlbench's grid — fragment size by batch size — on kvferry's
//! whole path, the bare put loop and memcpy, one request at a time.
//!
//! nixlbench times a transfer library on synthetic descriptor lists: `batch` blocks of
//! `block size` bytes each, one transfer request per batch, and reports bandwidth and the
//! average and p99 of the time to prepare, post and complete a request. kvferry moves what a
//! planner plans for a model's cache, so the grid gives it a cache whose blocks are exactly
//! those fragments: a Llama-architecture model of one layer with one KV head of 128 elements
//! in bf16 ([`GRID_MODEL`]): 512 bytes per token for K and V together, so a block of
//! `size / 512` tokens is one fragment of `size` bytes on a tp1 -> tp1 pair (the same layout
//! on both sides), and a request of `batch × tokens per block` tokens is `batch` fragments.
//! Slots are placed as [`crate::slots`] places them (shuffled), so two ordinals land on
//! adjacent slots on both sides only by chance: then they coalesce, and a cell's fragment
//! count is slightly below its batch (the report gives the mean).
//!
//! Each cell is one [`bench::run`] with fresh servers: one request per round, the configured
//! rounds after the warm-up ones, and the oracle's check of round 0. Per cell the report
//! gives the medians of the bench (GB/s of each path) and, over the counted rounds, the
//! average and p99 (nearest rank) of: the request's time on kvferry's path as the controller
//! sees it (`Submit` to `Done`, the control round trips to the decode server included) and
//! as the decode agent times it (first claim to last completion), the bare put loop's time,
//! the preparation (the planner's `pair` and validation: what NIXL's `make_prepped_xfer` and
//! nixlbench's prepare time stand for) and the posting (issuing the puts or copies, gathers
//! included). Cells over `max_request_bytes` are skipped and listed.
//!
//! With an export directory, every cell's round-0 set is written there as a
//! `kvferry-workload/1` file named `SIZE-BATCH.json` (`scripts/bench-peers --sweep` gives
//! them to NIXL and Mooncake), and the grid's model as `model/config.json`.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use kvferry_testkit::layout::{ModelShape, ModelSpec};

use crate::bench::{self, BenchConfig, BenchReport, StageSeconds};
use crate::demo::DemoError;

/// The grid's model: one layer, one KV head of 128 elements, bf16 (a `config.json` any
/// kvferry build reads; see the module docs).
pub const GRID_MODEL: &str = r#"{
  "model_type": "llama",
  "architectures": ["LlamaForCausalLM"],
  "num_hidden_layers": 1,
  "num_attention_heads": 8,
  "num_key_value_heads": 1,
  "hidden_size": 1024,
  "head_dim": 128,
  "torch_dtype": "bfloat16"
}
"#;
/// Cache bytes per token of [`GRID_MODEL`]: K and V of one 128-element bf16 head.
pub const BYTES_PER_TOKEN: u64 = 2 * 128 * 2;
/// nixlbench's block sizes, 4 KiB to 4 MiB, every fourfold step.
pub const DEFAULT_SIZES: [u64; 6] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
/// nixlbench's batch sizes, 1 to 1,024, every fourfold step.
pub const DEFAULT_BATCHES: [u64; 6] = [1, 4, 16, 64, 256, 1024];
/// The largest request a cell may move by default: each side holds two sets, and the memcpy
/// baseline two more copies, so this keeps the grid within a small machine's memory.
pub const DEFAULT_MAX_REQUEST_BYTES: u64 = 256 << 20;

/// What to run.
#[derive(Clone, Debug)]
pub struct GridConfig {
    /// Servers, transport, rounds and the rest; its model, prompt length, requests and
    /// exports are set per cell.
    pub base: BenchConfig,
    /// Fragment sizes in bytes (multiples of [`BYTES_PER_TOKEN`]).
    pub sizes: Vec<u64>,
    /// Fragments per request.
    pub batches: Vec<u64>,
    /// Cells whose request would move more bytes than this are skipped.
    pub max_request_bytes: u64,
    /// Where to write the grid's model and every cell's workload (see the module docs);
    /// without one the model goes to a temporary folder, removed at the end.
    pub export_dir: Option<PathBuf>,
}

/// The average and p99 of one time over a cell's counted rounds, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Latency {
    /// The mean.
    pub avg_us: f64,
    /// The 99th percentile, nearest rank (the largest of fewer than 100 rounds).
    pub p99_us: f64,
}

impl Latency {
    /// Of `seconds` (zero when empty).
    pub fn of(seconds: &[f64]) -> Latency {
        if seconds.is_empty() {
            return Latency::default();
        }
        let mut v = seconds.to_vec();
        v.sort_by(f64::total_cmp);
        let rank = (v.len() * 99).div_ceil(100).max(1);
        Latency {
            avg_us: v.iter().sum::<f64>() / v.len() as f64 * 1e6,
            p99_us: v[rank - 1] * 1e6,
        }
    }
}

/// One cell of the grid.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Cell {
    /// Bytes of every block, so of every fragment.
    pub fragment_bytes: u64,
    /// Blocks of the request.
    pub batch: u64,
    /// Tokens per block of the grid's model for this size.
    pub tokens_per_block: u32,
    /// Bytes of the request.
    pub bytes: u64,
    /// Fragments of the request after coalescing (mean over the rounds).
    pub fragments: u64,
    /// Median GB/s of kvferry's path (controller-timed).
    pub ours_gbps: f64,
    /// Median GB/s of kvferry's path as the decode agent times it.
    pub agent_gbps: f64,
    /// Median GB/s of the bare put loop.
    pub raw_gbps: f64,
    /// Median GB/s of memcpy of the same fragments (0 when refused).
    pub memcpy_gbps: f64,
    /// A request on kvferry's path, `Submit` to `Done` at the controller.
    pub ours: Latency,
    /// The same request as the decode agent times it (first claim to last completion).
    pub agent: Latency,
    /// The bare put loop over the same fragments.
    pub raw: Latency,
    /// Planning and validation (the planner's `pair`, `kvferry_plan::validate`).
    pub prepare: Latency,
    /// Issuing the puts, or the copies into the peer's mapping over shm, gathers included.
    pub post: Latency,
    /// Whether the oracle found every destination byte right.
    pub verified: bool,
    /// The exported workload, if any.
    pub workload: Option<String>,
    /// The cell's whole bench report.
    pub report: BenchReport,
}

impl Cell {
    fn of(size: u64, batch: u64, tpb: u32, workload: Option<&Path>, report: BenchReport) -> Self {
        let stage = |f: fn(&StageSeconds) -> f64| -> Vec<f64> {
            report.ours.rounds_stages.iter().map(f).collect()
        };
        Cell {
            fragment_bytes: size,
            batch,
            tokens_per_block: tpb,
            bytes: report.bytes,
            fragments: report.fragments,
            ours_gbps: report.ours.gbps.median,
            agent_gbps: report.agent.gbps.median,
            raw_gbps: report.raw.gbps.median,
            memcpy_gbps: report.memcpy.gbps.median,
            ours: Latency::of(&report.ours.rounds_seconds),
            agent: Latency::of(&report.agent.rounds_seconds),
            raw: Latency::of(&report.raw.rounds_seconds),
            prepare: Latency::of(&stage(|s| s.plan_s + s.validate_s)),
            post: Latency::of(&stage(|s| s.gather_s + s.puts_s)),
            verified: report.verified,
            workload: workload.map(|p| p.display().to_string()),
            report,
        }
    }
}

/// What the grid measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Grid {
    /// The grid's model, in words.
    pub model: String,
    /// Its `config.json`, when it was written to the export folder.
    pub model_config: Option<String>,
    /// Context deployment.
    pub prefill: String,
    /// Generation deployment.
    pub decode: String,
    /// `shm`, `tcp`, ...
    pub transport: String,
    /// `--bounce` of both servers.
    pub bounce: String,
    /// Counted rounds of every cell.
    pub rounds: u32,
    /// The cells run, sizes outer, batches inner.
    pub cells: Vec<Cell>,
    /// `[fragment_bytes, batch]` of the cells over the byte limit.
    pub skipped: Vec<[u64; 2]>,
    /// The byte limit.
    pub max_request_bytes: u64,
}

impl Grid {
    /// Whether every cell verified.
    pub fn verified(&self) -> bool {
        self.cells.iter().all(|c| c.verified)
    }
}

/// `4 KiB`, `256 KiB`, `4 MiB`.
pub fn size_label(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

impl fmt::Display for Grid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvferry bench --sweep: {}, prefill {} -> decode {} over {}, bounce {}",
            self.model, self.prefill, self.decode, self.transport, self.bounce
        )?;
        writeln!(
            f,
            "one request of BATCH fragments at a time, {} counted rounds per cell; GB/s are \
             medians, times in us are avg / p99 over the rounds",
            self.rounds
        )?;
        writeln!(
            f,
            "{:>8} {:>5} {:>6}  {:>7} {:>7} {:>7} {:>7}  {:>15} {:>15} {:>15} {:>13} {:>15}",
            "fragment",
            "batch",
            "frags",
            "ours",
            "agent",
            "raw",
            "memcpy",
            "ours us",
            "agent us",
            "raw us",
            "prepare us",
            "post us"
        )?;
        let pair = |l: &Latency| format!("{:.0} / {:.0}", l.avg_us, l.p99_us);
        for c in &self.cells {
            writeln!(
                f,
                "{:>8} {:>5} {:>6}  {:>7.3} {:>7.3} {:>7.3} {:>7.3}  {:>15} {:>15} {:>15} {:>13} \
                 {:>15}{}",
                size_label(c.fragment_bytes),
                c.batch,
                c.fragments,
                c.ours_gbps,
                c.agent_gbps,
                c.raw_gbps,
                c.memcpy_gbps,
                pair(&c.ours),
                pair(&c.agent),
                pair(&c.raw),
                pair(&c.prepare),
                pair(&c.post),
                if c.verified { "" } else { "  NOT VERIFIED" }
            )?;
        }
        if !self.skipped.is_empty() {
            let list: Vec<String> = self
                .skipped
                .iter()
                .map(|[s, b]| format!("{} x {b}", size_label(*s)))
                .collect();
            write!(
                f,
                "skipped (over {} per request): {}",
                size_label(self.max_request_bytes),
                list.join(", ")
            )?;
        }
        for c in self.cells.iter().filter(|c| !c.report.errors.is_empty()) {
            write!(
                f,
                "\n{} x {}: {}",
                size_label(c.fragment_bytes),
                c.batch,
                c.report.errors.join("; ")
            )?;
        }
        Ok(())
    }
}

/// The folder the grid's model is written to, removed on drop unless it was asked for.
struct ModelDir {
    path: PathBuf,
    remove: bool,
}

impl Drop for ModelDir {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Refuses a grid that cannot run, naming the value.
fn check(config: &GridConfig) -> Result<(), DemoError> {
    let invalid = |s: String| Err(DemoError::Invalid(s));
    if config.sizes.is_empty() || config.batches.is_empty() {
        return invalid("--sweep needs at least one fragment size and one batch size".into());
    }
    for &size in &config.sizes {
        if size == 0 || size % BYTES_PER_TOKEN != 0 {
            return invalid(format!(
                "fragment size {size}: the grid's blocks are whole tokens of {BYTES_PER_TOKEN} \
                 bytes, so it must be a positive multiple of {BYTES_PER_TOKEN}"
            ));
        }
        if u32::try_from(size / BYTES_PER_TOKEN).is_err() {
            return invalid(format!("fragment size {size}: too many tokens per block"));
        }
    }
    if let Some(0) = config.batches.iter().min() {
        return invalid("batch sizes must be positive".into());
    }
    let smallest = config.sizes.iter().min().copied().unwrap_or(0);
    let fewest = config.batches.iter().min().copied().unwrap_or(0);
    if smallest.saturating_mul(fewest) > config.max_request_bytes {
        return invalid(format!(
            "every cell is over the limit of {} bytes per request (the smallest moves {} x {})",
            config.max_request_bytes, smallest, fewest
        ));
    }
    if config.base.rounds == 0 {
        return invalid("--rounds must be positive".into());
    }
    Ok(())
}

/// Runs the grid: one [`bench::run`] per cell within the byte limit, fresh servers each.
///
/// # Errors
///
/// A size that is not whole tokens of the grid's model, an empty list, the model file that
/// cannot be written, and whatever [`bench::run`] fails with.
pub fn run(config: &GridConfig) -> Result<Grid, DemoError> {
    check(config)?;
    let dir = match &config.export_dir {
        Some(d) => ModelDir {
            path: d.clone(),
            remove: false,
        },
        None => ModelDir {
            path: std::env::temp_dir().join(format!("kvferry-sweep-{}", std::process::id())),
            remove: true,
        },
    };
    let model_dir = dir.path.join("model");
    let written = std::fs::create_dir_all(&model_dir)
        .and_then(|()| std::fs::write(model_dir.join("config.json"), GRID_MODEL));
    written
        .map_err(|e| DemoError::Invalid(format!("cannot write {}: {e}", model_dir.display())))?;
    let shape = ModelShape::from_config_file(&model_dir.join("config.json"))
        .map_err(|e| DemoError::Invalid(format!("the grid's model: {e}")))?;

    let base = &config.base;
    let mut grid = Grid {
        model: format!("one layer, one KV head x 128, bf16 ({BYTES_PER_TOKEN} bytes per token)"),
        model_config: config
            .export_dir
            .as_ref()
            .map(|_| model_dir.join("config.json").display().to_string()),
        prefill: base.pair.ctx_spec.clone(),
        decode: base.pair.gen_spec.clone(),
        transport: base.pair.transport.to_string(),
        bounce: base.pair.bounce.to_string(),
        rounds: base.rounds,
        max_request_bytes: config.max_request_bytes,
        ..Grid::default()
    };
    for &size in &config.sizes {
        let tpb = (size / BYTES_PER_TOKEN) as u32;
        for &batch in &config.batches {
            if size.saturating_mul(batch) > config.max_request_bytes {
                grid.skipped.push([size, batch]);
                continue;
            }
            let workload = config
                .export_dir
                .as_ref()
                .map(|d| d.join(format!("{size}-{batch}.json")));
            let mut pair = base.pair.clone();
            pair.model = ModelSpec::of(shape.clone()).with_tokens_per_block(tpb);
            pair.gen_tokens_per_block = None;
            let cell = BenchConfig {
                pair,
                prompt_len: batch * u64::from(tpb),
                requests: 1,
                rounds: base.rounds,
                perftest: false,
                export_fragments: None,
                export_workload: workload.clone(),
            };
            tracing::info!(size, batch, "sweep cell");
            let report = bench::run(&cell)?;
            grid.cells
                .push(Cell::of(size, batch, tpb, workload.as_deref(), report));
        }
    }
    Ok(grid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p99_is_the_nearest_rank() {
        let hundred: Vec<f64> = (1..=100).map(|k| k as f64 * 1e-6).collect();
        let l = Latency::of(&hundred);
        assert_eq!(l.p99_us.round(), 99.0);
        assert!((l.avg_us - 50.5).abs() < 1e-9);
        // Fewer than 100 rounds: the largest.
        assert_eq!(Latency::of(&[3e-6, 1e-6, 2e-6]).p99_us.round(), 3.0);
        assert_eq!(Latency::of(&[]), Latency::default());
    }

    #[test]
    fn the_grid_model_has_the_stated_bytes_per_token() {
        let shape = ModelShape::from_hf_config(GRID_MODEL, "grid").unwrap();
        let spec = ModelSpec::of(shape).with_tokens_per_block(8);
        assert_eq!(spec.num_layers(), 1);
        assert_eq!(size_label(8 * BYTES_PER_TOKEN), "4 KiB");
        assert_eq!(size_label(4 << 20), "4 MiB");
        assert_eq!(size_label(1536), "1536 B");
    }
}
