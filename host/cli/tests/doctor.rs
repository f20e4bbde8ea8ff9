//! `kvferry doctor` reports the UCX this binary really loads, and what each transport selects.

use crate::support;

use std::path::Path;

use serde_json::Value;
use support::Kvferry;

/// A JSON array of strings.
fn strings(value: &Value) -> Vec<&str> {
    let array = value
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {value}"));
    array.iter().map(|v| v.as_str().unwrap()).collect()
}

/// The report's row for `transport` pools in `memory`.
fn row<'a>(report: &'a Value, transport: &str, memory: &str) -> &'a Value {
    report["transports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["transport"] == transport && t["memory"] == memory)
        .unwrap_or_else(|| panic!("no {transport} {memory} row: {report:#}"))
}

#[test]
fn doctor_reports_the_linked_ucx_and_the_devices_each_transport_selects() {
    let report = Kvferry::new().arg("doctor").arg("--json").quiet().json();
    // Which kvferry, and the planner ABI its planners must match.
    assert_eq!(report["kvferry"], env!("CARGO_PKG_VERSION"));
    assert_eq!(report["planner_abi"], kvferry_planner_abi::ABI_VERSION);
    let ucx = &report["ucx"];
    // The loaded library is the one the build linked against (the rpath works without
    // LD_LIBRARY_PATH), and its version matches the headers the bindings came from.
    let linked = std::fs::canonicalize(ucx["linked_dir"].as_str().unwrap()).unwrap();
    let loaded = strings(&ucx["loaded"]);
    let libucp: Vec<&Path> = loaded
        .iter()
        .map(Path::new)
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("libucp")
        })
        .collect();
    assert_eq!(libucp.len(), 1, "{loaded:?}");
    let libucp_dir = std::fs::canonicalize(libucp[0].parent().unwrap()).unwrap();
    assert_eq!(libucp_dir, linked);
    let version = ucx["version"].as_str().unwrap();
    let api = ucx["linked_api"].as_str().unwrap();
    assert!(
        version.starts_with(&format!("{api}.")),
        "{version} vs API {api}"
    );
    assert_eq!(ucx["multi_threaded"], true);
    assert_eq!(
        strings(&report["problems"]),
        Vec::<&str>::new(),
        "{report:#}"
    );

    let tcp = row(&report, "tcp", "host");
    assert_eq!(tcp["ucx_tls"], "tcp");
    assert_eq!(tcp["ucx_net_devices"], "lo");
    assert_eq!(strings(&tcp["resources"]), ["tcp/lo"]);
    let shm = row(&report, "shm", "host");
    assert!(
        strings(&shm["resources"]).contains(&"posix/memory"),
        "{shm:#}"
    );
    assert!(strings(&shm["memory_types"]).contains(&"host"), "{shm:#}");
}

#[test]
fn doctor_require_cuda_fails_without_registrable_device_memory() {
    let out = Kvferry::new()
        .args(["doctor", "--require-cuda", "--json"])
        .quiet()
        .output();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let registrable = ["shm", "tcp"]
        .iter()
        .any(|t| strings(&row(&report, t, "cuda")["memory_types"]).contains(&"cuda"));
    // Without a GPU (CI) nothing can register device memory and the flag fails the run,
    // naming why; on a GPU machine with a CUDA-enabled UCX it passes.
    assert_eq!(out.status.success(), registrable, "{report:#}");
    if !registrable {
        let problems = report["problems"].to_string();
        assert!(problems.contains("--require-cuda"), "{problems}");
    }
}

#[test]
fn doctor_tcp_devices_follow_net_devices() {
    // UCX logs the missing device on stdout, beside the JSON: silence it.
    let out = Kvferry::new()
        .args(["doctor", "--net-devices", "no_such_nic0", "--json"])
        .env("UCX_LOG_LEVEL", "fatal")
        .quiet()
        .output();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let tcp = row(&report, "tcp", "host");
    assert_eq!(tcp["ucx_net_devices"], "no_such_nic0");
    // A device UCX does not have selects nothing: the context fails or lists no tcp
    // resource, and doctor says the transport cannot start.
    assert!(
        !tcp["error"].is_null() || strings(&tcp["resources"]).is_empty(),
        "{tcp:#}"
    );
    assert!(!out.status.success());
}
