//! `kvferry conform`: a planner proven against the oracle matrix
//! ([`kvferry_testkit::conform`]), reported case by case, by model, or as one JSON object.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use kvferry::agent::BounceMode;
use kvferry_plan::bounce::BounceLimits;
use kvferry_testkit::conform::{CaseVerdict, PlannerUnderTest};
use serde_json::json;

use crate::Host;
use crate::progress::Progress;

/// `kvferry conform`: loads the planner (a library, or an id on the plugin path), runs the
/// matrix and prints what `output` asks for; exits 1 unless the planner conforms (at least
/// one case ran and none failed).
pub(crate) fn conform(
    config: Option<&std::path::Path>,
    library: Option<&std::path::Path>,
    planner: Option<&str>,
    seed: u64,
    case: Option<&str>,
    bounce: BounceMode,
    output: ConformOutput,
) -> Result<ExitCode> {
    let json = output == ConformOutput::Json;
    let under_test = match (library, planner) {
        (Some(path), _) => PlannerUnderTest::from_file(path).map_err(|e| anyhow!(e))?,
        (None, Some(id)) => {
            let host = Host::load(config)?;
            PlannerUnderTest::from_registry(Arc::new(host.registry), id).map_err(|e| anyhow!(e))?
        }
        (None, None) => bail!("name a planner library, or a planner id with --planner"),
    };
    if !json {
        println!(
            "conform {} ({}), matrix seed {seed:#x}",
            under_test.id(),
            under_test.source().display()
        );
    }
    let limits = match bounce {
        BounceMode::Off => None,
        BounceMode::On => Some(BounceLimits::without_thresholds()),
        _ => Some(BounceLimits::default()),
    };
    let progress = Progress::spinner(!json, "laying out the matrix");
    let mut seen = 0usize;
    let report =
        kvferry_testkit::conform::conform_with(&under_test, seed, case, limits, |outcome| {
            seen += 1;
            progress.set_message(format!("{seen} cases: {}", outcome.name));
            let failed = matches!(outcome.verdict, CaseVerdict::Failed { .. });
            if output == ConformOutput::Verbose || (failed && !json) {
                progress.println(outcome.to_string());
            }
        });
    progress.finish();
    if json {
        let results: Vec<serde_json::Value> = report
            .cases
            .iter()
            .map(|c| {
                let (verdict, reason, first_wrong) = match &c.verdict {
                    CaseVerdict::Passed => ("passed", None, None),
                    CaseVerdict::Failed {
                        reason,
                        first_wrong,
                    } => ("failed", Some(reason.clone()), first_wrong.clone()),
                    CaseVerdict::Refused { reason } => ("refused", Some(reason.clone()), None),
                    _ => ("unknown", None, None),
                };
                json!({
                    "name": c.name,
                    "model": c.model,
                    "prefill": c.prefill.to_string(),
                    "decode": c.decode.to_string(),
                    "fragments": c.fragments,
                    "bytes": c.bytes,
                    "bounced_pieces": c.bounced,
                    "verdict": verdict,
                    "reason": reason,
                    "first_wrong": first_wrong,
                })
            })
            .collect();
        let out = json!({
            "planner": report.planner,
            "source": under_test.source(),
            "seed": report.seed,
            "bounce": bounce.to_string(),
            "cases": report.ran(),
            "passed": report.passed(),
            "failed": report.failed(),
            "refused": report.refused(),
            "deployments": report.deployments.len(),
            "failures": report.failures(),
            "ok": report.is_ok(),
            "results": results,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        if output == ConformOutput::Summary {
            print!("{}", by_model(&report));
        }
        println!("{report}");
        let failures = report.failures();
        if !failures.is_empty() {
            println!(
                "failed ({}), rerun one with --seed {seed:#x} --case '<name>':",
                failures.len()
            );
            for f in &failures {
                println!("  {f}");
            }
        } else if report.ran() == 0 {
            println!("no case ran: a planner that refuses every case proves nothing");
        }
    }
    Ok(if report.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// What `conform` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConformOutput {
    /// The failures as they happen, then a table by model and the summary line.
    Summary,
    /// Every case as it ends, then the summary line.
    Verbose,
    /// One JSON object.
    Json,
}

/// `conform`'s table of verdicts by model, then the most frequent refusals: refusals that
/// differ only in their numbers count as one cause, shown by the text of its first refusal
/// as the planner wrote it.
fn by_model(report: &kvferry_testkit::conform::ConformReport) -> String {
    use std::collections::BTreeMap;
    let mut rows: BTreeMap<&str, [usize; 3]> = BTreeMap::new();
    // Per cause: how many refusals, the first one's text, and its place in the matrix.
    let mut causes: BTreeMap<String, (usize, &str, usize)> = BTreeMap::new();
    for (index, case) in report.cases.iter().enumerate() {
        let row = rows.entry(case.model.as_str()).or_default();
        match &case.verdict {
            CaseVerdict::Passed => row[0] += 1,
            CaseVerdict::Failed { .. } => row[1] += 1,
            CaseVerdict::Refused { reason } => {
                row[2] += 1;
                causes
                    .entry(numbers_masked(reason))
                    .or_insert((0, reason.as_str(), index))
                    .0 += 1;
            }
            _ => {}
        }
    }
    let mut out = format!(
        "{:<24} {:>7} {:>7} {:>8}\n",
        "model", "passed", "failed", "refused"
    );
    for (model, [passed, failed, refused]) in &rows {
        out.push_str(&format!(
            "{model:<24} {passed:>7} {failed:>7} {refused:>8}\n"
        ));
    }
    let mut causes: Vec<(usize, &str, usize)> = causes.into_values().collect();
    causes.sort_by_key(|&(n, _, first)| (std::cmp::Reverse(n), first));
    if !causes.is_empty() {
        out.push_str("most frequent refusals (each counts those that differ only in numbers):\n");
        for (n, example, _) in causes.iter().take(3) {
            out.push_str(&format!("  {n:>4} x {example}\n"));
        }
    }
    out.push_str("(--verbose prints every case)\n");
    out
}

/// `text` with every run of digits written `#`: the key under which refusals that differ
/// only in their sizes, ranks and widths count as one cause.
fn numbers_masked(text: &str) -> String {
    let mut key = String::with_capacity(text.len());
    for c in text.chars() {
        if !c.is_ascii_digit() {
            key.push(c);
        } else if !key.ends_with('#') {
            key.push('#');
        }
    }
    key
}
