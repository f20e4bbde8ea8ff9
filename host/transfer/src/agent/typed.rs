//! Role-typed faces of the agent: a [`PrefillAgent`] has the calls a prefill rank makes and a
//! [`DecodeAgent`] those of a decode rank, so a call of the wrong role does not compile.
//! Both are the same [`Agent`] underneath (as rustls's `ClientConnection` and
//! `ServerConnection` are one connection core); [`Agent`] itself stays for the bindings whose
//! role is known only at run time (the C API, Python), where a wrong-role call is the
//! [`CallError::Role`] error.
//!
//! ```no_run
//! use kvferry_transfer::agent::{DecodeAgent, Expect};
//! fn receive(agent: &DecodeAgent, expect: Expect) {
//!     agent.expect(expect).unwrap();
//! }
//! ```
//!
//! A prefill agent has no `expect`:
//!
//! ```compile_fail,E0599
//! use kvferry_transfer::agent::{Expect, PrefillAgent};
//! fn receive(agent: &PrefillAgent, expect: Expect) {
//!     agent.expect(expect).unwrap();
//! }
//! ```

use std::os::fd::RawFd;

use kvferry_loader::BoundPlanner;
use kvferry_planner_abi::RankInfo;
use kvferry_protocol::PeerIdentity;

use super::{Agent, AgentConfig, AgentStats, CallError, Event, Expect, SendChunk, StartError};
use crate::Role;

/// A prefill rank's agent: it listens on its side channel and makes requests' KV cache
/// available ([`send`](Self::send)) to the decode ranks that claim them.
#[derive(Debug)]
pub struct PrefillAgent {
    agent: Agent,
}

/// A decode rank's agent: it learns prefill ranks ([`add_peer`](Self::add_peer) or the
/// endpoints of each request) and receives requests into its slots
/// ([`expect`](Self::expect)).
#[derive(Debug)]
pub struct DecodeAgent {
    agent: Agent,
}

/// `config.role` must be `role`.
fn check_role(config: &AgentConfig, role: Role) -> Result<(), StartError> {
    if config.role == role {
        Ok(())
    } else {
        Err(StartError::Config(format!(
            "the configuration's role is {}, but a {role} agent was asked for",
            config.role
        )))
    }
}

/// The calls both roles make, delegated to the shared [`Agent`].
macro_rules! shared_calls {
    () => {
        /// This rank's metadata, for engines that exchange it on their own channel.
        ///
        /// # Errors
        ///
        /// The description does not fit in a frame.
        pub fn local_metadata(&self) -> Result<Vec<u8>, CallError> {
            self.agent.local_metadata()
        }

        /// Who this agent is.
        pub fn identity(&self) -> PeerIdentity {
            self.agent.identity()
        }

        /// This rank's description as peers see it.
        pub fn rank_info(&self) -> &RankInfo {
            self.agent.rank_info()
        }

        /// Cancels a request (see [`Agent::cancel`]).
        ///
        /// # Errors
        ///
        /// [`CallError::Unknown`] if the request is not known or has ended.
        pub fn cancel(&self, request: u64) -> Result<(), CallError> {
            self.agent.cancel(request)
        }

        /// Every event since the last call, oldest first.
        pub fn poll(&self) -> Vec<Event> {
            self.agent.poll()
        }

        /// A descriptor that is readable while events wait (see [`Agent::wake_fd`]).
        pub fn wake_fd(&self) -> RawFd {
            self.agent.wake_fd()
        }

        /// Makes the descriptor readable again (see [`Agent::rewake`]).
        pub fn rewake(&self) {
            self.agent.rewake()
        }

        /// Requests this agent holds (in flight, not yet ended).
        pub fn requests_held(&self) -> usize {
            self.agent.requests_held()
        }

        /// What this agent did since it started (see [`AgentStats`]).
        pub fn stats(&self) -> AgentStats {
            self.agent.stats()
        }

        /// Vetted peer connections.
        pub fn connections(&self) -> usize {
            self.agent.connections()
        }

        /// The role-agnostic agent underneath, for code that serves either role.
        pub fn as_agent(&self) -> &Agent {
            &self.agent
        }
    };
}

impl PrefillAgent {
    /// Starts a prefill rank's agent (see [`Agent::start`]).
    ///
    /// # Safety
    ///
    /// As [`Agent::start`]: every pool of `config.rank.page_table` is engine-owned memory of
    /// the type it names, live and left alone as the protocol requires for the agent's life.
    ///
    /// # Errors
    ///
    /// A configuration whose role is not prefill ([`StartError::Config`]), or what
    /// [`Agent::start`] refuses.
    pub unsafe fn start(config: AgentConfig, bound: BoundPlanner) -> Result<Self, StartError> {
        check_role(&config, Role::Prefill)?;
        // SAFETY: the caller's contract is `Agent::start`'s.
        let agent = unsafe { Agent::start(config, bound) }?;
        Ok(Self { agent })
    }

    /// The side channel's advertised `host:port`, which decode ranks dial.
    pub fn endpoint(&self) -> &str {
        // A prefill agent always listens (`Agent::start_inner`).
        self.agent.endpoint().unwrap_or_default()
    }

    /// Makes (a chunk of) a request's KV cache available (see [`SendChunk`]).
    ///
    /// # Errors
    ///
    /// Invalid parameters (the request is then untouched), or a stopped agent.
    pub fn send(&self, send: SendChunk) -> Result<(), CallError> {
        self.agent.send(send)
    }

    shared_calls!();
}

impl DecodeAgent {
    /// Starts a decode rank's agent (see [`Agent::start`]).
    ///
    /// # Safety
    ///
    /// As [`Agent::start`]: every pool of `config.rank.page_table` is engine-owned memory of
    /// the type it names, live and left alone as the protocol requires for the agent's life.
    ///
    /// # Errors
    ///
    /// A configuration whose role is not decode ([`StartError::Config`]), or what
    /// [`Agent::start`] refuses.
    pub unsafe fn start(config: AgentConfig, bound: BoundPlanner) -> Result<Self, StartError> {
        check_role(&config, Role::Decode)?;
        // SAFETY: the caller's contract is `Agent::start`'s.
        let agent = unsafe { Agent::start(config, bound) }?;
        Ok(Self { agent })
    }

    /// Adds a prefill rank's metadata to this rank's directory (see [`Agent::add_peer`]).
    ///
    /// # Errors
    ///
    /// The bytes are not metadata, or describe a rank this one cannot use.
    pub fn add_peer(&self, metadata: &[u8]) -> Result<PeerIdentity, CallError> {
        self.agent.add_peer(metadata)
    }

    /// Expects a request into this rank's slots (see [`Expect`]).
    ///
    /// # Errors
    ///
    /// Invalid parameters or a duplicate id (nothing is taken), or a stopped agent.
    pub fn expect(&self, expect: Expect) -> Result<(), CallError> {
        self.agent.expect(expect)
    }

    /// Tells prefill instance `peer` this instance still wants `requests` (see
    /// [`Agent::hold`]).
    ///
    /// # Errors
    ///
    /// A stopped agent.
    pub fn hold(
        &self,
        peer: &str,
        endpoints: &[String],
        requests: &[u64],
    ) -> Result<(), CallError> {
        self.agent.hold(peer, endpoints, requests)
    }

    shared_calls!();
}

impl From<PrefillAgent> for Agent {
    fn from(a: PrefillAgent) -> Agent {
        a.agent
    }
}

impl From<DecodeAgent> for Agent {
    fn from(a: DecodeAgent) -> Agent {
        a.agent
    }
}

impl TryFrom<Agent> for PrefillAgent {
    type Error = Agent;

    /// The agent, if it is a prefill rank's; else the agent back.
    fn try_from(agent: Agent) -> Result<Self, Agent> {
        if agent.role() == Role::Prefill {
            Ok(Self { agent })
        } else {
            Err(agent)
        }
    }
}

impl TryFrom<Agent> for DecodeAgent {
    type Error = Agent;

    /// The agent, if it is a decode rank's; else the agent back.
    fn try_from(agent: Agent) -> Result<Self, Agent> {
        if agent.role() == Role::Decode {
            Ok(Self { agent })
        } else {
            Err(agent)
        }
    }
}
