//! The oracle matrix (`kvferry_testkit::conform`): the default planner against every preset
//! and a matrix of context × generation topologies, every destination byte checked — the
//! same run as `kvferry conform libkvferry_planner_default.so`, with the planner linked.
//!
//! Each case has a name; rerun one alone with `KVFERRY_CASE='<part of its name>'`.

use kvferry_testkit::conform::{DEFAULT_SEED, conform, matrix};
use kvferry_testkit::conformance::{CASE_FILTER_ENV, PlannerUnderTest};

#[test]
fn default_planner_moves_every_byte_right() {
    let total = matrix(DEFAULT_SEED).len();
    assert!(total >= 200, "the matrix has only {total} topology pairs");
    let planner = PlannerUnderTest::linked(kvferry_planner_default::planner_module());
    let filter = std::env::var(CASE_FILTER_ENV).ok();
    let report = conform(&planner, DEFAULT_SEED, filter.as_deref(), |_| {});
    let failed: Vec<String> = report
        .cases
        .iter()
        .filter(|c| !matches!(c.verdict, kvferry_testkit::conform::CaseVerdict::Passed))
        .map(ToString::to_string)
        .collect();
    // The default planner supports every deployment: nothing may be refused either.
    assert!(
        failed.is_empty() && report.is_ok(),
        "{report}\n(rerun one with {CASE_FILTER_ENV}='<name>'):\n\n{}",
        failed.join("\n\n")
    );
    if filter.is_none() {
        assert_eq!(report.passed(), total);
    }
    eprintln!("{report}");
}
