//! A planner whose `pair` never returns (`tests/fixtures/hangs`, id `fixture.hangs`): the
//! prefill agent fails the request it was planning when the planner deadline passes, says
//! which planner hung, replaces the wedged planner thread, and keeps serving the same peer
//! connection — a second request on it gets its answer the same way.

use crate::support;

use std::time::Duration;

use kvferry_loader::Registry;
use kvferry_planner_abi::Mapping;
use kvferry_testkit::conform::build_out_of_tree;
use kvferry_transfer::Role;
use kvferry_transfer::agent::{Event, FailureKind};

use support::*;

fn hanging_planner() -> kvferry_loader::BoundPlanner {
    let dir = build_out_of_tree("tests/fixtures");
    let registry = Registry::scan_files(&[dir.join("libfixture_hangs.so")]);
    let deployment = kvferry_planner_abi::Deployment {
        architecture: "llama".into(),
        mapping: "tp1".parse::<Mapping>().unwrap(),
    };
    registry.bind("fixture.hangs", &deployment).unwrap()
}

#[test]
fn a_hung_planner_fails_its_requests_by_name_and_the_connection_keeps_working() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let bound = hanging_planner();
    let deadline = |c: &mut kvferry_transfer::agent::AgentConfig| {
        c.planner_timeout = Duration::from_millis(300);
        c.rank.planner_id = "fixture.hangs".into();
    };
    let prefill = start(Role::Prefill, &src, secret(), bound.clone(), deadline);
    let decode = start(Role::Decode, &dst, secret(), bound, deadline);
    let endpoint = prefill.endpoint().unwrap().to_string();
    for request in [1u64, 2] {
        prefill
            .send(whole(request, tables(&src, &[0, 1]), 32))
            .unwrap();
        decode
            .expect(expecting(request, &endpoint, tables(&dst, &[0, 1]), 32))
            .unwrap();
        match wait(&prefill, request, Duration::from_secs(20)) {
            Event::Failed { kind, detail, .. } => {
                assert_eq!(kind, FailureKind::Planner, "{detail}");
                assert!(detail.contains("fixture.hangs did not return"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        match wait(&decode, request, Duration::from_secs(20)) {
            Event::Failed { detail, .. } => {
                assert!(detail.contains("fixture.hangs did not return"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(prefill.wedged_planner_calls() >= 2);
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[], &[], None);
}
