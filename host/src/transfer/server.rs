//! `kvferry serve`: one instance, its control listener, one thread per connection.

use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use super::Flow;
use super::conn::{drain, spawn_writer};
use super::instance::{Instance, InstanceConfig, InstanceError};
use super::receiver::{GenerationServer, GenerationSession};
use super::sender::{ContextServer, ContextSession};
use super::verify::{VerifyError, prime_all};
use super::wire::{Message, Role, read_frame};
use kvferry_loader::BoundPlanner;

/// How long a refused connection's remaining input is drained before closing it.
const DRAIN: Duration = Duration::from_millis(200);

/// Options of a server beyond its instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    /// Control address to listen on (`127.0.0.1:0` picks a free port).
    pub listen: String,
    /// How long a request may take: on the generation side, to hear from all its writers;
    /// on the context side, each write job once it starts (then it fails and its puts are
    /// quarantined, see [`super::rank`]).
    pub timeout: Duration,
    /// Salt of the oracle's tags and canaries; both servers of a pair must agree.
    pub seed: u64,
    /// Fault injection, context side: sleep this long before every flush.
    pub stall: Duration,
    /// Context side: keep every queued plan until its request is released, so
    /// [`Message::Bench`] can replay it (`kvferry bench`).
    pub record_plans: bool,
}

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The instance could not start.
    #[error(transparent)]
    Instance(#[from] InstanceError),
    /// The pools could not be primed.
    #[error("priming the pools with the canary: {0}")]
    Prime(#[from] VerifyError),
    /// The control address could not be bound.
    #[error("cannot listen on {addr}: {error}")]
    Listen {
        /// The address.
        addr: String,
        /// The OS error.
        error: std::io::Error,
    },
}

#[derive(Clone, Debug)]
enum Server {
    Context(Arc<ContextServer>),
    Generation(Arc<GenerationServer>),
}

/// A started server: the instance runs, the listener is bound.
#[derive(Debug)]
pub struct Running {
    server: Server,
    listener: TcpListener,
    addr: SocketAddr,
}

/// Starts the instance (allocating, describing and priming every rank) and binds the
/// control listener.
///
/// Pool memory is checked first ([`Instance::prepare`]): a machine that cannot hold the pools
/// where `config.memory` asks (no CUDA driver, a UCX without CUDA support) fails before
/// anything listens.
///
/// # Errors
///
/// See [`ServeError`].
pub fn start(
    config: InstanceConfig,
    bound: BoundPlanner,
    options: &ServeOptions,
) -> Result<Running, ServeError> {
    let listen_error = |source| ServeError::Listen {
        addr: options.listen.clone(),
        error: source,
    };
    let role = config.role;
    let prepared = Instance::prepare(config)?;
    // Bound before the pools are allocated, so a bad address fails before any memory is.
    let listener = TcpListener::bind(&options.listen).map_err(listen_error)?;
    let addr = listener.local_addr().map_err(listen_error)?;
    let instance = prepared.start(bound)?;
    let server = match role {
        Role::Context => Server::Context(Arc::new(ContextServer::new(instance, options))),
        Role::Generation => {
            let server = GenerationServer::new(instance, options.seed, options.timeout);
            for rank in server.instance().ranks() {
                prime_all(server.oracle(), &rank.info, &rank.pools)?;
            }
            Server::Generation(server)
        }
    };
    Ok(Running {
        server,
        listener,
        addr,
    })
}

impl Running {
    /// The bound control address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The running instance.
    pub fn instance(&self) -> &Instance {
        match &self.server {
            Server::Context(s) => s.instance(),
            Server::Generation(s) => s.instance(),
        }
    }

    /// Accepts connections for ever (a `Shutdown` message exits the process).
    pub fn run(self) {
        for stream in self.listener.incoming() {
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            };
            let server = self.server.clone();
            let spawned = thread::Builder::new()
                .name("conn".into())
                .spawn(move || connection(&server, stream));
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot spawn a connection thread");
            }
        }
    }
}

enum Session {
    Context(ContextSession),
    Generation(GenerationSession),
}

/// Serves one control connection until it closes or misbehaves.
fn connection(server: &Server, stream: TcpStream) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "unknown".to_string(), |a| a.to_string());
    let _ = stream.set_nodelay(true);
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "cannot clone a connection socket");
            return;
        }
    };
    let outbox = spawn_writer(writer, peer.clone());
    let mut reader = BufReader::new(stream);
    let mut session = match server {
        Server::Context(_) => Session::Context(ContextSession::default()),
        Server::Generation(_) => Session::Generation(GenerationSession),
    };
    let refusal = loop {
        let message = match read_frame(&mut reader) {
            Ok(m) => m,
            Err(e) if e.is_disconnect() => break None,
            Err(e) => break Some(e.to_string()),
        };
        tracing::trace!(%peer, kind = message.kind(), "message");
        let flow = match (server, &mut session) {
            (Server::Context(s), Session::Context(session)) => s.handle(session, &outbox, message),
            (Server::Generation(s), Session::Generation(session)) => {
                s.handle(session, &outbox, message)
            }
            _ => Flow::Close,
        };
        match flow {
            Flow::Continue => {}
            Flow::Close => break None,
            Flow::Refuse(reason) => break Some(reason),
            Flow::Exit => {
                tracing::info!(%peer, "shutdown requested");
                std::process::exit(0);
            }
        }
    };
    if let Some(reason) = refusal {
        tracing::warn!(%peer, %reason, "refusing connection");
        let _ = outbox.send(Message::Error {
            message: format!("connection refused: {reason}"),
        });
        drop(outbox);
        let stream = reader.get_mut();
        let _ = stream.set_read_timeout(Some(DRAIN));
        drain(stream, DRAIN);
    }
    match (server, &mut session) {
        (Server::Context(s), Session::Context(session)) => s.closed(session),
        (Server::Generation(_), Session::Generation(_)) => {}
        _ => {}
    }
}
