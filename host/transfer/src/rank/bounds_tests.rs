//! The sender's own check of a bounced piece's place (behind the claim's check of the offer,
//! which keeps every honest job inside): the packed image must lie inside the arena the
//! receiver declared. At the exact edges: an image on the arena's first or last byte is put,
//! one byte before or past it is refused ([`WriteError::DestinationOutside`]) before any put.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use kvferry_planner_abi::ffi::RVec;
use kvferry_planner_abi::{GroupKind, LayerGroupRows, TransferPlan, ViewId};
use kvferry_protocol::PoolKey;
use kvferry_ucx::{Context, ErrorMode, Worker};

use super::{BounceJob, RankThread, RemoteRank, WriteError, WriteJob, WriteStats};
use crate::Transport;
use crate::bounce::{Copier, Staging};
use crate::memory::{PoolAllocator, RankPools};

/// One pool per rank (a multiple of 2 MiB, see `tests/key_range.rs`).
const POOL: u64 = 2 << 20;
/// The receiver declares `[AT, AT + ARENA)` of its pool as its arena, so a put that slipped a
/// byte past it still lands in memory its key maps (and the test sees it).
const AT: u64 = 8192;
const ARENA: u64 = 16384;
const CANARY: u8 = 0xA5;

struct Rank {
    thread: RankThread,
    pools: Arc<RankPools>,
    key: PoolKey,
    _ctx: Arc<Context>,
}

fn rank(label: &str, staging: bool) -> Rank {
    let ctx = Transport::Shm.context().expect("UCX context");
    let mut allocator = PoolAllocator::with_host_budget(&ctx, None);
    allocator.alloc(0, 0, POOL);
    let pools = allocator.finish(1).expect("pool").remove(0);
    let key = pools.keys().expect("keys").remove(0);
    let pools = Arc::new(pools);
    let worker = Worker::new(&ctx).expect("worker");
    // Halves smaller than the image, so it goes in several chunks.
    let staging = staging.then(|| Staging::new(&ctx, 4096, Copier::Host).expect("staging"));
    let thread = RankThread::spawn_bouncing(
        label,
        0,
        worker,
        Arc::clone(&pools),
        ErrorMode::None,
        staging,
        kvferry_protocol::exec::ExecConfig::default(),
    )
    .expect("rank thread");
    Rank {
        thread,
        pools,
        key,
        _ctx: ctx,
    }
}

fn fill(rank: &Rank, byte: impl Fn(usize) -> u8) {
    let bytes: Vec<u8> = (0..POOL as usize).map(byte).collect();
    // SAFETY: no job of this test is running, and no peer writes the pool meanwhile.
    unsafe { rank.pools.write(0, 0, &bytes) }.unwrap();
}

fn source_byte(i: usize) -> u8 {
    (i % 251) as u8 + 1
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

/// Bounces `len` bytes from the start of the sender's pool to `at` bytes into the
/// receiver's pool (where its arena is declared at [`AT`]).
fn bounce(
    sender: &Rank,
    dest: &Arc<RemoteRank>,
    at: u64,
    len: u64,
) -> Result<WriteStats, WriteError> {
    let (src, dst) = (sender.key.base, dest.pools[0].base);
    let mut plan = TransferPlan::new();
    plan.push(src, dst, len);
    let plan = kvferry_plan::validate(plan, &[row(src, len)], &[row(dst, len)]).unwrap();
    let job = BounceJob {
        remote_addr: dest.pools[0].base + at,
        gather: kvferry_plan::bounce::gather_list(&plan),
    };
    let (tx, rx) = mpsc::channel();
    sender.thread.write(WriteJob {
        request: 1,
        dest: Arc::clone(dest),
        plan: Arc::new(plan),
        timeout: Duration::from_secs(10),
        hook: None,
        done: Box::new(move |result| {
            let _ = tx.send(result);
        }),
        release: None,
        bounce: Some(job),
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("job reported")
}

/// The receiver holds the sender's first `len` bytes at `at` (if any) and its canary
/// everywhere else; the canary is restored after.
fn assert_only(receiver: &Rank, written: Option<(u64, u64)>) {
    let mut got = vec![0; POOL as usize];
    receiver.pools.read(0, 0, &mut got).unwrap();
    let mut want = vec![CANARY; POOL as usize];
    if let Some((at, len)) = written {
        for i in 0..len as usize {
            want[at as usize + i] = source_byte(i);
        }
    }
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "receiver byte {i} is {:#x}, expected {:#x} ({written:?})",
            got[i], want[i]
        );
    }
    fill(receiver, |_| CANARY);
}

#[test]
fn a_bounced_image_one_byte_outside_the_declared_arena_is_refused_before_any_put() {
    let receiver = rank("gen", false);
    let sender = rank("ctx", true);
    fill(&sender, source_byte);
    fill(&receiver, |_| CANARY);
    let real = receiver.key.clone();
    let dest = Arc::new(RemoteRank {
        peer: 1,
        instance: "gen".into(),
        rank: 0,
        worker_address: receiver.thread.address().to_vec(),
        pools: vec![real.clone()],
        alive: Arc::new(AtomicBool::new(true)),
        bounce: Some(PoolKey {
            base: real.base + AT,
            len: ARENA,
            rkey: real.rkey.clone(),
        }),
    });
    let end = AT + ARENA;

    // Just inside: the whole arena, and images on its first and last bytes.
    for (at, len) in [
        (AT, ARENA),
        (AT, 1),
        (end - 1, 1),
        (AT, 6000),
        (end - 6000, 6000),
    ] {
        let stats =
            bounce(&sender, &dest, at, len).unwrap_or_else(|e| panic!("{at} +{len}: {e:?}"));
        assert!(stats.bounced, "{at} +{len}: {stats:?}");
        assert_eq!(stats.bytes, len);
        assert_only(&receiver, Some((at, len)));
    }
    // One byte beyond: before, past the end, longer than the arena.
    for (at, len) in [
        (AT - 1, 1),
        (AT - 1, 6000),
        (end, 1),
        (end - 5999, 6000),
        (AT, ARENA + 1),
        (AT - 1, ARENA + 2),
    ] {
        match bounce(&sender, &dest, at, len) {
            Err(WriteError::DestinationOutside {
                fragment: 0,
                rank: 0,
                address,
                len: l,
                ..
            }) if (address, l) == (real.base + at, len) => {}
            other => panic!("{at} +{len}: expected DestinationOutside, got {other:?}"),
        }
        assert_only(&receiver, None);
    }
    // A receiver that declared no arena takes no image.
    let plain = Arc::new(RemoteRank {
        peer: 2,
        bounce: None,
        ..(*dest).clone()
    });
    assert!(matches!(
        bounce(&sender, &plain, AT, 1),
        Err(WriteError::DestinationOutside { .. })
    ));
    assert_only(&receiver, None);
}
