//! `example.template`: a small but complete kvferry planner, meant to be copied.
//!
//! It moves caches whose geometry is identical on both sides, one whole row (cache block) at a
//! time:
//!
//! - every layer group is PAGED and has exactly one view;
//! - both sides have the same `tokens_per_block`, slot bytes, buffer entries, layout (kind,
//!   dtype, element bits, shard and replica counts, shard unit, sections), windows and layers;
//! - both sides have the same TP, PP and CP sizes and attention-DP setting, and the
//!   deployment is one of [`ARCHITECTURES`] with `pp = cp = 1`, so each rank exchanges with
//!   exactly one peer rank: the one with the same TP rank inside the peer's DP group.
//!
//! Under those conditions a row on one side holds exactly the bytes of the matching row on the
//! other, so `pair` copies whole rows: for every block ordinal of the requested token range
//! that both sides hold, one fragment of `row_bytes` from the sender's row to the receiver's.
//!
//! See `README.md` for how to turn this into your own planner and deploy it.

#![deny(missing_docs)]
// No unsafe code in a planner; `deny` rather than `forbid`, so `export_planner!` can allow it
// on the one static it generates.
#![deny(unsafe_code)]

use std::fmt::Display;

use kvferry_planner_abi::ffi::ROption;
use kvferry_planner_abi::{
    Deployment, DeploymentRefusal, GroupKind, LayerGroupRows, PageTable, PairRequest,
    PeerTargets, PlanError, PlannerPlugin, PoolView, RankInfo, Specificity, TransferPlan,
    TransferPlanner, ViewId, export_planner,
};

/// The id both servers must agree on (`KVFERRY_PLANNER`). Rename it: `<vendor>.<planner>`.
pub const PLANNER_ID: &str = "example.template";

/// The architectures (as a model's config names them) this planner plans for. Rename them
/// with the planner: a planner that names its models is preferred by automatic selection
/// (`KVFERRY_PLANNER=auto`) over the generic `kvferry.default`.
pub const ARCHITECTURES: &[&str] = &["LlamaForCausalLM"];

/// The planner: stateless, so one instance serves every peer from any thread.
#[derive(Debug, Default)]
pub struct SameLayoutPlanner;

impl TransferPlanner for SameLayoutPlanner {
    fn check_peer(&self, me: &RankInfo, peer: &RankInfo) -> Result<(), PlanError> {
        same_topology(me, peer)?;
        peer.page_table
            .validate()
            .map_err(|e| e.context("peer page table"))?;
        same_geometry(&me.page_table, &peer.page_table)
    }

    fn targets(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        peer_dp_rank: u32,
    ) -> Result<PeerTargets, PlanError> {
        same_topology(me, peer)?;
        same_sharding(&me.page_table, &peer.page_table)?;
        if peer_dp_rank >= peer.dp_size.max(1) {
            return Err(PlanError::invalid(format!(
                "peer DP rank {peer_dp_rank} is not below the peer's dp_size {}",
                peer.dp_size
            )));
        }
        // Same TP size per DP group on both sides, pp = cp = 1: the peer rank with our TP rank
        // inside the peer's DP group. With pp = cp = 1 the instance rank is the TP rank.
        let rank = peer_dp_rank * peer.tp_per_dp() + me.tp_rank_in_dp();
        Ok(PeerTargets {
            ranks: vec![rank].into(),
            uniform: true,
        })
    }

    fn pair(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: &[LayerGroupRows],
        peer_rows: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<TransferPlan, PlanError> {
        let tpb = u64::from(me.page_table.tokens_per_block);
        if tpb == 0 {
            return Err(PlanError::invalid("tokens_per_block is 0"));
        }
        // Ordinals of the requested token range, never past the prompt, and (legacy) never
        // before the receiver's `dst_start_token`.
        let mut lo = request.token_range.start / tpb;
        if let ROption::RSome(start) = request.dst_start_token {
            lo = lo.max(start / tpb);
        }
        let hi = request
            .token_range
            .end
            .div_ceil(tpb)
            .min(request.prompt_len.div_ceil(tpb));

        let mut plan = TransferPlan::new();
        for src in my_rows {
            // A view the receiver excluded has no rows on its side: nothing to write.
            let Some(dst) = peer_rows.iter().find(|r| r.view == src.view) else {
                continue;
            };
            check_view_pair(me, peer, src, dst)?;
            let first = src.ordinals.partition_point(|&o| o < lo);
            for (&ordinal, &address) in src.ordinals[first..].iter().zip(&src.addresses[first..]) {
                if ordinal >= hi {
                    break;
                }
                if let Some(dst_address) = dst.address_of(ordinal) {
                    plan.push(address, dst_address, src.row_bytes);
                }
            }
        }
        Ok(plan)
    }
}

impl PlannerPlugin for SameLayoutPlanner {
    const PLANNER_ID: &'static str = PLANNER_ID;

    /// One model family (the Llama architectures the template is written for), any TP width.
    /// Automatic selection prefers it over `kvferry.default` (generic) for those models.
    const SPECIFICITY: Specificity = Specificity::ARCHITECTURE;

    fn supports_deployment(deployment: &Deployment) -> Result<(), DeploymentRefusal> {
        // The host prefixes the planner id and the deployment.
        let mapping = deployment.mapping;
        if !ARCHITECTURES.contains(&deployment.architecture.as_str()) {
            return Err(DeploymentRefusal::new(
                "architecture",
                &deployment.architecture,
                ARCHITECTURES.join(" | "),
                "the template is written for Llama-style GQA caches",
            ));
        }
        if mapping.pp != 1 {
            return Err(DeploymentRefusal::new(
                "mapping.pp",
                mapping.pp,
                1,
                "every rank must hold every layer",
            ));
        }
        if mapping.cp != 1 {
            return Err(DeploymentRefusal::new(
                "mapping.cp",
                mapping.cp,
                1,
                "every rank must hold every token",
            ));
        }
        Ok(())
    }

    fn new(me: &RankInfo) -> Result<Self, PlanError> {
        me.page_table.validate()?;
        for (g, group) in me.page_table.groups.iter().enumerate() {
            if group.kind != GroupKind::PAGED {
                return Err(PlanError::unsupported(format!(
                    "{PLANNER_ID}: group {g} is a {} group; only PAGED groups are supported",
                    group.kind
                )));
            }
            if group.views.len() != 1 {
                return Err(PlanError::unsupported(format!(
                    "{PLANNER_ID}: group {g} has {} views; exactly one is supported",
                    group.views.len()
                )));
            }
        }
        Ok(SameLayoutPlanner)
    }
}

export_planner!(SameLayoutPlanner);

/// Refuses the peer unless `ours == theirs`, naming the field.
fn same<T: PartialEq + Display>(
    field: &str,
    ours: T,
    theirs: T,
    reason: &str,
) -> Result<(), PlanError> {
    if ours == theirs {
        Ok(())
    } else {
        Err(PlanError::refuse(field, ours, theirs, reason))
    }
}

/// Both sides must be sharded the same way for one-to-one rank pairing.
fn same_topology(me: &RankInfo, peer: &RankInfo) -> Result<(), PlanError> {
    let reason = "this planner pairs ranks one to one";
    same("tp_size", me.tp_size, peer.tp_size, reason)?;
    same("pp_size", me.pp_size, peer.pp_size, reason)?;
    same("cp_size", me.cp_size, peer.cp_size, reason)?;
    same("attention_dp", me.attention_dp, peer.attention_dp, reason)
}

/// Both sides must split every view into the same shards and replicas.
fn same_sharding(ours: &PageTable, theirs: &PageTable) -> Result<(), PlanError> {
    same(
        "groups",
        ours.groups.len(),
        theirs.groups.len(),
        "both sides must hold the same layer groups",
    )?;
    for (g, (a, b)) in ours.groups.iter().zip(theirs.groups.iter()).enumerate() {
        for (v, (va, vb)) in a.views.iter().zip(b.views.iter()).enumerate() {
            let at = |field: &str| format!("groups[{g}].views[{v}].layout.{field}");
            let reason = "rows hold different shards";
            same(
                &at("num_shards"),
                va.layout.num_shards,
                vb.layout.num_shards,
                reason,
            )?;
            same(
                &at("num_replicas"),
                va.layout.num_replicas,
                vb.layout.num_replicas,
                reason,
            )?;
        }
    }
    Ok(())
}

/// Both page tables must lay every row out identically (rank-specific shard indices aside).
fn same_geometry(ours: &PageTable, theirs: &PageTable) -> Result<(), PlanError> {
    same(
        "tokens_per_block",
        ours.tokens_per_block,
        theirs.tokens_per_block,
        "rows must hold the same tokens on both sides",
    )?;
    same_sharding(ours, theirs)?;
    for (g, (a, b)) in ours.groups.iter().zip(theirs.groups.iter()).enumerate() {
        let at = |field: &str| format!("groups[{g}].{field}");
        same(&at("kind"), a.kind, b.kind, "only PAGED groups pair")?;
        let window = |w: Option<u64>| w.map_or_else(|| "none".to_string(), |w| w.to_string());
        same(
            &at("window"),
            window(a.window()),
            window(b.window()),
            "both sides must keep the same tokens",
        )?;
        same(
            &at("layers"),
            a.layers.len(),
            b.layers.len(),
            "rows must hold the same layers",
        )?;
        for (i, (la, lb)) in a.layers.iter().zip(b.layers.iter()).enumerate() {
            same(
                &at(&format!("layers[{i}].global")),
                la.global,
                lb.global,
                "rows must hold the same layers in the same order",
            )?;
        }
        same(
            &at("views"),
            a.views.len(),
            b.views.len(),
            "this planner moves single-view groups",
        )?;
        for (v, (va, vb)) in a.views.iter().zip(b.views.iter()).enumerate() {
            same_view(ours, theirs, &at(&format!("views[{v}]")), va, vb)?;
        }
    }
    Ok(())
}

/// One view pair: slot size, entries and layout must be equal.
fn same_view(
    ours: &PageTable,
    theirs: &PageTable,
    at: &str,
    a: &PoolView,
    b: &PoolView,
) -> Result<(), PlanError> {
    let slot_bytes = |table: &PageTable, view: &PoolView| {
        table
            .pools
            .get(view.pool as usize)
            .map_or(0, |p| p.slot_bytes)
    };
    same(
        &format!("{at}.slot_bytes"),
        slot_bytes(ours, a),
        slot_bytes(theirs, b),
        "whole rows must be the same size",
    )?;
    same(
        &format!("{at}.entries"),
        a.entries.len(),
        b.entries.len(),
        "rows must be laid out identically",
    )?;
    // Entries in a canonical order: by layer, then offset.
    let sorted = |view: &PoolView| {
        let mut entries = view.entries.to_vec();
        entries.sort_by_key(|e| (e.local_layer, e.offset));
        entries
    };
    for (i, (ea, eb)) in sorted(a).iter().zip(sorted(b).iter()).enumerate() {
        let entry = |e: &kvferry_planner_abi::BufferEntry| {
            format!(
                "(layer {}, offset {}, size {})",
                e.local_layer, e.offset, e.size
            )
        };
        same(
            &format!("{at}.entries[{i}]"),
            entry(ea),
            entry(eb),
            "rows must be laid out identically",
        )?;
    }
    let (la, lb) = (&a.layout, &b.layout);
    let field = |name: &str| format!("{at}.layout.{name}");
    let reason = "rows must be laid out identically";
    same(&field("kind"), la.kind, lb.kind, reason)?;
    same(
        &field("dtype"),
        la.dtype.as_str(),
        lb.dtype.as_str(),
        reason,
    )?;
    same(&field("elem_bits"), la.elem_bits, lb.elem_bits, reason)?;
    same(
        &field("shard_unit_bytes"),
        la.shard_unit_bytes,
        lb.shard_unit_bytes,
        reason,
    )?;
    let sections = |l: &kvferry_planner_abi::RoleLayout| format!("{:?}", l.section_bytes);
    same(&field("section_bytes"), sections(la), sections(lb), reason)
}

/// The checks `pair` makes on one (sender rows, receiver rows) pair of a view.
fn check_view_pair(
    me: &RankInfo,
    peer: &RankInfo,
    src: &LayerGroupRows,
    dst: &LayerGroupRows,
) -> Result<(), PlanError> {
    let view = src.view;
    if src.kind != GroupKind::PAGED || dst.kind != GroupKind::PAGED {
        return Err(PlanError::unsupported(format!(
            "view (group {}, view {}): only PAGED rows are supported",
            view.group, view.view
        )));
    }
    if src.row_bytes != dst.row_bytes {
        return Err(PlanError::invalid(format!(
            "view (group {}, view {}): rows of {} bytes here, {} on the peer",
            view.group, view.view, src.row_bytes, dst.row_bytes
        )));
    }
    if src.ordinals.len() != src.addresses.len() {
        return Err(PlanError::invalid(format!(
            "view (group {}, view {}): {} ordinals but {} addresses",
            view.group,
            view.view,
            src.ordinals.len(),
            src.addresses.len()
        )));
    }
    // Whole rows are only right when both ranks hold the same shard of the view.
    let shard = |rank: &RankInfo, id: ViewId| {
        rank.page_table
            .groups
            .get(id.group as usize)
            .and_then(|g| g.views.get(id.view as usize))
            .map(|v| v.layout.shard_index)
    };
    match (shard(me, view), shard(peer, dst.view)) {
        (Some(a), Some(b)) if a == b => Ok(()),
        (Some(a), Some(b)) => Err(PlanError::invalid(format!(
            "view (group {}, view {}): this rank holds shard {a}, the peer shard {b}",
            view.group, view.view
        ))),
        _ => Err(PlanError::invalid(format!(
            "view (group {}, view {}) is not in both page tables",
            view.group, view.view
        ))),
    }
}

#[cfg(test)]
mod tests {
    use kvferry_planner_abi::{ErrorKind, Mapping, SlotTable, TokenRange};
    use kvferry_testkit::builder::{Deploy, Model, rows_of};
    use kvferry_testkit::scenario::Transfer;
    use kvferry_testkit::layout::{ModelSpec, Preset};
    use kvferry_testkit::scenario::Scenario;

    use super::*;

    const TPB: u32 = 8;

    /// Two layers of K and V, 2 KV heads of 8 BF16 elements, 8 tokens per block (256-byte
    /// buffers at TP 1), 16 slots per pool: page tables from the testkit's builder.
    fn model() -> Model {
        Model {
            slots: 16,
            ..Model::gqa(2, 2, 8, TPB)
        }
    }

    /// An instance of [`model`] under TP `tp`, or attention DP over `tp` ranks.
    fn instance(context: bool, tp: u32, attention_dp: bool) -> Deploy {
        let m = model();
        let d = if context {
            Deploy::context(tp, &m)
        } else {
            Deploy::generation(tp, &m)
        };
        let d = d.planner(PLANNER_ID);
        if attention_dp { d.adp() } else { d }
    }

    /// Rank `rank` of a context (or generation) instance of [`model`].
    fn rank(context: bool, tp: u32, rank: u32, attention_dp: bool) -> RankInfo {
        instance(context, tp, attention_dp).rank(&model(), rank)
    }

    /// The base address of a rank's one pool.
    fn base(rank: &RankInfo) -> u64 {
        rank.page_table.pools[0].base
    }

    fn deployment(pp: u32, cp: u32) -> Deployment {
        Deployment {
            architecture: "LlamaForCausalLM".into(),
            mapping: Mapping {
                tp: 2,
                pp,
                cp,
                moe_tp: 1,
                moe_ep: 1,
                attention_dp: false,
            },
        }
    }

    fn refused_field(result: Result<impl std::fmt::Debug, PlanError>) -> String {
        let error = result.expect_err("should be refused");
        assert_eq!(error.kind(), ErrorKind::PEER_INCOMPATIBLE, "{error}");
        error.refusal().expect("a refusal").field.to_string()
    }

    #[test]
    fn module_identity() {
        let module = planner_module();
        assert_eq!(module.id(), PLANNER_ID);
        assert_eq!(
            module.describer(),
            kvferry_planner_abi::DEFAULT_DESCRIBER_ID
        );
        assert_eq!(module.library_version(), env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn deployments_with_pp_or_cp_are_unsupported() {
        let module = planner_module();
        module.check_deployment(&deployment(1, 1)).unwrap();
        for (pp, cp, field) in [(2, 1, "mapping.pp"), (1, 2, "mapping.cp")] {
            let error = module.check_deployment(&deployment(pp, cp)).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::UNSUPPORTED);
            let refusal = error.deployment_refusal().expect("a field-level refusal");
            assert_eq!(refusal.field.as_str(), field, "{error}");
            assert_eq!(refusal.supported.as_str(), "1", "{error}");
        }
        let mut other = deployment(1, 1);
        other.architecture = "DeepseekV3ForCausalLM".into();
        let error = module.check_deployment(&other).unwrap_err();
        let refusal = error.deployment_refusal().expect("a field-level refusal");
        assert_eq!(refusal.field.as_str(), "architecture", "{error}");
        assert_eq!(module.specificity_level(), Specificity::ARCHITECTURE);
    }

    #[test]
    fn only_single_view_paged_tables_instantiate() {
        let mut me = rank(true, 1, 0, false);
        SameLayoutPlanner::new(&me).unwrap();
        me.page_table.groups[0].kind = GroupKind::STATE;
        let error = SameLayoutPlanner::new(&me).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::UNSUPPORTED);
    }

    #[test]
    fn check_peer_names_the_differing_field() {
        let planner = SameLayoutPlanner;
        let me = rank(true, 2, 0, false);
        let peer = rank(false, 2, 0, false);
        planner.check_peer(&me, &peer).unwrap();

        let mut other = peer.clone();
        other.page_table.tokens_per_block = 16;
        assert_eq!(
            refused_field(planner.check_peer(&me, &other)),
            "tokens_per_block"
        );

        let mut other = peer.clone();
        other.page_table.groups[0].views[0].layout.dtype = "fp8_e4m3".into();
        assert_eq!(
            refused_field(planner.check_peer(&me, &other)),
            "groups[0].views[0].layout.dtype"
        );

        let mut other = peer.clone();
        other.page_table.pools[0].slot_bytes *= 2;
        other.page_table.pools[0].slot_stride *= 2;
        assert_eq!(
            refused_field(planner.check_peer(&me, &other)),
            "groups[0].views[0].slot_bytes"
        );

        let mut other = peer.clone();
        // Layer 1 first in the slot, then layer 0.
        let layer = other.page_table.pools[0].slot_bytes / 2;
        for entry in other.page_table.groups[0].views[0].entries.iter_mut() {
            entry.offset ^= layer;
        }
        assert_eq!(
            refused_field(planner.check_peer(&me, &other)),
            "groups[0].views[0].entries[0]"
        );

        let other = rank(false, 4, 0, false);
        assert_eq!(refused_field(planner.check_peer(&me, &other)), "tp_size");
    }

    #[test]
    fn targets_are_the_same_tp_rank_in_the_peer_dp_group() {
        let planner = SameLayoutPlanner;
        let me = rank(false, 2, 1, false);
        let peer = rank(true, 2, 0, false);
        let targets = planner.targets(&me, &peer, 0).unwrap();
        assert_eq!(targets.ranks.as_slice(), &[1]);
        assert!(targets.uniform);

        // Attention DP on both sides: each DP group is one rank.
        let me = rank(false, 4, 1, true);
        let peer = rank(true, 4, 0, true);
        assert_eq!(
            planner.targets(&me, &peer, 3).unwrap().ranks.as_slice(),
            &[3]
        );
        assert_eq!(
            planner.targets(&me, &peer, 4).unwrap_err().kind(),
            ErrorKind::INVALID_INPUT
        );

        let peer = rank(true, 4, 0, false);
        assert_eq!(
            refused_field(planner.targets(&me, &peer, 0)),
            "attention_dp"
        );
    }

    /// Rows for one side from a slot table of the single group.
    fn rows(rank: &RankInfo, slots: Vec<i64>) -> Vec<LayerGroupRows> {
        rows_of(rank, &[SlotTable::from(slots)])
    }

    #[test]
    fn pair_copies_whole_rows_both_sides_hold() {
        let planner = SameLayoutPlanner;
        let (me, peer) = (rank(true, 1, 0, false), rank(false, 1, 0, false));
        let (src, dst) = (base(&me), base(&peer));
        let row = me.page_table.pools[0].slot_bytes;
        assert_eq!(row, 2 * 2 * 256, "2 layers of K and V");
        // Prompt of 19 tokens, tpb 8: three ordinals. The receiver already holds ordinal 0.
        let mine = rows(&me, vec![7, 1, 5]);
        let theirs = rows(&peer, vec![-1, 4, 0]);
        let plan = planner
            .pair(&me, &peer, &mine, &theirs, &PairRequest::whole(19))
            .unwrap();
        let fragments: Vec<_> = plan.iter().collect();
        assert_eq!(
            fragments,
            [(src + row, dst + 4 * row, row), (src + 5 * row, dst, row),]
        );

        // A chunk: tokens [8, 16) is ordinal 1 only.
        let chunk = PairRequest {
            token_range: TokenRange { start: 8, end: 16 },
            prompt_len: 19,
            dst_start_token: ROption::RNone,
            is_last: false,
        };
        let plan = planner.pair(&me, &peer, &mine, &theirs, &chunk).unwrap();
        assert_eq!(plan.fragments(), 1);

        // dst_start_token 16 skips ordinals 0 and 1.
        let theirs_all = rows(&peer, vec![2, 4, 0]);
        let mut late = PairRequest::whole(19);
        late.dst_start_token = ROption::RSome(16);
        let plan = planner.pair(&me, &peer, &mine, &theirs_all, &late).unwrap();
        assert_eq!(plan.iter().collect::<Vec<_>>(), [(src + 5 * row, dst, row)]);

        // A view the receiver excluded gets nothing.
        let plan = planner
            .pair(&me, &peer, &mine, &[], &PairRequest::whole(19))
            .unwrap();
        assert!(plan.is_empty());
    }

    #[test]
    fn pair_refuses_rows_of_different_shards() {
        let planner = SameLayoutPlanner;
        let me = rank(true, 2, 0, false);
        let peer = rank(false, 2, 1, false);
        let error = planner
            .pair(
                &me,
                &peer,
                &rows(&me, vec![0]),
                &rows(&peer, vec![1]),
                &PairRequest::whole(8),
            )
            .unwrap_err();
        assert_eq!(error.kind(), ErrorKind::INVALID_INPUT);
    }

    #[test]
    fn the_exported_module_drives_the_same_planner() {
        let (me, peer) = (rank(true, 1, 0, false), rank(false, 1, 0, false));
        let planner = planner_module().instantiate(&me).unwrap();
        planner.check_peer(&me, &peer).unwrap();
        let plan = planner
            .pair(
                &me,
                &peer,
                &rows(&me, vec![3, 2]),
                &rows(&peer, vec![0, 1]),
                &PairRequest::whole(16),
            )
            .unwrap();
        assert_eq!(plan.fragments(), 2);
        assert_eq!(plan.total_bytes(), 2 * me.page_table.pools[0].slot_bytes);
    }

    #[test]
    fn every_byte_of_a_request_lands_once_and_nothing_else_changes() {
        // The testkit's oracle: tag-filled sources, canary-primed destinations, every byte of
        // every pool checked after the plans ran. TP 2 and attention DP over 2 ranks, whole
        // or in chunks, with a lost sender block and a cached receiver prefix.
        let m = model();
        for attention_dp in [false, true] {
            for pieces in [vec![(0, 37)], vec![(0, 16), (16, 37)]] {
                let mut t = Transfer::new(
                    &m,
                    instance(true, 2, attention_dp),
                    instance(false, 2, attention_dp),
                    37,
                );
                t.ctx_dp_rank = u32::from(attention_dp);
                t.pieces = pieces;
                t.ctx_holes = vec![3];
                t.gen_holes = vec![0];
                let reports = t.run_every_group(SameLayoutPlanner::new).unwrap();
                for report in &reports {
                    assert!(report.is_ok(), "{report}");
                    // 5 blocks, one lost, one cached: 3 whole rows into every receiver.
                    let covered: u64 = report
                        .receivers
                        .iter()
                        .map(|r| {
                            let info = t.generation.rank(&m, r.rank);
                            3 * info.page_table.pools[0].slot_bytes
                        })
                        .sum();
                    assert_eq!(report.verification.bytes_covered, covered, "{report}");
                    assert_eq!(report.bytes, covered, "{report}");
                }
            }
        }
        // A real model: DeepSeek-V3's latent cache from DP rank 0 of dep2 to DP rank 1 of dep2.
        let mut s = Scenario::new(
            ModelSpec::new(Preset::DeepseekV3),
            "dep2".parse().unwrap(),
            "dep2".parse().unwrap(),
            100,
        );
        s.gen_dp_rank = 1;
        s.planner_id = PLANNER_ID.to_string();
        let factory = |info: &RankInfo| -> Result<std::sync::Arc<dyn TransferPlanner>, PlanError> {
            Ok(std::sync::Arc::new(SameLayoutPlanner::new(info)?))
        };
        let report = s.run(&factory, &factory).unwrap();
        assert!(report.is_ok(), "{report}");
        assert_eq!(report.pairs.len(), 1);
        assert_eq!(
            report.bytes,
            4 * 1_124_352,
            "4 blocks of 61 layers × 32 × 576 B"
        );
    }
}
