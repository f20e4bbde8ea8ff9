//! `--memory host|cuda` of `kvferry serve`, `demo` and `bench` as a user runs them. In a build
//! without the `cuda` feature, `--memory cuda` is refused up front with the rebuild
//! instruction (host/tests/cuda.rs covers the feature build).

use crate::support;

use std::process::Output;

use kvferry_harness::demo::CONTROL_ON;
use support::{Kvferry, text};

#[cfg(not(feature = "cuda"))]
const REBUILD: &str = "kvferry: this kvferry was built without the `cuda` feature; rebuild with \
                       `cargo build --features cuda`";

/// `kvferry serve` of a small decode instance, plus `extra`.
fn serve(extra: &[&str]) -> Output {
    let mut args = vec![
        "serve",
        "--role",
        "generation",
        "--model",
        "llama-3-70b",
        "--deployment",
        "tp1",
        "--listen",
        "127.0.0.1:0",
        "--slots",
        "4",
    ];
    args.extend_from_slice(extra);
    Kvferry::new().quiet().args(args).output()
}

/// Exit status 1, the message on stderr, and never a listening line.
fn assert_refused(out: &Output, message: &str) {
    let (stdout, stderr) = text(out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains(message), "{stderr}");
    assert!(!stdout.contains(CONTROL_ON), "{stdout}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn serve_memory_cuda_without_the_feature_asks_for_a_rebuild() {
    let out = serve(&["--memory", "cuda"]);
    assert_refused(&out, REBUILD);
    let (_, stderr) = text(&out);
    println!("seen: {}", stderr.trim());
    // Also with a device named; refused before the stdin watcher (stdin is empty) exits 0.
    let out = serve(&[
        "--memory",
        "cuda",
        "--cuda-device",
        "0",
        "--exit-with-stdin",
    ]);
    assert_refused(&out, REBUILD);
}

#[cfg(not(feature = "cuda"))]
#[test]
fn demo_and_bench_memory_cuda_without_the_feature_ask_for_a_rebuild() {
    let common = [
        "--memory",
        "cuda",
        "--model",
        "llama-3-70b",
        "--ctx",
        "tp1",
        "--gen",
        "tp1",
        "--prompt-len",
        "64",
    ];
    for command in ["demo", "bench"] {
        let mut args = vec![command];
        args.extend_from_slice(&common);
        let out = Kvferry::new().quiet().args(args).output();
        assert_refused(&out, REBUILD);
        // Refused by the controller itself: no server child was started.
        let (_, stderr) = text(&out);
        assert!(!stderr.contains("server:"), "{command}: {stderr}");
    }
}

#[test]
fn pools_larger_than_the_machine_are_refused_at_start_with_the_numbers() {
    // 1,000,000 Llama-3-70B slots at tp1: about 10 TB of host pools. Without the pre-flight
    // the kernel would hand the pools out lazily and kill the server when they were touched.
    let out = Kvferry::new()
        .quiet()
        .args(["serve", "--role", "generation", "--model", "llama-3-70b"])
        .args([
            "--deployment",
            "tp1",
            "--listen",
            "127.0.0.1:0",
            "--slots",
            "1000000",
        ])
        .output();
    assert_refused(&out, "host pools would not fit");
    let (_, stderr) = text(&out);
    assert!(
        stderr.contains("asked for in all") && stderr.contains("available ("),
        "{stderr}"
    );
}

#[test]
fn cuda_device_without_memory_cuda_is_refused() {
    let out = serve(&["--cuda-device", "0"]);
    assert_refused(&out, "kvferry: --cuda-device needs --memory cuda");
}

#[test]
fn an_unknown_memory_names_the_known_ones() {
    let out = serve(&["--memory", "gpu"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("unknown memory `gpu` (known: host, cuda)"),
        "{stderr}"
    );
}

#[test]
fn demo_with_memory_host_verifies_and_reports_it() {
    let report = Kvferry::new()
        .quiet()
        .args([
            "demo",
            "--memory",
            "host",
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp1",
            "--gen",
            "tp1",
            "--requests",
            "2",
            "--prompt-len",
            "64",
            "--in-flight",
            "2",
            "--json",
        ])
        .json();
    assert_eq!(report["memory"], "host", "{report}");
    assert_eq!(report["verified"], true, "{report}");
}

/// `serve` needs the deployment's secret: none, or one too short, is refused at start by name
/// (before any pool is allocated or port bound for peers).
#[test]
fn serve_without_a_usable_secret_is_refused_naming_it() {
    let missing = Kvferry::new()
        .quiet()
        .env_remove("KVFERRY_SECRET")
        .args(["serve", "--role", "context", "--model", "llama-3-70b"])
        .args(["--deployment", "tp1", "--slots", "4"])
        .output();
    assert_refused(
        &missing,
        "no secret: pass a secret file or set KVFERRY_SECRET",
    );
    let short = Kvferry::new()
        .quiet()
        .env("KVFERRY_SECRET", "short")
        .args(["serve", "--role", "context", "--model", "llama-3-70b"])
        .args(["--deployment", "tp1", "--slots", "4"])
        .output();
    assert_refused(&short, "at least 16 bytes; this one has 5");
}
