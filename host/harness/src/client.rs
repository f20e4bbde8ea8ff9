//! A client of one connection: what the demo controller and the tests use to drive servers
//! ([`ControlMessage`] on their control listener).

use std::net::{TcpStream, ToSocketAddrs};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use kvferry_protocol::secure::HandshakeError;
use kvferry_protocol::{Frame, Secret, WireError};
use kvferry_transfer::harness::conn::{
    HANDSHAKE_TIMEOUT, Outbox, Secured, secure_dial, spawn_reader, spawn_writer,
};

use crate::control::ControlMessage;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// No connection.
    #[error("cannot connect to {addr}")]
    Connect {
        /// The server's address.
        addr: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The connection ended.
    #[error("connection to {addr} closed: {reason}")]
    Closed {
        /// The server's address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// Nothing arrived in time.
    #[error("no message from {addr} within {} ms", waited.as_millis())]
    Timeout {
        /// The server's address.
        addr: String,
        /// How long we waited.
        waited: Duration,
    },
    /// The secure handshake failed (another secret, or not a kvferry server).
    #[error("cannot authenticate to {addr}")]
    Handshake {
        /// The server's address.
        addr: String,
        /// Why.
        #[source]
        source: HandshakeError,
    },
    /// The server refused the connection.
    #[error("{addr} refused the connection: {message}")]
    Refused {
        /// The server's address.
        addr: String,
        /// The server's message.
        message: String,
    },
}

/// One connection, with a reader thread so receiving can time out cleanly.
#[derive(Debug)]
pub struct Client<M: Frame = ControlMessage> {
    addr: String,
    outbox: Outbox<M>,
    inbox: Receiver<Result<M, WireError>>,
}

impl<M: Frame + Send + 'static> Client<M> {
    /// Connects to `addr` (`host:port`) and proves `secret` (the deployment's: servers
    /// answer nothing before).
    ///
    /// # Errors
    ///
    /// The address does not resolve, the connection is refused, or the handshake fails.
    pub fn connect(addr: &str, secret: &Secret) -> Result<Client<M>, ClientError> {
        let connect = |source| ClientError::Connect {
            addr: addr.to_string(),
            source,
        };
        let sock = addr
            .to_socket_addrs()
            .map_err(connect)?
            .next()
            .ok_or_else(|| {
                connect(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "resolves to no address",
                ))
            })?;
        let stream = TcpStream::connect_timeout(&sock, Duration::from_secs(5)).map_err(connect)?;
        let _ = stream.set_nodelay(true);
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let Secured {
            mut reader, writer, ..
        } = secure_dial::<M>(stream, secret, addr, deadline).map_err(|source| {
            ClientError::Handshake {
                addr: addr.to_string(),
                source,
            }
        })?;
        // Replies may be long in coming (a whole benchmark round): no read deadline.
        let _ = reader.get_mut().get_mut().settle(None);
        Ok(Client {
            addr: addr.to_string(),
            outbox: spawn_writer(writer, format!("client-{addr}")),
            inbox: spawn_reader(reader, format!("client-{addr}")),
        })
    }

    /// The server's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Queues a message.
    ///
    /// # Errors
    ///
    /// The connection's writer has stopped.
    pub fn send(&self, message: M) -> Result<(), ClientError> {
        self.outbox.send(message).map_err(|_| ClientError::Closed {
            addr: self.addr.clone(),
            reason: "the writer stopped".into(),
        })
    }

    /// The next message, waiting at most `timeout`.
    ///
    /// # Errors
    ///
    /// Nothing arrived in time, the connection ended, or the server sent its family's error
    /// message.
    pub fn recv(&self, timeout: Duration) -> Result<M, ClientError> {
        match self.inbox.recv_timeout(timeout) {
            Ok(Ok(message)) => match message.error_text() {
                Some(text) => Err(ClientError::Refused {
                    addr: self.addr.clone(),
                    message: text.to_string(),
                }),
                None => Ok(message),
            },
            Ok(Err(e)) => Err(ClientError::Closed {
                addr: self.addr.clone(),
                reason: kvferry_plan::error_chain(&e),
            }),
            Err(RecvTimeoutError::Timeout) => Err(ClientError::Timeout {
                addr: self.addr.clone(),
                waited: timeout,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(ClientError::Closed {
                addr: self.addr.clone(),
                reason: "the reader stopped".into(),
            }),
        }
    }

    /// Sends `message` and returns the next message received.
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send) and [`recv`](Self::recv).
    pub fn call(&self, message: M, timeout: Duration) -> Result<M, ClientError> {
        self.send(message)?;
        self.recv(timeout)
    }
}
