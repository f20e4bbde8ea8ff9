//! `kvferry conform`: a planner team's proof that its planner moves every byte right.
//!
//! [`matrix`] is the oracle matrix: every model preset against context × generation topology
//! pairs — TP 1 to 8 both ways (and 16 where the heads allow), PP 1 ↔ 2 with uneven layer
//! splits, helix CP on the decode side, attention DP against TP and attention DP widths
//! that differ — each with a random prompt length that is not a multiple of the block size,
//! random slot placement, padded slots, and, where the topology allows, chunked sends and a
//! cached prefix on the receiver — and, per preset, prefill and decode block sizes that
//! differ (16 ↔ 32 and 32 ↔ 64 both ways, [`REBLOCK_SIZES`], semantics §3.2 rule 4) over TP
//! equal and resharded, PP, chunked and cached pieces, plus sizes that do not divide
//! (16 ↔ 24) and helix CP with differing sizes, which carry an expected refusal naming
//! `tokens_per_block` ([`Case::expected_refusal`]). [`conform`] runs every case the planner
//! accepts end to end in process ([`Scenario`]) and checks every destination byte with the
//! oracle; it also asks the planner about every deployment the matrix names and checks that
//! a refusal comes back as a refusal with a reason, not a panic.
//!
//! A case is:
//! - **passed**: every destination byte holds its tag, every other byte is untouched, no
//!   receiver byte was written twice;
//! - **failed**: a wrong byte (named by the first one's layer, head and token), an overlap, a
//!   plan the host's validation refuses, or a planner error that is not a refusal;
//! - **refused**: the planner does not support one side's deployment, or refuses the pair
//!   (`check_peer`, or a construction-time `UNSUPPORTED`) — with its reason; the outcome
//!   carries the case's expected refusal, if the semantics rule the case out.
//!
//! The matrix is deterministic for a seed, and every case's name carries its parameters, so
//! a failure is rerun alone with the same seed and a name filter.

mod kit;
pub use kit::{
    CASE_FILTER_ENV, Case, OUT_OF_TREE_PROFILE, OUT_OF_TREE_TARGET, PlannerUnderTest, build_dir,
    build_out_of_tree, canonical, plugin_dir_with, repo_root, selected, tempdir,
};

use std::collections::BTreeSet;
use std::fmt;

use kvferry_plan::bounce::BounceLimits;
use kvferry_planner_abi::{Deployment, ErrorKind, Mapping, TokenRange};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use strum::IntoEnumIterator;

use crate::layout::{ModelSpec, Preset};
use crate::oracle::Logical;
use crate::scenario::{Scenario, ScenarioReport};

/// The seed of the matrix when none is given.
pub const DEFAULT_SEED: u64 = 0x0_7ac1e;

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

/// The topology pairs of one preset: (context, generation).
pub fn topologies(preset: Preset) -> Vec<(Mapping, Mapping)> {
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
    // Attention DP widths, equal and differing; the narrower ones twice more, so each is
    // drawn with other prompts, DP ranks, chunks and cached prefixes (the MLA planner's whole
    // domain).
    for round in 0..3 {
        let widths: &[u32] = if round == 0 {
            &[1, 2, 4, 8]
        } else {
            &[1, 2, 4]
        };
        for &c in widths {
            for &g in widths {
                pairs.push((dep(c), dep(g)));
            }
        }
    }
    pairs
}

/// The preset with an uneven PP split and a small block, to keep pools small.
pub fn model(preset: Preset) -> ModelSpec {
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

/// Every case of the matrix for `seed`, in a fixed order.
pub fn matrix(seed: u64) -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for preset in Preset::iter() {
        let model = model(preset);
        let tpb = u64::from(model.tokens_per_block);
        for (prefill, decode) in topologies(preset) {
            let helix = decode.cp > 1;
            // At least one block per CP rank; not a multiple of the block size.
            let min_blocks = u64::from(decode.cp) + 1;
            let prompt_len = rng.gen_range(min_blocks * tpb..12 * tpb) | 1;
            let blocks = prompt_len.div_ceil(tpb);
            let mut s = Scenario::new(model.clone(), prefill, decode, prompt_len);
            s.seed = rng.next_u64();
            s.ctx_dp_rank = if prefill.attention_dp {
                rng.gen_range(0..prefill.tp)
            } else {
                0
            };
            s.gen_dp_rank = if decode.attention_dp {
                rng.gen_range(0..decode.tp)
            } else {
                0
            };
            s.padded = rng.gen_bool(0.2);
            // Chunked sends and cached prefixes are refused under helix (semantics §6.2) and
            // chunks need pp = 1 (§8.3).
            if !helix && prefill.pp == 1 && decode.pp == 1 && rng.gen_bool(0.5) {
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
                "{preset} {prefill}->{} prompt {prompt_len} dp {}->{} chunks {} cached {} padded {} \
                 seed {:#x}",
                decode,
                s.ctx_dp_rank,
                s.gen_dp_rank,
                s.chunks.as_ref().map_or(0, Vec::len),
                s.cached_tokens,
                s.padded,
                s.seed,
            );
            out.push(Case {
                name,
                scenario: s,
                expected_refusal: None,
            });
        }
    }
    reblock_cases(&mut rng, &mut out);
    out
}

/// Block sizes that differ between the two sides (semantics §3.2 rule 4), context first:
/// divisible pairs both ways, which HND views re-block.
pub const REBLOCK_SIZES: [(u32, u32); 4] = [(16, 32), (32, 16), (32, 64), (64, 32)];

/// Block sizes that do not divide, and helix CP with different sizes: refused on
/// `tokens_per_block`.
const REFUSED_SIZES: [(u32, u32); 2] = [(16, 24), (24, 16)];

/// The re-blocking cases of every preset (all presets' PAGED views are HND): TP equal and
/// resharded, PP, chunked sends (chunk boundaries inside a larger block) and cached prefixes;
/// then the refused ones.
fn reblock_cases(rng: &mut StdRng, out: &mut Vec<Case>) {
    let topologies = [
        (tp(1), tp(1)),
        (tp(2), tp(2)),
        (tp(2), tp(4)),
        (tp(4), tp(2)),
        (m(2, 2, 1, false), tp(2)),
    ];
    for preset in Preset::iter() {
        for (ctx_tpb, gen_tpb) in REBLOCK_SIZES {
            for (prefill, decode) in topologies {
                let s = reblock_scenario(rng, preset, ctx_tpb, gen_tpb, prefill, decode, true);
                out.push(Case {
                    name: reblock_name(preset, ctx_tpb, gen_tpb, &s),
                    scenario: s,
                    expected_refusal: None,
                });
            }
        }
    }
    for preset in [Preset::Llama3_70b, Preset::DeepseekV3] {
        let refused = REFUSED_SIZES
            .iter()
            .flat_map(|&(c, g)| [(c, g, tp(1), tp(1)), (c, g, tp(2), tp(4))])
            .chain([(16, 32, tp(1), m(1, 1, 2, false))]);
        for (ctx_tpb, gen_tpb, prefill, decode) in refused {
            let helix = decode.cp > 1;
            let s = reblock_scenario(rng, preset, ctx_tpb, gen_tpb, prefill, decode, !helix);
            out.push(Case {
                name: format!("refused {}", reblock_name(preset, ctx_tpb, gen_tpb, &s)),
                scenario: s,
                expected_refusal: Some("tokens_per_block".to_string()),
            });
        }
    }
}

fn reblock_scenario(
    rng: &mut StdRng,
    preset: Preset,
    ctx_tpb: u32,
    gen_tpb: u32,
    prefill: Mapping,
    decode: Mapping,
    pieces: bool,
) -> Scenario {
    let model = model(preset).with_tokens_per_block(ctx_tpb);
    let (c, big) = (u64::from(ctx_tpb), u64::from(ctx_tpb.max(gen_tpb)));
    // At least two larger blocks; not a multiple of either size.
    let prompt_len = rng.gen_range(2 * big..4 * big) | 1;
    let mut s = Scenario::new(model, prefill, decode, prompt_len);
    s.gen_tokens_per_block = Some(gen_tpb);
    s.seed = rng.next_u64();
    s.padded = rng.gen_bool(0.2);
    if pieces && prefill.pp == 1 && decode.pp == 1 && rng.gen_bool(0.6) {
        // Chunks of whole context blocks: with the larger blocks on the receiver, a chunk
        // boundary may fall inside one.
        let step = rng.gen_range(1..=3) * c;
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
    if pieces && rng.gen_bool(0.5) {
        s.cached_tokens = rng.gen_range(1..prompt_len);
    }
    s
}

fn reblock_name(preset: Preset, ctx_tpb: u32, gen_tpb: u32, s: &Scenario) -> String {
    format!(
        "{preset} {}->{} tpb {ctx_tpb}->{gen_tpb} prompt {} chunks {} cached {} padded {} seed \
         {:#x}",
        s.ctx_mapping,
        s.gen_mapping,
        s.prompt_len,
        s.chunks.as_ref().map_or(0, Vec::len),
        s.cached_tokens,
        s.padded,
        s.seed,
    )
}

/// How one case ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CaseVerdict {
    /// Every byte right.
    Passed,
    /// Something wrong; `first_wrong` names the first wrong destination byte, if any.
    Failed {
        /// What went wrong.
        reason: String,
        /// `layer L head H token T` (or the oracle's full description) of the first wrong
        /// byte.
        first_wrong: Option<String>,
    },
    /// The planner does not take this pair, and said why.
    Refused {
        /// The planner's reason.
        reason: String,
    },
}

/// One case's outcome.
#[derive(Clone, Debug)]
pub struct CaseOutcome {
    /// The case name (rerun it alone with it).
    pub name: String,
    /// The model's name (a preset's).
    pub model: String,
    /// The context deployment.
    pub prefill: Mapping,
    /// The generation deployment.
    pub decode: Mapping,
    /// Fragments written (after coalescing); 0 unless the case ran.
    pub fragments: usize,
    /// Bytes written; 0 unless the case ran.
    pub bytes: u64,
    /// Pieces that went through a bounce region ([`conform_with`]); 0 unless the case ran.
    pub bounced: usize,
    /// The verdict.
    pub verdict: CaseVerdict,
    /// The field the semantics expect a refusal of this case to name ([`Case`]).
    pub expected_refusal: Option<String>,
}

impl fmt::Display for CaseOutcome {
    /// One line: verdict, topology pair, fragments, bytes, name, and the reason if any.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tag = match &self.verdict {
            CaseVerdict::Passed => "pass",
            CaseVerdict::Failed { .. } => "FAIL",
            CaseVerdict::Refused { .. } => "refused",
        };
        write!(
            f,
            "{tag:<7} {:<22} {:>4}->{:<6} {:>8} fragments {:>11} bytes  {}",
            self.model,
            self.prefill.to_string(),
            self.decode.to_string(),
            self.fragments,
            self.bytes,
            self.name
        )?;
        match &self.verdict {
            CaseVerdict::Passed => Ok(()),
            CaseVerdict::Failed {
                reason,
                first_wrong,
            } => {
                if let Some(at) = first_wrong {
                    write!(f, "\n        first wrong byte: {at}")?;
                }
                write!(f, "\n        {}", reason.replace('\n', "\n        "))
            }
            CaseVerdict::Refused { reason } => write!(f, "\n        {reason}"),
        }
    }
}

/// What the planner said about one deployment of the matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeploymentVerdict {
    /// Supported.
    Accepted,
    /// Refused, with a reason: as it should be.
    Refused(String),
    /// Refused wrongly: a panic, an error of another kind, or no reason.
    Broken(String),
}

/// One deployment's check.
#[derive(Clone, Debug)]
pub struct DeploymentCheck {
    /// `<architecture> <mapping>`.
    pub deployment: String,
    /// The planner's answer.
    pub verdict: DeploymentVerdict,
}

/// Everything one conformance run found.
#[derive(Clone, Debug)]
pub struct ConformReport {
    /// The planner id.
    pub planner: String,
    /// The matrix seed.
    pub seed: u64,
    /// Every case the filter selected, in matrix order.
    pub cases: Vec<CaseOutcome>,
    /// Every distinct deployment of the selected cases.
    pub deployments: Vec<DeploymentCheck>,
}

impl ConformReport {
    fn count(&self, pick: impl Fn(&CaseVerdict) -> bool) -> usize {
        self.cases.iter().filter(|c| pick(&c.verdict)).count()
    }

    /// Cases that ran (passed or failed).
    pub fn ran(&self) -> usize {
        self.passed() + self.failed()
    }

    /// Cases that passed.
    pub fn passed(&self) -> usize {
        self.count(|v| matches!(v, CaseVerdict::Passed))
    }

    /// Cases that failed.
    pub fn failed(&self) -> usize {
        self.count(|v| matches!(v, CaseVerdict::Failed { .. }))
    }

    /// Cases the planner refused.
    pub fn refused(&self) -> usize {
        self.count(|v| matches!(v, CaseVerdict::Refused { .. }))
    }

    /// Names of what failed: failed cases, then `refusal of <deployment>` for every
    /// deployment refused wrongly.
    pub fn failures(&self) -> Vec<String> {
        let cases = self
            .cases
            .iter()
            .filter(|c| matches!(c.verdict, CaseVerdict::Failed { .. }))
            .map(|c| c.name.clone());
        let refusals = self
            .deployments
            .iter()
            .filter(|d| matches!(d.verdict, DeploymentVerdict::Broken(_)))
            .map(|d| format!("refusal of {}", d.deployment));
        cases.chain(refusals).collect()
    }

    /// Whether the planner conforms: at least one case ran, none failed, and every refusal
    /// came back as a refusal with a reason. A planner that refuses every case proves
    /// nothing, so it does not conform.
    pub fn is_ok(&self) -> bool {
        self.ran() > 0 && self.failures().is_empty()
    }
}

impl fmt::Display for ConformReport {
    /// The summary line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let broken = self
            .deployments
            .iter()
            .filter(|d| matches!(d.verdict, DeploymentVerdict::Broken(_)))
            .count();
        let refused_deployments = self
            .deployments
            .iter()
            .filter(|d| matches!(d.verdict, DeploymentVerdict::Refused(_)))
            .count();
        write!(
            f,
            "{}: {} cases ran, {} passed, {} failed; {} refused; {} deployments asked, {} \
             refused with a reason, {} refused wrongly (seed {:#x})",
            self.planner,
            self.ran(),
            self.passed(),
            self.failed(),
            self.refused(),
            self.deployments.len(),
            refused_deployments,
            broken,
            self.seed
        )
    }
}

/// Where a wrong destination byte is, as a planner author reads it.
fn first_wrong(report: &ScenarioReport) -> Option<String> {
    let m = report.verification.mismatches.first()?;
    let at = format!(
        "{} rank {} pool {} offset {:#x}: expected {:#04x}, found {:#04x}",
        m.instance, m.rank, m.pool, m.offset, m.expected, m.found
    );
    Some(match &m.logical {
        Logical::Token {
            layer,
            head,
            token,
            buffer,
            roles,
            byte,
        } => format!(
            "layer {layer} head {head} token {token} (buffer {buffer} of {{{roles}}}, byte \
             {byte}; {at})"
        ),
        other => format!("{other} ({at})"),
    })
}

fn verdict_of(
    result: Result<ScenarioReport, String>,
    error_kind: Option<ErrorKind>,
) -> (usize, u64, usize, CaseVerdict) {
    let bounced = |r: &ScenarioReport| r.pairs.iter().map(|p| p.bounced).sum::<usize>();
    match result {
        Ok(report) if report.is_ok() => (
            report.fragments,
            report.bytes,
            bounced(&report),
            CaseVerdict::Passed,
        ),
        Ok(report) => {
            let v = &report.verification;
            let reason = if v.is_clean() {
                format!(
                    "{} receiver writes overlap an earlier one: {:?}",
                    report.overlapping_writes, report.overlaps
                )
            } else {
                format!(
                    "{} bytes differ ({} destination bytes checked, {} covered by the request, \
                     {} source bytes checked)",
                    v.mismatched_bytes, v.bytes_checked, v.bytes_covered, v.source_bytes_checked
                )
            };
            (
                report.fragments,
                report.bytes,
                bounced(&report),
                CaseVerdict::Failed {
                    first_wrong: first_wrong(&report),
                    reason,
                },
            )
        }
        Err(reason) => {
            let refusal = matches!(
                error_kind,
                Some(ErrorKind::UNSUPPORTED | ErrorKind::PEER_INCOMPATIBLE)
            );
            let verdict = if refusal {
                CaseVerdict::Refused { reason }
            } else {
                CaseVerdict::Failed {
                    reason,
                    first_wrong: None,
                }
            };
            (0, 0, 0, verdict)
        }
    }
}

/// Asks the planner about one deployment.
fn ask(planner: &PlannerUnderTest, deployment: &Deployment) -> DeploymentVerdict {
    match planner.check_deployment(deployment) {
        Ok(()) => DeploymentVerdict::Accepted,
        Err(e) if e.kind() == ErrorKind::UNSUPPORTED && !e.message().trim().is_empty() => {
            DeploymentVerdict::Refused(e.message().to_string())
        }
        Err(e) if e.kind() == ErrorKind::UNSUPPORTED => {
            DeploymentVerdict::Broken("refused without a reason".to_string())
        }
        Err(e) => DeploymentVerdict::Broken(e.to_string()),
    }
}

/// Runs the matrix of `seed` (the cases whose name contains `filter`, if given) against
/// `planner`, calling `progress` after each case.
pub fn conform(
    planner: &PlannerUnderTest,
    seed: u64,
    filter: Option<&str>,
    progress: impl FnMut(&CaseOutcome),
) -> ConformReport {
    conform_with(planner, seed, filter, None, progress)
}

/// [`conform`], each case's pieces bounced where its receiver's region passes `bounce`'s
/// limits and it has one writer ([`Scenario::bounce`]): the sender's plan gathered into a
/// packed image and scattered by the receiver's own plan of the piece, as the agent does.
/// `None`: every piece fragment by fragment.
pub fn conform_with(
    planner: &PlannerUnderTest,
    seed: u64,
    filter: Option<&str>,
    bounce: Option<BounceLimits>,
    mut progress: impl FnMut(&CaseOutcome),
) -> ConformReport {
    let cases: Vec<Case> = matrix(seed)
        .into_iter()
        .filter(|c| filter.is_none_or(|f| c.name.contains(f)))
        .map(|mut c| {
            if let Some(limits) = bounce {
                c.scenario.bounce = true;
                c.scenario.bounce_limits = limits;
            }
            c
        })
        .collect();
    let mut asked = BTreeSet::new();
    let mut deployments = Vec::new();
    let mut outcomes = Vec::with_capacity(cases.len());
    for case in &cases {
        let s = &case.scenario;
        let architecture = s.model.architecture();
        let mut refusal = None;
        for mapping in [s.ctx_mapping, s.gen_mapping] {
            let deployment = Deployment {
                architecture: architecture.into(),
                mapping,
            };
            let verdict = ask(planner, &deployment);
            if refusal.is_none() && verdict != DeploymentVerdict::Accepted {
                refusal = Some(match &verdict {
                    DeploymentVerdict::Refused(r) => CaseVerdict::Refused {
                        reason: format!("{deployment}: {r}"),
                    },
                    DeploymentVerdict::Broken(r) => CaseVerdict::Failed {
                        reason: format!("{deployment}: {r}"),
                        first_wrong: None,
                    },
                    DeploymentVerdict::Accepted => unreachable!("checked above"),
                });
            }
            if asked.insert(deployment.to_string()) {
                deployments.push(DeploymentCheck {
                    deployment: deployment.to_string(),
                    verdict,
                });
            }
        }
        let (fragments, bytes, bounced, verdict) = match refusal {
            Some(verdict) => (0, 0, 0, verdict),
            None => {
                let (result, kind) = planner.run_scenario(s);
                verdict_of(result, kind)
            }
        };
        let outcome = CaseOutcome {
            name: case.name.clone(),
            model: s.model.name().to_string(),
            prefill: s.ctx_mapping,
            decode: s.gen_mapping,
            fragments,
            bytes,
            bounced,
            verdict,
            expected_refusal: case.expected_refusal.clone(),
        };
        progress(&outcome);
        outcomes.push(outcome);
    }
    ConformReport {
        planner: planner.id().to_string(),
        seed,
        cases: outcomes,
        deployments,
    }
}
