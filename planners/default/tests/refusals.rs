//! One test per refusal of semantics §3: each names the field and both values, and the
//! check refuses from either side of the pair.

use kvferry_planner_abi::ffi::{RString, RVec};
use kvferry_planner_abi::{
    BufferEntry, ErrorKind, GroupKind, LayoutKind, PeerRefusal, PlannerPlugin, PoolView, RankInfo,
    RoleLayout, TransferPlanner, ViewId,
};
use kvferry_planner_default::DefaultPlanner;
use kvferry_testkit::builder::{
    Deploy, Model, local_layers, piece, role_vec, rows_excluding, rows_of, tables,
};

/// The refusal `me` gives `peer`, after checking the peer gives the mirror image.
fn refused(me: &RankInfo, peer: &RankInfo) -> PeerRefusal {
    let one = |a: &RankInfo, b: &RankInfo| {
        let err = DefaultPlanner::new(a)
            .expect("planner")
            .check_peer(a, b)
            .expect_err("the peer must be refused");
        assert_eq!(err.kind(), ErrorKind::PEER_INCOMPATIBLE, "{err}");
        err.refusal().expect("a field-level refusal").clone()
    };
    let ours = one(me, peer);
    let theirs = one(peer, me);
    assert_eq!(ours.field, theirs.field, "{ours} / {theirs}");
    assert_eq!((&ours.ours, &ours.theirs), (&theirs.theirs, &theirs.ours));
    ours
}

fn accepted(me: &RankInfo, peer: &RankInfo) {
    for (a, b) in [(me, peer), (peer, me)] {
        DefaultPlanner::new(a)
            .expect("planner")
            .check_peer(a, b)
            .unwrap_or_else(|e| panic!("refused: {e}"));
    }
}

fn assert_field(r: &PeerRefusal, field: &str, ours: &str, theirs: &str) {
    assert_eq!(
        (r.field.as_str(), r.ours.as_str(), r.theirs.as_str()),
        (field, ours, theirs),
        "{r}"
    );
}

fn gqa() -> Model {
    Model::gqa(4, 4, 4, 4)
}

/// The first view of the first group of a rank.
fn view(ri: &mut RankInfo, group: usize, v: usize) -> &mut PoolView {
    &mut ri.page_table.groups[group].views[v]
}

#[test]
fn t1_both_sides_with_context_parallelism() {
    let m = gqa();
    let r = refused(
        &Deploy::generation(1, &m).cp(2).rank(&m, 0),
        &Deploy::context(1, &m).cp(2).rank(&m, 0),
    );
    assert_field(&r, "cp_size", "2", "2");
    assert!(r.reason.contains("helix"), "{r}");
}

#[test]
fn t2_helix_with_different_block_sizes() {
    let (a, b) = (gqa(), Model { tpb: 8, ..gqa() });
    let r = refused(
        &Deploy::generation(1, &a).cp(2).rank(&a, 0),
        &Deploy::context(1, &b).rank(&b, 0),
    );
    assert_field(&r, "tokens_per_block", "4", "8");
    assert!(r.reason.contains("helix"), "{r}");
}

#[test]
fn hnd_block_sizes_that_divide_are_accepted() {
    // §3.2 rule 4: HND views re-block when one block size is a multiple of the other.
    let (a, b) = (gqa(), Model { tpb: 8, ..gqa() });
    for (ga, cb) in [(1, 1), (2, 4), (4, 1)] {
        accepted(
            &Deploy::generation(ga, &a).rank(&a, 0),
            &Deploy::context(cb, &b).rank(&b, 0),
        );
    }
}

#[test]
fn nhd_views_with_different_block_sizes_are_refused() {
    // An NHD buffer is token-major: its bytes are addressed by token inside a block.
    let a = Model {
        layout: LayoutKind::NHD,
        ..gqa()
    };
    let b = Model {
        tpb: 8,
        ..a.clone()
    };
    let r = refused(
        &Deploy::generation(1, &a).rank(&a, 0),
        &Deploy::context(1, &b).rank(&b, 0),
    );
    assert_field(&r, "tokens_per_block", "4", "8");
    assert!(r.reason.contains("HND views only"), "{r}");
    assert!(r.reason.contains("nhd"), "{r}");
}

#[test]
fn block_sizes_that_do_not_divide_are_refused() {
    let (a, b) = (gqa(), Model { tpb: 6, ..gqa() });
    let r = refused(
        &Deploy::generation(1, &a).rank(&a, 0),
        &Deploy::context(1, &b).rank(&b, 0),
    );
    assert_field(&r, "tokens_per_block", "4", "6");
    assert!(r.reason.contains("6 is not a multiple of 4"), "{r}");
}

#[test]
fn re_blocking_needs_declared_shard_units() {
    let (a, b) = (gqa(), Model { tpb: 8, ..gqa() });
    let mut me = Deploy::generation(1, &a).rank(&a, 0);
    let mut peer = Deploy::context(1, &b).rank(&b, 0);
    view(&mut me, 0, 0).layout.shard_unit_bytes = 0;
    view(&mut peer, 0, 0).layout.shard_unit_bytes = 0;
    let r = refused(&me, &peer);
    assert_eq!(r.field.as_str(), "layout.shard_unit_bytes", "{r}");
}

#[test]
fn t3_chunked_transfer_with_helix_is_refused_at_plan_time() {
    let m = gqa();
    let ctx = Deploy::context(1, &m).rank(&m, 0);
    let generation = Deploy::generation(1, &m).cp(2).rank(&m, 1);
    accepted(&generation, &ctx);
    let planner = DefaultPlanner::new(&ctx).expect("planner");
    let ours = rows_of(&ctx, &tables(&ctx.page_table, &[0, 1, 2, 3], &[]));
    let theirs = rows_of(&generation, &tables(&generation.page_table, &[0, 1], &[]));
    let err = planner
        .pair(&ctx, &generation, &ours, &theirs, &piece(0, 8, 16, false))
        .expect_err("chunked under CP");
    let r = err.refusal().expect("refusal");
    assert_field(r, "cp_size", "1", "2");
    assert!(r.reason.contains("[0, 8) of a 16-token prompt"), "{r}");
    // The whole prompt in one piece is fine.
    let plan = planner
        .pair(&ctx, &generation, &ours, &theirs, &piece(0, 16, 16, true))
        .expect("monolithic");
    assert_eq!(plan.fragments(), 2);
}

#[test]
fn a_sender_with_context_parallelism_is_refused_at_plan_time() {
    let m = gqa();
    let sender = Deploy::context(1, &m).cp(2).rank(&m, 0);
    let receiver = Deploy::generation(1, &m).rank(&m, 0);
    let t = tables(&sender.page_table, &[0], &[]);
    let err = DefaultPlanner::new(&sender)
        .expect("planner")
        .pair(
            &sender,
            &receiver,
            &rows_of(&sender, &t),
            &rows_of(&receiver, &t),
            &piece(0, 4, 4, true),
        )
        .expect_err("context CP");
    assert_field(err.refusal().expect("refusal"), "cp_size", "2", "1");
}

#[test]
fn t4_layer_counts_may_differ() {
    let (four, five) = (gqa(), gqa().with_layers(5));
    accepted(
        &Deploy::generation(2, &four).rank(&four, 0),
        &Deploy::context(2, &five).rank(&five, 0),
    );
}

#[test]
fn tp_widths_must_divide() {
    let m = Model::gqa(2, 12, 4, 4);
    let r = refused(
        &Deploy::generation(2, &m).rank(&m, 0),
        &Deploy::context(3, &m).rank(&m, 0),
    );
    assert_field(&r, "tp_size", "2 per DP group", "3 per DP group");
}

#[test]
fn mapper_kinds_differ() {
    let (a, b) = (
        gqa(),
        Model {
            layout: LayoutKind::NHD,
            ..gqa()
        },
    );
    let r = refused(
        &Deploy::generation(1, &a).rank(&a, 0),
        &Deploy::context(1, &b).rank(&b, 0),
    );
    assert_field(&r, "layout.kind", "hnd", "nhd");
    assert!(r.reason.contains("incompatible mapper kinds"), "{r}");
}

#[test]
fn element_types_differ() {
    let (a, b) = (
        gqa(),
        Model {
            dtype: "fp16",
            ..gqa()
        },
    );
    let r = refused(
        &Deploy::generation(1, &a).rank(&a, 0),
        &Deploy::context(1, &b).rank(&b, 0),
    );
    assert_field(&r, "layout.dtype", "bf16", "fp16");
}

#[test]
fn element_widths_differ() {
    let m = gqa();
    let (a, mut b) = (
        Deploy::generation(1, &m).rank(&m, 0),
        Deploy::context(1, &m).rank(&m, 0),
    );
    view(&mut b, 0, 0).layout.elem_bits = 8;
    assert_field(&refused(&a, &b), "layout.elem_bits", "16", "8");
}

#[test]
fn shard_counts_must_divide() {
    let m = Model::gqa(2, 12, 4, 4);
    let (a, mut b) = (
        Deploy::generation(2, &m).rank(&m, 0),
        Deploy::context(4, &m).rank(&m, 0),
    );
    // A declaration of 3 shards of 4 heads with the region of 3 heads: inconsistent.
    view(&mut b, 0, 0).layout.num_shards = 3;
    assert_field(&refused(&a, &b), "layout.num_shards", "2", "3");
}

#[test]
fn aggregated_region_sizes_differ() {
    let (a, b) = (
        gqa(),
        Model {
            head_dim: 8,
            ..gqa()
        },
    );
    let r = refused(
        &Deploy::generation(2, &a).rank(&a, 0),
        &Deploy::context(1, &b).rank(&b, 0),
    );
    assert_field(&r, "bytes_per_layer × num_shards", "128 × 2", "512 × 1");
}

#[test]
fn a_replicated_view_declared_as_sharded() {
    let mut m = Model::hybrid(8, 4);
    if let Some(s) = m.state.as_mut() {
        s.replicated_side = Some(32);
    }
    let (a, mut b) = (
        Deploy::generation(1, &m).rank(&m, 0),
        Deploy::context(1, &m).rank(&m, 0),
    );
    // Half the bytes declared as one of two shards: the aggregate matches, the copy cannot.
    let side = view(&mut b, 1, 2);
    side.layout.num_shards = 2;
    for (i, e) in side.entries.iter_mut().enumerate() {
        (e.offset, e.size) = (i as u64 * 16, 16);
    }
    assert_field(&refused(&a, &b), "bytes_per_layer", "32", "16");
}

#[test]
fn shard_units_differ() {
    let m = gqa();
    let (a, mut b) = (
        Deploy::generation(1, &m).rank(&m, 0),
        Deploy::context(1, &m).rank(&m, 0),
    );
    view(&mut b, 0, 0).layout.shard_unit_bytes = 16;
    assert_field(&refused(&a, &b), "layout.shard_unit_bytes", "32", "16");
}

#[test]
fn a_resplit_needs_declared_shard_units() {
    let m = gqa();
    let (mut a, mut b) = (
        Deploy::generation(2, &m).rank(&m, 0),
        Deploy::context(1, &m).rank(&m, 0),
    );
    view(&mut a, 0, 0).layout.shard_unit_bytes = 0;
    view(&mut b, 0, 0).layout.shard_unit_bytes = 0;
    let r = refused(&a, &b);
    assert_field(&r, "layout.shard_unit_bytes", "0", "0");
    assert!(r.reason.contains("sub-byte"), "{r}");
    // Equal shard counts copy intact and need no unit.
    let (mut a, mut b) = (
        Deploy::generation(2, &m).rank(&m, 0),
        Deploy::context(2, &m).rank(&m, 0),
    );
    view(&mut a, 0, 0).layout.shard_unit_bytes = 0;
    view(&mut b, 0, 0).layout.shard_unit_bytes = 0;
    accepted(&a, &b);
}

#[test]
fn a_layer_must_be_whole_shard_units() {
    let m = gqa();
    let (mut a, mut b) = (
        Deploy::generation(1, &m).rank(&m, 0),
        Deploy::context(1, &m).rank(&m, 0),
    );
    view(&mut a, 0, 0).layout.shard_unit_bytes = 48;
    view(&mut b, 0, 0).layout.shard_unit_bytes = 48;
    assert_field(
        &refused(&a, &b),
        "layout.shard_unit_bytes",
        "48 in a 256-byte layer",
        "48 in a 256-byte layer",
    );
}

#[test]
fn a_resplit_needs_equal_buffer_counts() {
    let m = gqa();
    let (a, mut b) = (
        Deploy::generation(2, &m).rank(&m, 0),
        Deploy::context(1, &m).rank(&m, 0),
    );
    // K and V declared as one entry per layer on the prefill side.
    let v = view(&mut b, 0, 0);
    v.entries = (0..4)
        .map(|l| BufferEntry {
            local_layer: l,
            offset: u64::from(l) * 256,
            size: 256,
        })
        .collect();
    assert_field(&refused(&a, &b), "buffers_per_layer", "2", "1");
}

#[test]
fn a_resplit_needs_equal_buffers() {
    let m = gqa();
    let (a, mut b) = (
        Deploy::generation(2, &m).rank(&m, 0),
        Deploy::context(1, &m).rank(&m, 0),
    );
    for e in view(&mut b, 0, 0).entries.iter_mut() {
        let layer = u64::from(e.local_layer) * 256;
        (e.offset, e.size) = if e.offset == layer {
            (layer, 96)
        } else {
            (layer + 96, 160)
        };
    }
    let r = refused(&a, &b);
    assert_eq!(r.field.as_str(), "entries.size", "{r}");
    assert!(r.theirs.contains("{96, 160}"), "{r}");
}

#[test]
fn nhd_has_no_place_in_a_state_group() {
    let m = Model::hybrid(8, 4);
    let (mut a, mut b) = (
        Deploy::generation(1, &m).rank(&m, 0),
        Deploy::context(1, &m).rank(&m, 0),
    );
    for ri in [&mut a, &mut b] {
        view(ri, 1, 1).layout.kind = LayoutKind::NHD;
    }
    let r = refused(&a, &b);
    assert_field(&r, "layout.kind", "nhd", "nhd");
    assert!(r.reason.contains("STATE"), "{r}");
}

#[test]
fn section_counts_differ() {
    let m = Model::hybrid(8, 4);
    let (a, mut b) = (
        Deploy::generation(1, &m).rank(&m, 0),
        Deploy::context(1, &m).rank(&m, 0),
    );
    view(&mut b, 1, 0).layout.section_bytes = RVec::from(vec![64, 64]);
    assert_field(
        &refused(&a, &b),
        "layout.section_bytes",
        "3 sections",
        "2 sections",
    );
}

#[test]
fn aggregated_sections_differ() {
    let m = Model::hybrid(8, 4);
    let (a, mut b) = (
        Deploy::generation(2, &m).rank(&m, 0),
        Deploy::context(1, &m).rank(&m, 0),
    );
    view(&mut b, 1, 0).layout.section_bytes = RVec::from(vec![48, 40, 40]);
    assert_field(
        &refused(&a, &b),
        "layout.section_bytes[0] × num_shards",
        "32 × 2",
        "48 × 1",
    );
}

#[test]
fn recurrent_state_geometry_differs() {
    // §3.4 rule 1/2: SSM bytes per head (head_dim × d_state × dtype) differ.
    let a = Model::hybrid(8, 4);
    let mut b = a.clone();
    if let Some(s) = b.state.as_mut() {
        s.ssm_head_bytes = 32;
    }
    let r = refused(
        &Deploy::generation(2, &a).rank(&a, 0),
        &Deploy::context(1, &b).rank(&b, 0),
    );
    assert_eq!(r.field.as_str(), "bytes_per_layer × num_shards", "{r}");
    assert_eq!((r.ours.as_str(), r.theirs.as_str()), ("32 × 2", "128 × 1"));
}

#[test]
fn a_replicated_side_state_on_one_side_only() {
    // §3.4 rule 4.
    let a = Model::hybrid(8, 4);
    let mut b = a.clone();
    if let Some(s) = b.state.as_mut() {
        s.replicated_side = Some(8);
    }
    let r = refused(
        &Deploy::generation(1, &a).rank(&a, 0),
        &Deploy::context(1, &b).rank(&b, 0),
    );
    assert_eq!(r.field.as_str(), "roles", "{r}");
    assert!(r.theirs.contains("{side}"), "{r}");
    assert!(
        r.reason.contains("recurrent state of global layer 0"),
        "{r}"
    );
}

#[test]
fn a_view_spanning_two_peer_layer_groups() {
    // §3.5: the decode side groups layers 0-1 and 2-3 apart (e.g. two windows).
    let m = gqa();
    let ctx = Deploy::context(1, &m).rank(&m, 0);
    let mut generation = Deploy::generation(1, &m).rank(&m, 0);
    let mut second = generation.page_table.groups[0].clone();
    let first = &mut generation.page_table.groups[0];
    first.layers = local_layers(&[0, 1]);
    first.views[0].entries = first.views[0]
        .entries
        .iter()
        .copied()
        .filter(|e| e.local_layer < 2)
        .collect();
    second.layers = local_layers(&[2, 3]);
    second.views[0].entries = second.views[0]
        .entries
        .iter()
        .filter(|e| e.local_layer >= 2)
        .map(|e| BufferEntry {
            local_layer: e.local_layer - 2,
            ..*e
        })
        .collect();
    generation.page_table.groups.push(second);
    let err = DefaultPlanner::new(&ctx)
        .expect("planner")
        .check_peer(&ctx, &generation)
        .expect_err("refused");
    let r = err.refusal().expect("refusal");
    assert_eq!(r.field.as_str(), "layer_group", "{r}");
    assert!(r.ours.contains("[0, 1, 2, 3]"), "{r}");
    // And from the decode side, whose views each sit in one context group, the reverse
    // matching direction refuses the same way.
    let err = DefaultPlanner::new(&generation)
        .expect("planner")
        .check_peer(&generation, &ctx)
        .expect_err("refused");
    assert_eq!(
        err.refusal().expect("refusal").field.as_str(),
        "layer_group"
    );
}

#[test]
fn mla_against_separate_heads() {
    // §13.13: an MLA peer for a non-MLA rank.
    let (gqa, mla) = (Model::gqa(4, 1, 576, 4), Model::mla(4, 576, 4));
    let r = refused(
        &Deploy::generation(1, &gqa).rank(&gqa, 0),
        &Deploy::context(1, &mla).rank(&mla, 0),
    );
    assert_field(&r, "roles", "{key,value}", "{key}");
    assert!(r.reason.contains("global layer 0"), "{r}");
}

/// A decode rank with an extra `swa` view over layers 2 and 3 (bounded replay: it
/// rebuilds those bytes itself when it excludes the view).
fn with_swa_view(mut ri: RankInfo) -> RankInfo {
    let pool = ri.page_table.pools[0].clone();
    ri.page_table.pools.push(kvferry_planner_abi::PhysicalPool {
        base: pool.base + (1 << 29),
        slot_bytes: 64,
        slot_stride: 64,
        ..pool
    });
    ri.page_table.groups[0].views.push(PoolView {
        pool: 1,
        entries: RVec::from(vec![
            BufferEntry {
                local_layer: 2,
                offset: 0,
                size: 32,
            },
            BufferEntry {
                local_layer: 3,
                offset: 32,
                size: 32,
            },
        ]),
        roles: role_vec(&["swa"]),
        layout: RoleLayout {
            dtype: RString::from("bf16"),
            ..RoleLayout::whole(LayoutKind::REPLICATED, "bf16", 16)
        },
    });
    ri
}

#[test]
fn bounded_replay_mismatch_unless_the_receiver_excludes_the_view() {
    // §3.6: the sender holds layers 2 and 3 but keeps no `swa` bytes for them.
    let m = gqa();
    let ctx = Deploy::context(1, &m).rank(&m, 0);
    let generation = with_swa_view(Deploy::generation(1, &m).rank(&m, 0));
    accepted(&generation, &ctx);
    let planner = DefaultPlanner::new(&ctx).expect("planner");
    let ours = rows_of(&ctx, &tables(&ctx.page_table, &[0, 1], &[]));
    let t = tables(&generation.page_table, &[2, 3], &[]);
    let err = planner
        .pair(
            &ctx,
            &generation,
            &ours,
            &rows_of(&generation, &t),
            &piece(0, 8, 8, true),
        )
        .expect_err("the swa view is not excluded");
    let r = err.refusal().expect("refusal");
    assert_eq!(r.field.as_str(), "excluded_views", "{r}");
    assert!(r.ours.contains("global layer 2"), "{r}");
    assert!(r.theirs.contains("{swa}"), "{r}");
    assert!(r.reason.contains("bounded replay mismatch"), "{r}");

    let swa = ViewId { group: 0, view: 1 };
    let excluded = rows_excluding(&generation, &t, &[swa]);
    let plan = planner
        .pair(&ctx, &generation, &ours, &excluded, &piece(0, 8, 8, true))
        .expect("excluded");
    let swa_pool = &generation.page_table.pools[1];
    assert_eq!(plan.fragments(), 2);
    assert!(plan.dst.iter().all(|&d| d < swa_pool.base));
    assert_eq!(plan.total_bytes(), 2 * ctx.page_table.pools[0].slot_bytes);
}

#[test]
fn malformed_peers_are_invalid_input_not_refusals() {
    let m = gqa();
    let me = Deploy::generation(1, &m).rank(&m, 0);
    let mut peer = Deploy::context(1, &m).rank(&m, 0);
    peer.layers_per_pp = RVec::from(vec![2, 2]);
    let err = DefaultPlanner::new(&me)
        .expect("planner")
        .check_peer(&me, &peer)
        .expect_err("malformed");
    assert_eq!(err.kind(), ErrorKind::INVALID_INPUT);
    assert!(
        err.message()
            .contains("layers_per_pp has 2 entries for pp_size 1"),
        "{err}"
    );
    let mut peer = Deploy::context(1, &m).rank(&m, 0);
    peer.page_table.groups[0].kind = GroupKind::STATE;
    peer.page_table.groups[0].views[0].entries[1].offset += 1;
    let err = DefaultPlanner::new(&me)
        .expect("planner")
        .check_peer(&me, &peer)
        .expect_err("malformed");
    assert_eq!(err.kind(), ErrorKind::INVALID_INPUT, "{err}");
    assert!(
        err.message()
            .contains("page table of instance prefill rank 0"),
        "{err}"
    );
}
