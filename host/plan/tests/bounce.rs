//! Bounce-region sizing and gates (`transfer-semantics.md` §9.2, test behaviours 26–30),
//! on a Kimi-K3-shaped page table: 24 MLA layers in one paged pool (latent 576, BF16,
//! 32 tokens per block: 884,736-byte slots) and 69 KDA layers of recurrent state.

use kvferry_plan::bounce::{BounceLimits, BounceSkip, Reservation, block_bytes_per_group, reserve};
use kvferry_planner_abi::{
    GroupKind, LayerGroup, LayoutKind, MemoryType, PageTable, PhysicalPool, PoolView, RoleLayout,
    SlotTable,
    ffi::{ROption, RString, RVec},
};

const MLA_SLOT: u64 = 32 * 576 * 2 * 24;
const K3_STATE: u64 = 69 * (221_184 + 6_291_456);

fn pool(slot_bytes: u64) -> PhysicalPool {
    PhysicalPool {
        base: 0x1000_0000,
        slot_bytes,
        slot_stride: slot_bytes,
        num_slots: 256,
        memory_type: MemoryType::DRAM,
    }
}

fn view(pool: u32, role: &str) -> PoolView {
    PoolView {
        pool,
        entries: RVec::new(),
        roles: RVec::from(vec![RString::from(role)]),
        layout: RoleLayout::whole(LayoutKind::HND, "bf16", 16),
    }
}

fn group(kind: GroupKind, views: Vec<PoolView>) -> LayerGroup {
    LayerGroup {
        kind,
        window: ROption::RNone,
        layers: RVec::new(),
        views: RVec::from(views),
    }
}

/// K3: pool 0 the MLA latent, pools 1 and 2 the KDA conv and SSM state.
fn k3() -> PageTable {
    PageTable {
        tokens_per_block: 32,
        pools: RVec::from(vec![pool(MLA_SLOT), pool(221_184), pool(6_291_456)]),
        groups: RVec::from(vec![
            group(GroupKind::PAGED, vec![view(0, "key")]),
            group(GroupKind::STATE, vec![view(1, "conv"), view(2, "ssm")]),
        ]),
    }
}

fn table(slots: impl IntoIterator<Item = i64>) -> SlotTable {
    SlotTable {
        slots: slots.into_iter().collect(),
    }
}

/// `blocks` paged blocks (every other ordinal a cached-prefix hole before them) and a state
/// slot when `state`.
fn tables(blocks: i64, state: bool) -> Vec<SlotTable> {
    let paged = (0..4).map(|_| SlotTable::HOLE).chain(0..blocks);
    vec![
        table(paged),
        table(if state {
            vec![3]
        } else {
            vec![SlotTable::HOLE]
        }),
    ]
}

/// One writer, default limits: the common case.
fn reserve_one(
    pt: &PageTable,
    tables: &[SlotTable],
    extra: u64,
) -> Result<Reservation, BounceSkip> {
    reserve(pt, tables, extra, 1, true, &BounceLimits::default())
}

fn fan_in() -> BounceLimits {
    BounceLimits {
        fan_in: true,
        ..BounceLimits::default()
    }
}

#[test]
fn block_bytes_count_distinct_paged_pools_and_skip_state() {
    // Behaviour 26.
    assert_eq!(block_bytes_per_group(&k3()), vec![Some(884_736), None]);
    // Two views of one pool (K and V in one slot) count the pool once; two pools add.
    let mut pt = k3();
    pt.groups[0].views.push(view(0, "value"));
    assert_eq!(block_bytes_per_group(&pt)[0], Some(884_736));
    pt.pools.push(pool(1000));
    pt.groups[0].views.push(view(3, "indexer"));
    assert_eq!(block_bytes_per_group(&pt)[0], Some(885_736));
}

#[test]
fn a_k3_request_with_state_bounces_blocks_plus_payload() {
    // Behaviour 27: 67 blocks and the state payload, although 67 < 96 blocks.
    let got = reserve_one(&k3(), &tables(67, true), K3_STATE);
    assert_eq!(
        got,
        Ok(Reservation {
            total: 67 * 884_736 + 449_372_160,
            writers: 1,
            blocks: 67,
            extra: K3_STATE,
        })
    );
    // An empty state entry with the extra still given (the reference's test) is the same.
    let got = reserve_one(&k3(), &tables(67, false), K3_STATE);
    assert_eq!(got.map(|r| r.total), Ok(67 * 884_736 + K3_STATE));
}

#[test]
fn state_groups_are_sized_by_the_payload_not_refused() {
    // Behaviour 28: a STATE entry whose block size is unknown is skipped.
    let got = reserve_one(&k3(), &tables(100, true), 0);
    assert_eq!(got.map(|r| r.total), Ok(100 * MLA_SLOT));
    // A paged group holding blocks with no pool to size them is a different matter.
    let mut pt = k3();
    pt.groups[0].views = RVec::new();
    assert_eq!(
        reserve_one(&pt, &tables(100, false), 0),
        Err(BounceSkip::UnknownBlockSize {
            group: 0,
            blocks: 100
        })
    );
}

#[test]
fn extra_bytes_count_toward_the_byte_threshold_and_the_capacity() {
    // Behaviour 29, on a one-block table whose block is 500 bytes.
    let pt = PageTable {
        pools: RVec::from(vec![pool(500)]),
        groups: RVec::from(vec![group(GroupKind::PAGED, vec![view(0, "key")])]),
        ..k3()
    };
    let one = [table([0])];
    let limits = BounceLimits {
        min_bytes: 1000,
        ..BounceLimits::default()
    };
    assert_eq!(
        reserve(&pt, &one, 499, 1, true, &limits),
        Err(BounceSkip::TooFewBytes {
            total: 999,
            min: 1000
        })
    );
    assert_eq!(
        reserve(&pt, &one, 500, 1, true, &limits).map(|r| r.total),
        Ok(1000)
    );
    let small = BounceLimits {
        capacity: 500,
        ..limits
    };
    let got = reserve(
        &pt,
        &one,
        100,
        1,
        true,
        &BounceLimits {
            min_bytes: 0,
            ..small
        },
    );
    assert_eq!(
        got,
        Err(BounceSkip::OverCapacity {
            total: 600,
            capacity: 500
        })
    );
    // Without state the block threshold applies instead.
    assert_eq!(
        reserve(&pt, &one, 0, 1, true, &limits),
        Err(BounceSkip::TooFewBlocks { blocks: 1, min: 96 })
    );
}

#[test]
fn fan_in_splits_evenly_only_without_state_and_only_when_enabled() {
    // Behaviour 30.
    let pt = k3();
    assert_eq!(
        reserve(&pt, &tables(128, true), K3_STATE, 2, true, &fan_in()),
        Err(BounceSkip::StateWithFanIn {
            extra: K3_STATE,
            writers: 2
        })
    );
    let split = reserve(&pt, &tables(128, false), 0, 2, true, &fan_in()).unwrap();
    assert_eq!(
        (split.total, split.share()),
        (128 * MLA_SLOT, 64 * MLA_SLOT)
    );
    // Off by default (the newest reference refuses multi-writer bounce), and never for
    // writers whose shares are not uniform.
    assert_eq!(
        reserve(&pt, &tables(128, false), 0, 2, true, &Default::default()),
        Err(BounceSkip::FanInDisabled { writers: 2 })
    );
    assert_eq!(
        reserve(&pt, &tables(128, false), 0, 2, false, &fan_in()),
        Err(BounceSkip::NotUniform { writers: 2 })
    );
    // A region that does not split evenly: 97 blocks of 1,001 bytes over two writers.
    let odd = PageTable {
        pools: RVec::from(vec![pool(1001)]),
        groups: RVec::from(vec![group(GroupKind::PAGED, vec![view(0, "key")])]),
        ..k3()
    };
    assert_eq!(
        reserve(&odd, &tables(97, false)[..1], 0, 2, true, &fan_in()),
        Err(BounceSkip::Uneven {
            total: 97 * 1001,
            writers: 2
        })
    );
    // Nor one whose paged groups have different block sizes, even when the bytes divide.
    let mut mixed = odd.clone();
    mixed.pools.push(pool(999));
    mixed
        .groups
        .push(group(GroupKind::PAGED, vec![view(1, "value")]));
    let both = [tables(100, false).remove(0), tables(100, false).remove(0)];
    assert_eq!(
        reserve(&mixed, &both, 0, 2, true, &fan_in()),
        Err(BounceSkip::MixedBlockSizes {
            sizes: vec![999, 1001],
            writers: 2
        })
    );
}

#[test]
fn nothing_to_move_and_mismatched_tables_are_named() {
    assert_eq!(
        reserve_one(&k3(), &tables(0, false), 0),
        Err(BounceSkip::Empty)
    );
    assert_eq!(
        reserve(&k3(), &tables(100, false), 0, 0, true, &Default::default()),
        Err(BounceSkip::NoWriters)
    );
    let err = reserve_one(&k3(), &tables(10, false)[..1], 0).unwrap_err();
    assert_eq!(err.to_string(), "1 slot tables for 2 layer groups");
}
