//! Preset layouts against the published numbers (transfer-semantics §11–§12).

use kvferry_planner_abi::{
    DEFAULT_DESCRIBER_ID, GroupKind, LayoutKind, Mapping, RankCoords, RankInfo,
};
use kvferry_testkit::layout::{
    Dtype, LayoutError, MAX_INSTANCE_RANKS, MAX_RANK_BYTES, ModelSpec, PoolOptions, Preset,
    build_instance, build_rank, check_mapping,
};
use strum::IntoEnumIterator;

pub(crate) fn mapping(tp: u32, pp: u32, cp: u32, attention_dp: bool) -> Mapping {
    Mapping {
        tp,
        pp,
        cp,
        moe_tp: 1,
        moe_ep: 1,
        attention_dp,
    }
}

pub(crate) fn build(model: &ModelSpec, m: Mapping) -> Result<Vec<RankInfo>, LayoutError> {
    let mut next = 0x1000_0000u64;
    let mut alloc = |_: u32, _: usize, bytes: u64| {
        let base = next;
        next += bytes.next_multiple_of(4096) + 4096;
        base
    };
    build_instance(
        model,
        &m,
        "test",
        "test.planner",
        &PoolOptions::default(),
        &mut alloc,
    )
}

fn slot_bytes(info: &RankInfo, pool: usize) -> u64 {
    info.page_table.pools[pool].slot_bytes
}

#[test]
fn names_round_trip() {
    let names: Vec<String> = Preset::iter().map(|p| p.to_string()).collect();
    assert_eq!(
        names,
        [
            "deepseek-v3",
            "llama-3-70b",
            "qwen3-next-80b-a3b",
            "gpt-oss-120b"
        ]
    );
    for p in Preset::iter() {
        assert_eq!(p.as_ref().parse::<Preset>().unwrap(), p);
        assert_eq!(p.to_string(), p.as_ref());
    }
    assert_eq!(Preset::DeepseekV3.architecture(), "DeepseekV3ForCausalLM");
    assert_eq!(Preset::Llama3_70b.architecture(), "LlamaForCausalLM");
    assert_eq!(
        Preset::Qwen3Next80bA3b.architecture(),
        "Qwen3NextForCausalLM"
    );
    assert_eq!(Preset::GptOss120b.architecture(), "GptOssForCausalLM");
    let err = "llama-2".parse::<Preset>().unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown model preset `llama-2` (known: deepseek-v3, llama-3-70b, qwen3-next-80b-a3b, \
         gpt-oss-120b)"
    );
    assert_eq!("fp8".parse::<Dtype>().unwrap(), Dtype::Fp8);
    assert_eq!("bf16".parse::<Dtype>().unwrap(), Dtype::Bf16);
    assert_eq!(Dtype::Fp8.to_string(), "fp8");
    assert_eq!(Dtype::Bf16.as_ref(), "bf16");
    let err = "fp4".parse::<Dtype>().unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown kv dtype `fp4` (known: fp8, bf16, fp16, fp32)"
    );
    assert_eq!("fp32".parse::<Dtype>().unwrap().bits(), 32);
    assert_eq!(ModelSpec::new(Preset::DeepseekV3).dtype, Dtype::Fp8);
    assert_eq!(ModelSpec::new(Preset::Llama3_70b).dtype, Dtype::Bf16);
    assert_eq!(ModelSpec::new(Preset::GptOss120b).tokens_per_block, 32);
}

#[test]
fn deepseek_v3_slot_and_request_bytes() {
    let infos = build(&ModelSpec::new(Preset::DeepseekV3), mapping(1, 1, 1, false)).unwrap();
    let info = &infos[0];
    let pt = &info.page_table;
    assert_eq!(pt.groups.len(), 1);
    assert_eq!(pt.pools.len(), 1);
    let group = &pt.groups[0];
    assert_eq!(group.kind, GroupKind::PAGED);
    assert_eq!(group.layers.len(), 61);
    assert_eq!(group.views.len(), 1);
    let view = &group.views[0];
    assert_eq!(view.role_set().into_iter().collect::<Vec<_>>(), ["key"]);
    assert_eq!(view.layout.kind, LayoutKind::HND);
    assert_eq!(view.layout.dtype.as_str(), "fp8_e4m3");
    assert_eq!(view.layout.elem_bits, 8);
    assert_eq!(view.layout.num_shards, 1);
    assert_eq!(view.layout.shard_unit_bytes, 32 * 576);
    assert_eq!(slot_bytes(info, 0), 1_124_352);
    // 8192 tokens = 256 rows.
    assert_eq!(256 * slot_bytes(info, 0), 287_834_112);
    assert_eq!(info.describer_id.as_str(), DEFAULT_DESCRIBER_ID);
    assert_eq!(info.planner_id.as_str(), "test.planner");

    let bf16 = ModelSpec::new(Preset::DeepseekV3).with_dtype(Dtype::Bf16);
    assert_eq!(
        slot_bytes(&build(&bf16, mapping(1, 1, 1, false)).unwrap()[0], 0),
        2_248_704
    );
    let tpb64 = ModelSpec::new(Preset::DeepseekV3).with_tokens_per_block(64);
    assert_eq!(
        slot_bytes(&build(&tpb64, mapping(1, 1, 1, false)).unwrap()[0], 0),
        2_248_704
    );
}

#[test]
fn deepseek_v3_replicas_under_tp_not_under_attention_dp() {
    let model = ModelSpec::new(Preset::DeepseekV3);
    let tp = build(&model, mapping(8, 1, 1, false)).unwrap();
    for (r, info) in tp.iter().enumerate() {
        let l = &info.page_table.groups[0].views[0].layout;
        assert_eq!((l.num_shards, l.shard_index), (1, 0));
        assert_eq!((l.num_replicas, l.replica_index), (8, r as u32));
        assert_eq!((info.dp_size, info.dp_rank), (1, 0));
        assert_eq!(slot_bytes(info, 0), 1_124_352);
    }
    let dep = build(&model, mapping(8, 1, 1, true)).unwrap();
    for (r, info) in dep.iter().enumerate() {
        let l = &info.page_table.groups[0].views[0].layout;
        assert_eq!((l.num_replicas, l.replica_index), (1, 0));
        assert_eq!((info.dp_size, info.dp_rank), (8, r as u32));
        assert_eq!(info.tp_per_dp(), 1);
    }
}

#[test]
fn llama_3_70b_head_sharding() {
    let model = ModelSpec::new(Preset::Llama3_70b);
    let tp1 = build(&model, mapping(1, 1, 1, false)).unwrap();
    assert_eq!(slot_bytes(&tp1[0], 0), 10_485_760);
    let tp4 = build(&model, mapping(4, 1, 1, false)).unwrap();
    assert_eq!(slot_bytes(&tp4[0], 0), 2_621_440);
    let view = &tp4[2].page_table.groups[0].views[0];
    assert_eq!(view.entries[0].size, 16_384);
    assert_eq!(view.entries[1].offset, 16_384);
    assert_eq!((view.layout.num_shards, view.layout.shard_index), (4, 2));
    assert_eq!(view.layout.shard_unit_bytes, 32 * 128 * 2);
    assert_eq!(
        view.role_set().into_iter().collect::<Vec<_>>(),
        ["key", "value"]
    );
    let tp8 = build(&model, mapping(8, 1, 1, false)).unwrap();
    assert_eq!(slot_bytes(&tp8[5], 0), 1_310_720);
    // TP16: one head per rank, duplicated twice.
    let tp16 = build(&model, mapping(16, 1, 1, false)).unwrap();
    let l = &tp16[5].page_table.groups[0].views[0].layout;
    assert_eq!(
        (l.num_shards, l.shard_index, l.num_replicas, l.replica_index),
        (8, 2, 2, 1)
    );
    assert_eq!(slot_bytes(&tp16[5], 0), 1_310_720);
    // Attention DP: every rank holds all 8 heads.
    let dep4 = build(&model, mapping(4, 1, 1, true)).unwrap();
    assert_eq!(slot_bytes(&dep4[3], 0), 10_485_760);

    let err = build(&model, mapping(3, 1, 1, false)).unwrap_err();
    assert!(
        matches!(
            err,
            LayoutError::Sharding {
                width: 3,
                count: 8,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("llama-3-70b"), "{err}");
}

#[test]
fn qwen3_next_groups_and_state_sizes() {
    let model = ModelSpec::new(Preset::Qwen3Next80bA3b);
    let tp1 = build(&model, mapping(1, 1, 1, false)).unwrap();
    let pt = &tp1[0].page_table;
    assert_eq!(pt.groups.len(), 2);
    let (attn, state) = (&pt.groups[0], &pt.groups[1]);
    assert_eq!(attn.kind, GroupKind::PAGED);
    assert_eq!(attn.layers.len(), 12);
    assert!(attn.layers.iter().all(|l| l.global % 4 == 3));
    // 2 heads × 256 × 2 B × 32 tokens per buffer, K+V, 12 layers.
    assert_eq!(slot_bytes(&tp1[0], 0), 12 * 2 * 2 * 256 * 2 * 32);
    assert_eq!(state.kind, GroupKind::STATE);
    assert_eq!(state.layers.len(), 36);
    let conv = &state.views[0];
    assert_eq!(conv.layout.kind, LayoutKind::SECTIONED);
    assert_eq!(
        conv.layout.section_bytes.as_slice(),
        &[12_288, 12_288, 24_576]
    );
    assert_eq!(conv.entries[0].size, 49_152);
    assert_eq!(slot_bytes(&tp1[0], conv.pool as usize), 36 * 49_152);
    let ssm = &state.views[1];
    assert_eq!(ssm.layout.kind, LayoutKind::HND);
    assert_eq!(ssm.layout.dtype.as_str(), "fp32");
    assert_eq!(ssm.layout.elem_bits, 32);
    assert_eq!(ssm.layout.shard_unit_bytes, 65_536);
    assert_eq!(ssm.entries[0].size, 2_097_152);
    assert_eq!(slot_bytes(&tp1[0], ssm.pool as usize), 36 * 2_097_152);

    let tp2 = build(&model, mapping(2, 1, 1, false)).unwrap();
    let state = &tp2[1].page_table.groups[1];
    let conv = &state.views[0].layout;
    assert_eq!(conv.section_bytes.as_slice(), &[6_144, 6_144, 12_288]);
    assert_eq!((conv.num_shards, conv.shard_index), (2, 1));
    assert_eq!(state.views[1].entries[0].size, 1_048_576);
    // TP4: attention heads duplicated (2 heads over 4 ranks), GDN split four ways.
    let tp4 = build(&model, mapping(4, 1, 1, false)).unwrap();
    let kv = &tp4[3].page_table.groups[0].views[0].layout;
    assert_eq!(
        (
            kv.num_shards,
            kv.shard_index,
            kv.num_replicas,
            kv.replica_index
        ),
        (2, 1, 2, 1)
    );
    // Attention DP: whole state on every rank.
    let dep2 = build(&model, mapping(2, 1, 1, true)).unwrap();
    assert_eq!(
        dep2[1].page_table.groups[1].views[1].entries[0].size,
        2_097_152
    );

    assert!(matches!(
        build(&model, mapping(3, 1, 1, false)),
        Err(LayoutError::Sharding { width: 3, .. })
    ));
    assert!(matches!(
        build(&model, mapping(32, 1, 1, false)),
        Err(LayoutError::Sharding {
            width: 32,
            count: 16,
            ..
        })
    ));
}

#[test]
fn qwen3_next_uneven_pp_omits_empty_groups() {
    let model = ModelSpec::new(Preset::Qwen3Next80bA3b).with_layers_per_pp(vec![3, 45]);
    let infos = build(&model, mapping(1, 2, 1, false)).unwrap();
    // Stage 0 holds layers 0..3: no attention layer, only the STATE group.
    let pt0 = &infos[0].page_table;
    assert_eq!(pt0.groups.len(), 1);
    assert_eq!(pt0.groups[0].kind, GroupKind::STATE);
    assert_eq!(pt0.groups[0].layers.len(), 3);
    let pt1 = &infos[1].page_table;
    assert_eq!(pt1.groups.len(), 2);
    assert_eq!(pt1.groups[0].kind, GroupKind::PAGED);
    assert_eq!(pt1.groups[0].layers[0].global, 3);
    assert_eq!(pt1.groups[0].layers[0].local, 0);
    assert_eq!(infos[1].pp_layer_range(), 3..48);

    let bad = ModelSpec::new(Preset::Qwen3Next80bA3b).with_layers_per_pp(vec![3, 40]);
    let err = build(&bad, mapping(1, 2, 1, false)).unwrap_err();
    assert!(err.to_string().contains("sums to 43"), "{err}");
}

#[test]
fn gpt_oss_sliding_and_full_groups() {
    let infos = build(&ModelSpec::new(Preset::GptOss120b), mapping(1, 1, 1, false)).unwrap();
    let pt = &infos[0].page_table;
    assert_eq!(pt.groups.len(), 2);
    assert_eq!(pt.pools.len(), 2);
    let (sliding, full) = (&pt.groups[0], &pt.groups[1]);
    assert_eq!(sliding.window(), Some(128));
    assert_eq!(full.window(), None);
    assert!(sliding.layers.iter().all(|l| l.global % 2 == 0));
    assert!(full.layers.iter().all(|l| l.global % 2 == 1));
    assert_eq!(sliding.layers.len(), 18);
    assert_eq!(sliding.views[0].pool, 0);
    assert_eq!(full.views[0].pool, 1);
    // 8 heads × 64 × 2 B × 32 tokens, K+V, 18 layers.
    assert_eq!(slot_bytes(&infos[0], 0), 18 * 2 * 8 * 64 * 2 * 32);
}

#[test]
fn rank_numbering_is_cp_minor_and_pp_split_even() {
    let m = mapping(2, 3, 2, false);
    let model = ModelSpec::new(Preset::DeepseekV3);
    assert_eq!(model.layers_per_pp(3).unwrap(), [21, 20, 20]);
    assert_eq!(model.layers_per_pp(4).unwrap(), [16, 15, 15, 15]);
    let infos = build(&model, m).unwrap();
    assert_eq!(infos.len(), 12);
    for info in &infos {
        let c = RankCoords {
            pp: info.pp_rank,
            tp: info.tp_rank,
            cp: info.cp_rank,
        };
        assert_eq!(m.rank_at(c), info.instance_rank);
        assert_eq!(m.coords(info.instance_rank), c);
        assert_eq!(
            info.instance_rank,
            info.pp_rank * 4 + info.tp_rank * 2 + info.cp_rank
        );
        assert_eq!(info.layers_per_pp.as_slice(), &[21, 20, 20]);
    }
    assert_eq!(infos[7].pp_layer_range(), 21..41);
    let layers = &infos[7].page_table.groups[0].layers;
    assert_eq!((layers[0].local, layers[0].global), (0, 21));

    let mut alloc = |_: u32, _: usize, _: u64| 0x1000;
    let err = build_rank(
        &model,
        &m,
        "x",
        "y",
        12,
        &PoolOptions::default(),
        &mut alloc,
    );
    assert!(matches!(
        err,
        Err(LayoutError::RankOutOfRange { rank: 12, .. })
    ));
}

#[test]
fn padded_pools_have_a_larger_stride() {
    let options = PoolOptions {
        paged_slots: 4,
        slot_padding: 4096,
        ..PoolOptions::default()
    };
    let mut sizes = Vec::new();
    let mut alloc = |_: u32, _: usize, bytes: u64| {
        sizes.push(bytes);
        0x10_0000
    };
    let info = build_rank(
        &ModelSpec::new(Preset::DeepseekV3),
        &mapping(1, 1, 1, false),
        "x",
        "y",
        0,
        &options,
        &mut alloc,
    )
    .unwrap();
    let pool = &info.page_table.pools[0];
    assert_eq!(pool.slot_stride, pool.slot_bytes + 4096);
    assert_eq!(sizes, [3 * pool.slot_stride + pool.slot_bytes]);
}

#[test]
fn instances_wider_than_the_largest_supported_are_refused_before_any_rank_is_built() {
    let model = ModelSpec::new(Preset::DeepseekV3);
    assert_eq!(
        check_mapping(&mapping(MAX_INSTANCE_RANKS, 1, 1, true)).unwrap(),
        65_536
    );
    let mut alloc = |_: u32, _: usize, _: u64| -> u64 { panic!("nothing may be laid out") };
    for (m, world) in [
        (mapping(MAX_INSTANCE_RANKS + 1, 1, 1, true), 65_537u128),
        (mapping(4_000_000_000, 1, 1, false), 4_000_000_000),
        // The product overflows the ABI's u32 `world_size`.
        (mapping(65_536, 65_536, 1, false), 1 << 32),
        (
            mapping(u32::MAX, u32::MAX, u32::MAX, false),
            u128::from(u32::MAX).pow(3),
        ),
    ] {
        let err = check_mapping(&m).unwrap_err();
        assert!(
            matches!(err, LayoutError::TooManyRanks { mapping: got } if got == m),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&format!("deployment {m} has {world} ranks")),
            "{text}"
        );
        assert!(
            text.contains("the largest instance supported has 65536"),
            "{text}"
        );
        let options = PoolOptions::default();
        let built = build_instance(&model, &m, "x", "y", &options, &mut alloc);
        assert!(matches!(built, Err(LayoutError::TooManyRanks { .. })));
        let built = build_rank(&model, &m, "x", "y", 0, &options, &mut alloc);
        assert!(matches!(built, Err(LayoutError::TooManyRanks { .. })));
    }
}

#[test]
fn a_rank_whose_pools_exceed_what_one_rank_may_hold_is_refused_before_allocating() {
    let mut alloc = |_: u32, _: usize, _: u64| -> u64 { panic!("nothing may be allocated") };
    // 4e9 tokens per block: a Llama slot of 1.3 PB at tp1.
    let model = ModelSpec::new(Preset::Llama3_70b).with_tokens_per_block(4_000_000_000);
    let options = PoolOptions {
        paged_slots: 3,
        ..PoolOptions::default()
    };
    let err = build_rank(
        &model,
        &mapping(1, 1, 1, false),
        "prefill",
        "y",
        0,
        &options,
        &mut alloc,
    )
    .unwrap_err();
    let LayoutError::RankTooLarge(large) = &err else {
        panic!("{err}");
    };
    assert_eq!(large.slot_bytes, 80 * 2 * 8 * 128 * 2 * 4_000_000_000);
    assert_eq!(large.bytes, 3 * u128::from(large.slot_bytes));
    let text = err.to_string();
    assert!(
        text.starts_with("prefill rank 0 (tp1): its pools would take "),
        "{text}"
    );
    assert!(text.contains("3932160000000000 bytes (3.49 PiB)"), "{text}");
    assert!(text.contains(&format!("{MAX_RANK_BYTES} bytes")), "{text}");

    // Slots past u64 are measured, not overflowed.
    let options = PoolOptions {
        paged_slots: u64::MAX,
        ..PoolOptions::default()
    };
    let model = ModelSpec::new(Preset::Llama3_70b);
    let err = build_rank(
        &model,
        &mapping(1, 1, 1, false),
        "ctx",
        "y",
        0,
        &options,
        &mut alloc,
    )
    .unwrap_err();
    assert!(
        matches!(&err, LayoutError::RankTooLarge(l) if l.bytes > u128::from(u64::MAX)),
        "{err}"
    );

    // Just under the limit lays out.
    let slot = 80 * 2 * 8 * 128 * 2 * 32;
    let options = PoolOptions {
        paged_slots: MAX_RANK_BYTES / slot,
        ..PoolOptions::default()
    };
    let mut sizes = Vec::new();
    let mut alloc = |_: u32, _: usize, bytes: u64| {
        sizes.push(bytes);
        0x10_0000
    };
    build_rank(
        &model,
        &mapping(1, 1, 1, false),
        "ctx",
        "y",
        0,
        &options,
        &mut alloc,
    )
    .unwrap();
    assert!(sizes.iter().sum::<u64>() <= MAX_RANK_BYTES);
}
