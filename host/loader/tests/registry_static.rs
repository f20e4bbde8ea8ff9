//! The registry over statically linked planners (`Registry::from_modules`), as tests and
//! benchmarks use it: duplicate ids, binding, refusals. Loads no library.

use kvferry_loader::{BindError, LoadError, Registry};
use kvferry_planner_abi::ffi::RVec;
use kvferry_planner_abi::{
    DEFAULT_DESCRIBER_ID, Deployment, LayerGroupRows, Mapping, PageTable, PairRequest, PeerTargets,
    PlanError, PlannerPlugin, RankInfo, TransferPlan, TransferPlanner, export_planner,
};

/// Plans nothing; supports single-stage deployments only.
struct SingleStage;

impl TransferPlanner for SingleStage {
    fn check_peer(&self, _: &RankInfo, _: &RankInfo) -> Result<(), PlanError> {
        Ok(())
    }

    fn targets(&self, me: &RankInfo, _: &RankInfo, _: u32) -> Result<PeerTargets, PlanError> {
        Ok(PeerTargets {
            ranks: vec![me.instance_rank].into(),
            uniform: true,
        })
    }

    fn pair(
        &self,
        _: &RankInfo,
        _: &RankInfo,
        _: &[LayerGroupRows],
        _: &[LayerGroupRows],
        _: &PairRequest,
    ) -> Result<TransferPlan, PlanError> {
        Ok(TransferPlan::new())
    }
}

impl PlannerPlugin for SingleStage {
    const PLANNER_ID: &'static str = "test.single_stage";

    fn supports_deployment(deployment: &Deployment) -> Result<(), String> {
        if deployment.mapping.pp == 1 {
            Ok(())
        } else {
            Err("pipeline parallelism is not supported".to_string())
        }
    }

    fn new(_: &RankInfo) -> Result<Self, PlanError> {
        Ok(SingleStage)
    }
}

export_planner!(SingleStage);

/// A planner asking for a describer the host does not have. Built with `module_of` directly,
/// since `export_planner!` may appear once per binary.
struct OddDescriber;

impl TransferPlanner for OddDescriber {
    fn check_peer(&self, _: &RankInfo, _: &RankInfo) -> Result<(), PlanError> {
        Ok(())
    }

    fn targets(&self, _: &RankInfo, _: &RankInfo, _: u32) -> Result<PeerTargets, PlanError> {
        Ok(PeerTargets {
            ranks: RVec::new(),
            uniform: true,
        })
    }

    fn pair(
        &self,
        _: &RankInfo,
        _: &RankInfo,
        _: &[LayerGroupRows],
        _: &[LayerGroupRows],
        _: &PairRequest,
    ) -> Result<TransferPlan, PlanError> {
        Ok(TransferPlan::new())
    }
}

impl PlannerPlugin for OddDescriber {
    const PLANNER_ID: &'static str = "test.odd_describer";
    const DESCRIBER_ID: &'static str = "acme.describer";

    fn supports_deployment(_: &Deployment) -> Result<(), String> {
        Ok(())
    }

    fn new(_: &RankInfo) -> Result<Self, PlanError> {
        Ok(OddDescriber)
    }
}

impl kvferry_planner_abi::__private::PluginVersion for OddDescriber {
    const VERSION: &'static str = "9.9.9";
}

fn deployment(pp: u32) -> Deployment {
    Deployment {
        architecture: "LlamaForCausalLM".into(),
        mapping: Mapping {
            tp: 1,
            pp,
            cp: 1,
            moe_tp: 1,
            moe_ep: 1,
            attention_dp: false,
        },
    }
}

fn rank() -> RankInfo {
    RankInfo {
        instance_name: "ctx".into(),
        instance_rank: 3,
        tp_size: 1,
        tp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        cp_size: 1,
        cp_rank: 0,
        dp_size: 1,
        dp_rank: 0,
        attention_dp: false,
        layers_per_pp: RVec::from(vec![0]),
        page_table: PageTable {
            tokens_per_block: 32,
            pools: RVec::new(),
            groups: RVec::new(),
        },
        planner_id: SingleStage::PLANNER_ID.into(),
        describer_id: DEFAULT_DESCRIBER_ID.into(),
        planner_blob: RVec::new(),
    }
}

fn registry() -> Registry {
    Registry::from_modules([
        (planner_module(), "static:test.single_stage"),
        (
            kvferry_planner_abi::module_of::<OddDescriber>(),
            "static:test.odd_describer",
        ),
        (planner_module(), "static:again"),
    ])
}

#[test]
fn static_modules_are_listed_and_repeats_refused() {
    let registry = registry();
    let ids: Vec<&str> = registry.planners().iter().map(|p| p.id.as_str()).collect();
    assert_eq!(ids, ["test.single_stage", "test.odd_describer"]);
    let info = registry.planner("test.single_stage").unwrap();
    assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
    assert_eq!(info.describer_id, DEFAULT_DESCRIBER_ID);
    assert_eq!(info.path.to_str(), Some("static:test.single_stage"));
    assert!(registry.dirs().is_empty());

    let [skipped] = registry.skipped() else {
        panic!("one skipped: {:?}", registry.skipped());
    };
    assert_eq!(
        skipped.reason,
        LoadError::DuplicateId {
            id: "test.single_stage".into(),
            first: "static:test.single_stage".into(),
            second: "static:again".into(),
        }
    );

    let json = serde_json::to_value(registry.planners()).unwrap();
    assert_eq!(
        json[0],
        serde_json::json!({
            "id": "test.single_stage",
            "describer_id": DEFAULT_DESCRIBER_ID,
            "version": env!("CARGO_PKG_VERSION"),
            "path": "static:test.single_stage",
        })
    );
    let json = serde_json::to_value(registry.skipped()).unwrap();
    assert_eq!(json[0]["reason"]["kind"], "duplicate_id");
    assert_eq!(json[0]["reason"]["first"], "static:test.single_stage");
    assert_eq!(json[0]["path"], "static:again");
    assert_eq!(
        json[0]["message"],
        "static:again: duplicate planner id `test.single_stage`, already loaded from \
         static:test.single_stage"
    );
}

#[test]
fn bind_checks_the_deployment_and_instantiates() {
    let registry = registry();
    let bound = registry.bind("test.single_stage", &deployment(1)).unwrap();
    assert_eq!(bound.id(), "test.single_stage");
    assert_eq!(bound.describer_id(), DEFAULT_DESCRIBER_ID);
    assert_eq!(bound.version(), env!("CARGO_PKG_VERSION"));
    assert_eq!(bound.path().to_str(), Some("static:test.single_stage"));
    let planner = bound.instantiate(&rank()).unwrap();
    let targets = planner.targets(&rank(), &rank(), 0).unwrap();
    assert_eq!(targets.ranks.as_slice(), &[3]);

    let error = registry
        .bind("test.single_stage", &deployment(2))
        .unwrap_err();
    let BindError::Unsupported { error: reason, .. } = &error else {
        panic!("expected Unsupported, got {error:?}");
    };
    assert_eq!(reason.kind(), kvferry_planner_abi::ErrorKind::UNSUPPORTED);
    assert_eq!(
        error.to_string(),
        "planner `test.single_stage` (static:test.single_stage) does not support \
         LlamaForCausalLM tp1pp2: pipeline parallelism is not supported"
    );
}

#[test]
fn bind_refuses_unknown_describers_and_ids() {
    let registry = registry();
    let error = registry
        .bind("test.odd_describer", &deployment(1))
        .unwrap_err();
    assert!(
        matches!(&error, BindError::UnknownDescriber { describer_id, .. }
            if describer_id == "acme.describer"),
        "{error:?}"
    );
    println!("{error}");

    let error = registry
        .bind("kvferry.default", &deployment(1))
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "no planner `kvferry.default`: known planners are test.single_stage, \
         test.odd_describer (searched no plugin directory); 1 file was skipped, see \
         `kvferry planners --all`"
    );

    let empty = Registry::scan(&[]);
    let error = empty.bind("kvferry.default", &deployment(1)).unwrap_err();
    assert_eq!(
        error.to_string(),
        "no planner `kvferry.default`: no planner was loaded (searched no plugin directory)"
    );
}

#[test]
fn registry_and_bound_planner_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Registry>();
    send_sync::<kvferry_loader::BoundPlanner>();
}
