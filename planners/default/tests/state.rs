//! Recurrent state (semantics §7, §13.19–21, 26–31): shard pairing on the state grid, the
//! last piece, and the receiver payload.

use crate::common;

use common::run;
use kvferry_planner_abi::{PlannerPlugin, RankInfo, SlotTable, TransferPlan, TransferPlanner};
use kvferry_planner_default::DefaultPlanner;
use kvferry_testkit::builder::{Deploy, Model, StateSpec, piece, rows_of, tables};
use kvferry_testkit::scenario::Transfer;

/// A hybrid model whose state splits over up to 8 ranks.
fn wide_hybrid() -> Model {
    let mut m = Model::hybrid(8, 4);
    m.state = Some(StateSpec {
        layers: vec![0, 1, 2, 4, 5, 6],
        conv_sections: vec![128, 64, 64],
        ssm_heads: 8,
        ssm_head_bytes: 16,
        replicated_side: None,
    });
    m
}

/// The plan `sender` writes into `receiver` for a 2-block prompt, with or without the last
/// piece's state.
fn plan(sender: &RankInfo, receiver: &RankInfo, is_last: bool) -> TransferPlan {
    let ours = rows_of(sender, &tables(&sender.page_table, &[0, 1], &[3]));
    let theirs = rows_of(receiver, &tables(&receiver.page_table, &[2, 3], &[5]));
    DefaultPlanner::new(sender)
        .expect("planner")
        .pair(sender, receiver, &ours, &theirs, &piece(0, 8, 8, is_last))
        .expect("plan")
}

/// Bytes of a plan that land in the receiver's STATE pools (every pool after the first).
fn state_bytes(p: &TransferPlan, receiver: &RankInfo) -> u64 {
    let first_state_pool = receiver.page_table.pools[1].base;
    p.iter()
        .filter(|&(_, d, _)| d >= first_state_pool)
        .map(|(_, _, l)| l)
        .sum()
}

#[test]
fn state_grid_is_tp_times_cp_cp_minor() {
    // §13.19: (1, 0) at tp = cp = 1; cp 32 rank 5 → (32, 5); tp2 r1 cp4 r3 → (8, 7).
    let m = wide_hybrid();
    assert_eq!(Deploy::generation(1, &m).state_grid(0, 0), (1, 0));
    assert_eq!(Deploy::generation(1, &m).cp(32).state_grid(0, 5), (32, 5));
    assert_eq!(Deploy::generation(2, &m).cp(4).state_grid(1, 3), (8, 7));
    // Helix decode rank (tp 1, cp 3) of tp2 cp4 is flat rank 7 and holds state shard 7
    // of 8: of its four TP8 context writers only rank 7 sends state.
    let ctx = Deploy::context(8, &m);
    let generation = Deploy::generation(2, &m).cp(4);
    let g = generation.rank(&m, 7);
    let ssm = &g.page_table.groups[1].views[1].layout;
    assert_eq!((ssm.num_shards, ssm.shard_index), (8, 7));
    let t = DefaultPlanner::new(&g)
        .unwrap()
        .targets(&g, &ctx.rank(&m, 0), 0)
        .unwrap();
    assert_eq!(t.ranks.as_slice(), &[4, 5, 6, 7]);
    for c in 4..8 {
        let sent = state_bytes(&plan(&ctx.rank(&m, c), &g, true), &g);
        assert_eq!(sent > 0, c == 7, "prefill rank {c}");
    }
    run(&Transfer::new(&m, ctx, generation, 13)).expect("bytes");
}

#[test]
fn equal_state_widths_pair_rank_for_rank() {
    // §13.20: tp2 sender, cp2 receiver: paired iff sender rank == receiver cp rank.
    let m = wide_hybrid();
    for t in 0..2 {
        for c in 0..2 {
            let s = Deploy::context(2, &m).rank(&m, t);
            let r = Deploy::generation(1, &m).cp(2).rank(&m, c);
            let sent = state_bytes(&plan(&s, &r, true), &r);
            assert_eq!(sent > 0, t == c, "sender {t} receiver cp {c}");
        }
    }
}

#[test]
fn a_finer_receiver_pairs_the_covering_sender_only() {
    // §13.21: grid 2 → grid 4: receiver g pairs sender g / 2 only.
    let m = wide_hybrid();
    for t in 0..2 {
        for g in 0..4 {
            let s = Deploy::context(2, &m).rank(&m, t);
            let r = Deploy::generation(4, &m).rank(&m, g);
            let sent = state_bytes(&plan(&s, &r, true), &r);
            assert_eq!(sent > 0, t == g / 2, "sender {t} receiver {g}");
        }
    }
}

#[test]
fn state_rides_on_the_last_piece_only() {
    let m = wide_hybrid();
    let (s, r) = (
        Deploy::context(1, &m).rank(&m, 0),
        Deploy::generation(1, &m).rank(&m, 0),
    );
    assert_eq!(state_bytes(&plan(&s, &r, false), &r), 0);
    let last = plan(&s, &r, true);
    // Six state layers of (256 conv + 128 ssm) bytes.
    assert_eq!(state_bytes(&last, &r), 6 * (256 + 128));
    // Two blocks of two attention layers of K and V, 4 heads × 4 tokens × 8 bytes each.
    assert_eq!(last.total_bytes() - state_bytes(&last, &r), 2 * 2 * 2 * 128);
}

/// Kimi-K3 (semantics §12.3): 24 MLA layers (latent 576, BF16, tpb 32) and 69 KDA layers
/// with conv `[3 × 96 heads × 128, 3]` BF16 and SSM `[96, 128, 128]` FP32 state.
fn kimi_k3() -> Model {
    let attn: Vec<u32> = (0..93).filter(|l| l % 4 == 0).collect();
    let state: Vec<u32> = (0..93).filter(|l| l % 4 != 0).collect();
    assert_eq!((attn.len(), state.len()), (24, 69));
    Model {
        layers: 93,
        attn,
        state: Some(StateSpec {
            layers: state,
            conv_sections: vec![73_728; 3],
            ssm_heads: 96,
            ssm_head_bytes: 128 * 128 * 4,
            replicated_side: None,
        }),
        slots: 128,
        ..Model::mla(24, 576, 32)
    }
}

#[test]
fn receiver_payload_is_the_state_landing_in_the_receivers_slot() {
    // §13.26 / 31: MLA row 884,736 B; state payload 69 × (221,184 + 6,291,456) for any slot,
    // 0 with no slot or without a STATE group on either side.
    let m = kimi_k3();
    let r = Deploy::generation(1, &m).rank(&m, 0);
    let s = Deploy::context(1, &m).rank(&m, 0);
    assert_eq!(r.page_table.pools[0].slot_bytes, 884_736);
    let planner = DefaultPlanner::new(&r).expect("planner");
    let payload = |sender: &RankInfo, slot: &[i64]| {
        planner
            .receiver_payload_bytes(&r, sender, &tables(&r.page_table, &[0; 67], slot))
            .expect("payload")
    };
    for slot in [0, 5, 127] {
        assert_eq!(payload(&s, &[slot]), 449_372_160);
    }
    assert_eq!(payload(&s, &[]), 0);
    assert_eq!(payload(&s, &[SlotTable::HOLE]), 0);
    let attention_only = Model::mla(24, 576, 32);
    assert_eq!(
        payload(
            &Deploy::context(1, &attention_only).rank(&attention_only, 0),
            &[1]
        ),
        0
    );
    let planner = DefaultPlanner::new(&s).expect("planner");
    let mla = Deploy::generation(1, &attention_only).rank(&attention_only, 0);
    let tables = tables(&mla.page_table, &[0], &[]);
    assert_eq!(
        planner
            .receiver_payload_bytes(&mla, &s, &tables)
            .expect("payload"),
        0
    );
}

#[test]
fn receiver_payload_is_receiver_local_and_limited_to_common_layers() {
    let m = wide_hybrid();
    let per_layer_tp1 = 256 + 128;
    // A TP2 receiver gets half of every layer, whatever the sender's width.
    let r = Deploy::generation(2, &m).rank(&m, 1);
    let planner = DefaultPlanner::new(&r).expect("planner");
    let t = tables(&r.page_table, &[0, 1], &[4]);
    for sender_tp in [1, 2, 4] {
        let s = Deploy::context(sender_tp, &m).rank(&m, 0);
        let got = planner.receiver_payload_bytes(&r, &s, &t).expect("payload");
        assert_eq!(got, 6 * per_layer_tp1 / 2, "sender tp{sender_tp}");
    }
    // A sender stage holding layers 0..4 shares state layers 0, 1 and 2 only.
    let s = Deploy::context(1, &m).pp(vec![4, 4]).rank(&m, 0);
    assert_eq!(
        planner.receiver_payload_bytes(&r, &s, &t).expect("payload"),
        3 * per_layer_tp1 / 2
    );
    // The slot table count must match the receiver's groups.
    let err = planner
        .receiver_payload_bytes(&r, &s, &t[..1])
        .expect_err("one table short");
    assert!(
        err.message()
            .contains("1 slot tables for the 2 layer groups"),
        "{err}"
    );
}
