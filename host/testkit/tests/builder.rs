//! The rank builder: page tables of any shape, rank headers, slot tables.

use kvferry_planner_abi::{GroupKind, LayoutKind, Mapping, MemoryType, RoleLayout, SlotTable};
use kvferry_testkit::builder::{
    Deploy, GroupSpec, Model, ViewSpec, local_layers, page_table, rank_info, scattered, tables,
};
use kvferry_testkit::layout::PoolOptions;
use kvferry_testkit::scenario::request_tables;

const H: i64 = SlotTable::HOLE;

#[test]
fn every_model_and_mapping_gives_valid_page_tables() {
    let mut hybrid = Model::hybrid(8, 4);
    if let Some(state) = hybrid.state.as_mut() {
        state.replicated_side = Some(24);
    }
    let models = [
        Model::gqa(4, 4, 4, 4),
        Model {
            layout: LayoutKind::NHD,
            ..Model::gqa(4, 4, 4, 4)
        },
        Model::mla(4, 9, 4),
        Model {
            window: Some(16),
            slot_padding: 100,
            ..Model::gqa(4, 2, 8, 8)
        },
        Model::llama70b(),
        hybrid,
    ];
    for model in &models {
        for tp in [1, 2, 4, 8] {
            let base = Deploy::context(tp, model);
            for deploy in [
                base.clone(),
                base.clone().adp(),
                base.clone().cp(2),
                base.clone().pp(vec![1, 3]),
                base.clone().pp(vec![3, 0, 1]),
            ] {
                let infos = deploy.instance(model);
                assert_eq!(infos.len() as u32, deploy.world());
                for info in &infos {
                    info.page_table
                        .validate()
                        .unwrap_or_else(|e| panic!("{model:?} {:?}: {e}", deploy.mapping));
                    // Pools never overlap, within a rank or across ranks.
                    for p in info.page_table.pools.iter() {
                        let (r, i) = ((p.base >> 36) & 0xff, (p.base >> 30) & 0x3f);
                        assert_eq!(p.base, deploy.base(r as u32, i as u32));
                        assert!(p.footprint() < 1 << 30);
                    }
                }
            }
        }
    }
}

#[test]
fn synthetic_models_are_laid_out_as_documented() {
    // Hybrid, tp2 rank 1: attention layers 3 and 7 (one of 2 shards of 4 heads), state
    // layers 0-2 and 4-6 at grid 2, index 1.
    let model = Model::hybrid(8, 4);
    let info = Deploy::generation(2, &model).rank(&model, 1);
    let pt = &info.page_table;
    assert_eq!((info.tp_size, info.tp_rank, info.dp_size), (2, 1, 1));
    assert_eq!(pt.groups.len(), 2);
    let attn = &pt.groups[0];
    assert_eq!(attn.kind, GroupKind::PAGED);
    assert_eq!(
        attn.layers.iter().map(|l| l.global).collect::<Vec<_>>(),
        [3, 7]
    );
    let kv = &attn.views[0];
    assert_eq!((kv.layout.num_shards, kv.layout.shard_index), (2, 1));
    // 2 heads × 4 tokens × 4 × 2 bytes per buffer, K and V, 2 layers.
    assert_eq!(pt.pools[0].slot_bytes, 2 * 2 * 64);
    assert_eq!(kv.layout.shard_unit_bytes, 32);
    let state = &pt.groups[1];
    assert_eq!(state.kind, GroupKind::STATE);
    let conv = &state.views[0].layout;
    assert_eq!(conv.kind, LayoutKind::SECTIONED);
    assert_eq!(conv.section_bytes.as_slice(), &[32, 16, 16]);
    assert_eq!((conv.num_shards, conv.shard_index), (2, 1));
    let ssm = &state.views[1].layout;
    assert_eq!((ssm.kind, ssm.shard_unit_bytes), (LayoutKind::HND, 16));
    assert_eq!(pt.pools[2].slot_bytes, 6 * 2 * 16);
    // Under attention DP every rank holds every head and the whole state.
    let info = Deploy::generation(4, &model).adp().rank(&model, 3);
    assert_eq!((info.dp_size, info.dp_rank), (4, 3));
    let kv = &info.page_table.groups[0].views[0].layout;
    assert_eq!((kv.num_shards, kv.num_replicas), (1, 1));
    assert_eq!(info.page_table.groups[1].views[0].layout.num_shards, 1);
}

#[test]
fn any_groups_and_views_lay_out_back_to_back_in_their_own_pools() {
    let mut sectioned = RoleLayout::whole(LayoutKind::SECTIONED, "bf16", 16);
    sectioned.section_bytes = vec![8, 8, 16].into();
    let groups = vec![
        GroupSpec {
            kind: GroupKind::PAGED,
            window: Some(64),
            layers: local_layers(&[10, 11]).to_vec(),
            views: vec![
                ViewSpec::new(
                    &["key", "value"],
                    RoleLayout::whole(LayoutKind::NHD, "bf16", 16),
                    2,
                    48,
                ),
                ViewSpec::new(
                    &["indexer_k"],
                    RoleLayout::whole(LayoutKind::REPLICATED, "fp8_e4m3", 8),
                    1,
                    16,
                ),
            ],
        },
        GroupSpec {
            kind: GroupKind::STATE,
            window: None,
            layers: Vec::new(),
            views: vec![ViewSpec::new(&["gone"], sectioned.clone(), 1, 32)],
        },
        GroupSpec {
            kind: GroupKind::STATE,
            window: None,
            layers: local_layers(&[12]).to_vec(),
            views: vec![ViewSpec::new(&["conv"], sectioned, 1, 32)],
        },
    ];
    let options = PoolOptions {
        paged_slots: 10,
        state_slots: 3,
        slot_padding: 16,
        memory_type: MemoryType::DRAM,
    };
    let mut bases = Vec::new();
    let pt = page_table(8, groups, &options, &mut |pool, bytes| {
        bases.push((pool, bytes));
        0x1000 * (pool as u64 + 1)
    });
    pt.validate().unwrap();
    // The group without layers is skipped.
    assert_eq!(pt.groups.len(), 2);
    assert_eq!(
        bases,
        [(0, 10 * 208 - 16), (1, 10 * 48 - 16), (2, 3 * 48 - 16)]
    );
    let kv = &pt.groups[0].views[0];
    let offsets: Vec<_> = kv
        .entries
        .iter()
        .map(|e| (e.local_layer, e.offset))
        .collect();
    assert_eq!(offsets, [(0, 0), (0, 48), (1, 96), (1, 144)]);
    assert_eq!(pt.groups[0].window(), Some(64));
    assert_eq!(
        (
            pt.pools[1].base,
            pt.pools[1].slot_bytes,
            pt.pools[1].slot_stride
        ),
        (0x2000, 32, 48)
    );
    assert_eq!(pt.groups[1].views[0].pool, 2);
    assert_eq!(pt.pools[2].num_slots, 3);
    assert_eq!(pt.pools[2].memory_type, MemoryType::DRAM);
}

#[test]
fn rank_headers_follow_the_mapping_cp_minor() {
    let model = Model::gqa(4, 4, 4, 4);
    let mapping: Mapping = "tp2pp2cp2".parse().unwrap();
    let pt = Deploy::context(1, &model).page_table(&model, 0);
    let info = rank_info("x", &mapping, 5, vec![2, 2], pt, "p");
    assert_eq!(
        (info.pp_rank, info.tp_rank, info.cp_rank, info.dp_rank),
        (1, 0, 1, 0)
    );
    assert_eq!(info.pp_layer_range(), 2..4);
    let dep: Mapping = "dep4".parse().unwrap();
    let pt = Deploy::context(1, &model).page_table(&model, 0);
    let info = rank_info("x", &dep, 2, vec![4], pt, "p");
    assert_eq!((info.dp_size, info.dp_rank, info.tp_per_dp()), (4, 2, 1));
}

#[test]
fn request_tables_are_positional_with_holes() {
    assert_eq!(scattered(5, 8, 1, &[2]), [1, 4, H, 2, 5]);
    let model = Model::hybrid(8, 4);
    // Helix CP rank 1 of 2 holds global ordinals 1, 3, 5 of a 6-block prompt.
    let info = Deploy::generation(1, &model).cp(2).rank(&model, 1);
    let t = request_tables(&info, 24, 8, 2, &[3], false);
    assert_eq!(t[0].slots.as_slice(), &[2, H, 0]);
    assert!(t[1].slots.is_empty());
    let t = request_tables(&info, 24, 8, 2, &[], true);
    assert_eq!(t[1].slots.as_slice(), &[4]);
    let t = tables(&info.page_table, &[7, 6], &[1]);
    assert_eq!(
        (t[0].slots.as_slice(), t[1].slots.as_slice()),
        (&[7, 6][..], &[1][..])
    );
}
