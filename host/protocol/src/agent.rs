//! The per-rank agent protocol: what two [transfer agents] say to each other on the side
//! channel, as messages and state machines, sans I/O.
//!
//! A decode rank dials the side channel of each prefill rank it needs.
//! Every connection runs in a [secure channel](crate::secure) first: a Noise handshake keyed by
//! the deployment's [`Secret`], after which every message is encrypted and authenticated
//! under keys no relay holds. Inside it, rank descriptions ([`AgentMetadata`]) are exchanged
//! and vetted, and only then may requests flow.
//!
//! ```text
//! generation (AgentSession::dial)              context (AgentSession::accept)
//!   ══ secure::dial(secret, intent) ════════▶  secure::accept(secret): checks the intent
//!   ── Metadata(gen) ────────────────────────▶  vet the metadata (the first record proves
//!                                                  the dialer holds the secret); connect to
//!   its worker takes ◀═ UCX AM: tag(session)‖c ══  the declared worker, send it a challenge
//!   ◀── ProveWorker ─────────────────────────────  ask for it back
//!   ── WorkerProof{c} ───────────────────────▶  c matches: the worker is the dialer's own
//!   vet the metadata ◀── Metadata(ctx) | Refused
//!   Ready ── RequestData, Cancel, Hold, Ping ▶  Ready
//!         ◀──────────── Completion, Ping ────
//! ```
//!
//! A message out of order or a message the other side never sends is an [`AgentError`]
//! naming what is wrong; the caller answers with [`AgentMessage::Error`] and closes that
//! connection only. `Ping` is keep-alive traffic: each side sends it when idle, so a reader's
//! timeout tells a silent (stopped, cut off) peer from an idle one.
//!
//! [transfer agents]: https://docs.rs/kvferry-transfer

use std::fmt;

use serde::{Deserialize, Serialize};

pub use crate::secure::{MIN_SECRET_LEN, Secret, SecretError};
use crate::{Completion, Frame, RankDescriptor, RequestData, Role, WireError};

/// What a rank's agent tells its peers about itself: who it is, which planner it binds,
/// where its side channel is, and its rank description (pools, keys, worker address).
///
/// An engine that exchanges metadata on its own channel passes [`to_bytes`](Self::to_bytes)
/// along and the peer reads it with [`from_bytes`](Self::from_bytes), which checks it as
/// hostile input (a frame of this family: magic, version, size cap, exact decode).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentMetadata {
    /// The instance the rank belongs to.
    pub instance: String,
    /// Context (prefill, writes) or generation (decode, is written).
    pub role: Role,
    /// Random per agent start: a restarted rank is a new peer.
    pub epoch: u64,
    /// The bound planner's id.
    pub planner_id: String,
    /// The bound planner's describer id.
    pub describer_id: String,
    /// The bound planner library's version.
    pub planner_version: String,
    /// What the rank holds, for messages.
    pub label: String,
    /// The side channel's advertised `host:port` (prefill ranks; decode ranks dial).
    pub endpoint: Option<String>,
    /// The rank: its `RankInfo`, UCX worker address and pool keys.
    pub rank: RankDescriptor,
}

impl AgentMetadata {
    /// Who this is: instance, rank and epoch.
    pub fn identity(&self) -> PeerIdentity {
        PeerIdentity {
            instance: self.instance.clone(),
            rank: self.rank.info.instance_rank,
            epoch: self.epoch,
        }
    }

    /// The bytes an engine passes to a peer's `add_peer`.
    ///
    /// # Errors
    ///
    /// The description does not fit in a frame.
    pub fn to_bytes(&self) -> Result<Vec<u8>, WireError> {
        let mut out = Vec::new();
        crate::write_frame(&mut out, &AgentMessage::Metadata(Box::new(self.clone())))?;
        Ok(out)
    }

    /// Reads [`to_bytes`](Self::to_bytes) output, checking it as hostile input.
    ///
    /// # Errors
    ///
    /// Not a metadata frame of this protocol version, or bytes after it.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, WireError> {
        let mut reader = bytes;
        let message: AgentMessage = crate::read_frame(&mut reader)?;
        if !reader.is_empty() {
            return Err(WireError::Trailing {
                extra: reader.len(),
            });
        }
        match message {
            AgentMessage::Metadata(m) => Ok(*m),
            other => Err(WireError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("expected agent metadata, found {}", other.kind()),
            ))),
        }
    }
}

/// One start of one rank of one instance.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PeerIdentity {
    /// The instance.
    pub instance: String,
    /// The rank.
    pub rank: u32,
    /// Its start.
    pub epoch: u64,
}

impl fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} rank {} (epoch {:016x})",
            self.instance, self.rank, self.epoch
        )
    }
}

/// One message between two agents.
///
/// New messages are appended, so the encoding of the others does not change.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum AgentMessage {
    /// A rank's description (both ways, the dialer's first).
    Metadata(Box<AgentMetadata>),
    /// The acceptor refuses the dialer's rank; it closes next.
    Refused {
        /// Which check refused it, and why.
        reason: String,
    },
    /// A decode rank's request to this prefill rank.
    RequestData(RequestData),
    /// A prefill rank's report on one piece, after its flush.
    Completion(Completion),
    /// The decode rank abandons a request: the prefill rank answers with the pair's
    /// last completion once none of its writes can still land.
    Cancel {
        /// The request.
        request: u64,
        /// Why.
        reason: String,
    },
    /// Keep-alive.
    Ping,
    /// The decode rank's instance still wants a request it has not claimed (its engine
    /// queued it): the prefill rank extends the request's lease, within a bound of its own.
    Hold {
        /// The request.
        request: u64,
    },
    /// The sender refuses the connection; it closes it next.
    Error {
        /// What was wrong.
        message: String,
    },
    /// The prefill rank sent a challenge to the worker address the decode rank declared,
    /// as a UCX active message ([`WORKER_CHALLENGE_AM`]): the decode rank answers with
    /// the challenge its worker received for this session.
    ProveWorker,
    /// The decode rank's answer: the challenge its worker received for this session
    /// (empty if none arrived in time).
    WorkerProof {
        /// The challenge's random bytes.
        challenge: Vec<u8>,
    },
}

/// The UCX active-message id of a worker challenge.
pub const WORKER_CHALLENGE_AM: u16 = 0x4b46;
/// Bytes of a worker challenge's random part.
pub const WORKER_CHALLENGE_LEN: usize = 32;

/// The tag that ties a worker challenge to one session: a hash of the session's handshake
/// hash ([`crate::secure::Channel::binding`]), which only its two ends know. A worker that
/// receives challenges answers, on a session, only the one tagged for that session — so a
/// peer cannot have another process's worker answer for it, even through a session of its
/// own with that process.
pub fn worker_challenge_tag(binding: &[u8; 32]) -> [u8; 32] {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    h.update(b"kvferry worker challenge v1\0");
    h.update(binding);
    h.finalize().into()
}

impl Frame for AgentMessage {
    const MAGIC: [u8; 4] = *b"KVFA";
    const FAMILY: &'static str = "agent";

    fn kind(&self) -> &'static str {
        match self {
            AgentMessage::Metadata(_) => "Metadata",
            AgentMessage::Refused { .. } => "Refused",
            AgentMessage::RequestData(_) => "RequestData",
            AgentMessage::Completion(_) => "Completion",
            AgentMessage::Cancel { .. } => "Cancel",
            AgentMessage::Ping => "Ping",
            AgentMessage::Hold { .. } => "Hold",
            AgentMessage::Error { .. } => "Error",
            AgentMessage::ProveWorker => "ProveWorker",
            AgentMessage::WorkerProof { .. } => "WorkerProof",
        }
    }

    fn error_text(&self) -> Option<&str> {
        match self {
            AgentMessage::Error { message } => Some(message),
            _ => None,
        }
    }
}

/// Why an agent session cannot go on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The message is not one this side accepts in its current state.
    #[error("{kind} is not expected by a {side} agent session {state}")]
    Unexpected {
        /// `generation` (dialer) or `context` (acceptor).
        side: Role,
        /// The state, in words.
        state: &'static str,
        /// The message's kind.
        kind: &'static str,
    },
    /// The peer's metadata names the wrong role.
    #[error("{peer} is a {found} rank; a {expected} rank was expected")]
    Role {
        /// The peer.
        peer: PeerIdentity,
        /// Its role.
        found: Role,
        /// The role needed.
        expected: Role,
    },
    /// The acceptor refused this rank.
    #[error("refused: {reason}")]
    Refused {
        /// Its reason.
        reason: String,
    },
    /// The peer sent its `Error` message.
    #[error("the peer reported an error and closed: {message}")]
    PeerError {
        /// Its text.
        message: String,
    },
}

/// Where an agent session stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentState {
    /// Waiting for the peer's metadata.
    AwaitMetadata,
    /// The peer's metadata arrived; the caller vets it.
    Vetting,
    /// Acceptor: the worker challenge is out, waiting for the dialer's proof.
    AwaitWorkerProof,
    /// Requests may flow.
    Ready,
    /// Ended.
    Closed,
}

impl AgentState {
    fn words(self) -> &'static str {
        match self {
            AgentState::AwaitMetadata => "waiting for metadata",
            AgentState::Vetting => "vetting the peer",
            AgentState::AwaitWorkerProof => "waiting for the worker's proof",
            AgentState::Ready => "ready",
            AgentState::Closed => "closed",
        }
    }
}

/// What a message meant to a session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentEvent {
    /// Nothing for the caller (keep-alive).
    Nothing,
    /// The peer authenticated and described itself: vet it, then `accept`/`ready` or
    /// `refuse`.
    Metadata(Box<AgentMetadata>),
    /// A decode rank's request (acceptor only).
    RequestData(Box<RequestData>),
    /// A prefill rank's report (dialer only).
    Completion(Completion),
    /// The acceptor asks for the challenge the dialer's worker received (dialer only).
    ProveWorker,
    /// The dialer's answer to [`AgentSession::challenge`] (acceptor only).
    WorkerProof(Vec<u8>),
    /// A decode rank abandons a request (acceptor only).
    Cancel {
        /// The request.
        request: u64,
        /// Why.
        reason: String,
    },
    /// A decode rank's instance still wants a request (acceptor only).
    Hold {
        /// The request.
        request: u64,
    },
}

/// One side of one agent connection: the decode rank dials
/// ([`AgentSession::dial`]), the prefill rank accepts ([`AgentSession::accept`]).
#[derive(Clone, Debug)]
pub struct AgentSession {
    side: Role,
    state: AgentState,
}

impl AgentSession {
    /// A decode rank's session over an established channel, and the first message to
    /// send: its own description.
    pub fn dial(metadata: AgentMetadata) -> (Self, AgentMessage) {
        (
            Self {
                side: Role::Decode,
                state: AgentState::AwaitMetadata,
            },
            AgentMessage::Metadata(Box::new(metadata)),
        )
    }

    /// A prefill rank's session over an accepted channel.
    pub fn accept() -> Self {
        Self {
            side: Role::Prefill,
            state: AgentState::AwaitMetadata,
        }
    }

    /// Where the session stands.
    pub fn state(&self) -> AgentState {
        self.state
    }

    /// The acceptor has vetted the dialer's metadata: the reply carries its own.
    ///
    /// # Errors
    ///
    /// Not vetting, or this is the dialer.
    pub fn admit(&mut self, own: AgentMetadata) -> Result<AgentMessage, AgentError> {
        self.expect_vetting(Role::Prefill, "Metadata")?;
        self.state = AgentState::Ready;
        Ok(AgentMessage::Metadata(Box::new(own)))
    }

    /// The acceptor, vetting, has sent a challenge to the dialer's declared worker: the
    /// message asking for it back. The dialer's [`AgentMessage::WorkerProof`] follows.
    ///
    /// # Errors
    ///
    /// Not vetting, or this is the dialer.
    pub fn challenge(&mut self) -> Result<AgentMessage, AgentError> {
        self.expect_vetting(Role::Prefill, "ProveWorker")?;
        self.state = AgentState::AwaitWorkerProof;
        Ok(AgentMessage::ProveWorker)
    }

    /// The dialer has vetted the acceptor's metadata: requests may go out.
    ///
    /// # Errors
    ///
    /// Not vetting, or this is the acceptor.
    pub fn ready(&mut self) -> Result<(), AgentError> {
        self.expect_vetting(Role::Decode, "ready")?;
        self.state = AgentState::Ready;
        Ok(())
    }

    /// Refuses the peer after vetting: the message to send before closing.
    pub fn refuse(&mut self, reason: String) -> AgentMessage {
        self.state = AgentState::Closed;
        match self.side {
            Role::Prefill => AgentMessage::Refused { reason },
            Role::Decode => AgentMessage::Error { message: reason },
        }
    }

    fn expect_vetting(&self, side: Role, kind: &'static str) -> Result<(), AgentError> {
        if self.side != side || self.state != AgentState::Vetting {
            return Err(AgentError::Unexpected {
                side: self.side,
                state: self.state.words(),
                kind,
            });
        }
        Ok(())
    }

    /// Feeds one message from the peer.
    ///
    /// # Errors
    ///
    /// See [`AgentError`]; the session is closed after any error.
    pub fn receive(&mut self, message: AgentMessage) -> Result<AgentEvent, AgentError> {
        let result = self.step(message);
        if result.is_err() {
            self.state = AgentState::Closed;
        }
        result
    }

    fn step(&mut self, message: AgentMessage) -> Result<AgentEvent, AgentError> {
        use AgentMessage as M;
        use AgentState as S;
        if let M::Error { message } = &message {
            return Err(AgentError::PeerError {
                message: message.clone(),
            });
        }
        let expected_role = match self.side {
            Role::Decode => Role::Prefill,
            Role::Prefill => Role::Decode,
        };
        match (self.side, self.state, message) {
            (_, S::AwaitMetadata, M::Metadata(m)) => {
                if m.role != expected_role {
                    return Err(AgentError::Role {
                        peer: m.identity(),
                        found: m.role,
                        expected: expected_role,
                    });
                }
                self.state = S::Vetting;
                Ok(AgentEvent::Metadata(m))
            }
            (Role::Decode, S::AwaitMetadata, M::Refused { reason }) => {
                Err(AgentError::Refused { reason })
            }
            (Role::Decode, S::AwaitMetadata, M::ProveWorker) => Ok(AgentEvent::ProveWorker),
            (Role::Prefill, S::AwaitWorkerProof, M::WorkerProof { challenge }) => {
                self.state = S::Vetting;
                Ok(AgentEvent::WorkerProof(challenge))
            }
            (_, S::Ready, M::Ping) => Ok(AgentEvent::Nothing),
            (Role::Prefill, S::Ready, M::RequestData(data)) => {
                Ok(AgentEvent::RequestData(Box::new(data)))
            }
            (Role::Prefill, S::Ready, M::Cancel { request, reason }) => {
                Ok(AgentEvent::Cancel { request, reason })
            }
            (Role::Prefill, S::Ready, M::Hold { request }) => Ok(AgentEvent::Hold { request }),
            (Role::Decode, S::Ready, M::Completion(c)) => Ok(AgentEvent::Completion(c)),
            (side, state, message) => Err(AgentError::Unexpected {
                side,
                state: state.words(),
                kind: message.kind(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acceptor_takes_nothing_before_metadata() {
        let mut acceptor = AgentSession::accept();
        let err = acceptor
            .receive(AgentMessage::RequestData(sample_request()))
            .unwrap_err();
        assert!(
            matches!(
                err,
                AgentError::Unexpected {
                    kind: "RequestData",
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(acceptor.state(), AgentState::Closed);
    }

    fn sample_request() -> RequestData {
        RequestData {
            request: 1,
            receiver_instance: "gen".into(),
            receiver_rank: 0,
            sender_rank: 0,
            slot_tables: Vec::new(),
            token_range: kvferry_planner_abi::TokenRange { start: 0, end: 1 },
            prompt_len: 1,
            dst_start_token: None,
            excluded_views: Vec::new(),
            bounce: None,
            integrity: None,
        }
    }
}
