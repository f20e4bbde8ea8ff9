//! One request between two hand-built deployments ([`crate::builder::Deploy`]), moved and
//! checked by the oracle: the slot tables such a request uses ([`request_tables`]) and the
//! request itself ([`Transfer`]).

use kvferry_planner_abi::{
    GroupKind, PlanError, RankInfo, SlotTable, TokenRange, TransferPlanner, ViewId,
};
use std::collections::BTreeMap;
use std::sync::Arc;

use super::{
    Exchange, PlannerFactory, ScenarioError, ScenarioReport, SlotAssignment, check_chunks,
    slot_tables,
};
use crate::builder::{Deploy, Model, scattered};

/// The slot tables of `info` for a request of `prompt` tokens in pools of `slots` slots.
///
/// PAGED tables are positional over the rank's local ordinals ([`super::slot_tables`]:
/// helix strides, the stale front of windowed groups masked), local ordinal `j` in slot
/// `(j × 3 + shift) % slots`, and every *global* ordinal in `holes` masked. STATE tables hold
/// slot `(shift + 2) % slots`, or nothing without `state`.
pub fn request_tables(
    info: &RankInfo,
    prompt: u64,
    slots: u64,
    shift: u64,
    holes: &[u64],
    state: bool,
) -> Vec<SlotTable> {
    let tpb = u64::from(info.page_table.tokens_per_block.max(1));
    let assignment = SlotAssignment {
        paged: scattered(prompt.div_ceil(tpb), slots, shift, &[]),
        state: ((shift + 2) % slots) as i64,
    };
    let (cp, cp_rank) = (u64::from(info.cp_size.max(1)), u64::from(info.cp_rank));
    let mut out = slot_tables(info, prompt, 0, &assignment);
    for (group, table) in info.page_table.groups.iter().zip(&mut out) {
        if group.kind == GroupKind::STATE {
            if !state {
                *table = SlotTable::new([]);
            }
            continue;
        }
        let masked: Vec<i64> = table
            .slots
            .iter()
            .enumerate()
            .map(|(j, &s)| {
                if holes.contains(&(j as u64 * cp + cp_rank)) {
                    SlotTable::HOLE
                } else {
                    s
                }
            })
            .collect();
        *table = SlotTable::from(masked);
    }
    out
}

/// One request moved from a context deployment to a generation deployment, checked by the
/// oracle: the [`Deploy`] counterpart of [`super::Scenario`].
///
/// Slot tables come from [`request_tables`] (context shift 1, generation shift 2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The model on the prefill side.
    pub ctx_model: Model,
    /// The model on the decode side (differs for e.g. MTP layers on one side).
    pub gen_model: Model,
    /// The prefill instance.
    pub ctx: Deploy,
    /// The decode instance.
    pub generation: Deploy,
    /// Prompt length in tokens.
    pub prompt: u64,
    /// The prefill DP group serving the request.
    pub ctx_dp_rank: u32,
    /// The decode DP group receiving it.
    pub gen_dp_rank: u32,
    /// Token ranges the context sends, in order (block-aligned); the last one carries the
    /// state.
    pub pieces: Vec<(u64, u64)>,
    /// Global ordinals the prefill side does not hold.
    pub ctx_holes: Vec<u64>,
    /// Global ordinals the decode side masks (cached, out of window).
    pub gen_holes: Vec<u64>,
    /// Whether the decode side has a state slot for the request.
    pub gen_state: bool,
    /// Views every receiver excludes.
    pub excluded: Vec<ViewId>,
    /// Seed of the oracle's tags.
    pub seed: u64,
}

impl Transfer {
    /// The whole prompt in one piece, every block held on both sides, DP groups 0.
    pub fn new(model: &Model, ctx: Deploy, generation: Deploy, prompt: u64) -> Self {
        Self {
            ctx_model: model.clone(),
            gen_model: model.clone(),
            ctx,
            generation,
            prompt,
            ctx_dp_rank: 0,
            gen_dp_rank: 0,
            pieces: vec![(0, prompt)],
            ctx_holes: Vec::new(),
            gen_holes: Vec::new(),
            gen_state: true,
            excluded: Vec::new(),
            seed: 0,
        }
    }

    /// Both instances' ranks, slot tables and pieces.
    ///
    /// # Errors
    ///
    /// Pieces that are empty, out of order, overlapping, past the prompt or not aligned to
    /// blocks.
    pub fn exchange(&self) -> Result<Exchange, ScenarioError> {
        let tpb = u64::from(self.ctx_model.tpb);
        let chunks: Vec<TokenRange> = self
            .pieces
            .iter()
            .map(|&(start, end)| TokenRange { start, end })
            .collect();
        let pieces = check_chunks(&chunks, self.prompt, tpb)?;
        let ctx = self.ctx.instance(&self.ctx_model);
        let generation = self.generation.instance(&self.gen_model);
        let tables = |infos: &[RankInfo], model: &Model, shift, holes: &[u64], state| {
            infos
                .iter()
                .map(|i| {
                    let t = request_tables(i, self.prompt, model.slots, shift, holes, state);
                    (i.instance_rank, t)
                })
                .collect::<BTreeMap<_, _>>()
        };
        Ok(Exchange {
            ctx_tables: tables(&ctx, &self.ctx_model, 1, &self.ctx_holes, true),
            gen_tables: tables(
                &generation,
                &self.gen_model,
                2,
                &self.gen_holes,
                self.gen_state,
            ),
            gen_excluded: generation
                .iter()
                .map(|i| (i.instance_rank, self.excluded.clone()))
                .collect(),
            ctx,
            generation,
            pieces,
            ctx_dp_rank: self.ctx_dp_rank,
            gen_dp_rank: self.gen_dp_rank,
            bounce: false,
            seed: self.seed,
            bounce_limits: Default::default(),
            memory_budget: None,
        })
    }

    /// Runs the request (see [`Exchange::run`]); byte mismatches and overlapping writes are in
    /// the report ([`ScenarioReport::is_ok`]).
    ///
    /// # Errors
    ///
    /// As [`exchange`](Self::exchange) and [`Exchange::run`].
    pub fn run(
        &self,
        ctx_planner: PlannerFactory<'_>,
        gen_planner: PlannerFactory<'_>,
    ) -> Result<ScenarioReport, ScenarioError> {
        self.exchange()?.run(ctx_planner, gen_planner)
    }

    /// Runs the request into every decode DP group in turn (one report each), the same
    /// planner type on both sides.
    ///
    /// # Errors
    ///
    /// As [`run`](Self::run).
    pub fn run_every_group<P, F>(&self, planner: F) -> Result<Vec<ScenarioReport>, ScenarioError>
    where
        P: TransferPlanner + 'static,
        F: Fn(&RankInfo) -> Result<P, PlanError>,
    {
        let factory = |info: &RankInfo| -> Result<Arc<dyn TransferPlanner>, PlanError> {
            Ok(Arc::new(planner(info)?))
        };
        (0..self.generation.dp_groups())
            .map(|dp| {
                let mut exchange = self.exchange()?;
                exchange.gen_dp_rank = dp;
                exchange.run(&factory, &factory)
            })
            .collect()
    }
}
