//! Byte-level checks: every destination byte of every decode rank is written exactly
//! once with the right bytes, or left untouched, across TP / PP / CP / attention-DP pairings.

use crate::common;

use common::run;
use kvferry_planner_abi::{
    LayerGroupRows, LayoutKind, PairRequest, PeerTargets, PlanError, PlannerPlugin, RankInfo,
    TransferPlan, TransferPlanner,
};
use kvferry_planner_default::DefaultPlanner;
use kvferry_testkit::builder::{Deploy, Model};
use kvferry_testkit::error_chain;
use kvferry_testkit::scenario::ScenarioError;
use kvferry_testkit::scenario::Transfer;

fn small_gqa(layout: LayoutKind) -> Model {
    Model {
        layout,
        ..Model::gqa(4, 4, 4, 4)
    }
}

/// `ctx tp` × `generation tp` over 1, 2, 4 and 8 ranks for 4 KV heads: equal widths, either side
/// finer, and more ranks than heads (duplicated heads, replica election).
fn tp_matrix(model: &Model) {
    for ctx_tp in [1, 2, 4, 8] {
        for gen_tp in [1, 2, 4, 8] {
            let s = Transfer::new(
                model,
                Deploy::context(ctx_tp, model),
                Deploy::generation(gen_tp, model),
                13,
            );
            let out = run(&s).unwrap_or_else(|e| {
                panic!("ctx tp{ctx_tp} generation tp{gen_tp}: {}", error_chain(&e))
            });
            for (g, &busy) in &out.busy_writers {
                // Distinct shards each decode rank needs, one writer each.
                let gen_shards = gen_tp.min(4);
                let ctx_shards = ctx_tp.min(4);
                let want = (ctx_shards / gen_shards).max(1);
                assert_eq!(
                    busy, want as usize,
                    "ctx tp{ctx_tp} generation tp{gen_tp} rank {g}"
                );
            }
        }
    }
}

#[test]
fn hnd_heads_reshard_across_tp_widths() {
    tp_matrix(&small_gqa(LayoutKind::HND));
}

#[test]
fn nhd_heads_reshard_across_tp_widths() {
    tp_matrix(&small_gqa(LayoutKind::NHD));
}

#[test]
fn attention_dp_pairs_one_to_one_and_fans_in_from_tp() {
    let model = small_gqa(LayoutKind::HND);
    let shapes = |name_ctx: bool| {
        let base = |tp| {
            if name_ctx {
                Deploy::context(tp, &model)
            } else {
                Deploy::generation(tp, &model)
            }
        };
        vec![base(1), base(2), base(4), base(2).adp(), base(4).adp()]
    };
    for ctx in shapes(true) {
        for generation in shapes(false) {
            let groups = ctx.dp_groups();
            for ctx_dp in 0..groups {
                let mut s = Transfer::new(&model, ctx.clone(), generation.clone(), 16);
                s.ctx_dp_rank = ctx_dp;
                run(&s).unwrap_or_else(|e| {
                    panic!("{ctx:?} -> {generation:?} dp {ctx_dp}: {}", error_chain(&e))
                });
            }
        }
    }
}

#[test]
fn mla_latent_has_one_writer_per_destination() {
    let model = Model::mla(3, 9, 4);
    let shapes = |ctx: bool| {
        let base = |tp| {
            if ctx {
                Deploy::context(tp, &model)
            } else {
                Deploy::generation(tp, &model)
            }
        };
        vec![base(1), base(2), base(4), base(2).adp(), base(4).adp()]
    };
    for ctx in shapes(true) {
        for generation in shapes(false) {
            let mut s = Transfer::new(&model, ctx.clone(), generation.clone(), 11);
            s.ctx_dp_rank = ctx.dp_groups() - 1;
            let out = run(&s)
                .unwrap_or_else(|e| panic!("{ctx:?} -> {generation:?}: {}", error_chain(&e)));
            assert!(
                out.busy_writers.values().all(|&b| b == 1),
                "{ctx:?} -> {generation:?}: {out:?}"
            );
        }
    }
}

#[test]
fn pipeline_stages_send_only_their_layers() {
    let model = small_gqa(LayoutKind::HND);
    let splits = [
        vec![4],
        vec![2, 2],
        vec![1, 3],
        vec![3, 1],
        vec![1, 1, 1, 1],
    ];
    for ctx_split in &splits {
        for gen_split in &splits {
            for (ctx_tp, gen_tp) in [(1, 1), (2, 1), (1, 2)] {
                let ctx = Deploy::context(ctx_tp, &model).pp(ctx_split.clone());
                let generation = Deploy::generation(gen_tp, &model).pp(gen_split.clone());
                let s = Transfer::new(&model, ctx, generation, 13);
                run(&s).unwrap_or_else(|e| {
                    panic!("ctx pp{ctx_split:?} tp{ctx_tp} -> generation pp{gen_split:?} tp{gen_tp}: {}", error_chain(&e))
                });
            }
        }
    }
}

#[test]
fn chunks_holes_and_cached_prefixes_move_only_held_blocks() {
    let model = small_gqa(LayoutKind::NHD);
    let mut s = Transfer::new(
        &model,
        Deploy::context(2, &model),
        Deploy::generation(4, &model),
        27,
    );
    s.pieces = vec![(0, 8), (8, 20), (20, 27)];
    s.ctx_holes = vec![0];
    s.gen_holes = vec![1, 2];
    let out = run(&s).expect("chunked");
    // 7 blocks, 3 of them skipped; a tp4 rank holds 1 head × 2 buffers × 4 layers × 32 B.
    assert!(out.bytes.values().all(|&b| b == 4 * 4 * 2 * 32), "{out:?}");
}

#[test]
fn helix_generation_ranks_receive_every_cp_th_block() {
    let model = small_gqa(LayoutKind::HND);
    for (ctx_tp, gen_tp, gen_cp) in [(1, 1, 2), (2, 1, 2), (2, 2, 2), (4, 2, 2), (1, 1, 4)] {
        let s = Transfer::new(
            &model,
            Deploy::context(ctx_tp, &model),
            Deploy::generation(gen_tp, &model).cp(gen_cp),
            29,
        );
        run(&s).unwrap_or_else(|e| {
            panic!(
                "ctx tp{ctx_tp} -> generation tp{gen_tp} cp{gen_cp}: {}",
                error_chain(&e)
            )
        });
    }
}

#[test]
fn hybrid_state_is_resharded_and_written_once() {
    let model = Model::hybrid(8, 4);
    let gens = [
        Deploy::generation(1, &model),
        Deploy::generation(2, &model),
        Deploy::generation(4, &model),
        Deploy::generation(1, &model).cp(2),
        Deploy::generation(2, &model).cp(2),
        Deploy::generation(2, &model).adp(),
    ];
    for ctx_tp in [1, 2, 4] {
        for generation in &gens {
            let s = Transfer::new(
                &model,
                Deploy::context(ctx_tp, &model),
                generation.clone(),
                13,
            );
            run(&s).unwrap_or_else(|e| {
                panic!("ctx tp{ctx_tp} -> {generation:?}: {}", error_chain(&e))
            });
        }
    }
}

#[test]
fn hybrid_state_rides_on_the_last_chunk_only_once() {
    let mut model = Model::hybrid(8, 4);
    if let Some(state) = model.state.as_mut() {
        state.replicated_side = Some(24);
    }
    let mut s = Transfer::new(
        &model,
        Deploy::context(2, &model),
        Deploy::generation(1, &model),
        13,
    );
    s.pieces = vec![(0, 4), (4, 12), (12, 13)];
    run(&s).expect("chunked hybrid");
    s.generation = Deploy::generation(4, &model);
    run(&s).expect("chunked hybrid, finer receiver");
    // No state slot on the receiver: the state stays untouched, KV still moves.
    s.gen_state = false;
    run(&s).expect("no receiver state slot");
}

#[test]
fn extra_layers_on_one_side_are_never_matched() {
    // MTP: the context holds a fifth layer the decode side does not (T4), and back.
    let four = small_gqa(LayoutKind::HND);
    let five = small_gqa(LayoutKind::HND).with_layers(5);
    let mut s = Transfer::new(
        &five,
        Deploy::context(2, &five),
        Deploy::generation(2, &four),
        9,
    );
    s.gen_model = four.clone();
    run(&s).expect("extra context layer");
    let mut s = Transfer::new(
        &four,
        Deploy::context(2, &four),
        Deploy::generation(1, &five),
        9,
    );
    s.gen_model = five;
    run(&s).expect("extra generation layer");
}

/// The default planner with every plan altered after the fact.
struct Altered {
    inner: DefaultPlanner,
    alter: fn(&mut TransferPlan),
}

impl TransferPlanner for Altered {
    fn check_peer(&self, me: &RankInfo, peer: &RankInfo) -> Result<(), PlanError> {
        self.inner.check_peer(me, peer)
    }

    fn targets(&self, me: &RankInfo, peer: &RankInfo, dp: u32) -> Result<PeerTargets, PlanError> {
        self.inner.targets(me, peer, dp)
    }

    fn pair(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        my_rows: &[LayerGroupRows],
        peer_rows: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<TransferPlan, PlanError> {
        let mut plan = self.inner.pair(me, peer, my_rows, peer_rows, request)?;
        (self.alter)(&mut plan);
        Ok(plan)
    }
}

#[test]
fn the_oracle_catches_missing_misplaced_and_doubled_bytes() {
    let model = Model::hybrid(8, 4);
    let t = Transfer::new(
        &model,
        Deploy::context(2, &model),
        Deploy::generation(4, &model),
        13,
    );
    let run_altered = |alter: fn(&mut TransferPlan)| {
        let mut reports = t.run_every_group(|ri| {
            Ok(Altered {
                inner: DefaultPlanner::new(ri)?,
                alter,
            })
        })?;
        assert_eq!(reports.len(), 1);
        Ok::<_, ScenarioError>(reports.remove(0))
    };
    // Unaltered, the same run is clean.
    assert!(run_altered(|_| {}).expect("runs").is_ok());
    // The last fragment of every plan dropped: its destination bytes still hold the canary.
    let dropped = run_altered(|p| {
        p.src.pop();
        p.dst.pop();
        p.len.pop();
    })
    .expect("runs");
    assert!(dropped.verification.mismatched_bytes > 0, "{dropped}");
    // The first fragment read one byte late (and one byte shorter): wrong bytes, one missing.
    let shifted = run_altered(|p| {
        if p.len.first().is_some_and(|&l| l > 1) {
            p.src[0] += 1;
            p.len[0] -= 1;
        }
    })
    .expect("runs");
    assert!(shifted.verification.mismatched_bytes > 0, "{shifted}");
    // The first fragment sent twice: refused before anything moves.
    let doubled = run_altered(|p| {
        let first = p.iter().next();
        if let Some((s, d, l)) = first {
            p.push(s, d, l);
        }
    });
    assert!(
        matches!(doubled, Err(ScenarioError::Plan { .. })),
        "{doubled:?}"
    );
}

/// §3.2 rule 4: HND blocks of `ctx_tpb` tokens against `gen_tpb`, one a multiple of the
/// other, across TP widths, whole and chunked, with holes on either side.
fn reblocked(ctx_tpb: u32, gen_tpb: u32) {
    let base = small_gqa(LayoutKind::HND);
    let ctx_model = Model {
        tpb: ctx_tpb,
        slots: 64,
        ..base.clone()
    };
    let gen_model = Model {
        tpb: gen_tpb,
        slots: 64,
        ..base
    };
    let prompt = 5 * u64::from(ctx_tpb.max(gen_tpb)) + 3;
    let c = u64::from(ctx_tpb);
    for (ctx_tp, gen_tp) in [(1, 1), (2, 2), (2, 4), (4, 2), (1, 4), (8, 2)] {
        for variant in 0u64..4 {
            let mut t = Transfer::new(
                &ctx_model,
                Deploy::context(ctx_tp, &ctx_model),
                Deploy::generation(gen_tp, &gen_model),
                prompt,
            );
            t.gen_model = gen_model.clone();
            t.seed = variant;
            match variant {
                // Chunks of one and three context blocks.
                1 => t.pieces = vec![(0, c), (c, 4 * c), (4 * c, prompt)],
                // Holes: the receiver's cached front and one context block missing.
                2 => {
                    t.gen_holes = vec![0];
                    t.ctx_holes = vec![2];
                }
                // A chunk boundary inside a larger block, and a receiver hole.
                3 => {
                    t.pieces = vec![(0, 3 * c), (3 * c, prompt)];
                    t.gen_holes = vec![1];
                }
                _ => {}
            }
            let what = format!("tpb {ctx_tpb}->{gen_tpb} tp{ctx_tp}->tp{gen_tp} variant {variant}");
            run(&t).unwrap_or_else(|e| panic!("{what}: {}", error_chain(&e)));
        }
    }
}

#[test]
fn hnd_blocks_re_block_from_smaller_to_larger() {
    reblocked(4, 8);
    reblocked(4, 16);
}

#[test]
fn hnd_blocks_re_block_from_larger_to_smaller() {
    reblocked(8, 4);
    reblocked(16, 4);
}

#[test]
fn re_blocking_sends_from_the_receiver_block_holding_dst_start_token() {
    use kvferry_planner_abi::ffi::ROption;
    use std::sync::Arc;
    let base = Model {
        slots: 64,
        ..small_gqa(LayoutKind::HND)
    };
    for (ctx_tpb, gen_tpb) in [(4, 8), (8, 4), (4, 16), (16, 4)] {
        let ctx_model = Model {
            tpb: ctx_tpb,
            ..base.clone()
        };
        let gen_model = Model {
            tpb: gen_tpb,
            ..base.clone()
        };
        for start in [5, 9, 16, 21] {
            let mut t = Transfer::new(
                &ctx_model,
                Deploy::context(2, &ctx_model),
                Deploy::generation(4, &gen_model),
                45,
            );
            t.gen_model = gen_model.clone();
            // The receiver already holds the blocks before the one holding `start`.
            t.gen_holes = (0..start / u64::from(gen_tpb)).collect();
            let mut exchange = t.exchange().expect("exchange");
            for p in &mut exchange.pieces {
                p.dst_start_token = ROption::RSome(start);
            }
            let factory = |info: &RankInfo| -> Result<Arc<dyn TransferPlanner>, PlanError> {
                Ok(Arc::new(DefaultPlanner::new(info)?))
            };
            let report = exchange
                .run(&factory, &factory)
                .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
            assert!(
                report.is_ok() && report.verification.bytes_covered > 0,
                "tpb {ctx_tpb}->{gen_tpb} start {start}: {report}"
            );
        }
    }
}
