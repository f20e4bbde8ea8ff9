//! The out-of-tree planner template (`examples/planner-template`) builds on its own and the
//! registry loads it like any third-party planner.
//!
//! The template is its own cargo workspace (with its own committed `Cargo.lock`); it is built
//! once per test binary into `target/out-of-tree/shared`
//! ([`build_out_of_tree`]), never into the source tree.

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kvferry_loader::{BindError, Registry};
use kvferry_planner_abi::ffi::RVec;
use kvferry_planner_abi::{DEFAULT_DESCRIBER_ID, Deployment, Mapping, PageTable, RankInfo};
use kvferry_testkit::conform::{build_out_of_tree, repo_root};
use support::Kvferry;

/// The template's planner id.
const TEMPLATE_ID: &str = "example.template";

/// Builds the planner template (debug profile) once per test binary and returns the path of
/// its shared object.
pub fn build_template() -> &'static Path {
    static SO: OnceLock<PathBuf> = OnceLock::new();
    SO.get_or_init(|| {
        let so = build_out_of_tree("examples/planner-template").join("libplanner_template.so");
        assert!(so.is_file(), "{} was not built", so.display());
        so
    })
}

/// The template's version, from its `Cargo.toml`.
fn template_version() -> String {
    let manifest = repo_root().join("examples/planner-template/Cargo.toml");
    let text = std::fs::read_to_string(&manifest).expect("read the template's Cargo.toml");
    let value: toml::Value = text.parse().expect("parse the template's Cargo.toml");
    value["package"]["version"]
        .as_str()
        .expect("package.version")
        .to_string()
}

/// A temporary plugin directory holding a copy of the template's `.so`.
fn plugin_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("create a temporary plugin directory");
    std::fs::copy(build_template(), dir.path().join("libplanner_template.so"))
        .expect("copy the template into the plugin directory");
    dir
}

fn deployment(tp: u32, pp: u32) -> Deployment {
    Deployment {
        architecture: "LlamaForCausalLM".into(),
        mapping: Mapping {
            tp,
            pp,
            cp: 1,
            moe_tp: 1,
            moe_ep: 1,
            attention_dp: false,
        },
    }
}

#[test]
fn the_template_is_listed_with_its_describer_and_version() {
    let dir = plugin_dir();
    let registry = Registry::scan(&[dir.path().to_path_buf()]);
    assert!(registry.skipped().is_empty(), "{:?}", registry.skipped());
    let info = registry
        .planner(TEMPLATE_ID)
        .expect("example.template is listed");
    assert_eq!(info.describer_id, DEFAULT_DESCRIBER_ID);
    assert_eq!(info.version, template_version());
    assert_eq!(info.path, dir.path().join("libplanner_template.so"));
    println!("{info}");
}

#[test]
fn the_template_binds_where_it_supports_the_deployment() {
    let dir = plugin_dir();
    let registry = Registry::scan(&[dir.path().to_path_buf()]);

    let bound = registry.bind(TEMPLATE_ID, &deployment(2, 1)).unwrap();
    assert_eq!(bound.id(), TEMPLATE_ID);
    let empty = PageTable {
        tokens_per_block: 32,
        pools: RVec::new(),
        groups: RVec::new(),
    };
    let me = RankInfo::new("ctx", &deployment(2, 1).mapping, 0, vec![0], empty)
        .with_planner(TEMPLATE_ID);
    let planner = bound.instantiate(&me).unwrap();
    let mut peer = me.clone();
    peer.instance_name = "gen".into();
    planner.check_peer(&me, &peer).unwrap();
    assert_eq!(
        planner.targets(&me, &peer, 0).unwrap().ranks.as_slice(),
        &[0]
    );

    let error = registry.bind(TEMPLATE_ID, &deployment(2, 2)).unwrap_err();
    assert!(matches!(error, BindError::Unsupported { .. }), "{error:?}");
    // The message names the file; the planner's reason is the source.
    assert!(
        error.to_string().contains("libplanner_template.so"),
        "{error}"
    );
    let text = kvferry_testkit::error_chain(&error);
    assert!(text.contains("mapping.pp = 2 (supports 1)"), "{text}");
    println!("{text}");
}

#[test]
fn the_cli_lists_the_template_and_plans_with_it() {
    let dir = plugin_dir();
    let out = Kvferry::new()
        .plugin_dir(dir.path())
        .args(["planners", "--json"])
        .output();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<&str> = listed["planners"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![TEMPLATE_ID]);

    // Bound through KVFERRY_PLANNER, exactly as a third party would run it.
    let out = Kvferry::new()
        .plugin_dir(dir.path())
        .planner(TEMPLATE_ID)
        .args([
            "plan",
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp2",
            "--gen",
            "tp2",
            "--prompt-len",
            "100",
            "--verify",
            "--json",
        ])
        .output();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["planner"], TEMPLATE_ID);
    assert_eq!(plan["verified"], true, "{plan}");
    // 100 tokens of Llama-3-70B at tp2: 4 blocks of 32 tokens, 5,242,880 B per rank's slot.
    assert_eq!(plan["total_bytes"], 2 * 4 * 5_242_880_u64);
    assert_eq!(plan["pairs"].as_array().unwrap().len(), 2);
    assert!(stderr.contains("bound planner"), "{stderr}");
}
