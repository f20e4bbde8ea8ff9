//! The per-peer state machines: which message may come when, on each side of a peer
//! connection.
//!
//! A generation instance dials a context server and drives a [`Dialer`]; the context server
//! drives one [`Acceptor`] per accepted connection. Neither does I/O: the caller reads a
//! frame, hands the message to `receive`, acts on the event, and writes the messages the
//! state machine hands back.
//!
//! ```text
//! generation (Dialer)                         context (Acceptor)
//!   new() ── InstanceInfoRequest ─────────▶   InfoRequested → answer InstanceInfo
//!   AwaitInfo  ◀──────────── InstanceInfo ──
//!   Vetting: the caller checks planner ids, pages, check_peer
//!   register() ── Register ───────────────▶   Vetting: the caller checks the same
//!   AwaitVerdict ◀── Registered | Refused ──   accept() → Registered | refuse() → Closed
//!   Ready ── RequestData, Cancel ─────────▶   Registered: RequestData, Cancel
//!         ◀──────────────── Completion ────
//! ```
//!
//! Anything out of order — a `RequestData` before `Register`, a `Completion` before the
//! verdict, a message the other side never sends — is a [`SessionError`] naming the state and
//! the message; the caller answers it with [`PeerMessage::Error`] and closes that connection
//! only. A peer's own `Error` message ends the session with its text.

use crate::{Completion, Frame, InstanceInfo, PeerMessage, RequestData, Role};

/// Why a session cannot go on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// The message is not one this side accepts in its current state.
    #[error("{kind} is not expected by a {side} session {state}")]
    Unexpected {
        /// `generation` or `context`.
        side: Role,
        /// The state, in words (e.g. `waiting for InstanceInfo`).
        state: &'static str,
        /// The message's kind.
        kind: &'static str,
    },
    /// The peer describes itself with the wrong role.
    #[error("the peer {instance} is a {found} instance; a {expected} instance was expected")]
    Role {
        /// The peer's instance name.
        instance: String,
        /// Its role.
        found: Role,
        /// The role this side needs.
        expected: Role,
    },
    /// A request names a receiver other than the registered instance, or a rank it lacks.
    #[error("RequestData for request {request} names {found}, but {registered} registered")]
    WrongReceiver {
        /// The request.
        request: u64,
        /// The receiver it names (instance and rank).
        found: String,
        /// The registered instance and its rank count.
        registered: String,
    },
    /// The peer sent its `Error` message: it closes the connection.
    #[error("the peer reported an error and closed: {message}")]
    PeerError {
        /// Its text.
        message: String,
    },
}

/// Where a [`Dialer`] stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DialState {
    /// `InstanceInfoRequest` sent; waiting for `InstanceInfo`.
    AwaitInfo,
    /// The peer's description arrived; the caller vets it, then calls
    /// [`Dialer::register`] (or drops the session).
    Vetting,
    /// `Register` sent; waiting for the verdict.
    AwaitVerdict,
    /// Registered: requests may go out, completions come in.
    Ready,
    /// The session ended (refused, or broken).
    Closed,
}

/// What a message meant to a [`Dialer`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DialEvent {
    /// The context server described itself: vet it, then [`Dialer::register`].
    Info(Box<InstanceInfo>),
    /// The context server accepted the registration.
    Registered {
        /// Its instance name.
        instance: String,
    },
    /// The context server refused the registration; the session is closed.
    Refused {
        /// Its reason.
        reason: String,
    },
    /// A sender's report on one piece.
    Completion(Completion),
    /// The context server abandons a request.
    Cancel {
        /// The request.
        request: u64,
        /// Why.
        reason: String,
    },
}

/// The generation side of one peer connection.
#[derive(Clone, Debug)]
pub struct Dialer {
    state: DialState,
}

impl Dialer {
    /// A new session, and the first message to send.
    pub fn new() -> (Self, PeerMessage) {
        (
            Self {
                state: DialState::AwaitInfo,
            },
            PeerMessage::InstanceInfoRequest,
        )
    }

    /// Where the session stands.
    pub fn state(&self) -> &DialState {
        &self.state
    }

    /// The `Register` message for this instance's description, once the peer's was vetted.
    ///
    /// # Errors
    ///
    /// The session is not vetting (no `InstanceInfo` came yet, or it registered already), or
    /// `own` is not a generation instance.
    pub fn register(&mut self, own: InstanceInfo) -> Result<PeerMessage, SessionError> {
        if self.state != DialState::Vetting {
            return Err(self.unexpected("Register"));
        }
        if own.role != Role::Generation {
            return Err(SessionError::Role {
                instance: own.instance_name,
                found: own.role,
                expected: Role::Generation,
            });
        }
        self.state = DialState::AwaitVerdict;
        Ok(PeerMessage::Register(own))
    }

    fn unexpected(&self, kind: &'static str) -> SessionError {
        SessionError::Unexpected {
            side: Role::Generation,
            state: match self.state {
                DialState::AwaitInfo => "waiting for InstanceInfo",
                DialState::Vetting => "vetting the peer",
                DialState::AwaitVerdict => "waiting for the registration verdict",
                DialState::Ready => "registered",
                DialState::Closed => "closed",
            },
            kind,
        }
    }

    /// Handles one message from the context server.
    ///
    /// # Errors
    ///
    /// A message out of order, a peer that is not a context instance, or the peer's `Error`;
    /// the session is closed after any of them.
    pub fn receive(&mut self, message: PeerMessage) -> Result<DialEvent, SessionError> {
        let result = match (&self.state, message) {
            (_, PeerMessage::Error { message }) => Err(SessionError::PeerError { message }),
            (DialState::AwaitInfo, PeerMessage::InstanceInfo(info)) => {
                if info.role == Role::Context {
                    self.state = DialState::Vetting;
                    Ok(DialEvent::Info(Box::new(info)))
                } else {
                    Err(SessionError::Role {
                        instance: info.instance_name,
                        found: info.role,
                        expected: Role::Context,
                    })
                }
            }
            (DialState::AwaitVerdict, PeerMessage::Registered { instance }) => {
                self.state = DialState::Ready;
                Ok(DialEvent::Registered { instance })
            }
            (DialState::AwaitVerdict, PeerMessage::Refused { reason }) => {
                self.state = DialState::Closed;
                Ok(DialEvent::Refused { reason })
            }
            (DialState::Ready, PeerMessage::Completion(c)) => Ok(DialEvent::Completion(c)),
            (DialState::Ready, PeerMessage::Cancel { request, reason }) => {
                Ok(DialEvent::Cancel { request, reason })
            }
            (_, other) => Err(self.unexpected(other.kind())),
        };
        if result.is_err() {
            self.state = DialState::Closed;
        }
        result
    }
}

/// Where an [`Acceptor`] stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcceptState {
    /// No registration yet: only `InstanceInfoRequest` and `Register` are accepted.
    Open,
    /// A `Register` arrived; the caller vets it, then [`Acceptor::accept`]s or
    /// [`Acceptor::refuse`]s it.
    Vetting,
    /// A generation instance registered.
    Registered {
        /// Its instance name.
        instance: String,
        /// Its rank count.
        ranks: u32,
    },
    /// The session ended.
    Closed,
}

/// What a message meant to an [`Acceptor`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcceptEvent {
    /// The peer asks for this instance's description: answer [`PeerMessage::InstanceInfo`].
    InfoRequested,
    /// A generation instance registers: vet it, then [`Acceptor::accept`] or
    /// [`Acceptor::refuse`].
    Register(Box<InstanceInfo>),
    /// A registered receiver rank asks for a request's bytes.
    RequestData(Box<RequestData>),
    /// The registered instance abandons a request.
    Cancel {
        /// The request.
        request: u64,
        /// Why.
        reason: String,
    },
}

/// The context side of one peer connection.
#[derive(Clone, Debug)]
pub struct Acceptor {
    state: AcceptState,
    /// The registration being vetted: name and rank count.
    pending: Option<(String, u32)>,
}

impl Default for Acceptor {
    fn default() -> Self {
        Self::new()
    }
}

impl Acceptor {
    /// A new session on an accepted connection.
    pub fn new() -> Self {
        Self {
            state: AcceptState::Open,
            pending: None,
        }
    }

    /// Where the session stands.
    pub fn state(&self) -> &AcceptState {
        &self.state
    }

    /// The registered instance's name, if one registered.
    pub fn registered(&self) -> Option<&str> {
        match &self.state {
            AcceptState::Registered { instance, .. } => Some(instance),
            _ => None,
        }
    }

    /// Accepts the registration being vetted; returns the answer to send.
    ///
    /// # Errors
    ///
    /// No registration is being vetted.
    pub fn accept(&mut self, own_name: &str) -> Result<PeerMessage, SessionError> {
        let Some((instance, ranks)) = self
            .pending
            .take()
            .filter(|_| self.state == AcceptState::Vetting)
        else {
            return Err(self.unexpected("Registered"));
        };
        self.state = AcceptState::Registered { instance, ranks };
        Ok(PeerMessage::Registered {
            instance: own_name.to_string(),
        })
    }

    /// Refuses the registration being vetted; returns the answer to send, after which the
    /// caller closes the connection.
    pub fn refuse(&mut self, reason: String) -> PeerMessage {
        self.pending = None;
        self.state = AcceptState::Closed;
        PeerMessage::Refused { reason }
    }

    fn unexpected(&self, kind: &'static str) -> SessionError {
        SessionError::Unexpected {
            side: Role::Context,
            state: match self.state {
                AcceptState::Open => "before Register",
                AcceptState::Vetting => "vetting a registration",
                AcceptState::Registered { .. } => "registered",
                AcceptState::Closed => "closed",
            },
            kind,
        }
    }

    /// Handles one message from the generation instance.
    ///
    /// A registered instance may register again on the same connection (it replaces the
    /// first registration once accepted); a `Cancel` before any registration concerns no
    /// request of this session and is answered with nothing.
    ///
    /// # Errors
    ///
    /// A message out of order (a `RequestData` before `Register`, a message only a context
    /// server sends), a registration of a non-generation instance, a request naming another
    /// receiver or a rank the registered instance lacks, or the peer's `Error`; the session is
    /// closed after any of them.
    pub fn receive(&mut self, message: PeerMessage) -> Result<Option<AcceptEvent>, SessionError> {
        let result = match (&self.state, message) {
            (AcceptState::Closed, other) => Err(self.unexpected(other.kind())),
            (_, PeerMessage::Error { message }) => Err(SessionError::PeerError { message }),
            (AcceptState::Vetting, other) => Err(self.unexpected(other.kind())),
            (_, PeerMessage::InstanceInfoRequest) => Ok(Some(AcceptEvent::InfoRequested)),
            (_, PeerMessage::Register(info)) => {
                if info.role == Role::Generation {
                    let ranks = u32::try_from(info.ranks.len()).unwrap_or(u32::MAX);
                    self.pending = Some((info.instance_name.clone(), ranks));
                    self.state = AcceptState::Vetting;
                    Ok(Some(AcceptEvent::Register(Box::new(info))))
                } else {
                    Err(SessionError::Role {
                        instance: info.instance_name,
                        found: info.role,
                        expected: Role::Generation,
                    })
                }
            }
            (AcceptState::Registered { instance, ranks }, PeerMessage::RequestData(data)) => {
                if data.receiver_instance != *instance || data.receiver_rank >= *ranks {
                    Err(SessionError::WrongReceiver {
                        request: data.request,
                        found: format!(
                            "instance {} rank {}",
                            data.receiver_instance, data.receiver_rank
                        ),
                        registered: format!("instance {instance} with {ranks} rank(s)"),
                    })
                } else {
                    Ok(Some(AcceptEvent::RequestData(Box::new(data))))
                }
            }
            (AcceptState::Registered { .. }, PeerMessage::Cancel { request, reason }) => {
                Ok(Some(AcceptEvent::Cancel { request, reason }))
            }
            (AcceptState::Open, PeerMessage::Cancel { .. }) => Ok(None),
            (_, other) => Err(self.unexpected(other.kind())),
        };
        if result.is_err() {
            self.pending = None;
            self.state = AcceptState::Closed;
        }
        result
    }
}
