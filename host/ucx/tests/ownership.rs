//! Ownership without lifetimes: an endpoint holds its worker, a remote key its endpoint, and
//! requests and windows what their operations use, so each may outlive the values it was made
//! from, and UCX's destruction order (key, then endpoint, then worker) holds whatever order the
//! values are dropped in.
//!
//! `Worker::into_send` succeeds only on the last handle on a UCX worker, which makes it the
//! observable proof that every endpoint, key and request made from a worker is gone.

use crate::common;

use std::time::Duration;

use common::{DEADLINE, Progressor, Transport, pattern};
use kvferry_ucx::{MemRegion, Op, PutWindow, Status, Worker};

const LEN: usize = 1 << 20;
const FRAG: usize = 64 << 10;

/// A target worker progressed by its own thread, with an allocated region to put into.
struct Target {
    region: MemRegion,
    address: Vec<u8>,
    packed: Vec<u8>,
    progressor: Progressor,
}

impl Target {
    fn new(transport: Transport) -> Target {
        let ctx = transport.context();
        let worker = Worker::new(&ctx).unwrap();
        let region = MemRegion::allocate(&ctx, LEN).unwrap();
        let (address, packed) = (
            worker.address().unwrap(),
            region.pack_rkey().unwrap().into_bytes(),
        );
        Target {
            region,
            address,
            packed,
            progressor: Progressor::spawn(worker),
        }
    }

    fn base(&self) -> u64 {
        self.region.remote_addr()
    }

    /// Stops progressing; returns the region's bytes.
    fn finish(self) -> Vec<u8> {
        drop(self.progressor.stop());
        let mut got = vec![0; LEN];
        self.region.read_at(0, &mut got);
        got
    }
}

/// The `Worker` value is dropped first: its endpoint and remote key keep the UCX worker alive,
/// progress it (`ep.worker()` and the window's waits), put and flush, and every byte lands.
fn endpoint_and_key_outlive_their_worker(transport: Transport) {
    let target = Target::new(transport);
    let ctx = transport.context();
    let worker = Worker::new(&ctx).unwrap();
    let ep = worker.connect(&target.address).unwrap();
    let rkey = ep.unpack_rkey(&target.packed).unwrap();
    drop(worker);

    // The worker is still usable through the endpoint's handle on it.
    assert!(!ep.worker().address().unwrap().is_empty());
    ep.flush().unwrap().wait().unwrap(); // wire-up

    let src = pattern(LEN, 0x4D);
    let mut window = PutWindow::new(&ep);
    window.set_deadline(Some(std::time::Instant::now() + DEADLINE));
    for (i, chunk) in src.chunks(FRAG).enumerate() {
        window
            .put(chunk, target.base() + (i * FRAG) as u64, &rkey)
            .unwrap();
    }
    window.finish().unwrap();

    // Key, then endpoint (closed while the target still progresses), then the UCX worker.
    drop(rkey);
    ep.close(Duration::from_secs(5)).unwrap();
    assert!(
        target.finish() == src,
        "target bytes differ from what was put"
    );
}

#[test]
fn endpoint_and_key_outlive_their_worker_shm() {
    endpoint_and_key_outlive_their_worker(Transport::Shm);
}

#[test]
fn endpoint_and_key_outlive_their_worker_tcp() {
    endpoint_and_key_outlive_their_worker(Transport::Tcp);
}

/// A window with puts in flight outlives the worker, endpoint and key values: it holds what
/// its puts use, finishes them, and its drop releases the last handles (closing the endpoint).
#[test]
fn window_outlives_worker_endpoint_and_key_tcp() {
    let target = Target::new(Transport::Tcp);
    let ctx = Transport::Tcp.context();
    let worker = Worker::new(&ctx).unwrap();
    let ep = worker.connect(&target.address).unwrap();
    let rkey = ep.unpack_rkey(&target.packed).unwrap();
    ep.flush().unwrap().wait().unwrap();

    let src = pattern(LEN, 0x1F);
    let mut window = PutWindow::with_capacity(&ep, 8);
    window.set_deadline(Some(std::time::Instant::now() + DEADLINE));
    for (i, chunk) in src.chunks(FRAG).enumerate() {
        window
            .put(chunk, target.base() + (i * FRAG) as u64, &rkey)
            .unwrap();
    }
    // Only the window is left holding the UCX objects.
    drop(rkey);
    drop(ep);
    drop(worker);
    window.flush().unwrap();
    assert!(window.is_settled());
    drop(window);

    assert!(
        target.finish() == src,
        "target bytes differ from what was put"
    );
}

/// While an endpoint, a remote key or a request made from a worker exists, the worker cannot
/// move to another thread (they share it and stay on this one), and closing the endpoint only
/// releases the caller's handle; once they are all gone the worker moves.
#[test]
fn handles_pin_the_worker_until_they_are_gone_shm() {
    let target = Target::new(Transport::Shm);
    let ctx = Transport::Shm.context();
    let worker = Worker::new(&ctx).unwrap();

    let ep = worker.connect(&target.address).unwrap();
    let worker = worker
        .into_send()
        .expect_err("an endpoint shares the worker");

    let rkey = ep.unpack_rkey(&target.packed).unwrap();
    let src = pattern(64, 0x33);
    let put = ep.put(&src, target.base(), &rkey).unwrap();
    let err = ep.close(Duration::from_secs(5)).unwrap_err();
    assert_eq!((err.op(), err.status()), (Op::EpClose, Status::BUSY));
    let worker = worker
        .into_send()
        .expect_err("the remote key and the request keep the endpoint, and so the worker");

    drop(rkey);
    let worker = worker
        .into_send()
        .expect_err("the request keeps the endpoint and its key");
    put.wait().unwrap(); // the last handle: closes the endpoint

    let moved = worker.into_send().expect("no handle is left");
    let worker = std::thread::spawn(move || {
        let worker = moved.into_worker();
        worker.progress();
        worker.into_send().unwrap()
    })
    .join()
    .unwrap()
    .into_worker();
    drop(worker);

    let mut got = vec![0; 64];
    target.region.read_at(0, &mut got);
    assert_eq!(got, src);
    target.finish();
}

/// Connecting to a peer and forgetting it, many times over, leaves no handle on the worker
/// behind: each endpoint is closed as soon as its key and value are dropped, not parked until
/// the worker goes, so the worker can still move afterwards. (Open descriptors are no measure
/// in one process: the peer keeps the endpoint its wire-up created back to us until the peer
/// worker is destroyed, with or without our close.)
#[test]
fn connecting_and_forgetting_a_peer_leaves_no_handle_tcp() {
    const ROUNDS: usize = 50;
    let target = Target::new(Transport::Tcp);
    let ctx = Transport::Tcp.context();
    let worker = Worker::new(&ctx).unwrap();

    for round in 0..ROUNDS {
        let ep = worker.connect(&target.address).unwrap();
        let rkey = ep.unpack_rkey(&target.packed).unwrap();
        let src = pattern(FRAG, round as u8);
        let mut window = PutWindow::new(&ep);
        window.set_deadline(Some(std::time::Instant::now() + DEADLINE));
        window.put(&src, target.base(), &rkey).unwrap();
        window.finish().unwrap();
        let mut got = vec![0; FRAG];
        target.region.read_at(0, &mut got);
        assert!(got == src, "round {round}: bytes differ");
        // Forget the peer: drop its key and endpoint (closed while it progresses).
        drop(rkey);
        drop(ep);
    }

    let worker = worker
        .into_send()
        .expect("every endpoint and key is gone")
        .into_worker();
    drop(worker);
    target.finish();
}
