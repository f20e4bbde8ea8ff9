//! Mapper vectors (semantics §5.3, §13.16–18) and the worked numbers of §12.

use kvferry_planner_abi::ffi::RString;
use kvferry_planner_abi::{LayoutKind, PlannerPlugin, RankInfo, TransferPlan, TransferPlanner};
use kvferry_planner_default::DefaultPlanner;
use kvferry_testkit::builder::{Deploy, Model, piece, rows_of, tables};

/// The plan `sender` writes into `receiver` for a whole prompt, every ordinal held.
fn plan(sender: &RankInfo, receiver: &RankInfo, prompt: u64) -> TransferPlan {
    let blocks = prompt.div_ceil(u64::from(sender.page_table.tokens_per_block));
    let table: Vec<i64> = (0..blocks as i64).collect();
    let ours = rows_of(sender, &tables(&sender.page_table, &table, &[0]));
    let theirs = rows_of(receiver, &tables(&receiver.page_table, &table, &[0]));
    let planner = DefaultPlanner::new(sender).expect("planner");
    planner.check_peer(sender, receiver).expect("compatible");
    planner
        .pair(
            sender,
            receiver,
            &ours,
            &theirs,
            &piece(0, prompt, prompt, true),
        )
        .expect("plan")
}

/// The targets `me` expects for peer DP rank 0.
fn targets(me: &RankInfo, peer: &RankInfo) -> (Vec<u32>, bool) {
    let planner = DefaultPlanner::new(me).expect("planner");
    let t = planner.targets(me, peer, 0).expect("targets");
    (t.ranks.to_vec(), t.uniform)
}

#[test]
fn hnd_head_mismatch_vector_with_sub_byte_elements() {
    // §13.16: self tp1 with 2 heads of 64 B per buffer (layer 256 B = K 128 + V 128), peer
    // tp2 rank 1 with 1 head (layer 128 B); rows at 1000 and 2000; 2 layers. The sizes come
    // from the slot bytes, never from the element width (NVFP4: 4 bits).
    let model = Model::gqa(2, 2, 8, 4);
    let mut ctx = Deploy::context(1, &model).rank(&model, 0);
    let mut generation = Deploy::generation(2, &model).rank(&model, 1);
    for (ri, base) in [(&mut ctx, 1000), (&mut generation, 2000)] {
        ri.page_table.pools[0].base = base;
        let layout = &mut ri.page_table.groups[0].views[0].layout;
        layout.dtype = RString::from("nvfp4");
        layout.elem_bits = 4;
    }
    assert_eq!(ctx.page_table.pools[0].slot_bytes, 512);
    assert_eq!(generation.page_table.pools[0].slot_bytes, 256);
    let p = plan(&ctx, &generation, 4);
    assert_eq!(
        p.iter().collect::<Vec<_>>(),
        vec![
            (1064, 2000, 64),
            (1192, 2064, 64),
            (1320, 2128, 64),
            (1448, 2192, 64)
        ]
    );
}

#[test]
fn hnd_mismatch_emits_one_fragment_per_layer_and_buffer() {
    // §13.17: 4 layers × K/V per row, each `min(heads) × bytes per head`.
    let model = Model::gqa(4, 8, 16, 8);
    let head = 8 * 16 * 2;
    for (ctx_tp, gen_tp) in [(1, 2), (2, 8), (8, 2), (4, 1)] {
        let c = Deploy::context(ctx_tp, &model).rank(&model, 0);
        let g = Deploy::generation(gen_tp, &model).rank(&model, 0);
        let p = plan(&c, &g, 24);
        let heads = (8 / ctx_tp).min(8 / gen_tp);
        assert_eq!(p.fragments(), 3 * 4 * 2, "tp{ctx_tp} -> tp{gen_tp}");
        assert!(p.len.iter().all(|&l| l == u64::from(heads * head)));
    }
}

#[test]
fn finer_peer_head_offset_follows_the_total_head_formula() {
    // §13.18: when the peer is finer, the source head inside our buffer is
    // `(peer_tp_rank × self_heads × self_tp) / peer_tp % self_heads`.
    let model = Model::gqa(1, 8, 4, 2);
    let head = 2 * 4 * 2;
    for self_tp in [1u32, 2, 4] {
        for peer_tp in [2u32, 4, 8] {
            if peer_tp <= self_tp {
                continue;
            }
            let self_heads = 8 / self_tp;
            for peer_rank in 0..peer_tp {
                let self_rank = peer_rank / (peer_tp / self_tp);
                let c = Deploy::context(self_tp, &model).rank(&model, self_rank);
                let g = Deploy::generation(peer_tp, &model).rank(&model, peer_rank);
                let p = plan(&c, &g, 2);
                let want = (peer_rank * self_heads * self_tp) / peer_tp % self_heads;
                let src = c.page_table.pools[0].base;
                assert_eq!(
                    p.src[0] - src,
                    u64::from(want * head),
                    "self tp{self_tp} r{self_rank} peer tp{peer_tp} r{peer_rank}"
                );
            }
        }
    }
}

/// Offsets of a plan's fragments from the two rows' starts, for one block.
fn offsets(p: &TransferPlan, src_row: u64, dst_row: u64) -> Vec<(u64, u64, u64)> {
    p.iter()
        .map(|(s, d, l)| (s - src_row, d - dst_row, l))
        .collect()
}

#[test]
fn llama70b_tp4_to_tp8() {
    // §12.2: decode rank g ← prefill rank g / 2; source head offset (g % 2) × 8192 in every K and V
    // buffer; 80 × 2 = 160 fragments of 8192 B per block.
    let model = Model::llama70b();
    let ctx = Deploy::context(4, &model);
    let generation = Deploy::generation(8, &model);
    assert_eq!(
        ctx.rank(&model, 0).page_table.pools[0].slot_bytes,
        2_621_440
    );
    assert_eq!(
        generation.rank(&model, 0).page_table.pools[0].slot_bytes,
        1_310_720
    );
    for g in 0..8 {
        let gri = generation.rank(&model, g);
        let (ranks, uniform) = targets(&gri, &ctx.rank(&model, 0));
        assert_eq!((ranks.clone(), uniform), (vec![g / 2], true));
        let cri = ctx.rank(&model, g / 2);
        let p = plan(&cri, &gri, 32);
        assert_eq!(p.fragments(), 160);
        let want: Vec<(u64, u64, u64)> = (0..80u64)
            .flat_map(|layer| {
                (0..2u64).map(move |b| {
                    (
                        layer * 32_768 + b * 16_384 + u64::from(g % 2) * 8_192,
                        layer * 16_384 + b * 8_192,
                        8_192,
                    )
                })
            })
            .collect();
        let rows = (cri.page_table.pools[0].base, gri.page_table.pools[0].base);
        assert_eq!(offsets(&p, rows.0, rows.1), want, "decode rank {g}");
    }
}

#[test]
fn llama70b_tp8_to_tp4() {
    // §12.2: decode rank g ← ctx ranks 2g, 2g + 1 (2 writers, uniform); prefill rank t writes its
    // head at destination offset (t % 2) × 8192 in each buffer.
    let model = Model::llama70b();
    let ctx = Deploy::context(8, &model);
    let generation = Deploy::generation(4, &model);
    for g in 0..4 {
        let gri = generation.rank(&model, g);
        let (ranks, uniform) = targets(&gri, &ctx.rank(&model, 0));
        assert_eq!((ranks.clone(), uniform), (vec![2 * g, 2 * g + 1], true));
        for t in ranks {
            let cri = ctx.rank(&model, t);
            let p = plan(&cri, &gri, 32);
            let want: Vec<(u64, u64, u64)> = (0..80u64)
                .flat_map(|layer| {
                    (0..2u64).map(move |b| {
                        (
                            layer * 16_384 + b * 8_192,
                            layer * 32_768 + b * 16_384 + u64::from(t % 2) * 8_192,
                            8_192,
                        )
                    })
                })
                .collect();
            let rows = (cri.page_table.pools[0].base, gri.page_table.pools[0].base);
            assert_eq!(offsets(&p, rows.0, rows.1), want, "ctx {t} -> gen {g}");
        }
    }
}

#[test]
fn llama70b_tp16_to_tp8_elects_one_of_two_duplicated_heads() {
    // §12.2: TP16 holds each of the 8 heads twice; half the ctx ranks send empty plans.
    let model = Model::llama70b();
    let ctx = Deploy::context(16, &model);
    let generation = Deploy::generation(8, &model);
    let mut empty = 0;
    for g in 0..8 {
        let gri = generation.rank(&model, g);
        let (ranks, uniform) = targets(&gri, &ctx.rank(&model, 0));
        assert_eq!(ranks, vec![2 * g, 2 * g + 1]);
        assert!(!uniform, "one writer of two sends nothing");
        let plans: Vec<TransferPlan> = ranks
            .iter()
            .map(|&t| plan(&ctx.rank(&model, t), &gri, 64))
            .collect();
        assert_eq!(
            plans[0].fragments(),
            2,
            "intact: one whole-slot copy per block"
        );
        assert_eq!(plans[0].total_bytes(), 2 * 1_310_720);
        assert!(plans[1].is_empty());
        empty += plans.iter().filter(|p| p.is_empty()).count();
    }
    assert_eq!(empty, 8);
}

#[test]
fn intact_copies_merge_layers_adjacent_on_both_sides() {
    let model = Model::llama70b();
    // Equal TP: the whole slot in one fragment per block.
    let c = Deploy::context(4, &model).rank(&model, 1);
    let g = Deploy::generation(4, &model).rank(&model, 1);
    let p = plan(&c, &g, 96);
    assert_eq!(p.fragments(), 3);
    assert!(p.len.iter().all(|&l| l == 2_621_440));

    // PP: the receiver's second stage holds layers 40..80, one run from the middle.
    let g = Deploy::generation(4, &model)
        .pp(vec![40, 40])
        .rank(&model, 5);
    let p = plan(&c, &g, 32);
    let rows = (c.page_table.pools[0].base, g.page_table.pools[0].base);
    assert_eq!(
        offsets(&p, rows.0, rows.1),
        vec![(40 * 32_768, 0, 40 * 32_768)]
    );

    // A receiver that stores layers 2 and 3 in swapped places: three runs.
    let model = Model::gqa(4, 8, 128, 32);
    let c = Deploy::context(8, &model).rank(&model, 0);
    let mut g = Deploy::generation(8, &model).rank(&model, 0);
    let layer = 16_384;
    for e in g.page_table.groups[0].views[0].entries.iter_mut() {
        match e.local_layer {
            2 => e.offset += layer,
            3 => e.offset -= layer,
            _ => {}
        }
    }
    let p = plan(&c, &g, 32);
    let rows = (c.page_table.pools[0].base, g.page_table.pools[0].base);
    assert_eq!(
        offsets(&p, rows.0, rows.1),
        vec![
            (0, 0, 2 * layer),
            (2 * layer, 3 * layer, layer),
            (3 * layer, 2 * layer, layer)
        ]
    );
}

#[test]
fn deepseek_mla_tp8_to_attention_dp_has_one_owner_per_request() {
    // §12.1: FP8 latent of 576 B per token per layer, 61 layers, tpb 32: 1,124,352 B rows.
    // TP8 ctx → ADP gen: 8 writers expected, the one whose replica matches the DP rank owns.
    let model = Model {
        elem_bytes: 1,
        dtype: "fp8_e4m3",
        slots: 256,
        ..Model::mla(61, 576, 32)
    };
    let ctx = Deploy::context(8, &model);
    let generation = Deploy::generation(8, &model).adp();
    assert_eq!(
        ctx.rank(&model, 0).page_table.pools[0].slot_bytes,
        1_124_352
    );
    for d in 0..8 {
        let gri = generation.rank(&model, d);
        let (ranks, uniform) = targets(&gri, &ctx.rank(&model, 0));
        assert_eq!(ranks, (0..8).collect::<Vec<_>>());
        assert!(!uniform);
        for t in ranks {
            let p = plan(&ctx.rank(&model, t), &gri, 8192);
            if t == d {
                assert_eq!(p.fragments(), 256);
                assert_eq!(p.total_bytes(), 287_834_112);
            } else {
                assert!(p.is_empty(), "ctx {t} -> dp {d}");
            }
        }
    }
}

#[test]
fn nhd_resplit_emits_one_fragment_per_layer_buffer_and_token() {
    let model = Model {
        layout: LayoutKind::NHD,
        ..Model::gqa(2, 4, 4, 4)
    };
    // tp1 → tp2 rank 1: each token of each K/V buffer gives its second half of heads.
    let c = Deploy::context(1, &model).rank(&model, 0);
    let g = Deploy::generation(2, &model).rank(&model, 1);
    let p = plan(&c, &g, 4);
    let (tok_c, tok_g) = (4 * 8, 2 * 8);
    let want: Vec<(u64, u64, u64)> = (0..2u64)
        .flat_map(|layer| {
            (0..2u64).flat_map(move |b| {
                (0..4u64).map(move |t| {
                    (
                        layer * 256 + b * 128 + t * tok_c + 16,
                        layer * 128 + b * 64 + t * tok_g,
                        16,
                    )
                })
            })
        })
        .collect();
    let rows = (c.page_table.pools[0].base, g.page_table.pools[0].base);
    assert_eq!(offsets(&p, rows.0, rows.1), want);
}

#[test]
fn sectioned_state_resplits_every_section_on_its_own() {
    // Conv state [x | B | C] = [64 | 32 | 32] bytes at grid 1, halves at grid 2: ctx tp1 →
    // gen tp2 rank 1 copies the second half of every section of every layer.
    let model = Model::hybrid(4, 4);
    let c = Deploy::context(1, &model).rank(&model, 0);
    let g = Deploy::generation(2, &model).rank(&model, 1);
    let p = plan(&c, &g, 4);
    let conv = |ri: &RankInfo| ri.page_table.pools[1].base;
    let ssm = |ri: &RankInfo| ri.page_table.pools[2].base;
    let conv_frags: Vec<(u64, u64, u64)> = p
        .iter()
        .filter(|&(s, _, _)| (conv(&c)..ssm(&c)).contains(&s))
        .map(|(s, d, l)| (s - conv(&c), d - conv(&g), l))
        .collect();
    let want: Vec<(u64, u64, u64)> = (0..3u64)
        .flat_map(|layer| {
            [
                (layer * 128 + 32, layer * 64, 32),
                (layer * 128 + 64 + 16, layer * 64 + 32, 16),
                (layer * 128 + 96 + 16, layer * 64 + 48, 16),
            ]
        })
        .collect();
    assert_eq!(conv_frags, want);
}
