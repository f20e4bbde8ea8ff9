use kvferry_planner_abi::{ErrorKind, Mapping, SlotTable, TokenRange, ViewId, ffi::ROption};
use kvferry_testkit::builder::{Deploy, Model, rows_excluding, rows_of};
use kvferry_testkit::error_chain;
use kvferry_testkit::scenario::Transfer;

use super::*;

/// DeepSeek-V3's latent cache (semantics §12.1): 61 layers of one 576-element latent per
/// token, FP8, 32 tokens per block, 64 slots per pool.
fn v3() -> Model {
    Model {
        elem_bytes: 1,
        dtype: "fp8_e4m3",
        slots: 64,
        ..Model::mla(61, 576, 32)
    }
}

/// `model` under attention DP over `dp` ranks: the prefill instance, or the generation one.
fn dep(context: bool, dp: u32, model: &Model) -> Deploy {
    let d = if context {
        Deploy::context(dp, model)
    } else {
        Deploy::generation(dp, model)
    };
    d.adp().planner(DeepseekMlaLatent::PLANNER_ID)
}

/// Decode rank `rank` of a dep8 deployment of `model`.
fn gen8(model: &Model, rank: u32) -> RankInfo {
    dep(false, 8, model).rank(model, rank)
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

/// Prefill DP rank 1 of dep4 and decode DP rank 5 of dep8.
fn ctx_gen() -> (RankInfo, RankInfo) {
    let m = v3();
    (dep(true, 4, &m).rank(&m, 1), gen8(&m, 5))
}

/// Base addresses of the latent pools of the prefill and decode ranks.
fn bases(ctx: &RankInfo, gen_: &RankInfo) -> (u64, u64) {
    (ctx.page_table.pools[0].base, gen_.page_table.pools[0].base)
}

/// The fragments the host writes for one piece: the planner's compressed plan, validated
/// and merged by the host (rows byte-adjacent on both sides become one write). Its flat
/// `pair` gives the same writes.
fn plan(
    ctx: &RankInfo,
    gen_: &RankInfo,
    src: &[i64],
    dst: &[i64],
    request: &PairRequest,
) -> TransferPlan {
    let p = DeepseekMlaLatent::new(ctx).unwrap();
    let mine = rows_of(ctx, &[SlotTable::new(src.to_vec())]);
    let theirs = rows_of(gen_, &[SlotTable::new(dst.to_vec())]);
    let compressed = p
        .pair_compressed(ctx, gen_, &mine, &theirs, request)
        .unwrap()
        .expect("the MLA planner plans compressed");
    let validated = kvferry_plan::validate_compressed(compressed, &mine, &theirs).unwrap();
    let flat = p.pair(ctx, gen_, &mine, &theirs, request).unwrap();
    let flat = kvferry_plan::validate(flat, &mine, &theirs).unwrap();
    assert_eq!(
        validated.fragments().collect::<Vec<_>>(),
        flat.fragments().collect::<Vec<_>>(),
        "compressed and flat plans write the same"
    );
    let mut out = TransferPlan::new();
    for (s, d, n) in validated.fragments() {
        out.push(s, d, n);
    }
    out
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
    let fp8 = v3();
    assert_eq!(gen8(&fp8, 0).page_table.pools[0].slot_bytes, 1_124_352);
    let bf16 = Model {
        elem_bytes: 2,
        dtype: "bf16",
        ..v3()
    };
    assert_eq!(gen8(&bf16, 0).page_table.pools[0].slot_bytes, 2_248_704);
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
    let with = |m: Model| gen8(&m, 0);
    let cases: Vec<(RankInfo, &str)> = vec![
        (with(Model { tpb: 64, ..v3() }), "tokens_per_block"),
        (
            with(Model {
                elem_bytes: 2,
                dtype: "bf16",
                ..v3()
            }),
            "dtype",
        ),
        (with(v3().with_layers(62)), "layer count"),
        (
            with(Model {
                layers: 62,
                attn: (1..62).collect(),
                ..v3()
            }),
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
    let mut peer = gen8(&v3(), 0);
    peer.page_table.pools[0].slot_bytes += 64;
    peer.page_table.pools[0].slot_stride += 64;
    let err = p.check_peer(&ctx, &peer).unwrap_err();
    assert_eq!(refusal_field(&err), "page table");
    assert!(err.to_string().contains("tile the slot"), "{err}");
}

#[test]
fn check_peer_refuses_a_second_view() {
    let (ctx, _) = ctx_gen();
    let p = DeepseekMlaLatent::new(&ctx).unwrap();
    let mut peer = gen8(&v3(), 0);
    let views = &mut peer.page_table.groups[0].views;
    let mut indexer = views[0].clone();
    indexer.roles = vec!["indexer_k".into()].into();
    views.push(indexer);
    let err = p.check_peer(&ctx, &peer).unwrap_err();
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
    let (src, dst) = bases(&ctx, &gen_);
    let row = ctx.page_table.pools[0].slot_bytes;
    let p = plan(
        &ctx,
        &gen_,
        &[3, 4, 5, 6],
        &[10, 11, 12, 13],
        &PairRequest::whole(128),
    );
    assert_eq!(p.fragments(), 1);
    assert_eq!(p.src[0], src + 3 * row);
    assert_eq!(p.dst[0], dst + 10 * row);
    assert_eq!(p.len[0], 4 * row);
}

#[test]
fn runs_break_where_either_side_jumps() {
    let (ctx, gen_) = ctx_gen();
    let (src, dst) = bases(&ctx, &gen_);
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
            (src, dst + 20 * row, 2 * row),
            (src + 7 * row, dst + 22 * row, row),
            (src + 8 * row, dst + 30 * row, row),
        ]
    );
}

#[test]
fn a_padded_pool_never_merges() {
    let m = Model { slots: 16, ..v3() };
    let padded = Model {
        slot_padding: 4096,
        ..m.clone()
    };
    let ctx = dep(true, 4, &padded).rank(&padded, 0);
    let gen_ = dep(false, 4, &m).rank(&m, 0);
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
    let (src, dst) = bases(&ctx, &gen_);
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
            (src + 2 * row, dst + 7 * row, row),
            (src + 4 * row, dst + 9 * row, row),
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
    let (src, dst) = bases(&ctx, &gen_);
    let row = ctx.page_table.pools[0].slot_bytes;
    assert_eq!(
        p.iter().collect::<Vec<_>>(),
        vec![(src + 2 * row, dst + 10 * row, 6 * row)]
    );
}

#[test]
fn an_excluded_view_gives_an_empty_plan() {
    let (ctx, gen_) = ctx_gen();
    let p = DeepseekMlaLatent::new(&ctx).unwrap();
    let mine = rows_of(&ctx, &[SlotTable::new([0, 1])]);
    let excluded = [ViewId { group: 0, view: 0 }];
    let theirs = rows_excluding(&gen_, &[SlotTable::new([0, 1])], &excluded);
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
    let mine = rows_of(&ctx, &[SlotTable::new([0, 1, 2])]);
    let theirs = rows_of(&gen_, &[SlotTable::new([5, 6, 7])]);
    let request = PairRequest::whole(96);
    let via_ffi = loaded.pair(&ctx, &gen_, &mine, &theirs, &request).unwrap();
    let direct = DeepseekMlaLatent::new(&ctx).unwrap();
    assert_eq!(
        via_ffi,
        direct.pair(&ctx, &gen_, &mine, &theirs, &request).unwrap()
    );
    let compressed = loaded
        .pair_compressed(&ctx, &gen_, &mine, &theirs, &request)
        .unwrap();
    assert_eq!(
        compressed,
        direct
            .pair_compressed(&ctx, &gen_, &mine, &theirs, &request)
            .unwrap()
    );
    assert_eq!(compressed.unwrap().patterns[0].row_pairs(), 3);
    assert!(
        String::from_utf8(loaded.describe().unwrap())
            .unwrap()
            .contains("tpb=32")
    );
}

#[test]
fn requests_move_every_latent_byte_once_and_nothing_else() {
    // Byte level, through the testkit's oracle: a short latent (4 layers × 64 elements,
    // tpb 4) from prefill DP rank 1 of dep4 to every DP rank of dep2 and dep8, whole or in
    // chunks, with a lost sender block and a cached receiver prefix, padded pools or not.
    for padding in [0, 64] {
        let m = Model {
            elem_bytes: 1,
            dtype: "fp8_e4m3",
            slots: 16,
            slot_padding: padding,
            ..Model::mla(4, 64, 4)
        };
        for (dp, pieces) in [(2, vec![(0, 37)]), (8, vec![(0, 16), (16, 32), (32, 37)])] {
            let mut t = Transfer::new(&m, dep(true, 4, &m), dep(false, dp, &m), 37);
            t.ctx_dp_rank = 1;
            t.pieces = pieces;
            t.ctx_holes = vec![3];
            t.gen_holes = vec![0, 1];
            let reports = t
                .run_every_group(DeepseekMlaLatent::new)
                .unwrap_or_else(|e| {
                    panic!("dep4 -> dep{dp}, padding {padding}: {}", error_chain(&e))
                });
            assert_eq!(reports.len(), dp as usize);
            for (d, report) in reports.iter().enumerate() {
                assert!(report.is_ok(), "dep{dp} rank {d}: {report}");
                // 10 blocks, one lost, two cached: 7 rows of 4 layers × 4 tokens × 64 B.
                assert_eq!(report.verification.bytes_covered, 7 * 4 * 4 * 64);
                assert_eq!(report.bytes_into(d as u32), 7 * 4 * 4 * 64);
                assert_eq!(report.receivers[0].targets, [1]);
            }
        }
    }
}
