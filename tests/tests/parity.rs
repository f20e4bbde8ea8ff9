//! The MLA latent planner moves exactly the bytes the default planner moves.
//!
//! Over random slot placements, prompt lengths, chunked token ranges, receiver cached
//! prefixes and attention-DP widths 1..=8 on both sides (dep4 → dep8 included), both planners
//! plan the same request; their validated plans must have the same canonical form (same
//! source byte for every destination byte). A sample is also executed and byte-checked.
//!
//! The MLA planner is linked statically; the default planner is loaded from its `.so`, the
//! way the host always loads planners (one planner per binary can be linked, see
//! `export_planner!`).

use std::sync::Arc;

use kvferry_plan::{RequestSide, plan_transfer};
use kvferry_planner_abi::ffi::ROption;
use kvferry_planner_abi::{Mapping, PairRequest, TokenRange, TransferPlanner};
use kvferry_testkit::conform::{PlannerUnderTest, canonical, plugin_dir_with};
use kvferry_testkit::error_chain;
use kvferry_testkit::layout::{self, Dtype, ModelSpec, PoolOptions, Preset};
use kvferry_testkit::oracle::LocalMemory;
use kvferry_testkit::scenario::{Scenario, SlotAssignment, slot_tables};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn dep(width: u32) -> Mapping {
    Mapping {
        tp: width,
        pp: 1,
        cp: 1,
        moe_tp: 1,
        moe_ep: width,
        attention_dp: true,
    }
}

/// Pieces of a prompt: whole, or block-aligned chunks of `chunk_blocks` blocks.
fn pieces(prompt_len: u64, tpb: u64, chunk_blocks: Option<u64>) -> Vec<PairRequest> {
    let Some(n) = chunk_blocks else {
        return vec![PairRequest::whole(prompt_len)];
    };
    let step = n * tpb;
    let starts: Vec<u64> = (0..prompt_len).step_by(step as usize).collect();
    let last = starts.len() - 1;
    starts
        .iter()
        .enumerate()
        .map(|(k, &start)| PairRequest {
            token_range: TokenRange {
                start,
                end: (start + step).min(prompt_len),
            },
            prompt_len,
            dst_start_token: ROption::RNone,
            is_last: k == last,
        })
        .collect()
}

struct Planners {
    mla: PlannerUnderTest,
    default: PlannerUnderTest,
    _dir: kvferry_testkit::conform::tempdir::TempPlugins,
}

fn planners() -> Planners {
    let dir = plugin_dir_with(&["libkvferry_planner_default.so"]);
    Planners {
        mla: PlannerUnderTest::linked(kvferry_planner_deepseek_mla_latent::planner_module()),
        default: PlannerUnderTest::loaded(dir.path(), "kvferry.default"),
        _dir: dir,
    }
}

#[test]
fn mla_and_default_plan_the_same_bytes() {
    let p = planners();
    let mut rng = StdRng::seed_from_u64(0x5eed_0001);
    let arch = Preset::DeepseekV3.architecture();
    let mut widths: Vec<(u32, u32)> = (1..=8).flat_map(|c| (1..=8).map(move |g| (c, g))).collect();
    widths.push((4, 8)); // the PR's headline pairing, once more with its own draws
    let mut cases = 0;
    for (ctx_w, gen_w) in widths {
        for round in 0..3 {
            let dtype = if rng.gen_bool(0.5) {
                Dtype::Fp8
            } else {
                Dtype::Bf16
            };
            let tpb: u32 = [16, 32, 64][rng.gen_range(0..3)];
            let model = ModelSpec::new(Preset::DeepseekV3)
                .with_dtype(dtype)
                .with_tokens_per_block(tpb);
            let tpb = u64::from(tpb);
            let prompt_len = rng.gen_range(1..=40 * tpb);
            let blocks = prompt_len.div_ceil(tpb);
            let cached = if rng.gen_bool(0.3) {
                rng.gen_range(0..prompt_len)
            } else {
                0
            };
            let chunk_blocks = rng.gen_bool(0.4).then(|| rng.gen_range(1..=blocks.max(1)));
            let (ctx_dp, gen_dp) = (rng.gen_range(0..ctx_w), rng.gen_range(0..gen_w));
            let name = format!(
                "dep{ctx_w}->dep{gen_w} #{round} {dtype} tpb{tpb} prompt {prompt_len} cached \
                 {cached} chunks {chunk_blocks:?} dp {ctx_dp}->{gen_dp}"
            );

            let options = PoolOptions {
                paged_slots: blocks + 8,
                ..PoolOptions::default()
            };
            // Addresses only: the plans are compared, not executed.
            let mut space = LocalMemory::new();
            let mut alloc =
                |rank: u32, pool: usize, bytes: u64| space.reserve(bytes, format!("{rank}/{pool}"));
            let ctx = layout::build_instance(&model, &dep(ctx_w), "ctx", "x", &options, &mut alloc)
                .unwrap();
            let decode =
                layout::build_instance(&model, &dep(gen_w), "gen", "x", &options, &mut alloc)
                    .unwrap();
            let (me, peer) = (&ctx[ctx_dp as usize], &decode[gen_dp as usize]);
            let contiguous = rng.gen_bool(0.3);
            let assign = |rng: &mut StdRng| {
                if contiguous {
                    SlotAssignment::contiguous(blocks)
                } else {
                    SlotAssignment::random(blocks, options.paged_slots, 1, rng)
                }
            };
            let my_tables = slot_tables(me, prompt_len, 0, &assign(&mut rng));
            let peer_tables = slot_tables(peer, prompt_len, cached, &assign(&mut rng));

            let mut plans = Vec::new();
            for planner in [&p.mla, &p.default] {
                let bound = planner.bind(arch, dep(ctx_w)).unwrap();
                let sender: Arc<dyn TransferPlanner> = bound.instantiate(me).unwrap();
                sender
                    .check_peer(me, peer)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                let targets = sender.targets(me, peer, gen_dp).unwrap();
                assert_eq!(
                    targets.ranks.as_slice(),
                    &[gen_dp],
                    "{name}: {}",
                    planner.id()
                );
                let mut fragments = Vec::new();
                for piece in pieces(prompt_len, tpb, chunk_blocks) {
                    let plan = plan_transfer(
                        sender.as_ref(),
                        RequestSide::new(me, &my_tables),
                        RequestSide::new(peer, &peer_tables),
                        &piece,
                    )
                    .unwrap_or_else(|e| panic!("{name}: {}: {}", planner.id(), error_chain(&e)));
                    fragments.extend(plan.fragments());
                }
                plans.push(canonical(fragments));
            }
            let expected_blocks = blocks - (cached / tpb).min(blocks);
            let row = me.page_table.pools[0].slot_bytes;
            let moved: u64 = plans[0].iter().map(|f| f.2).sum();
            assert_eq!(moved, expected_blocks * row, "{name}: bytes moved");
            assert_eq!(plans[0], plans[1], "{name}: MLA and default plans differ");
            cases += 1;
        }
    }
    assert!(cases >= 190, "{cases} cases");
}

#[test]
fn both_planners_verify_byte_for_byte_on_a_sample() {
    let p = planners();
    let model = ModelSpec::new(Preset::DeepseekV3);
    for (ctx_w, gen_w, prompt, seed) in [
        (4, 8, 1000, 1),
        (8, 4, 77, 2),
        (1, 1, 32, 3),
        (2, 5, 513, 4),
    ] {
        let mut s = Scenario::new(model.clone(), dep(ctx_w), dep(gen_w), prompt);
        s.ctx_dp_rank = ctx_w - 1;
        s.gen_dp_rank = gen_w / 2;
        s.seed = seed;
        let mut bytes = Vec::new();
        for planner in [&p.mla, &p.default] {
            let report = planner.run(&s).unwrap();
            assert!(
                report.is_ok(),
                "{}: dep{ctx_w}->dep{gen_w}: {report}",
                planner.id()
            );
            bytes.push(report.bytes);
        }
        assert_eq!(bytes[0], bytes[1]);
    }
}
