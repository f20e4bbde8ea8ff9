//! A receiver that dies fails its sender's jobs through UCX: over `tcp` with
//! `ucx_peer_errors` the sender's endpoints are in UCX's peer-failure mode
//! (`TransportSpec::error_mode`), so a job to a dead receiver
//! fails with `WriteError::PeerFailed` (naming the rank and UCX's status) instead of waiting
//! for its deadline, while the side channel still says the receiver is alive (`alive` stays
//! set throughout). Job timeouts are far longer than any wait here, so the error kind alone
//! shows that UCX, not the deadline, ended the job; the waits are bounded only so that a
//! regression fails instead of hanging.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, atomic::AtomicBool};
use std::time::Duration;

use kvferry_plan::{ValidatedPlan, error_chain, validate};
use kvferry_planner_abi::ffi::RVec;
use kvferry_planner_abi::{GroupKind, LayerGroupRows, TransferPlan, ViewId};
use kvferry_protocol::PoolKey;
use kvferry_transfer::harness::memory::{PoolAllocator, RankPools};
use kvferry_transfer::harness::rank::{
    RankThread, RemoteRank, WriteError, WriteHook, WriteJob, WriteStats,
};
use kvferry_transfer::{Transport, TransportSpec};
use kvferry_ucx::{Context, ErrorMode, Status, Worker};

const POOL: u64 = 4 << 20;
/// Bounds every wait for a report (a hang guard, never the point of a test).
const WAIT: Duration = Duration::from_secs(60);
/// Far longer than `WAIT`: a job that ends before `WAIT` did not end at its deadline.
const JOB_TIMEOUT: Duration = Duration::from_secs(600);

/// A rank of one pool; `thread` is `None` for a receiver nobody progresses.
struct Rank {
    thread: Option<RankThread>,
    worker_address: Vec<u8>,
    /// A worker that is never progressed (with `thread` `None`).
    _idle: Option<Worker>,
    _pools: Arc<RankPools>,
    keys: Vec<PoolKey>,
    _ctx: Arc<Context>,
}

fn pools(ctx: &Arc<Context>) -> (Arc<RankPools>, Vec<PoolKey>) {
    let mut allocator = PoolAllocator::with_host_budget(ctx, None);
    allocator.alloc(0, 0, POOL);
    let pools = allocator.finish(1).expect("pool").remove(0);
    let keys = pools.keys().expect("keys");
    (Arc::new(pools), keys)
}

/// A tcp rank with its thread, its endpoints in the mode the tcp preset asks for.
fn rank(label: &str) -> Rank {
    let spec = TransportSpec {
        ucx_peer_errors: true,
        ..Transport::Tcp.into()
    };
    assert_eq!(spec.error_mode(), ErrorMode::Peer);
    let ctx = spec.context_for(Default::default()).expect("UCX context");
    let (pools, keys) = pools(&ctx);
    let worker = Worker::new(&ctx).expect("worker");
    let thread = RankThread::spawn(label, 0, worker, Arc::clone(&pools), spec.error_mode())
        .expect("rank thread");
    Rank {
        worker_address: thread.address().to_vec(),
        thread: Some(thread),
        _idle: None,
        _pools: pools,
        keys,
        _ctx: ctx,
    }
}

/// A tcp receiver whose worker nobody progresses: a hung peer.
fn hung_receiver() -> Rank {
    let ctx = Transport::Tcp.context().expect("UCX context");
    let (pools, keys) = pools(&ctx);
    let worker = Worker::new(&ctx).expect("worker");
    Rank {
        worker_address: worker.address().expect("address"),
        thread: None,
        _idle: Some(worker),
        _pools: pools,
        keys,
        _ctx: ctx,
    }
}

fn remote(receiver: &Rank, peer: u64) -> Arc<RemoteRank> {
    Arc::new(RemoteRank {
        peer,
        instance: "decode".into(),
        rank: 0,
        worker_address: receiver.worker_address.clone(),
        pools: receiver.keys.clone(),
        alive: Arc::new(AtomicBool::new(true)),
        bounce: None,
    })
}

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

/// The sender's whole pool onto the receiver's (split into 1 MiB puts).
fn plan(sender: &Rank, receiver: &Rank) -> Arc<ValidatedPlan> {
    let (src, dst) = (sender.keys[0].base, receiver.keys[0].base);
    let mut plan = TransferPlan::new();
    plan.push(src, dst, POOL);
    Arc::new(validate(plan, &[row(src, POOL)], &[row(dst, POOL)]).expect("valid plan"))
}

/// Queues one job; its outcome arrives on the returned channel.
fn start(
    sender: &Rank,
    dest: Arc<RemoteRank>,
    plan: Arc<ValidatedPlan>,
    timeout: Duration,
    hook: Option<Arc<dyn WriteHook>>,
) -> Receiver<Result<WriteStats, WriteError>> {
    let (tx, rx) = mpsc::channel();
    sender.thread.as_ref().unwrap().write(WriteJob {
        request: 1,
        dest,
        plan,
        timeout,
        hook,
        done: Box::new(move |result| {
            let _ = tx.send(result);
        }),
        release: None,
        bounce: None,
    });
    rx
}

fn write(
    sender: &Rank,
    dest: Arc<RemoteRank>,
    plan: Arc<ValidatedPlan>,
) -> Result<WriteStats, WriteError> {
    start(sender, dest, plan, JOB_TIMEOUT, None)
        .recv_timeout(WAIT)
        .expect("job reported")
}

/// The UCX status of a `PeerFailed` for rank 0 of `gen`; panics on any other outcome.
fn peer_failed(result: Result<WriteStats, WriteError>) -> Status {
    match result {
        Err(WriteError::PeerFailed {
            ref instance,
            rank: 0,
            status,
            ..
        }) if instance == "decode" => {
            let e = result.unwrap_err();
            eprintln!("{}", error_chain(&e));
            assert!(
                error_chain(&e).starts_with("decode rank 0 failed in UCX: "),
                "{}",
                error_chain(&e)
            );
            status
        }
        other => panic!("expected PeerFailed for decode rank 0, got {other:?}"),
    }
}

/// The receiver dies between two jobs: the sender's endpoint fails while its thread idles,
/// the next job fails with UCX's status without writing, the connection is dropped (the job
/// after it connects afresh and fails through UCX again), and a receiver registered anew is
/// written normally.
#[test]
fn a_job_to_a_receiver_that_died_fails_with_its_ucx_error_tcp() {
    let sender = rank("prefill");
    let receiver = rank("decode");
    let dest = remote(&receiver, 1);
    let stats = write(&sender, Arc::clone(&dest), plan(&sender, &receiver)).expect("first job");
    assert_eq!(stats.bytes, POOL);

    // The receiver dies: its thread ends, its worker is destroyed, its sockets close. The side
    // channel has not noticed (`alive` is still set).
    let plan_to_dead = plan(&sender, &receiver);
    drop(receiver);

    let status = peer_failed(write(&sender, Arc::clone(&dest), Arc::clone(&plan_to_dead)));
    assert!(status.code() < 0, "{status:?}");
    // The failed connection was dropped: the next job connects afresh to the dead address,
    // which UCX 1.22 refuses at once over tcp (`Connect`, unreachable); either way no
    // deadline.
    let again = write(&sender, dest, plan_to_dead);
    match again {
        Err(WriteError::PeerFailed { .. } | WriteError::Connect { .. }) => {}
        other => panic!("expected PeerFailed or Connect, got {other:?}"),
    }

    let restarted = rank("decode");
    let stats = write(&sender, remote(&restarted, 2), plan(&sender, &restarted))
        .expect("a receiver registered anew is written");
    assert_eq!(stats.bytes, POOL);
}

/// Before its flush, the job waits until the test has killed the receiver.
#[derive(Debug)]
struct KillBeforeFlush {
    ready: Mutex<Sender<()>>,
    killed: Mutex<Receiver<()>>,
}

impl WriteHook for KillBeforeFlush {
    fn before_flush(&self, _dest: &RemoteRank, _plan: &ValidatedPlan) {
        let _ = self.ready.lock().unwrap().send(());
        let _ = self.killed.lock().unwrap().recv_timeout(WAIT);
    }
}

/// The receiver dies while the job is in flight (after its puts, before its flush): the job
/// fails through UCX.
#[test]
fn a_receiver_that_dies_mid_job_fails_the_job_through_ucx_tcp() {
    let sender = rank("prefill");
    let receiver = rank("decode");
    let (ready_tx, ready_rx) = mpsc::channel();
    let (killed_tx, killed_rx) = mpsc::channel();
    let hook = Arc::new(KillBeforeFlush {
        ready: Mutex::new(ready_tx),
        killed: Mutex::new(killed_rx),
    });
    let outcome = start(
        &sender,
        remote(&receiver, 1),
        plan(&sender, &receiver),
        JOB_TIMEOUT,
        Some(hook),
    );
    ready_rx
        .recv_timeout(WAIT)
        .expect("the job reached its flush");
    drop(receiver);
    killed_tx.send(()).unwrap();
    peer_failed(outcome.recv_timeout(WAIT).expect("job reported"));
}

/// A job to a receiver that hangs gives up at its deadline with its puts quarantined; they
/// can never finish while the receiver hangs, so the job is not reported. Once the receiver
/// dies, UCX fails them, the quarantine drains, and the job is reported (with its timeout),
/// then the job refused behind it; the next job finds the endpoint failed.
#[test]
fn a_quarantined_window_drains_once_its_receiver_dies_tcp() {
    let sender = rank("prefill");
    let receiver = hung_receiver();
    let dest = remote(&receiver, 1);
    let to_hung = plan(&sender, &receiver);
    let outcome = start(
        &sender,
        Arc::clone(&dest),
        Arc::clone(&to_hung),
        Duration::from_millis(300),
        None,
    );
    let behind = start(
        &sender,
        Arc::clone(&dest),
        Arc::clone(&to_hung),
        JOB_TIMEOUT,
        None,
    );
    // Jobs run in order: once a job to a live receiver is done, the two above have run.
    let live = rank("decode");
    write(&sender, remote(&live, 2), plan(&sender, &live)).expect("a live receiver is written");
    assert!(
        outcome.try_recv().is_err() && behind.try_recv().is_err(),
        "a quarantined job (and one behind it) is not reported while its puts may land"
    );

    drop(receiver);
    match outcome.recv_timeout(WAIT).expect("the quarantine drained") {
        Err(WriteError::TimedOut { in_flight, .. }) => assert!(in_flight > 0),
        other => panic!("expected the job's timeout, got {other:?}"),
    }
    match behind
        .recv_timeout(WAIT)
        .expect("reported after the quarantined job")
    {
        Err(WriteError::Stuck { .. }) => {}
        other => panic!("expected Stuck, got {other:?}"),
    }
    // The next job finds the endpoint failed — or, when the window sat stalled for
    // `ExecConfig::stall_limit` before the receiver died (a loaded machine: seen once in CI), the
    // registration given up. Either way nothing is written.
    match write(&sender, dest, to_hung) {
        Err(WriteError::PeerGone {
            ref instance,
            rank: 0,
        }) if instance == "decode" => {}
        result => {
            peer_failed(result);
        }
    }
}
