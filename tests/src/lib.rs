//! Cross-planner conformance tests (MLA/default parity, the oracle matrix) and the planning
//! benchmark. The harness they use lives in `kvferry-testkit` (`conformance`), so planner
//! teams can run it too; this crate only holds the tests.
