//! The default describer, page-table validation, the wire form and the panic guard.

use kvferry_planner_abi::ffi::ROption;
use kvferry_planner_abi::*;

/// One PAGED group with a K/V view and an indexer view in one pool (padded), plus a STATE
/// group with a conv view in its own pool.
fn table() -> PageTable {
    let kv = PoolView {
        pool: 0,
        entries: vec![
            BufferEntry {
                local_layer: 0,
                offset: 0,
                size: 64,
            },
            BufferEntry {
                local_layer: 0,
                offset: 64,
                size: 64,
            },
            BufferEntry {
                local_layer: 1,
                offset: 128,
                size: 64,
            },
            BufferEntry {
                local_layer: 1,
                offset: 192,
                size: 64,
            },
        ]
        .into(),
        roles: vec!["key".into(), "value".into()].into(),
        layout: RoleLayout::whole(LayoutKind::HND, "bf16", 16),
    };
    let indexer = PoolView {
        pool: 0,
        entries: vec![
            BufferEntry {
                local_layer: 0,
                offset: 256,
                size: 32,
            },
            BufferEntry {
                local_layer: 1,
                offset: 288,
                size: 32,
            },
        ]
        .into(),
        roles: vec!["indexer_k".into()].into(),
        layout: RoleLayout::whole(LayoutKind::REPLICATED, "fp8_e4m3", 8),
    };
    let mut conv_layout = RoleLayout::whole(LayoutKind::SECTIONED, "bf16", 16);
    conv_layout.section_bytes = vec![8, 8, 16].into();
    let conv = PoolView {
        pool: 1,
        entries: vec![BufferEntry {
            local_layer: 0,
            offset: 0,
            size: 32,
        }]
        .into(),
        roles: vec!["conv".into()].into(),
        layout: conv_layout,
    };
    PageTable {
        tokens_per_block: 8,
        pools: vec![
            PhysicalPool {
                base: 0x1000,
                slot_bytes: 320,
                slot_stride: 512,
                num_slots: 10,
                memory_type: MemoryType::VRAM,
            },
            PhysicalPool {
                base: 0x10_0000,
                slot_bytes: 32,
                slot_stride: 32,
                num_slots: 4,
                memory_type: MemoryType::DRAM,
            },
        ]
        .into(),
        groups: vec![
            LayerGroup {
                kind: GroupKind::PAGED,
                window: ROption::RNone,
                layers: vec![
                    LocalLayer {
                        local: 0,
                        global: 10,
                    },
                    LocalLayer {
                        local: 1,
                        global: 11,
                    },
                ]
                .into(),
                views: vec![kv, indexer].into(),
            },
            LayerGroup {
                kind: GroupKind::STATE,
                window: ROption::RNone,
                layers: vec![LocalLayer {
                    local: 0,
                    global: 12,
                }]
                .into(),
                views: vec![conv].into(),
            },
        ]
        .into(),
    }
}

#[test]
fn rows_cover_every_held_slot_of_every_view_in_order() {
    let t = table();
    t.validate().unwrap();
    let rows = rows(&t, &[SlotTable::new([7, -1, 5]), SlotTable::new([2])], &[]).unwrap();
    assert_eq!(rows.len(), 3);
    for r in &rows[..2] {
        assert_eq!(r.kind, GroupKind::PAGED);
        assert_eq!(r.ordinals.as_slice(), &[0, 2]);
        assert_eq!(
            r.addresses.as_slice(),
            &[0x1000 + 7 * 512, 0x1000 + 5 * 512]
        );
        assert_eq!((r.row_bytes, r.row_stride), (320, 512));
        assert_eq!((r.span_start, r.span_end), (0, 3));
        assert_eq!(r.address_of(2), Some(0x1000 + 5 * 512));
        assert_eq!(r.address_of(1), None);
    }
    assert_eq!(rows[0].view, ViewId { group: 0, view: 0 });
    assert_eq!(rows[1].view, ViewId { group: 0, view: 1 });
    let state = &rows[2];
    assert_eq!(state.kind, GroupKind::STATE);
    assert_eq!(state.ordinals.as_slice(), &[0]);
    assert_eq!(state.addresses.as_slice(), &[0x10_0000 + 2 * 32]);
}

#[test]
fn excluded_views_and_empty_state_give_no_rows() {
    let t = table();
    let excluded = [ViewId { group: 0, view: 1 }];
    let rows = rows(&t, &[SlotTable::new([1]), SlotTable::default()], &excluded).unwrap();
    assert_eq!(
        rows.iter().map(|r| r.view).collect::<Vec<_>>(),
        vec![ViewId { group: 0, view: 0 }, ViewId { group: 1, view: 0 }]
    );
    assert!(rows[1].is_empty());
}

#[test]
fn rows_refuse_bad_slot_tables_naming_the_problem() {
    let t = table();
    let cases: Vec<(Vec<SlotTable>, Vec<ViewId>, &str)> = vec![
        (
            vec![SlotTable::new([0])],
            vec![],
            "1 slot tables for 2 layer groups",
        ),
        (
            vec![SlotTable::new([10]), SlotTable::default()],
            vec![],
            "names slot 10, outside pool 0 of 10 slots",
        ),
        (
            vec![SlotTable::new([-2]), SlotTable::default()],
            vec![],
            "names slot -2",
        ),
        (
            vec![SlotTable::new([0]), SlotTable::new([0, 1])],
            vec![],
            "STATE group",
        ),
        (
            vec![SlotTable::new([0]), SlotTable::default()],
            vec![ViewId { group: 0, view: 5 }],
            "excluded view (group 0, view 5) does not exist",
        ),
    ];
    for (tables, excluded, needle) in cases {
        let err = rows(&t, &tables, &excluded).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::INVALID_INPUT);
        assert!(err.to_string().contains(needle), "{err}");
    }
}

#[test]
fn layer_ranges_resolve_contiguous_layers_in_slot_order() {
    let t = table();
    let ranges = t.groups[0].views[0].layer_ranges(&t.groups[0]).unwrap();
    assert_eq!(
        ranges,
        vec![
            LayerRange {
                local: 0,
                global: 10,
                offset: 0,
                size: 128,
                buffers: 2
            },
            LayerRange {
                local: 1,
                global: 11,
                offset: 128,
                size: 128,
                buffers: 2
            },
        ]
    );
}

#[test]
fn validate_refuses_broken_tables_naming_the_field() {
    type Mutation = Box<dyn Fn(&mut PageTable)>;
    let mutations: Vec<(Mutation, &str)> = vec![
        (
            Box::new(|t| t.tokens_per_block = 0),
            "tokens_per_block is 0",
        ),
        (
            Box::new(|t| t.pools[0].slot_stride = 100),
            "slot_stride 100 is smaller than slot_bytes 320",
        ),
        (
            Box::new(|t| t.groups[0].views[0].pool = 7),
            "pool 7 does not exist",
        ),
        (
            Box::new(|t| t.groups[0].views[0].entries[1].offset = 65),
            "not contiguous",
        ),
        (
            Box::new(|t| t.groups[0].views[0].entries[3].size = 32),
            "every layer of a view must match",
        ),
        (
            Box::new(|t| t.groups[0].views[1].entries[1].offset = 300),
            "runs past the slot's 320 bytes",
        ),
        (
            Box::new(|t| t.groups[0].views[0].layout.shard_index = 1),
            "shard_index 1 is not below num_shards 1",
        ),
        (
            Box::new(|t| t.groups[0].views[0].layout.kind = LayoutKind(9)),
            "layout kind unknown(9)",
        ),
        (
            Box::new(|t| t.pools[1].memory_type = MemoryType(3)),
            "memory type unknown(3)",
        ),
        (
            Box::new(|t| t.groups[1].views[0].layout.section_bytes = vec![8, 8].into()),
            "sections sum to 16 bytes but a layer holds 32",
        ),
        (
            Box::new(|t| t.groups[0].views[0].entries[0].local_layer = 4),
            "local layer 4, which the group does not hold",
        ),
    ];
    for (mutate, needle) in mutations {
        let mut t = table();
        mutate(&mut t);
        let err = t.validate().unwrap_err();
        assert!(
            err.to_string().contains(needle),
            "wanted {needle:?}, got {err}"
        );
    }
}

#[test]
fn rank_info_survives_the_wire() {
    let rank = RankInfo::new("ctx-0", &"dep4".parse().unwrap(), 3, vec![61], table())
        .with_planner("kvferry.default")
        .with_planner_blob(vec![1, 2, 3]);
    assert_eq!((rank.tp_rank, rank.dp_size, rank.dp_rank), (3, 4, 3));
    let config = bincode::config::standard();
    let bytes = bincode::serde::encode_to_vec(&rank, config).unwrap();
    let (back, used): (RankInfo, usize) =
        bincode::serde::decode_from_slice(&bytes, config).unwrap();
    assert_eq!(used, bytes.len());
    assert_eq!(back, rank);
    assert_eq!(back.tp_per_dp(), 1);
    assert_eq!(back.pp_layer_range(), 0..61);
}

#[test]
fn refusals_name_field_and_both_values() {
    let err = PlanError::refuse("tokens_per_block", 32, 64, "blocks must align");
    assert_eq!(err.kind(), ErrorKind::PEER_INCOMPATIBLE);
    assert_eq!(
        err.to_string(),
        "peer incompatible: tokens_per_block: ours 32, theirs 64: blocks must align"
    );
    let r = err.refusal().unwrap();
    assert_eq!(
        (r.field.as_str(), r.ours.as_str(), r.theirs.as_str()),
        ("tokens_per_block", "32", "64")
    );
    let err = err.context("peer ctx-0/3");
    assert!(
        err.to_string()
            .starts_with("peer incompatible: peer ctx-0/3: tokens_per_block")
    );
    assert!(err.refusal().is_some());
}

struct Panicky;

impl TransferPlanner for Panicky {
    fn check_peer(&self, _: &RankInfo, _: &RankInfo) -> Result<(), PlanError> {
        panic!("check_peer exploded")
    }
    fn targets(&self, _: &RankInfo, _: &RankInfo, dp: u32) -> Result<PeerTargets, PlanError> {
        Ok(PeerTargets {
            ranks: vec![dp].into(),
            uniform: true,
        })
    }
    fn pair(
        &self,
        _: &RankInfo,
        _: &RankInfo,
        _: &[LayerGroupRows],
        _: &[LayerGroupRows],
        _: &PairRequest,
    ) -> Result<TransferPlan, PlanError> {
        std::panic::panic_any(42u32)
    }
}

impl PlannerPlugin for Panicky {
    const PLANNER_ID: &'static str = "test.panicky";
    const SPECIFICITY: Specificity = Specificity(150);
    fn supports_deployment(d: &Deployment) -> Result<(), DeploymentRefusal> {
        if d.architecture.is_empty() {
            panic!("no architecture")
        }
        Err(DeploymentRefusal::new(
            "architecture",
            &d.architecture,
            "Y",
            "X is not for me",
        ))
    }
    fn new(me: &RankInfo) -> Result<Self, PlanError> {
        if me.instance_name.as_str() == "boom" {
            panic!("constructor exploded");
        }
        Ok(Panicky)
    }
}

export_planner!(Panicky);

#[test]
fn panics_become_errors_and_the_planner_stays_usable() {
    let module = planner_module();
    assert_eq!(module.id(), "test.panicky");
    assert_eq!(module.specificity_level(), Specificity(150));
    let mapping = Mapping {
        tp: 2,
        pp: 1,
        cp: 1,
        moe_tp: 2,
        moe_ep: 1,
        attention_dp: false,
    };
    let d = Deployment {
        architecture: "X".into(),
        mapping,
    };
    let err = module.check_deployment(&d).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UNSUPPORTED);
    assert_eq!(
        err.message(),
        "architecture = X (supports Y): X is not for me"
    );
    let refusal = err.deployment_refusal().expect("a field-level refusal");
    assert_eq!(
        (refusal.field.as_str(), refusal.found.as_str()),
        ("architecture", "X")
    );
    let d = Deployment {
        architecture: "".into(),
        mapping,
    };
    let err = module.check_deployment(&d).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PANICKED);
    assert!(
        err.message()
            .contains("supports_deployment panicked: no architecture"),
        "{err}"
    );

    let mut me =
        RankInfo::new("boom", &Mapping::SINGLE, 0, vec![2], table()).with_planner("test.panicky");
    let err = module.instantiate(&me).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PANICKED);
    assert!(err.message().contains("constructor exploded"), "{err}");

    me.instance_name = "fine".into();
    let planner = module.instantiate(&me).unwrap();
    let err = planner.check_peer(&me, &me).unwrap_err();
    assert!(
        err.message()
            .contains("check_peer panicked: check_peer exploded"),
        "{err}"
    );
    let err = planner
        .pair(&me, &me, &[], &[], &PairRequest::whole(8))
        .unwrap_err();
    assert_eq!(err.message(), "pair panicked: non-string panic payload");
    assert_eq!(planner.targets(&me, &me, 3).unwrap().ranks.as_slice(), &[3]);
}
