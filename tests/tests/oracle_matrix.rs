//! The oracle matrix (`kvferry_testkit::conform`): the default planner against every preset
//! and a matrix of context × generation topologies, every destination byte checked — the
//! same run as `kvferry conform libkvferry_planner_default.so`, with the planner linked.
//!
//! Each case has a name; rerun one alone with `KVFERRY_CASE='<part of its name>'`.

use kvferry_testkit::conform::{CaseVerdict, DEFAULT_SEED, conform, matrix};
use kvferry_testkit::conformance::{CASE_FILTER_ENV, PlannerUnderTest};

#[test]
fn default_planner_moves_every_byte_right() {
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
    let report = conform(&planner, DEFAULT_SEED, filter.as_deref(), |_| {});
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
}
