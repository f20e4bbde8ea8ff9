//! Connections: the secure channel every connection runs in (a Noise handshake under a
//! whole-handshake deadline, then encrypted records), a writer thread per connection, so no
//! protocol thread ever blocks on a slow peer's socket, and a reader helper for clients.
//! Generic over the message family ([`Frame`]), so the CLI's control connections use the same
//! machinery.

use std::io::{self, BufReader, Read, Write};
use std::net::{IpAddr, Shutdown, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_protocol::secure::{self, HandshakeError, Intent, SecureReader, SecureWriter};
use kvferry_protocol::{Frame, Secret, WireError, read_frame, write_frame};

/// How long a whole handshake may take, from the connection to the first frame read (the
/// secure handshake, then the metadata on the side channel): a deadline, not a quiet interval.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Queue of messages to one connection; dropping every clone closes the sending half.
pub type Outbox<M> = Sender<M>;

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
/// At most `MAX_UNPROVEN` in all and `MAX_UNPROVEN_PER_ADDRESS` from one address: a new
/// one past either cap closes the oldest instead of being turned away, so connections that
/// stall or dribble (each also bounded by the handshake's deadline) cannot keep an honest
/// peer out, whose handshake takes a round trip. Each costs at most one handshake message
/// ([`secure::MAX_HELLO`]) and one record ([`secure::MAX_RECORD`]) of buffers before it is
/// proven.
#[derive(Clone, Debug, Default)]
pub struct Unproven(Arc<Mutex<UnprovenConns>>);

#[derive(Debug, Default)]
struct UnprovenConns {
    next: u64,
    conns: Vec<(u64, Option<IpAddr>, TcpStream)>,
}

/// The most connections not yet proven at once, per listener.
pub(crate) const MAX_UNPROVEN: usize = 64;
/// The most connections not yet proven from one address at once, per listener.
pub(crate) const MAX_UNPROVEN_PER_ADDRESS: usize = 16;

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

impl Unproven {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, UnprovenConns> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a connection just accepted, closing the oldest unproven one first when a
    /// cap is reached. Drop the returned [`Pending`] once the peer is proven (or gone).
    pub fn admit(&self, stream: &TcpStream) -> Pending {
        let addr = stream.peer_addr().ok().map(|a| a.ip());
        let mut this = self.lock();
        let from_addr = this.conns.iter().filter(|(_, a, _)| *a == addr).count();
        let evict = if from_addr >= MAX_UNPROVEN_PER_ADDRESS {
            this.conns.iter().position(|(_, a, _)| *a == addr)
        } else if this.conns.len() >= MAX_UNPROVEN {
            Some(0)
        } else {
            None
        };
        if let Some(i) = evict {
            let (_, old, socket) = this.conns.remove(i);
            tracing::info!(addr = ?old, "an unproven connection closed for a newer one");
            let _ = socket.shutdown(Shutdown::Both);
        }
        let id = this.next;
        this.next += 1;
        if let Ok(socket) = stream.try_clone() {
            this.conns.push((id, addr, socket));
        }
        Pending {
            registry: self.clone(),
            id,
        }
    }
}

/// Starts the thread that writes every message queued on the returned [`Outbox`] to
/// `writer`, in order. When every sender is dropped (or a write fails) it shuts the sending
/// half of the socket down.
pub fn spawn_writer<M: Frame + Send + 'static>(writer: Writer, label: String) -> Outbox<M> {
    let (tx, rx) = mpsc::channel::<M>();
    let spawned = thread::Builder::new()
        .name(format!("w-{label}"))
        .spawn(move || {
            let mut writer = writer;
            for message in rx {
                let started = std::time::Instant::now();
                if let Err(e) = write_frame(&mut writer, &message) {
                    tracing::debug!(peer = %label, error = %e, kind = message.kind(), "write failed");
                    break;
                }
                // A peer that does not read fills the socket's buffer; everything queued
                // behind this message (keep-alives included) waits with it.
                let took = started.elapsed();
                if took >= std::time::Duration::from_secs(1) {
                    tracing::warn!(
                        peer = %label,
                        kind = message.kind(),
                        took_ms = took.as_millis() as u64,
                        "a side-channel write waited long for its peer to read"
                    );
                }
            }
            let _ = writer.get_ref().shutdown(Shutdown::Write);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot spawn a connection writer thread");
    }
    tx
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

/// Reads and discards what a refused peer still sends, for at most `limit` (so the error
/// frame sent to it is not lost to a reset caused by unread input).
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
