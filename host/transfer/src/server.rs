//! The context instance's peer listener: one thread per generation peer connection, speaking
//! [`PeerMessage`] frames.
//!
//! A connection that sends a bad frame, or a message out of protocol, gets a
//! [`PeerMessage::Error`] naming what was wrong and is closed; nothing else is affected.

use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use kvferry_plan::error_chain;
use kvferry_protocol::{Frame, PeerMessage, read_frame};

use crate::conn::{Flow, drain, spawn_writer};
use crate::sender::{ContextServer, ContextSession};

/// How long a refused connection's remaining input is drained before closing it.
const DRAIN: Duration = Duration::from_millis(200);

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
        })
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

    /// Accepts connections for ever, one thread each.
    pub fn run(self) {
        for stream in self.listener.incoming() {
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            };
            let server = Arc::clone(&self.server);
            let spawned = thread::Builder::new()
                .name("peer-conn".into())
                .spawn(move || connection(&server, stream));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot spawn a connection thread");
            }
        }
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
