//! Targets (semantics §5.1, §13.9–14) and the uniform writer flag (§9.1).

use kvferry_planner_abi::{ErrorKind, PeerTargets, PlannerPlugin, RankInfo, TransferPlanner};
use kvferry_planner_default::DefaultPlanner;
use kvferry_testkit::builder::{Deploy, Model};

fn targets(me: &RankInfo, peer: &RankInfo, peer_dp_rank: u32) -> PeerTargets {
    let planner = DefaultPlanner::new(me).expect("planner");
    planner
        .targets(me, peer, peer_dp_rank)
        .unwrap_or_else(|e| panic!("targets: {e}"))
}

#[test]
fn pp_fan_in_targets_every_overlapping_stage() {
    // §13.9: self pp1 [2] vs peer pp2 [1, 1] → ranks [0, 1].
    let model = Model::gqa(2, 4, 4, 4);
    let me = Deploy::generation(1, &model).rank(&model, 0);
    let peer = Deploy::context(1, &model).pp(vec![1, 1]).rank(&model, 0);
    let t = targets(&me, &peer, 0);
    assert_eq!(t.ranks.as_slice(), &[0, 1]);
    assert!(!t.uniform, "PP fan-in is not uniform");
    // And back: each context stage serves the single decode rank.
    for stage in 0..2 {
        let ctx = Deploy::context(1, &model)
            .pp(vec![1, 1])
            .rank(&model, stage);
        assert_eq!(targets(&ctx, &me, 0).ranks.as_slice(), &[0]);
    }
}

#[test]
fn a_stage_without_layers_has_no_targets() {
    // §13.10
    let model = Model::gqa(2, 4, 4, 4);
    let me = Deploy::generation(1, &model).pp(vec![2, 0]).rank(&model, 1);
    assert!(me.page_table.groups.is_empty());
    let peer = Deploy::context(1, &model).pp(vec![1, 1]).rank(&model, 0);
    let t = targets(&me, &peer, 0);
    assert!(t.ranks.is_empty());
    assert!(!t.uniform);
}

#[test]
fn attention_dp_pairs_exactly_the_target_dp_rank() {
    // §13.14: 4×4 attention DP, any source DP rank to any target DP rank.
    let model = Model::mla(2, 8, 4);
    let ctx = Deploy::context(4, &model).adp();
    let generation = Deploy::generation(4, &model).adp();
    for s in 0..4 {
        for d in 0..4 {
            let (src, dst) = (ctx.rank(&model, s), generation.rank(&model, d));
            for ri in [&src, &dst] {
                assert_eq!(ri.instance_rank, ri.tp_rank);
                assert_eq!(ri.tp_rank, ri.dp_rank);
                assert_eq!((ri.tp_size, ri.dp_size, ri.tp_per_dp()), (4, 4, 1));
            }
            let t = targets(&src, &dst, dst.dp_rank);
            assert_eq!(t.ranks.as_slice(), &[dst.instance_rank]);
            assert!(t.uniform);
            // The receiver names the source of the request's DP group.
            assert_eq!(targets(&dst, &src, s).ranks.as_slice(), &[s]);
        }
    }
}

#[test]
fn tp_context_fans_in_to_an_attention_dp_rank() {
    let model = Model::mla(2, 8, 4);
    let ctx = Deploy::context(4, &model);
    let generation = Deploy::generation(4, &model).adp();
    for d in 0..4 {
        let gri = generation.rank(&model, d);
        let t = targets(&gri, &ctx.rank(&model, 0), 0);
        assert_eq!(t.ranks.as_slice(), &[0, 1, 2, 3]);
        assert!(!t.uniform, "one owner, three empty writers");
        for c in 0..4 {
            let t = targets(&ctx.rank(&model, c), &gri, d);
            assert_eq!(t.ranks.as_slice(), &[d]);
        }
    }
}

#[test]
fn helix_context_rank_serves_every_cp_rank() {
    let model = Model::gqa(2, 4, 4, 4);
    let ctx = Deploy::context(2, &model);
    let generation = Deploy::generation(2, &model).cp(2);
    // Decode rank (tp t, cp c) is flat rank 2t + c and hears from prefill rank t only.
    for g in 0..4 {
        let gri = generation.rank(&model, g);
        let t = targets(&gri, &ctx.rank(&model, 0), 0);
        assert_eq!(t.ranks.as_slice(), &[g / 2]);
        assert!(t.uniform);
    }
    for c in 0..2 {
        let t = targets(&ctx.rank(&model, c), &generation.rank(&model, 0), 0);
        assert_eq!(t.ranks.as_slice(), &[2 * c, 2 * c + 1]);
        assert!(!t.uniform, "CP involved");
    }
}

#[test]
fn uniform_only_when_every_writer_has_an_equal_share() {
    let gqa = Model::gqa(4, 8, 16, 4);
    let gen_tp2 = Deploy::generation(2, &gqa).rank(&gqa, 1);
    // 2 writers of equal head shares.
    let t = targets(&gen_tp2, &Deploy::context(4, &gqa).rank(&gqa, 0), 0);
    assert_eq!((t.ranks.as_slice(), t.uniform), (&[2, 3][..], true));
    // Recurrent state: writers send unequal shares.
    let hybrid = Model::hybrid(8, 4);
    let g = Deploy::generation(1, &hybrid).rank(&hybrid, 0);
    let t = targets(&g, &Deploy::context(2, &hybrid).rank(&hybrid, 0), 0);
    assert_eq!((t.ranks.len(), t.uniform), (2, false));
}

#[test]
fn targets_are_cached_per_peer_dp_rank_and_checked() {
    let model = Model::mla(2, 8, 4);
    let me = Deploy::context(2, &model).rank(&model, 1);
    let peer = Deploy::generation(4, &model).adp().rank(&model, 0);
    let planner = DefaultPlanner::new(&me).expect("planner");
    for d in [3, 0, 3, 2] {
        assert_eq!(
            planner.targets(&me, &peer, d).unwrap().ranks.as_slice(),
            &[d]
        );
    }
    let err = planner.targets(&me, &peer, 4).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::INVALID_INPUT);
    assert!(err.message().contains("not below the 4 DP groups"), "{err}");
}
