//! `PutWindow` deadlines: a window whose target stops progressing, or disappears, gives up at
//! its deadline with `TIMED_OUT` instead of waiting for ever, keeps what is still in flight
//! (and its borrows), and finishes normally once the target progresses again.
//!
//! Over tcp UCX emulates puts with active messages, so puts and flushes complete only while
//! the target worker progresses: stopping its progress thread is a receiver that hangs.

use crate::common;

use std::time::{Duration, Instant};

use common::{DEADLINE, Progressor, Target, Transport, pattern};
use kvferry_ucx::{ErrorMode, Op, PutWindow, Status, Worker};

const LEN: usize = 8 << 20;
const FRAG: usize = 16 << 10;
/// How long past its deadline a window may take to give up (progress rounds are short; the
/// margin absorbs a loaded 2-core machine).
const SLACK: Duration = Duration::from_secs(2);

fn is_timeout(e: &kvferry_ucx::Error) -> bool {
    e.status() == Status::TIMED_OUT && matches!(e.op(), Op::Put | Op::Flush)
}

/// The target stops progressing mid-window: the window times out within its deadline, keeps
/// its puts, and once the target progresses again the same window (with a later deadline)
/// issues the rest, flushes, and every byte arrives.
#[test]
fn window_times_out_while_the_target_hangs_then_recovers_tcp() {
    let ctx = Transport::Tcp.context();
    let t = Target::start(&ctx, LEN);

    let a = Worker::new(&ctx).unwrap();
    let (ep, rkey) = t.connect(&a, ErrorMode::None); // wired up while the target progresses
    let Target {
        progressor,
        region: target,
        base,
        ..
    } = t;

    // The target hangs from here on.
    let b = progressor.stop();

    let src = pattern(LEN, 0x3C);
    let fragments: Vec<(usize, &[u8])> = src.chunks(FRAG).enumerate().collect();
    let budget = Duration::from_millis(300);
    let started = Instant::now();
    let mut window = PutWindow::with_capacity(&ep, 32).with_deadline(started + budget);
    let mut next = 0;
    let error = loop {
        let Some(&(i, fragment)) = fragments.get(next) else {
            // Every put was issued (the socket took them all): the flush must time out.
            break window
                .flush()
                .expect_err("a flush cannot finish without the target");
        };
        match window.put(fragment, base + (i * FRAG) as u64, &rkey) {
            Ok(()) => next += 1,
            Err(e) => break e,
        }
    };
    let waited = started.elapsed();
    assert!(is_timeout(&error), "{error:?}");
    assert!(
        waited >= budget && waited < budget + SLACK,
        "gave up after {waited:?} with a {budget:?} deadline"
    );
    assert!(!window.is_idle(), "work must still be in flight");
    eprintln!(
        "timed out after {waited:?}: {next} of {} puts issued, {} in flight, {error:?}",
        fragments.len(),
        window.in_flight()
    );

    // Past the deadline nothing new is issued.
    let before = window.in_flight();
    let refused = window.put(fragments[0].1, base, &rkey).unwrap_err();
    assert!(is_timeout(&refused), "{refused:?}");
    assert!(window.in_flight() <= before);

    // The target comes back: the same window finishes the job.
    let progressor = Progressor::spawn(b);
    window.set_deadline(Some(Instant::now() + DEADLINE));
    for &(i, fragment) in &fragments[next..] {
        window
            .put(fragment, base + (i * FRAG) as u64, &rkey)
            .unwrap();
    }
    window.flush().unwrap();
    assert!(window.is_idle());
    drop(window);
    drop(rkey);
    drop(ep);
    let _b = progressor.stop();

    let mut got = vec![0; LEN];
    target.read_at(0, &mut got);
    assert!(got == src, "target bytes differ after recovery");
}

/// The target worker is destroyed mid-window (its sockets close): the window gives up within
/// its deadline, whatever UCX reports, and the initiator abandons the puts it can no longer
/// wait for while keeping their source alive until the endpoint is closed (the abandoned
/// puts' key is leaked by `abandon` itself).
#[test]
fn window_gives_up_when_the_target_is_gone_tcp() {
    let ctx_b = Transport::Tcp.context();
    let t = Target::start(&ctx_b, LEN);

    let ctx_a = Transport::Tcp.context();
    let a = Worker::new(&ctx_a).unwrap();
    let (ep, rkey) = t.connect(&a, ErrorMode::None); // wired up while the target progresses
    let Target {
        progressor,
        region: target,
        base,
        ..
    } = t;

    let src = pattern(LEN, 0x5E);
    let budget = Duration::from_millis(500);
    let mut window = PutWindow::with_capacity(&ep, 32);
    // Fill the window while the target still runs, then take the target away.
    for (i, fragment) in src.chunks(FRAG).take(32).enumerate() {
        window
            .put(fragment, base + (i * FRAG) as u64, &rkey)
            .unwrap();
    }
    drop(progressor.stop());
    drop(target);
    drop(ctx_b);

    let started = Instant::now();
    window.set_deadline(Some(started + budget));
    let mut outcome = Ok(());
    for (i, fragment) in src.chunks(FRAG).enumerate().skip(32) {
        outcome = window.put(fragment, base + (i * FRAG) as u64, &rkey);
        if outcome.is_err() {
            break;
        }
    }
    if outcome.is_ok() {
        outcome = window.flush();
    }
    let waited = started.elapsed();
    let error = outcome.expect_err("writing to a destroyed worker cannot succeed");
    assert!(
        waited < budget + SLACK,
        "gave up after {waited:?} with a {budget:?} deadline: {error:?}"
    );
    eprintln!(
        "gave up after {waited:?}: {error:?} ({}), {} puts in flight",
        error.status(),
        window.in_flight()
    );

    if window.is_idle() {
        drop(window);
    } else {
        // SAFETY: the abandoned puts read `src`, which is dropped last: after `rkey` (its
        // `ucp_rkey_destroy` is skipped, `abandon` marked it used by abandoned puts) and `ep`,
        // the last handle on the endpoint, whose drop closes it (forced once its flush times
        // out, which ends the abandoned requests).
        unsafe { window.abandon() };
    }
    drop(rkey);
    drop(ep);
    drop(src);
}

/// A deadline already past refuses a put that would have had room, without issuing it.
#[test]
fn no_put_is_issued_after_the_deadline_shm() {
    let ctx = Transport::Shm.context();
    let t = Target::start(&ctx, FRAG);
    let a = Worker::new(&ctx).unwrap();
    let (ep, rkey) = t.connect(&a, ErrorMode::None); // wired up while the target progresses
    let Target {
        progressor,
        region: target,
        base,
        ..
    } = t;

    let src = pattern(FRAG, 0x21);
    let mut window = PutWindow::new(&ep).with_deadline(Instant::now());
    let error = window.put(&src, base, &rkey).unwrap_err();
    assert_eq!((error.op(), error.status()), (Op::Put, Status::TIMED_OUT));
    assert_eq!(window.in_flight(), 0);
    assert!(window.is_idle());
    // An idle window's flush still runs: nothing waits on the target here.
    window.set_deadline(None);
    window.put(&src, base, &rkey).unwrap();
    window.finish().unwrap();
    drop(rkey);
    drop(ep);
    let _b = progressor.stop();
    let mut got = vec![0; FRAG];
    target.read_at(0, &mut got);
    assert_eq!(got, src);
}

/// A window stuck on a target that stopped progressing (its socket no longer drains) is ended
/// by closing its endpoint by force: every put in flight completes with an error at the next
/// progress, the window becomes idle and can be dropped without waiting, nothing more is
/// issued on the endpoint, and `failure` reports the cancellation.
#[test]
fn a_forced_close_ends_a_window_stuck_on_a_hung_target_tcp() {
    let ctx = Transport::Tcp.context();
    let t = Target::start(&ctx, LEN);
    let a = Worker::new(&ctx).unwrap();
    let (ep, rkey) = t.connect(&a, ErrorMode::Peer); // wired up while the target progresses
    let Target {
        progressor,
        region: _target,
        base,
        packed,
        ..
    } = t;
    progressor.pause();

    let src = pattern(LEN, 0x4B);
    let mut window = PutWindow::with_capacity(&ep, 32)
        .with_deadline(Instant::now() + Duration::from_millis(300));
    let mut outcome = Ok(());
    for (i, fragment) in src.chunks(FRAG).enumerate() {
        outcome = window.put(fragment, base + (i * FRAG) as u64, &rkey);
        if outcome.is_err() {
            break;
        }
    }
    if outcome.is_ok() {
        outcome = window.flush();
    }
    assert!(is_timeout(&outcome.unwrap_err()));
    assert!(!window.is_idle(), "puts must be stuck in flight");
    let stuck = window.in_flight();

    ep.force_close().unwrap();
    assert!(ep.is_closed());
    ep.force_close().unwrap(); // closing twice does nothing
    assert_eq!(ep.failure(), Some(Status::CANCELED));
    let deadline = Instant::now() + DEADLINE;
    let mut failed = 0;
    loop {
        match window.poll() {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => {
                failed += 1;
                assert_eq!(e.status(), Status::CANCELED, "{e:?}");
            }
        }
        assert!(
            Instant::now() < deadline,
            "puts still in flight after the close"
        );
        a.progress();
    }
    eprintln!("{stuck} puts in flight ended by the forced close");
    assert!(failed > 0, "the cancelled puts must report an error");
    // Nothing is issued on a closed endpoint, through any handle.
    let refused = ep.put(&src[..FRAG], base, &rkey).unwrap_err();
    assert_eq!(
        (refused.op(), refused.status()),
        (Op::Put, Status::NOT_CONNECTED)
    );
    assert_eq!(ep.flush().unwrap_err().status(), Status::NOT_CONNECTED);
    assert_eq!(
        ep.unpack_rkey(packed.as_bytes()).unwrap_err().status(),
        Status::NOT_CONNECTED
    );
    drop(window);
    drop(rkey);
    drop(ep);
    let _b = progressor.stop();
}

/// Shared memory has no peer error handling, so UCX forbids a forced close: refused, and the
/// endpoint stays usable.
#[test]
fn a_forced_close_needs_peer_error_mode_shm() {
    let ctx = Transport::Shm.context();
    let b = Worker::new(&ctx).unwrap();
    let a = Worker::new(&ctx).unwrap();
    let ep = a.connect(&b.address().unwrap()).unwrap();
    let refused = ep.force_close().unwrap_err();
    assert_eq!(
        (refused.op(), refused.status()),
        (Op::EpClose, Status::UNSUPPORTED)
    );
    assert!(!ep.is_closed());
    common::drive(ep.flush().unwrap(), &[&a, &b]).unwrap();
}
