//! The planner as a plugin: its root module, deployment support, construction, and use
//! through the FFI boundary exactly as the host drives a loaded library.

use kvferry_planner_abi::ffi::RString;
use kvferry_planner_abi::{
    DEFAULT_DESCRIBER_ID, Deployment, ErrorKind, Mapping, PairRequest, PlannerPlugin,
    TransferPlanner,
};
use kvferry_planner_default::{DefaultPlanner, planner_module};
use kvferry_testkit::builder::{Deploy, Model, rows_of, tables};

#[test]
fn the_root_module_names_the_default_planner() {
    let module = planner_module();
    assert_eq!(module.id(), "kvferry.default");
    assert_eq!(module.describer(), DEFAULT_DESCRIBER_ID);
    assert_eq!(module.library_version(), env!("CARGO_PKG_VERSION"));
}

#[test]
fn every_deployment_is_supported() {
    let module = planner_module();
    for (architecture, tp, pp, cp, attention_dp) in [
        ("LlamaForCausalLM", 8, 1, 1, false),
        ("DeepseekV3ForCausalLM", 8, 1, 1, true),
        ("Qwen3NextForCausalLM", 4, 2, 1, false),
        ("DeepseekV3ForCausalLM", 2, 1, 4, false),
    ] {
        let d = Deployment {
            architecture: RString::from(architecture),
            mapping: Mapping {
                tp,
                pp,
                cp,
                moe_tp: 1,
                moe_ep: tp,
                attention_dp,
            },
        };
        module.check_deployment(&d).expect("supported");
    }
}

#[test]
fn construction_validates_the_rank() {
    let m = Model::gqa(2, 4, 4, 4);
    let mut bad = Deploy::context(2, &m).rank(&m, 1);
    bad.tp_rank = 2;
    let err = DefaultPlanner::new(&bad).expect_err("rank out of range");
    assert_eq!(err.kind(), ErrorKind::INVALID_INPUT);
    assert!(
        err.message().contains("tp_rank 2 is not below tp_size 2"),
        "{err}"
    );
    let mut bad = Deploy::context(2, &m).rank(&m, 1);
    bad.page_table.tokens_per_block = 0;
    let err = planner_module()
        .instantiate(&bad)
        .expect_err("invalid table");
    assert!(
        err.message()
            .contains("page table of instance prefill rank 1"),
        "{err}"
    );
}

#[test]
fn the_loaded_planner_plans_like_the_static_one() {
    let m = Model::gqa(4, 4, 4, 4);
    let ctx = Deploy::context(2, &m).rank(&m, 1);
    let generation = Deploy::generation(4, &m).rank(&m, 3);
    let loaded = planner_module().instantiate(&ctx).expect("instantiate");
    let direct = DefaultPlanner::new(&ctx).expect("planner");
    assert!(loaded.describe().expect("describe").is_empty());
    loaded.check_peer(&ctx, &generation).expect("compatible");
    let t = loaded.targets(&ctx, &generation, 0).expect("targets");
    assert_eq!(t.ranks.as_slice(), &[2, 3]);
    let ours = rows_of(&ctx, &tables(&ctx.page_table, &[0, 1, 2], &[]));
    let theirs = rows_of(
        &generation,
        &tables(&generation.page_table, &[3, 4, 5], &[]),
    );
    let req = PairRequest::whole(12);
    let a = loaded
        .pair(&ctx, &generation, &ours, &theirs, &req)
        .expect("plan");
    let b = direct
        .pair(&ctx, &generation, &ours, &theirs, &req)
        .expect("plan");
    assert_eq!(a, b);
    assert_eq!(a.fragments(), 3 * 4 * 2);
    loaded.forget_peer(&generation);
    // Forgetting is only a cache drop: the peer is vetted again on next use.
    assert_eq!(
        loaded
            .pair(&ctx, &generation, &ours, &theirs, &req)
            .expect("plan"),
        a
    );
}

#[test]
fn one_planner_serves_many_threads() {
    let m = Model::gqa(4, 4, 4, 4);
    let ctx = Deploy::context(1, &m).rank(&m, 0);
    let planner = DefaultPlanner::new(&ctx).expect("planner");
    let ours = rows_of(&ctx, &tables(&ctx.page_table, &[0, 1], &[]));
    std::thread::scope(|s| {
        for g in 0..4 {
            let (planner, ctx, ours, m) = (&planner, &ctx, &ours, &m);
            s.spawn(move || {
                let generation = Deploy::generation(4, m).rank(m, g);
                let theirs = rows_of(&generation, &tables(&generation.page_table, &[2, 3], &[]));
                for _ in 0..50 {
                    let plan = planner
                        .pair(ctx, &generation, ours, &theirs, &PairRequest::whole(8))
                        .expect("plan");
                    assert_eq!(plan.fragments(), 2 * 4 * 2);
                    assert_eq!(
                        plan.src[0] - ctx.page_table.pools[0].base,
                        u64::from(g) * 32
                    );
                }
            });
        }
    });
}
