//! The per-rank agent protocol: what two [transfer agents] say to each other on the side
//! channel, as messages and state machines, sans I/O.
//!
//! A generation (decode) rank dials the side channel of each context (prefill) rank it needs.
//! Before anything else both sides prove they hold the deployment's shared [`Secret`] —
//! without sending it: each proves it by an HMAC-SHA256 over both sides' fresh nonces, under
//! its own role's label, so a proof can be neither replayed on another connection nor
//! reflected back. Only then are rank descriptions ([`AgentMetadata`]) exchanged and vetted,
//! and only then may requests flow.
//!
//! ```text
//! generation (AgentDialer)                     context (AgentAcceptor)
//!   new(secret, nonce_d) ── Hello{nonce_d} ──▶  Challenge{nonce_a, proof_a}
//!   verify proof_a ◀──────────────────────────
//!   ── Proof{proof_d}, Metadata(gen) ────────▶  verify proof_d, vet the metadata
//!   vet the metadata ◀── Metadata(ctx) | Refused
//!   Ready ── RequestData, Cancel, Ping ──────▶  Ready
//!         ◀──────────── Completion, Ping ────
//! ```
//!
//! A wrong proof, a message out of order or a message the other side never sends is an
//! [`AgentError`] naming what is wrong; the caller answers with [`AgentMessage::Error`] where
//! the peer has authenticated (never before: an unauthenticated peer learns nothing) and
//! closes that connection only. `Ping` is keep-alive traffic: each side sends it when idle,
//! so a reader's timeout tells a silent (stopped, cut off) peer from an idle one.
//!
//! [transfer agents]: https://docs.rs/kvferry-transfer

use std::fmt;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::{Completion, Frame, RankDescriptor, RequestData, Role, WireError};

/// Bytes of a handshake nonce and of a proof.
pub const NONCE_LEN: usize = 32;
/// The shortest shared secret accepted.
pub const MIN_SECRET_LEN: usize = 16;

/// A handshake nonce: fresh random bytes per connection and side.
pub type Nonce = [u8; NONCE_LEN];
/// An HMAC-SHA256 proof of the shared secret over both nonces.
pub type Proof = [u8; NONCE_LEN];

/// The deployment's shared secret, which every agent of a deployment holds and proves.
///
/// Its bytes never appear in `Debug` output or on the wire.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    key: Vec<u8>,
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            f.write_str("Secret(none)")
        } else {
            write!(f, "Secret({} bytes, redacted)", self.key.len())
        }
    }
}

/// Why a secret was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a shared secret must be at least {MIN_SECRET_LEN} bytes; this one has {len}")]
pub struct SecretError {
    /// Its length.
    pub len: usize,
}

impl Secret {
    /// A secret of at least [`MIN_SECRET_LEN`] bytes.
    ///
    /// # Errors
    ///
    /// A shorter one.
    pub fn new(key: impl Into<Vec<u8>>) -> Result<Self, SecretError> {
        let key = key.into();
        if key.len() < MIN_SECRET_LEN {
            return Err(SecretError { len: key.len() });
        }
        Ok(Self { key })
    }

    /// No secret: peers are not authenticated. Two agents without a secret accept each
    /// other; an agent without one and an agent with one refuse each other. For tests and
    /// single-user machines only — any local process can then drive the agent.
    pub fn unauthenticated() -> Self {
        Self { key: Vec::new() }
    }

    /// Whether this is [`Secret::unauthenticated`].
    pub fn is_unauthenticated(&self) -> bool {
        self.key.is_empty()
    }

    fn mac(&self, label: &[u8], dialer: &Nonce, acceptor: &Nonce) -> Hmac<Sha256> {
        // HMAC takes keys of any length, the empty one included.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
        mac.update(b"kvferry agent v1\0");
        mac.update(label);
        mac.update(dialer);
        mac.update(acceptor);
        mac
    }

    /// The proof `role` gives on a connection with these nonces.
    pub fn prove(&self, role: Role, dialer: &Nonce, acceptor: &Nonce) -> Proof {
        self.mac(label(role), dialer, acceptor)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is `role`'s proof on a connection with these nonces (compared in
    /// constant time).
    pub fn verify(&self, role: Role, dialer: &Nonce, acceptor: &Nonce, proof: &Proof) -> bool {
        self.mac(label(role), dialer, acceptor)
            .verify_slice(proof)
            .is_ok()
    }
}

fn label(role: Role) -> &'static [u8] {
    match role {
        Role::Generation => b"generation dials\0",
        Role::Context => b"context accepts\0",
    }
}

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
    /// The side channel's advertised `host:port` (context ranks; generation ranks dial).
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
    /// The dialer's first message: its nonce.
    Hello {
        /// Fresh random bytes.
        nonce: Nonce,
    },
    /// The acceptor's nonce and its proof of the secret.
    Challenge {
        /// Fresh random bytes.
        nonce: Nonce,
        /// HMAC of the secret over both nonces, under the context label.
        proof: Proof,
    },
    /// The dialer's proof of the secret.
    Proof {
        /// HMAC of the secret over both nonces, under the generation label.
        proof: Proof,
    },
    /// A rank's description (both ways, after the proofs).
    Metadata(Box<AgentMetadata>),
    /// The acceptor refuses the dialer's rank; it closes next.
    Refused {
        /// Which check refused it, and why.
        reason: String,
    },
    /// A generation rank's request to this context rank.
    RequestData(RequestData),
    /// A context rank's report on one piece, after its flush.
    Completion(Completion),
    /// The generation rank abandons a request: the context rank answers with the pair's
    /// last completion once none of its writes can still land.
    Cancel {
        /// The request.
        request: u64,
        /// Why.
        reason: String,
    },
    /// Keep-alive.
    Ping,
    /// The sender refuses the connection; it closes it next.
    Error {
        /// What was wrong.
        message: String,
    },
}

impl Frame for AgentMessage {
    const MAGIC: [u8; 4] = *b"KVFA";
    const FAMILY: &'static str = "agent";

    fn kind(&self) -> &'static str {
        match self {
            AgentMessage::Hello { .. } => "Hello",
            AgentMessage::Challenge { .. } => "Challenge",
            AgentMessage::Proof { .. } => "Proof",
            AgentMessage::Metadata(_) => "Metadata",
            AgentMessage::Refused { .. } => "Refused",
            AgentMessage::RequestData(_) => "RequestData",
            AgentMessage::Completion(_) => "Completion",
            AgentMessage::Cancel { .. } => "Cancel",
            AgentMessage::Ping => "Ping",
            AgentMessage::Error { .. } => "Error",
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
    /// The peer's proof is wrong: it does not hold this deployment's secret (or holds one
    /// where this side has none, or the reverse).
    #[error("the peer did not prove the shared secret (a different secret, or one side has none)")]
    Unauthenticated,
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
    /// Dialer: `Hello` sent, waiting for the challenge.
    AwaitChallenge,
    /// Acceptor: waiting for `Hello`.
    AwaitHello,
    /// Acceptor: challenge sent, waiting for the dialer's proof.
    AwaitProof,
    /// Authenticated; waiting for the peer's metadata.
    AwaitMetadata,
    /// The peer's metadata arrived; the caller vets it.
    Vetting,
    /// Requests may flow.
    Ready,
    /// Ended.
    Closed,
}

impl AgentState {
    fn words(self) -> &'static str {
        match self {
            AgentState::AwaitChallenge => "waiting for the challenge",
            AgentState::AwaitHello => "waiting for Hello",
            AgentState::AwaitProof => "waiting for the proof",
            AgentState::AwaitMetadata => "waiting for metadata",
            AgentState::Vetting => "vetting the peer",
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
    /// Send these, in order (the handshake's next step).
    Reply(Vec<AgentMessage>),
    /// The peer authenticated and described itself: vet it, then `accept`/`ready` or
    /// `refuse`.
    Metadata(Box<AgentMetadata>),
    /// A generation rank's request (acceptor only).
    RequestData(Box<RequestData>),
    /// A context rank's report (dialer only).
    Completion(Completion),
    /// A generation rank abandons a request (acceptor only).
    Cancel {
        /// The request.
        request: u64,
        /// Why.
        reason: String,
    },
}

/// One side of one agent connection: the generation rank dials
/// ([`AgentSession::dial`]), the context rank accepts ([`AgentSession::accept`]).
#[derive(Clone)]
pub struct AgentSession {
    side: Role,
    state: AgentState,
    secret: Secret,
    own: Nonce,
    peer: Nonce,
    metadata: Option<Box<AgentMetadata>>,
}

impl fmt::Debug for AgentSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentSession")
            .field("side", &self.side)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl AgentSession {
    /// A generation rank's session, dialing with `metadata` as its own description, and the
    /// first message to send. `nonce` must be fresh random bytes.
    pub fn dial(secret: Secret, nonce: Nonce, metadata: AgentMetadata) -> (Self, AgentMessage) {
        (
            Self {
                side: Role::Generation,
                state: AgentState::AwaitChallenge,
                secret,
                own: nonce,
                peer: [0; NONCE_LEN],
                metadata: Some(Box::new(metadata)),
            },
            AgentMessage::Hello { nonce },
        )
    }

    /// A context rank's session for an accepted connection. `nonce` must be fresh random
    /// bytes.
    pub fn accept(secret: Secret, nonce: Nonce) -> Self {
        Self {
            side: Role::Context,
            state: AgentState::AwaitHello,
            secret,
            own: nonce,
            peer: [0; NONCE_LEN],
            metadata: None,
        }
    }

    /// Where the session stands.
    pub fn state(&self) -> AgentState {
        self.state
    }

    /// Whether the peer has proved the secret (so it may be told why it is refused).
    pub fn authenticated(&self) -> bool {
        matches!(
            self.state,
            AgentState::AwaitMetadata | AgentState::Vetting | AgentState::Ready
        )
    }

    /// The acceptor has vetted the dialer's metadata: the reply carries its own.
    ///
    /// # Errors
    ///
    /// Not vetting, or this is the dialer.
    pub fn admit(&mut self, own: AgentMetadata) -> Result<AgentMessage, AgentError> {
        self.expect_vetting(Role::Context, "Metadata")?;
        self.state = AgentState::Ready;
        Ok(AgentMessage::Metadata(Box::new(own)))
    }

    /// The dialer has vetted the acceptor's metadata: requests may go out.
    ///
    /// # Errors
    ///
    /// Not vetting, or this is the acceptor.
    pub fn ready(&mut self) -> Result<(), AgentError> {
        self.expect_vetting(Role::Generation, "ready")?;
        self.state = AgentState::Ready;
        Ok(())
    }

    /// Refuses the peer after vetting: the message to send before closing.
    pub fn refuse(&mut self, reason: String) -> AgentMessage {
        self.state = AgentState::Closed;
        match self.side {
            Role::Context => AgentMessage::Refused { reason },
            Role::Generation => AgentMessage::Error { message: reason },
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
            if self.authenticated() || self.state == S::AwaitChallenge {
                return Err(AgentError::PeerError {
                    message: message.clone(),
                });
            }
        }
        let expected_role = match self.side {
            Role::Generation => Role::Context,
            Role::Context => Role::Generation,
        };
        match (self.side, self.state, message) {
            (Role::Generation, S::AwaitChallenge, M::Challenge { nonce, proof }) => {
                if !self.secret.verify(Role::Context, &self.own, &nonce, &proof) {
                    return Err(AgentError::Unauthenticated);
                }
                self.peer = nonce;
                self.state = S::AwaitMetadata;
                let proof = self.secret.prove(Role::Generation, &self.own, &nonce);
                let own = self
                    .metadata
                    .take()
                    .unwrap_or_else(|| unreachable!("a dialer holds its metadata until proved"));
                Ok(AgentEvent::Reply(vec![
                    M::Proof { proof },
                    M::Metadata(own),
                ]))
            }
            (Role::Context, S::AwaitHello, M::Hello { nonce }) => {
                self.peer = nonce;
                self.state = S::AwaitProof;
                let proof = self.secret.prove(Role::Context, &nonce, &self.own);
                Ok(AgentEvent::Reply(vec![M::Challenge {
                    nonce: self.own,
                    proof,
                }]))
            }
            (Role::Context, S::AwaitProof, M::Proof { proof }) => {
                if !self
                    .secret
                    .verify(Role::Generation, &self.peer, &self.own, &proof)
                {
                    return Err(AgentError::Unauthenticated);
                }
                self.state = S::AwaitMetadata;
                Ok(AgentEvent::Nothing)
            }
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
            (Role::Generation, S::AwaitMetadata, M::Refused { reason }) => {
                Err(AgentError::Refused { reason })
            }
            (_, S::Ready, M::Ping) => Ok(AgentEvent::Nothing),
            (Role::Context, S::Ready, M::RequestData(data)) => {
                Ok(AgentEvent::RequestData(Box::new(data)))
            }
            (Role::Context, S::Ready, M::Cancel { request, reason }) => {
                Ok(AgentEvent::Cancel { request, reason })
            }
            (Role::Generation, S::Ready, M::Completion(c)) => Ok(AgentEvent::Completion(c)),
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

    fn secret(b: u8) -> Secret {
        Secret::new(vec![b; 32]).unwrap()
    }

    #[test]
    fn short_secrets_are_refused_and_never_printed() {
        assert_eq!(Secret::new(b"short".to_vec()), Err(SecretError { len: 5 }));
        let s = Secret::new(b"0123456789abcdef-very-secret".to_vec()).unwrap();
        let shown = format!("{s:?}");
        assert!(!shown.contains("very-secret"), "{shown}");
        assert_eq!(format!("{:?}", Secret::unauthenticated()), "Secret(none)");
    }

    #[test]
    fn proofs_bind_the_role_and_both_nonces() {
        let s = secret(7);
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let p = s.prove(Role::Generation, &a, &b);
        assert!(s.verify(Role::Generation, &a, &b, &p));
        assert!(!s.verify(Role::Context, &a, &b, &p), "reflected");
        assert!(!s.verify(Role::Generation, &b, &a, &p), "nonces swapped");
        assert!(!s.verify(Role::Generation, &a, &[3; 32], &p), "replayed");
        assert!(
            !secret(8).verify(Role::Generation, &a, &b, &p),
            "other secret"
        );
        let none = Secret::unauthenticated();
        let q = none.prove(Role::Generation, &a, &b);
        assert!(none.verify(Role::Generation, &a, &b, &q));
        assert!(!s.verify(Role::Generation, &a, &b, &q));
    }

    #[test]
    fn an_acceptor_without_hello_and_proof_accepts_nothing() {
        let mut acceptor = AgentSession::accept(secret(1), [9; 32]);
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
        }
    }
}
