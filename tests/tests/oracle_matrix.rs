//! The oracle matrix (`kvferry_testkit::conform`): the default planner against every preset
//! and a matrix of context × generation topologies, every destination byte checked — the
//! same run as `kvferry conform libkvferry_planner_default.so`, with the planner linked.
//!
//! Each case has a name; rerun one alone with `KVFERRY_CASE='<part of its name>'`.

use kvferry_plan::bounce::BounceLimits;
use kvferry_testkit::conform::{CASE_FILTER_ENV, PlannerUnderTest};
use kvferry_testkit::conform::{CaseVerdict, ConformReport, DEFAULT_SEED, conform_with, matrix};

#[test]
fn default_planner_moves_every_byte_right() {
    let report = run(None);
    assert_eq!(report.cases.iter().map(|c| c.bounced).sum::<usize>(), 0);
}

/// The same matrix with every single-writer receiver's pieces bounced (transfer-semantics
/// §9): gathered by the sender's plan into a packed image, scattered by the receiver's own
/// plan of the piece with stand-in sources, as the agent does.
#[test]
fn default_planner_moves_every_byte_right_bounced() {
    let report = run(Some(BounceLimits::without_thresholds()));
    let bounced = report.cases.iter().filter(|c| c.bounced > 0).count();
    assert!(
        bounced >= 100,
        "only {bounced} of {} cases bounced a piece",
        report.cases.len()
    );
}

fn run(bounce: Option<BounceLimits>) -> ConformReport {
    let cases = matrix(DEFAULT_SEED);
    let total = cases.len();
    let expected_refusals = cases
        .iter()
        .filter(|c| c.expected_refusal.is_some())
        .count();
    assert!(total >= 200, "the matrix has only {total} topology pairs");
    assert!(expected_refusals > 0, "the matrix has no case to refuse");
    let reblocked = cases
        .iter()
        .filter(|c| c.expected_refusal.is_none() && c.scenario.gen_tokens_per_block.is_some())
        .count();
    assert!(reblocked >= 60, "only {reblocked} re-blocking cases");
    let planner = PlannerUnderTest::linked(kvferry_planner_default::planner_module());
    let filter = std::env::var(CASE_FILTER_ENV).ok();
    let report = conform_with(&planner, DEFAULT_SEED, filter.as_deref(), bounce, |_| {});
    // Every case passes, except those the semantics refuse (e.g. block sizes that do not
    // divide): those must be refused, naming the field.
    let failed: Vec<String> = report
        .cases
        .iter()
        .filter(|c| match (&c.expected_refusal, &c.verdict) {
            (None, CaseVerdict::Passed) => false,
            (Some(field), CaseVerdict::Refused { reason }) => !reason.contains(field.as_str()),
            _ => true,
        })
        .map(ToString::to_string)
        .collect();
    assert!(
        failed.is_empty() && report.is_ok(),
        "{report}\n(rerun one with {CASE_FILTER_ENV}='<name>'):\n\n{}",
        failed.join("\n\n")
    );
    if filter.is_none() {
        assert_eq!(report.passed(), total - expected_refusals);
        assert_eq!(report.refused(), expected_refusals);
    }
    eprintln!("{report}");
    report
}
