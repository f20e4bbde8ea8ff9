//! A worker that sleeps on its wake-up descriptor (`ucp_worker_arm`, then `poll` on
//! `ucp_worker_get_efd`) is woken by an active message arriving, over shared memory and tcp:
//! how an idle rank thread sleeps instead of spinning; and a flush waiting on a stalled
//! target naps on that descriptor (`Worker::progress_or_nap`) instead of spinning.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::Duration;

use common::{DEADLINE, Transport, drive, pattern};
use kvferry_platform::wait_readable;
use kvferry_ucx::Worker;

const ID: u16 = 9;

fn woken_by_a_message(transport: Transport) {
    let ctx = transport.context();
    let (address_tx, address_rx) = mpsc::channel();
    let (asleep_tx, asleep_rx) = mpsc::channel();
    let (got_tx, got_rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = Arc::clone(&stop);
    let receiver_ctx = Arc::clone(&ctx);
    let receiver = thread::spawn(move || {
        let worker = Worker::new(&receiver_ctx).unwrap();
        let (tx, inbox) = mpsc::channel();
        worker
            .set_am_handler(ID, move |_, data| tx.send(data.to_vec()).unwrap())
            .unwrap();
        address_tx.send(worker.address().unwrap()).unwrap();
        let efd = worker.event_fd().unwrap();
        // (message, sleeps before it came, whether the sleep it came in woke on the descriptor)
        let (mut sleeps, mut woke) = (0u32, false);
        while !stopping.load(Ordering::Acquire) {
            while worker.progress() {}
            if let Ok(message) = inbox.try_recv() {
                got_tx.send((message, sleeps, woke)).unwrap();
            }
            if !worker.arm().unwrap() {
                continue;
            }
            if sleeps == 0 {
                asleep_tx.send(()).unwrap();
            }
            sleeps += 1;
            woke = wait_readable(efd, Duration::from_millis(100)).unwrap();
        }
    });
    let sender = Worker::new(&ctx).unwrap();
    let address = address_rx.recv().unwrap();
    // Sent only once the receiver sleeps on its descriptor with nothing to progress.
    asleep_rx.recv_timeout(DEADLINE).unwrap();
    thread::sleep(Duration::from_millis(20));
    let ep = sender.connect(&address).unwrap();
    let payload = pattern(64 << 10, 0x3c);
    let send = ep.am_send_with(ID, b"", &payload, kvferry_ucx::AmProto::Auto);
    drive(send.unwrap(), &[&sender]).unwrap();
    let (message, sleeps, woke) = loop {
        sender.progress();
        match got_rx.try_recv() {
            Ok(got) => break got,
            Err(mpsc::TryRecvError::Empty) => {}
            Err(e) => panic!("receiver ended: {e}"),
        }
    };
    assert!(
        message == payload,
        "payload differs ({} bytes)",
        message.len()
    );
    assert!(sleeps >= 1, "the receiver never slept before the message");
    assert!(
        woke,
        "the message came without its descriptor waking the receiver"
    );
    // Its close needs the receiver's progress over tcp: the receiver still runs.
    ep.close(DEADLINE).unwrap();
    stop.store(true, Ordering::Release);
    receiver.join().expect("receiver panicked");
}

#[test]
fn shm_message_wakes_a_sleeping_worker() {
    woken_by_a_message(Transport::Shm);
}

#[test]
fn tcp_message_wakes_a_sleeping_worker() {
    woken_by_a_message(Transport::Tcp);
}

/// CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec; the clock id is a constant libc defines.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// A flush over tcp whose target does not progress waits for it asleep on the worker's
/// descriptor (`Worker::progress_or_nap`): its thread uses a small share of one core while
/// it waits, instead of all of it, and the flush still finishes, every byte in place, as
/// soon as the target progresses again.
#[test]
fn a_flush_waiting_on_its_target_naps_until_it_answers_tcp() {
    const LEN: usize = 64 << 10;
    const STALL: Duration = Duration::from_millis(400);
    let ctx = Transport::Tcp.context();
    let t = common::Target::start(&ctx, LEN);
    let sender = Worker::new(&ctx).unwrap();
    let (ep, rkey) = t.connect(&sender, kvferry_ucx::ErrorMode::None);
    let src = pattern(LEN, 0x5a);
    // The target stops reading its socket: the put's bytes wait in the kernel, and the flush
    // for its acknowledgement.
    t.progressor.pause();
    let mut window = kvferry_ucx::PutWindow::with_capacity(&ep, 4)
        .with_deadline(std::time::Instant::now() + DEADLINE);
    window.put(&src, t.base, &rkey).unwrap();
    let (cpu, wall) = thread::scope(|s| {
        s.spawn(|| {
            thread::sleep(STALL);
            t.progressor.resume();
        });
        let (cpu, wall) = (thread_cpu(), std::time::Instant::now());
        window.flush().unwrap();
        (thread_cpu() - cpu, wall.elapsed())
    });
    assert!(
        wall >= STALL / 2,
        "the flush finished in {wall:?}, before the target progressed"
    );
    assert!(
        cpu < wall / 4,
        "the waiting thread used {cpu:?} of CPU in {wall:?}: it spun instead of sleeping"
    );
    drop(window);
    drop(rkey);
    drop(ep);
    let common::Target {
        progressor, region, ..
    } = t;
    let _target = progressor.stop();
    let mut landed = vec![0; LEN];
    region.read_at(0, &mut landed);
    assert!(landed == src, "the put's bytes differ at the target");
}
