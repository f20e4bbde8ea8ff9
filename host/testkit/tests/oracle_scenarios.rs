//! The oracle and the scenario runner, driven by a test-only planner for identical layouts.

use std::sync::Arc;

use kvferry_plan::{RequestSide, validate};
use kvferry_planner_abi::{
    GroupKind, LayerGroupRows, LayoutKind, Mapping, PairRequest, PeerTargets, PlanError, RankInfo,
    SlotTable, TokenRange, TransferPlan, TransferPlanner, ViewId, ffi::RVec,
};
use kvferry_testkit::builder::{Deploy, Model};
use kvferry_testkit::error_chain;
use kvferry_testkit::layout::{Dtype, ModelSpec, PoolOptions, Preset, build_rank};
use kvferry_testkit::oracle::{
    Delivery, LocalMemory, Logical, MemoryError, Oracle, OracleError, Side,
};
use kvferry_testkit::scenario::Transfer;
use kvferry_testkit::scenario::{Exchange, MemoryBudget, Scenario, ScenarioError, ScenarioReport};
use strum::IntoEnumIterator;

type Mutation = Box<dyn Fn(&mut TransferPlan) + Send + Sync>;

/// Whole rows by ordinal between identical layouts (same TP, PP and attention DP); the
/// decode side may add helix CP. Test-only: it never re-shards.
#[derive(Default)]
struct Mirror {
    /// Send every held ordinal whatever the piece's token range.
    ignore_token_range: bool,
    /// Target every TP rank of the peer (every replica writes).
    all_tp_ranks: bool,
    /// Applied to every plan.
    mutate: Option<Mutation>,
}

impl TransferPlanner for Mirror {
    fn check_peer(&self, me: &RankInfo, peer: &RankInfo) -> Result<(), PlanError> {
        let fields = [
            (
                "tokens_per_block",
                me.page_table.tokens_per_block,
                peer.page_table.tokens_per_block,
            ),
            ("tp_size", me.tp_size, peer.tp_size),
            ("pp_size", me.pp_size, peer.pp_size),
            (
                "attention_dp",
                u32::from(me.attention_dp),
                u32::from(peer.attention_dp),
            ),
        ];
        for (field, ours, theirs) in fields {
            if ours != theirs {
                return Err(PlanError::refuse(
                    field,
                    ours,
                    theirs,
                    "mirror needs equal layouts",
                ));
            }
        }
        if me.cp_size != peer.cp_size && me.cp_size.min(peer.cp_size) != 1 {
            return Err(PlanError::refuse(
                "cp_size",
                me.cp_size,
                peer.cp_size,
                "helix only",
            ));
        }
        Ok(())
    }

    fn targets(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        peer_dp_rank: u32,
    ) -> Result<PeerTargets, PlanError> {
        let tps: Vec<u32> = if peer.attention_dp {
            vec![peer_dp_rank]
        } else if self.all_tp_ranks {
            (0..peer.tp_size).collect()
        } else {
            vec![me.tp_rank]
        };
        let cps: Vec<u32> = if peer.cp_size == me.cp_size {
            vec![me.cp_rank]
        } else if me.cp_size == 1 {
            (0..peer.cp_size).collect()
        } else {
            vec![0]
        };
        let mut ranks = Vec::new();
        for &tp in &tps {
            for &cp in &cps {
                ranks.push(me.pp_rank * peer.tp_size * peer.cp_size + tp * peer.cp_size + cp);
            }
        }
        ranks.sort_unstable();
        Ok(PeerTargets {
            ranks: RVec::from(ranks),
            uniform: true,
        })
    }

    fn pair(
        &self,
        me: &RankInfo,
        peer: &RankInfo,
        mine: &[LayerGroupRows],
        theirs: &[LayerGroupRows],
        request: &PairRequest,
    ) -> Result<TransferPlan, PlanError> {
        let tpb = u64::from(me.page_table.tokens_per_block);
        let (lo, hi) = if self.ignore_token_range {
            (0, u64::MAX)
        } else {
            (
                request.token_range.start / tpb,
                request.token_range.end.div_ceil(tpb),
            )
        };
        let (c, r) = if peer.cp_size > 1 && me.cp_size == 1 {
            (u64::from(peer.cp_size), u64::from(peer.cp_rank))
        } else {
            (1, 0)
        };
        let mut plan = TransferPlan::new();
        for (s, d) in mine.iter().zip(theirs) {
            if s.view != d.view {
                return Err(PlanError::invalid("views differ"));
            }
            if s.kind == GroupKind::STATE {
                if request.is_last && !s.is_empty() && !d.is_empty() {
                    plan.push(s.addresses[0], d.addresses[0], s.row_bytes);
                }
                continue;
            }
            for (k, &j) in d.ordinals.iter().enumerate() {
                let g = j * c + r;
                if (lo..hi).contains(&g) {
                    if let Some(a) = s.address_of(g) {
                        plan.push(a, d.addresses[k], s.row_bytes);
                    }
                }
            }
        }
        if let Some(m) = &self.mutate {
            m(&mut plan);
        }
        Ok(plan)
    }
}

fn mapping(tp: u32, pp: u32, cp: u32, attention_dp: bool) -> Mapping {
    Mapping {
        tp,
        pp,
        cp,
        moe_tp: 1,
        moe_ep: 1,
        attention_dp,
    }
}

fn tp1() -> Mapping {
    mapping(1, 1, 1, false)
}

fn run_with(s: &Scenario, planner: Mirror) -> Result<ScenarioReport, ScenarioError> {
    let planner: Arc<dyn TransferPlanner> = Arc::new(planner);
    let factory =
        move |_: &RankInfo| -> Result<Arc<dyn TransferPlanner>, PlanError> { Ok(planner.clone()) };
    s.run(&factory, &factory)
}

fn run(s: &Scenario) -> ScenarioReport {
    let report = run_with(s, Mirror::default()).unwrap();
    assert!(report.is_ok(), "{report}");
    report
}

fn slot_bytes(preset: Preset) -> u64 {
    let mut alloc = |_: u32, _: usize, _: u64| 0x10_0000;
    let info = build_rank(
        &ModelSpec::new(preset),
        &tp1(),
        "x",
        "y",
        0,
        &PoolOptions::default(),
        &mut alloc,
    )
    .unwrap();
    info.page_table.pools[0].slot_bytes
}

#[test]
fn every_preset_single_rank() {
    for preset in Preset::iter() {
        let s = Scenario::new(ModelSpec::new(preset), tp1(), tp1(), 100);
        let report = run(&s);
        assert_eq!(report.receivers.len(), 1);
        assert_eq!(report.receivers[0].expected_transfers, 1);
        assert_eq!(report.pairs.len(), 1);
        // The mirror moves exactly what the oracle expects covered.
        assert_eq!(report.bytes, report.verification.bytes_covered, "{preset}");
        assert!(report.verification.bytes_checked > report.verification.bytes_covered);
        assert!(report.verification.source_bytes_checked > 0);
    }
}

#[test]
fn pools_past_the_memory_budget_are_refused_before_any_is_backed() {
    let model = ModelSpec::new(Preset::Llama3_70b);
    // 100 tokens: 4 blocks + 2 slack = 6 slots of 10 MiB per rank.
    let pool = 6 * slot_bytes(Preset::Llama3_70b);
    let budget = |bytes: u64| MemoryBudget {
        bytes,
        available: format!("{bytes} bytes available (test)"),
    };
    let mut s = Scenario::new(model, tp1(), tp1(), 100);
    // Less than the receiver's pools: refused once laid out, before the slot tables.
    s.memory_budget = Some(budget(pool - 1));
    let err = s.exchange().unwrap_err();
    let ScenarioError::Memory { needed, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(*needed, pool);
    assert_eq!(
        err.to_string(),
        format!(
            "backing the pools of 1 receiving decode rank needs {}; {} bytes available (test)",
            kvferry_testkit::units::bytes(pool),
            pool - 1
        )
    );
    // Room for the receiver but not the sender too: refused once the targets are known.
    s.memory_budget = Some(budget(2 * pool - 1));
    let err = run_with(&s, Mirror::default()).unwrap_err();
    assert!(
        matches!(err, ScenarioError::Memory { needed, .. } if needed == 2 * pool),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("1 sending prefill rank and 1 receiving decode rank"),
        "{err}"
    );
    // Both fit: the request runs and backs exactly that.
    s.memory_budget = Some(budget(2 * pool));
    let report = run(&s);
    assert_eq!(report.backed_bytes, 2 * pool);
}

#[test]
fn deepseek_rows_coalesce_when_slots_are_contiguous() {
    let mut s = Scenario::new(ModelSpec::new(Preset::DeepseekV3), tp1(), tp1(), 300);
    s.contiguous_slots = true;
    let report = run(&s);
    assert_eq!(report.planned_fragments, 10);
    assert_eq!(report.fragments, 1);
    assert_eq!(report.bytes, 10 * 1_124_352);

    // Padding keeps rows apart.
    s.padded = true;
    let report = run(&s);
    assert_eq!(report.fragments, 10);

    // Random slots: some neighbours, mostly not.
    s.padded = false;
    s.contiguous_slots = false;
    let report = run(&s);
    assert!(report.fragments > 1 && report.fragments <= 10);
}

#[test]
fn sliding_window_masks_stale_blocks() {
    // gpt-oss: window 128, prompt 300, tpb 32 → stale_end (301 − 128) / 32 = 5 of 10 blocks.
    let s = Scenario::new(ModelSpec::new(Preset::GptOss120b), tp1(), tp1(), 300);
    let report = run(&s);
    let sliding_slot = slot_bytes(Preset::GptOss120b);
    // Pool 1 (full layers) has the same slot size: 5 sliding + 10 full rows.
    assert_eq!(report.bytes, 15 * sliding_slot);
    assert_eq!(report.planned_fragments, 15);
}

#[test]
fn multi_rank_layouts() {
    let cases = [
        (
            ModelSpec::new(Preset::DeepseekV3),
            mapping(2, 1, 1, false),
            2,
        ),
        (
            ModelSpec::new(Preset::Llama3_70b),
            mapping(2, 2, 1, false),
            4,
        ),
        (
            ModelSpec::new(Preset::Qwen3Next80bA3b).with_layers_per_pp(vec![3, 45]),
            mapping(2, 2, 1, false),
            4,
        ),
        (
            ModelSpec::new(Preset::GptOss120b),
            mapping(4, 1, 1, false),
            4,
        ),
    ];
    for (model, m, receivers) in cases {
        let s = Scenario::new(model.clone(), m, m, 100);
        let report = run(&s);
        assert_eq!(report.receivers.len(), receivers, "{model} {m}");
        assert!(report.receivers.iter().all(|r| r.expected_transfers == 1));
        assert_eq!(
            report.bytes, report.verification.bytes_covered,
            "{model} {m}"
        );
    }
}

#[test]
fn attention_dp_serves_one_group() {
    let model = ModelSpec::new(Preset::DeepseekV3).with_dtype(Dtype::Bf16);
    let mut s = Scenario::new(model, mapping(2, 1, 1, true), mapping(2, 1, 1, true), 100);
    s.ctx_dp_rank = 1;
    s.gen_dp_rank = 0;
    let report = run(&s);
    assert_eq!(report.receivers.len(), 1);
    assert_eq!(report.receivers[0].rank, 0);
    assert_eq!(report.receivers[0].targets, [1]);
    assert_eq!(report.pairs[0].src_rank, 1);
    // Only the two ranks taking part got memory: 4 blocks + 2 slack slots each.
    assert_eq!(report.backed_bytes, 2 * 6 * 2_248_704);

    s.gen_dp_rank = 2;
    assert!(matches!(
        run_with(&s, Mirror::default()),
        Err(ScenarioError::Invalid(_))
    ));
}

#[test]
fn helix_generation_side() {
    for (model, ctx, generation) in [
        (
            ModelSpec::new(Preset::DeepseekV3),
            tp1(),
            mapping(1, 1, 2, false),
        ),
        (
            ModelSpec::new(Preset::Llama3_70b),
            mapping(2, 1, 1, false),
            mapping(2, 1, 2, false),
        ),
    ] {
        let s = Scenario::new(model.clone(), ctx, generation, 200);
        let report = run(&s);
        // 7 blocks: CP rank 0 holds ordinals 0, 2, 4, 6; CP rank 1 holds 1, 3, 5.
        assert_eq!(report.receivers.len(), 2 * ctx.tp as usize);
        assert_eq!(report.planned_fragments, 7 * ctx.tp as usize, "{model}");
        assert_eq!(report.bytes, report.verification.bytes_covered);
    }
}

#[test]
fn chunked_sender_and_cached_receiver() {
    let mut s = Scenario::new(ModelSpec::new(Preset::Llama3_70b), tp1(), tp1(), 200);
    s.chunks = Some(vec![
        TokenRange { start: 0, end: 64 },
        TokenRange {
            start: 64,
            end: 128,
        },
        TokenRange {
            start: 128,
            end: 200,
        },
    ]);
    let report = run(&s);
    assert_eq!(report.pairs[0].pieces, 3);
    assert_eq!(report.planned_fragments, 7);

    s.chunks = None;
    s.cached_tokens = 64;
    let report = run(&s);
    assert_eq!(report.planned_fragments, 5);
    assert_eq!(report.bytes, 5 * 10_485_760);

    s.chunks = Some(vec![TokenRange { start: 0, end: 50 }]);
    assert!(matches!(
        run_with(&s, Mirror::default()),
        Err(ScenarioError::Invalid(_))
    ));
}

#[test]
fn qwen_state_rides_on_the_last_piece() {
    let mut s = Scenario::new(ModelSpec::new(Preset::Qwen3Next80bA3b), tp1(), tp1(), 96);
    s.chunks = Some(vec![
        TokenRange { start: 0, end: 32 },
        TokenRange { start: 32, end: 96 },
    ]);
    let report = run(&s);
    let attention = 3 * 12 * 2 * 2 * 256 * 2 * 32;
    let state = 36 * 49_152 + 36 * 2_097_152;
    assert_eq!(report.bytes, attention + state);
}

#[test]
fn runs_are_deterministic_for_a_seed() {
    let mut s = Scenario::new(ModelSpec::new(Preset::DeepseekV3), tp1(), tp1(), 300);
    s.seed = 42;
    let a = run(&s);
    let b = run(&s);
    assert_eq!(a.pairs, b.pairs);
    assert_eq!(a.verification, b.verification);
    s.seed = 43;
    let c = run(&s);
    assert_eq!(c.bytes, a.bytes);
}

#[test]
fn shifted_fragment_is_caught() {
    let s = Scenario::new(ModelSpec::new(Preset::DeepseekV3), tp1(), tp1(), 300);
    let mirror = Mirror {
        mutate: Some(Box::new(|p: &mut TransferPlan| {
            // Fragment 3 lands one byte late (and one byte short, to stay in its row).
            p.dst[3] += 1;
            p.len[3] -= 1;
        })),
        ..Mirror::default()
    };
    let report = run_with(&s, mirror).unwrap();
    assert!(!report.is_ok());
    let v = &report.verification;
    let row = 1_124_352;
    assert!(v.mismatched_bytes > row / 2, "{}", v.mismatched_bytes);
    assert!(v.mismatched_bytes <= row);
    let first = &v.mismatches[0];
    assert_eq!(first.side, Side::Destination);
    assert_eq!(
        (first.instance.as_str(), first.rank, first.pool),
        ("decode", 0, 0)
    );
    // The first byte of the row kept its canary; it should hold layer 0's token 96 byte 0.
    match &first.logical {
        Logical::Token {
            layer,
            roles,
            buffer,
            head,
            token,
            byte,
        } => {
            assert_eq!((*layer, roles.as_str(), *buffer, *head), (0, "key", 0, 0));
            assert_eq!((*token, *byte), (96, 0));
        }
        other => panic!("{other:?}"),
    }
    let text = report.verification.to_string();
    assert!(text.contains("bytes differ"), "{text}");
    assert!(
        text.contains("destination decode rank 0 pool 0 offset"),
        "{text}"
    );
    assert!(
        text.contains("layer 0 {key} buffer 0 head 0 token 96 byte 0"),
        "{text}"
    );
}

#[test]
fn missing_fragment_is_caught() {
    let s = Scenario::new(ModelSpec::new(Preset::Llama3_70b), tp1(), tp1(), 100);
    let mirror = Mirror {
        mutate: Some(Box::new(|p: &mut TransferPlan| {
            p.src.remove(2);
            p.dst.remove(2);
            p.len.remove(2);
        })),
        ..Mirror::default()
    };
    let report = run_with(&s, mirror).unwrap();
    let v = &report.verification;
    let row = 10_485_760;
    // Every byte of the row kept its canary (a few match their tag by chance).
    assert!(v.mismatched_bytes > row - row / 64 && v.mismatched_bytes <= row);
    assert!(matches!(
        v.mismatches[0].logical,
        Logical::Token { token: 64, .. }
    ));
    assert_eq!(report.verification.bytes_covered - report.bytes, row);
}

#[test]
fn extra_write_into_an_uncovered_slot_is_caught() {
    let mut s = Scenario::new(ModelSpec::new(Preset::DeepseekV3), tp1(), tp1(), 128);
    // Only the first half is sent; the planner ignores the range and sends all four blocks.
    s.chunks = Some(vec![TokenRange { start: 0, end: 64 }]);
    let mirror = Mirror {
        ignore_token_range: true,
        ..Mirror::default()
    };
    let report = run_with(&s, mirror).unwrap();
    let v = &report.verification;
    assert_eq!(v.bytes_covered, 2 * 1_124_352);
    assert!(v.mismatched_bytes > 2 * 1_124_352 - 2 * 1_124_352 / 64);
    assert!(matches!(
        v.mismatches[0].logical,
        Logical::Uncovered { padding: false, .. }
    ));
    assert!(v.to_string().contains("(canary)"));
}

#[test]
fn every_replica_writing_is_an_overlap() {
    let m = mapping(2, 1, 1, false);
    let mut s = Scenario::new(ModelSpec::new(Preset::DeepseekV3), m, m, 64);
    s.contiguous_slots = true;
    let mirror = Mirror {
        all_tp_ranks: true,
        ..Mirror::default()
    };
    let report = run_with(&s, mirror).unwrap();
    // Identical bytes, so every byte matches; but each receiver's two rows (one coalesced
    // write per sender) were written twice.
    assert!(report.verification.is_clean());
    assert_eq!(report.receivers[0].expected_transfers, 2);
    assert_eq!(report.overlapping_writes, 2);
    assert!(!report.is_ok());
    assert!(report.to_string().contains("overlapping writes"));
}

#[test]
fn asymmetric_targets_are_an_error() {
    struct OneWay(Mirror);
    impl TransferPlanner for OneWay {
        fn check_peer(&self, me: &RankInfo, peer: &RankInfo) -> Result<(), PlanError> {
            self.0.check_peer(me, peer)
        }
        fn targets(&self, me: &RankInfo, p: &RankInfo, d: u32) -> Result<PeerTargets, PlanError> {
            let mut t = self.0.targets(me, p, d)?;
            if me.instance_name.as_str() == "prefill" {
                t.ranks = RVec::from(vec![1]);
            }
            Ok(t)
        }
        fn pair(
            &self,
            me: &RankInfo,
            peer: &RankInfo,
            mine: &[LayerGroupRows],
            theirs: &[LayerGroupRows],
            request: &PairRequest,
        ) -> Result<TransferPlan, PlanError> {
            self.0.pair(me, peer, mine, theirs, request)
        }
    }
    let m = mapping(2, 1, 1, false);
    let s = Scenario::new(ModelSpec::new(Preset::DeepseekV3), m, m, 64);
    let planner: Arc<dyn TransferPlanner> = Arc::new(OneWay(Mirror::default()));
    let factory =
        move |_: &RankInfo| -> Result<Arc<dyn TransferPlanner>, PlanError> { Ok(planner.clone()) };
    let err = s.run(&factory, &factory).unwrap_err();
    assert!(
        matches!(
            err,
            ScenarioError::Asymmetric {
                ctx_rank: 0,
                gen_rank: 0,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn refusal_names_the_field() {
    let s = Scenario::new(
        ModelSpec::new(Preset::Llama3_70b),
        mapping(2, 1, 1, false),
        mapping(4, 1, 1, false),
        64,
    );
    let err = run_with(&s, Mirror::default()).unwrap_err();
    // The planner's refusal is the source: the chain names the field once.
    let chain = error_chain(&err);
    assert_eq!(chain.matches("tp_size").count(), 1, "{chain}");
}

/// Runs an exchange with the mirror on both sides.
fn run_exchange(e: &Exchange) -> Result<ScenarioReport, ScenarioError> {
    let planner: Arc<dyn TransferPlanner> = Arc::new(Mirror::default());
    let factory =
        move |_: &RankInfo| -> Result<Arc<dyn TransferPlanner>, PlanError> { Ok(planner.clone()) };
    e.run(&factory, &factory)
}

#[test]
fn builder_deployments_run_through_the_oracle() {
    let mut hybrid = Model::hybrid(8, 4);
    if let Some(state) = hybrid.state.as_mut() {
        state.replicated_side = Some(24);
    }
    let models = [
        Model::gqa(3, 4, 4, 4),
        Model {
            layout: LayoutKind::NHD,
            ..Model::gqa(3, 4, 4, 4)
        },
        Model::mla(3, 9, 4),
        Model {
            window: Some(9),
            slot_padding: 40,
            ..Model::gqa(2, 2, 8, 4)
        },
        hybrid,
    ];
    for model in &models {
        let deploys = |tp: u32| {
            [
                (Deploy::context(tp, model), Deploy::generation(tp, model)),
                (
                    Deploy::context(tp, model).adp(),
                    Deploy::generation(tp, model).adp(),
                ),
            ]
        };
        let mut pairs: Vec<(Deploy, Deploy)> = [1, 2, 4].into_iter().flat_map(deploys).collect();
        if model.state.is_none() {
            pairs.push((
                Deploy::context(2, model),
                Deploy::generation(2, model).cp(2),
            ));
        }
        for (ctx, generation) in pairs {
            let mut t = Transfer::new(model, ctx.clone(), generation.clone(), 29);
            t.ctx_dp_rank = ctx.dp_groups() - 1;
            t.gen_dp_rank = generation.dp_groups() - 1;
            if generation.mapping.cp == 1 {
                t.pieces = vec![(0, 12), (12, 29)];
            }
            t.ctx_holes = vec![2];
            t.gen_holes = vec![0, 5];
            t.seed = 5;
            let what = format!("{model:?}: {} -> {}", ctx.mapping, generation.mapping);
            let report = run_exchange(&t.exchange().unwrap())
                .unwrap_or_else(|e| panic!("{what}: {}", error_chain(&e)));
            assert!(report.is_ok(), "{what}: {report}");
            assert!(report.verification.bytes_covered > 0, "{what}: {report}");
            assert_eq!(report.bytes, report.verification.bytes_covered, "{what}");
        }
    }
}

#[test]
fn exchanges_refuse_overlapping_pools_and_missing_tables() {
    let model = Model::gqa(2, 2, 8, 4);
    let t = Transfer::new(
        &model,
        Deploy::context(1, &model),
        Deploy::generation(1, &model),
        16,
    );
    let mut e = t.exchange().unwrap();
    // Both instances at the same synthetic addresses.
    e.generation = Deploy {
        id: 1,
        ..t.generation.clone()
    }
    .instance(&model);
    assert!(
        matches!(
            run_exchange(&e),
            Err(ScenarioError::Oracle(OracleError::Memory(
                MemoryError::Overlaps { .. }
            )))
        ),
        "{:?}",
        run_exchange(&e)
    );
    let mut e = t.exchange().unwrap();
    e.gen_tables.clear();
    let err = run_exchange(&e).unwrap_err();
    assert!(
        matches!(&err, ScenarioError::Invalid(m) if m.contains("no slot tables for decode rank 0")),
        "{err}"
    );
    let mut e = t.exchange().unwrap();
    e.gen_dp_rank = 1;
    assert!(matches!(run_exchange(&e), Err(ScenarioError::Invalid(_))));
    // An excluded receiver view is neither written nor expected: every byte keeps its canary.
    let mut e = t.exchange().unwrap();
    e.gen_excluded.insert(0, vec![ViewId { group: 0, view: 0 }]);
    let report = run_exchange(&e).unwrap();
    assert!(report.is_ok(), "{report}");
    assert_eq!((report.bytes, report.verification.bytes_covered), (0, 0));
    assert!(report.verification.bytes_checked > 0);
}

#[test]
fn corrupted_source_and_unmapped_execution_are_reported() {
    let options = PoolOptions {
        paged_slots: 4,
        ..PoolOptions::default()
    };
    let model = ModelSpec::new(Preset::DeepseekV3);
    let mut memory = LocalMemory::new();
    let mut alloc = |r: u32, p: usize, bytes: u64| memory.allocate(bytes, format!("ctx {r} {p}"));
    let ctx = build_rank(&model, &tp1(), "ctx", "p", 0, &options, &mut alloc).unwrap();
    let tables = [SlotTable::new([3, 1])];
    let oracle = Oracle::new(7);
    let side = RequestSide::new(&ctx, &tables);
    oracle.fill_source(&mut memory, side).unwrap();
    let delivery = Delivery {
        prefill: &[side],
        receivers: &[],
        pieces: &[PairRequest::whole(64)],
    };
    let clean = oracle.verify(&memory, &delivery).unwrap();
    assert!(clean.is_clean(), "{clean}");
    assert_eq!(
        clean.source_bytes_checked,
        ctx.page_table.pools[0].footprint()
    );

    // Flip one byte of a requested slot and one of an unrequested slot.
    let pool = ctx.page_table.pools[0].clone();
    memory.bytes_mut(pool.slot_address(1) + 5, 1).unwrap()[0] ^= 0xff;
    memory.bytes_mut(pool.slot_address(0), 1).unwrap()[0] ^= 0x01;
    let report = oracle.verify(&memory, &delivery).unwrap();
    assert_eq!(report.mismatched_bytes, 2);
    assert!(report.mismatches.iter().all(|m| m.side == Side::Source));
    assert!(matches!(
        report.mismatches[0].logical,
        Logical::Foreign { slot: 0, .. }
    ));
    assert!(matches!(
        report.mismatches[1].logical,
        Logical::Token {
            layer: 0,
            token: 32,
            byte: 5,
            ..
        }
    ));

    // A validated plan whose rows lie outside every pool still fails cleanly.
    let rows = |a: u64| LayerGroupRows {
        view: ViewId { group: 0, view: 0 },
        kind: GroupKind::PAGED,
        ordinals: RVec::from(vec![0]),
        addresses: RVec::from(vec![a]),
        row_bytes: 64,
        row_stride: 64,
        span_start: 0,
        span_end: 1,
    };
    let mut plan = TransferPlan::new();
    plan.push(pool.base, 0x10, 64);
    let v = validate(plan, &[rows(pool.base)], &[rows(0x10)]).unwrap();
    let err = memory.execute(&v).unwrap_err();
    assert_eq!(
        err,
        MemoryError::Unmapped {
            address: 0x10,
            len: 64
        }
    );
    let mut plan = TransferPlan::new();
    plan.push(pool.base + pool.footprint() - 8, pool.base, 64);
    let end = pool.base + pool.footprint() - 8;
    let v = validate(plan, &[rows(end)], &[rows(pool.base)]).unwrap();
    assert!(matches!(
        memory.execute(&v),
        Err(MemoryError::PastEnd { .. })
    ));
}

/// `cargo test --release -p kvferry-testkit --test suite oracle_scenarios:: -- --ignored --nocapture`
#[test]
#[ignore = "timing; run in release"]
fn deepseek_8k_timing() {
    let s = Scenario::new(ModelSpec::new(Preset::DeepseekV3), tp1(), tp1(), 8192);
    let report = run(&s);
    assert_eq!(report.bytes, 287_834_112);
    println!("{report}");
    println!("{:#?}", report.timings);
    let mut s = s.clone();
    s.contiguous_slots = true;
    let report = run(&s);
    assert_eq!(report.fragments, 1);
    println!("contiguous: {:#?}", report.timings);
}

#[test]
fn a_view_whose_layers_cannot_be_derived_keeps_the_reason_as_source() {
    let model = Model::gqa(2, 2, 8, 4);
    let mut info = Deploy::generation(1, &model).rank(&model, 0);
    info.page_table.groups[0].views[0].entries[0].local_layer = 99;
    let err = Oracle::new(1)
        .prime_destination(&mut LocalMemory::new(), &info)
        .unwrap_err();
    assert!(
        matches!(
            &err,
            OracleError::ViewLayers {
                group: 0,
                view: 0,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "decode rank 0: group 0 view 0: cannot derive its layers"
    );
    let chain = error_chain(&err);
    assert_eq!(chain.matches("local layer 99").count(), 1, "{chain}");
}
