//! Connections: the secure channel every connection runs in (a Noise handshake under a
//! whole-handshake deadline, then encrypted records), an outbox per connection that writes a
//! message at once when the socket takes it and leaves the rest to the connection's writer
//! thread, so no protocol thread ever blocks on a slow peer's socket, and a reader helper
//! for clients.
//! Generic over the message family ([`Frame`]), so the CLI's control connections use the same
//! machinery.

use std::io::{self, BufReader, ErrorKind, Read, Write};
use std::marker::PhantomData;
use std::net::{IpAddr, Ipv6Addr, Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_platform::send_now;
use kvferry_protocol::secure::{self, HandshakeError, Intent, SecureReader, SecureWriter};
use kvferry_protocol::{Frame, Secret, WireError, encode, read_frame};

/// How long a whole handshake may take, from the connection to the first frame read (the
/// secure handshake, then the metadata on the side channel): a deadline, not a quiet interval.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A socket whose reads end at a deadline (the whole handshake's), not only after a quiet
/// interval: a peer that dribbles a byte now and then cannot hold a connection past it.
#[derive(Debug)]
pub struct Timed {
    stream: TcpStream,
    deadline: Option<Instant>,
}

impl Timed {
    /// The deadline ends; from now on reads time out after `timeout` of silence (`None`:
    /// never).
    pub fn settle(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.deadline = None;
        self.stream.set_read_timeout(timeout)
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the handshake's deadline passed",
                ));
            }
            self.stream.set_read_timeout(Some(left))?;
        }
        self.stream.read(buf)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// The reading half of a secured connection.
pub type Reader = SecureReader<BufReader<Timed>>;
/// The writing half of a secured connection.
pub type Writer = SecureWriter<TcpStream>;

/// A connection whose handshake completed: both halves, the socket (to shut it down from
/// elsewhere) and the session's binding ([`secure::Channel::binding`]).
#[derive(Debug)]
pub struct Secured {
    /// Reads open records; its deadline still runs until the handshake settles it.
    pub reader: Reader,
    /// Seals records.
    pub writer: Writer,
    /// Another handle of the socket.
    pub socket: TcpStream,
    /// The handshake hash.
    pub binding: [u8; 32],
}

fn secured(timed: Timed, channel: secure::Channel) -> io::Result<Secured> {
    let writer = timed.stream.try_clone()?;
    let socket = timed.stream.try_clone()?;
    let binding = channel.binding();
    let (reader, writer) = channel.split(BufReader::new(timed), writer);
    Ok(Secured {
        reader,
        writer,
        socket,
        binding,
    })
}

/// Runs the dialer's side of the handshake on `stream` by `deadline`, naming `endpoint` as
/// the one it meant to reach.
///
/// # Errors
///
/// The handshake failed ([`HandshakeError`]), or the socket could not be cloned.
pub fn secure_dial<M: Frame>(
    stream: TcpStream,
    secret: &Secret,
    endpoint: &str,
    deadline: Instant,
) -> Result<Secured, HandshakeError> {
    let mut timed = Timed {
        stream,
        deadline: Some(deadline),
    };
    let intent = Intent {
        endpoint: endpoint.to_string(),
    };
    let channel = secure::dial::<M>(&mut timed, secret, &intent)?;
    Ok(secured(timed, channel)?)
}

/// Runs the acceptor's side of the handshake on `stream` by `deadline`; returns the
/// connection and the endpoint the dialer meant to reach. The dialer is proven once the
/// first frame reads (see [`secure::accept`]).
///
/// # Errors
///
/// The handshake failed ([`HandshakeError`]), or the socket could not be cloned.
pub fn secure_accept<M: Frame>(
    stream: TcpStream,
    secret: &Secret,
    deadline: Instant,
) -> Result<(Secured, Intent), HandshakeError> {
    let mut timed = Timed {
        stream,
        deadline: Some(deadline),
    };
    let (channel, intent) = secure::accept::<M>(&mut timed, secret)?;
    Ok((secured(timed, channel)?, intent))
}

/// Connections whose peer has not proven the secret yet, oldest first (one registry per
/// listener; clones share it).
///
/// At most `MAX_UNPROVEN` in all and `MAX_UNPROVEN_PER_ADDRESS` from one source: a new
/// one past either cap closes the oldest instead of being turned away, so connections that
/// stall or dribble (each also bounded by the handshake's deadline) cannot keep an honest
/// peer out, whose handshake takes a round trip. A source is the peer's address, except that
/// every loopback address (`127.0.0.0/8`, `::1`, and either as an IPv4-mapped address) is one
/// source: any local user can bind any of them. Each costs at most one handshake message
/// ([`secure::MAX_HELLO`]) and one record ([`secure::MAX_RECORD`]) of buffers before it is
/// proven. A listener that serves a bounded number of connections admits through
/// [`Unproven::admit_counted`], so that a full listener, too, closes an unproven connection
/// for a newer one and refuses only when every connection it serves is proven.
#[derive(Clone, Debug, Default)]
pub struct Unproven(Arc<Mutex<UnprovenConns>>);

#[derive(Debug, Default)]
struct UnprovenConns {
    next: u64,
    conns: Vec<(u64, Option<IpAddr>, TcpStream)>,
}

/// The most connections not yet proven at once, per listener.
pub(crate) const MAX_UNPROVEN: usize = 64;
/// The most connections not yet proven from one source at once, per listener (every
/// loopback address is one source, see [`Unproven`]).
pub(crate) const MAX_UNPROVEN_PER_ADDRESS: usize = 16;

/// The source a connection from `addr` is counted under in [`Unproven`]: every loopback
/// address (IPv4, IPv6, or IPv4-mapped) is one, `::1`; an IPv4-mapped address is its IPv4
/// address; any other address is itself.
fn source(addr: IpAddr) -> IpAddr {
    let v4 = match addr {
        IpAddr::V4(a) => Some(a),
        IpAddr::V6(a) => a.to_ipv4_mapped(),
    };
    match v4 {
        Some(a) if a.is_loopback() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        Some(a) => IpAddr::V4(a),
        None if addr.is_loopback() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        None => addr,
    }
}

/// A connection's place in [`Unproven`], left when dropped (proven, or gone).
#[derive(Debug)]
pub struct Pending {
    registry: Unproven,
    id: u64,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.registry.lock().conns.retain(|(id, ..)| *id != self.id);
    }
}

impl UnprovenConns {
    /// Closes the oldest unproven connection when a newcomer from `from` would pass a cap,
    /// or, when `full` (its listener serves all it may), in any case; returns whether the
    /// newcomer may be admitted: `false` only when `full` and no unproven connection is left
    /// to close.
    fn make_room(&mut self, from: Option<IpAddr>, full: bool) -> bool {
        let from_source = self.conns.iter().filter(|(_, a, _)| *a == from).count();
        let evict = if from_source >= MAX_UNPROVEN_PER_ADDRESS {
            self.conns.iter().position(|(_, a, _)| *a == from)
        } else if (full || self.conns.len() >= MAX_UNPROVEN) && !self.conns.is_empty() {
            Some(0)
        } else {
            None
        };
        let Some(i) = evict else { return !full };
        let (_, old, socket) = self.conns.remove(i);
        tracing::info!(
            source = old.map(tracing::field::display),
            listener_full = full,
            "an unproven connection closed for a newer one"
        );
        // Its thread's next read or write fails at once: the thread ends and frees its place.
        let _ = socket.shutdown(Shutdown::Both);
        true
    }

    fn register(
        &mut self,
        registry: &Unproven,
        stream: &TcpStream,
        from: Option<IpAddr>,
    ) -> Pending {
        let id = self.next;
        self.next += 1;
        if let Ok(socket) = stream.try_clone() {
            self.conns.push((id, from, socket));
        }
        Pending {
            registry: registry.clone(),
            id,
        }
    }
}

impl Unproven {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, UnprovenConns> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a connection just accepted from the source `from` on a listener that
    /// counts nothing else, closing the oldest unproven one first when a cap is reached (the
    /// tests' way in; listeners use [`Unproven::admit_counted`]).
    #[cfg(test)]
    fn admit_from(&self, stream: &TcpStream, from: Option<IpAddr>) -> Pending {
        let mut this = self.lock();
        this.make_room(from, false);
        this.register(self, stream, from)
    }

    /// Registers a connection just accepted by a listener that serves at most `max`
    /// connections, `open` of which are open, and counts it in `open`. Past `max`, an
    /// unproven connection is closed for it (the oldest from its source when that source's
    /// cap is reached, else the oldest); `None` (nothing counted: close the newcomer) only
    /// when none is left to close, every connection served being proven, or when connections
    /// closed for newer ones that have not ended yet would take `open` past twice `max`.
    /// The caller takes one from `open` once the connection it admitted has ended (a closed
    /// one's thread ends at its next read or write); drop the [`Pending`] once its peer is
    /// proven (or gone).
    pub fn admit_counted(
        &self,
        stream: &TcpStream,
        open: &AtomicUsize,
        max: usize,
    ) -> Option<Pending> {
        let from = stream.peer_addr().ok().map(|a| source(a.ip()));
        let mut this = self.lock();
        let before = open.fetch_add(1, Ordering::AcqRel);
        let full = before >= max;
        if before >= max.saturating_mul(2) || !this.make_room(from, full) {
            open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(this.register(self, stream, from))
    }
}

/// Starts the writer of a connection and returns the [`Outbox`] that sends on it.
///
/// Every message is sealed in the order it is sent. One sent while nothing is queued before
/// it is written at once by the sending thread, as far as the socket takes it without
/// waiting ([`kvferry_platform::send_now`]): a message to a peer that keeps reading costs no
/// hand-off to another thread (two thread wake-ups fewer on a request's path, one each way).
/// What the socket does not take waits, with every message sent after it, for the
/// connection's writer thread, which writes it however long that takes, so no sender ever
/// blocks on a slow peer's socket. When every clone of the outbox is dropped, the writer
/// writes what is still queued and shuts the sending half of the socket down; after a failed
/// write nothing more is written (the peer sees the connection end) and every later send is
/// refused.
pub fn spawn_writer<M: Frame>(writer: Writer, label: String) -> Outbox<M> {
    let socket = match writer.get_ref().try_clone() {
        Ok(socket) => Some(socket),
        Err(e) => {
            tracing::warn!(peer = %label, error = %e, "cannot clone a connection's socket: nothing is written to it");
            None
        }
    };
    let failed = socket.is_none();
    let shared = Arc::new(OutShared {
        state: Mutex::new(OutState {
            sealer: writer,
            queued: Vec::new(),
            writing: false,
            senders: 1,
            failed,
        }),
        wake: Condvar::new(),
        socket,
        label,
    });
    if !failed {
        let writing = Arc::clone(&shared);
        let spawned = thread::Builder::new()
            .name(format!("w-{}", shared.label))
            .spawn(move || write_queued(&writing));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot spawn a connection writer thread");
            shared.fail();
        }
    }
    Outbox {
        shared,
        _messages: PhantomData,
    }
}

/// The sending end of a connection ([`spawn_writer`]): messages of family `M`, sealed and
/// written in the order sent. Clones share the connection; dropping the last one closes its
/// sending half once what is queued is written.
pub struct Outbox<M> {
    shared: Arc<OutShared>,
    _messages: PhantomData<fn(M)>,
}

/// An [`Outbox`] refused a message: the connection's writing ended (a write failed, or its
/// writer never started), so nothing sent on it reaches the peer any more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the connection's writing has ended")]
pub struct Closed;

impl<M: Frame> Outbox<M> {
    /// Sends `message`: written now if nothing is queued before it and the socket takes it
    /// without waiting, else queued for the writer thread. Never blocks on the peer.
    ///
    /// # Errors
    ///
    /// [`Closed`]: the connection's writing ended, before this message or while writing it
    /// (then nothing more is written and the peer sees the connection end).
    pub fn send(&self, message: M) -> Result<(), Closed> {
        let failed = |what: &str, error: &dyn std::fmt::Display| {
            tracing::debug!(peer = %self.shared.label, %error, kind = message.kind(), "{what} failed");
            self.shared.fail();
            Err(Closed)
        };
        let frame = match encode(&message) {
            Ok(frame) => frame,
            Err(e) => return failed("encoding", &e),
        };
        let mut state = self.shared.lock();
        if state.failed {
            return Err(Closed);
        }
        let sealed = match state.sealer.seal_frame(&frame) {
            Ok(sealed) => sealed,
            Err(e) => {
                drop(state);
                return failed("sealing", &e);
            }
        };
        if state.writing || !state.queued.is_empty() {
            state.queued.extend_from_slice(&sealed);
        } else {
            // Nothing before it: as much as the socket takes now, from this thread.
            let socket = self.shared.socket.as_ref().ok_or(Closed)?;
            let sent = match send_now(socket, &sealed) {
                Ok(n) => n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => 0,
                Err(e) => {
                    drop(state);
                    return failed("write", &e);
                }
            };
            if sent == sealed.len() {
                return Ok(());
            }
            state.queued.extend_from_slice(&sealed[sent..]);
        }
        drop(state);
        self.shared.wake.notify_one();
        Ok(())
    }
}

impl<M> Clone for Outbox<M> {
    fn clone(&self) -> Self {
        self.shared.lock().senders += 1;
        Self {
            shared: Arc::clone(&self.shared),
            _messages: PhantomData,
        }
    }
}

impl<M> Drop for Outbox<M> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.senders -= 1;
        if state.senders == 0 {
            drop(state);
            self.shared.wake.notify_one();
        }
    }
}

impl<M> std::fmt::Debug for Outbox<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.shared.lock();
        f.debug_struct("Outbox")
            .field("peer", &self.shared.label)
            .field("queued", &state.queued.len())
            .field("failed", &state.failed)
            .finish()
    }
}

/// A connection's sending state, shared by its outboxes and its writer thread.
struct OutShared {
    state: Mutex<OutState>,
    /// Signalled when bytes are queued for the writer, or the last outbox goes.
    wake: Condvar,
    /// Another handle on the socket, written by senders (without waiting) and by the writer
    /// (waiting); `None` if it could not be made (then nothing is written).
    socket: Option<TcpStream>,
    /// The peer, for logs.
    label: String,
}

struct OutState {
    /// Seals each message as it is sent: the records' nonces are their order on the wire.
    sealer: Writer,
    /// Sealed bytes not yet written, in order: the writer thread's to write.
    queued: Vec<u8>,
    /// The writer thread is writing bytes it took from `queued`: senders queue behind them.
    writing: bool,
    /// Outboxes alive.
    senders: usize,
    /// A write failed, or the writer could not start: nothing more is written.
    failed: bool,
}

impl OutShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, OutState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Nothing more is written: the peer sees the connection's sending half close.
    fn fail(&self) {
        self.lock().failed = true;
        self.wake.notify_one();
        if let Some(socket) = &self.socket {
            let _ = socket.shutdown(Shutdown::Write);
        }
    }
}

/// The writer thread: writes what senders queued, in order, until the last outbox is gone
/// (then shuts the sending half down) or a write fails.
fn write_queued(shared: &OutShared) {
    let Some(socket) = shared.socket.as_ref() else {
        return;
    };
    let mut state = shared.lock();
    loop {
        if state.failed {
            return;
        }
        if state.queued.is_empty() {
            state.writing = false;
            if state.senders == 0 {
                break;
            }
            state = shared.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            continue;
        }
        state.writing = true;
        let bytes = std::mem::take(&mut state.queued);
        drop(state);
        let started = Instant::now();
        let written = (&*socket).write_all(&bytes);
        // A peer that does not read fills the socket's buffer; everything queued behind
        // these bytes (keep-alives included) waits with them.
        let took = started.elapsed();
        if took >= Duration::from_secs(1) {
            tracing::warn!(
                peer = %shared.label,
                bytes = bytes.len(),
                took_ms = took.as_millis() as u64,
                "a side-channel write waited long for its peer to read"
            );
        }
        if let Err(e) = written {
            tracing::debug!(peer = %shared.label, error = %e, "write failed");
            shared.fail();
            return;
        }
        state = shared.lock();
    }
    drop(state);
    let _ = socket.shutdown(Shutdown::Write);
}

/// Starts a thread that reads frames from `reader` into the returned channel until the first
/// error (which it passes on, then stops).
#[cfg_attr(not(feature = "harness"), allow(dead_code))]
pub fn spawn_reader<M: Frame + Send + 'static>(
    reader: Reader,
    label: String,
) -> Receiver<Result<M, WireError>> {
    let (tx, rx) = mpsc::channel();
    let spawned = thread::Builder::new()
        .name(format!("r-{label}"))
        .spawn(move || {
            let mut reader = reader;
            loop {
                let frame = read_frame(&mut reader);
                let stop = frame.is_err();
                if tx.send(frame).is_err() || stop {
                    break;
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot spawn a connection reader thread");
    }
    rx
}

/// Connects to `addr` (`host:port`) within `timeout`, with Nagle off and reads timing out
/// after `read_timeout`; the error says which step failed.
///
/// # Errors
///
/// `addr` does not resolve, the connection is not made in time, or the socket cannot be
/// configured.
pub(crate) fn dial(
    addr: &str,
    timeout: Duration,
    read_timeout: Duration,
) -> Result<TcpStream, String> {
    let sock = addr
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve: {e}"))?
        .next()
        .ok_or_else(|| "resolves to no address".to_string())?;
    let stream =
        TcpStream::connect_timeout(&sock, timeout).map_err(|e| format!("cannot connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    stream
        .set_read_timeout(Some(read_timeout))
        .map_err(|e| e.to_string())?;
    Ok(stream)
}

/// Reads and discards what a peer still sends until it closes its end, for about `limit` (each
/// read waits at most the stream's own timeout): so the error frame sent to a refused peer is
/// not lost to a reset caused by unread input, and a decode rank whose link ended keeps its
/// worker until the prefill rank has closed its end (`agent::decode`).
pub fn drain(stream: &mut impl Read, limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 16 << 10];
    let mut total = 0usize;
    while Instant::now() < deadline && total < (4 << 20) {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_protocol::AgentMessage;
    use std::net::TcpListener;

    /// A secured loopback connection: the dialer's writer and the acceptor's reader.
    fn pair() -> (Writer, Reader) {
        let secret = Secret::new(vec![7; 32]).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepting = {
            let secret = secret.clone();
            thread::spawn(move || {
                let (stream, _) = listener.accept().unwrap();
                let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
                secure_accept::<AgentMessage>(stream, &secret, deadline)
                    .unwrap()
                    .0
            })
        };
        let stream = TcpStream::connect(addr).unwrap();
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let dialer =
            secure_dial::<AgentMessage>(stream, &secret, &addr.to_string(), deadline).unwrap();
        let mut acceptor = accepting.join().unwrap();
        acceptor.reader.get_mut().get_mut().settle(None).unwrap();
        (dialer.writer, acceptor.reader)
    }

    /// Message `k`: small, or 128 KiB (every fourth).
    fn message(k: u64) -> AgentMessage {
        if k % 4 == 3 {
            AgentMessage::Refused {
                reason: format!("{k}:{}", "x".repeat(128 << 10)),
            }
        } else {
            AgentMessage::Hold { request: k }
        }
    }

    #[test]
    fn an_outbox_never_waits_for_its_peer_and_delivers_in_order_then_closes() {
        let (writer, mut reader) = pair();
        let outbox = spawn_writer::<AgentMessage>(writer, "test".into());
        // 400 messages (13 MB), more than the sockets hold, sent before the peer reads
        // a byte: the first go out from this thread, the rest through the writer.
        const N: u64 = 400;
        let (sent, all_sent) = mpsc::channel();
        let reading = thread::spawn(move || {
            let waited = all_sent.recv_timeout(Duration::from_secs(60));
            let mut got = Vec::new();
            loop {
                match read_frame::<AgentMessage>(&mut reader) {
                    Ok(m) => got.push(m),
                    Err(e) => return (waited, got, e),
                }
            }
        });
        let clone = outbox.clone();
        for k in 0..N {
            let by = if k % 2 == 0 { &outbox } else { &clone };
            by.send(message(k)).unwrap();
        }
        sent.send(()).unwrap();
        drop((outbox, clone));
        let (waited, got, end) = reading.join().unwrap();
        assert_eq!(waited, Ok(()), "a send waited for the peer to read");
        assert_eq!(got.len() as u64, N);
        for (k, m) in got.into_iter().enumerate() {
            let want = bincode_eq(&m, &message(k as u64));
            assert!(want, "message {k} out of order or altered: {}", m.kind());
        }
        // The last outbox gone, the writer shut the sending half: a clean end, not an error.
        assert!(end.is_disconnect(), "{end}");
    }

    #[test]
    fn an_outbox_refuses_once_its_connection_is_gone() {
        let (writer, reader) = pair();
        let outbox = spawn_writer::<AgentMessage>(writer, "test".into());
        outbox.send(message(0)).unwrap();
        drop(reader);
        // Writes to a closed connection fail (reset) within a few sends; until then they are
        // queued or taken by the socket.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut k = 1;
        let refused = loop {
            match outbox.send(message(k)) {
                Err(e) => break e,
                Ok(()) if Instant::now() < deadline => k += 1,
                Ok(()) => panic!("{k} sends to a closed connection were all taken"),
            }
            thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(refused, Closed);
        assert_eq!(
            outbox.send(message(0)),
            Err(Closed),
            "and every send after it"
        );
    }

    #[test]
    fn every_loopback_address_is_one_source() {
        let ip = |a: &str| source(a.parse().unwrap());
        let lo = ip("127.0.0.1");
        for a in [
            "127.0.0.2",
            "127.1.2.3",
            "127.255.255.254",
            "::1",
            "::ffff:127.0.0.5",
        ] {
            assert_eq!(ip(a), lo, "{a}");
        }
        assert_eq!(ip("::ffff:10.0.0.1"), ip("10.0.0.1"));
        for a in [
            "10.0.0.1",
            "::ffff:10.0.0.2",
            "fe80::1",
            "2001:db8::1",
            "0.0.0.0",
        ] {
            assert_ne!(ip(a), lo, "{a}");
        }
        assert_ne!(ip("10.0.0.1"), ip("10.0.0.2"));
    }

    /// Whether the peer closed `s` (an end of stream or a reset), not just stayed silent.
    fn closed(s: &mut TcpStream) -> bool {
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        match s.read(&mut [0u8; 1]) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        }
    }

    #[test]
    fn connections_from_many_loopback_addresses_share_one_source_cap() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let registry = Unproven::new();
        let mut clients = Vec::new();
        let mut pending = Vec::new();
        // One more than a source may hold, each from another loopback address.
        for k in 0..=MAX_UNPROVEN_PER_ADDRESS {
            clients.push(TcpStream::connect(addr).unwrap());
            let (accepted, _) = listener.accept().unwrap();
            let from = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2 + k as u8));
            pending.push(registry.admit_from(&accepted, Some(source(from))));
        }
        assert_eq!(registry.lock().conns.len(), MAX_UNPROVEN_PER_ADDRESS);
        let (oldest, newer) = clients.split_first_mut().unwrap();
        oldest
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        assert!(
            matches!(oldest.read(&mut [0u8; 1]), Ok(0) | Err(_)),
            "the oldest stayed open"
        );
        assert!(!newer.iter_mut().any(closed), "a newer one was closed");
    }

    #[test]
    fn a_full_listener_closes_the_oldest_unproven_connection_and_refuses_only_when_all_are_proven()
    {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let connect = || {
            let client = TcpStream::connect(addr).unwrap();
            let (accepted, _) = listener.accept().unwrap();
            (client, accepted)
        };
        let registry = Unproven::new();
        let open = AtomicUsize::new(0);
        let (mut c0, s0) = connect();
        let p0 = registry.admit_counted(&s0, &open, 2).unwrap();
        let (mut c1, s1) = connect();
        let p1 = registry.admit_counted(&s1, &open, 2).unwrap();
        assert_eq!(open.load(Ordering::Acquire), 2);
        // Full: a third closes the oldest unproven connection, not itself; it counts until
        // the closed one's thread ends.
        let (mut c2, s2) = connect();
        let p2 = registry
            .admit_counted(&s2, &open, 2)
            .expect("the third was refused");
        assert_eq!(open.load(Ordering::Acquire), 3);
        c0.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        assert!(
            matches!(c0.read(&mut [0u8; 1]), Ok(0) | Err(_)),
            "the oldest stayed open"
        );
        assert!(
            !closed(&mut c1) && !closed(&mut c2),
            "a newer one was closed"
        );
        // Its thread ends; the other two are proven.
        drop(p0);
        open.fetch_sub(1, Ordering::AcqRel);
        drop((p1, p2));
        // Every connection served is proven: a newcomer is refused, and not counted.
        let (_c3, s3) = connect();
        assert!(registry.admit_counted(&s3, &open, 2).is_none());
        assert_eq!(open.load(Ordering::Acquire), 2);
        assert!(
            !closed(&mut c1) && !closed(&mut c2),
            "a proven one was closed"
        );
        // Below the cap, one is admitted again.
        open.fetch_sub(1, Ordering::AcqRel);
        let (_c4, s4) = connect();
        let _p4 = registry.admit_counted(&s4, &open, 2).unwrap();
        // With as many closed ones still ending as it serves, none is admitted, even for an
        // unproven one.
        open.store(4, Ordering::Release);
        let (_c5, s5) = connect();
        assert!(registry.admit_counted(&s5, &open, 2).is_none());
        assert_eq!(open.load(Ordering::Acquire), 4);
    }

    fn bincode_eq(a: &AgentMessage, b: &AgentMessage) -> bool {
        encode(a).unwrap() == encode(b).unwrap()
    }
}
