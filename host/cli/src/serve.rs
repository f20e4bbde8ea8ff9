//! `kvferry serve`: one instance of a model preset, driven by a controller over the control
//! protocol ([`crate::control`]) — the engine's part played by a test harness.
//!
//! The transfer library ([`kvferry_transfer`]) moves bytes between slots it is handed and
//! never touches their contents. This module is what an engine would be around it, plus the
//! test machinery: it lays the preset's pools out, allocates slots per request
//! ([`SlotPools`]), fills source slots with the oracle's tags ("prefill"), primes destination
//! slots with the canary (all at start, and again whenever kvferry hands a request's slots
//! back), checks delivered bytes with the oracle, and exits when told to. A context server
//! also listens for generation peers ([`PeerListener`]); its control listener is a separate
//! port, bound to loopback unless told otherwise.

use std::collections::{BTreeMap, HashMap};
use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use kvferry_loader::BoundPlanner;
use kvferry_plan::error_chain;
use kvferry_planner_abi::{Mapping, RankInfo, SlotTable};
use kvferry_protocol::{Frame, MAX_FRAME_BYTES, read_frame};
use kvferry_testkit::layout::{ModelSpec, PoolOptions, build_instance};
use kvferry_testkit::oracle::{Oracle, VerifyReport};
use kvferry_testkit::scenario::slot_tables;
use kvferry_transfer::conn::{Outbox, drain, spawn_writer};
use kvferry_transfer::instance::InstanceError;
use kvferry_transfer::rank::{RemoteRank, WriteHook};
use kvferry_transfer::receiver::Completed;
use kvferry_transfer::sender::ContextOptions;
use kvferry_transfer::{
    ContextServer, Expect, GenerationServer, Instance, InstanceConfig, PairFragments, PeerListener,
    Role, SourceRequest,
};

use crate::control::{ControlMessage, RankTables, Submit, VerifySummary};
use crate::slots::{Allocation, SlotPools};
use crate::verify::{ReceiverPart, VerifyError, fill_slots, prime_all, prime_slots};
use crate::verify::{verify_idle, verify_request};

/// How long a refused connection's remaining input is drained before closing it.
const DRAIN: Duration = Duration::from_millis(200);

/// Options of a server beyond its instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    /// Context side: the peer address generation instances connect to.
    pub listen: String,
    /// The control address (`127.0.0.1:0` picks a free loopback port).
    pub control: String,
    /// How long a request may take: on the generation side, to hear from all its writers;
    /// on the context side, each write job once it starts.
    pub timeout: Duration,
    /// Salt of the oracle's tags and canaries; both servers of a pair must agree.
    pub seed: u64,
    /// Fault injection, context side: sleep this long before every flush.
    pub stall: Duration,
    /// Context side: peer connections served at once.
    pub max_peer_connections: usize,
    /// Context side: keep every queued plan until its request is released, so
    /// [`ControlMessage::Bench`] can replay it (`kvferry bench`).
    pub record_plans: bool,
    /// PAGED slots of every PAGED pool.
    pub paged_slots: u64,
    /// STATE slots of every STATE pool.
    pub state_slots: u64,
}

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The instance could not start.
    #[error("starting the instance")]
    Instance(#[from] InstanceError),
    /// The pools could not be primed.
    #[error("priming the pools with the canary")]
    Prime(#[from] VerifyError),
    /// An address could not be bound.
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address.
        addr: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Sleeps before every flush: a slow or hung receiver, for the fault tests.
#[derive(Debug)]
struct Stall(Duration);

impl WriteHook for Stall {
    fn before_flush(&self, _: &RemoteRank, _: &kvferry_plan::ValidatedPlan) {
        thread::sleep(self.0);
    }
}

/// The instance's side and the test machinery around it.
#[derive(Debug)]
enum Side {
    Context(Arc<ContextServer>),
    Generation(Arc<GenerationServer>),
}

#[derive(Debug)]
struct Held {
    allocation: Allocation,
    tables: BTreeMap<u32, Vec<SlotTable>>,
}

#[derive(Debug)]
struct Shared {
    side: Side,
    model: ModelSpec,
    oracle: Oracle,
    slots: Arc<Mutex<SlotPools>>,
    /// Generation side: what each request holds until kvferry hands it back.
    held: Mutex<HashMap<u64, Held>>,
    record_plans: bool,
    shutdown: Sender<()>,
}

/// A started server: the instance runs, the listeners are bound.
#[derive(Debug)]
pub struct Running {
    shared: Arc<Shared>,
    control: TcpListener,
    control_addr: SocketAddr,
    peer_addr: Option<SocketAddr>,
    shutdown: Receiver<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts the instance of `model` under `mapping` (allocating, describing and priming every
/// rank) and binds the listeners.
///
/// # Errors
///
/// See [`ServeError`].
pub fn start(
    config: InstanceConfig,
    model: ModelSpec,
    mapping: Mapping,
    bound: BoundPlanner,
    options: &ServeOptions,
) -> Result<Running, ServeError> {
    let listen_error = |addr: &str| {
        let addr = addr.to_string();
        move |source| ServeError::Listen { addr, source }
    };
    let role = config.role;
    let prepared = Instance::prepare(config)?;
    // Bound before the pools are allocated, so a bad address fails before any memory is.
    let control = TcpListener::bind(&options.control).map_err(listen_error(&options.control))?;
    let control_addr = control
        .local_addr()
        .map_err(listen_error(&options.control))?;
    let pool_options = PoolOptions {
        paged_slots: options.paged_slots,
        state_slots: options.state_slots,
        slot_padding: 0,
        ..PoolOptions::default()
    };
    let planner_id = bound.id().to_string();
    let name = prepared.config().name.clone();
    let layout_model = model.clone();
    let instance = prepared.start(
        bound,
        Box::new(move |allocator| {
            let options = PoolOptions {
                memory_type: allocator.memory_type(),
                ..pool_options
            };
            build_instance(
                &layout_model,
                &mapping,
                &name,
                &planner_id,
                &options,
                &mut |rank, pool, bytes| allocator.alloc(rank, pool, bytes),
            )
            .map_err(Into::into)
        }),
    )?;
    let slots = Arc::new(Mutex::new(SlotPools::new(
        instance.dp_groups(),
        options.paged_slots,
        options.state_slots,
        instance.has_state(),
    )));
    let oracle = Oracle::new(options.seed);
    let (shutdown_tx, shutdown) = mpsc::channel();
    let (side, peer_addr) = match role {
        Role::Context => {
            let hook: Option<Arc<dyn WriteHook>> = (!options.stall.is_zero())
                .then(|| Arc::new(Stall(options.stall)) as Arc<dyn WriteHook>);
            let server = Arc::new(ContextServer::new(
                instance,
                &ContextOptions {
                    timeout: options.timeout,
                    record_plans: options.record_plans,
                    hook,
                },
            ));
            let listener = PeerListener::bind(Arc::clone(&server), &options.listen)
                .map_err(|e| match e {
                    kvferry_transfer::ServeError::Listen { addr, source } => {
                        ServeError::Listen { addr, source }
                    }
                    other => ServeError::Listen {
                        addr: options.listen.clone(),
                        source: std::io::Error::other(other.to_string()),
                    },
                })?
                .max_connections(options.max_peer_connections);
            let addr = listener.local_addr();
            listener.spawn().map_err(listen_error(&options.listen))?;
            (Side::Context(server), Some(addr))
        }
        Role::Generation => {
            // Every free slot holds the canary: primed now, before any peer has our keys.
            for rank in instance.ranks() {
                prime_all(&oracle, &rank.info, &rank.pools)?;
            }
            (
                Side::Generation(GenerationServer::new(instance, options.timeout)),
                None,
            )
        }
    };
    Ok(Running {
        shared: Arc::new(Shared {
            side,
            model,
            oracle,
            slots,
            held: Mutex::new(HashMap::new()),
            record_plans: options.record_plans,
            shutdown: shutdown_tx,
        }),
        control,
        control_addr,
        peer_addr,
        shutdown,
    })
}

impl Running {
    /// The bound control address.
    pub fn control_addr(&self) -> SocketAddr {
        self.control_addr
    }

    /// The bound peer address (context servers only).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_addr
    }

    /// The running instance.
    pub fn instance(&self) -> &Instance {
        self.shared.instance()
    }

    /// Serves control connections until one asks for [`ControlMessage::Shutdown`]; returns
    /// then (the caller exits the process).
    pub fn run(self) {
        let Running {
            shared,
            control,
            shutdown,
            ..
        } = self;
        let accepting = thread::Builder::new()
            .name("control-accept".into())
            .spawn(move || {
                for stream in control.incoming() {
                    let stream = match stream {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(error = %e, "accept failed");
                            continue;
                        }
                    };
                    let shared = Arc::clone(&shared);
                    let spawned = thread::Builder::new()
                        .name("control".into())
                        .spawn(move || connection(&shared, stream));
                    if let Err(e) = spawned {
                        tracing::warn!(error = %e, "cannot spawn a connection thread");
                    }
                }
            });
        if let Err(e) = accepting {
            tracing::warn!(error = %e, "cannot spawn the control accept thread");
            return;
        }
        let _ = shutdown.recv();
    }
}

impl Shared {
    fn instance(&self) -> &Instance {
        match &self.side {
            Side::Context(s) => s.instance(),
            Side::Generation(s) => s.instance(),
        }
    }

    fn tokens_per_block(&self) -> u64 {
        u64::from(self.model.tokens_per_block)
    }

    fn handle(self: &Arc<Self>, outbox: &Outbox<ControlMessage>, message: ControlMessage) -> bool {
        let reply = match (message, &self.side) {
            (ControlMessage::InfoRequest, _) => ControlMessage::Info(self.instance().describe()),
            (ControlMessage::Shutdown, _) => {
                tracing::info!("shutdown requested");
                let _ = self.shutdown.send(());
                return false;
            }
            (ControlMessage::Submit(submit), Side::Context(server)) => {
                let request = submit.request;
                let result = self.prefill(server, submit).map_err(|e| {
                    tracing::warn!(request, error = %e, "prefill refused");
                    e
                });
                ControlMessage::Submitted { request, result }
            }
            (ControlMessage::Submit(submit), Side::Generation(server)) => {
                let request = submit.request;
                match self.expect(server, submit, outbox) {
                    Ok(()) => return true,
                    Err(e) => {
                        tracing::warn!(request, error = %e, "request refused");
                        ControlMessage::Done {
                            request,
                            result: Err(e),
                        }
                    }
                }
            }
            (ControlMessage::Release { request }, Side::Context(server)) => {
                server.release(request);
                ControlMessage::Released { request }
            }
            (ControlMessage::Release { request }, Side::Generation(server)) => {
                self.release(server, request);
                ControlMessage::Released { request }
            }
            (ControlMessage::Cancel { request, reason }, Side::Generation(server)) => {
                server.cancel(request, &reason);
                return true;
            }
            (ControlMessage::Verify { request, context }, Side::Generation(server)) => {
                let result = self.verify(server, request, &context);
                ControlMessage::Verified { request, result }
            }
            (ControlMessage::VerifyIdle, Side::Generation(server)) => {
                ControlMessage::IdleVerified {
                    result: self.verify_idle(server),
                }
            }
            (ControlMessage::Bench { .. }, Side::Context(_)) if !self.record_plans => {
                ControlMessage::BenchDone {
                    result: Err("this context server does not record plans (start it with \
                                 --record-plans)"
                        .into()),
                }
            }
            (ControlMessage::Fragments { .. }, Side::Context(_)) if !self.record_plans => {
                ControlMessage::FragmentsDone {
                    result: Err("this context server does not record plans (start it with \
                                 --record-plans)"
                        .into()),
                }
            }
            (ControlMessage::Fragments { requests }, Side::Context(server)) => {
                ControlMessage::FragmentsDone {
                    result: server
                        .recorded_fragments(&requests)
                        .and_then(fits_one_frame),
                }
            }
            (ControlMessage::Bench { requests }, Side::Context(server)) => {
                let result = server.replay(&requests).map_err(|e| {
                    tracing::warn!(error = %e, "bench replay failed");
                    e
                });
                ControlMessage::BenchDone { result }
            }
            (other, _) => {
                let role = match self.side {
                    Side::Context(_) => "context",
                    Side::Generation(_) => "generation",
                };
                ControlMessage::Error {
                    message: format!("{} is not a message a {role} server accepts", other.kind()),
                }
            }
        };
        let close = matches!(reply, ControlMessage::Error { .. });
        let _ = outbox.send(reply);
        !close
    }

    /// The context side's "prefill": slots for the DP group's ranks, tags from the oracle,
    /// then the request handed to the transfer library.
    fn prefill(
        self: &Arc<Self>,
        server: &Arc<ContextServer>,
        submit: Submit,
    ) -> Result<Vec<RankTables>, String> {
        let id = submit.request;
        let pieces = kvferry_plan::pieces(
            submit.prompt_len,
            self.model.tokens_per_block,
            submit.chunks.as_deref(),
        )
        .map_err(|e| format!("request {id}: {e}"))?;
        let instance = server.instance();
        let group = instance.dp_group(submit.ctx_dp_rank);
        if group.is_empty() {
            return Err(format!(
                "request {id}: ctx_dp_rank {} does not exist ({} dp groups)",
                submit.ctx_dp_rank,
                instance.dp_groups()
            ));
        }
        let blocks = submit.prompt_len.div_ceil(self.tokens_per_block());
        let allocation = lock(&self.slots)
            .allocate(submit.ctx_dp_rank, blocks, id ^ 0x00c0_17e7)
            .map_err(|e| format!("request {id}: {e}"))?;
        let mut tables = BTreeMap::new();
        for &r in &group {
            let Some(rank) = instance.rank(r) else {
                continue;
            };
            let t = slot_tables(&rank.info, submit.prompt_len, 0, &allocation.assignment);
            if let Err(e) = fill_slots(&self.oracle, &rank.info, &rank.pools, &t) {
                lock(&self.slots).free(&allocation);
                return Err(format!(
                    "request {id}: filling rank {r}: {}",
                    error_chain(&e)
                ));
            }
            tables.insert(r, t);
        }
        let reply: Vec<RankTables> = tables
            .iter()
            .map(|(&rank, t)| RankTables {
                rank,
                tables: t.clone(),
            })
            .collect();
        let slots = Arc::clone(&self.slots);
        let freeing = allocation.clone();
        server
            .add_request(
                SourceRequest {
                    request: id,
                    prompt_len: submit.prompt_len,
                    pieces,
                    tables,
                    dp_rank: submit.ctx_dp_rank,
                },
                Box::new(move || lock(&slots).free(&freeing)),
            )
            .map_err(|e| {
                lock(&self.slots).free(&allocation);
                error_chain(&e)
            })?;
        Ok(reply)
    }

    /// The generation side of a request: slots for the DP group's ranks (they hold the
    /// canary), then the request handed to the transfer library, whose outcome goes to the
    /// controller as [`ControlMessage::Done`].
    fn expect(
        self: &Arc<Self>,
        server: &Arc<GenerationServer>,
        submit: Submit,
        outbox: &Outbox<ControlMessage>,
    ) -> Result<(), String> {
        let id = submit.request;
        let peer = submit
            .peer
            .clone()
            .ok_or_else(|| format!("request {id}: no context peer address"))?;
        if submit.cached > submit.prompt_len {
            return Err(format!(
                "request {id}: cached {} exceeds prompt_len {}",
                submit.cached, submit.prompt_len
            ));
        }
        let pieces = kvferry_plan::pieces(
            submit.prompt_len,
            self.model.tokens_per_block,
            submit.chunks.as_deref(),
        )
        .map_err(|e| format!("request {id}: {e}"))?;
        let tpb = self.tokens_per_block();
        let cached = submit.cached / tpb * tpb;
        let instance = server.instance();
        let group = instance.dp_group(submit.gen_dp_rank);
        if group.is_empty() {
            return Err(format!(
                "request {id}: gen_dp_rank {} does not exist ({} dp groups)",
                submit.gen_dp_rank,
                instance.dp_groups()
            ));
        }
        // The id check, the allocation and the record are one step under `held`: two
        // submits of one id racing each other must not both allocate (one would leak).
        let (allocation, tables) = {
            let mut held = lock(&self.held);
            if held.contains_key(&id) {
                return Err(format!("request {id} already exists"));
            }
            let blocks = submit.prompt_len.div_ceil(tpb);
            let allocation = lock(&self.slots)
                .allocate(submit.gen_dp_rank, blocks, id ^ 0x0009_e4e7)
                .map_err(|e| format!("request {id}: {e}"))?;
            // Free slots hold the canary already (primed at start, re-primed when freed).
            let tables: BTreeMap<u32, Vec<SlotTable>> = group
                .iter()
                .filter_map(|&g| instance.rank(g))
                .map(|rank| {
                    let t = slot_tables(
                        &rank.info,
                        submit.prompt_len,
                        submit.cached,
                        &allocation.assignment,
                    );
                    (rank.info.instance_rank, t)
                })
                .collect();
            held.insert(
                id,
                Held {
                    allocation: allocation.clone(),
                    tables: tables.clone(),
                },
            );
            (allocation, tables)
        };
        let reply = outbox.clone();
        let accepted = server.expect(
            Expect {
                request: id,
                peer,
                ctx_dp_rank: submit.ctx_dp_rank,
                gen_dp_rank: submit.gen_dp_rank,
                prompt_len: submit.prompt_len,
                pieces,
                dst_start_token: (cached > 0).then_some(cached),
                tables,
            },
            Box::new(move |request, result| {
                let _ = reply.send(ControlMessage::Done {
                    request,
                    result: result.map_err(|e| error_chain(&e)),
                });
            }),
        );
        if let Err(e) = accepted {
            lock(&self.held).remove(&id);
            lock(&self.slots).free(&allocation);
            return Err(error_chain(&e));
        }
        Ok(())
    }

    /// Lets go of a generation request; once kvferry hands its slots back they get the
    /// canary again and return to the free lists.
    fn release(self: &Arc<Self>, server: &Arc<GenerationServer>, request: u64) {
        if !lock(&self.held).contains_key(&request) {
            return;
        }
        let shared = Arc::clone(self);
        let known = server.release(
            request,
            Box::new(move || {
                let Some(held) = lock(&shared.held).remove(&request) else {
                    return;
                };
                let instance = shared.instance();
                for (&g, tables) in &held.tables {
                    if let Some(rank) = instance.rank(g) {
                        if let Err(e) = prime_slots(&shared.oracle, &rank.info, &rank.pools, tables)
                        {
                            tracing::warn!(rank = g, error = %error_chain(&e), "cannot re-prime released slots");
                        }
                    }
                }
                lock(&shared.slots).free(&held.allocation);
            }),
        );
        if !known {
            // kvferry never took it (or forgot it): the slots are ours again now.
            if let Some(held) = lock(&self.held).remove(&request) {
                lock(&self.slots).free(&held.allocation);
            }
        }
    }

    /// Checks a completed request's destination slots with the oracle.
    fn verify(
        &self,
        server: &GenerationServer,
        request: u64,
        context: &[RankTables],
    ) -> Result<VerifySummary, String> {
        let Completed {
            peer,
            tables,
            pieces,
            ..
        } = server.completed(request).map_err(|e| error_chain(&e))?;
        let instance = server.instance();
        let parts: Vec<ReceiverPart<'_>> = tables
            .iter()
            .filter_map(|(&g, t)| {
                let rank = instance.rank(g)?;
                Some(ReceiverPart {
                    info: &rank.info,
                    pools: &rank.pools,
                    tables: t,
                    excluded: &[],
                })
            })
            .collect();
        let mut ctx: Vec<(&RankInfo, &[SlotTable])> = Vec::with_capacity(context.len());
        for t in context {
            let d = peer
                .ranks
                .get(t.rank as usize)
                .ok_or_else(|| format!("{} has no rank {}", peer.instance_name, t.rank))?;
            ctx.push((&d.info, t.tables.as_slice()));
        }
        let report = verify_request(&self.oracle, &parts, &ctx, &pieces)
            .map_err(|e| format!("request {request}: {}", error_chain(&e)))?;
        Ok(summary(&report))
    }

    fn verify_idle(&self, server: &GenerationServer) -> Result<VerifySummary, String> {
        let count = server.requests_held().max(lock(&self.held).len());
        if count > 0 {
            return Err(format!("{count} requests still hold slots"));
        }
        let ranks: Vec<_> = server
            .instance()
            .ranks()
            .iter()
            .map(|r| (&r.info, r.pools.as_ref()))
            .collect();
        let report = verify_idle(&self.oracle, &ranks).map_err(|e| error_chain(&e))?;
        Ok(summary(&report))
    }
}

/// The wire form of a report.
pub fn summary(report: &VerifyReport) -> VerifySummary {
    VerifySummary {
        ok: report.is_clean(),
        bytes_checked: report.bytes_checked,
        bytes_covered: report.bytes_covered,
        mismatched_bytes: report.mismatched_bytes,
        detail: report.to_string(),
    }
}

/// Serves one control connection until it closes or misbehaves.
fn connection(shared: &Arc<Shared>, stream: TcpStream) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "unknown".to_string(), |a| a.to_string());
    let _span = tracing::info_span!("control", %peer).entered();
    let _ = stream.set_nodelay(true);
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "cannot clone a connection socket");
            return;
        }
    };
    let outbox = spawn_writer::<ControlMessage>(writer, peer.clone());
    let mut reader = BufReader::new(stream);
    let refusal = loop {
        let message: ControlMessage = match read_frame(&mut reader) {
            Ok(m) => m,
            Err(e) if e.is_disconnect() => break None,
            Err(e) => break Some(error_chain(&e)),
        };
        tracing::trace!(kind = message.kind(), "message");
        if !shared.handle(&outbox, message) {
            break None;
        }
    };
    if let Some(reason) = refusal {
        tracing::warn!(%reason, "refusing connection");
        let _ = outbox.send(ControlMessage::Error {
            message: format!("connection refused: {reason}"),
        });
        drop(outbox);
        let stream = reader.get_mut();
        let _ = stream.set_read_timeout(Some(DRAIN));
        drain(stream, DRAIN);
    }
}

/// `pairs`, unless their [`ControlMessage::FragmentsDone`] could exceed one control frame
/// (bounded from above: at most 29 bytes per fragment and 64 per pair and pool list entry).
fn fits_one_frame(pairs: Vec<PairFragments>) -> Result<Vec<PairFragments>, String> {
    let fragments: usize = pairs.iter().map(|p| p.fragments.len()).sum();
    let entries: usize = pairs
        .iter()
        .map(|p| 1 + p.src_pools.len() + p.dst_pools.len() + p.plans.len())
        .sum();
    let bound = fragments * 29 + entries * 64 + 64;
    if bound > MAX_FRAME_BYTES {
        return Err(format!(
            "{fragments} fragments in {} pairs may not fit one {MAX_FRAME_BYTES}-byte control \
             frame; export fewer requests",
            pairs.len()
        ));
    }
    Ok(pairs)
}
