//! The context instance's peer listener: one thread per generation peer connection, speaking
//! [`PeerMessage`] frames.
//!
//! A connection that sends a bad frame, or a message out of protocol, gets a
//! [`PeerMessage::Error`] naming what was wrong and is closed; nothing else is affected.
//!
//! Open connections are capped ([`PeerListener::max_connections`]): one past the cap gets an
//! `Error` naming the limit and is closed at once, so a local process opening sockets in a
//! loop cannot take every thread and descriptor. Accept failures (out of file descriptors)
//! back off from 1 ms to 1 s instead of spinning, and are logged once per backoff level.

use std::io::BufReader;
use std::io::Write as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::Duration;

use kvferry_plan::error_chain;
use kvferry_protocol::{Frame, PeerMessage, encode, read_frame};

use crate::conn::{Flow, drain, spawn_writer};
use crate::sender::{ContextServer, ContextSession};

/// How long a refused connection's remaining input is drained before closing it.
const DRAIN: Duration = Duration::from_millis(200);
/// Open peer connections a listener serves at once unless told otherwise.
pub const MAX_PEER_CONNECTIONS: usize = 256;
/// The first and the longest pause after a failed accept.
const ACCEPT_BACKOFF: (Duration, Duration) = (Duration::from_millis(1), Duration::from_secs(1));

/// Why the peer listener could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The address could not be bound.
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address.
        addr: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// A bound peer listener of a context server.
#[derive(Debug)]
pub struct PeerListener {
    server: Arc<ContextServer>,
    listener: TcpListener,
    addr: SocketAddr,
    max_connections: usize,
    open: Arc<AtomicUsize>,
}

impl PeerListener {
    /// Binds `addr` (port 0 picks a free port) for `server`'s generation peers.
    ///
    /// # Errors
    ///
    /// [`ServeError::Listen`] if the address cannot be bound.
    pub fn bind(server: Arc<ContextServer>, addr: &str) -> Result<Self, ServeError> {
        let listen_error = |source| ServeError::Listen {
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(addr).map_err(listen_error)?;
        let addr = listener.local_addr().map_err(listen_error)?;
        Ok(Self {
            server,
            listener,
            addr,
            max_connections: MAX_PEER_CONNECTIONS,
            open: Arc::default(),
        })
    }

    /// Serves at most `n` (at least 1) connections at once; default
    /// [`MAX_PEER_CONNECTIONS`].
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Accepts connections on a thread of its own, for the life of the process.
    ///
    /// # Errors
    ///
    /// The thread could not be spawned.
    pub fn spawn(self) -> std::io::Result<()> {
        thread::Builder::new()
            .name("peer-accept".into())
            .spawn(move || self.run())
            .map(|_| ())
    }

    /// Accepts connections for ever, one thread each, at most
    /// [`max_connections`](Self::max_connections) at once.
    pub fn run(self) {
        let mut backoff = Duration::ZERO;
        for stream in self.listener.incoming() {
            let stream = match stream {
                Ok(s) => {
                    backoff = Duration::ZERO;
                    s
                }
                Err(e) => {
                    let next = (backoff * 2).clamp(ACCEPT_BACKOFF.0, ACCEPT_BACKOFF.1);
                    if next != backoff {
                        tracing::warn!(error = %e, retry_in_ms = next.as_millis() as u64, "accept failed");
                    }
                    backoff = next;
                    thread::sleep(backoff);
                    continue;
                }
            };
            if self.open.load(Ordering::Acquire) >= self.max_connections {
                refuse_over_cap(stream, self.max_connections);
                continue;
            }
            let open = OpenConnection::new(&self.open);
            let server = Arc::clone(&self.server);
            let spawned = thread::Builder::new()
                .name("peer-conn".into())
                .spawn(move || {
                    let _open = open;
                    connection(&server, stream);
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot spawn a connection thread");
            }
        }
    }
}

/// One open connection, counted while it lives.
struct OpenConnection(Arc<AtomicUsize>);

impl OpenConnection {
    fn new(open: &Arc<AtomicUsize>) -> Self {
        open.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(open))
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Tells a connection past the cap why it is closed, without waiting on it.
fn refuse_over_cap(mut stream: TcpStream, cap: usize) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "unknown".to_string(), |a| a.to_string());
    tracing::warn!(%peer, cap, "refusing a peer connection: too many open");
    let message = PeerMessage::Error {
        message: format!("connection refused: {cap} peer connections are open, the limit"),
    };
    // A small frame into a fresh socket's empty send buffer: the write does not block, and
    // the timeout bounds it if it would.
    let _ = stream.set_write_timeout(Some(DRAIN));
    if let Ok(frame) = encode(&message) {
        let _ = stream.write_all(&frame);
    }
}

/// Serves one peer connection until it closes or misbehaves.
fn connection(server: &Arc<ContextServer>, stream: TcpStream) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "unknown".to_string(), |a| a.to_string());
    let _span = tracing::info_span!("peer", %peer).entered();
    let _ = stream.set_nodelay(true);
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "cannot clone a connection socket");
            return;
        }
    };
    let outbox = spawn_writer::<PeerMessage>(writer, peer.clone());
    let mut reader = BufReader::new(stream);
    let mut session = ContextSession::default();
    let refusal = loop {
        let message: PeerMessage = match read_frame(&mut reader) {
            Ok(m) => m,
            Err(e) if e.is_disconnect() => break None,
            Err(e) => break Some(error_chain(&e)),
        };
        tracing::trace!(kind = message.kind(), "message");
        match server.handle(&mut session, &outbox, message) {
            Flow::Continue => {}
            Flow::Close => break None,
            Flow::Refuse(reason) => break Some(reason),
        }
    };
    if let Some(reason) = refusal {
        tracing::warn!(%reason, "refusing connection");
        let _ = outbox.send(PeerMessage::Error {
            message: format!("connection refused: {reason}"),
        });
        drop(outbox);
        let stream = reader.get_mut();
        let _ = stream.set_read_timeout(Some(DRAIN));
        drain(stream, DRAIN);
    }
    server.closed(&mut session);
}
