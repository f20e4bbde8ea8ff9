//! Worker addresses that are not a peer's `address()`: UCX aborts the whole process (an
//! always-on assertion) on an unknown address version, so `connect` refuses those first.
//! Each case runs in a child process (this test binary re-executed), so a regression fails
//! the test instead of killing the test run.

use crate::common;

use std::process::Command;

use common::Transport;
use kvferry_ucx::{Op, Status, Worker};

const CHILD: &str = "KVFERRY_GARBAGE_ADDRESS_CASE";

/// The garbage for `case`, made from a real address of `real.len()` bytes.
fn garbage(case: &str, real: &[u8]) -> Vec<u8> {
    match case {
        "version-2" => vec![0x42],
        "version-15" => vec![0xff; real.len()],
        "version-15-then-real" => {
            let mut a = real.to_vec();
            a[0] |= 0x0f;
            a
        }
        "zeros" => vec![0; real.len()],
        "truncated" => real[..real.len() / 2].to_vec(),
        other => panic!("unknown case {other}"),
    }
}

/// In the child: connects with the case's garbage and prints the outcome.
#[test]
fn child() {
    let Ok(case) = std::env::var(CHILD) else {
        return;
    };
    let ctx = Transport::Shm.context();
    let (target, worker) = (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap());
    let address = garbage(&case, &target.address().unwrap());
    match worker.connect(&address) {
        Ok(_) => println!("outcome: connected"),
        Err(e) => {
            assert_eq!(e.op(), Op::EpCreate);
            println!("outcome: {}", e.status().code());
        }
    }
}

/// Runs `case` in a child; returns its outcome line, or panics naming how the child died.
fn run(case: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &common::test_named(module_path!(), "child")])
        .args(["--nocapture", "--test-threads=1"])
        .env(CHILD, case)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{case}: the child died ({}): {}{}",
        out.status,
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.split_once("outcome: ").map(|(_, outcome)| outcome.trim()))
        .unwrap_or_else(|| panic!("{case}: no outcome in {stdout}"))
        .to_string()
}

#[test]
fn unknown_address_versions_are_refused_before_ucx_sees_them() {
    let invalid = Status::INVALID_PARAM.code().to_string();
    for case in ["version-2", "version-15", "version-15-then-real"] {
        assert_eq!(run(case), invalid, "{case}");
    }
}

/// Garbage of a known version reaches UCX and fails there without killing the process. A
/// truncated address is still read past its end by UCX: what it finds there decides the
/// status — seen: `INVALID_PARAM`, `UNREACHABLE`, and once in CI `SHMEM_SEGMENT` (-17) — so
/// any error status passes; an abort, a crash or a success does not.
#[test]
fn other_garbage_fails_in_ucx_without_aborting() {
    for case in ["zeros", "truncated"] {
        let outcome = run(case);
        let code: i32 = outcome.parse().unwrap_or_else(|_| {
            panic!("{case}: the connect did not fail with a status: {outcome}")
        });
        assert!(code < 0, "{case}: connected to garbage ({outcome})");
    }
}
