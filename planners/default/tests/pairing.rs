//! Ordinal pairing (semantics §8.2), chunks, cache reuse, windows and the helix stride
//! (§6.2), as §13.39–43, 49, 53, 54 and 60 map onto positional slot tables.

use kvferry_planner_abi::ffi::ROption;
use kvferry_planner_abi::{
    BufferEntry, GroupKind, PairRequest, PlannerPlugin, RankInfo, SlotTable, TransferPlan,
    TransferPlanner,
};
use kvferry_planner_default::DefaultPlanner;
use kvferry_testkit::builder::{Deploy, Model, local_layers, piece, rows_of};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const H: i64 = SlotTable::HOLE;

/// One attention layer, one head: a 64-byte row per block of `tpb` tokens (tpb 8), copied
/// whole, so a plan is one fragment per paired row.
fn model(tpb: u32, slots: u64) -> Model {
    Model {
        slots,
        ..Model::gqa(1, 1, 16 / tpb.min(16), tpb)
    }
}

struct Pair {
    ctx: RankInfo,
    generation: RankInfo,
    planner: DefaultPlanner,
}

impl Pair {
    fn new(model: &Model, generation: Deploy, rank: u32) -> Self {
        let ctx = Deploy::context(1, model).rank(model, 0);
        let generation = generation.rank(model, rank);
        let planner = DefaultPlanner::new(&ctx).expect("planner");
        planner.check_peer(&ctx, &generation).expect("compatible");
        Self {
            ctx,
            generation,
            planner,
        }
    }

    fn plain(model: &Model) -> Self {
        Self::new(model, Deploy::generation(1, model), 0)
    }

    /// The plan for one piece with one table per group on each side.
    fn plan(&self, ours: &[&[i64]], theirs: &[&[i64]], req: &PairRequest) -> TransferPlan {
        let t = |v: &[&[i64]]| -> Vec<SlotTable> {
            v.iter()
                .map(|s| SlotTable::new(s.iter().copied()))
                .collect()
        };
        self.planner
            .pair(
                &self.ctx,
                &self.generation,
                &rows_of(&self.ctx, &t(ours)),
                &rows_of(&self.generation, &t(theirs)),
                req,
            )
            .expect("plan")
    }

    /// `(source slot, destination slot)` of every fragment (one per row here).
    fn slots(&self, plan: &TransferPlan) -> Vec<(i64, i64)> {
        let slot = |ri: &RankInfo, addr: u64| {
            let pools = &ri.page_table.pools;
            let p = pools.iter().rfind(|p| p.base <= addr).expect("a pool");
            ((addr - p.base) / p.slot_stride) as i64
        };
        plan.iter()
            .map(|(s, d, _)| (slot(&self.ctx, s), slot(&self.generation, d)))
            .collect()
    }
}

#[test]
fn host_pages_pair_by_ordinal() {
    // §13.60: tpb 8, prompt 19 → 3 ordinals; sender [7, 1, 5], receiver [2, 4, 0].
    let m = model(8, 8);
    let p = Pair::plain(&m);
    let plan = p.plan(&[&[7, 1, 5]], &[&[2, 4, 0]], &PairRequest::whole(19));
    assert_eq!(p.slots(&plan), vec![(7, 2), (1, 4), (5, 0)]);
    assert_eq!(plan.total_bytes(), 3 * 64);
    assert!(plan.len.iter().all(|&l| l == 64));
}

#[test]
fn a_chunk_past_a_short_tables_resident_range_pairs_nothing() {
    // §13.39
    let m = model(8, 8);
    let p = Pair::plain(&m);
    let plan = p.plan(
        &[&[3, 4]],
        &[&[0, 1, 2, 3, 4, 5, 6, 7]],
        &piece(32, 64, 64, true),
    );
    assert!(plan.is_empty());
}

#[test]
fn an_incrementally_allocated_sender_sends_each_block_once() {
    // §13.40: resident end 16 with chunk [0, 16) → all 16; then end 32, chunk [16, 32).
    let m = model(1, 32);
    let p = Pair::plain(&m);
    let full: Vec<i64> = (0..32).collect();
    let half: Vec<i64> = (0..32).map(|o| if o < 16 { o } else { H }).collect();
    let first = p.plan(&[&half], &[&full], &piece(0, 16, 32, false));
    assert_eq!(p.slots(&first), (0..16).map(|o| (o, o)).collect::<Vec<_>>());
    let second = p.plan(&[&full], &[&full], &piece(16, 32, 32, true));
    assert_eq!(
        p.slots(&second),
        (16..32).map(|o| (o, o)).collect::<Vec<_>>()
    );
}

#[test]
fn a_cached_receiver_prefix_is_skipped() {
    // §13.41: the receiver holds [104..107] for ordinals 4..8 (ordinals 0..4 cached).
    let m = model(1, 128);
    let p = Pair::plain(&m);
    let src: Vec<i64> = (0..8).collect();
    let dst = [H, H, H, H, 104, 105, 106, 107];
    assert!(p.plan(&[&src], &[&dst], &piece(0, 4, 8, false)).is_empty());
    let plan = p.plan(&[&src], &[&dst], &piece(4, 8, 8, true));
    assert_eq!(p.slots(&plan), vec![(4, 104), (5, 105), (6, 106), (7, 107)]);
}

/// A model whose two layers sit in two PAGED groups (full attention and a 3-block window).
fn two_groups(ri: &mut RankInfo) {
    let mut second = ri.page_table.groups[0].clone();
    let first = &mut ri.page_table.groups[0];
    first.layers = local_layers(&[0]);
    first.views[0].entries = first.views[0]
        .entries
        .iter()
        .copied()
        .filter(|e| e.local_layer == 0)
        .collect();
    let row = first.views[0].entries.iter().map(|e| e.size).sum::<u64>();
    second.window = ROption::RSome(3);
    second.layers = local_layers(&[1]);
    second.views[0].pool = 1;
    second.views[0].entries = second.views[0]
        .entries
        .iter()
        .filter(|e| e.local_layer == 1)
        .map(|e| BufferEntry {
            local_layer: 0,
            offset: e.offset - row,
            ..*e
        })
        .collect();
    let mut pool = ri.page_table.pools[0].clone();
    pool.slot_bytes = row;
    pool.slot_stride = row;
    ri.page_table.pools[0] = pool.clone();
    pool.base += 1 << 29;
    ri.page_table.pools.push(pool);
    ri.page_table.groups.push(second);
}

#[test]
fn two_groups_pair_in_group_order() {
    // §13.42: chunk blocks [4, 8): full attention src [4..8] → dst [104..108]; the window
    // group holds ordinals 5..8 in src [10, 11, 12] → dst [200, 201, 202].
    let m = Model {
        slots: 256,
        ..Model::gqa(2, 1, 8, 1)
    };
    let mut p = Pair::plain(&m);
    two_groups(&mut p.ctx);
    two_groups(&mut p.generation);
    let full_src: Vec<i64> = (0..8).collect();
    let full_dst: Vec<i64> = (100..108).collect();
    let win_src = [H, H, H, H, H, 10, 11, 12];
    let win_dst = [H, H, H, H, H, 200, 201, 202];
    let plan = p.plan(
        &[&full_src, &win_src],
        &[&full_dst, &win_dst],
        &piece(4, 8, 8, true),
    );
    assert_eq!(
        p.slots(&plan),
        vec![
            (4, 104),
            (5, 105),
            (6, 106),
            (7, 107),
            (10, 200),
            (11, 201),
            (12, 202)
        ]
    );
    assert!(plan.len.iter().all(|&l| l == 32), "one K+V layer per row");
}

#[test]
fn a_whole_prompt_chunk_is_the_monolithic_plan() {
    // §13.43, and chunks concatenate to the monolithic plan.
    let m = model(8, 8);
    let p = Pair::plain(&m);
    let (src, dst) = ([5, 6, 7, 0, 1], [0, 1, 2, 3, 4]);
    let whole = p.plan(&[&src], &[&dst], &PairRequest::whole(37));
    assert_eq!(whole, p.plan(&[&src], &[&dst], &piece(0, 37, 37, true)));
    let mut chunks = TransferPlan::new();
    for (a, b) in [(0, 8), (8, 24), (24, 37)] {
        chunks.extend(&p.plan(&[&src], &[&dst], &piece(a, b, 37, b == 37)));
    }
    assert_eq!(chunks, whole);
}

#[test]
fn removed_front_blocks_are_holes() {
    // §13.49: V1 chain [10, 11, 12, 13] with two front blocks removed → [-1, -1, 12, 13].
    let m = model(8, 16);
    let p = Pair::plain(&m);
    let plan = p.plan(
        &[&[H, H, 12, 13]],
        &[&[0, 1, 2, 3]],
        &PairRequest::whole(32),
    );
    assert_eq!(p.slots(&plan), vec![(12, 2), (13, 3)]);
    let plan = p.plan(
        &[&[10, 11, 12, 13]],
        &[&[0, 1, 2, 3]],
        &PairRequest::whole(32),
    );
    assert_eq!(p.slots(&plan), vec![(10, 0), (11, 1), (12, 2), (13, 3)]);
}

/// A sliding-window table as a V1 manager describes it: the front
/// `max(removed, (prompt + 1 − window) / tpb)` ordinals masked, and (receiver only) the
/// cached prefix `cached / tpb` masked.
fn window_table(chain: &[i64], prompt: u64, window: u64, tpb: u64, cached: u64) -> Vec<i64> {
    let stale = (prompt + 1).saturating_sub(window) / tpb;
    let masked = stale.max(cached / tpb);
    chain
        .iter()
        .enumerate()
        .map(|(o, &s)| if (o as u64) < masked { H } else { s })
        .collect()
}

#[test]
fn window_and_reuse_masks_select_the_blocks_both_sides_hold() {
    // §13.53: tpb 8, prompt 32, window 16.
    let m = Model {
        window: Some(16),
        ..model(8, 32)
    };
    let p = Pair::plain(&m);
    let src = window_table(&[18, 19, 20, 21], 32, 16, 8, 0);
    assert_eq!(src, vec![H, H, 20, 21]);
    for (cached, want) in [
        (0, vec![20, 21]),
        (16, vec![20, 21]),
        (24, vec![21]),
        (32, vec![]),
    ] {
        let dst = window_table(&[0, 1, 2, 3], 32, 16, 8, cached);
        let plan = p.plan(&[&src], &[&dst], &PairRequest::whole(32));
        let got: Vec<i64> = p.slots(&plan).into_iter().map(|(s, _)| s).collect();
        assert_eq!(got, want, "cached {cached}");
    }
    // Window 24 and 16 cached tokens on a chain [_, 10, 11, 12] → [11, 12].
    let src = window_table(&[9, 10, 11, 12], 32, 24, 8, 0);
    assert_eq!(src, vec![H, 10, 11, 12]);
    let dst = window_table(&[0, 1, 2, 3], 32, 24, 8, 16);
    let plan = p.plan(&[&src], &[&dst], &PairRequest::whole(32));
    let got: Vec<i64> = p.slots(&plan).into_iter().map(|(s, _)| s).collect();
    assert_eq!(got, vec![11, 12]);
}

#[test]
fn a_larger_receiver_window_pairs_only_what_the_sender_holds() {
    // §13.54: window 24, the sender holds 2 blocks, the receiver 3 → [10, 11] ↔ [21, 22].
    let m = model(8, 32);
    let p = Pair::plain(&m);
    let plan = p.plan(
        &[&[H, H, 10, 11]],
        &[&[H, 20, 21, 22]],
        &PairRequest::whole(32),
    );
    assert_eq!(p.slots(&plan), vec![(10, 21), (11, 22)]);
}

#[test]
fn dst_start_token_bounds_the_ordinals() {
    let m = model(8, 8);
    let p = Pair::plain(&m);
    let mut req = PairRequest::whole(32);
    req.dst_start_token = ROption::RSome(16);
    let plan = p.plan(&[&[0, 1, 2, 3]], &[&[4, 5, 6, 7]], &req);
    assert_eq!(p.slots(&plan), vec![(2, 6), (3, 7)]);
    // Not block aligned: the block holding the start token is still sent.
    req.dst_start_token = ROption::RSome(12);
    let plan = p.plan(&[&[0, 1, 2, 3]], &[&[4, 5, 6, 7]], &req);
    assert_eq!(p.slots(&plan), vec![(1, 5), (2, 6), (3, 7)]);
}

#[test]
fn helix_receiver_ordinal_j_is_sender_ordinal_j_cp_plus_rank() {
    // §6.2: 5 blocks over 2 CP ranks; rank 1 holds global blocks 1 and 3 locally as 0, 1.
    let m = model(8, 8);
    let p = Pair::new(&m, Deploy::generation(1, &m).cp(2), 1);
    let src = [0, 1, 2, 3, 4];
    let plan = p.plan(&[&src], &[&[6, 7]], &PairRequest::whole(40));
    assert_eq!(p.slots(&plan), vec![(1, 6), (3, 7)]);
    let plan = p.plan(&[&[0, 1, 2, H, 4]], &[&[6, 7]], &PairRequest::whole(40));
    assert_eq!(p.slots(&plan), vec![(1, 6)]);
    // Rank 0 holds global blocks 0, 2 and 4.
    let p = Pair::new(&m, Deploy::generation(1, &m).cp(2), 0);
    let plan = p.plan(&[&src], &[&[5, 6, 7]], &PairRequest::whole(40));
    assert_eq!(p.slots(&plan), vec![(0, 5), (2, 6), (4, 7)]);
}

#[test]
fn empty_and_excluded_sides_give_empty_plans() {
    let m = model(8, 8);
    let p = Pair::plain(&m);
    assert!(
        p.plan(&[&[]], &[&[0, 1]], &PairRequest::whole(16))
            .is_empty()
    );
    assert!(
        p.plan(&[&[0, 1]], &[&[H, H]], &PairRequest::whole(16))
            .is_empty()
    );
    assert!(
        p.plan(&[&[0, 1]], &[&[0, 1]], &piece(16, 16, 16, true))
            .is_empty()
    );
    let excluded = p
        .planner
        .pair(
            &p.ctx,
            &p.generation,
            &rows_of(&p.ctx, &[SlotTable::new([0, 1])]),
            &[],
            &PairRequest::whole(16),
        )
        .expect("plan");
    assert!(excluded.is_empty());
}

#[test]
fn rows_that_do_not_describe_the_page_table_are_invalid() {
    let m = model(8, 8);
    let p = Pair::plain(&m);
    let ours = rows_of(&p.ctx, &[SlotTable::new([0, 1])]);
    let mut theirs = rows_of(&p.generation, &[SlotTable::new([0, 1])]);
    theirs[0].row_bytes += 1;
    let err = p
        .planner
        .pair(
            &p.ctx,
            &p.generation,
            &ours,
            &theirs,
            &PairRequest::whole(16),
        )
        .expect_err("row bytes");
    assert!(err.message().contains("bytes per row"), "{err}");
    let mut theirs = rows_of(&p.generation, &[SlotTable::new([0, 1])]);
    theirs[0].kind = GroupKind::STATE;
    assert!(
        p.planner
            .pair(
                &p.ctx,
                &p.generation,
                &ours,
                &theirs,
                &PairRequest::whole(16)
            )
            .is_err()
    );
    let err = p
        .planner
        .pair(&p.ctx, &p.generation, &ours, &ours, &piece(9, 3, 16, true))
        .expect_err("backwards range");
    assert!(err.message().contains("ends before it starts"), "{err}");
}

#[test]
fn random_tables_pair_exactly_the_ordinals_both_hold() {
    let m = model(4, 64);
    let p = Pair::plain(&m);
    let mut rng = StdRng::seed_from_u64(0x5eed);
    for _ in 0..200 {
        let prompt = rng.gen_range(1..=200u64);
        let blocks = prompt.div_ceil(4) as usize;
        let mut table = |p_hole: f64| -> Vec<i64> {
            (0..blocks)
                .map(|_| {
                    if rng.gen_bool(p_hole) {
                        H
                    } else {
                        rng.gen_range(0..64)
                    }
                })
                .collect()
        };
        let (src, dst) = (table(0.3), table(0.3));
        let want: Vec<(i64, i64)> = src
            .iter()
            .zip(&dst)
            .filter(|&(&s, &d)| s != H && d != H)
            .map(|(&s, &d)| (s, d))
            .collect();
        let whole = p.plan(&[&src], &[&dst], &PairRequest::whole(prompt));
        assert_eq!(p.slots(&whole), want);
        // Random block-aligned chunks concatenate to the same plan.
        let mut cuts: Vec<u64> = (0..rng.gen_range(0..4))
            .map(|_| rng.gen_range(0..=blocks as u64) * 4)
            .filter(|&c| c < prompt)
            .collect();
        cuts.push(0);
        cuts.push(prompt);
        cuts.sort_unstable();
        cuts.dedup();
        let mut chunked = TransferPlan::new();
        for w in cuts.windows(2) {
            let req = piece(w[0], w[1], prompt, w[1] == prompt);
            chunked.extend(&p.plan(&[&src], &[&dst], &req));
        }
        assert_eq!(chunked, whole, "cuts {cuts:?}");
    }
}
