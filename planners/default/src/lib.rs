#![deny(unsafe_code)]
#![deny(missing_docs)]

//! kvferry's default planner, `kvferry.default`: the transfer plan every model gets unless a
//! model-specific planner is bound.
//!
//! It has the semantics of TensorRT-LLM's `DefaultTransferPlanner` over the "G4" page table
//! (`transfer-semantics.md` §2–§9):
//!
//! - **Peer check** ([`TransferPlanner::check_peer`], §3): topology rules, the page-table
//!   layout gate for every matched view pair, recurrent-state layout, pool-matching refusals
//!   and layer coverage. Every refusal names the field and both sides' values.
//! - **Pool matching** (§4): each local view is matched to the peer views of the same role
//!   set and overlapping global layers, inside the single peer layer group of the same class
//!   (PAGED or STATE) that holds its layers.
//! - **Targets** (§5.1): PP layer overlap, TP overlap inside the DP group, CP overlap, and
//!   the CP-minor flat rank `pp × (TP × CP) + tp × CP + cp`.
//! - **Ownership** (§5.2): a rank writes a view pair only when the shards are paired and it
//!   is the elected replica, so exactly one writer lands on every destination byte; the
//!   others return empty plans.
//! - **Mappers** (§5.3, §7): intact copies with layer-run merging, HND / NHD head re-split,
//!   SECTIONED per-section re-split, REPLICATED whole copies, and HND re-blocking between
//!   different `tokens_per_block` (§3.2 rule 4).
//! - **Pairing** (§8.2, §6.2): ordinals both sides hold inside the piece's token range, with
//!   the helix stride when the receiver runs context parallelism; recurrent state rides on
//!   the last piece.
//! - **Receiver payload** (§7): the recurrent-state bytes that land in the receiver's slots.
//!
//! Everything a peer needs is derived once per peer and cached (the verdict, the matched view
//! pairs with their per-row fragment offsets and ownership, the targets per peer DP rank);
//! [`TransferPlanner::forget_peer`] drops it.
//!
//! # Where the reference leaves a choice
//!
//! Each choice keeps destination bytes correct, refusing rather than guessing:
//!
//! - Different `tokens_per_block` on the two sides (§3.2 rule 4) are re-blocked when every
//!   PAGED view of both sides is HND and one size is a multiple of the other: the unit is a
//!   block of the smaller side, sub-block `k` of larger ordinal `O` being smaller ordinal
//!   `O × ratio + k`, one fragment per (layer, buffer, head in common) since a head's tokens
//!   are contiguous in an HND buffer. Both sides must declare `shard_unit_bytes` (one head's
//!   block) to locate the heads. NHD and REPLICATED PAGED views, sizes that do not divide and
//!   helix CP with different sizes are refused on `tokens_per_block`. A piece covers
//!   smaller-side blocks `[start / small, ceil(end / small))`, from the receiver block that
//!   holds `dst_start_token` on (sent whole, as with equal sizes).
//! - A local view is matched to *every* same-role peer view it shares layers with, not only
//!   the first: identical when at most one exists, and no layer is silently dropped when one
//!   side split a role's layers over several views.
//! - A global layer cached in PAGED views on both sides must be carried by some view pair
//!   (e.g. an MLA latent against separate K/V heads is refused), and a STATE view must have
//!   a counterpart for every layer the other side holds in state (§3.4 rule 4, generalised).
//! - Bounded replay (§3.6) is checked per piece: a receiver view that is not excluded, over
//!   layers this sender holds in a group of the same class, must be served by a view pair.
//! - Recurrent state travels with the piece marked `is_last` only (§7).
//! - `uniform` (§9.1) is conservative: any PP fan-in, CP, replica election, recurrent
//!   state, replicated view or uneven block size makes it `false`.
//!
//! # Module layers
//!
//! A module imports only from the layers below it, so no module imports one that imports
//! it back. Bottom-up:
//!
//! 1. `view` (a page-table view with its layer regions resolved) and `side` (refusals in
//!    this rank's perspective whichever direction is checked);
//! 2. `mapper` (§5.2 ownership, §5.3 mappers) and `matching` (§4 pool matching);
//! 3. `link` (the matched view pairs a peer's plans are made from; data only);
//! 4. `topology` (§5.1 targets, §9.1 uniform shares);
//! 5. `compat` (§3 peer check, which builds the link), `pairing` (§8.2 plan emission from
//!    the link) and `state` (§7 receiver payload);
//! 6. `cache` (the link and targets per peer), under the crate root.
//!
//! A lower module's docs name a higher one in plain text, never as a `crate::` path.

/*
Module map, for maintainers, bottom-up (see "Module layers" above):

- `view`:     one (layer group, view) of a page table with its layer regions resolved.
- `side`:     whose view is "mine" in a check run in both directions; refusals in this
              rank's perspective.
- `mapper`:   §5.2 shard pairing and ownership, §5.3 shard arithmetic and the five mappers.
- `matching`: §4 pool matching.
- `link`:     the `Link` to a peer (matched pairs + mappers + ownership) its plans are made
              from; data only.
- `topology`: §5.1 targets and §9.1 uniform writer shares.
- `compat`:   §3 peer check; builds the `Link`.
- `pairing`:  §8.2 ordinal pairing, §6.2 helix stride, and plan emission from the `Link`.
- `state`:    §7 receiver payload bytes.
- `cache`:    per-peer caches behind one mutex.
- `testkit`:  (tests only) tiny page-table builders; imports nothing from the crate.
*/

mod cache;
mod compat;
mod link;
mod mapper;
mod matching;
mod pairing;
mod side;
mod state;
#[cfg(test)]
mod testkit;
mod topology;
mod view;

use kvferry_planner_abi::{
    CompressedPlan, Deployment, DeploymentRefusal, LayerGroupRows, PairRequest, PeerTargets,
    PlanError, PlannerPlugin, RankInfo, SlotTable, Specificity, TransferPlan, TransferPlanner,
    export_planner,
};

/// The default planner: one instance per rank.
///
/// Stateless apart from its per-peer caches, so one instance may serve several threads.
#[derive(Debug, Default)]
pub struct DefaultPlanner {
    cache: cache::PeerCache,
}

impl TransferPlanner for DefaultPlanner {
    fn check_peer(&self, me: &RankInfo, peer: &RankInfo) -> Result<(), PlanError> {
        self.cache.link(me, peer).map(|_| ())
    }

    fn targets(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        peer_dp_rank: u32,
    ) -> Result<PeerTargets, PlanError> {
        self.cache.targets(me, peer, peer_dp_rank)
    }

    fn pair(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: &[LayerGroupRows],
        peer_rows: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<TransferPlan, PlanError> {
        let plan = self.compressed(me, peer, my_rows, peer_rows, request)?;
        plan.expand(my_rows, peer_rows)
            .map_err(|e| PlanError::invalid(format!("expanding the compressed plan: {e}")))
    }

    fn pair_compressed(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: &[LayerGroupRows],
        peer_rows: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<Option<CompressedPlan>, PlanError> {
        self.compressed(me, peer, my_rows, peer_rows, request)
            .map(Some)
    }

    fn receiver_payload_bytes(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        slot_tables: &[SlotTable],
    ) -> Result<u64, PlanError> {
        state::receiver_payload_bytes(me, peer, slot_tables)
    }

    fn forget_peer(&self, peer: &RankInfo) {
        self.cache.forget(peer);
    }
}

impl DefaultPlanner {
    /// The plan of one piece in compressed form: one pattern per owned view pair.
    fn compressed(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: &[LayerGroupRows],
        peer_rows: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<CompressedPlan, PlanError> {
        pairing::check_request(me, peer, request)?;
        let link = self.cache.link(me, peer)?;
        pairing::pair(me, peer, &link, my_rows, peer_rows, request)
    }
}

impl PlannerPlugin for DefaultPlanner {
    const PLANNER_ID: &'static str = "kvferry.default";

    /// Every architecture: the least specific planner, bound by `auto` only when no
    /// model-specific planner accepts the deployment.
    const SPECIFICITY: Specificity = Specificity::GENERIC;

    /// The default plan holds for every architecture and mapping: what a pair of ranks can
    /// exchange is decided per peer by [`TransferPlanner::check_peer`].
    fn supports_deployment(_: &Deployment) -> Result<(), DeploymentRefusal> {
        Ok(())
    }

    fn new(me: &RankInfo) -> Result<Self, PlanError> {
        topology::check_rank(me)?;
        me.page_table
            .validate()
            .map_err(|e| e.context(format!("page table of {}", topology::who(me))))?;
        Ok(Self::default())
    }
}

export_planner!(DefaultPlanner);
