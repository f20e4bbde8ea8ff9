//! The oracle matrix: the default planner against every preset and a matrix of context ×
//! generation topologies, every destination byte checked.
//!
//! For each (preset, context, generation) pair a request with a random prompt length (not a
//! multiple of the block size), random slot placement, and — where the topology allows —
//! chunked sends and a receiver cached prefix runs end to end in memory: targets, rows and
//! pair for every sender rank, plans validated and executed, then every destination byte
//! checked against its tag and every other byte checked untouched.
//!
//! Each case has a name; rerun one alone with `KVFERRY_CASE='<part of its name>'`.

use kvferry_planner_abi::{Mapping, TokenRange};
use kvferry_testkit::conformance::{Case, PlannerUnderTest, selected};
use kvferry_testkit::layout::{ModelSpec, Preset};
use kvferry_testkit::scenario::Scenario;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn m(tp: u32, pp: u32, cp: u32, adp: bool) -> Mapping {
    Mapping {
        tp,
        pp,
        cp,
        moe_tp: tp,
        moe_ep: 1,
        attention_dp: adp,
    }
}

fn tp(n: u32) -> Mapping {
    m(n, 1, 1, false)
}

fn dep(n: u32) -> Mapping {
    m(n, 1, 1, true)
}

/// The topology pairs of one preset.
fn topologies(preset: Preset) -> Vec<(Mapping, Mapping)> {
    let mut widths = vec![1, 2, 4, 8];
    if preset == Preset::Llama3_70b {
        widths.push(16); // more ranks than KV heads: duplicated heads, one writer elected
    }
    let mut pairs = Vec::new();
    // TP both ways.
    for &c in &widths {
        for &g in &widths {
            pairs.push((tp(c), tp(g)));
        }
    }
    // PP 1 <-> 2 (uneven split, see `model`), with TP changing too.
    for (c, g) in [
        (m(2, 2, 1, false), tp(2)),
        (tp(2), m(2, 2, 1, false)),
        (m(1, 2, 1, false), tp(4)),
        (tp(4), m(1, 2, 1, false)),
        (m(2, 2, 1, false), m(4, 2, 1, false)),
        (m(4, 2, 1, false), m(1, 2, 1, false)),
    ] {
        pairs.push((c, g));
    }
    // Helix: generation cp 2 and 4 against a cp 1 context.
    for c in [1, 2, 4] {
        for (g, cp) in [(1, 2), (2, 2), (1, 4), (2, 4)] {
            pairs.push((tp(c), m(g, 1, cp, false)));
        }
    }
    // Attention DP against TP, both ways.
    for w in [2, 4] {
        for t in [1, 2, 4] {
            pairs.push((dep(w), tp(t)));
            pairs.push((tp(t), dep(w)));
        }
    }
    // Attention DP widths that differ.
    for (c, g) in [(2, 4), (4, 2), (1, 8), (8, 2), (4, 8)] {
        pairs.push((dep(c), dep(g)));
    }
    pairs
}

/// The preset with an uneven PP split and a small block, to keep pools small.
fn model(preset: Preset) -> ModelSpec {
    let split = match preset {
        Preset::DeepseekV3 => vec![25, 36],
        Preset::Llama3_70b => vec![36, 44],
        Preset::Qwen3Next80bA3b => vec![20, 28],
        Preset::GptOss120b => vec![16, 20],
    };
    ModelSpec::new(preset)
        .with_tokens_per_block(16)
        .with_layers_per_pp(split)
}

fn cases() -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(0x0_7ac1e);
    let mut out = Vec::new();
    for preset in Preset::ALL {
        let model = model(preset);
        let tpb = u64::from(model.tokens_per_block);
        for (ctx, r#gen) in topologies(preset) {
            let helix = r#gen.cp > 1;
            // At least one block per CP rank; not a multiple of the block size.
            let min_blocks = u64::from(r#gen.cp) + 1;
            let prompt_len = rng.gen_range(min_blocks * tpb..12 * tpb) | 1;
            let blocks = prompt_len.div_ceil(tpb);
            let mut s = Scenario::new(model.clone(), ctx, r#gen, prompt_len);
            s.seed = rng.r#gen();
            s.ctx_dp_rank = if ctx.attention_dp {
                rng.gen_range(0..ctx.tp)
            } else {
                0
            };
            s.gen_dp_rank = if r#gen.attention_dp {
                rng.gen_range(0..r#gen.tp)
            } else {
                0
            };
            s.padded = rng.gen_bool(0.2);
            // Chunked sends and cached prefixes are refused under helix (semantics §6.2) and
            // chunks need pp = 1 (§8.3).
            if !helix && ctx.pp == 1 && r#gen.pp == 1 && rng.gen_bool(0.5) {
                let step = rng.gen_range(1..=blocks.div_ceil(2)) * tpb;
                s.chunks = Some(
                    (0..prompt_len)
                        .step_by(step as usize)
                        .map(|start| TokenRange {
                            start,
                            end: (start + step).min(prompt_len),
                        })
                        .collect(),
                );
            }
            if !helix && rng.gen_bool(0.4) {
                s.cached_tokens = rng.gen_range(0..prompt_len);
            }
            let name = format!(
                "{preset} {ctx}->{} prompt {prompt_len} dp {}->{} chunks {} cached {} padded {} \
                 seed {:#x}",
                r#gen,
                s.ctx_dp_rank,
                s.gen_dp_rank,
                s.chunks.as_ref().map_or(0, Vec::len),
                s.cached_tokens,
                s.padded,
                s.seed,
            );
            out.push(Case { name, scenario: s });
        }
    }
    out
}

#[test]
fn default_planner_moves_every_byte_right() {
    let planner = PlannerUnderTest::linked(kvferry_planner_default::planner_module());
    let cases = cases();
    let total = cases.len();
    assert!(total >= 200, "the matrix has only {total} topology pairs");
    let mut failures = Vec::new();
    let mut ran = 0;
    for case in cases.iter().filter(|c| selected(c)) {
        ran += 1;
        match planner.run(&case.scenario) {
            Ok(report) if report.is_ok() => {}
            Ok(report) => failures.push(format!("{case}\n{report}")),
            Err(e) => failures.push(format!("{case}\n  error: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {ran} cases failed (rerun one with KVFERRY_CASE='<name>'):\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
    eprintln!("{ran} of {total} cases verified");
}
