//! `kvferry plan`: one request between two instances, planned pair by pair from the page
//! tables alone ([`dry`]) or, with `--verify`, moved and checked byte by byte by the testkit's
//! oracle ([`Exchange::run`]); both print the same header and report the same way
//! ([`PlanOutcome`]).

mod dry;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use kvferry_harness::demo;
use kvferry_plan::bounce::BounceLimits;
use kvferry_planner_abi::{Mapping, PlanError, RankInfo, TokenRange, TransferPlanner};
use kvferry_testkit::layout::{LayoutError, ModelSpec};
use kvferry_testkit::scenario::{
    Exchange, MemoryBudget, PairReport, PlannerFactory, ReceiverReport, Scenario, ScenarioError,
};
use kvferry_testkit::units;
use serde_json::json;

use crate::progress::Progress;
use crate::{Host, check_width, memory_budget};
use dry::DryPair;

/// What `kvferry plan` was asked, its flags resolved.
pub(crate) struct PlanArgs {
    /// The prefill side's model.
    pub model: ModelSpec,
    /// The decode side's block size, when it differs.
    pub gen_tokens_per_block: Option<u32>,
    pub prefill: Mapping,
    pub decode: Mapping,
    pub prompt_len: u64,
    pub ctx_dp_rank: u32,
    pub gen_dp_rank: u32,
    pub chunk: Option<u64>,
    pub cached: u64,
    pub seed: u64,
    pub contiguous: bool,
    pub bounce: BounceLimits,
    /// Move single-writer receivers' pieces through their regions (`--bounce` on or auto).
    pub bounced: bool,
    pub planner: Option<String>,
    /// Move and check every byte (the oracle) instead of planning alone.
    pub verify: bool,
    pub json: bool,
}

impl PlanArgs {
    /// What the spinner says: `planning tp4 -> tp8 for 512 tokens`.
    fn planning(&self) -> String {
        format!(
            "planning {} -> {} for {} tokens",
            self.prefill, self.decode, self.prompt_len
        )
    }

    /// A spinner saying `message` once the command has run [`PROGRESS_AFTER`] (on a
    /// terminal, and not with `--json`).
    fn spinner(&self, message: String) -> Progress {
        Progress::spinner_after(!self.json, PROGRESS_AFTER, message)
    }
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
    let context = format!(
        "{} cannot fit",
        sized_by(
            a.prompt_len,
            a.model.tokens_per_block,
            a.gen_tokens_per_block
        )
    );
    if let ScenarioError::Memory {
        ranks,
        needed,
        budget,
    } = &e
    {
        // In binary units beside the budget ([`crate::memory_budget`]); the hint goes after
        // the numbers, which tests and people read first.
        return anyhow!(
            "{context}: backing the pools of {ranks} needs {}; {}; drop --verify to plan it \
             from the page tables alone, with no pools",
            units::bytes(*needed),
            budget.available
        );
    }
    anyhow::Error::new(e).context(context)
}

/// The flags that size a request, for a refusal: `--prompt-len N with --tokens-per-block T`
/// (both block sizes when the sides differ).
fn sized_by(prompt_len: u64, tokens_per_block: u32, gen_tokens_per_block: Option<u32>) -> String {
    let tpb = tokens_per_block;
    let blocks = match gen_tokens_per_block {
        Some(g) => format!("--ctx-tokens-per-block {tpb} --gen-tokens-per-block {g}"),
        None => format!("--tokens-per-block {tpb}"),
    };
    format!("--prompt-len {prompt_len} with {blocks}")
}

/// [`plan_error`] for a [`ScenarioError`] inside `e`; any other error as it is.
fn plan_failure(e: anyhow::Error, a: &PlanArgs) -> anyhow::Error {
    match e.downcast::<ScenarioError>() {
        Ok(e) => plan_error(e, a),
        Err(e) => e,
    }
}

/// `kvferry plan`: binds the planner on both sides, lays the request out, then plans it
/// ([`dry`]) or, with `--verify`, moves and checks every byte ([`plan_verified`]).
pub(crate) fn plan(host: &Host, a: PlanArgs) -> Result<ExitCode> {
    check_width("--ctx", &a.prefill)?;
    check_width("--gen", &a.decode)?;
    let id = host.planner_id(a.planner.as_deref());
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
    let ctx_bound = host
        .bind(&id, &scenario.model, a.prefill)
        .context("prefill instance")?;
    // A deployment is the architecture and the mapping: the same on both sides, it is bound
    // (and logged) once.
    let gen_bound = if a.decode == a.prefill {
        ctx_bound.clone()
    } else {
        host.bind(&id, &scenario.gen_model(), a.decode)
            .context("decode instance")?
    };
    if ctx_bound.id() != gen_bound.id() {
        bail!(
            "the prefill instance binds {} and the decode instance binds {}: two servers \
             that select different planners refuse each other (name one with --planner)",
            ctx_bound.id(),
            gen_bound.id()
        );
    }
    let budget = memory_budget();
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
        dry::check_before_layout(&scenario, budget.as_ref()).map_err(|e| plan_failure(e, &a))?;
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

/// The JSON of one (sender, receiver) pair: what both runs count of it.
fn pair_json(p: &PairReport) -> serde_json::Value {
    json!({
        "src_rank": p.src_rank,
        "dst_rank": p.dst_rank,
        "fragments": p.fragments,
        "planned_fragments": p.planned_fragments,
        "bytes": p.bytes,
        "bounced_pieces": p.bounced,
    })
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
    let progress = a.spinner(format!("{} and checking every byte", a.planning()));
    let run = exchange.run(ctx_factory, gen_factory);
    progress.finish();
    let mut report = run.map_err(|e| plan_error(e, a))?;
    report.timings.setup += layout;
    let verified = report.is_ok();
    let pairs: Vec<_> = report.pairs.iter().map(pair_json).collect();
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
    dry::mean_fragment(bytes, fragments).map_or(String::new(), |m| {
        format!(", mean fragment {}", units::bytes(m))
    })
}

/// `kvferry plan` without `--verify`: every pair planned and validated from the page tables
/// alone, counted, nothing backed or moved ([`dry::run`]).
fn plan_dry_run(
    a: &PlanArgs,
    scenario: &Scenario,
    exchange: &Exchange,
    ctx_factory: PlannerFactory<'_>,
    gen_factory: PlannerFactory<'_>,
    budget: Option<&MemoryBudget>,
) -> Result<PlanOutcome> {
    let progress = a.spinner(a.planning());
    let run = dry::run(
        scenario,
        exchange,
        ctx_factory,
        gen_factory,
        budget,
        &|i, n, c, g| {
            progress.set_message(format!(
                "{}: ctx {c} -> gen {g}, pair {} of {n}",
                a.planning(),
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
            let (counts, mut pair) = (&p.counts, pair_json(&p.counts));
            if let Some(pair) = pair.as_object_mut() {
                pair.extend(object(json!({
                    "pieces": counts.pieces,
                    "patterns": p.patterns,
                    "mean_fragment_bytes": dry::mean_fragment(counts.bytes, counts.fragments),
                })));
            }
            pair
        })
        .collect();
    let json = json!({
        "pairs": pairs,
        "receivers": receivers_json(&report.receivers),
        "total_fragments": report.fragments(),
        "total_planned_fragments": report.planned_fragments(),
        "total_patterns": report.patterns(),
        "total_bytes": report.bytes(),
        "mean_fragment_bytes": dry::mean_fragment(report.bytes(), report.fragments()),
        "overlapping_writes": report.overlaps.len(),
        "overlaps": report.overlaps,
        "verified": false,
        "verify": dry::NOT_MOVED,
    });
    // The receivers in the oracle's report's words.
    let mut text = String::new();
    for r in &report.receivers {
        text.push_str(&format!("{r}\n"));
    }
    let patterns = |p: Option<usize>| p.map_or(String::new(), |n| format!(", {n} patterns"));
    for DryPair {
        counts: p,
        patterns: pattern_count,
    } in &report.pairs
    {
        text.push_str(&format!(
            "ctx {} -> gen {}: {} pieces, {} fragments ({} planned{}), {}{}{}\n",
            p.src_rank,
            p.dst_rank,
            p.pieces,
            p.fragments,
            p.planned_fragments,
            patterns(*pattern_count),
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
    text.push_str(&format!("{}\n", dry::NOT_MOVED));
    Ok(PlanOutcome {
        ok: report.is_ok(),
        json: object(json),
        text,
    })
}

/// How long `plan` runs before it shows its spinner (on a terminal).
const PROGRESS_AFTER: Duration = Duration::from_secs(2);
