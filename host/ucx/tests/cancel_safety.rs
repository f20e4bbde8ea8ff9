//! Dropping in-flight puts must not return before UCX is done with their source memory.
//!
//! Over tcp, UCX emulates puts with active messages and queues them when the socket is full,
//! reading the source bytes only when it gets to send them. So if dropping a request (or a
//! window of them) returned while UCX still held it, UCX would later send whatever the source
//! holds by then. Each test therefore drops mid-flight, immediately overwrites the source with
//! the bitwise complement, flushes, and checks that not one byte of the complement reached the
//! target: every target byte is either the original pattern (the put finished before the drop
//! returned) or still zero (it was cancelled). The target is progressed by its own thread, as a
//! real peer would be, but paused while the puts are posted: a fast peer could otherwise drain
//! every put before the drop (CI saw exactly that), and the test would prove nothing.

use crate::common;

use common::{Progressor, Transport, pattern};
use kvferry_ucx::{MemRegion, PutWindow, Worker};

const LEN: usize = 8 << 20;

/// Checks the target after the source was complemented: no complement byte may appear.
/// Returns how many bytes hold the original pattern.
fn assert_no_late_reads(target: &MemRegion, original: &[u8]) -> usize {
    let mut got = vec![0; target.len()];
    target.read_at(0, &mut got);
    let mut delivered = 0;
    for (i, (&byte, &sent)) in got.iter().zip(original).enumerate() {
        assert!(
            byte == sent || byte == 0,
            "byte {i} is {byte:#04x}: UCX read the source after the drop returned \
             (sent {sent:#04x}, complement {:#04x})",
            !sent
        );
        delivered += usize::from(byte == sent);
    }
    delivered
}

#[test]
fn dropping_a_window_waits_for_every_put() {
    const FRAG: usize = 16 << 10;
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
    ep.flush().unwrap().wait().unwrap(); // wire-up

    let original = pattern(LEN, 0x6B);
    let mut src = original.clone();
    let mut window = PutWindow::with_capacity(&ep, 4 * LEN / FRAG);
    // A stalled target stops reading its socket; repeat the whole transfer until puts are
    // queued (the kernel buffers may swallow a pass).
    progressor.pause();
    for _ in 0..4 {
        for (i, fragment) in src.chunks(FRAG).enumerate() {
            window
                .put(fragment, base + (i * FRAG) as u64, &rkey)
                .unwrap();
        }
        if window.in_flight() > 0 {
            break;
        }
    }
    let in_flight = window.in_flight();
    assert!(
        in_flight > 0,
        "every put finished at once although the target was stalled"
    );
    // Nothing progresses the sender between here and the drop, so the puts stay in flight;
    // the target must progress again or the drop could never finish waiting.
    progressor.resume();
    drop(window);

    // The window's borrow of `src` has ended, so this compiles; at run time it is safe only
    // because the drop above waited.
    src.iter_mut().for_each(|byte| *byte = !*byte);
    ep.flush().unwrap().wait().unwrap();
    drop(rkey);
    drop(ep);
    let _b = progressor.stop();

    let delivered = assert_no_late_reads(&target, &original);
    eprintln!("{in_flight} puts in flight at drop; {delivered} of {LEN} bytes delivered");
}

#[test]
fn dropping_requests_waits_and_releases_their_region() {
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
    ep.flush().unwrap().wait().unwrap(); // wire-up

    let original = pattern(LEN, 0x2D);
    let mut source = MemRegion::allocate(&ctx, LEN).unwrap();
    source.write_at(0, &original);
    // Repeat the put against a stalled target until one is queued (the kernel may take
    // 8 MiB at once); the last request is then in flight when they are all dropped.
    progressor.pause();
    let mut requests = Vec::new();
    while requests.len() < 16 {
        let mut request = ep.put_region(&source, 0, LEN, base, &rkey).unwrap();
        let in_flight = !request.is_done();
        requests.push(request);
        if in_flight {
            break;
        }
    }
    assert!(
        !requests.last_mut().unwrap().is_done(),
        "16 puts of 8 MiB over tcp finished at once although the target was stalled"
    );
    progressor.resume();
    drop(requests);

    // `write_at` needs `&mut source`, impossible while the request borrowed it; the drop must
    // also have waited for UCX to stop reading it.
    let complement: Vec<u8> = original.iter().map(|byte| !byte).collect();
    source.write_at(0, &complement);
    ep.flush().unwrap().wait().unwrap();
    drop(rkey);
    drop(ep);
    let _b = progressor.stop();

    assert_no_late_reads(&target, &original);
}
