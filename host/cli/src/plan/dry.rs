//! `kvferry plan` without `--verify`: one request planned from the two instances' page tables
//! alone. Every pair the planners target is planned piece by piece and validated against both
//! sides' described rows, exactly as the agents plan it; nothing is backed, tagged or copied
//! (the pools sit at made-up addresses, which is all planning and validation read), so the
//! cost is the planner's and the validator's, not the pools'.
//!
//! What it checks is what an agent checks before a byte moves: the planners' `check_peer` and
//! `targets` on both sides, every fragment inside both sides' rows, no destination byte
//! written twice by one plan, none written by two plans into one receiver (writers and pieces
//! alike, [`kvferry_plan::overlapping_writers`]) and, for bounced pieces, the sender's packed
//! image the same size as the receiver's own plan of the piece. What only `--verify` checks is
//! that the bytes land where the model says they belong (the oracle's tags).

use anyhow::{Result, bail};
use kvferry_plan::{ValidatedPlan, overlapping_writers};
use kvferry_planner_abi::{GroupKind, RankInfo};
use kvferry_testkit::scenario::{
    Exchange, MemoryBudget, PairReport, PlannerFactory, ReceiverReport, Scenario, paged_slots,
};
use kvferry_testkit::units;

/// What the output says in place of the oracle's verdict.
pub const NOT_MOVED: &str =
    "dry run: plans validated, bytes not moved; --verify to move and check every byte";

/// Bytes of one described row (its ordinal and its address, `u64` each).
const ROW_BYTES: u64 = 16;

/// Traffic of one (sender, receiver) pair over every piece, as planned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DryPair {
    /// The pair, its pieces, fragments and bytes, and the pieces that would go through the
    /// receiver's bounce region, counted as `--verify` counts them.
    pub counts: PairReport,
    /// Patterns of the planner's compressed plans, all pieces; `None` when a piece's plan was
    /// flat.
    pub patterns: Option<usize>,
}

/// Mean bytes per fragment, `None` without fragments.
pub fn mean_fragment(bytes: u64, fragments: usize) -> Option<u64> {
    (fragments > 0).then(|| bytes / fragments as u64)
}

/// What a dry run planned and found.
#[derive(Clone, Debug, Default)]
pub struct DryRun {
    /// Per (sender, receiver) pair, receivers ascending, senders in target order.
    pub pairs: Vec<DryPair>,
    /// Per receiver, ascending.
    pub receivers: Vec<ReceiverReport>,
    /// Two plans into one receiver that write the same bytes: the first found per receiver.
    pub overlaps: Vec<String>,
}

impl DryRun {
    /// Fragments after coalescing, all pairs.
    pub fn fragments(&self) -> usize {
        self.pairs.iter().map(|p| p.counts.fragments).sum()
    }

    /// Fragments the planners returned, all pairs.
    pub fn planned_fragments(&self) -> usize {
        self.pairs.iter().map(|p| p.counts.planned_fragments).sum()
    }

    /// Patterns, all pairs; `None` when any plan was flat.
    pub fn patterns(&self) -> Option<usize> {
        self.pairs.iter().map(|p| p.patterns).sum()
    }

    /// Bytes, all pairs.
    pub fn bytes(&self) -> u64 {
        self.pairs.iter().map(|p| p.counts.bytes).sum()
    }

    /// Whether no receiver has two plans writing the same bytes.
    pub fn is_ok(&self) -> bool {
        self.overlaps.is_empty()
    }
}

/// Memory a dry run holds at its peak, estimated from the page tables before anything sized
/// by the prompt is made: the slot placements and tables, the rows both sides of one pair
/// describe, and the compressed plans a receiver's overlap check holds (`writers` of them).
/// A planner that answers with flat plans holds more (a fragment is 24 bytes).
fn estimate(
    ctx: &[RankInfo],
    generation: &[RankInfo],
    s: &Scenario,
    writers: u64,
    pieces: u64,
) -> u64 {
    let side = |infos: &[RankInfo], dp: u32| {
        let group: Vec<&RankInfo> = infos.iter().filter(|i| i.dp_rank == dp).collect();
        let tables: u64 = group
            .iter()
            .map(|i| paged_rows(i, s.prompt_len, false))
            .sum();
        let rows = group
            .iter()
            .map(|i| paged_rows(i, s.prompt_len, true))
            .max()
            .unwrap_or(0);
        // Each side's slot placement: every slot of its pools, shuffled.
        let slots = group.first().map_or(0, |i| {
            paged_slots(s.prompt_len, i.page_table.tokens_per_block)
        });
        (
            slots.saturating_add(tables).saturating_mul(8),
            rows.saturating_mul(ROW_BYTES),
        )
    };
    let (ctx_fixed, ctx_rows) = side(ctx, s.ctx_dp_rank);
    let (gen_fixed, gen_rows) = side(generation, s.gen_dp_rank);
    // Planning one piece: both sides' rows, the plan's row pairs (two `u32`) and their
    // addresses (two `u64`), and the copy its patterns are counted from.
    let pair = ctx_rows
        .saturating_add(gen_rows)
        .saturating_mul(2)
        .saturating_add(gen_rows.saturating_mul(3));
    // Every plan into one receiver, held for the overlap check, and its map of rows.
    let plans = writers.saturating_mul(pieces);
    let held = if plans > 1 {
        gen_rows
            .saturating_mul(writers.saturating_mul(3) / 2)
            .saturating_add(gen_rows.saturating_mul(4))
    } else {
        0
    };
    ctx_fixed
        .saturating_add(gen_fixed)
        .saturating_add(pair)
        .saturating_add(held)
}

/// Blocks `info` holds of the prompt, per PAGED group (its slot tables' entries), times its
/// views when `per_view` (the rows it describes).
fn paged_rows(info: &RankInfo, prompt_len: u64, per_view: bool) -> u64 {
    let pt = &info.page_table;
    let blocks = prompt_len.div_ceil(u64::from(pt.tokens_per_block.max(1)));
    let (cp, cp_rank) = (u64::from(info.cp_size.max(1)), u64::from(info.cp_rank));
    let local = blocks.saturating_sub(cp_rank).div_ceil(cp);
    pt.groups
        .iter()
        .map(|g| {
            let per_slot = if per_view { g.views.len() as u64 } else { 1 };
            let slots = if g.kind == GroupKind::STATE { 1 } else { local };
            slots.saturating_mul(per_slot)
        })
        .fold(0u64, u64::saturating_add)
}

/// Refuses a dry run estimated at `needed` bytes beyond `budget`.
fn check_budget(budget: Option<&MemoryBudget>, needed: u64, s: &Scenario) -> Result<()> {
    let Some(budget) = budget else {
        return Ok(());
    };
    if needed <= budget.bytes {
        return Ok(());
    }
    bail!(
        "{} cannot be planned here: its slot tables and the rows the planner reads would take \
         about {}; {}",
        super::sized_by(
            s.prompt_len,
            s.model.tokens_per_block,
            s.gen_tokens_per_block
        ),
        units::bytes(needed),
        budget.available
    )
}

/// Refuses a request whose dry run would not fit `budget`, from the two instances' layout
/// alone (before the slot tables, sized by the prompt, are made). Layout refusals are
/// [`kvferry_testkit::scenario::ScenarioError::Layout`], as [`Scenario::exchange`] returns
/// them.
pub fn check_before_layout(s: &Scenario, budget: Option<&MemoryBudget>) -> Result<()> {
    let Some(budget) = budget else {
        return Ok(());
    };
    // Parameters the scenario refuses are left to it, with its words.
    if s.model.tokens_per_block == 0 || s.gen_tokens_per_block == Some(0) {
        return Ok(());
    }
    let (ctx, generation) = s.lay_out()?;
    check_budget(Some(budget), estimate(&ctx, &generation, s, 1, 1), s)
}

/// Plans `exchange` as its agents would, without memory: see the module docs. `on_pair` is
/// told each pair as its planning starts (`(index, pairs, sender, receiver)`).
///
/// # Errors
///
/// What [`Exchange::run`] refuses before it moves a byte, with the same errors (an empty DP
/// group, a rank without slot tables, a planner error or refusal, targets outside the DP
/// group or not symmetric, a rejected plan, a bounced piece whose sizes disagree), and a
/// request whose planning would not fit `budget` once the writers are known.
pub fn run(
    s: &Scenario,
    exchange: &Exchange,
    ctx_planner: PlannerFactory<'_>,
    gen_planner: PlannerFactory<'_>,
    budget: Option<&MemoryBudget>,
    on_pair: &dyn Fn(usize, usize, u32, u32),
) -> Result<DryRun> {
    let agreed = exchange.handshake(ctx_planner, gen_planner)?;
    let receiving = &agreed.receiving;
    let writers = receiving
        .values()
        .map(|r| r.targets.len() as u64)
        .max()
        .unwrap_or(0);
    check_budget(
        budget,
        estimate(
            &agreed.ctx,
            &agreed.generation,
            s,
            writers,
            exchange.pieces.len() as u64,
        ),
        s,
    )?;

    let total_pairs: usize = receiving.values().map(|r| r.targets.len()).sum();
    let mut report = DryRun::default();
    for (&g, r) in receiving {
        report.receivers.push(r.clone());
        // Every plan into `g` with its (sender, piece), for the overlap check.
        let mut plans: Vec<(u32, usize, ValidatedPlan)> = Vec::new();
        let holds = r.targets.len() * exchange.pieces.len() > 1;
        for &c in &r.targets {
            on_pair(report.pairs.len(), total_pairs, c, g);
            let mut pair = DryPair {
                counts: PairReport::new(c, g),
                patterns: Some(0),
            };
            for k in 0..exchange.pieces.len() {
                let plan = agreed.plan(c, g, k)?;
                if agreed.bounces(g) {
                    // The receiver's own plan of the piece scatters what the sender packs:
                    // the two must agree on the bytes.
                    agreed.scatter_runs(c, g, k, &plan)?;
                    pair.counts.bounced += 1;
                }
                pair.counts.count(&plan);
                pair.patterns = match pair.patterns {
                    Some(n) if plan.is_compressed() => Some(n + plan.patterns().len()),
                    _ => None,
                };
                if holds {
                    plans.push((c, k, plan));
                }
            }
            report.pairs.push(pair);
        }
        let refs: Vec<&ValidatedPlan> = plans.iter().map(|(_, _, p)| p).collect();
        if let Some(o) = overlapping_writers(&refs) {
            let (c1, k1, _) = &plans[o.first];
            let (c2, k2, _) = &plans[o.second];
            report.overlaps.push(format!(
                "decode rank {g}: ctx {c1} piece {k1} and ctx {c2} piece {k2} both write {:#x} +{}",
                o.address, o.len
            ));
        }
    }
    Ok(report)
}
