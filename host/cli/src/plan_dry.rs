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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use anyhow::{Result, bail};
use kvferry_plan::bounce;
use kvferry_plan::{RequestSide, ValidatedPlan, overlapping_writers, plan_transfer};
use kvferry_planner_abi::ffi::RVec;
use kvferry_planner_abi::{GroupKind, RankInfo, TransferPlanner};
use kvferry_testkit::layout::{ModelSpec, PoolOptions, build_instance, bytes_text};
use kvferry_testkit::oracle::LocalMemory;
use kvferry_testkit::scenario::{
    DECODE_INSTANCE, Exchange, MemoryBudget, PREFILL_INSTANCE, PlannerFactory, ReceiverReport,
    Scenario, ScenarioError,
};

/// What the output says in place of the oracle's verdict.
pub const NOT_MOVED: &str =
    "dry run: plans validated, bytes not moved; --verify to move and check every byte";

/// Bytes of one described row (its ordinal and its address, `u64` each).
const ROW_BYTES: u64 = 16;

/// Traffic of one (sender, receiver) pair over every piece, as planned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DryPair {
    /// Prefill rank.
    pub src_rank: u32,
    /// Decode rank.
    pub dst_rank: u32,
    /// Pieces planned.
    pub pieces: usize,
    /// Fragments after coalescing.
    pub fragments: usize,
    /// Fragments the planner returned.
    pub planned_fragments: usize,
    /// Patterns of the planner's compressed plans, all pieces; `None` when a piece's plan was
    /// flat.
    pub patterns: Option<usize>,
    /// Bytes the plans move.
    pub bytes: u64,
    /// Pieces that would go through the receiver's bounce region.
    pub bounced: usize,
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
        self.pairs.iter().map(|p| p.fragments).sum()
    }

    /// Fragments the planners returned, all pairs.
    pub fn planned_fragments(&self) -> usize {
        self.pairs.iter().map(|p| p.planned_fragments).sum()
    }

    /// Patterns, all pairs; `None` when any plan was flat.
    pub fn patterns(&self) -> Option<usize> {
        self.pairs.iter().map(|p| p.patterns).sum()
    }

    /// Bytes, all pairs.
    pub fn bytes(&self) -> u64 {
        self.pairs.iter().map(|p| p.bytes).sum()
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

/// PAGED slots of each pool of a side, as [`Scenario::exchange`] sizes them.
fn paged_slots(prompt_len: u64, tokens_per_block: u32) -> u64 {
    let blocks = prompt_len.div_ceil(u64::from(tokens_per_block.max(1)));
    blocks.saturating_add(2 + blocks / 16)
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
    let tpb = s.model.tokens_per_block;
    let sized_by = match s.gen_tokens_per_block {
        Some(g) => format!("--ctx-tokens-per-block {tpb} --gen-tokens-per-block {g}"),
        None => format!("--tokens-per-block {tpb}"),
    };
    bail!(
        "--prompt-len {} with {sized_by} cannot be planned here: its slot tables and the rows \
         the planner reads would take about {}; {}",
        s.prompt_len,
        bytes_text(u128::from(needed)),
        budget.available
    )
}

/// Refuses a request whose dry run would not fit `budget`, from the two instances' layout
/// alone (before the slot tables, sized by the prompt, are made). Layout refusals are
/// [`ScenarioError::Layout`], as [`Scenario::exchange`] returns them.
pub fn check_before_layout(s: &Scenario, budget: Option<&MemoryBudget>) -> Result<()> {
    let Some(budget) = budget else {
        return Ok(());
    };
    // Parameters the scenario refuses are left to it, with its words.
    if s.model.tokens_per_block == 0 || s.gen_tokens_per_block == Some(0) {
        return Ok(());
    }
    let gen_model = s.gen_model();
    let mut space = LocalMemory::new();
    let mut lay_out =
        |model: &ModelSpec, mapping, name: &str| -> Result<Vec<RankInfo>, ScenarioError> {
            let options = PoolOptions {
                paged_slots: paged_slots(s.prompt_len, model.tokens_per_block),
                state_slots: 2,
                ..PoolOptions::default()
            };
            let mut alloc = |rank: u32, pool: usize, bytes: u64| {
                space.reserve(bytes, format!("{name} rank {rank} pool {pool}"))
            };
            Ok(build_instance(
                model,
                mapping,
                name,
                &s.planner_id,
                &options,
                &mut alloc,
            )?)
        };
    let ctx = lay_out(&s.model, &s.ctx_mapping, PREFILL_INSTANCE)?;
    let generation = lay_out(&gen_model, &s.gen_mapping, DECODE_INSTANCE)?;
    check_budget(Some(budget), estimate(&ctx, &generation, s, 1, 1), s)
}

/// Planners of one instance, built on first use; building stamps the rank's planner blob.
struct Planners<'a> {
    instance: &'static str,
    factory: PlannerFactory<'a>,
    built: BTreeMap<u32, Arc<dyn TransferPlanner>>,
}

impl<'a> Planners<'a> {
    fn new(instance: &'static str, factory: PlannerFactory<'a>) -> Self {
        Self {
            instance,
            factory,
            built: BTreeMap::new(),
        }
    }

    fn ensure(&mut self, infos: &mut [RankInfo], rank: u32) -> Result<(), ScenarioError> {
        if self.built.contains_key(&rank) {
            return Ok(());
        }
        let info = infos.get_mut(rank as usize).ok_or_else(|| {
            ScenarioError::Invalid(format!("{} has no rank {rank}", self.instance))
        })?;
        let planner =
            (self.factory)(info).map_err(|e| self.error(rank, "building the planner", e))?;
        let blob = planner
            .describe()
            .map_err(|e| self.error(rank, "describe", e))?;
        info.planner_blob = RVec::from(blob);
        self.built.insert(rank, planner);
        Ok(())
    }

    fn get(&self, rank: u32) -> Result<&dyn TransferPlanner, ScenarioError> {
        self.built.get(&rank).map(|p| p.as_ref()).ok_or_else(|| {
            ScenarioError::Invalid(format!("no planner for {} rank {rank}", self.instance))
        })
    }

    fn error(
        &self,
        rank: u32,
        what: &str,
        source: kvferry_planner_abi::PlanError,
    ) -> ScenarioError {
        ScenarioError::Planner {
            instance: self.instance,
            rank,
            what: what.to_string(),
            source,
        }
    }
}

/// Ranks of the DP group `dp_rank`.
fn dp_group(infos: &[RankInfo], dp_rank: u32) -> Vec<u32> {
    infos
        .iter()
        .filter(|i| i.dp_rank == dp_rank)
        .map(|i| i.instance_rank)
        .collect()
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
    let mut ctx_infos = exchange.ctx.clone();
    let mut gen_infos = exchange.generation.clone();
    let ctx_group = dp_group(&ctx_infos, exchange.ctx_dp_rank);
    let receivers = dp_group(&gen_infos, exchange.gen_dp_rank);
    if ctx_group.is_empty() || receivers.is_empty() {
        return Err(ScenarioError::Invalid(format!(
            "ctx dp group {} has {} ranks, gen dp group {} has {}",
            exchange.ctx_dp_rank,
            ctx_group.len(),
            exchange.gen_dp_rank,
            receivers.len()
        ))
        .into());
    }
    // Every rank of a DP group needs its tables, as the oracle's run requires.
    let missing = ctx_group
        .iter()
        .filter(|c| !exchange.ctx_tables.contains_key(c))
        .map(|&c| (PREFILL_INSTANCE, c))
        .chain(
            receivers
                .iter()
                .filter(|g| !exchange.gen_tables.contains_key(g))
                .map(|&g| (DECODE_INSTANCE, g)),
        )
        .next();
    if let Some((side, rank)) = missing {
        return Err(
            ScenarioError::Invalid(format!("no slot tables for {side} rank {rank}")).into(),
        );
    }
    let ctx_tables = &exchange.ctx_tables;
    let gen_tables = &exchange.gen_tables;
    let excluded = |g: u32| exchange.gen_excluded.get(&g).map_or(&[][..], Vec::as_slice);

    let mut ctx_planners = Planners::new(PREFILL_INSTANCE, ctx_planner);
    let mut gen_planners = Planners::new(DECODE_INSTANCE, gen_planner);
    ctx_planners.ensure(&mut ctx_infos, 0)?;
    for &g in &receivers {
        gen_planners.ensure(&mut gen_infos, g)?;
    }
    let mut receiving: BTreeMap<u32, ReceiverReport> = BTreeMap::new();
    for &g in &receivers {
        let (me, peer) = (&gen_infos[g as usize], &ctx_infos[0]);
        let planner = gen_planners.get(g)?;
        planner
            .check_peer(me, peer)
            .map_err(|e| gen_planners.error(g, "check_peer of prefill rank 0", e))?;
        let t = planner
            .targets(me, peer, exchange.ctx_dp_rank)
            .map_err(|e| gen_planners.error(g, "targets", e))?;
        let tables = &gen_tables[&g];
        let payload_bytes = planner
            .receiver_payload_bytes(me, peer, tables)
            .map_err(|e| gen_planners.error(g, "receiver_payload_bytes", e))?;
        let bounce = bounce::reserve(
            &me.page_table,
            tables,
            payload_bytes,
            u32::try_from(t.ranks.len()).unwrap_or(u32::MAX),
            t.uniform,
            &exchange.bounce_limits,
        );
        if let Some(&c) = t.ranks.iter().find(|c| !ctx_group.contains(c)) {
            return Err(ScenarioError::TargetOutsideGroup {
                gen_rank: g,
                ctx_rank: c,
                dp: exchange.ctx_dp_rank,
            }
            .into());
        }
        receiving.insert(
            g,
            ReceiverReport {
                rank: g,
                expected_transfers: t.ranks.len(),
                targets: t.ranks.to_vec(),
                uniform: t.uniform,
                payload_bytes,
                bounce,
            },
        );
    }
    let senders: BTreeSet<u32> = receiving
        .values()
        .flat_map(|r| r.targets.iter().copied())
        .collect();
    for &c in &senders {
        ctx_planners.ensure(&mut ctx_infos, c)?;
    }
    for (&g, r) in &receiving {
        for &c in &r.targets {
            let (me, peer) = (&ctx_infos[c as usize], &gen_infos[g as usize]);
            let planner = ctx_planners.get(c)?;
            planner
                .check_peer(me, peer)
                .map_err(|e| ctx_planners.error(c, &format!("check_peer of decode rank {g}"), e))?;
            let back = planner
                .targets(me, peer, exchange.gen_dp_rank)
                .map_err(|e| ctx_planners.error(c, &format!("targets of decode rank {g}"), e))?;
            if !back.ranks.contains(&g) {
                return Err(ScenarioError::Asymmetric {
                    ctx_rank: c,
                    gen_rank: g,
                    targets: back.ranks.to_vec(),
                }
                .into());
            }
        }
    }
    let writers = receiving
        .values()
        .map(|r| r.targets.len() as u64)
        .max()
        .unwrap_or(0);
    check_budget(
        budget,
        estimate(
            &ctx_infos,
            &gen_infos,
            s,
            writers,
            exchange.pieces.len() as u64,
        ),
        s,
    )?;

    let total_pairs: usize = receiving.values().map(|r| r.targets.len()).sum();
    let mut report = DryRun::default();
    for (&g, r) in &receiving {
        report.receivers.push(r.clone());
        let receiver = RequestSide {
            excluded: excluded(g),
            ..RequestSide::new(&gen_infos[g as usize], &gen_tables[&g])
        };
        // Every plan into `g` with its (sender, piece), for the overlap check.
        let mut plans: Vec<(u32, usize, ValidatedPlan)> = Vec::new();
        let holds = r.targets.len() * exchange.pieces.len() > 1;
        for &c in &r.targets {
            on_pair(report.pairs.len(), total_pairs, c, g);
            let planner = ctx_planners.get(c)?;
            let sender = RequestSide::new(&ctx_infos[c as usize], &ctx_tables[&c]);
            let mut pair = DryPair {
                src_rank: c,
                dst_rank: g,
                patterns: Some(0),
                ..DryPair::default()
            };
            for (k, piece) in exchange.pieces.iter().enumerate() {
                let plan_from = |sender: RequestSide<'_>| {
                    plan_transfer(planner, sender, receiver, piece).map_err(|source| {
                        ScenarioError::Plan {
                            ctx_rank: c,
                            gen_rank: g,
                            piece: k,
                            source,
                        }
                    })
                };
                let plan = plan_from(sender)?;
                let bounced = exchange.bounce && r.bounce.is_ok() && r.targets.len() == 1;
                if bounced {
                    // The receiver's own plan of the piece scatters what the sender packs:
                    // the two must agree on the bytes.
                    let stand_in = bounce::stand_in_tables(
                        &ctx_infos[c as usize].page_table,
                        piece.prompt_len,
                    );
                    let own = plan_from(RequestSide::new(&ctx_infos[c as usize], &stand_in))?;
                    let scattered: u64 = bounce::scatter_runs(&own).iter().map(|&(_, n)| n).sum();
                    if scattered != plan.total_bytes() {
                        return Err(ScenarioError::Bounce {
                            ctx_rank: c,
                            gen_rank: g,
                            piece: k,
                            detail: format!(
                                "the sender's plan packs {} bytes, the receiver's own plan of \
                                 the piece scatters {scattered}",
                                plan.total_bytes()
                            ),
                        }
                        .into());
                    }
                    pair.bounced += 1;
                }
                pair.pieces += 1;
                pair.fragments += plan.len();
                pair.planned_fragments += plan.planned_fragments();
                pair.bytes += plan.total_bytes();
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
