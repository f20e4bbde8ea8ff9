//! `kvferry conform` as a planner team runs it: against a planner library file, with one line
//! per case, a summary, and `--json`; a wrong byte fails the run naming the case and where
//! the first wrong byte is.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;

use kvferry_testkit::conform::build_out_of_tree;
use serde_json::Value;
use support::{Kvferry, build_dir};

fn conform_json(library: &Path, extra: &[&str]) -> (Output, Value) {
    let mut args = vec!["conform", library.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    let out = Kvferry::new().args(args).output();
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "conform --json prints JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, v)
}

fn template() -> &'static Path {
    static SO: OnceLock<PathBuf> = OnceLock::new();
    SO.get_or_init(|| build_out_of_tree("examples/planner-template").join("libplanner_template.so"))
}

fn fixtures() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| build_out_of_tree("tests/fixtures"))
}

#[test]
fn the_planner_template_conforms() {
    let (out, v) = conform_json(template(), &[]);
    assert!(out.status.success(), "{v}");
    assert_eq!(v["planner"], "example.template");
    assert_eq!(v["failed"], 0);
    assert_eq!(v["failures"], Value::Array(vec![]));
    // Llama at equal TP widths (1 to 16, attention DP or not): everything else is refused,
    // each with the planner's reason.
    let cases = v["cases"].as_u64().unwrap();
    assert!(cases >= 5, "{cases} cases ran");
    assert_eq!(v["passed"].as_u64().unwrap(), cases);
    let results = v["results"].as_array().unwrap();
    for r in results.iter().filter(|r| r["verdict"] == "refused") {
        assert!(!r["reason"].as_str().unwrap_or_default().is_empty(), "{r}");
    }
    assert!(
        results
            .iter()
            .any(|r| r["verdict"] == "passed" && r["prefill"] == "tp4" && r["decode"] == "tp4"),
        "{v}"
    );
}

/// The planner template built against planner-abi 0.2.0, as released
/// (`tests/fixtures/abi-0.2.0`): a planner that predates compressed plans.
fn template_on_abi_0_2_0() -> &'static Path {
    static SO: OnceLock<PathBuf> = OnceLock::new();
    SO.get_or_init(|| build_out_of_tree("tests/fixtures/abi-0.2.0").join("libfixture_abi_0_2_0.so"))
}

/// A planner built against the 0.2.0 interface loads into this host (0.2.1: `pair_compressed`
/// appended to the planner vtable), answers through its flat `pair`, and every destination
/// byte lands where the oracle expects, on the same cases as the template built today.
#[test]
fn a_planner_built_against_abi_0_2_0_still_loads_and_conforms() {
    let (out, v) = conform_json(template_on_abi_0_2_0(), &[]);
    assert!(out.status.success(), "{v}");
    assert_eq!(v["planner"], "example.template");
    assert_eq!(v["failed"], 0, "{v}");
    let (_, today) = conform_json(template(), &[]);
    assert_eq!(v["passed"], today["passed"], "{v}");
    assert!(v["passed"].as_u64().unwrap() >= 5, "{v}");
}

#[test]
fn a_one_head_offset_fails_naming_the_case_and_the_first_wrong_byte() {
    let library = fixtures().join("libfixture_wrong_offset.so");
    // Llama's slice of the matrix is enough to show it (the whole matrix is the oracle
    // matrix test's).
    let (out, v) = conform_json(&library, &["--case", "llama-3-70b tp"]);
    assert!(!out.status.success(), "{v}");
    assert_eq!(v["planner"], "fixture.wrong_offset");
    assert!(v["failed"].as_u64().unwrap() >= 1, "{v}");
    let failures: Vec<&str> = v["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    // Ranks holding more than one head get the wrong head; tp8 and tp16 hold one.
    assert!(
        failures
            .iter()
            .any(|f| f.starts_with("llama-3-70b tp1->tp1 ")),
        "{failures:?}"
    );
    assert!(
        !failures
            .iter()
            .any(|f| f.starts_with("llama-3-70b tp8->tp8 ")),
        "{failures:?}"
    );
    let first = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["verdict"] == "failed")
        .unwrap();
    let at = first["first_wrong"].as_str().unwrap();
    assert!(at.starts_with("layer 0 head "), "{at}");
    assert!(at.contains(" token "), "{at}");

    // The named case alone, as text: it fails again, with the same first wrong byte.
    let name = failures[0];
    let out = Kvferry::new()
        .args(["conform", library.to_str().unwrap(), "--case", name])
        .output();
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("FAIL"), "{stdout}");
    assert!(stdout.contains(at), "{stdout}");
    assert!(
        stdout.contains("1 cases ran, 0 passed, 1 failed"),
        "{stdout}"
    );
}

#[test]
fn the_mla_planner_conforms_on_its_deployments_and_refuses_the_rest_with_reasons() {
    let library = build_dir().join("libkvferry_planner_deepseek_mla_latent.so");
    let (out, v) = conform_json(&library, &[]);
    assert!(out.status.success(), "{v}");
    assert_eq!(v["planner"], "kvferry.deepseek_mla_latent");
    // DeepSeek-V3 at every attention-DP pair of the matrix.
    assert!(v["cases"].as_u64().unwrap() >= 30, "{}", v["cases"]);
    assert_eq!(v["failed"], 0);
    let refused = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["model"] == "llama-3-70b")
        .unwrap();
    assert_eq!(refused["verdict"], "refused");
    assert!(
        refused["reason"]
            .as_str()
            .unwrap()
            .contains("architecture = LlamaForCausalLM"),
        "{refused}"
    );
}

#[test]
fn the_default_planner_conforms_on_a_slice_of_the_matrix() {
    // The whole matrix runs in `tests/tests/oracle_matrix.rs` with the planner linked; here
    // the same planner as a file, through the CLI, on Qwen3-Next (recurrent state) from TP 4
    // to every width, attention DP and block size the matrix has (the whole `tp` slice, 60
    // cases, takes 40 s here).
    let library = build_dir().join("libkvferry_planner_default.so");
    let (out, v) = conform_json(&library, &["--case", "qwen3-next-80b-a3b tp4"]);
    assert!(out.status.success(), "{v}");
    assert_eq!(v["failed"], 0);
    assert_eq!(v["refused"], 0);
    assert!(v["cases"].as_u64().unwrap() >= 16, "{}", v["cases"]);
}

#[test]
fn conform_refuses_a_file_that_is_not_a_planner() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("libnothing.so");
    std::fs::write(&path, b"not an elf").unwrap();
    let out = Kvferry::new()
        .args(["conform", path.to_str().unwrap()])
        .output();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("libnothing.so"), "{stderr}");
    assert!(
        stderr.contains("not a loadable ELF shared object"),
        "{stderr}"
    );
}
