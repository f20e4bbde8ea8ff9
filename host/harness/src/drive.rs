//! One side of a transfer as a controller drives it: the `kvferry serve` processes of one
//! instance (one holding every rank, or one per rank), each reached on its control address.
//! `demo` and `bench` send each request to the servers that hold a rank of its DP group and
//! merge their answers.

use std::time::Duration;

use kvferry_protocol::Frame as _;
use kvferry_transfer::harness::{BenchStats, PairFragments};
use kvferry_transfer::{RequestStats, Role};

use crate::client::{Client, ClientError};
use crate::control::VerifySummary;
use crate::control::{ControlMessage as Message, PeerRef, RankTables, ServerInfo, Submit};

/// Why a harness run (`demo`, `bench`) could not run: a server, a control call or the
/// parameters.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// A child could not be started or did not come up.
    #[error("{role} server: {message}")]
    Child {
        /// `context` or `generation`.
        role: &'static str,
        /// What went wrong.
        message: String,
    },
    /// A control call failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// A server answered something unexpected.
    #[error("{0}")]
    Protocol(String),
    /// Bad parameters.
    #[error("{0}")]
    Invalid(String),
}

/// How long a control reply (other than `Done`) may take.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(120);

/// The servers of one instance.
#[derive(Debug)]
pub struct Side {
    role: Role,
    servers: Vec<(Client, ServerInfo)>,
}

impl Side {
    /// Connects to every control address, proves `secret`, and asks each server what it serves; they must be
    /// ranks of one instance, of the role `role` names, each rank served once.
    ///
    /// # Errors
    ///
    /// A server that cannot be reached or answers out of protocol, servers of different
    /// instances or planners, or a rank served twice or by none.
    pub fn connect(
        role: Role,
        addrs: &[String],
        secret: &kvferry_protocol::Secret,
    ) -> Result<Side, DemoError> {
        let expected = role;
        let mut servers = Vec::with_capacity(addrs.len());
        for addr in addrs {
            let client = Client::connect(addr, secret)?;
            let info = match client.call(Message::InfoRequest, REPLY_TIMEOUT)? {
                Message::Info(info) => info,
                other => {
                    return Err(DemoError::Protocol(format!(
                        "{role} server {addr} answered {} to InfoRequest",
                        other.kind()
                    )));
                }
            };
            if info.role != expected {
                return Err(DemoError::Invalid(format!(
                    "{addr} serves a {} instance, not a {role} one",
                    info.role
                )));
            }
            servers.push((client, info));
        }
        let Some((_, first)) = servers.first() else {
            return Err(DemoError::Invalid(format!("no {role} server")));
        };
        let mut served = vec![0u32; first.world as usize];
        for (client, info) in &servers {
            if info.instance != first.instance
                || info.planner_id != first.planner_id
                || info.world != first.world
            {
                return Err(DemoError::Invalid(format!(
                    "{} serves instance {} ({} ranks, planner {}), {} serves {} ({} ranks, \
                     planner {}): the servers of one side must run one instance (start each \
                     with the same --name)",
                    client.addr(),
                    info.instance,
                    info.world,
                    info.planner_id,
                    servers[0].0.addr(),
                    first.instance,
                    first.world,
                    first.planner_id
                )));
            }
            for r in &info.ranks {
                if let Some(n) = served.get_mut(r.info.instance_rank as usize) {
                    *n += 1;
                }
            }
        }
        if let Some(rank) = served.iter().position(|&n| n != 1) {
            return Err(DemoError::Invalid(format!(
                "rank {rank} of {role} instance {} is served by {} of the servers given (each \
                 rank needs exactly one)",
                first.instance, served[rank]
            )));
        }
        Ok(Side { role, servers })
    }

    /// What the first server says (every server of the side runs the same instance).
    pub fn info(&self) -> &ServerInfo {
        &self.servers[0].1
    }

    /// DP groups of the instance.
    pub fn dp_groups(&self) -> u32 {
        self.info().ranks.first().map_or(1, |r| r.info.dp_groups())
    }

    /// How a decode server reaches this (context) instance.
    pub fn peer(&self) -> PeerRef {
        PeerRef {
            instance: self.info().instance.clone(),
            endpoints: self
                .servers
                .iter()
                .flat_map(|(_, i)| i.ranks.iter().filter_map(|r| r.endpoint.clone()))
                .collect(),
        }
    }

    /// The servers holding a rank of DP group `dp`.
    fn holding(&self, dp: u32) -> impl Iterator<Item = &Client> {
        self.servers
            .iter()
            .filter(move |(_, info)| info.ranks.iter().any(|r| r.info.dp_rank == dp))
            .map(|(c, _)| c)
    }

    fn dp_of(&self, s: &Submit) -> u32 {
        match self.role {
            Role::Prefill => s.ctx_dp_rank,
            Role::Decode => s.gen_dp_rank,
        }
    }

    /// Prefill side: prefills `submits`; per submit (in order) its merged tables or why not.
    ///
    /// # Errors
    ///
    /// A control call that fails or an answer out of protocol.
    pub fn prefill(
        &self,
        submits: &[Submit],
    ) -> Result<Vec<Result<Vec<RankTables>, String>>, DemoError> {
        let mut results: Vec<Result<Vec<RankTables>, String>> =
            (0..submits.len()).map(|_| Ok(Vec::new())).collect();
        for (client, info) in &self.servers {
            let mut asked = 0;
            for s in submits {
                if info.ranks.iter().any(|r| r.info.dp_rank == s.ctx_dp_rank) {
                    client.send(Message::Submit(s.clone()))?;
                    asked += 1;
                }
            }
            for _ in 0..asked {
                match client.recv(REPLY_TIMEOUT)? {
                    Message::Submitted { request, result } => {
                        let Some(k) = submits.iter().position(|s| s.request == request) else {
                            return Err(DemoError::Protocol(format!(
                                "Submitted for unknown request {request}"
                            )));
                        };
                        match (result, &mut results[k]) {
                            (Ok(tables), Ok(all)) => all.extend(tables),
                            (Err(e), slot @ Ok(_)) => *slot = Err(e),
                            _ => {}
                        }
                    }
                    other => {
                        return Err(DemoError::Protocol(format!(
                            "prefill server {} answered {} to Submit",
                            client.addr(),
                            other.kind()
                        )));
                    }
                }
            }
        }
        for r in results.iter_mut().flatten() {
            r.sort_by_key(|t| t.rank);
        }
        Ok(results)
    }

    /// Decode side: submits every request at once (each with `peer`), waits for every
    /// server's `Done`; per request (in order of `submits`) its merged statistics or why it
    /// failed.
    ///
    /// # Errors
    ///
    /// A control call that fails (or no answer within `wait`) or an answer out of protocol.
    pub fn transfer(
        &self,
        submits: &[Submit],
        peer: &PeerRef,
        wait: Duration,
    ) -> Result<Vec<Result<RequestStats, String>>, DemoError> {
        let mut asked = vec![0usize; self.servers.len()];
        for s in submits {
            let mut submit = s.clone();
            submit.peer = Some(peer.clone());
            for (k, (client, info)) in self.servers.iter().enumerate() {
                if info.ranks.iter().any(|r| r.info.dp_rank == s.gen_dp_rank) {
                    client.send(Message::Submit(submit.clone()))?;
                    asked[k] += 1;
                }
            }
        }
        let mut results: Vec<Result<RequestStats, String>> = (0..submits.len())
            .map(|_| Ok(RequestStats::default()))
            .collect();
        for ((client, _), asked) in self.servers.iter().zip(asked) {
            for _ in 0..asked {
                match client.recv(wait)? {
                    Message::Done { request, result } => {
                        let Some(k) = submits.iter().position(|s| s.request == request) else {
                            return Err(DemoError::Protocol(format!(
                                "Done for unknown request {request}"
                            )));
                        };
                        match (result, &mut results[k]) {
                            (Ok(stats), Ok(all)) => all.merge(&stats),
                            (Err(e), slot @ Ok(_)) => *slot = Err(e),
                            _ => {}
                        }
                    }
                    other => {
                        return Err(DemoError::Protocol(format!(
                            "decode server {} sent {} during the transfer",
                            client.addr(),
                            other.kind()
                        )));
                    }
                }
            }
        }
        Ok(results)
    }

    /// Decode side: the oracle's verdict on one completed request, merged over the
    /// servers holding it.
    ///
    /// # Errors
    ///
    /// A control call that fails or an answer out of protocol.
    pub fn verify(
        &self,
        submit: &Submit,
        context: &[RankTables],
    ) -> Result<Result<VerifySummary, String>, DemoError> {
        let mut merged = VerifySummary::clean();
        for client in self.holding(submit.gen_dp_rank) {
            let reply = client.call(
                Message::Verify {
                    request: submit.request,
                    context: context.to_vec(),
                },
                REPLY_TIMEOUT,
            )?;
            match reply {
                Message::Verified { result: Ok(s), .. } => merged.merge(&s),
                Message::Verified { result: Err(e), .. } => return Ok(Err(e)),
                other => {
                    return Err(DemoError::Protocol(format!(
                        "decode server {} answered {} to Verify",
                        client.addr(),
                        other.kind()
                    )));
                }
            }
        }
        Ok(Ok(merged))
    }

    /// Decode side: the slot tables a completed request landed in, per rank, from every
    /// server holding it.
    ///
    /// # Errors
    ///
    /// A control call that fails, a server's refusal, or an answer out of protocol.
    pub fn tables(&self, submit: &Submit) -> Result<Vec<RankTables>, DemoError> {
        let mut ranks = Vec::new();
        for client in self.holding(submit.gen_dp_rank) {
            let request = submit.request;
            match client.call(Message::Tables { request }, REPLY_TIMEOUT)? {
                Message::TablesDone { result: Ok(t), .. } => ranks.extend(t),
                Message::TablesDone { result: Err(e), .. } => {
                    return Err(DemoError::Protocol(format!(
                        "decode server {} tables of request {request}: {e}",
                        client.addr()
                    )));
                }
                other => {
                    return Err(DemoError::Protocol(format!(
                        "decode server {} answered {} to Tables",
                        client.addr(),
                        other.kind()
                    )));
                }
            }
        }
        Ok(ranks)
    }

    /// Releases a request on every server holding it.
    ///
    /// # Errors
    ///
    /// A control call that fails or an answer out of protocol.
    pub fn release(&self, submit: &Submit) -> Result<(), DemoError> {
        for client in self.holding(self.dp_of(submit)) {
            match client.call(
                Message::Release {
                    request: submit.request,
                },
                REPLY_TIMEOUT,
            )? {
                Message::Released { .. } => {}
                Message::Refused { message, .. } => {
                    return Err(DemoError::Protocol(format!(
                        "{} refused Release: {message}",
                        client.addr()
                    )));
                }
                other => {
                    return Err(DemoError::Protocol(format!(
                        "{} answered {} to Release",
                        client.addr(),
                        other.kind()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Decode side: every server's check that its pools hold only the canary, merged.
    ///
    /// # Errors
    ///
    /// A control call that fails or an answer out of protocol.
    pub fn verify_idle(&self) -> Result<Result<VerifySummary, String>, DemoError> {
        let mut merged = VerifySummary::clean();
        for (client, _) in &self.servers {
            match client.call(Message::VerifyIdle, REPLY_TIMEOUT)? {
                Message::IdleVerified { result: Ok(s) } => merged.merge(&s),
                Message::IdleVerified { result: Err(e) } => return Ok(Err(e)),
                other => {
                    return Err(DemoError::Protocol(format!(
                        "decode server {} answered {} to VerifyIdle",
                        client.addr(),
                        other.kind()
                    )));
                }
            }
        }
        Ok(Ok(merged))
    }

    /// Prefill side: the bare replay of `requests`' recorded plans on every server at once;
    /// the totals, timed by the slowest server.
    ///
    /// # Errors
    ///
    /// A control call that fails, a server's refusal, or an answer out of protocol.
    pub fn replay(&self, requests: &[u64], wait: Duration) -> Result<BenchStats, DemoError> {
        self.baseline(
            || Message::Bench {
                requests: requests.to_vec(),
            },
            wait,
        )?
        .map_err(DemoError::Protocol)
    }

    /// Prefill side: the memcpy baseline of `requests`' recorded fragments on every server at
    /// once; the totals, timed by the slowest server, or a server's refusal (its buffers do
    /// not fit, a fragment outside its pools).
    ///
    /// # Errors
    ///
    /// A control call that fails or an answer out of protocol.
    pub fn memcpy(
        &self,
        requests: &[u64],
        wait: Duration,
    ) -> Result<Result<BenchStats, String>, DemoError> {
        self.baseline(
            || Message::Memcpy {
                requests: requests.to_vec(),
            },
            wait,
        )
    }

    /// Sends `ask()` to every server at once and merges their `BenchDone` or `MemcpyDone`;
    /// the first refusal instead, once every server answered.
    fn baseline(
        &self,
        ask: impl Fn() -> Message,
        wait: Duration,
    ) -> Result<Result<BenchStats, String>, DemoError> {
        let asked = ask().kind();
        for (client, _) in &self.servers {
            client.send(ask())?;
        }
        let mut total = Ok(BenchStats::default());
        for (client, _) in &self.servers {
            match client.recv(wait)? {
                Message::BenchDone { result: Ok(s) } | Message::MemcpyDone { result: Ok(s) } => {
                    if let Ok(total) = &mut total {
                        total.merge(&s);
                    }
                }
                Message::BenchDone { result: Err(e) } | Message::MemcpyDone { result: Err(e) } => {
                    if total.is_ok() {
                        total = Err(format!("prefill server {} {asked}: {e}", client.addr()));
                    }
                }
                other => {
                    return Err(DemoError::Protocol(format!(
                        "prefill server {} answered {} to {asked}",
                        client.addr(),
                        other.kind()
                    )));
                }
            }
        }
        Ok(total)
    }

    /// Prefill side: per request of `requests` (in order), the prefill ranks' statistics
    /// (bytes sent, the stages of their pairs), merged over the servers.
    ///
    /// # Errors
    ///
    /// A control call that fails, a server's refusal, or an answer out of protocol.
    pub fn stats(&self, requests: &[u64]) -> Result<Vec<RequestStats>, DemoError> {
        let mut merged = vec![RequestStats::default(); requests.len()];
        for (client, _) in &self.servers {
            match client.call(
                Message::Stats {
                    requests: requests.to_vec(),
                },
                REPLY_TIMEOUT,
            )? {
                Message::StatsDone { result: Ok(s) } if s.len() == requests.len() => {
                    for (all, s) in merged.iter_mut().zip(&s) {
                        all.merge(s);
                    }
                }
                Message::StatsDone { result: Ok(s) } => {
                    return Err(DemoError::Protocol(format!(
                        "prefill server {} sent {} statistics for {} requests",
                        client.addr(),
                        s.len(),
                        requests.len()
                    )));
                }
                Message::StatsDone { result: Err(e) } => {
                    return Err(DemoError::Protocol(format!(
                        "prefill server {} statistics: {e}",
                        client.addr()
                    )));
                }
                other => {
                    return Err(DemoError::Protocol(format!(
                        "prefill server {} answered {} to Stats",
                        client.addr(),
                        other.kind()
                    )));
                }
            }
        }
        Ok(merged)
    }

    /// Prefill side: the recorded fragments of `requests`, per pair, from every server.
    ///
    /// # Errors
    ///
    /// A control call that fails, a server's refusal, or an answer out of protocol.
    pub fn fragments(&self, requests: &[u64]) -> Result<Vec<PairFragments>, DemoError> {
        let mut pairs = Vec::new();
        for (client, _) in &self.servers {
            match client.call(
                Message::Fragments {
                    requests: requests.to_vec(),
                },
                REPLY_TIMEOUT,
            )? {
                Message::FragmentsDone { result: Ok(p) } => pairs.extend(p),
                Message::FragmentsDone { result: Err(e) } => {
                    return Err(DemoError::Protocol(format!(
                        "prefill server {} fragment export: {e}",
                        client.addr()
                    )));
                }
                other => {
                    return Err(DemoError::Protocol(format!(
                        "prefill server {} answered {} to Fragments",
                        client.addr(),
                        other.kind()
                    )));
                }
            }
        }
        Ok(pairs)
    }

    /// Asks every server to stop.
    pub fn shutdown(&self) {
        for (client, _) in &self.servers {
            let _ = client.send(Message::Shutdown);
        }
    }
}
