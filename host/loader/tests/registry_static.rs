//! The registry over statically linked planners (`Registry::from_modules`), as tests and
//! benchmarks use it: duplicate ids, binding, refusals. Loads no library.

use kvferry_loader::{BindError, LoadError, Registry};
use kvferry_planner_abi::ffi::RVec;
use kvferry_planner_abi::{
    DEFAULT_DESCRIBER_ID, Deployment, DeploymentRefusal, LayerGroupRows, Mapping, PageTable,
    PairRequest, PeerTargets, PlanError, PlannerPlugin, RankInfo, Specificity, TransferPlan,
    TransferPlanner, export_planner,
};
use kvferry_testkit::error_chain;

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

    const SPECIFICITY: Specificity = Specificity::GENERIC;

    fn supports_deployment(deployment: &Deployment) -> Result<(), DeploymentRefusal> {
        if deployment.mapping.pp == 1 {
            Ok(())
        } else {
            Err(DeploymentRefusal::new(
                "mapping.pp",
                deployment.mapping.pp,
                1,
                "pipeline parallelism is not supported",
            ))
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

    const SPECIFICITY: Specificity = Specificity::GENERIC;

    fn supports_deployment(_: &Deployment) -> Result<(), DeploymentRefusal> {
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
    let empty = PageTable {
        tokens_per_block: 32,
        pools: RVec::new(),
        groups: RVec::new(),
    };
    // Rank 3 of a TP-4 instance.
    let tp4 = Mapping {
        tp: 4,
        moe_tp: 4,
        ..Mapping::SINGLE
    };
    RankInfo::new("ctx", &tp4, 3, vec![0], empty).with_planner(SingleStage::PLANNER_ID)
}

fn registry() -> Registry {
    Registry::from_modules([
        (planner_module(), "static:test.single_stage"),
        (
            kvferry_planner_abi::host::module_of::<OddDescriber>(),
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
            "specificity": 0,
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
    // The message names planner and deployment; the planner's reason is the source, once.
    assert_eq!(
        error.to_string(),
        "planner `test.single_stage` (static:test.single_stage) does not support \
         LlamaForCausalLM tp1pp2"
    );
    assert_eq!(
        error_chain(&error),
        "planner `test.single_stage` (static:test.single_stage) does not support \
         LlamaForCausalLM tp1pp2: unsupported: mapping.pp = 2 (supports 1): pipeline \
         parallelism is not supported"
    );
    let field = reason.deployment_refusal().expect("a field-level refusal");
    assert_eq!(
        (
            field.field.as_str(),
            field.found.as_str(),
            field.supported.as_str()
        ),
        ("mapping.pp", "2", "1")
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

/// A planner for one architecture, declared at a given specificity: `Llama<S>` accepts
/// `LlamaForCausalLM` only, `Any<S>` every architecture.
struct ForArch<const S: u32, const ANY: bool>;

impl<const S: u32, const ANY: bool> TransferPlanner for ForArch<S, ANY> {
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

impl<const S: u32, const ANY: bool> PlannerPlugin for ForArch<S, ANY> {
    const PLANNER_ID: &'static str = match (S, ANY) {
        (0, true) => "test.generic",
        (100, false) => "test.llama",
        (100, true) => "test.also_architecture",
        _ => "test.other",
    };
    const SPECIFICITY: Specificity = Specificity(S);

    fn supports_deployment(d: &Deployment) -> Result<(), DeploymentRefusal> {
        if ANY || d.architecture.as_str() == "LlamaForCausalLM" {
            Ok(())
        } else {
            Err(DeploymentRefusal::new(
                "architecture",
                &d.architecture,
                "LlamaForCausalLM",
                "written for Llama",
            ))
        }
    }

    fn new(_: &RankInfo) -> Result<Self, PlanError> {
        Ok(ForArch)
    }
}

impl<const S: u32, const ANY: bool> kvferry_planner_abi::__private::PluginVersion
    for ForArch<S, ANY>
{
    const VERSION: &'static str = "1.0.0";
}

fn module<T: PlannerPlugin + kvferry_planner_abi::__private::PluginVersion>()
-> kvferry_planner_abi::host::PlannerModuleRef {
    kvferry_planner_abi::host::module_of::<T>()
}

fn with_arch(architecture: &str) -> Deployment {
    Deployment {
        architecture: architecture.into(),
        ..deployment(1)
    }
}

#[test]
fn auto_binds_the_most_specific_supporting_planner() {
    // Registration order must not matter: the generic planner comes first.
    let registry = Registry::from_modules([
        (module::<ForArch<0, true>>(), "static:generic"),
        (module::<ForArch<100, false>>(), "static:llama"),
        (
            kvferry_planner_abi::host::module_of::<OddDescriber>(),
            "static:odd",
        ),
    ]);
    let llama = with_arch("LlamaForCausalLM");
    let bound = registry.bind("auto", &llama).unwrap();
    assert_eq!(bound.id(), "test.llama");
    assert_eq!(registry.bind_auto(&llama).unwrap().id(), "test.llama");

    // Another architecture: the model-specific planner refuses, the generic one binds.
    let other = with_arch("Qwen3NextForCausalLM");
    assert_eq!(registry.bind("auto", &other).unwrap().id(), "test.generic");

    let candidates = registry.candidates(&other);
    let verdicts: Vec<(&str, bool)> = candidates
        .iter()
        .map(|c| (c.info.id.as_str(), c.verdict.is_ok()))
        .collect();
    assert_eq!(
        verdicts,
        [
            ("test.generic", true),
            ("test.llama", false),
            ("test.odd_describer", false)
        ]
    );
    let refusal = candidates[1].verdict.as_ref().unwrap_err();
    let field = refusal.deployment_refusal().expect("a field-level refusal");
    assert_eq!(
        (field.field.as_str(), field.found.as_str()),
        ("architecture", "Qwen3NextForCausalLM")
    );
    // Supports everything, but this host lacks its describer: never a candidate.
    let odd = candidates[2].verdict.as_ref().unwrap_err().to_string();
    assert!(odd.contains("needs describer `acme.describer`"), "{odd}");
}

#[test]
fn auto_refuses_to_guess_between_equally_specific_planners() {
    let registry = Registry::from_modules([
        (module::<ForArch<100, false>>(), "static:llama"),
        (module::<ForArch<100, true>>(), "static:also"),
        (module::<ForArch<0, true>>(), "static:generic"),
    ]);
    let error = registry
        .bind("auto", &with_arch("LlamaForCausalLM"))
        .unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, BindError::Ambiguous { .. }), "{error:?}");
    for needle in [
        "test.llama",
        "static:llama",
        "test.also_architecture",
        "static:also",
    ] {
        assert!(text.contains(needle), "{needle}: {text}");
    }
    // Where only one of them supports the deployment, there is nothing to guess.
    let bound = registry
        .bind("auto", &with_arch("GptOssForCausalLM"))
        .unwrap();
    assert_eq!(bound.id(), "test.also_architecture");
}

#[test]
fn auto_with_no_supporting_planner_lists_every_reason() {
    let registry = Registry::from_modules([(module::<ForArch<100, false>>(), "static:llama")]);
    let error = registry
        .bind("auto", &with_arch("DeepseekV3ForCausalLM"))
        .unwrap_err();
    assert!(matches!(error, BindError::NoCandidate { .. }), "{error:?}");
    let text = error.to_string();
    assert!(
        text.contains("no planner supports DeepseekV3ForCausalLM tp1"),
        "{text}"
    );
    assert!(
        text.contains(
            "`test.llama` refuses: architecture = DeepseekV3ForCausalLM (supports LlamaForCausalLM)"
        ),
        "{text}"
    );
}
