//! Active messages between two workers: a header plus a 1 MiB payload there, a reply back, over
//! eager and rendezvous protocols; a handler that panics; a worker without handlers.
//!
//! The responder runs on its own thread, as the peer process would: with endpoints in both
//! directions over tcp, UCX 1.13 needs the peer to progress even to flush an idle endpoint, so
//! each side closes its endpoint while the other is still progressing.

use crate::common;

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::Duration;

use common::{Transport, drive, pattern, progress_until};
use kvferry_ucx::{AmProto, Context, Request, Worker};

const REQUEST_ID: u16 = 7;
const REPLY_ID: u16 = 8;
const PAYLOAD: usize = 1 << 20;

type Message = (Vec<u8>, Vec<u8>);

/// Installs a handler for `id` that forwards every message into a channel.
fn collect(worker: &Worker, id: u16) -> mpsc::Receiver<Message> {
    let (tx, rx) = mpsc::channel();
    worker
        .set_am_handler(id, move |header, data| {
            tx.send((header.to_vec(), data.to_vec())).unwrap();
        })
        .unwrap();
    rx
}

/// Progresses `workers` until `rx` yields a message.
fn receive(rx: &mpsc::Receiver<Message>, workers: &[&Worker]) -> Message {
    let mut message = None;
    progress_until(workers, || {
        message = rx.try_recv().ok();
        message.is_some()
    });
    message.unwrap()
}

/// A worker on its own thread that reports every `REQUEST_ID` message and answers it with a
/// `REPLY_ID` message carrying `"ack:"` and the request's header, no payload.
struct Responder {
    address: Vec<u8>,
    received: mpsc::Receiver<Message>,
    connect_back: mpsc::Sender<Vec<u8>>,
    stop: Arc<AtomicBool>,
    thread: thread::JoinHandle<()>,
}

impl Responder {
    fn spawn(ctx: Arc<Context>) -> Responder {
        let (address_tx, address_rx) = mpsc::channel();
        let (connect_tx, connect_rx) = mpsc::channel::<Vec<u8>>();
        let (received_tx, received_rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            let worker = Worker::new(&ctx).unwrap();
            let inbox = collect(&worker, REQUEST_ID);
            address_tx.send(worker.address().unwrap()).unwrap();
            let peer = connect_rx.recv().unwrap();
            let ep = worker.connect(&peer).unwrap();
            let mut replies: Vec<Request<'_>> = Vec::new();
            while !stopping.load(Ordering::Acquire) {
                worker.progress();
                while let Ok((header, data)) = inbox.try_recv() {
                    let reply = [b"ack:".as_slice(), &header].concat();
                    replies.push(ep.am_send_owned(REPLY_ID, reply, Vec::new()).unwrap());
                    received_tx.send((header, data)).unwrap();
                }
                replies.retain_mut(|reply| !reply.is_done());
            }
            // The initiator keeps progressing until this thread has finished, so these waits
            // (unsent replies, then the endpoint's flush and close) complete.
            drop(replies);
            ep.close(Duration::from_secs(5)).unwrap();
        });
        Responder {
            address: address_rx.recv().unwrap(),
            received: received_rx,
            connect_back: connect_tx,
            stop,
            thread,
        }
    }

    /// Stops the responder, progressing `worker` (its peer) until the thread has closed its
    /// endpoint and exited.
    fn stop(self, worker: &Worker) {
        self.stop.store(true, Ordering::Release);
        progress_until(&[worker], || self.thread.is_finished());
        self.thread.join().expect("responder panicked");
    }
}

fn round_trip(transport: Transport, proto: AmProto) {
    let responder = Responder::spawn(transport.context());
    let ctx = transport.context();
    let a = Worker::new(&ctx).unwrap();
    let replies = collect(&a, REPLY_ID);
    responder.connect_back.send(a.address().unwrap()).unwrap();
    let ep = a.connect(&responder.address).unwrap();

    let header = b"kvferry request header".to_vec();
    let payload = pattern(PAYLOAD, 0x21);
    let send = ep
        .am_send_with(REQUEST_ID, &header, &payload, proto)
        .unwrap();
    let (reply_header, reply_data) = receive(&replies, &[&a]);
    drive(send, &[&a]).unwrap();
    assert_eq!(reply_header, [b"ack:".as_slice(), &header].concat());
    assert!(reply_data.is_empty());

    let (got_header, got_payload) = responder.received.recv().unwrap();
    assert_eq!(got_header, header);
    assert!(
        got_payload == payload,
        "payload differs ({} bytes received)",
        got_payload.len()
    );

    ep.close(Duration::from_secs(5)).unwrap();
    responder.stop(&a);
}

#[test]
fn eager_shm() {
    round_trip(Transport::Shm, AmProto::Eager);
}

#[test]
fn eager_tcp() {
    round_trip(Transport::Tcp, AmProto::Eager);
}

#[test]
fn rendezvous_shm() {
    round_trip(Transport::Shm, AmProto::Rendezvous);
}

#[test]
fn rendezvous_tcp() {
    round_trip(Transport::Tcp, AmProto::Rendezvous);
}

#[test]
fn auto_env_transports() {
    round_trip(Transport::Env, AmProto::Auto);
}

/// A panicking handler never unwinds into UCX: the panic comes out of `progress` afterwards,
/// the handler is poisoned (later messages are dropped), and replacing it recovers.
#[test]
fn handler_panic_resumes_from_progress() {
    let ctx = Transport::Shm.context();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    b.set_am_handler(REQUEST_ID, |_, _| panic!("handler exploded"))
        .unwrap();
    let ep = a.connect(&b.address().unwrap()).unwrap();

    let first = ep.am_send(REQUEST_ID, b"h", b"first").unwrap();
    let payload = panic::catch_unwind(AssertUnwindSafe(|| {
        progress_until(&[&a, &b], || false);
    }))
    .unwrap_err();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"handler exploded"));
    drive(first, &[&a, &b]).unwrap();

    // Poisoned: the next message is dropped without calling the handler (nothing panics).
    drive(ep.am_send(REQUEST_ID, b"h", b"second").unwrap(), &[&a, &b]).unwrap();
    for _ in 0..1000 {
        a.progress();
        b.progress();
    }

    // A new handler for the id works.
    let at_b = collect(&b, REQUEST_ID);
    let send = ep.am_send(REQUEST_ID, b"h", b"third").unwrap();
    let (_, data) = receive(&at_b, &[&a, &b]);
    drive(send, &[&a, &b]).unwrap();
    assert_eq!(data, b"third");

    b.remove_am_handler(REQUEST_ID).unwrap();
    drive(ep.flush().unwrap(), &[&a, &b]).unwrap();
}

/// UCX 1.13 crashes on a message to a worker that never had a handler; `Worker::new` installs
/// an empty one so the message is dropped (UCX prints a warning) instead.
#[test]
fn message_to_a_worker_without_handlers_is_dropped() {
    let ctx = Transport::Shm.context();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    let ep = a.connect(&b.address().unwrap()).unwrap();
    drive(
        ep.am_send(REQUEST_ID, b"h", b"nobody listens").unwrap(),
        &[&a, &b],
    )
    .unwrap();
    for _ in 0..1000 {
        a.progress();
        b.progress();
    }
    drive(ep.flush().unwrap(), &[&a, &b]).unwrap();
}
