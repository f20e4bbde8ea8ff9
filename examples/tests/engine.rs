//! The engine example across processes, one process per rank, nothing built here: the test
//! only starts `engine_prefill` / `engine_decode` / `engine_decode_failover`, hands the
//! prefill ranks' endpoints to the decode ranks, and reads their exit codes and JSON lines.
//!
//! - tp2 prefill → tp2 decode and tp2 → tp1, over tcp and shm: every rank exits 0 (every
//!   request ended as expected, once), and the decode checked exactly the rows the workload
//!   says it received.
//! - Three one-rank prefill instances feeding one decode rank: one is killed with SIGKILL
//!   and one stopped with SIGSTOP past the decode's 1 s peer timeout while their requests are
//!   half written; only their requests fail, each naming its peer, the third's all arrive
//!   verified; then the stopped one is resumed, the killed one restarted on its old address,
//!   and fresh requests to every instance arrive verified.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use kvferry_examples::engine::{self, KV_HEADS, LAYERS, Mix};
use serde_json::Value;

const PREFILL: &str = env!("CARGO_BIN_EXE_engine_prefill");
const DECODE: &str = env!("CARGO_BIN_EXE_engine_decode");
const FAILOVER: &str = env!("CARGO_BIN_EXE_engine_decode_failover");
const SECRET: &str = "the example deployment's shared secret";

/// A child process whose stdout lines arrive on a channel; killed (and resumed first, if
/// stopped) when dropped.
struct Proc {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    seen: Vec<String>,
    stderr: PathBuf,
}

impl Proc {
    fn spawn(name: &str, program: &str, args: &[String], dir: &Path) -> Proc {
        let stderr = dir.join(format!("{name}.stderr"));
        let mut child = Command::new(program)
            .args(args)
            .env("KVFERRY_SECRET", SECRET)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc {
            name: name.to_string(),
            child,
            stdin,
            lines,
            seen: Vec::new(),
            stderr,
        }
    }

    /// What went wrong, with what the process printed.
    fn fail(&self, what: &str) -> ! {
        let err = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let tail: Vec<&str> = err.lines().rev().take(20).collect();
        panic!(
            "{}: {what}\nstdout:\n{}\nstderr (last lines, newest first):\n{}",
            self.name,
            self.seen.join("\n"),
            tail.join("\n")
        );
    }

    /// Waits for a JSON line `pick` accepts.
    fn wait_json(&mut self, limit: Duration, pick: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if let Some(v) = json(&line) {
                        if pick(&v) {
                            return v;
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => self.fail("no such line in time"),
                Err(RecvTimeoutError::Disconnected) => self.fail("exited before that line"),
            }
        }
    }

    /// Takes in the lines printed so far.
    fn drain(&mut self) {
        self.seen.extend(self.lines.try_iter());
    }

    /// Tells a prefill started with `--until-stdin-closes` to stop.
    fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// Waits for the process to exit 0; returns its JSON lines (UCX logs to stdout too).
    fn finish(&mut self, limit: Duration) -> Vec<Value> {
        let deadline = Instant::now() + limit;
        let status: ExitStatus = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                self.fail("did not exit in time");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        self.seen.extend(self.lines.iter());
        if !status.success() {
            self.fail(&format!("exited with {status}"));
        }
        self.seen.iter().filter_map(|l| json(l)).collect()
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid; it takes no pointers.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill({}, {signal})", self.name);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal(libc::SIGCONT);
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn json(line: &str) -> Option<Value> {
    line.starts_with('{')
        .then(|| serde_json::from_str(line).ok())
        .flatten()
}

/// Waits for the endpoint a prefill rank wrote.
fn endpoint(p: &Proc, file: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if let Ok(e) = std::fs::read_to_string(file) {
            return e;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    p.fail("wrote no endpoint")
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_string()).collect()
}

/// One prefill instance of `ptp` ranks and one decode instance of `dtp` ranks, each rank its
/// own process, moving `requests` requests of the mixed workload.
fn engines(ptp: u32, dtp: u32, transport: &str, seed: u64, requests: usize) {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, format!("{SECRET}\n")).unwrap();
    // A secret file must be readable by its owner alone.
    std::fs::set_permissions(
        &secret_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let secret_file = secret_file.display().to_string();
    let common = |tp: u32, rank: u32| {
        args(&[
            "--tp",
            &tp.to_string(),
            "--rank",
            &rank.to_string(),
            "--transport",
            transport,
            "--seed",
            &seed.to_string(),
            "--requests",
            &requests.to_string(),
            "--secret-file",
            &secret_file,
        ])
    };
    let mut prefills: Vec<Proc> = Vec::new();
    let mut endpoints = Vec::new();
    for r in 0..ptp {
        let file = dir.path().join(format!("prefill-{r}.endpoint"));
        let mut a = common(ptp, r);
        a.extend(args(&[
            "--endpoint-file",
            &file.display().to_string(),
            "--until-stdin-closes",
            // A cancel that overtakes the decode's claim leaves the send to its lease.
            "--lease-ms",
            "4000",
        ]));
        let p = Proc::spawn(&format!("prefill rank {r}"), PREFILL, &a, dir.path());
        endpoints.push(endpoint(&p, &file));
        prefills.push(p);
    }
    let mut decodes: Vec<Proc> = (0..dtp)
        .map(|r| {
            let mut a = common(dtp, r);
            a.extend(args(&["--prefill-endpoints", &endpoints.join(",")]));
            Proc::spawn(&format!("decode rank {r}"), DECODE, &a, dir.path())
        })
        .collect();

    // What the decode must have checked, from the workload both sides derive.
    let specs = engine::workload(seed, 0, requests, Mix::Mixed);
    let row_count = u64::from(LAYERS * 2 * KV_HEADS / dtp);
    let delivered = specs.iter().filter(|s| !s.cancel);
    let rows: u64 = delivered
        .clone()
        .map(|s| (s.prompt_len - s.cached_prefix.unwrap_or(0)) * row_count)
        .sum();
    let prefix_rows: u64 = delivered
        .map(|s| s.cached_prefix.unwrap_or(0) * row_count)
        .sum();
    let cancelled = specs.iter().filter(|s| s.cancel).count() as u64;
    assert!(
        cancelled > 0 && prefix_rows > 0,
        "seed {seed}: a workload without a cancel or a prefix"
    );

    for d in &mut decodes {
        let summary = d.finish(Duration::from_secs(30)).pop().unwrap();
        let want = [
            ("received", requests as u64 - cancelled),
            ("verified_rows", rows),
            ("cached_prefix_rows", prefix_rows),
        ];
        for (field, value) in want {
            assert_eq!(summary[field], value, "{}: {field} in {summary}", d.name);
        }
        assert_eq!(
            summary["cancelled"].as_u64().unwrap()
                + summary["failed_after_cancel"].as_u64().unwrap(),
            cancelled,
            "{}: {summary}",
            d.name
        );
    }
    // The decode is gone: the prefill ranks may stop.
    for p in &mut prefills {
        p.close_stdin();
    }
    for p in &mut prefills {
        let summary = p.finish(Duration::from_secs(30)).pop().unwrap();
        assert_eq!(
            summary["sent"].as_u64().unwrap() + summary["cancelled_by_peer"].as_u64().unwrap(),
            requests as u64,
            "{}: {summary}",
            p.name
        );
        assert!(
            summary["chunks"].as_u64().unwrap() > requests as u64,
            "{summary}"
        );
    }
}

#[test]
fn tp2_prefill_to_tp2_decode_over_tcp_and_shm() {
    engines(2, 2, "tcp", 1, 24);
    engines(2, 2, "shm", 2, 24);
}

#[test]
fn tp2_prefill_to_tp1_decode_over_tcp_and_shm() {
    engines(2, 1, "tcp", 3, 24);
    engines(2, 1, "shm", 4, 24);
}

/// A one-rank prefill instance for the failover test, serving `requests` chunked requests
/// from `id_base`.
fn prefill(
    dir: &Path,
    name: &str,
    id_base: u64,
    requests: usize,
    extra: &[&str],
) -> (Proc, String) {
    let file = dir.join(format!("{name}.endpoint"));
    let _ = std::fs::remove_file(&file);
    let mut a = args(&[
        "--instance",
        name,
        "--id-base",
        &id_base.to_string(),
        "--workload",
        "chunked",
        "--requests",
        &requests.to_string(),
        "--peer-timeout-ms",
        "1000",
        "--endpoint-file",
        &file.display().to_string(),
        "--until-stdin-closes",
    ]);
    a.extend(args(extra));
    let p = Proc::spawn(name, PREFILL, &a, dir);
    let e = endpoint(&p, &file);
    (p, e)
}

#[test]
fn a_killed_and_a_stopped_prefill_fail_only_their_own_requests() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A is killed and B stopped while each holds the last chunk of its three requests (they
    // are half written); C is left alone. B and C also serve two fresh requests each later.
    let (mut a, a_endpoint) = prefill(d, "prefill-a", 1000, 3, &["--hold-last"]);
    let (mut b, b_endpoint) = prefill(d, "prefill-b", 2000, 3, &["--hold-last", "--fresh", "2"]);
    let (mut c, c_endpoint) = prefill(d, "prefill-c", 3000, 3, &["--fresh", "2"]);
    let mut decode = Proc::spawn(
        "decode",
        FAILOVER,
        &args(&[
            "--peer",
            &format!("prefill-a={a_endpoint}"),
            "--peer",
            &format!("prefill-b={b_endpoint}"),
            "--peer",
            &format!("prefill-c={c_endpoint}"),
            "--requests",
            "3",
            "--fresh",
            "2",
            "--peer-timeout-ms",
            "1000",
        ]),
        d,
    );
    let phase1 = |v: &Value, instance: &str| v["phase"] == 1 && v["instance"] == instance;
    for _ in 0..3 {
        let v = decode.wait_json(Duration::from_secs(20), |v| phase1(v, "prefill-c"));
        assert_eq!(v["outcome"], "verified", "{v}");
    }
    // C's requests are all in: A's and B's were claimed with them and are half written. Left
    // so for longer than the peer timeout, they must still be open: only the kill and the
    // stop may end them.
    std::thread::sleep(Duration::from_millis(1500));
    decode.drain();
    let before = decode.seen.len();
    a.signal(libc::SIGKILL);
    b.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    decode.wait_json(Duration::from_secs(20), |v| {
        v["phase"] == 1 && v["done"] == true
    });
    let silent_for = stopped.elapsed();
    b.signal(libc::SIGCONT);
    let phase1: Vec<(usize, Value)> = decode
        .seen
        .iter()
        .enumerate()
        .filter_map(|(i, l)| json(l).map(|v| (i, v)))
        .filter(|(_, v)| v["phase"] == 1 && v["id"].is_u64())
        .collect();
    assert_eq!(phase1.len(), 9, "{phase1:?}");
    for (instance, endpoint) in [("prefill-a", &a_endpoint), ("prefill-b", &b_endpoint)] {
        let mine: Vec<&(usize, Value)> = phase1
            .iter()
            .filter(|(_, v)| v["instance"] == instance)
            .collect();
        assert_eq!(mine.len(), 3, "{instance}: {phase1:?}");
        for (i, v) in mine {
            assert!(
                *i >= before,
                "{instance}'s request ended before its peer was hit: {v}"
            );
            assert_eq!(v["outcome"], "failed", "{v}");
            assert_eq!(v["kind"], "peer", "{v}");
            let named = v["peer"].as_str().unwrap_or_default();
            // The link's identity, or the endpoint when its dial is what failed.
            assert!(
                named.starts_with(&format!("{instance} rank 0")) || named == endpoint.as_str(),
                "{instance} is not the peer named: {v}"
            );
        }
    }
    // B fell silent: its requests fail on the peer timeout, not before (its last keep-alive
    // may have left up to a third of the timeout before the stop).
    assert!(
        silent_for >= Duration::from_millis(600),
        "B's requests ended {silent_for:?} after the stop, before the 1 s peer timeout"
    );
    for (_, v) in phase1.iter().filter(|(_, v)| v["instance"] == "prefill-b") {
        let detail = v["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("sent nothing for"), "{v}");
    }
    let _ = a.child.wait();

    // A restarts on its old address (a new epoch); B resumed: fresh requests to all three.
    let (mut a2, a2_endpoint) = prefill(
        d,
        "prefill-a",
        1000,
        0,
        &["--fresh", "2", "--listen", &a_endpoint],
    );
    assert_eq!(a2_endpoint, a_endpoint);
    let lines = decode.finish(Duration::from_secs(30));
    let summary = lines.last().unwrap();
    assert_eq!(summary["ok"], true, "{summary}");
    let fresh: Vec<&Value> = lines.iter().filter(|v| v["phase"] == 2).collect();
    assert_eq!(fresh.len(), 6, "{fresh:?}");
    assert!(
        fresh.iter().all(|v| v["outcome"] == "verified"),
        "{fresh:?}"
    );
    for p in [&mut a2, &mut b, &mut c] {
        p.close_stdin();
        let summary = p.finish(Duration::from_secs(20)).pop().unwrap();
        assert_eq!(summary["ok"], true, "{}: {summary}", p.name);
    }
}
