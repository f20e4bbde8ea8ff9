//! Endpoints in `ErrorMode::Peer` over tcp: once the peer is gone, a put or flush to it
//! completes with an error instead of waiting for ever, and `Endpoint::failure` reports UCX's
//! status. The peer goes two ways: its worker destroyed in this process, or its process
//! killed with SIGKILL (this test binary re-executed as the peer, as garbage_address.rs
//! does). Waits are bounded only so that a regression fails instead of hanging.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use common::{Progressor, Transport, drive, pattern, progress_until};
use kvferry_ucx::{Endpoint, Error, ErrorMode, MemRegion, RemoteKey, Worker};

const LEN: usize = 1 << 20;
const CHILD: &str = "KVFERRY_PEER_FAILURE_TARGET";

/// A put of `src` and a flush, each driven to completion (or failure) on `worker`.
fn put_and_flush(
    worker: &Worker,
    ep: &Endpoint,
    rkey: &RemoteKey,
    src: &[u8],
    base: u64,
) -> Result<(), Error> {
    drive(ep.put(src, base, rkey)?, &[worker])?;
    drive(ep.flush()?, &[worker])
}

/// Writes to the dead peer until an operation fails (the first put may still be taken by the
/// socket), then waits for the error handler; returns the operation's error.
fn fails_once_gone(
    worker: &Worker,
    ep: &Endpoint,
    rkey: &RemoteKey,
    src: &[u8],
    base: u64,
) -> Error {
    let mut error = None;
    // Each round either fails or finishes; a peer that is gone cannot finish a flush, so the
    // second round at the latest fails (`drive` bounds each wait).
    for _ in 0..2 {
        if let Err(e) = put_and_flush(worker, ep, rkey, src, base) {
            error = Some(e);
            break;
        }
    }
    let error = error.expect("a flush to a dead peer completed");
    // The handler may run in a later progress round than the one that failed the request.
    progress_until(&[worker], || ep.failure().is_some());
    error
}

#[test]
fn a_destroyed_peer_worker_fails_puts_and_is_reported_tcp() {
    let (ctx_a, ctx_b) = (Transport::Tcp.context(), Transport::Tcp.context());
    let target = Worker::new(&ctx_b).unwrap();
    let region = MemRegion::allocate(&ctx_b, LEN).unwrap();
    let (address, packed, base) = (
        target.address().unwrap(),
        region.pack_rkey().unwrap(),
        region.remote_addr(),
    );
    let progressor = Progressor::spawn(target);

    let worker = Worker::new(&ctx_a).unwrap();
    let ep = worker.connect_with(&address, ErrorMode::Peer).unwrap();
    assert_eq!(ep.error_mode(), ErrorMode::Peer);
    let rkey = ep.unpack_rkey(packed.as_bytes()).unwrap();
    let src = pattern(LEN, 0x5A);
    put_and_flush(&worker, &ep, &rkey, &src, base).expect("write while the peer is alive");
    assert_eq!(ep.failure(), None);

    // The peer goes: its worker destroyed, its sockets closed.
    drop(progressor.stop());
    drop(region);
    drop(ctx_b);

    let error = fails_once_gone(&worker, &ep, &rkey, &src, base);
    let failure = ep.failure().unwrap();
    eprintln!(
        "operation: {error}: {}; handler: {failure:?}",
        error.status()
    );
    assert!(failure.code() < 0, "{failure:?}");
    // Later operations fail too, at once or when driven; nothing waits for the peer.
    assert!(put_and_flush(&worker, &ep, &rkey, &src, base).is_err());
    // Closing the failed endpoint finishes (flush fails, forced close).
    drop(rkey);
    let _ = ep.close(common::DEADLINE);
    drop(ctx_a);
}

/// The default mode reports nothing (UCX calls no handler), whatever happens to the peer.
#[test]
fn connect_keeps_error_mode_none() {
    let ctx = Transport::Tcp.context();
    let (a, b) = (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap());
    let ep = a.connect(&b.address().unwrap()).unwrap();
    assert_eq!(ep.error_mode(), ErrorMode::None);
    assert_eq!(ep.failure(), None);
    drive(ep.flush().unwrap(), &[&a, &b]).unwrap();
    assert_eq!(ep.failure(), None);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// In the child: a tcp target that prints its address, key and base, then progresses until
/// it is killed (or its stdin closes, so an aborted parent leaves no process behind).
#[test]
fn child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let ctx = Transport::Tcp.context();
    let worker = Worker::new(&ctx).unwrap();
    let region = MemRegion::allocate(&ctx, LEN).unwrap();
    println!(
        "target: {} {} {}",
        hex(&worker.address().unwrap()),
        hex(region.pack_rkey().unwrap().as_bytes()),
        region.remote_addr()
    );
    std::io::stdout().flush().unwrap();
    let closed = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&closed);
    thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        flag.store(true, Ordering::Release);
    });
    while !closed.load(Ordering::Acquire) {
        worker.progress();
    }
}

#[test]
fn a_killed_peer_process_fails_puts_and_is_reported_tcp() {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &common::test_named(module_path!(), "child")])
        .args(["--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdin = child.stdin.take();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines
        .find_map(|l| Some(l.ok()?.split_once("target: ")?.1.to_string()))
        .expect("the child printed its target");
    let mut fields = line.split(' ');
    let (address, packed) = (unhex(fields.next().unwrap()), unhex(fields.next().unwrap()));
    let base: u64 = fields.next().unwrap().parse().unwrap();

    let ctx = Transport::Tcp.context();
    let worker = Worker::new(&ctx).unwrap();
    let ep = worker.connect_with(&address, ErrorMode::Peer).unwrap();
    let rkey = ep.unpack_rkey(&packed).unwrap();
    let src = pattern(LEN, 0xA5);
    put_and_flush(&worker, &ep, &rkey, &src, base).expect("write while the peer is alive");
    assert_eq!(ep.failure(), None);

    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert!(!status.success());

    let error = fails_once_gone(&worker, &ep, &rkey, &src, base);
    let failure = ep.failure().unwrap();
    eprintln!(
        "operation: {error}: {}; handler: {failure:?}",
        error.status()
    );
    assert!(failure.code() < 0, "{failure:?}");
    drop(stdin);
}
