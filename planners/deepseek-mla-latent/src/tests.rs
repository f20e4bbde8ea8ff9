use kvferry_planner_abi::{
    BufferEntry, ErrorKind, LayerGroup, LayoutKind, LocalLayer, Mapping, MemoryType, PoolView,
    RoleLayout, SlotTable, TokenRange, ViewId, ffi::ROption, rows,
};

use super::*;

const LATENT: u64 = 576;

/// A DeepSeek-V3-shaped latent page table: `layers` back to back, `tpb` tokens per slot.
fn table(layers: &[u32], tpb: u32, elem: u64, base: u64, slots: u64, pad: u64) -> PageTable {
    let layer_bytes = u64::from(tpb) * LATENT * elem;
    let slot_bytes = layer_bytes * layers.len() as u64;
    let (dtype, bits) = if elem == 1 {
        ("fp8_e4m3", 8)
    } else {
        ("bf16", 16)
    };
    PageTable {
        tokens_per_block: tpb,
        pools: vec![kvferry_planner_abi::PhysicalPool {
            base,
            slot_bytes,
            slot_stride: slot_bytes + pad,
            num_slots: slots,
            memory_type: MemoryType::VRAM,
        }]
        .into(),
        groups: vec![LayerGroup {
            kind: GroupKind::PAGED,
            window: ROption::RNone,
            layers: layers
                .iter()
                .enumerate()
                .map(|(i, &g)| LocalLayer {
                    local: i as u32,
                    global: g,
                })
                .collect(),
            views: vec![PoolView {
                pool: 0,
                entries: (0..layers.len())
                    .map(|i| BufferEntry {
                        local_layer: i as u32,
                        offset: i as u64 * layer_bytes,
                        size: layer_bytes,
                    })
                    .collect(),
                roles: vec!["key".into()].into(),
                layout: RoleLayout::whole(LayoutKind::HND, dtype, bits),
            }]
            .into(),
        }]
        .into(),
    }
}

fn v3_layers() -> Vec<u32> {
    (0..61).collect()
}

fn rank(name: &str, dp_size: u32, dp_rank: u32, page_table: PageTable) -> RankInfo {
    RankInfo {
        instance_name: name.into(),
        instance_rank: dp_rank,
        tp_size: dp_size,
        tp_rank: dp_rank,
        pp_size: 1,
        pp_rank: 0,
        cp_size: 1,
        cp_rank: 0,
        dp_size,
        dp_rank,
        attention_dp: true,
        layers_per_pp: vec![61].into(),
        page_table,
        planner_id: DeepseekMlaLatent::PLANNER_ID.into(),
        describer_id: kvferry_planner_abi::DEFAULT_DESCRIBER_ID.into(),
        planner_blob: Default::default(),
    }
}

fn deployment(arch: &str, tp: u32, pp: u32, cp: u32, adp: bool) -> Deployment {
    Deployment {
        architecture: arch.into(),
        mapping: Mapping {
            tp,
            pp,
            cp,
            moe_tp: 1,
            moe_ep: tp,
            attention_dp: adp,
        },
    }
}

fn ctx_gen() -> (RankInfo, RankInfo) {
    let ctx = rank("ctx", 4, 1, table(&v3_layers(), 32, 1, 0x1000_0000, 64, 0));
    let gen_ = rank("gen", 8, 5, table(&v3_layers(), 32, 1, 0x9000_0000, 64, 0));
    (ctx, gen_)
}

fn plan(
    ctx: &RankInfo,
    gen_: &RankInfo,
    src: &[i64],
    dst: &[i64],
    request: &PairRequest,
) -> TransferPlan {
    let p = DeepseekMlaLatent::new(ctx).unwrap();
    let mine = rows(&ctx.page_table, &[SlotTable::new(src.to_vec())], &[]).unwrap();
    let theirs = rows(&gen_.page_table, &[SlotTable::new(dst.to_vec())], &[]).unwrap();
    p.pair(ctx, gen_, &mine, &theirs, request).unwrap()
}

fn refusal_field(err: &PlanError) -> &str {
    assert_eq!(err.kind(), ErrorKind::PEER_INCOMPATIBLE, "{err}");
    err.refusal().unwrap().field.as_str()
}

#[test]
fn supports_deepseek_v3_under_attention_dp_at_any_width() {
    for width in [1, 2, 4, 8, 16, 32] {
        DeepseekMlaLatent::supports_deployment(&deployment(ARCHITECTURE, width, 1, 1, true))
            .unwrap();
    }
}

#[test]
fn refuses_other_deployments_with_the_reason() {
    let cases = [
        (
            deployment("LlamaForCausalLM", 4, 1, 1, true),
            ("architecture", "LlamaForCausalLM", ARCHITECTURE),
        ),
        (
            deployment(ARCHITECTURE, 4, 1, 1, false),
            ("mapping.attention_dp", "false", "true (depN)"),
        ),
        (
            deployment(ARCHITECTURE, 4, 2, 1, true),
            ("mapping.pp", "2", "1"),
        ),
        (
            deployment(ARCHITECTURE, 4, 1, 2, true),
            ("mapping.cp", "2", "1"),
        ),
    ];
    for (d, (field, found, supported)) in cases {
        let err = DeepseekMlaLatent::supports_deployment(&d).unwrap_err();
        assert_eq!(
            (
                err.field.as_str(),
                err.found.as_str(),
                err.supported.as_str()
            ),
            (field, found, supported),
            "{d}: {err}"
        );
        assert!(!err.reason.is_empty(), "{d}: {err}");
    }
}

#[test]
fn row_bytes_match_the_real_model() {
    // semantics §12.1: 61 layers × 32 tokens × 576 B at fp8 = 1,124,352 B per slot.
    let t = table(&v3_layers(), 32, 1, 0, 1, 0);
    assert_eq!(t.pools[0].slot_bytes, 1_124_352);
    let t = table(&v3_layers(), 32, 2, 0, 1, 0);
    assert_eq!(t.pools[0].slot_bytes, 2_248_704);
}

#[test]
fn check_peer_accepts_the_same_latent_at_another_dp_width() {
    let (ctx, gen_) = ctx_gen();
    let p = DeepseekMlaLatent::new(&ctx).unwrap();
    p.check_peer(&ctx, &gen_).unwrap();
    DeepseekMlaLatent::new(&gen_)
        .unwrap()
        .check_peer(&gen_, &ctx)
        .unwrap();
}

#[test]
fn check_peer_refuses_each_geometry_difference_naming_the_field() {
    let (ctx, _) = ctx_gen();
    let p = DeepseekMlaLatent::new(&ctx).unwrap();
    let with = |t: PageTable| rank("gen", 8, 0, t);
    let cases: Vec<(RankInfo, &str)> = vec![
        (
            with(table(&v3_layers(), 64, 1, 0, 8, 0)),
            "tokens_per_block",
        ),
        (with(table(&v3_layers(), 32, 2, 0, 8, 0)), "dtype"),
        (
            with(table(&(0..62).collect::<Vec<_>>(), 32, 1, 0, 8, 0)),
            "layer count",
        ),
        (
            with(table(&(1..62).collect::<Vec<_>>(), 32, 1, 0, 8, 0)),
            "layer ids",
        ),
    ];
    for (peer, field) in cases {
        let err = p.check_peer(&ctx, &peer).unwrap_err();
        assert_eq!(refusal_field(&err), field, "{err}");
        assert!(err.to_string().contains(field), "{err}");
    }
}

#[test]
fn check_peer_refuses_a_different_slot_size() {
    let (ctx, _) = ctx_gen();
    let p = DeepseekMlaLatent::new(&ctx).unwrap();
    // Same layers and tokens, but the latent is stored with a trailing pad inside the slot:
    // the layers no longer tile the slot, so the peer's layout is refused.
    let mut t = table(&v3_layers(), 32, 1, 0, 8, 0);
    t.pools[0].slot_bytes += 64;
    t.pools[0].slot_stride += 64;
    let err = p.check_peer(&ctx, &rank("gen", 8, 0, t)).unwrap_err();
    assert_eq!(refusal_field(&err), "page table");
    assert!(err.to_string().contains("tile the slot"), "{err}");
}

#[test]
fn check_peer_refuses_a_second_view() {
    let (ctx, _) = ctx_gen();
    let p = DeepseekMlaLatent::new(&ctx).unwrap();
    let mut t = table(&v3_layers(), 32, 1, 0, 8, 0);
    let mut indexer = t.groups[0].views[0].clone();
    indexer.roles = vec!["indexer_k".into()].into();
    t.groups[0].views.push(indexer);
    let err = p.check_peer(&ctx, &rank("gen", 8, 0, t)).unwrap_err();
    assert_eq!(refusal_field(&err), "page table");
    assert!(err.to_string().contains("exactly one view"), "{err}");
}

#[test]
fn check_peer_refuses_broken_topology_naming_the_field() {
    let (ctx, gen_) = ctx_gen();
    let p = DeepseekMlaLatent::new(&ctx).unwrap();
    let mut pp = gen_.clone();
    pp.pp_size = 2;
    assert_eq!(
        refusal_field(&p.check_peer(&ctx, &pp).unwrap_err()),
        "pp_size"
    );
    let mut cp = gen_.clone();
    cp.cp_size = 2;
    assert_eq!(
        refusal_field(&p.check_peer(&ctx, &cp).unwrap_err()),
        "cp_size"
    );
    let mut tp = gen_.clone();
    tp.attention_dp = false;
    let err = p.check_peer(&ctx, &tp).unwrap_err();
    assert_eq!(refusal_field(&err), "attention_dp");
    assert!(err.to_string().contains("ours true, theirs false"), "{err}");
}

#[test]
fn targets_are_the_peer_rank_of_the_dp_rank() {
    let (ctx, gen_) = ctx_gen();
    let p = DeepseekMlaLatent::new(&ctx).unwrap();
    for dp in 0..8 {
        let t = p.targets(&ctx, &gen_, dp).unwrap();
        assert_eq!(t.ranks.as_slice(), &[dp]);
        assert!(t.uniform);
    }
    let g = DeepseekMlaLatent::new(&gen_).unwrap();
    for dp in 0..4 {
        assert_eq!(g.targets(&gen_, &ctx, dp).unwrap().ranks.as_slice(), &[dp]);
    }
    let err = g.targets(&gen_, &ctx, 4).unwrap_err();
    assert!(
        err.to_string().contains("outside the peer's 4 DP ranks"),
        "{err}"
    );
}

#[test]
fn consecutive_slots_on_both_sides_merge_into_one_fragment() {
    let (ctx, gen_) = ctx_gen();
    let row = ctx.page_table.pools[0].slot_bytes;
    let p = plan(
        &ctx,
        &gen_,
        &[3, 4, 5, 6],
        &[10, 11, 12, 13],
        &PairRequest::whole(128),
    );
    assert_eq!(p.fragments(), 1);
    assert_eq!(p.src[0], 0x1000_0000 + 3 * row);
    assert_eq!(p.dst[0], 0x9000_0000 + 10 * row);
    assert_eq!(p.len[0], 4 * row);
}

#[test]
fn runs_break_where_either_side_jumps() {
    let (ctx, gen_) = ctx_gen();
    let row = ctx.page_table.pools[0].slot_bytes;
    // Source jumps after ordinal 1, destination after ordinal 2.
    let p = plan(
        &ctx,
        &gen_,
        &[0, 1, 7, 8],
        &[20, 21, 22, 30],
        &PairRequest::whole(128),
    );
    let frags: Vec<_> = p.iter().collect();
    assert_eq!(
        frags,
        vec![
            (0x1000_0000, 0x9000_0000 + 20 * row, 2 * row),
            (0x1000_0000 + 7 * row, 0x9000_0000 + 22 * row, row),
            (0x1000_0000 + 8 * row, 0x9000_0000 + 30 * row, row),
        ]
    );
}

#[test]
fn a_padded_pool_never_merges() {
    let ctx = rank(
        "ctx",
        4,
        0,
        table(&v3_layers(), 32, 1, 0x1000_0000, 16, 4096),
    );
    let gen_ = rank("gen", 4, 0, table(&v3_layers(), 32, 1, 0x9000_0000, 16, 0));
    let p = plan(&ctx, &gen_, &[0, 1, 2], &[0, 1, 2], &PairRequest::whole(96));
    assert_eq!(p.fragments(), 3);
    assert!(
        p.len
            .iter()
            .all(|&l| l == ctx.page_table.pools[0].slot_bytes)
    );
}

#[test]
fn holes_on_either_side_are_skipped() {
    let (ctx, gen_) = ctx_gen();
    let row = ctx.page_table.pools[0].slot_bytes;
    // The receiver already caches ordinals 0 and 1; the sender lost ordinal 3.
    let p = plan(
        &ctx,
        &gen_,
        &[0, 1, 2, -1, 4],
        &[-1, -1, 7, 8, 9],
        &PairRequest::whole(160),
    );
    let frags: Vec<_> = p.iter().collect();
    assert_eq!(
        frags,
        vec![
            (0x1000_0000 + 2 * row, 0x9000_0000 + 7 * row, row),
            (0x1000_0000 + 4 * row, 0x9000_0000 + 9 * row, row),
        ]
    );
}

#[test]
fn token_ranges_select_their_blocks_and_chunks_add_up() {
    let (ctx, gen_) = ctx_gen();
    let src: Vec<i64> = (0..10).collect();
    let dst: Vec<i64> = (20..30).rev().collect();
    let whole = plan(&ctx, &gen_, &src, &dst, &PairRequest::whole(300));
    assert_eq!(whole.fragments(), 10);
    let mut chunked = TransferPlan::new();
    for (start, end) in [(0, 128), (128, 256), (256, 300)] {
        let req = PairRequest {
            token_range: TokenRange { start, end },
            prompt_len: 300,
            dst_start_token: ROption::RNone,
            is_last: end == 300,
        };
        chunked.extend(&plan(&ctx, &gen_, &src, &dst, &req));
    }
    assert_eq!(chunked, whole);
    // A chunk covers exactly its blocks: tokens [128, 256) are ordinals 4..8.
    let req = PairRequest {
        token_range: TokenRange {
            start: 128,
            end: 256,
        },
        prompt_len: 300,
        dst_start_token: ROption::RNone,
        is_last: false,
    };
    assert_eq!(plan(&ctx, &gen_, &src, &dst, &req).fragments(), 4);
}

#[test]
fn dst_start_token_skips_the_cached_prefix() {
    let (ctx, gen_) = ctx_gen();
    let mut req = PairRequest::whole(256);
    req.dst_start_token = ROption::RSome(64);
    let p = plan(
        &ctx,
        &gen_,
        &[0, 1, 2, 3, 4, 5, 6, 7],
        &[8, 9, 10, 11, 12, 13, 14, 15],
        &req,
    );
    let row = ctx.page_table.pools[0].slot_bytes;
    assert_eq!(
        p.iter().collect::<Vec<_>>(),
        vec![(0x1000_0000 + 2 * row, 0x9000_0000 + 10 * row, 6 * row)]
    );
}

#[test]
fn an_excluded_view_gives_an_empty_plan() {
    let (ctx, gen_) = ctx_gen();
    let p = DeepseekMlaLatent::new(&ctx).unwrap();
    let mine = rows(&ctx.page_table, &[SlotTable::new([0, 1])], &[]).unwrap();
    let excluded = [ViewId { group: 0, view: 0 }];
    let theirs = rows(&gen_.page_table, &[SlotTable::new([0, 1])], &excluded).unwrap();
    assert!(theirs.is_empty());
    let plan = p
        .pair(&ctx, &gen_, &mine, &theirs, &PairRequest::whole(64))
        .unwrap();
    assert!(plan.is_empty());
}

#[test]
fn the_exported_module_drives_the_same_planner() {
    let module = planner_module();
    assert_eq!(module.id(), "kvferry.deepseek_mla_latent");
    assert_eq!(
        module.describer(),
        kvferry_planner_abi::DEFAULT_DESCRIBER_ID
    );
    assert_eq!(module.library_version(), env!("CARGO_PKG_VERSION"));
    module
        .check_deployment(&deployment(ARCHITECTURE, 8, 1, 1, true))
        .unwrap();
    let err = module
        .check_deployment(&deployment(ARCHITECTURE, 8, 1, 1, false))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UNSUPPORTED);
    let (ctx, gen_) = ctx_gen();
    let loaded = module.instantiate(&ctx).unwrap();
    let mine = rows(&ctx.page_table, &[SlotTable::new([0, 1, 2])], &[]).unwrap();
    let theirs = rows(&gen_.page_table, &[SlotTable::new([5, 6, 7])], &[]).unwrap();
    let via_ffi = loaded
        .pair(&ctx, &gen_, &mine, &theirs, &PairRequest::whole(96))
        .unwrap();
    let direct = plan(&ctx, &gen_, &[0, 1, 2], &[5, 6, 7], &PairRequest::whole(96));
    assert_eq!(via_ffi, direct);
    assert!(
        String::from_utf8(loaded.describe().unwrap())
            .unwrap()
            .contains("tpb=32")
    );
}
