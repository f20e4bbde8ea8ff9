//! Two workers in one process: puts into caller-owned (`register`ed) memory. UCX emulates these
//! puts with active messages on every transport, so the target worker must be progressed.

use crate::common;

use std::time::{Duration, Instant};

use common::{Transport, drive, pattern};
use kvferry_ucx::{MemRegion, Worker};

const LEN: usize = 1 << 20;

fn put_into_registered_vec(transport: Transport) {
    let ctx_b = transport.context();
    let b = Worker::new(&ctx_b).unwrap();
    let mut target = vec![0u8; LEN];
    // SAFETY: `target` is a live, initialised allocation of `LEN` bytes; it is neither touched
    // nor freed until after the region is dropped below.
    let region = unsafe { MemRegion::register(&ctx_b, target.as_mut_ptr(), LEN) }.unwrap();
    assert!(!region.is_allocated());
    assert_eq!(region.remote_addr(), target.as_ptr() as u64);

    let ctx_a = transport.context();
    let a = Worker::new(&ctx_a).unwrap();
    let ep = a.connect(&b.address().unwrap()).unwrap();
    let rkey = ep
        .unpack_rkey(region.pack_rkey().unwrap().as_bytes())
        .unwrap();

    let expected = pattern(LEN, 0x42);
    for (i, chunk) in expected.chunks(LEN / 4).enumerate() {
        let remote = region.remote_addr() + (i * LEN / 4) as u64;
        drive(ep.put(chunk, remote, &rkey).unwrap(), &[&a, &b]).unwrap();
    }
    drive(ep.flush().unwrap(), &[&a, &b]).unwrap();

    drop(rkey);
    drop(ep);
    drop(region);
    assert!(
        target == expected,
        "registered target differs from what was put"
    );
}

#[test]
fn put_shm() {
    put_into_registered_vec(Transport::Shm);
}

#[test]
fn put_tcp() {
    put_into_registered_vec(Transport::Tcp);
}

#[test]
fn put_env_transports() {
    put_into_registered_vec(Transport::Env);
}

/// platform-notes §4d as an executable statement: with registered target memory over tcp, a put
/// followed by a flush cannot complete while only the initiator progresses, and completes as
/// soon as the target progresses too.
#[test]
fn flush_waits_for_target_progress_tcp() {
    let ctx = Transport::Tcp.context();
    let b = Worker::new(&ctx).unwrap();
    let mut target = vec![0u8; 4096];
    // SAFETY: as in `put_into_registered_vec`: `target` outlives the region and is not used
    // until the region is gone.
    let region = unsafe { MemRegion::register(&ctx, target.as_mut_ptr(), target.len()) }.unwrap();
    let a = Worker::new(&ctx).unwrap();
    let ep = a.connect(&b.address().unwrap()).unwrap();
    let rkey = ep
        .unpack_rkey(region.pack_rkey().unwrap().as_bytes())
        .unwrap();
    // Finish wire-up with both sides progressing.
    drive(ep.flush().unwrap(), &[&a, &b]).unwrap();

    let src = pattern(4096, 0x77);
    let put = ep.put(&src, region.remote_addr(), &rkey).unwrap();
    let mut flush = ep.flush().unwrap();
    let until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < until {
        a.progress();
    }
    assert!(
        !flush.is_done(),
        "flush completed without the target progressing"
    );
    drive(flush, &[&a, &b]).unwrap();
    drive(put, &[&a, &b]).unwrap();

    drop(rkey);
    drop(ep);
    drop(region);
    assert!(target == src);
}
