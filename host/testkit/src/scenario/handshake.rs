//! What an exchange's agents settle before anything is planned: both instances' planners
//! built, every receiver's `check_peer` and `targets` against prefill rank 0, every target's
//! answer back ([`Handshake`]). [`Exchange::run`] plans, moves and verifies from it; a plan-only
//! dry run (`kvferry plan` without `--verify`) plans and validates from it with no memory.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use kvferry_plan::bounce;
use kvferry_plan::{RequestSide, ValidatedPlan, plan_transfer};
use kvferry_planner_abi::ffi::RVec;
use kvferry_planner_abi::{PlanError, RankInfo, SlotTable, TransferPlanner};

use super::{
    DECODE_INSTANCE, Exchange, PREFILL_INSTANCE, PlannerFactory, ReceiverReport, ScenarioError,
    dp_group,
};

/// An [`Exchange`] once both instances' planners agree on who writes to whom (module docs of
/// [`crate::scenario`], step 3 up to the first plan): prefill rank 0's planner and every
/// receiver's built, each receiver's `check_peer` and `targets` against prefill rank 0 and its
/// bounce region ([`ReceiverReport`]), then every named prefill rank's planner built and its
/// `check_peer` and `targets` back, which must name the receiver. Made by
/// [`Exchange::handshake`].
pub struct Handshake<'a> {
    exchange: &'a Exchange,
    /// Every rank of the prefill instance, in rank order; each whose planner was built carries
    /// its planner blob.
    pub ctx: Vec<RankInfo>,
    /// Every rank of the decode instance, in rank order; each receiver carries its planner
    /// blob.
    pub generation: Vec<RankInfo>,
    /// The prefill DP group serving the request, ascending.
    pub ctx_group: Vec<u32>,
    /// The receivers: the decode DP group receiving the request, ascending.
    pub receivers: Vec<u32>,
    /// Every prefill rank some receiver targets.
    pub senders: BTreeSet<u32>,
    /// Per receiver, ascending: its targets, and the bounce region it would reserve under
    /// [`Exchange::bounce_limits`].
    pub receiving: BTreeMap<u32, ReceiverReport>,
    ctx_tables: BTreeMap<u32, &'a [SlotTable]>,
    gen_tables: BTreeMap<u32, &'a [SlotTable]>,
    ctx_planners: Planners<'a>,
}

impl fmt::Debug for Handshake<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handshake")
            .field("ctx_group", &self.ctx_group)
            .field("receivers", &self.receivers)
            .field("senders", &self.senders)
            .field("receiving", &self.receiving)
            .finish_non_exhaustive()
    }
}

impl Exchange {
    /// Builds the planners and settles the targets both ways ([`Handshake`]); nothing is
    /// planned and no memory is touched.
    ///
    /// # Errors
    ///
    /// An empty DP group, a rank of one without slot tables, any planner error or refusal
    /// (building, `describe`, `check_peer`, `targets`, `receiver_payload_bytes`), a target
    /// outside the prefill DP group, or a target that does not name its receiver back.
    pub fn handshake<'a>(
        &'a self,
        ctx_planner: PlannerFactory<'a>,
        gen_planner: PlannerFactory<'a>,
    ) -> Result<Handshake<'a>, ScenarioError> {
        let mut ctx_infos = self.ctx.clone();
        let mut gen_infos = self.generation.clone();
        let ctx_group: Vec<u32> = dp_group(&ctx_infos, self.ctx_dp_rank);
        let receivers: Vec<u32> = dp_group(&gen_infos, self.gen_dp_rank);
        if ctx_group.is_empty() || receivers.is_empty() {
            return Err(ScenarioError::Invalid(format!(
                "ctx dp group {} has {} ranks, gen dp group {} has {}",
                self.ctx_dp_rank,
                ctx_group.len(),
                self.gen_dp_rank,
                receivers.len()
            )));
        }
        fn table<'t>(
            tables: &'t BTreeMap<u32, Vec<SlotTable>>,
            side: &str,
            rank: u32,
        ) -> Result<&'t [SlotTable], ScenarioError> {
            tables.get(&rank).map(Vec::as_slice).ok_or_else(|| {
                ScenarioError::Invalid(format!("no slot tables for {side} rank {rank}"))
            })
        }
        let ctx_tables: BTreeMap<u32, &[SlotTable]> = ctx_group
            .iter()
            .map(|&r| Ok((r, table(&self.ctx_tables, PREFILL_INSTANCE, r)?)))
            .collect::<Result<_, ScenarioError>>()?;
        let gen_tables: BTreeMap<u32, &[SlotTable]> = receivers
            .iter()
            .map(|&r| Ok((r, table(&self.gen_tables, DECODE_INSTANCE, r)?)))
            .collect::<Result<_, ScenarioError>>()?;

        // Planners: prefill rank 0 (what a receiver bootstraps from) and every receiver first.
        let mut ctx_planners = Planners::new(PREFILL_INSTANCE, ctx_planner);
        let mut gen_planners = Planners::new(DECODE_INSTANCE, gen_planner);
        ctx_planners.ensure(&mut ctx_infos, 0)?;
        for &g in &receivers {
            gen_planners.ensure(&mut gen_infos, g)?;
        }
        // Per receiver: its targets, and what it would reserve to have the request bounced.
        let mut receiving: BTreeMap<u32, ReceiverReport> = BTreeMap::new();
        for &g in &receivers {
            let (me, peer) = (&gen_infos[g as usize], &ctx_infos[0]);
            let planner = gen_planners.get(g);
            planner
                .check_peer(me, peer)
                .map_err(|e| gen_planners.error(g, "check_peer of prefill rank 0", e))?;
            let t = planner
                .targets(me, peer, self.ctx_dp_rank)
                .map_err(|e| gen_planners.error(g, "targets", e))?;
            let payload_bytes = planner
                .receiver_payload_bytes(me, peer, gen_tables[&g])
                .map_err(|e| gen_planners.error(g, "receiver_payload_bytes", e))?;
            let bounce = bounce::reserve(
                &me.page_table,
                gen_tables[&g],
                payload_bytes,
                u32::try_from(t.ranks.len()).unwrap_or(u32::MAX),
                t.uniform,
                &self.bounce_limits,
            );
            if let Some(&c) = t.ranks.iter().find(|c| !ctx_group.contains(c)) {
                return Err(ScenarioError::TargetOutsideGroup {
                    gen_rank: g,
                    ctx_rank: c,
                    dp: self.ctx_dp_rank,
                });
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
                let planner = ctx_planners.get(c);
                planner.check_peer(me, peer).map_err(|e| {
                    ctx_planners.error(c, &format!("check_peer of decode rank {g}"), e)
                })?;
                let back = planner.targets(me, peer, self.gen_dp_rank).map_err(|e| {
                    ctx_planners.error(c, &format!("targets of decode rank {g}"), e)
                })?;
                if !back.ranks.contains(&g) {
                    return Err(ScenarioError::Asymmetric {
                        ctx_rank: c,
                        gen_rank: g,
                        targets: back.ranks.to_vec(),
                    });
                }
            }
        }
        Ok(Handshake {
            exchange: self,
            ctx: ctx_infos,
            generation: gen_infos,
            ctx_group,
            receivers,
            senders,
            receiving,
            ctx_tables,
            gen_tables,
            ctx_planners,
        })
    }
}

impl Handshake<'_> {
    /// Prefill rank `c` as a sender: its rank and slot tables.
    ///
    /// # Panics
    ///
    /// `c` outside [`Handshake::ctx_group`].
    pub fn sender(&self, c: u32) -> RequestSide<'_> {
        RequestSide::new(&self.ctx[c as usize], self.ctx_tables[&c])
    }

    /// Receiver `g` as a peer: its rank, slot tables and the views it neither receives nor
    /// expects ([`Exchange::gen_excluded`]).
    ///
    /// # Panics
    ///
    /// `g` outside [`Handshake::receivers`].
    pub fn receiver(&self, g: u32) -> RequestSide<'_> {
        RequestSide {
            excluded: self
                .exchange
                .gen_excluded
                .get(&g)
                .map_or(&[][..], Vec::as_slice),
            ..RequestSide::new(&self.generation[g as usize], self.gen_tables[&g])
        }
    }

    /// Whether receiver `g`'s pieces go through its bounce region: the exchange bounces
    /// ([`Exchange::bounce`]), the region passes the limits, and `g` has one writer.
    ///
    /// # Panics
    ///
    /// `g` outside [`Handshake::receivers`].
    pub fn bounces(&self, g: u32) -> bool {
        let r = &self.receiving[&g];
        self.exchange.bounce && r.bounce.is_ok() && r.targets.len() == 1
    }

    /// Prefill rank `c`'s plan of piece `k` ([`Exchange::pieces`]) into receiver `g`, as its
    /// agent plans it ([`plan_transfer`]: paired and validated against both sides' rows).
    ///
    /// # Errors
    ///
    /// [`ScenarioError::Plan`], naming the pair and the piece.
    ///
    /// # Panics
    ///
    /// `c` not a sender ([`Handshake::senders`]), `g` not a receiver, or `k` past the pieces.
    pub fn plan(&self, c: u32, g: u32, k: usize) -> Result<ValidatedPlan, ScenarioError> {
        self.plan_from(self.sender(c), c, g, k)
    }

    /// Where receiver `g` scatters piece `k` bounced from prefill rank `c`, whose `plan` of
    /// it ([`Handshake::plan`]) the sender packs: the receiver's own plan of the piece, with
    /// stand-in sources ([`bounce::stand_in_tables`]), as sorted, merged destination runs
    /// ([`bounce::scatter_runs`]), which must scatter as many bytes as `plan` packs.
    ///
    /// # Errors
    ///
    /// [`ScenarioError::Plan`] for the receiver's own plan, or [`ScenarioError::Bounce`] when
    /// the two disagree on the bytes; each names the pair and the piece.
    ///
    /// # Panics
    ///
    /// As [`Handshake::plan`].
    pub fn scatter_runs(
        &self,
        c: u32,
        g: u32,
        k: usize,
        plan: &ValidatedPlan,
    ) -> Result<Vec<(u64, u64)>, ScenarioError> {
        let info = &self.ctx[c as usize];
        let stand_in =
            bounce::stand_in_tables(&info.page_table, self.exchange.pieces[k].prompt_len);
        let own = self.plan_from(RequestSide::new(info, &stand_in), c, g, k)?;
        let runs = bounce::scatter_runs(&own);
        let scattered: u64 = runs.iter().map(|&(_, n)| n).sum();
        if scattered != plan.total_bytes() {
            return Err(ScenarioError::Bounce {
                ctx_rank: c,
                gen_rank: g,
                piece: k,
                detail: super::packs_and_scatters(plan.total_bytes(), scattered),
            });
        }
        Ok(runs)
    }

    fn plan_from(
        &self,
        sender: RequestSide<'_>,
        c: u32,
        g: u32,
        k: usize,
    ) -> Result<ValidatedPlan, ScenarioError> {
        let planner = self.ctx_planners.get(c).as_ref();
        plan_transfer(planner, sender, self.receiver(g), &self.exchange.pieces[k]).map_err(
            |source| ScenarioError::Plan {
                ctx_rank: c,
                gen_rank: g,
                piece: k,
                source,
            },
        )
    }
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

    /// The planner of `rank`, built by [`Planners::ensure`].
    fn get(&self, rank: u32) -> &Arc<dyn TransferPlanner> {
        &self.built[&rank]
    }

    fn error(&self, rank: u32, what: &str, source: PlanError) -> ScenarioError {
        ScenarioError::Planner {
            instance: self.instance,
            rank,
            what: what.to_string(),
            source,
        }
    }
}
