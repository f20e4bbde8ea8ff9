//! Two hosts, faked honestly on one machine: a prefill and a decode agent, each in its own
//! network namespace joined by a veth pair, and each in its own IPC and PID namespace, so
//! UCX has nothing but `tcp` over the veth devices between them (no shared memory, no
//! `process_vm_writev`, no loopback). A verified transfer crosses the link; the link is cut
//! with a request in flight, which must fail within its timeouts naming the peer; once the
//! link is up again a later request succeeds (the decode rank dials anew).
//!
//! Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), `ip` (iproute2) and `unshare`
//! (util-linux); without them it says why and skips. The test re-runs this binary as the two
//! children (`KVFERRY_NS_CHILD=prefill|decode`), which talk to the parent by lines on their
//! standard input and output.

use crate::support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use kvferry_plan::ValidatedPlan;
use kvferry_transfer::agent::{Agent, AgentConfig, Event, FailureKind};
use kvferry_transfer::harness::rank::{RemoteRank, WriteHook};
use kvferry_transfer::{Role, TransportSpec};

use support::*;

const NS: [&str; 2] = ["kvf-prefill", "kvf-decode"];
const DEV: [&str; 2] = ["kvfp0", "kvfd0"];
const ADDR: [&str; 2] = ["10.213.7.1", "10.213.7.2"];
const PROMPT: u64 = 48;
const SLOTS: [i64; 3] = [2, 5, 1];
const DST: [i64; 3] = [6, 0, 3];

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespaces and the link; removed on drop.
struct Net;

impl Net {
    fn up() -> Result<Net, String> {
        Net::teardown();
        ip(&["netns", "add", NS[0]])?;
        let net = Net;
        ip(&["netns", "add", NS[1]])?;
        ip(&[
            "link", "add", DEV[0], "netns", NS[0], "type", "veth", "peer", "name", DEV[1], "netns",
            NS[1],
        ])?;
        for i in 0..2 {
            ip(&[
                "-n",
                NS[i],
                "addr",
                "add",
                &format!("{}/24", ADDR[i]),
                "dev",
                DEV[i],
            ])?;
            ip(&["-n", NS[i], "link", "set", DEV[i], "up"])?;
            ip(&["-n", NS[i], "link", "set", "lo", "up"])?;
        }
        Net::carrier(true)?;
        Ok(net)
    }

    /// Waits until both ends report the link up (or down): a veth's carrier comes a moment
    /// after `link set up`, and UCX lists only devices that are up.
    fn carrier(up: bool) -> Result<(), String> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let states: Vec<bool> = (0..2)
                .map(|i| {
                    Command::new("ip")
                        .args(["-n", NS[i], "-br", "link", "show", DEV[i]])
                        .output()
                        .map(|o| String::from_utf8_lossy(&o.stdout).contains(" UP "))
                        .unwrap_or(false)
                })
                .collect();
            if states.iter().all(|&s| s == up) || (!up && states.iter().any(|&s| !s)) {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(format!(
                    "the veth pair did not come {}",
                    if up { "up" } else { "down" }
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn link(up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", NS[0], "link", "set", DEV[0], state]).unwrap();
        Net::carrier(up).unwrap();
    }

    fn teardown() {
        for ns in NS {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        Net::teardown();
    }
}

fn spawn(role: usize) -> Child {
    let exe = std::env::current_exe().unwrap();
    Command::new("ip")
        .args([
            "netns", "exec", NS[role], "unshare", "--ipc", "--pid", "--fork", "--",
        ])
        .arg(exe)
        .args(["--exact", &support::test_named(module_path!(), "child")])
        .args(["--nocapture", "--test-threads=1"])
        .env(
            "KVFERRY_NS_CHILD",
            if role == 0 { "prefill" } else { "decode" },
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// What a child says (`KVF ...`; the test harness's own lines are dropped), as it says it.
fn words(child: &mut Child) -> mpsc::Receiver<String> {
    let out = BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines() {
            let Ok(line) = line else { return };
            // The harness prints `test child ... ` without a newline before the first word.
            if let Some(at) = line.find("KVF ") {
                if tx.send(line[at + 4..].to_string()).is_err() {
                    return;
                }
            }
        }
    });
    rx
}

/// The child's next word, within 60 s.
fn said(words: &mpsc::Receiver<String>, who: &str) -> String {
    words
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("the {who} child said nothing more ({e})"))
}

/// Kills the children when the test ends, however it ends.
struct Reap(Vec<Child>);

impl Drop for Reap {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn a_transfer_crosses_a_veth_link_and_a_cut_fails_only_what_was_in_flight() {
    if std::env::var_os("KVFERRY_NS_CHILD").is_some() {
        return;
    }
    let net = match Net::up() {
        Ok(net) => net,
        Err(why) => {
            eprintln!(
                "SKIPPED: this test needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), iproute2 and \
                 util-linux's unshare to make two network namespaces: {why}"
            );
            return;
        }
    };
    let mut prefill = spawn(0);
    let p_words = words(&mut prefill);
    let mut decode = spawn(1);
    let mut d_in = decode.stdin.take().unwrap();
    let d_words = words(&mut decode);
    let mut children = Reap(vec![prefill, decode]);
    let endpoint = said(&p_words, "prefill");
    let endpoint = endpoint.strip_prefix("endpoint ").unwrap().to_string();
    assert!(endpoint.starts_with(ADDR[0]), "{endpoint}");
    writeln!(d_in, "{endpoint}").unwrap();
    assert_eq!(said(&d_words, "decode"), "1 received and verified");
    assert_eq!(said(&d_words, "decode"), "2 in flight");
    Net::link(false);
    writeln!(d_in, "cut").unwrap();
    let failed = said(&d_words, "decode");
    assert!(failed.starts_with("2 failed"), "{failed}");
    eprintln!("{failed}");
    Net::link(true);
    writeln!(d_in, "up").unwrap();
    assert_eq!(said(&d_words, "decode"), "3 received and verified");
    let status = children.0[1].wait().unwrap();
    assert!(status.success(), "decode child: {status}");
    drop(children);
    drop(net);
}

/// Stalls the second write job (request 2) before its flush, so it is in flight when the
/// link is cut.
#[derive(Debug, Default)]
struct StallSecond(AtomicUsize);

impl WriteHook for StallSecond {
    fn before_flush(&self, _: &RemoteRank, _: &ValidatedPlan) {
        if self.0.fetch_add(1, Ordering::SeqCst) == 1 {
            std::thread::sleep(Duration::from_secs(3));
        }
    }
}

fn spec(dev: &str) -> TransportSpec {
    let mut spec: TransportSpec = "tcp".parse().unwrap();
    spec.net_devices = Some(dev.to_string());
    spec
}

fn config(role: Role, engine: &Engine) -> AgentConfig {
    let name = if role == Role::Prefill {
        "prefill"
    } else {
        "decode"
    };
    let mut c = AgentConfig::new(name, role, engine.info.clone(), secret());
    c.timeout = Duration::from_secs(6);
    c.peer_timeout = Duration::from_secs(2);
    c
}

#[test]
fn child() {
    let Some(role) = std::env::var_os("KVFERRY_NS_CHILD") else {
        return;
    };
    let model = model();
    if role == "prefill" {
        let src = Engine::new("prefill", &model, pattern);
        let mut c = config(Role::Prefill, &src);
        c.transport = spec(DEV[0]);
        c.listen = format!("{}:0", ADDR[0]);
        c.harness.hook = Some(Arc::new(StallSecond::default()));
        // SAFETY: `src` outlives the agent (both live until this process ends).
        let agent = unsafe { Agent::start(c, bound()) }.unwrap();
        println!("KVF endpoint {}", agent.endpoint().unwrap());
        for request in 1..=3 {
            agent
                .send(whole(request, tables(&src, &SLOTS), PROMPT))
                .unwrap();
        }
        // Serve until the parent closes our input.
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        return;
    }
    let mut dst = Engine::new("decode", &model, |_, _| CANARY);
    let src = Engine::new("prefill", &model, pattern);
    let mut c = config(Role::Decode, &dst);
    c.transport = spec(DEV[1]);
    // SAFETY: `dst` outlives the agent; its bytes are read only after terminal events.
    let agent = unsafe { Agent::start(c, bound()) }.unwrap();
    let mut stdin = std::io::stdin().lock();
    let mut endpoint = String::new();
    stdin.read_line(&mut endpoint).unwrap();
    let dst_tables = tables(&dst, &DST);
    let expect = |request| expecting(request, endpoint.trim(), dst_tables.clone(), PROMPT);
    agent.expect(expect(1)).unwrap();
    let got = wait(&agent, 1, Duration::from_secs(20));
    assert!(matches!(got, Event::Received { .. }), "{got:?}");
    check(&src, &dst, &SLOTS, &DST, None);
    println!("KVF 1 received and verified");
    // Fresh canaries, so request 3's check sees only its own writes.
    for p in 0..dst.buffers.len() {
        dst.bytes_mut(p).fill(CANARY);
    }
    agent.expect(expect(2)).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    println!("KVF 2 in flight");
    let mut line = String::new();
    stdin.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "cut");
    match wait(&agent, 2, Duration::from_secs(20)) {
        Event::Failed {
            kind, peer, detail, ..
        } => {
            assert!(
                matches!(kind, FailureKind::Peer | FailureKind::Timeout),
                "{kind}: {detail}"
            );
            assert!(peer.is_some_and(|p| p.contains("prefill")), "{detail}");
            assert!(detail.contains("prefill rank 0"), "{detail}");
            println!("KVF 2 failed ({kind}): {detail}");
        }
        other => panic!("request 2 across a cut link: {other:?}"),
    }
    line.clear();
    stdin.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "up");
    for p in 0..dst.buffers.len() {
        dst.bytes_mut(p).fill(CANARY);
    }
    agent.expect(expect(3)).unwrap();
    let got = wait(&agent, 3, Duration::from_secs(20));
    assert!(matches!(got, Event::Received { .. }), "{got:?}");
    check(&src, &dst, &SLOTS, &DST, None);
    println!("KVF 3 received and verified");
}
