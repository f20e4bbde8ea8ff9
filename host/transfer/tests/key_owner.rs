//! A peer may only have a rank write into memory of the process whose worker it declared:
//! over shared memory UCX copies into whatever segment a key names, so a holder of
//! the secret who proved its own worker and declared another process's pool key had a prefill
//! rank overwrite that process (35.8 MB, 4 runs of 4), and one that declared the prefill
//! rank's own key had it overwrite other requests' source slots. Both are refused at vet,
//! before any put, and nothing is written.

use crate::support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;

use kvferry_plan::error_chain;
use kvferry_protocol::PoolKey;
use kvferry_transfer::Transport;
use kvferry_transfer::harness::rank::WriteError;
use kvferry_ucx::{Context, MemRegion};

use support::ranks::{POOL, WAIT, one_fragment, rank, rank_on, remote, vet, write};

const VICTIM_BYTE: u8 = 0x5a;
const SOURCE_BYTE: u8 = 0xc3;

fn key_owner<T: std::fmt::Debug>(result: Result<T, WriteError>) -> String {
    match result {
        Err(e @ WriteError::KeyOwner { .. }) => error_chain(&e),
        other => panic!("expected a refused key owner, got {other:?}"),
    }
}

#[test]
fn a_peer_declaring_the_prefill_rank_s_own_key_is_refused_and_nothing_is_written() {
    let receiver = rank("decode", Transport::Shm);
    let sender = rank("prefill", Transport::Shm);
    // The sender's pool: half "sources" (SOURCE_BYTE), half other requests' slots (0).
    let half = (POOL / 2) as usize;
    // SAFETY: no job reads or writes the sender's pool yet.
    unsafe { sender.pools.write(0, 0, &vec![SOURCE_BYTE; half]) }.unwrap();
    // The receiver's worker, declaring the sender's own pool (its real key and range).
    let dest = remote(&receiver, 1, sender.keys.clone());
    let why = key_owner(vet(&sender, Arc::clone(&dest)));
    assert!(
        why.starts_with("decode rank 0 declares pool 0, but: its key maps this rank's own memory"),
        "{why}"
    );
    // A job to it, planned from the first half into the second: refused, nothing copied.
    let base = sender.keys[0].base;
    let job = one_fragment(base, base + half as u64, half as u64);
    let why = key_owner(write(&sender, dest, job).0);
    assert!(why.contains("this rank's own memory"), "{why}");
    let mut second = vec![1; half];
    sender.pools.read(0, half, &mut second).unwrap();
    assert!(
        second.iter().all(|&b| b == 0),
        "the sender's own slots were written"
    );

    // The receiver's own key through the same worker still vets (nothing else changed).
    vet(&sender, remote(&receiver, 2, receiver.keys.clone())).expect("its own key vets");
}

#[test]
fn a_peer_declaring_another_process_s_key_is_refused_and_nothing_lands_there() {
    // The victim's region in `sysv` (UCX tries it first), then in `posix`.
    for tls in ["posix,sysv,self", "posix,self"] {
        another_process_s_key(tls);
    }
}

fn another_process_s_key(tls: &str) {
    let mut victim = Victim::spawn(tls);
    // The declared worker numbers its memory domains as the victim does, so the sender's UCX
    // reads the key's entry as the victim's transport.
    let ctx = Context::builder().tls(tls).build().expect("context");
    let receiver = rank_on("decode", ctx, Transport::Shm);
    let sender = rank("prefill", Transport::Shm);
    // SAFETY: no job reads or writes the sender's pool yet.
    unsafe { sender.pools.write(0, 0, &vec![SOURCE_BYTE; POOL as usize]) }.unwrap();
    // The receiver proves its own worker (this process) and declares the victim's region.
    let dest = remote(&receiver, 1, vec![victim.key.clone()]);
    let why = key_owner(vet(&sender, Arc::clone(&dest)));
    let names = format!("names memory of process {}", victim.pid);
    assert!(
        why.contains(&names)
            && why.contains(&format!("its worker is process {}", std::process::id())),
        "{tls}: {why}"
    );
    let at = victim.key.base;
    let job = one_fragment(sender.keys[0].base, at, POOL);
    let why = key_owner(write(&sender, dest, job).0);
    assert!(why.contains(&names), "{why}");
    // The victim's memory is as it left it.
    assert_eq!(victim.changed(), 0, "bytes of the victim process changed");
}

/// A process of its own (this test binary, run on [`victim`]) that allocates a UCX
/// shared-memory region, fills it, and reports its key; on request it counts the bytes that
/// changed.
struct Victim {
    child: Child,
    words: mpsc::Receiver<String>,
    key: PoolKey,
    pid: u32,
}

impl Victim {
    fn spawn(tls: &str) -> Victim {
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args(["--exact", &support::test_named(module_path!(), "victim")])
            .args(["--nocapture", "--test-threads=1"])
            .env("KVFERRY_KEY_OWNER_VICTIM", tls)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, words) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines() {
                let Ok(line) = line else { return };
                if let Some(at) = line.find("KVF ") {
                    if tx.send(line[at + 4..].to_string()).is_err() {
                        return;
                    }
                }
            }
        });
        let said = words
            .recv_timeout(WAIT)
            .expect("the victim reports its key");
        let mut parts = said.split_whitespace();
        let mut next = || parts.next().expect("a key line").to_string();
        let (pid, base, len, rkey) = (next(), next(), next(), next());
        let rkey = (0..rkey.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&rkey[i..i + 2], 16).unwrap())
            .collect();
        Victim {
            child,
            words,
            key: PoolKey {
                base: base.parse().unwrap(),
                len: len.parse().unwrap(),
                rkey,
            },
            pid: pid.parse().unwrap(),
        }
    }

    /// Bytes of the victim's region that are no longer its fill.
    fn changed(&mut self) -> u64 {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "count").unwrap();
        let said = self.words.recv_timeout(WAIT).expect("the victim counts");
        said.strip_prefix("changed ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("the victim said {said:?}"))
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn victim() {
    let Ok(tls) = std::env::var("KVFERRY_KEY_OWNER_VICTIM") else {
        return;
    };
    let ctx = Context::builder().tls(tls).build().expect("UCX context");
    let mut region = MemRegion::allocate(&ctx, POOL as usize).expect("region");
    region.write_at(0, &vec![VICTIM_BYTE; POOL as usize]);
    let key: String = region
        .pack_rkey()
        .unwrap()
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!(
        "KVF {} {} {POOL} {key}",
        std::process::id(),
        region.remote_addr()
    );
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { return };
        if line.trim() == "count" {
            let mut now = vec![0; POOL as usize];
            region.read_at(0, &mut now);
            let changed = now.iter().filter(|&&b| b != VICTIM_BYTE).count();
            println!("KVF changed {changed}");
        }
    }
}
