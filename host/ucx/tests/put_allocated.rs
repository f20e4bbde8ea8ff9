//! Two workers in one process: puts into a UCX-allocated target region (the one-sided fast
//! path), checked byte for byte.

use crate::common;

use common::{Progressor, Transport, drive, pattern};
use kvferry_ucx::{MemRegion, PutWindow, Worker};

const LEN: usize = 1 << 20;

/// One plain put of the first half, one `put_region` of the second half from a UCX-allocated
/// source, a flush, then the bytes.
fn put_then_flush(transport: Transport) {
    let ctx_b = transport.context();
    let b = Worker::new(&ctx_b).unwrap();
    let target = MemRegion::allocate(&ctx_b, LEN).unwrap();
    assert!(target.is_allocated());
    let (address, packed, base) = (
        b.address().unwrap(),
        target.pack_rkey().unwrap(),
        target.remote_addr(),
    );

    let ctx_a = transport.context();
    let a = Worker::new(&ctx_a).unwrap();
    let ep = a.connect(&address).unwrap();
    let rkey = ep.unpack_rkey(packed.as_bytes()).unwrap();

    let expected = pattern(LEN, 0x11);
    let half = LEN / 2;
    drive(ep.put(&expected[..half], base, &rkey).unwrap(), &[&a, &b]).unwrap();

    let mut source = MemRegion::allocate(&ctx_a, LEN).unwrap();
    source.write_at(0, &expected);
    let request = ep
        .put_region(&source, half, LEN - half, base + half as u64, &rkey)
        .unwrap();
    drive(request, &[&a, &b]).unwrap();
    drive(ep.flush().unwrap(), &[&a, &b]).unwrap();

    let mut got = vec![0; LEN];
    target.read_at(0, &mut got);
    assert!(got == expected, "target bytes differ from what was put");
}

#[test]
fn put_shm() {
    put_then_flush(Transport::Shm);
}

#[test]
fn put_tcp() {
    put_then_flush(Transport::Tcp);
}

#[test]
fn put_env_transports() {
    put_then_flush(Transport::Env);
}

/// Thousands of small fragments, scattered (fragment `i` lands in slot `N - 1 - i`), through a
/// `PutWindow` that only progresses the initiator: over shared memory into UCX-allocated memory
/// the target does not need to progress once wire-up is done.
#[test]
fn window_scatters_fragments_without_target_progress_shm() {
    const FRAG: usize = 256;
    const N: usize = LEN / FRAG;
    let ctx = Transport::Shm.context();
    let b = Worker::new(&ctx).unwrap();
    let target = MemRegion::allocate(&ctx, LEN).unwrap();
    let a = Worker::new(&ctx).unwrap();
    let ep = a.connect(&b.address().unwrap()).unwrap();
    let rkey = ep
        .unpack_rkey(target.pack_rkey().unwrap().as_bytes())
        .unwrap();
    let base = target.remote_addr();
    // Wire-up needs both sides.
    drive(ep.flush().unwrap(), &[&a, &b]).unwrap();

    let src = pattern(LEN, 0x5A);
    let mut window = PutWindow::new(&ep);
    assert_eq!(window.capacity(), 32);
    for (i, fragment) in src.chunks(FRAG).enumerate() {
        window
            .put(fragment, base + ((N - 1 - i) * FRAG) as u64, &rkey)
            .unwrap();
        assert!(window.in_flight() <= window.capacity());
    }
    window.finish().unwrap();

    let mut got = vec![0; LEN];
    target.read_at(0, &mut got);
    for (i, fragment) in src.chunks(FRAG).enumerate() {
        let slot = N - 1 - i;
        assert_eq!(
            &got[slot * FRAG..(slot + 1) * FRAG],
            fragment,
            "fragment {i}"
        );
    }
}

/// The same over tcp, where every put is emulated and the target must progress: it gets its own
/// thread, as a real target process would have.
#[test]
fn window_over_tcp_with_a_progressing_target() {
    const FRAG: usize = 4096;
    let ctx = Transport::Tcp.context();
    let b = Worker::new(&ctx).unwrap();
    let target = MemRegion::allocate(&ctx, LEN).unwrap();
    let (address, packed, base) = (
        b.address().unwrap(),
        target.pack_rkey().unwrap(),
        target.remote_addr(),
    );
    let progressor = Progressor::spawn(b);

    let a = Worker::new(&ctx).unwrap();
    let ep = a.connect(&address).unwrap();
    let rkey = ep.unpack_rkey(packed.as_bytes()).unwrap();
    let src = pattern(LEN, 0x3C);
    let mut window = PutWindow::with_capacity(&ep, 8);
    for (i, fragment) in src.chunks(FRAG).enumerate() {
        window
            .put(fragment, base + (i * FRAG) as u64, &rkey)
            .unwrap();
    }
    window.finish().unwrap();
    drop(rkey);
    drop(ep);
    let _b = progressor.stop();

    let mut got = vec![0; LEN];
    target.read_at(0, &mut got);
    assert!(got == src, "target bytes differ from what was put");
}

#[test]
fn put_rejects_a_remote_key_of_another_endpoint_and_out_of_range_regions() {
    let ctx = Transport::Shm.context();
    let b = Worker::new(&ctx).unwrap();
    let target = MemRegion::allocate(&ctx, 64).unwrap();
    let a = Worker::new(&ctx).unwrap();
    let address = b.address().unwrap();
    let ep1 = a.connect(&address).unwrap();
    let ep2 = a.connect(&address).unwrap();
    let rkey1 = ep1
        .unpack_rkey(target.pack_rkey().unwrap().as_bytes())
        .unwrap();
    let err = ep2
        .put(&[1, 2, 3], target.remote_addr(), &rkey1)
        .unwrap_err();
    assert_eq!(err.status(), kvferry_ucx::Status::INVALID_PARAM);

    let source = MemRegion::allocate(&ctx, 16).unwrap();
    let err = ep1
        .put_region(&source, 8, 9, target.remote_addr(), &rkey1)
        .unwrap_err();
    assert_eq!(err.status(), kvferry_ucx::Status::INVALID_PARAM);
    drive(ep1.flush().unwrap(), &[&a, &b]).unwrap();
    drive(ep2.flush().unwrap(), &[&a, &b]).unwrap();
}
