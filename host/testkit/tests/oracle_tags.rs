//! Tags depend on logical coordinates only: the same cache byte carries the same tag under
//! every sharding and layout the oracle models.

use kvferry_plan::RequestSide;
use kvferry_planner_abi::{LayoutKind, Mapping, RankInfo, SlotTable};
use kvferry_testkit::layout::{ModelSpec, PoolOptions, Preset, build_rank};
use kvferry_testkit::oracle::{LocalMemory, Oracle};

fn mapping(tp: u32, cp: u32) -> Mapping {
    Mapping {
        tp,
        pp: 1,
        cp,
        moe_tp: 1,
        moe_ep: 1,
        attention_dp: false,
    }
}

fn options() -> PoolOptions {
    PoolOptions {
        paged_slots: 3,
        state_slots: 1,
        ..PoolOptions::default()
    }
}

fn rank(memory: &mut LocalMemory, preset: Preset, m: Mapping, r: u32) -> RankInfo {
    let mut alloc = |_: u32, _: usize, bytes: u64| memory.allocate(bytes, "pool");
    build_rank(
        &ModelSpec::new(preset),
        &m,
        "x",
        "p",
        r,
        &options(),
        &mut alloc,
    )
    .unwrap()
}

fn fill(memory: &mut LocalMemory, info: &RankInfo, tables: &[SlotTable]) {
    Oracle::new(11)
        .fill_source(memory, RequestSide::new(info, tables))
        .unwrap();
}

fn bytes(memory: &LocalMemory, info: &RankInfo, pool: usize, offset: u64, len: u64) -> Vec<u8> {
    let base = info.page_table.pools[pool].base;
    memory.bytes(base + offset, len).unwrap().to_vec()
}

#[test]
fn llama_heads_match_across_tp() {
    let mut memory = LocalMemory::new();
    let tp1 = rank(&mut memory, Preset::Llama3_70b, mapping(1, 1), 0);
    let tp2 = rank(&mut memory, Preset::Llama3_70b, mapping(2, 1), 1);
    // Ordinal 1 in slot 2 on TP1, in slot 0 on TP2.
    fill(&mut memory, &tp1, &[SlotTable::new([-1, 2])]);
    fill(&mut memory, &tp2, &[SlotTable::new([-1, 0])]);
    let head = 32 * 128 * 2;
    let (layer1, layer2) = (8 * head * 2, 4 * head * 2);
    let (slot1, slot2) = (tp1.page_table.pools[0].slot_stride, 0);
    for (layer, buffer) in [(0u64, 0u64), (5, 1), (79, 1)] {
        // TP2 rank 1 holds heads 4..8.
        let a = bytes(
            &memory,
            &tp1,
            0,
            2 * slot1 + layer * layer1 + buffer * 8 * head + 4 * head,
            4 * head,
        );
        let b = bytes(
            &memory,
            &tp2,
            0,
            slot2 + layer * layer2 + buffer * 4 * head,
            4 * head,
        );
        assert!(a == b, "layer {layer} buffer {buffer}");
    }
    // Different tokens differ.
    let a = bytes(&memory, &tp1, 0, 2 * slot1, 256);
    let c = bytes(&memory, &tp1, 0, 2 * slot1 + 256, 256);
    assert_ne!(a, c);
}

#[test]
fn nhd_and_hnd_agree() {
    let mut memory = LocalMemory::new();
    let hnd = rank(&mut memory, Preset::Llama3_70b, mapping(1, 1), 0);
    let mut nhd = rank(&mut memory, Preset::Llama3_70b, mapping(1, 1), 0);
    let layout = &mut nhd.page_table.groups[0].views[0].layout;
    layout.kind = LayoutKind::NHD;
    layout.shard_unit_bytes = 128 * 2;
    fill(&mut memory, &hnd, &[SlotTable::new([0])]);
    fill(&mut memory, &nhd, &[SlotTable::new([0])]);
    let row = 256;
    for (h, t) in [(0u64, 0u64), (3, 17), (7, 31)] {
        let a = bytes(&memory, &hnd, 0, (h * 32 + t) * row, row);
        let b = bytes(&memory, &nhd, 0, (t * 8 + h) * row, row);
        assert!(a == b, "head {h} token {t}");
    }
}

#[test]
fn qwen_state_shards_match_across_tp() {
    let mut memory = LocalMemory::new();
    let tp1 = rank(&mut memory, Preset::Qwen3Next80bA3b, mapping(1, 1), 0);
    let tp2 = rank(&mut memory, Preset::Qwen3Next80bA3b, mapping(2, 1), 1);
    let tables = [SlotTable::new([0]), SlotTable::new([0])];
    fill(&mut memory, &tp1, &tables);
    fill(&mut memory, &tp2, &tables);
    // Conv: sections Q, K, V; rank 1 of 2 holds the second half of each.
    let (full, half) = ([12_288u64, 12_288, 24_576], [6_144u64, 6_144, 12_288]);
    for layer in [0u64, 20, 35] {
        let (mut s1, mut s2) = (layer * 49_152, layer * 24_576);
        for k in 0..3 {
            let a = bytes(&memory, &tp1, 1, s1 + half[k], half[k]);
            let b = bytes(&memory, &tp2, 1, s2, half[k]);
            assert!(a == b, "layer {layer} section {k}");
            s1 += full[k];
            s2 += half[k];
        }
        // SSM: rank 1 holds value heads 16..32.
        let a = bytes(
            &memory,
            &tp1,
            2,
            layer * 2_097_152 + 16 * 65_536,
            16 * 65_536,
        );
        let b = bytes(&memory, &tp2, 2, layer * 1_048_576, 16 * 65_536);
        assert!(a == b, "ssm layer {layer}");
    }
}

#[test]
fn helix_local_ordinals_map_to_global_tokens() {
    let mut memory = LocalMemory::new();
    let ctx = rank(&mut memory, Preset::DeepseekV3, mapping(1, 1), 0);
    // CP rank 1 of 2: local ordinal 1 is global ordinal 3.
    let gen_rank = rank(&mut memory, Preset::DeepseekV3, mapping(1, 2), 1);
    fill(&mut memory, &ctx, &[SlotTable::new([-1, -1, -1, 1])]);
    fill(&mut memory, &gen_rank, &[SlotTable::new([-1, 2])]);
    let slot = ctx.page_table.pools[0].slot_bytes;
    let a = bytes(&memory, &ctx, 0, slot, slot);
    let b = bytes(&memory, &gen_rank, 0, 2 * slot, slot);
    assert!(a == b);
}
