//! The rank thread's own range checks, behind plan validation, at their exact edges: a
//! fragment whose destination is not inside one pool the peer declared
//! ([`WriteError::DestinationOutside`]), or whose source is not inside one pool of this rank
//! ([`WriteError::SourceOutside`]), is refused before any put, for a job and for a replay;
//! a fragment on a pool's first or last byte is written. Plans here are validated against
//! rows wider than the pools, as a planner bug or a hostile description would have them.

use std::sync::mpsc;
use std::sync::{Arc, atomic::AtomicBool};
use std::time::Duration;

use kvferry_plan::{ValidatedPlan, validate};
use kvferry_planner_abi::ffi::RVec;
use kvferry_planner_abi::{GroupKind, LayerGroupRows, TransferPlan, ViewId};
use kvferry_protocol::PoolKey;
use kvferry_transfer::harness::memory::{PoolAllocator, RankPools};
use kvferry_transfer::harness::rank::{
    RankThread, RemoteRank, ReplayJob, ReplayStats, WriteError, WriteJob, WriteStats,
};
use kvferry_transfer::{Transport, TransportSpec};
use kvferry_ucx::{Context, Worker};

/// One pool per rank, a multiple of 2 MiB (see `key_range.rs`).
const POOL: u64 = 2 << 20;
const WAIT: Duration = Duration::from_secs(20);
/// The receiver declares two pools inside its real one, byte-adjacent: `[AT, AT + DECLARED)`
/// and `[AT + DECLARED, AT + 2 * DECLARED)` from its base, so a put that slipped a byte past
/// either still lands in memory its key maps (and the test sees it).
const AT: u64 = 4096;
const DECLARED: u64 = 8192;
const CANARY: u8 = 0xA5;

struct Rank {
    thread: RankThread,
    pools: Arc<RankPools>,
    keys: Vec<PoolKey>,
    _ctx: Arc<Context>,
}

fn rank(label: &str) -> Rank {
    let transport = Transport::Shm;
    let ctx = transport.context().expect("UCX context");
    let mut allocator = PoolAllocator::with_host_budget(&ctx, None);
    allocator.alloc(0, 0, POOL);
    let pools = allocator.finish(1).expect("pool").remove(0);
    let keys = pools.keys().expect("keys");
    let pools = Arc::new(pools);
    let worker = Worker::new(&ctx).expect("worker");
    let errors = TransportSpec::from(transport).error_mode();
    let thread =
        RankThread::spawn(label, 0, worker, Arc::clone(&pools), errors).expect("rank thread");
    Rank {
        thread,
        pools,
        keys,
        _ctx: ctx,
    }
}

/// The receiver as a sender sees it: its two declared pools (see [`AT`]), on its real key.
fn declared(receiver: &Rank, peer: u64) -> Arc<RemoteRank> {
    let real = &receiver.keys[0];
    let pool = |k: u64| PoolKey {
        base: real.base + AT + k * DECLARED,
        len: DECLARED,
        rkey: real.rkey.clone(),
    };
    Arc::new(RemoteRank {
        peer,
        instance: "gen".into(),
        rank: 0,
        worker_address: receiver.thread.address().to_vec(),
        pools: vec![pool(0), pool(1)],
        alive: Arc::new(AtomicBool::new(true)),
        bounce: None,
    })
}

/// One row of `bytes` at `address`.
fn row(address: u64, bytes: u64) -> LayerGroupRows {
    LayerGroupRows {
        view: ViewId { group: 0, view: 0 },
        kind: GroupKind::PAGED,
        ordinals: RVec::from(vec![0]),
        addresses: RVec::from(vec![address]),
        row_bytes: bytes,
        row_stride: bytes,
        span_start: 0,
        span_end: 1,
    }
}

/// `fragments` validated against one row on each side spanning them all, wider than any
/// pool: only the rank thread's checks stand between them and the peer.
fn plan(fragments: &[(u64, u64, u64)]) -> ValidatedPlan {
    let span = |pick: fn(&(u64, u64, u64)) -> u64| {
        let lo = fragments.iter().map(pick).min().unwrap();
        let hi = fragments.iter().map(|f| pick(f) + f.2).max().unwrap();
        row(lo, hi - lo)
    };
    let mut p = TransferPlan::new();
    for &(s, d, n) in fragments {
        p.push(s, d, n);
    }
    validate(p, &[span(|f| f.0)], &[span(|f| f.1)]).expect("valid against the wide rows")
}

fn write(
    sender: &Rank,
    dest: Arc<RemoteRank>,
    plan: ValidatedPlan,
) -> Result<WriteStats, WriteError> {
    let (tx, rx) = mpsc::channel();
    sender.thread.write(WriteJob {
        request: 1,
        dest,
        plan: Arc::new(plan),
        timeout: Duration::from_secs(10),
        hook: None,
        done: Box::new(move |result| {
            let _ = tx.send(result);
        }),
        bounce: None,
        release: None,
    });
    rx.recv_timeout(WAIT).expect("job reported")
}

fn replay(
    sender: &Rank,
    dest: Arc<RemoteRank>,
    plan: ValidatedPlan,
) -> Result<ReplayStats, WriteError> {
    let (tx, rx) = mpsc::channel();
    sender.thread.replay(ReplayJob {
        plans: vec![(dest, Arc::new(plan))],
        timeout: Duration::from_secs(10),
        done: Box::new(move |result| {
            let _ = tx.send(result);
        }),
        release: None,
    });
    rx.recv_timeout(WAIT).expect("replay reported")
}

/// The receiver's whole pool.
fn landed(receiver: &Rank) -> Vec<u8> {
    let mut bytes = vec![0; POOL as usize];
    receiver.pools.read(0, 0, &mut bytes).unwrap();
    bytes
}

fn fill(rank: &Rank, byte: impl Fn(usize) -> u8) {
    let bytes: Vec<u8> = (0..POOL as usize).map(byte).collect();
    // SAFETY: no job of this test is running, and no peer writes the pool meanwhile.
    unsafe { rank.pools.write(0, 0, &bytes) }.unwrap();
}

fn source_byte(i: usize) -> u8 {
    (i % 251) as u8 + 1
}

/// `at` bytes into the receiver's pool hold the sender's bytes from `src` for `len` bytes,
/// and every other byte its canary; the canary is restored after.
fn assert_only(receiver: &Rank, sender: &Rank, writes: &[(u64, u64, u64)]) {
    let got = landed(receiver);
    let mut want = vec![CANARY; POOL as usize];
    for &(src, at, len) in writes {
        let src = (src - sender.keys[0].base) as usize;
        let at = at as usize;
        for i in 0..len as usize {
            want[at + i] = source_byte(src + i);
        }
    }
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "receiver byte {i} is {:#x}, expected {:#x} (writes {writes:?})",
            got[i], want[i]
        );
    }
    fill(receiver, |_| CANARY);
}

fn assert_destination_outside(
    result: Result<impl std::fmt::Debug, WriteError>,
    fragment: usize,
    address: u64,
    len: u64,
) {
    match result {
        Err(WriteError::DestinationOutside {
            fragment: f,
            rank: 0,
            address: a,
            len: l,
            ..
        }) if (f, a, l) == (fragment, address, len) => {}
        other => panic!(
            "expected DestinationOutside for fragment {fragment} at {address:#x} +{len}, got \
             {other:?}"
        ),
    }
}

/// Destinations at each edge of the declared pools: on the first and the last byte of each
/// (written), one byte before the first, one past the last, across the boundary between the
/// two byte-adjacent pools (refused, nothing written); the refused fragment named by its
/// index in the plan.
#[test]
fn a_destination_one_byte_outside_a_declared_pool_is_refused_before_any_put() {
    let receiver = rank("gen");
    let sender = rank("ctx");
    fill(&sender, source_byte);
    fill(&receiver, |_| CANARY);
    let dest = declared(&receiver, 1);
    let (src, base) = (sender.keys[0].base, receiver.keys[0].base);
    // Offsets into the receiver's real pool.
    let (first, second, end) = (AT, AT + DECLARED, AT + 2 * DECLARED);

    // Just inside: whole pools, and single bytes and short runs on each edge.
    for (at, len) in [
        (first, DECLARED),
        (second, DECLARED),
        (first, 1),
        (second - 1, 1),
        (second, 1),
        (end - 1, 1),
        (first, 64),
        (second - 64, 64),
        (end - 64, 64),
    ] {
        let written = write(&sender, Arc::clone(&dest), plan(&[(src, base + at, len)]))
            .unwrap_or_else(|e| panic!("{at} +{len}: {e:?}"));
        assert_eq!((written.bytes, written.fragments), (len, 1));
        assert_only(&receiver, &sender, &[(src, at, len)]);
    }

    // One byte beyond.
    for (at, len) in [
        (first - 1, 1),
        (first - 1, 64),
        (first - 1, DECLARED),
        (second - 63, 64),
        (second - 1, 2),
        (first, DECLARED + 1),
        (end - 63, 64),
        (end, 1),
        (second, DECLARED + 1),
        (first, 2 * DECLARED),
    ] {
        let result = write(&sender, Arc::clone(&dest), plan(&[(src, base + at, len)]));
        assert_destination_outside(result, 0, base + at, len);
        assert_only(&receiver, &sender, &[]);
    }

    // The second fragment of a plan, one byte past the end: named as fragment 1.
    let two = plan(&[(src, base + first, 64), (src + 64, base + end - 63, 64)]);
    assert_destination_outside(
        write(&sender, Arc::clone(&dest), two),
        1,
        base + end - 63,
        64,
    );
    fill(&receiver, |_| CANARY);

    // A replay resolves every fragment before its first put: nothing lands.
    let r = replay(
        &sender,
        Arc::clone(&dest),
        plan(&[(src, base + first, 64), (src + 64, base + end - 63, 64)]),
    );
    assert_destination_outside(r, 1, base + end - 63, 64);
    assert_only(&receiver, &sender, &[]);
    let r = replay(
        &sender,
        Arc::clone(&dest),
        plan(&[(src, base + first - 1, 1)]),
    );
    assert_destination_outside(r, 0, base + first - 1, 1);
    let stats = replay(
        &sender,
        dest,
        plan(&[(src, base + first, 1), (src + 1, base + end - 1, 1)]),
    )
    .expect("a replay on both edges");
    assert_eq!(stats.written.bytes, 2);
    assert_only(
        &receiver,
        &sender,
        &[(src, first, 1), (src + 1, end - 1, 1)],
    );
}

/// Sources at each edge of this rank's pool: its first and last byte are read, one byte
/// before or past it is refused ([`WriteError::SourceOutside`]) before any put.
#[test]
fn a_source_one_byte_outside_this_ranks_pool_is_refused_before_any_put() {
    let receiver = rank("gen");
    let sender = rank("ctx");
    fill(&sender, source_byte);
    fill(&receiver, |_| CANARY);
    let dest = declared(&receiver, 1);
    let (src, base) = (sender.keys[0].base, receiver.keys[0].base);
    let to = base + AT;

    for (from, len) in [(0, 64), (POOL - 64, 64), (POOL - 1, 1)] {
        write(&sender, Arc::clone(&dest), plan(&[(src + from, to, len)]))
            .unwrap_or_else(|e| panic!("source {from} +{len}: {e:?}"));
        assert_only(&receiver, &sender, &[(src + from, AT, len)]);
    }
    for (from, len) in [(POOL - 63, 64), (POOL, 1)] {
        let result = write(&sender, Arc::clone(&dest), plan(&[(src + from, to, len)]));
        match result {
            Err(WriteError::SourceOutside {
                fragment: 0,
                rank: 0,
                address,
                len: l,
            }) if (address, l) == (src + from, len) => {}
            other => panic!("source {from} +{len}: expected SourceOutside, got {other:?}"),
        }
        assert_only(&receiver, &sender, &[]);
    }
    let result = write(&sender, dest, plan(&[(src - 1, to, 64)]));
    assert!(
        matches!(result, Err(WriteError::SourceOutside { fragment: 0, address, len: 64, .. }) if address == src - 1),
        "{result:?}"
    );
    assert_only(&receiver, &sender, &[]);
}
