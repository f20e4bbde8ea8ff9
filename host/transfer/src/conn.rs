//! Connections: a writer thread per connection, so no protocol thread ever blocks on a slow
//! peer's socket, and a reader helper for clients. Generic over the message family
//! ([`Frame`]), so the CLI's control connections use the same machinery.

use std::io::{BufReader, Read};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread;
use std::time::{Duration, Instant};

use kvferry_protocol::{Frame, WireError, read_frame, write_frame};

/// Queue of messages to one connection; dropping every clone closes the sending half.
pub type Outbox<M> = Sender<M>;

/// Starts the thread that writes every message queued on the returned [`Outbox`] to
/// `stream`, in order. When every sender is dropped (or a write fails) it shuts the sending
/// half of the socket down.
pub fn spawn_writer<M: Frame + Send + 'static>(stream: TcpStream, label: String) -> Outbox<M> {
    let (tx, rx) = mpsc::channel::<M>();
    let spawned = thread::Builder::new()
        .name(format!("w-{label}"))
        .spawn(move || {
            let mut stream = stream;
            for message in rx {
                if let Err(e) = write_frame(&mut stream, &message) {
                    tracing::debug!(peer = %label, error = %e, kind = message.kind(), "write failed");
                    break;
                }
            }
            let _ = stream.shutdown(Shutdown::Write);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot spawn a connection writer thread");
    }
    tx
}

/// Starts a thread that reads frames from `stream` into the returned channel until the first
/// error (which it passes on, then stops).
pub fn spawn_reader<M: Frame + Send + 'static>(
    stream: TcpStream,
    label: String,
) -> Receiver<Result<M, WireError>> {
    let (tx, rx) = mpsc::channel();
    let spawned = thread::Builder::new()
        .name(format!("r-{label}"))
        .spawn(move || {
            let mut reader = BufReader::new(stream);
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
pub fn dial(addr: &str, timeout: Duration, read_timeout: Duration) -> Result<TcpStream, String> {
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

/// What a connection handler does after a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Read the next message.
    Continue,
    /// Close the connection quietly.
    Close,
    /// Send an error message with this reason, then close.
    Refuse(String),
}
