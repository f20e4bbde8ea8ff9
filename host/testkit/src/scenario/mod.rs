//! One request end to end, in process: build both instances, plan every pair, move the bytes,
//! verify every byte.
//!
//! A [`Scenario`] names a model, the prefill and decode mappings, a prompt and the DP
//! ranks serving it. [`Scenario::run`] then does what the two servers would do:
//!
//! 1. builds both instances' [`RankInfo`]s, their pools at addresses a [`LocalMemory`] hands
//!    out (pools sized to the request: `ceil(prompt_len / tpb)` plus slack PAGED slots, 2
//!    STATE slots);
//! 2. builds slot tables ([`slot_tables`]): PAGED tables are positional, with the stale front
//!    of windowed groups (`stale_end = max(0, (prompt_len + 1 − window) // tpb)` ordinals) and,
//!    on the receiver, the cached prefix masked to `-1`; STATE tables hold one slot;
//! 3. backs the pools of the ranks that take part, fills the senders' with tags and primes the
//!    receivers' with the canary; for every receiver rank (the decode ranks of `gen_dp_rank`'s DP group, over PP and
//!    CP): runs the generation planner's `check_peer` and `targets` against prefill rank 0,
//!    then for every target prefill rank its `check_peer` and `targets` back (which must name
//!    the receiver), and for every piece [`kvferry_plan::plan_transfer`] and
//!    [`LocalMemory::execute`];
//! 4. checks every byte with [`Oracle::verify`], and that no two writes into a receiver
//!    overlap (each destination byte has one writer over the whole request).
//!
//! Only ranks that take part get memory. Everything is deterministic for a seed.
//!
//! Steps 3 and 4 are [`Exchange::run`]: both instances' ranks, slot tables and pieces, of any
//! shape. [`Scenario::exchange`] builds an [`Exchange`] from a preset,
//! [`Transfer::exchange`] from hand-built deployments, and a test may edit
//! one before running it. Step 3 up to the first plan (planners, `check_peer` and `targets`
//! both ways) is [`Exchange::handshake`], which planning without memory shares
//! ([`Handshake`]: `kvferry plan` without `--verify`).

mod built;
mod handshake;
pub use built::{Transfer, request_tables};
pub use handshake::Handshake;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_planner_abi::{
    GroupKind, Mapping, PairRequest, PlanError, RankInfo, SlotTable, TokenRange, TransferPlanner,
    ViewId,
};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::layout::{LayoutError, ModelSpec, PoolOptions, build_instance};
use crate::oracle::{Delivery, LocalMemory, Oracle, OracleError, VerifyReport};
use kvferry_plan::bounce::{self, BounceLimits, BounceSkip, Reservation};
use kvferry_plan::{PlanFailure, RequestSide};

/// Instance name of the prefill side.
pub const PREFILL_INSTANCE: &str = "prefill";
/// Instance name of the decode side.
pub const DECODE_INSTANCE: &str = "decode";
/// Bytes of padding after every slot of a padded scenario.
pub const PADDING_BYTES: u64 = 4096;
/// STATE slots per STATE pool.
const STATE_SLOTS: u64 = 2;
/// Overlapping writes kept in a report.
const MAX_OVERLAPS_KEPT: usize = 8;

/// Builds the planner of one rank.
pub type PlannerFactory<'a> = &'a dyn Fn(&RankInfo) -> Result<Arc<dyn TransferPlanner>, PlanError>;

/// Why a scenario could not run to verification.
///
/// Each message names where it failed; the planner's, planning's or memory's error is the
/// `source()`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScenarioError {
    /// The scenario's parameters contradict each other.
    #[error("scenario: {0}")]
    Invalid(String),
    /// An instance could not be laid out.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A planner call (construction, describe, check_peer, targets) failed.
    #[error("{instance} rank {rank}: {what} failed")]
    Planner {
        /// The rank's instance.
        instance: &'static str,
        /// The rank.
        rank: u32,
        /// The call, e.g. `check_peer of decode rank 3`.
        what: String,
        /// The planner's error.
        source: PlanError,
    },
    /// A receiver's targets name a rank outside the prefill DP group.
    #[error(
        "decode rank {gen_rank} targets prefill rank {ctx_rank}, which is not in ctx dp group {dp}"
    )]
    TargetOutsideGroup {
        /// The receiver.
        gen_rank: u32,
        /// The named prefill rank.
        ctx_rank: u32,
        /// The prefill DP rank of the request.
        dp: u32,
    },
    /// A prefill rank's targets do not name the receiver that targets it.
    #[error(
        "prefill rank {ctx_rank} does not target decode rank {gen_rank} back (it targets {targets:?})"
    )]
    Asymmetric {
        /// The prefill rank.
        ctx_rank: u32,
        /// The receiver.
        gen_rank: u32,
        /// What the prefill rank targets.
        targets: Vec<u32>,
    },
    /// Planning one piece failed.
    #[error("prefill rank {ctx_rank} -> decode rank {gen_rank}, piece {piece}")]
    Plan {
        /// The sender.
        ctx_rank: u32,
        /// The receiver.
        gen_rank: u32,
        /// Index of the piece.
        piece: usize,
        /// What failed.
        source: PlanFailure,
    },
    /// Executing a plan failed.
    #[error("prefill rank {ctx_rank} -> decode rank {gen_rank}: executing the plan failed")]
    Execute {
        /// The sender.
        ctx_rank: u32,
        /// The receiver.
        gen_rank: u32,
        /// What failed.
        source: crate::oracle::MemoryError,
    },
    /// The oracle could not fill or check.
    #[error(transparent)]
    Oracle(#[from] OracleError),
    /// The pools to back would not fit in the memory the scenario may take
    /// ([`Scenario::memory_budget`]): refused before anything is allocated.
    #[error(
        "backing the pools of {ranks} needs {}; {}",
        crate::layout::bytes_text(u128::from(*needed)),
        budget.available
    )]
    Memory {
        /// Which ranks' pools, e.g. `4 receiving decode ranks`.
        ranks: String,
        /// Bytes of those pools.
        needed: u64,
        /// What may be taken, and what limits it.
        budget: MemoryBudget,
    },
    /// A bounced piece's packed image does not match the receiver's own plan of it.
    #[error("prefill rank {ctx_rank} -> decode rank {gen_rank}, piece {piece}: bounce: {detail}")]
    Bounce {
        /// The sender.
        ctx_rank: u32,
        /// The receiver.
        gen_rank: u32,
        /// Index of the piece.
        piece: usize,
        /// What does not match.
        detail: String,
    },
}

impl ScenarioError {
    /// The kind of the planner error behind this one, if a planner call failed (a refusal is
    /// `UNSUPPORTED` or `PEER_INCOMPATIBLE`).
    pub fn planner_error_kind(&self) -> Option<kvferry_planner_abi::ErrorKind> {
        match self {
            ScenarioError::Planner { source, .. } => Some(source.kind()),
            _ => None,
        }
    }
}

/// What the pools a scenario backs may take in all, as the caller measured it (the CLI
/// passes `kvferry_platform::HostBudget`, the figure `serve` checks its pools
/// against; the testkit does not link UCX).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryBudget {
    /// Bytes.
    pub bytes: u64,
    /// The figure as a person reads it, with what limits it: `25662619648 bytes (23.9 GiB)
    /// available (MemAvailable)`.
    pub available: String,
}

impl MemoryBudget {
    /// Refuses `needed` bytes of `ranks`' pools beyond the budget.
    fn check(&self, ranks: impl FnOnce() -> String, needed: u64) -> Result<(), ScenarioError> {
        if needed <= self.bytes {
            return Ok(());
        }
        Err(ScenarioError::Memory {
            ranks: ranks(),
            needed,
            budget: self.clone(),
        })
    }
}

/// PAGED slots of every pool of a side whose blocks hold `tokens_per_block` tokens, for a
/// prompt of `prompt_len` tokens: the prompt's blocks and slack (2, and one in 16), as
/// [`Scenario::lay_out`] sizes them.
pub fn paged_slots(prompt_len: u64, tokens_per_block: u32) -> u64 {
    let blocks = prompt_len.div_ceil(u64::from(tokens_per_block.max(1)));
    blocks.saturating_add(2 + blocks / 16)
}

/// Bytes of every pool of `ranks` (saturating: the layout keeps each rank's pools under
/// [`crate::layout::MAX_RANK_BYTES`]).
fn pool_bytes<'r>(ranks: impl IntoIterator<Item = &'r RankInfo>) -> u64 {
    ranks
        .into_iter()
        .flat_map(|info| info.page_table.pools.iter())
        .fold(0u64, |sum, pool| sum.saturating_add(pool.footprint()))
}

/// One request between two instances.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scenario {
    /// The model, on both sides.
    pub model: ModelSpec,
    /// The prefill instance's mapping.
    pub ctx_mapping: Mapping,
    /// The decode instance's mapping.
    pub gen_mapping: Mapping,
    /// Prompt length in tokens.
    pub prompt_len: u64,
    /// The prefill DP group serving the request (0 without attention DP).
    pub ctx_dp_rank: u32,
    /// The decode DP group receiving it (0 without attention DP).
    pub gen_dp_rank: u32,
    /// Sender-side chunks (block-aligned, ascending); `None` sends the prompt in one piece.
    pub chunks: Option<Vec<TokenRange>>,
    /// Prompt tokens the receiver already holds (its first `cached_tokens / tpb` ordinals are
    /// masked).
    pub cached_tokens: u64,
    /// Seed of slot placement and of the oracle's tags.
    pub seed: u64,
    /// Slots `0, 1, 2, ...` by ordinal instead of a random placement.
    pub contiguous_slots: bool,
    /// Pools with [`PADDING_BYTES`] after every slot.
    pub padded: bool,
    /// The planner id stamped on every rank.
    pub planner_id: String,
    /// Tokens per block of the decode instance when it differs from the model's (the
    /// prefill instance's); semantics §3.2 rule 4.
    pub gen_tokens_per_block: Option<u32>,
    /// The limits each receiver's bounce region is checked against.
    pub bounce_limits: BounceLimits,
    /// Move the pieces of every receiver whose bounce region passes the limits (one writer)
    /// as the agent does: the sender's plan gathered into a packed image, scattered by the
    /// receiver's own plan of the piece with stand-in sources.
    pub bounce: bool,
    /// What the pools backed for the request may take in all (`None`: unchecked). Checked
    /// before anything sized by the prompt is allocated: the receivers' pools once both
    /// instances are laid out (addresses only), every pool to back once the senders are
    /// known.
    pub memory_budget: Option<MemoryBudget>,
}

impl Scenario {
    /// A monolithic, uncached request with random slots, seed 0, unpadded pools, planner id
    /// `kvferry.default`, DP ranks 0.
    pub fn new(
        model: ModelSpec,
        ctx_mapping: Mapping,
        gen_mapping: Mapping,
        prompt_len: u64,
    ) -> Self {
        Self {
            model,
            ctx_mapping,
            gen_mapping,
            prompt_len,
            ctx_dp_rank: 0,
            gen_dp_rank: 0,
            chunks: None,
            cached_tokens: 0,
            seed: 0,
            contiguous_slots: false,
            padded: false,
            planner_id: "kvferry.default".to_string(),
            gen_tokens_per_block: None,
            bounce_limits: BounceLimits::default(),
            bounce: false,
            memory_budget: None,
        }
    }

    /// The pieces the senders plan, the last with `is_last`.
    ///
    /// # Errors
    ///
    /// Chunks that are empty, out of order, overlapping, past the prompt, or not aligned to
    /// blocks (a chunk may end at the prompt's end).
    pub fn pieces(&self) -> Result<Vec<PairRequest>, ScenarioError> {
        match &self.chunks {
            None => Ok(vec![PairRequest::whole(self.prompt_len)]),
            Some(chunks) => check_chunks(
                chunks,
                self.prompt_len,
                u64::from(self.model.tokens_per_block),
            ),
        }
    }

    /// Runs the request end to end (see the module docs).
    ///
    /// # Errors
    ///
    /// Invalid parameters, a layout refusal, any planner error or refusal, asymmetric
    /// targets, a rejected plan, or an oracle failure. Byte mismatches are not errors: they
    /// are in the report's [`ScenarioReport::verification`].
    pub fn run(
        &self,
        ctx_planner: PlannerFactory<'_>,
        gen_planner: PlannerFactory<'_>,
    ) -> Result<ScenarioReport, ScenarioError> {
        let started = Instant::now();
        let exchange = self.exchange()?;
        let layout = started.elapsed();
        let mut report = exchange.run(ctx_planner, gen_planner)?;
        report.timings.setup += layout;
        Ok(report)
    }

    /// Both instances laid out, the slot tables of the ranks taking part and the pieces: the
    /// request as an [`Exchange`].
    ///
    /// # Errors
    ///
    /// Invalid parameters or a layout refusal.
    pub fn exchange(&self) -> Result<Exchange, ScenarioError> {
        self.check()?;
        let pieces = self.pieces()?;
        let (ctx_blocks, ctx_options) = self.side_options(&self.model);
        let (gen_blocks, gen_options) = self.side_options(&self.gen_model());
        let (ctx, generation) = self.lay_out()?;
        // The receivers' pools are backed whatever the planner targets: refused here, before
        // the slot lists and tables (sized by the prompt, like the pools) are made.
        if let Some(budget) = &self.memory_budget {
            let receivers = dp_group(&generation, self.gen_dp_rank);
            let needed = pool_bytes(receivers.iter().map(|&g| &generation[g as usize]));
            budget.check(|| receiving_ranks(receivers.len()), needed)?;
        }
        let ctx_slots = SlotAssignment::new(self, 0x00c0_17e7, ctx_blocks, &ctx_options);
        let gen_slots = SlotAssignment::new(self, 0x0009_e4e7, gen_blocks, &gen_options);
        let ctx_tables = dp_group(&ctx, self.ctx_dp_rank)
            .into_iter()
            .map(|r| {
                let info = &ctx[r as usize];
                (r, slot_tables(info, self.prompt_len, 0, &ctx_slots))
            })
            .collect();
        let gen_tables = dp_group(&generation, self.gen_dp_rank)
            .into_iter()
            .map(|r| {
                let info = &generation[r as usize];
                (
                    r,
                    slot_tables(info, self.prompt_len, self.cached_tokens, &gen_slots),
                )
            })
            .collect();
        Ok(Exchange {
            ctx,
            generation,
            ctx_tables,
            gen_tables,
            gen_excluded: BTreeMap::new(),
            pieces,
            ctx_dp_rank: self.ctx_dp_rank,
            gen_dp_rank: self.gen_dp_rank,
            seed: self.seed,
            bounce_limits: self.bounce_limits,
            bounce: self.bounce,
            memory_budget: self.memory_budget.clone(),
        })
    }

    /// The decode instance's model: [`Scenario::model`] with
    /// [`Scenario::gen_tokens_per_block`] applied.
    pub fn gen_model(&self) -> ModelSpec {
        match self.gen_tokens_per_block {
            Some(tpb) => self.model.clone().with_tokens_per_block(tpb),
            None => self.model.clone(),
        }
    }

    /// Both instances laid out as [`Scenario::exchange`] lays them out, at addresses only
    /// (nothing is backed): pools sized to the request, [`paged_slots`] PAGED slots and 2
    /// STATE slots each, padded when [`Scenario::padded`]. What a caller sizes before the
    /// slot tables (sized by the prompt) are made.
    ///
    /// # Errors
    ///
    /// A block size of 0 ([`ScenarioError::Invalid`]) or a layout refusal.
    pub fn lay_out(&self) -> Result<(Vec<RankInfo>, Vec<RankInfo>), ScenarioError> {
        if self.model.tokens_per_block == 0 || self.gen_tokens_per_block == Some(0) {
            return Err(ScenarioError::Invalid("tokens_per_block is 0".to_string()));
        }
        let gen_model = self.gen_model();
        let mut space = LocalMemory::new();
        let mut instance = |model: &ModelSpec, mapping: &Mapping, name: &str| {
            let (_, options) = self.side_options(model);
            let mut alloc = |rank: u32, pool: usize, bytes: u64| {
                space.reserve(bytes, format!("{name} rank {rank} pool {pool}"))
            };
            build_instance(model, mapping, name, &self.planner_id, &options, &mut alloc)
        };
        let ctx = instance(&self.model, &self.ctx_mapping, PREFILL_INSTANCE)?;
        let generation = instance(&gen_model, &self.gen_mapping, DECODE_INSTANCE)?;
        Ok((ctx, generation))
    }

    /// The prompt's blocks on a side of `model`, and the options of that side's pools.
    fn side_options(&self, model: &ModelSpec) -> (u64, PoolOptions) {
        let blocks = self.prompt_len.div_ceil(u64::from(model.tokens_per_block));
        let options = PoolOptions {
            paged_slots: paged_slots(self.prompt_len, model.tokens_per_block),
            state_slots: STATE_SLOTS,
            slot_padding: if self.padded { PADDING_BYTES } else { 0 },
            ..PoolOptions::default()
        };
        (blocks, options)
    }

    fn check(&self) -> Result<(), ScenarioError> {
        let invalid = |m: String| Err(ScenarioError::Invalid(m));
        if self.prompt_len == 0 {
            return invalid("prompt_len is 0".to_string());
        }
        if self.model.tokens_per_block == 0 || self.gen_tokens_per_block == Some(0) {
            return invalid("tokens_per_block is 0".to_string());
        }
        if self.cached_tokens > self.prompt_len {
            return invalid(format!(
                "cached_tokens {} exceeds prompt_len {}",
                self.cached_tokens, self.prompt_len
            ));
        }
        for (name, mapping, dp) in [
            ("prefill", &self.ctx_mapping, self.ctx_dp_rank),
            ("decode", &self.gen_mapping, self.gen_dp_rank),
        ] {
            let groups = mapping.dp_groups();
            if dp >= groups {
                return invalid(format!(
                    "{name}_dp_rank {dp} but mapping {mapping} has {groups} dp groups"
                ));
            }
        }
        Ok(())
    }
}

pub(crate) fn check_chunks(
    chunks: &[TokenRange],
    prompt_len: u64,
    tpb: u64,
) -> Result<Vec<PairRequest>, ScenarioError> {
    kvferry_plan::pieces(prompt_len, tpb as u32, Some(chunks))
        .map_err(|e| ScenarioError::Invalid(e.to_string()))
}

/// One request between two instances given rank by rank: what [`Scenario::run`] does once
/// its preset is laid out, for page tables of any shape ([`crate::builder`], or a preset's
/// tables edited by a test).
///
/// [`run`](Self::run) places every pool of the ranks that take part at the address its page
/// table names (they must not overlap), then plans, moves and verifies as the module docs
/// describe, from step 3 on.
#[derive(Clone, Debug)]
pub struct Exchange {
    /// Every rank of the prefill instance, in rank order.
    pub ctx: Vec<RankInfo>,
    /// Every rank of the decode instance, in rank order.
    pub generation: Vec<RankInfo>,
    /// Slot tables of (at least) every rank of the prefill DP group, by instance rank.
    pub ctx_tables: BTreeMap<u32, Vec<SlotTable>>,
    /// Slot tables of (at least) every receiver, by instance rank.
    pub gen_tables: BTreeMap<u32, Vec<SlotTable>>,
    /// Views a receiver neither receives nor expects (bounded replay), by instance rank.
    pub gen_excluded: BTreeMap<u32, Vec<ViewId>>,
    /// The pieces every sender plans, in order; the last has `is_last`.
    pub pieces: Vec<PairRequest>,
    /// The prefill DP group serving the request.
    pub ctx_dp_rank: u32,
    /// The decode DP group receiving it.
    pub gen_dp_rank: u32,
    /// Seed of the oracle's tags.
    pub seed: u64,
    /// The limits each receiver's bounce region is checked against.
    pub bounce_limits: BounceLimits,
    /// Bounce where a receiver's region passes ([`Scenario::bounce`]).
    pub bounce: bool,
    /// What the pools of the ranks taking part may take in all, checked before any is
    /// backed (`None`: unchecked).
    pub memory_budget: Option<MemoryBudget>,
}

impl Exchange {
    /// Runs the request end to end (module docs, steps 3 and 4).
    ///
    /// # Errors
    ///
    /// An empty DP group, a rank of one without slot tables, overlapping pools, any planner
    /// error or refusal, asymmetric targets, a rejected plan, or an oracle failure. Byte
    /// mismatches are not errors: they are in the report's [`ScenarioReport::verification`].
    pub fn run(
        &self,
        ctx_planner: PlannerFactory<'_>,
        gen_planner: PlannerFactory<'_>,
    ) -> Result<ScenarioReport, ScenarioError> {
        let started = Instant::now();
        let agreed = self.handshake(ctx_planner, gen_planner)?;
        let (ctx_infos, gen_infos) = (&agreed.ctx, &agreed.generation);
        let (senders, receivers) = (&agreed.senders, &agreed.receivers);

        // Memory for the ranks that take part, once it is known to fit, then tags and
        // canaries.
        if let Some(budget) = &self.memory_budget {
            let needed = pool_bytes(
                senders
                    .iter()
                    .map(|&c| &ctx_infos[c as usize])
                    .chain(receivers.iter().map(|&g| &gen_infos[g as usize])),
            );
            let ranks = || {
                let n = senders.len();
                format!(
                    "{n} sending prefill rank{} and {}",
                    if n == 1 { "" } else { "s" },
                    receiving_ranks(receivers.len())
                )
            };
            budget.check(ranks, needed)?;
        }
        let mut memory = LocalMemory::new();
        for &c in senders {
            map_pools(&mut memory, &ctx_infos[c as usize])?;
        }
        for &g in receivers {
            map_pools(&mut memory, &gen_infos[g as usize])?;
        }
        let setup = started.elapsed();
        let oracle = Oracle::new(self.seed);
        let clock = Instant::now();
        for &c in senders {
            oracle.fill_source(&mut memory, agreed.sender(c))?;
        }
        for &g in receivers {
            oracle.prime_destination(&mut memory, &gen_infos[g as usize])?;
        }
        let fill = clock.elapsed();

        let mut report = ScenarioReport::default();
        let (mut plan_time, mut execute_time) = (Duration::ZERO, Duration::ZERO);
        for (&g, r) in &agreed.receiving {
            report.receivers.push(r.clone());
            let mut writes: Vec<(u64, u64, u32)> = Vec::new();
            for &c in &r.targets {
                let mut pair = PairReport::new(c, g);
                for k in 0..self.pieces.len() {
                    let clock = Instant::now();
                    let plan = agreed.plan(c, g, k)?;
                    plan_time += clock.elapsed();
                    let clock = Instant::now();
                    if agreed.bounces(g) {
                        let runs = agreed.scatter_runs(c, g, k, &plan)?;
                        bounce_piece(&mut memory, &plan, &runs).map_err(|detail| {
                            ScenarioError::Bounce {
                                ctx_rank: c,
                                gen_rank: g,
                                piece: k,
                                detail,
                            }
                        })?;
                        pair.bounced += 1;
                    } else {
                        memory
                            .execute(&plan)
                            .map_err(|source| ScenarioError::Execute {
                                ctx_rank: c,
                                gen_rank: g,
                                source,
                            })?;
                    }
                    execute_time += clock.elapsed();
                    writes.extend(plan.fragments().map(|(_, d, n)| (d, n, c)));
                    pair.count(&plan);
                }
                report.fragments += pair.fragments;
                report.planned_fragments += pair.planned_fragments;
                report.bytes += pair.bytes;
                report.pairs.push(pair);
            }
            find_overlaps(g, writes, &mut report);
        }

        let clock = Instant::now();
        let context: Vec<RequestSide<'_>> =
            agreed.ctx_group.iter().map(|&c| agreed.sender(c)).collect();
        let receiver_sides: Vec<RequestSide<'_>> =
            receivers.iter().map(|&g| agreed.receiver(g)).collect();
        report.verification = oracle.verify(
            &memory,
            &Delivery {
                prefill: &context,
                receivers: &receiver_sides,
                pieces: &self.pieces,
            },
        )?;
        report.timings = Timings {
            setup,
            fill,
            plan: plan_time,
            execute: execute_time,
            verify: clock.elapsed(),
        };
        report.backed_bytes = memory.backed_bytes();
        Ok(report)
    }
}

/// Moves one bounced piece in `memory` as the agent does: gathers `plan` (the sender's) into
/// its packed image, then writes the image into `runs` (the receiver's own scatter runs of
/// the piece). The two must describe the same number of bytes.
fn bounce_piece(
    memory: &mut LocalMemory,
    plan: &kvferry_plan::ValidatedPlan,
    runs: &[(u64, u64)],
) -> Result<(), String> {
    let mut image = Vec::with_capacity(plan.total_bytes() as usize);
    for (src, _, len) in bounce::gather_list(plan) {
        let bytes = memory
            .bytes(src, len)
            .map_err(|e| format!("gathering {src:#x} +{len}: {e}"))?;
        image.extend_from_slice(bytes);
    }
    let want: u64 = runs.iter().map(|&(_, n)| n).sum();
    if want != image.len() as u64 {
        return Err(packs_and_scatters(image.len() as u64, want));
    }
    let mut at = 0usize;
    for &(dst, len) in runs {
        let n = len as usize;
        memory
            .bytes_mut(dst, len)
            .map_err(|e| format!("scattering to {dst:#x} +{len}: {e}"))?
            .copy_from_slice(&image[at..at + n]);
        at += n;
    }
    Ok(())
}

/// Why a bounced piece cannot move: the sender's plan packs `packs` bytes, the receiver's own
/// plan of the piece scatters `scatters`.
fn packs_and_scatters(packs: u64, scatters: u64) -> String {
    format!(
        "the sender's plan packs {packs} bytes, the receiver's own plan of the piece scatters \
         {scatters}"
    )
}

/// Which slot holds which ordinal, shared by every rank of one side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotAssignment {
    /// Slot of local ordinal `j` of a PAGED group.
    pub paged: Vec<i64>,
    /// The STATE slot.
    pub state: i64,
}

impl SlotAssignment {
    /// Slots `0, 1, 2, ...` and STATE slot 0.
    pub fn contiguous(blocks: u64) -> Self {
        Self {
            paged: (0..blocks as i64).collect(),
            state: 0,
        }
    }

    /// `blocks` distinct slots drawn from `paged_slots`, and one of `state_slots`.
    pub fn random(blocks: u64, paged_slots: u64, state_slots: u64, rng: &mut StdRng) -> Self {
        let mut all: Vec<i64> = (0..paged_slots as i64).collect();
        all.shuffle(rng);
        all.truncate(blocks as usize);
        let mut state: Vec<i64> = (0..state_slots.max(1) as i64).collect();
        state.shuffle(rng);
        Self {
            paged: all,
            state: state[0],
        }
    }

    fn new(scenario: &Scenario, side: u64, blocks: u64, options: &PoolOptions) -> Self {
        if scenario.contiguous_slots {
            Self::contiguous(blocks)
        } else {
            let mut rng = StdRng::seed_from_u64(scenario.seed ^ side);
            Self::random(blocks, options.paged_slots, options.state_slots, &mut rng)
        }
    }
}

/// The slot tables of `info` for a prompt of `prompt_len` tokens.
///
/// PAGED groups are positional: local ordinal `j` (global ordinal `j × C + r` on CP rank `r`
/// of `C`) holds `assignment.paged[j]`, except holes for the stale front of a windowed group
/// (`max(0, (prompt_len + 1 − window) // tpb)` ordinals) and for the first
/// `cached_tokens / tpb` ordinals. STATE groups hold `[assignment.state]`.
pub fn slot_tables(
    info: &RankInfo,
    prompt_len: u64,
    cached_tokens: u64,
    assignment: &SlotAssignment,
) -> Vec<SlotTable> {
    let pt = &info.page_table;
    let tpb = u64::from(pt.tokens_per_block);
    let blocks = prompt_len.div_ceil(tpb);
    let (cp, cp_rank) = (u64::from(info.cp_size.max(1)), u64::from(info.cp_rank));
    let local = if blocks > cp_rank {
        (blocks - cp_rank).div_ceil(cp)
    } else {
        0
    };
    pt.groups
        .iter()
        .map(|group| {
            if group.kind == GroupKind::STATE {
                return SlotTable::new([assignment.state]);
            }
            let stale_end = group
                .window()
                .map_or(0, |w| (prompt_len + 1).saturating_sub(w) / tpb);
            let masked = stale_end.max(cached_tokens / tpb);
            SlotTable::from(
                (0..local)
                    .map(|j| {
                        let global = j * cp + cp_rank;
                        match assignment.paged.get(j as usize) {
                            Some(&slot) if global >= masked => slot,
                            _ => SlotTable::HOLE,
                        }
                    })
                    .collect::<Vec<_>>(),
            )
        })
        .collect()
}

/// `N receiving decode rank(s)`, for a refusal.
fn receiving_ranks(n: usize) -> String {
    format!("{n} receiving decode rank{}", if n == 1 { "" } else { "s" })
}

/// Ranks of the DP group `dp_rank` (all ranks without attention DP).
fn dp_group(infos: &[RankInfo], dp_rank: u32) -> Vec<u32> {
    infos
        .iter()
        .filter(|i| i.dp_rank == dp_rank)
        .map(|i| i.instance_rank)
        .collect()
}

/// Places and backs every pool of `info` at the address its page table names.
fn map_pools(memory: &mut LocalMemory, info: &RankInfo) -> Result<(), OracleError> {
    for (p, pool) in info.page_table.pools.iter().enumerate() {
        let label = format!(
            "{} rank {} pool {p}",
            info.instance_name, info.instance_rank
        );
        memory.reserve_at(pool.base, pool.footprint(), label)?;
        memory.back(pool.base)?;
    }
    Ok(())
}

/// Records writes into receiver `rank` that overlap: `(dst, len, sender)` over all pieces.
fn find_overlaps(rank: u32, mut writes: Vec<(u64, u64, u32)>, report: &mut ScenarioReport) {
    writes.sort_unstable();
    let mut reach: Option<(u64, u64, u32)> = None;
    for w in writes {
        if let Some(r) = reach {
            if w.0 < r.0 + r.1 {
                report.overlapping_writes += 1;
                if report.overlaps.len() < MAX_OVERLAPS_KEPT {
                    report.overlaps.push(OverlappingWrite {
                        gen_rank: rank,
                        first: (r.2, r.0, r.1),
                        second: (w.2, w.0, w.1),
                    });
                }
            }
        }
        if reach.is_none_or(|r| w.0 + w.1 > r.0 + r.1) {
            reach = Some(w);
        }
    }
}

/// Traffic of one (sender, receiver) pair over every piece.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PairReport {
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
    /// Bytes moved.
    pub bytes: u64,
    /// Pieces that went through the receiver's bounce region.
    pub bounced: usize,
}

impl PairReport {
    /// Prefill rank `src_rank` into decode rank `dst_rank`, nothing counted yet.
    pub fn new(src_rank: u32, dst_rank: u32) -> Self {
        Self {
            src_rank,
            dst_rank,
            ..Self::default()
        }
    }

    /// Counts one more piece, planned as `plan` (its fragments, before and after coalescing,
    /// and its bytes).
    pub fn count(&mut self, plan: &kvferry_plan::ValidatedPlan) {
        self.pieces += 1;
        self.fragments += plan.len();
        self.planned_fragments += plan.planned_fragments();
        self.bytes += plan.total_bytes();
    }
}

/// What one receiver waited for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiverReport {
    /// Decode rank.
    pub rank: u32,
    /// Writers it counts (`targets.len()`).
    pub expected_transfers: usize,
    /// The prefill ranks its planner named.
    pub targets: Vec<u32>,
    /// The targets' `uniform` flag (§9.1).
    pub uniform: bool,
    /// Recurrent-state bytes landing in its slots (the planner's `receiver_payload_bytes`).
    pub payload_bytes: u64,
    /// The bounce region it would reserve under [`Scenario::bounce_limits`], or why not.
    pub bounce: Result<Reservation, BounceSkip>,
}

/// One line: `decode rank 3: 2 expected transfers from [0, 1] (uniform), 0 bytes of state;
/// bounce: ...` (the region's size, with each writer's share when several share it, or
/// `no, ` and why not).
impl fmt::Display for ReceiverReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "decode rank {}: {} expected transfers from {:?}{}, {} of state; bounce: {}",
            self.rank,
            self.expected_transfers,
            self.targets,
            if self.uniform { " (uniform)" } else { "" },
            crate::units::bytes(self.payload_bytes),
            match &self.bounce {
                Ok(b) if b.writers > 1 => format!(
                    "{} ({} per writer)",
                    crate::units::bytes(b.total),
                    crate::units::size(b.share())
                ),
                Ok(b) => crate::units::bytes(b.total),
                Err(skip) => format!("no, {skip}"),
            }
        )
    }
}

/// Two writes into one receiver that cover the same bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverlappingWrite {
    /// The receiver.
    pub gen_rank: u32,
    /// `(sender, destination, length)` of the write reaching furthest before the second.
    pub first: (u32, u64, u64),
    /// `(sender, destination, length)` of the write starting inside it.
    pub second: (u32, u64, u64),
}

/// Wall-clock time of the phases of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timings {
    /// Layout, slot tables, planners, peer checks, targets, memory.
    pub setup: Duration,
    /// Tagging sources and priming destinations.
    pub fill: Duration,
    /// Describing, pairing, validating and coalescing.
    pub plan: Duration,
    /// Copying.
    pub execute: Duration,
    /// Checking every byte.
    pub verify: Duration,
}

/// What a run did and found.
#[derive(Clone, Debug, Default)]
pub struct ScenarioReport {
    /// Per (sender, receiver) pair, receivers ascending, senders in target order.
    pub pairs: Vec<PairReport>,
    /// Per receiver, ascending.
    pub receivers: Vec<ReceiverReport>,
    /// Fragments after coalescing, all pairs.
    pub fragments: usize,
    /// Fragments the planners returned, all pairs.
    pub planned_fragments: usize,
    /// Bytes moved, all pairs.
    pub bytes: u64,
    /// Writes that overlap an earlier write into the same receiver (any sender, any piece).
    pub overlapping_writes: u64,
    /// The first few of them.
    pub overlaps: Vec<OverlappingWrite>,
    /// The oracle's verdict.
    pub verification: VerifyReport,
    /// Bytes of memory the run backed.
    pub backed_bytes: u64,
    /// Phase timings (not deterministic).
    pub timings: Timings,
}

impl ScenarioReport {
    /// Whether every byte matched and no receiver byte was written twice.
    pub fn is_ok(&self) -> bool {
        self.verification.is_clean() && self.overlapping_writes == 0
    }

    /// Senders whose plans into decode rank `gen_rank` moved at least one byte.
    pub fn busy_writers(&self, gen_rank: u32) -> usize {
        self.pairs
            .iter()
            .filter(|p| p.dst_rank == gen_rank && p.bytes > 0)
            .count()
    }

    /// Bytes moved into decode rank `gen_rank`, all senders.
    pub fn bytes_into(&self, gen_rank: u32) -> u64 {
        self.pairs
            .iter()
            .filter(|p| p.dst_rank == gen_rank)
            .map(|p| p.bytes)
            .sum()
    }
}

impl fmt::Display for ScenarioReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for r in &self.receivers {
            writeln!(f, "{r}")?;
        }
        for p in &self.pairs {
            writeln!(
                f,
                "ctx {} -> gen {}: {} pieces, {} fragments ({} planned), {}{}",
                p.src_rank,
                p.dst_rank,
                p.pieces,
                p.fragments,
                p.planned_fragments,
                crate::units::bytes(p.bytes),
                if p.bounced > 0 {
                    format!(", {} pieces bounced", p.bounced)
                } else {
                    String::new()
                }
            )?;
        }
        writeln!(
            f,
            "total: {} fragments ({} planned), {}",
            self.fragments,
            self.planned_fragments,
            crate::units::bytes(self.bytes)
        )?;
        if self.overlapping_writes > 0 {
            writeln!(f, "{} overlapping writes:", self.overlapping_writes)?;
            for o in &self.overlaps {
                writeln!(
                    f,
                    "  decode rank {}: ctx {} wrote {:#x} +{}, ctx {} wrote {:#x} +{}",
                    o.gen_rank, o.first.0, o.first.1, o.first.2, o.second.0, o.second.1, o.second.2
                )?;
            }
        }
        write!(f, "verify: {}", self.verification)
    }
}
