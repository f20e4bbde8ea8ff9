//! Rank threads without agents, for the tests of what a rank thread does with a peer's
//! declaration: a rank of one UCX-allocated pool with its thread, a peer rank as a sender sees
//! it, `vet`, and one-fragment write jobs.

use std::sync::mpsc;
use std::sync::{Arc, atomic::AtomicBool};
use std::time::Duration;

use kvferry_plan::{ValidatedPlan, validate};
use kvferry_planner_abi::ffi::RVec;
use kvferry_planner_abi::{GroupKind, LayerGroupRows, TransferPlan, ViewId};
use kvferry_protocol::PoolKey;
use kvferry_transfer::harness::memory::{PoolAllocator, RankPools};
use kvferry_transfer::harness::rank::{RankThread, RemoteRank, WriteError, WriteJob, WriteStats};
use kvferry_transfer::{Transport, TransportSpec};
use kvferry_ucx::{Context, Worker};

/// One pool per rank, a multiple of 2 MiB so its segment ends where the pool does whether or
/// not UCX backs it with huge pages.
pub const POOL: u64 = 2 << 20;
/// The longest a vet or a job may take before the test fails instead of hanging.
pub const WAIT: Duration = Duration::from_secs(20);

/// A rank of one pool with its thread: a receiver only progresses, a sender also writes.
pub struct Rank {
    pub thread: RankThread,
    pub pools: Arc<RankPools>,
    pub keys: Vec<PoolKey>,
    _ctx: Arc<Context>,
}

/// A rank over `transport`.
pub fn rank(label: &str, transport: Transport) -> Rank {
    rank_on(label, transport.context().expect("UCX context"), transport)
}

/// A rank on context `ctx` (its transports), in `transport`'s error mode.
pub fn rank_on(label: &str, ctx: Arc<Context>, transport: Transport) -> Rank {
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

/// `receiver` as a sender sees it: its worker (which it proves), declaring `pools`.
pub fn remote(receiver: &Rank, peer: u64, pools: Vec<PoolKey>) -> Arc<RemoteRank> {
    Arc::new(RemoteRank {
        peer,
        instance: "decode".into(),
        rank: 0,
        worker_address: receiver.thread.address().to_vec(),
        pools,
        alive: Arc::new(AtomicBool::new(true)),
        bounce: None,
    })
}

/// What `sender`'s thread says of `dest` when asked to vet it.
pub fn vet(sender: &Rank, dest: Arc<RemoteRank>) -> Result<(), WriteError> {
    let (tx, rx) = mpsc::channel();
    sender.thread.vet(
        dest,
        None,
        Box::new(move |result| {
            let _ = tx.send(result);
        }),
    );
    rx.recv_timeout(WAIT).expect("vet replied")
}

/// One row of `bytes` at `address`.
pub fn row(address: u64, bytes: u64) -> LayerGroupRows {
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

/// A plan of one fragment of `len` bytes from `src` to `dst`, each inside a row of a pool's
/// size.
pub fn one_fragment(src: u64, dst: u64, len: u64) -> ValidatedPlan {
    let mut plan = TransferPlan::new();
    plan.push(src, dst, len);
    validate(plan, &[row(src, POOL)], &[row(dst, POOL)]).expect("valid plan")
}

/// Runs one job of `plan` to `dest` on `sender`'s thread: its outcome, and whether its
/// release ran first.
pub fn write(
    sender: &Rank,
    dest: Arc<RemoteRank>,
    plan: ValidatedPlan,
) -> (Result<WriteStats, WriteError>, bool) {
    let (tx, rx) = mpsc::channel();
    let (released_tx, released_rx) = mpsc::channel();
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
        release: Some(Box::new(move || {
            let _ = released_tx.send(());
        })),
    });
    let result = rx.recv_timeout(WAIT).expect("job reported");
    (result, released_rx.try_recv().is_ok())
}
