//! The default planner on the testkit's byte oracle: a [`Transfer`] run into every generation
//! DP group, every destination byte checked.

use std::collections::BTreeMap;

use kvferry_planner_abi::PlannerPlugin;
use kvferry_planner_default::DefaultPlanner;
use kvferry_testkit::scenario::ScenarioError;
use kvferry_testkit::scenario::Transfer;

/// What happened, per decode rank, over every decode DP group.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Writers the rank waited for (its targets).
    pub writers: BTreeMap<u32, usize>,
    /// Writers whose plans moved at least one byte.
    pub busy_writers: BTreeMap<u32, usize>,
    /// Bytes received.
    pub bytes: BTreeMap<u32, u64>,
}

/// Runs `t` with the default planner on both sides into every decode DP group in turn.
///
/// Panics unless every destination byte the request covers holds its tag and every other
/// destination byte its canary, the senders' pools are unchanged, no destination byte was
/// written twice, and the request covers at least one byte.
pub fn run(t: &Transfer) -> Result<Outcome, ScenarioError> {
    let mut out = Outcome::default();
    for report in t.run_every_group(DefaultPlanner::new)? {
        assert!(report.is_ok(), "{report}");
        assert!(
            report.verification.bytes_covered > 0,
            "the request covers nothing: {report}"
        );
        for r in &report.receivers {
            out.writers.insert(r.rank, r.expected_transfers);
            out.busy_writers.insert(r.rank, report.busy_writers(r.rank));
            out.bytes.insert(r.rank, report.bytes_into(r.rank));
        }
    }
    Ok(out)
}
