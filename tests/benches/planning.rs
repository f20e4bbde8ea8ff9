//! Plan time for one 131,072-token request, through the linked rlib and through the loaded
//! `.so`, so the cost of the plugin boundary is visible.
//!
//! - Llama-3-70B (bf16, 32 tokens per block) tp4 → tp8: prefill rank 0 → decode rank 0,
//!   4,096 blocks × 160 head-split fragments.
//! - DeepSeek-V3 (fp8) dep8 → dep8: DP rank 0 → DP rank 0, 4,096 rows, with the default
//!   planner and with the MLA latent planner.
//!
//! `pair` (the flat plan) and `pair_compressed` (patterns × row pairs, what the host asks
//! for first) are timed on precomputed rows (the planner alone); `plan_transfer` adds
//! describing both sides, validating and coalescing (what the host does per request: on
//! the compressed plan when the planner returns one, so linear in rows, not fragments).
//! "linked" calls the default planner's Rust type directly (`DefaultPlanner` from its rlib,
//! no FFI); "loaded" goes through the `.so` and the abi_stable vtable, as the host does.

use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvferry_plan::{RequestSide, plan_transfer};
use kvferry_planner_abi::{
    LayerGroupRows, Mapping, PairRequest, PlannerPlugin, RankInfo, SlotTable, TransferPlanner, rows,
};
use kvferry_planner_default::DefaultPlanner;
use kvferry_testkit::conform::{PlannerUnderTest, plugin_dir_with};
use kvferry_testkit::layout::{self, ModelSpec, PoolOptions, Preset};
use kvferry_testkit::oracle::LocalMemory;
use kvferry_testkit::scenario::{SlotAssignment, slot_tables};
use rand::SeedableRng;
use rand::rngs::StdRng;

const TOKENS: u64 = 131_072;

struct Case {
    name: &'static str,
    me: RankInfo,
    peer: RankInfo,
    my_tables: Vec<SlotTable>,
    peer_tables: Vec<SlotTable>,
    my_rows: Vec<LayerGroupRows>,
    peer_rows: Vec<LayerGroupRows>,
    mapping: Mapping,
    architecture: &'static str,
}

fn mapping(tp: u32, adp: bool) -> Mapping {
    Mapping {
        tp,
        pp: 1,
        cp: 1,
        moe_tp: tp,
        moe_ep: 1,
        attention_dp: adp,
    }
}

fn case(name: &'static str, preset: Preset, ctx: Mapping, decode: Mapping) -> Case {
    let model = ModelSpec::new(preset);
    let blocks = TOKENS.div_ceil(u64::from(model.tokens_per_block));
    let options = PoolOptions {
        paged_slots: blocks * 2,
        ..PoolOptions::default()
    };
    // Addresses only: planning never touches memory.
    let mut space = LocalMemory::new();
    let mut alloc =
        |rank: u32, pool: usize, bytes: u64| space.reserve(bytes, format!("{rank}/{pool}"));
    let ctx_infos = layout::build_instance(&model, &ctx, "ctx", "x", &options, &mut alloc).unwrap();
    let gen_infos =
        layout::build_instance(&model, &decode, "gen", "x", &options, &mut alloc).unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let me = ctx_infos[0].clone();
    let peer = gen_infos[0].clone();
    let my_tables = slot_tables(
        &me,
        TOKENS,
        0,
        &SlotAssignment::random(blocks, blocks * 2, 1, &mut rng),
    );
    let peer_tables = slot_tables(
        &peer,
        TOKENS,
        0,
        &SlotAssignment::random(blocks, blocks * 2, 1, &mut rng),
    );
    let my_rows = rows(&me.page_table, &my_tables, &[]).unwrap();
    let peer_rows = rows(&peer.page_table, &peer_tables, &[]).unwrap();
    Case {
        name,
        me,
        peer,
        my_tables,
        peer_tables,
        my_rows,
        peer_rows,
        mapping: ctx,
        architecture: preset.architecture(),
    }
}

fn bench(c: &mut Criterion) {
    let dir = plugin_dir_with(&[
        "libkvferry_planner_default.so",
        "libkvferry_planner_deepseek_mla_latent.so",
    ]);
    let loaded_default = PlannerUnderTest::loaded(dir.path(), "kvferry.default");
    let loaded_mla = PlannerUnderTest::loaded(dir.path(), "kvferry.deepseek_mla_latent");

    let cases = [
        case(
            "llama-3-70b tp4->tp8",
            Preset::Llama3_70b,
            mapping(4, false),
            mapping(8, false),
        ),
        case(
            "deepseek-v3 dep8->dep8",
            Preset::DeepseekV3,
            mapping(8, true),
            mapping(8, true),
        ),
    ];
    let request = PairRequest::whole(TOKENS);
    for case in &cases {
        let mut group = c.benchmark_group(case.name);
        group.sample_size(10);
        let linked: Arc<dyn TransferPlanner> = Arc::new(DefaultPlanner::new(&case.me).unwrap());
        let load = |planner: &PlannerUnderTest| -> Arc<dyn TransferPlanner> {
            let bound = planner.bind(case.architecture, case.mapping).unwrap();
            bound.instantiate(&case.me).unwrap()
        };
        let mut planners = vec![
            ("default linked", linked),
            ("default loaded", load(&loaded_default)),
        ];
        if case.architecture == Preset::DeepseekV3.architecture() {
            planners.push(("mla loaded", load(&loaded_mla)));
        }
        for (label, p) in planners {
            p.check_peer(&case.me, &case.peer).unwrap();
            let plan = p
                .pair(
                    &case.me,
                    &case.peer,
                    &case.my_rows,
                    &case.peer_rows,
                    &request,
                )
                .unwrap();
            eprintln!(
                "{} / {label}: {} fragments, {} bytes per pair",
                case.name,
                plan.fragments(),
                plan.total_bytes()
            );
            group.throughput(Throughput::Elements(plan.fragments() as u64));
            group.bench_function(BenchmarkId::new("pair", label), |b| {
                b.iter(|| {
                    p.pair(
                        &case.me,
                        &case.peer,
                        &case.my_rows,
                        &case.peer_rows,
                        &request,
                    )
                    .unwrap()
                })
            });
            if let Some(c) = p
                .pair_compressed(
                    &case.me,
                    &case.peer,
                    &case.my_rows,
                    &case.peer_rows,
                    &request,
                )
                .unwrap()
            {
                eprintln!(
                    "{} / {label}: compressed, {} patterns, {} row pairs",
                    case.name,
                    c.patterns.len(),
                    c.patterns.iter().map(|p| p.row_pairs()).sum::<usize>()
                );
                group.bench_function(BenchmarkId::new("pair_compressed", label), |b| {
                    b.iter(|| {
                        p.pair_compressed(
                            &case.me,
                            &case.peer,
                            &case.my_rows,
                            &case.peer_rows,
                            &request,
                        )
                        .unwrap()
                    })
                });
            }
            group.bench_function(BenchmarkId::new("plan_transfer", label), |b| {
                b.iter(|| {
                    plan_transfer(
                        p.as_ref(),
                        RequestSide::new(&case.me, &case.my_tables),
                        RequestSide::new(&case.peer, &case.peer_tables),
                        &request,
                    )
                    .unwrap()
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
