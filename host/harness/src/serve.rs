//! `kvferry serve`: the ranks of one instance of a model preset — all of them, or one with
//! `--rank N` as engines run them — each with its own [`Agent`], driven by a controller over
//! the control protocol ([`crate::control`]): the engine's part played by a test harness.
//!
//! The agents ([`kvferry_transfer::agent`]) move bytes between slots they are handed and never
//! touch their contents. This module is what an engine would be around them, plus the test
//! machinery: it lays the preset's pools out (allocated by UCX, so shared memory takes
//! one-sided puts), allocates slots per request ([`SlotPools`]), fills source slots with the
//! oracle's tags ("prefill"), primes destination slots with the canary (all at start, and
//! again whenever a request's slots come back), checks delivered bytes with the oracle, and
//! stops when told to. Its control listener is bound to loopback unless told otherwise; the
//! agents' side channels are what peers reach, behind the deployment's secret.
//!
//! A request belongs to the control connection that submitted it, for good: any other
//! connection's message about it is refused, naming it (see [`crate::control`]); nothing is
//! released when a connection closes. A request's slots come back as an engine's would: on
//! the prefill side once every rank here has ended it (its terminal event, whatever it is:
//! sent, lease lapsed, failed, cancelled), unless its plans are recorded for a replay; on the
//! decode side once it failed on every rank here (a received request keeps them for
//! `Verify`); else at its release. Its record — statistics, outcome — stays until the
//! release.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use kvferry_loader::BoundPlanner;
use kvferry_plan::error_chain;
use kvferry_planner_abi::{GroupKind, Mapping, PairRequest, RankInfo, SlotTable, ViewId};
use kvferry_protocol::{Frame, MAX_FRAME_BYTES, read_frame};
use kvferry_testkit::layout::{ModelSpec, PoolOptions, build_rank};
use kvferry_testkit::oracle::{Oracle, VerifyReport};
use kvferry_testkit::scenario::slot_tables;
use kvferry_transfer::agent::{Agent, AgentConfig, BounceConfig, Event, Expect, Secret, SendChunk};
use kvferry_transfer::harness::conn::{
    HANDSHAKE_TIMEOUT, Outbox, Pending, Secured, Unproven, drain, secure_accept, spawn_writer,
};
use kvferry_transfer::harness::copy::CopyArena;
use kvferry_transfer::harness::memory::{MemoryError, PoolAllocator, RankPools};
use kvferry_transfer::harness::rank::{RemoteRank, WriteHook};
use kvferry_transfer::harness::{BenchStats, PairFragments};
use kvferry_transfer::{MemoryKind, RequestStats, Role, Stages, TransportSpec};

use crate::control::{
    ControlMessage, PeerRef, RankTables, ServedRank, ServerInfo, Submit, VerifySummary,
};
use crate::slots::{Allocation, SlotPools};
use crate::verify::{ReceiverPart, VerifyError, fill_slots, prime_all, prime_slots};
use crate::verify::{verify_idle, verify_request};

/// How long a refused connection's remaining input is drained before closing it.
const DRAIN: Duration = Duration::from_millis(200);
/// How often an event pump looks at its stop flag while no event comes.
const PUMP_TICK: Duration = Duration::from_millis(100);
/// The answer to `Bench`, `Fragments` and `Memcpy` without `--record-plans`.
const NOT_RECORDING: &str =
    "this prefill server does not record plans (start it with --record-plans)";
/// How long a bench replay may take beyond the request timeout.
const REPLAY_GRACE: Duration = Duration::from_secs(5);

/// What the served instance is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceConfig {
    /// Context or generation.
    pub role: Role,
    /// The instance name every rank advertises (the same in every process of the instance).
    pub name: String,
    /// What the instance holds, for messages and logs (e.g. `deepseek-v3 fp8 tpb32 dep2`).
    pub label: String,
    /// The UCX transports and network devices.
    pub transport: TransportSpec,
    /// Where the pools live.
    pub memory: MemoryKind,
    /// CUDA pools: the device of every rank (`None`: rank `r` on device `r % device count`).
    pub cuda_device: Option<usize>,
}

/// Options of a server beyond its instance.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Prefill side: the side-channel listen address of every agent (port 0: each rank a
    /// free port; a fixed port needs `rank`).
    pub listen: String,
    /// Prefill side: the host the agents advertise (default: the listen address, or the
    /// first non-loopback interface address when that is unspecified).
    pub advertise: Option<String>,
    /// The control address (`127.0.0.1:0` picks a free loopback port).
    pub control: String,
    /// How long a request may take once it is expected (generation) or claimed (context).
    pub timeout: Duration,
    /// How long a context-side send waits for its receivers before it fails.
    pub lease: Duration,
    /// How long a peer may stay silent before its requests fail.
    pub peer_timeout: Duration,
    /// Prefill side: how long a receiver may leave stuck puts unfinished before it is given
    /// up (`ExecConfig::stall_limit`).
    pub stall_limit: Duration,
    /// Decode side: the integrity digest asked of every piece (`AgentConfig::integrity`).
    pub integrity: Option<kvferry_transfer::agent::Integrity>,
    /// Salt of the oracle's tags and canaries; both servers of a pair must agree.
    pub seed: u64,
    /// Fault injection, prefill side: sleep this long before every flush.
    pub stall: Duration,
    /// Prefill side: side-channel connections each agent serves at once (one more closes the
    /// oldest unproven one, or, when all are proven, is refused).
    pub max_peer_connections: usize,
    /// Prefill side: keep every written plan until its request is released, so
    /// [`ControlMessage::Bench`] can replay it (`kvferry bench`).
    pub record_plans: bool,
    /// PAGED slots of every PAGED pool.
    pub paged_slots: u64,
    /// STATE slots of every STATE pool.
    pub state_slots: u64,
    /// Serve this rank only (`None`: every rank of the instance, in this process).
    pub rank: Option<u32>,
    /// The deployment's shared secret (both servers of a pair must hold it).
    pub secret: Secret,
    /// Bounce transfers: mode, arena and staging sizes.
    pub bounce: BounceConfig,
}

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The options do not fit the instance.
    #[error("{0}")]
    Config(String),
    /// The pools could not be laid out.
    #[error("laying out rank {rank}'s pools")]
    Layout {
        /// The rank.
        rank: u32,
        /// Why.
        #[source]
        source: kvferry_testkit::layout::LayoutError,
    },
    /// The UCX context or the pools could not be made.
    #[error("the pools")]
    Memory(#[from] MemoryError),
    /// No UCX context.
    #[error("cannot create the UCX context for {transport}{hint}")]
    Context {
        /// The transport.
        transport: String,
        /// UCX's error.
        #[source]
        source: kvferry_ucx::Error,
        /// What to do about it, when kvferry can tell.
        hint: String,
    },
    /// An agent could not start.
    #[error("starting the agent of rank {rank}")]
    Agent {
        /// The rank.
        rank: u32,
        /// Why.
        #[source]
        source: kvferry_transfer::agent::StartError,
    },
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
    /// A thread could not be started.
    #[error("cannot start a thread")]
    Thread(#[source] std::io::Error),
}

/// Sleeps before every flush: a slow or hung receiver, for the fault tests.
#[derive(Debug)]
struct Stall(Duration);

impl WriteHook for Stall {
    fn before_flush(&self, _: &RemoteRank, _: &kvferry_plan::ValidatedPlan) {
        thread::sleep(self.0);
    }
}

/// One rank this server runs.
#[derive(Debug)]
struct Served {
    info: RankInfo,
    pools: Arc<RankPools>,
}

/// A control connection, numbered from 1 in the order they were proven (never reused, so a
/// closed connection's number names nobody else).
type ControllerId = u64;

/// A context-side request: sent on `pending` ranks, whose terminal events have not come.
#[derive(Debug)]
struct Outgoing {
    /// The control connection that submitted it: the only one that may act on it.
    owner: ControllerId,
    /// Its slots, until they are free again: once every rank here has ended the request
    /// (its terminal event: no write reads them any more), unless its plans are recorded for
    /// a replay (then at its release); the record itself stays until the release.
    allocation: Option<Allocation>,
    pending: BTreeSet<u32>,
    released: bool,
    /// The `Sent` events' bytes and stages, merged over the ranks.
    stats: RequestStats,
}

/// A generation-side request: expected on `pending` ranks.
#[derive(Debug)]
struct Incoming {
    /// The control connection that submitted it: the only one that may act on it (and the
    /// one its `Done` goes to).
    owner: ControllerId,
    /// Its slots, until they are re-primed and free again: once it failed on every rank here
    /// (nothing in them is worth a check) or is released. A received request keeps them for
    /// `Verify` until its release.
    allocation: Option<Allocation>,
    tables: BTreeMap<u32, Vec<SlotTable>>,
    pieces: Vec<PairRequest>,
    pending: BTreeSet<u32>,
    stats: RequestStats,
    errors: Vec<String>,
    cancelled: Option<String>,
    reply: Option<Outbox<ControlMessage>>,
    released: bool,
}

#[derive(Debug)]
struct Shared {
    role: Role,
    instance: String,
    label: String,
    planner_id: String,
    planner_version: String,
    world: u32,
    dp_groups: u32,
    model: ModelSpec,
    oracle: Oracle,
    ranks: BTreeMap<u32, Served>,
    /// Taken out at shutdown, so the agents are dropped (and UCX torn down) before exit.
    agents: RwLock<BTreeMap<u32, Arc<Agent>>>,
    slots: Mutex<SlotPools>,
    outgoing: Mutex<HashMap<u64, Outgoing>>,
    incoming: Mutex<HashMap<u64, Incoming>>,
    timeout: Duration,
    record_plans: bool,
    /// The memcpy baseline's buffers (`Memcpy`), made at its first run and kept.
    arena: Mutex<CopyArena>,
    stopping: AtomicBool,
    shutdown: Sender<()>,
    /// Controllers prove it as peers do (the same secure channel, the control family).
    secret: Secret,
    /// Control connections not proven yet.
    unproven: Unproven,
    /// Control connections open.
    open: AtomicUsize,
    /// The number of the next control connection proven.
    next_controller: AtomicU64,
    /// The proven control connections still open.
    controllers: Mutex<HashSet<ControllerId>>,
    /// Decode side: released or failed requests whose slots are being re-primed (taken
    /// out of their record, not yet back in the free lists); `VerifyIdle` waits for them.
    repriming: AtomicUsize,
}

/// The most control connections a server serves at once; one more closes the oldest unproven
/// one, or, when every one is a proven controller, is closed unanswered.
const MAX_CONTROL_CONNECTIONS: usize = 64;

/// A started server: the agents run, the control listener is bound.
#[derive(Debug)]
pub struct Running {
    shared: Arc<Shared>,
    control: TcpListener,
    control_addr: SocketAddr,
    shutdown: Receiver<()>,
    pumps: Vec<JoinHandle<()>>,
}

/// A server's side of `--metrics-listen` ([`Running::metrics_source`]): its agents' numbers
/// (`/metrics`) and whether they take requests (`/readyz`), until the server stops.
///
/// Every agent is started before [`start`] returns, so before a listener can be handed this,
/// and the agents are taken out only when the server stops: ready means the server has not
/// begun to stop and holds an agent for each of its ranks.
#[derive(Debug)]
pub struct MetricsSource {
    shared: std::sync::Weak<Shared>,
}

impl MetricsSource {
    /// The server, unless it has stopped or is stopping.
    fn live(&self) -> Option<Arc<Shared>> {
        let shared = self.shared.upgrade()?;
        (!shared.stopping.load(Ordering::Acquire)).then_some(shared)
    }
}

impl crate::metrics_http::Source for MetricsSource {
    fn render(&self) -> Option<String> {
        let shared = self.live()?;
        let samples: Vec<_> = shared
            .agents_now()
            .iter()
            .map(|(_, a)| kvferry_transfer::metrics::Sample::of(a))
            .collect();
        Some(kvferry_transfer::metrics::encode(&samples))
    }

    fn readiness(&self) -> crate::metrics_http::Readiness {
        use crate::metrics_http::Readiness;
        let Some(shared) = self.live() else {
            return Readiness::Stopped;
        };
        let agents = shared.agents_now();
        match shared
            .ranks
            .keys()
            .find(|r| !agents.iter().any(|(a, _)| a == *r))
        {
            Some(r) => Readiness::NotReady(format!("rank {r} has no agent")),
            None => Readiness::Ready,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Lays out the ranks this server runs (pools allocated by UCX on one context), primes a
/// decode server's pools with the canary, starts one agent per rank and binds the
/// control listener.
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
    // Before anything is sized by the rank count (the list of ranks hosted here).
    let world = kvferry_testkit::layout::check_mapping(&mapping)
        .map_err(|e| ServeError::Config(format!("--deployment {mapping}: {e}")))?;
    let hosted: Vec<u32> = match options.rank {
        Some(r) if r >= world => {
            return Err(ServeError::Config(format!(
                "--rank {r}: the deployment {mapping} has {world} ranks"
            )));
        }
        Some(r) => vec![r],
        None => (0..world).collect(),
    };
    if hosted.len() > 1 && config.role == Role::Prefill {
        let port = options
            .listen
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok());
        if port != Some(0) {
            return Err(ServeError::Config(format!(
                "--listen {}: {} ranks cannot share one fixed port; use port 0 (each rank a \
                 free port) or one process per rank with --rank",
                options.listen,
                hosted.len()
            )));
        }
    }
    config.memory.check_built()?;
    #[cfg(feature = "cuda")]
    if config.memory == MemoryKind::Cuda {
        kvferry_transfer::harness::memory::check_cuda_device(config.cuda_device)?;
    }
    // Bound before the pools are allocated, so a bad address fails before any memory is.
    let control = TcpListener::bind(&options.control).map_err(listen_error(&options.control))?;
    let control_addr = control
        .local_addr()
        .map_err(listen_error(&options.control))?;
    let context = config
        .transport
        .context_for(config.memory)
        .map_err(|source| ServeError::Context {
            transport: config.transport.to_string(),
            hint: config.transport.context_failure_hint(&source),
            source,
        })?;
    let mut allocator = PoolAllocator::for_memory(&context, config.memory, config.cuda_device)?;
    let pool_options = PoolOptions {
        paged_slots: options.paged_slots,
        state_slots: options.state_slots,
        slot_padding: 0,
        memory_type: allocator.memory_type(),
    };
    let mut infos = Vec::with_capacity(hosted.len());
    for &r in &hosted {
        let info = build_rank(
            &model,
            &mapping,
            &config.name,
            bound.id(),
            r,
            &pool_options,
            &mut |rank, pool, bytes| allocator.alloc(rank, pool, bytes),
        )
        .map_err(|source| ServeError::Layout { rank: r, source })?;
        infos.push(info);
    }
    let mut all: Vec<Option<RankPools>> = allocator.finish(world)?.into_iter().map(Some).collect();
    let oracle = Oracle::new(options.seed);
    let mut ranks = BTreeMap::new();
    for info in infos {
        let r = info.instance_rank;
        let pools = all
            .get_mut(r as usize)
            .and_then(Option::take)
            .map(Arc::new)
            .ok_or_else(|| ServeError::Config(format!("rank {r} got no pools")))?;
        if config.role == Role::Decode {
            // Every free slot holds the canary: primed now, before any peer has our keys.
            prime_all(&oracle, &info, &pools)?;
        }
        ranks.insert(r, Served { info, pools });
    }
    let hook: Option<Arc<dyn WriteHook>> =
        (!options.stall.is_zero()).then(|| Arc::new(Stall(options.stall)) as Arc<dyn WriteHook>);
    let mut agents = BTreeMap::new();
    for (&r, served) in &ranks {
        let mut agent_config = AgentConfig::new(
            &config.name,
            config.role,
            served.info.clone(),
            options.secret.clone(),
        );
        agent_config.label = config.label.clone();
        agent_config.transport = config.transport.clone();
        agent_config.listen = options.listen.clone();
        agent_config.advertise = options.advertise.clone();
        agent_config.timeout = options.timeout;
        agent_config.lease = options.lease;
        agent_config.peer_timeout = options.peer_timeout;
        agent_config.executor.stall_limit = options.stall_limit;
        agent_config.max_connections = options.max_peer_connections;
        agent_config.cuda_device = config.cuda_device;
        agent_config.harness.hook = hook.clone();
        agent_config.harness.record_plans = options.record_plans && config.role == Role::Prefill;
        agent_config.bounce = options.bounce;
        agent_config.integrity = options.integrity;
        // SAFETY: the pools were allocated on `context` by the allocator above, made by
        // `config.transport.context_for(config.memory)`; they are kvferry's memory, kept
        // alive by the agent (and by `ranks`), and this module touches their slots only as
        // the protocol allows: source slots are filled before `send` and left alone until the
        // request's terminal event on every rank holding it (then they may be filled for
        // another); destination slots are read and re-primed only after theirs.
        let agent = unsafe {
            Agent::start_on(
                agent_config,
                bound.clone(),
                Arc::clone(&context),
                Arc::clone(&served.pools),
            )
        }
        .map_err(|source| ServeError::Agent { rank: r, source })?;
        agents.insert(r, Arc::new(agent));
    }
    // The agents' own descriptions carry the planner's blob; the oracle models those.
    for (r, agent) in &agents {
        if let Some(served) = ranks.get_mut(r) {
            served.info = agent.rank_info().clone();
        }
    }
    let dp_groups = ranks.values().next().map_or(1, |s| s.info.dp_groups());
    let has_state = ranks.values().any(|s| {
        s.info
            .page_table
            .groups
            .iter()
            .any(|g| g.kind == GroupKind::STATE)
    });
    let (shutdown_tx, shutdown) = mpsc::channel();
    let shared = Arc::new(Shared {
        role: config.role,
        instance: config.name.clone(),
        label: config.label.clone(),
        planner_id: bound.id().to_string(),
        planner_version: bound.version().to_string(),
        world,
        dp_groups,
        model,
        oracle,
        ranks,
        agents: RwLock::new(agents),
        slots: Mutex::new(SlotPools::new(
            dp_groups,
            options.paged_slots,
            options.state_slots,
            has_state,
        )),
        outgoing: Mutex::new(HashMap::new()),
        incoming: Mutex::new(HashMap::new()),
        timeout: options.timeout,
        record_plans: options.record_plans,
        arena: Mutex::new(CopyArena::new()),
        stopping: AtomicBool::new(false),
        shutdown: shutdown_tx,
        secret: options.secret.clone(),
        unproven: Unproven::new(),
        open: AtomicUsize::new(0),
        next_controller: AtomicU64::new(1),
        controllers: Mutex::new(HashSet::new()),
        repriming: AtomicUsize::new(0),
    });
    let mut pumps = Vec::new();
    for (r, agent) in shared.agents_now() {
        let weak = Arc::downgrade(&shared);
        let pump = thread::Builder::new()
            .name(format!("events-r{r}"))
            .spawn(move || pump(&weak, r, &agent))
            .map_err(ServeError::Thread)?;
        pumps.push(pump);
    }
    Ok(Running {
        shared,
        control,
        control_addr,
        shutdown,
        pumps,
    })
}

/// Hands one agent's events to the server until it stops.
fn pump(shared: &std::sync::Weak<Shared>, rank: u32, agent: &Agent) {
    loop {
        // A failed wait (the descriptor is the agent's, open while it is borrowed here)
        // only means the events are read at once instead of after the tick.
        let _ = kvferry_platform::wait_readable(agent.wake_fd(), PUMP_TICK);
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.stopping.load(Ordering::Acquire) {
            return;
        }
        for event in agent.poll() {
            shared.on_event(rank, event);
        }
    }
}

impl Running {
    /// The bound control address.
    pub fn control_addr(&self) -> SocketAddr {
        self.control_addr
    }

    /// The side-channel endpoints of the prefill ranks this server runs, in rank order.
    pub fn endpoints(&self) -> Vec<String> {
        self.shared
            .agents_now()
            .into_iter()
            .filter_map(|(_, a)| a.endpoint().map(str::to_string))
            .collect()
    }

    /// The ranks this server runs.
    pub fn ranks(&self) -> Vec<u32> {
        self.shared.ranks.keys().copied().collect()
    }

    /// Its agents' numbers in the Prometheus text format and whether they take requests,
    /// until the server stops: what `--metrics-listen` serves
    /// ([`metrics_http::spawn`](crate::metrics_http::spawn)).
    pub fn metrics_source(&self) -> MetricsSource {
        MetricsSource {
            shared: Arc::downgrade(&self.shared),
        }
    }

    /// Stops the server as [`ControlMessage::Shutdown`] does (e.g. when its parent has gone).
    pub fn stopper(&self) -> Sender<()> {
        self.shared.shutdown.clone()
    }

    /// Serves control connections until one asks for [`ControlMessage::Shutdown`] (or the
    /// [`stopper`](Self::stopper) fires); then stops the agents — every connection ended,
    /// UCX torn down — and returns.
    pub fn run(self) {
        let Running {
            shared,
            control,
            shutdown,
            pumps,
            ..
        } = self;
        let accept_shared = Arc::clone(&shared);
        let accepting = thread::Builder::new()
            .name("control-accept".into())
            .spawn(move || {
                for stream in control.incoming() {
                    if accept_shared.stopping.load(Ordering::Acquire) {
                        break;
                    }
                    let stream = match stream {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(error = %e, "accept failed");
                            thread::sleep(Duration::from_millis(50));
                            continue;
                        }
                    };
                    // Full, it closes the oldest unproven connection for this one; only when
                    // every connection is a proven controller is this one turned away.
                    let Some(pending) = accept_shared.unproven.admit_counted(
                        &stream,
                        &accept_shared.open,
                        MAX_CONTROL_CONNECTIONS,
                    ) else {
                        tracing::warn!(
                            limit = MAX_CONTROL_CONNECTIONS,
                            "control listener full of proven or closing connections: connection refused"
                        );
                        continue;
                    };
                    let shared = Arc::clone(&accept_shared);
                    let spawned = thread::Builder::new()
                        .name("control".into())
                        .spawn(move || {
                            connection(&shared, stream, pending);
                            shared.open.fetch_sub(1, Ordering::AcqRel);
                        });
                    if let Err(e) = spawned {
                        // The connection (and its place) went with the closure.
                        accept_shared.open.fetch_sub(1, Ordering::AcqRel);
                        tracing::warn!(error = %e, "cannot spawn a connection thread");
                    }
                }
            });
        if let Err(e) = accepting {
            tracing::warn!(error = %e, "cannot spawn the control accept thread");
        } else {
            let _ = shutdown.recv();
        }
        shared.stopping.store(true, Ordering::Release);
        for pump in pumps {
            let _ = pump.join();
        }
        let agents = std::mem::take(&mut *shared.agents.write().unwrap_or_else(|e| e.into_inner()));
        // Each agent ends its connections and waits for its threads as it drops.
        drop(agents);
        tracing::info!(instance = %shared.instance, "stopped");
    }
}

impl Shared {
    fn tokens_per_block(&self) -> u64 {
        u64::from(self.model.tokens_per_block)
    }

    fn agents_now(&self) -> Vec<(u32, Arc<Agent>)> {
        self.agents
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(&r, a)| (r, Arc::clone(a)))
            .collect()
    }

    fn agent(&self, rank: u32) -> Option<Arc<Agent>> {
        self.agents
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&rank)
            .cloned()
    }

    /// The ranks of DP group `dp` this server runs.
    fn group(&self, dp: u32) -> Result<Vec<u32>, String> {
        if dp >= self.dp_groups {
            return Err(format!(
                "DP rank {dp} does not exist ({} dp groups)",
                self.dp_groups
            ));
        }
        Ok(self
            .ranks
            .values()
            .filter(|s| s.info.dp_rank == dp)
            .map(|s| s.info.instance_rank)
            .collect())
    }

    fn info(&self) -> ServerInfo {
        let agents = self.agents_now();
        ServerInfo {
            instance: self.instance.clone(),
            role: self.role,
            planner_id: self.planner_id.clone(),
            planner_version: self.planner_version.clone(),
            label: self.label.clone(),
            world: self.world,
            ranks: self
                .ranks
                .iter()
                .map(|(r, s)| ServedRank {
                    info: s.info.clone(),
                    endpoint: agents
                        .iter()
                        .find(|(a, _)| a == r)
                        .and_then(|(_, a)| a.endpoint().map(str::to_string)),
                })
                .collect(),
        }
    }

    /// Answers one message of the control connection `controller`.
    fn handle(
        self: &Arc<Self>,
        outbox: &Outbox<ControlMessage>,
        controller: ControllerId,
        message: ControlMessage,
    ) -> bool {
        let reply = match (message, self.role) {
            (ControlMessage::InfoRequest, _) => ControlMessage::Info(self.info()),
            (ControlMessage::Shutdown, _) => {
                tracing::info!("shutdown requested");
                let _ = self.shutdown.send(());
                return false;
            }
            (ControlMessage::Submit(submit), Role::Prefill) => {
                let request = submit.request;
                let result = self.prefill(submit, controller).inspect_err(|e| {
                    tracing::warn!(request, error = %e, "prefill refused");
                });
                ControlMessage::Submitted { request, result }
            }
            (ControlMessage::Submit(submit), Role::Decode) => {
                let request = submit.request;
                match self.expect(submit, outbox, controller) {
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
            (ControlMessage::Release { request }, Role::Prefill) => {
                match self.release_outgoing(request, controller) {
                    Ok(()) => ControlMessage::Released { request },
                    Err(message) => refused(request, message),
                }
            }
            (ControlMessage::Release { request }, Role::Decode) => {
                match self.release_incoming(request, controller) {
                    Ok(()) => ControlMessage::Released { request },
                    Err(message) => refused(request, message),
                }
            }
            (ControlMessage::Cancel { request, reason }, Role::Decode) => {
                match self.cancel_incoming(request, reason, Some(controller)) {
                    Ok(()) => return true,
                    Err(message) => refused(request, message),
                }
            }
            (ControlMessage::Verify { request, context }, Role::Decode) => {
                let result = self.verify(request, &context, controller);
                ControlMessage::Verified { request, result }
            }
            (ControlMessage::Tables { request }, Role::Decode) => ControlMessage::TablesDone {
                request,
                result: self.incoming_tables(request, controller),
            },
            (ControlMessage::VerifyIdle, Role::Decode) => ControlMessage::IdleVerified {
                result: self.verify_idle(),
            },
            (ControlMessage::Bench { .. }, Role::Prefill) if !self.record_plans => {
                ControlMessage::BenchDone {
                    result: Err(NOT_RECORDING.into()),
                }
            }
            (ControlMessage::Fragments { .. }, Role::Prefill) if !self.record_plans => {
                ControlMessage::FragmentsDone {
                    result: Err(NOT_RECORDING.into()),
                }
            }
            (ControlMessage::Memcpy { .. }, Role::Prefill) if !self.record_plans => {
                ControlMessage::MemcpyDone {
                    result: Err(NOT_RECORDING.into()),
                }
            }
            (ControlMessage::Memcpy { requests }, Role::Prefill) => {
                let result = self.memcpy(&requests, controller).inspect_err(|e| {
                    tracing::warn!(error = %e, "bench memcpy failed");
                });
                ControlMessage::MemcpyDone { result }
            }
            (ControlMessage::Stats { requests }, Role::Prefill) => ControlMessage::StatsDone {
                result: self.outgoing_stats(&requests, controller),
            },
            (ControlMessage::Fragments { requests }, Role::Prefill) => {
                ControlMessage::FragmentsDone {
                    result: self
                        .fragments(&requests, controller)
                        .and_then(fits_one_frame),
                }
            }
            (ControlMessage::Bench { requests }, Role::Prefill) => {
                let result = self.replay(&requests, controller).inspect_err(|e| {
                    tracing::warn!(error = %e, "bench replay failed");
                });
                ControlMessage::BenchDone { result }
            }
            (other, _) => ControlMessage::Error {
                message: format!(
                    "{} is not a message a {} server accepts",
                    other.kind(),
                    self.role
                ),
            },
        };
        self.answer(outbox, reply)
    }

    fn answer(&self, outbox: &Outbox<ControlMessage>, reply: ControlMessage) -> bool {
        let close = matches!(reply, ControlMessage::Error { .. });
        let _ = outbox.send(reply);
        !close
    }

    /// The prefill side's "prefill": slots for the DP group's ranks served here, tags from
    /// the oracle, then every chunk handed to each rank's agent. The request is
    /// `controller`'s.
    fn prefill(
        self: &Arc<Self>,
        submit: Submit,
        controller: ControllerId,
    ) -> Result<Vec<RankTables>, String> {
        let id = submit.request;
        let pieces = kvferry_plan::pieces(
            submit.prompt_len,
            self.model.tokens_per_block,
            submit.chunks.as_deref(),
        )
        .map_err(|e| format!("request {id}: {e}"))?;
        let group = self
            .group(submit.ctx_dp_rank)
            .map_err(|e| format!("request {id}: {e}"))?;
        if group.is_empty() {
            return Ok(Vec::new());
        }
        let blocks = submit.prompt_len.div_ceil(self.tokens_per_block());
        // The id check, the allocation and the record are one step: two submits of one id
        // racing each other must not both allocate (one would leak).
        let allocation = {
            let mut outgoing = lock(&self.outgoing);
            if let Some(out) = outgoing.get(&id) {
                return Err(self.duplicate(id, out.owner, controller));
            }
            let allocation = lock(&self.slots)
                .allocate(submit.ctx_dp_rank, blocks, id ^ 0x00c0_17e7)
                .map_err(|e| format!("request {id}: {e}"))?;
            outgoing.insert(
                id,
                Outgoing {
                    owner: controller,
                    allocation: Some(allocation.clone()),
                    pending: BTreeSet::new(),
                    released: false,
                    stats: RequestStats::default(),
                },
            );
            allocation
        };
        // Filled outside the lock (it may be gigabytes): no agent has the request yet.
        let mut tables = BTreeMap::new();
        for &r in &group {
            let served = &self.ranks[&r];
            let t = slot_tables(&served.info, submit.prompt_len, 0, &allocation.assignment);
            if let Err(e) = fill_slots(&self.oracle, &served.info, &served.pools, &t) {
                if let Some(allocation) = lock(&self.outgoing)
                    .remove(&id)
                    .and_then(|out| out.allocation)
                {
                    lock(&self.slots).free(&allocation);
                }
                return Err(format!(
                    "request {id}: filling rank {r}: {}",
                    error_chain(&e)
                ));
            }
            tables.insert(r, t);
        }
        if let Some(out) = lock(&self.outgoing).get_mut(&id) {
            out.pending = group.iter().copied().collect();
        }
        // (rank, why, whether it took an earlier send).
        let mut refused = None;
        'ranks: for (&r, t) in &tables {
            let Some(agent) = self.agent(r) else {
                refused = Some((r, "the server is stopping".to_string(), false));
                break;
            };
            let parts = layer_parts(&self.ranks[&r].info, submit.layer_parts);
            let mut took = false;
            for piece in &pieces {
                for (j, views) in parts.iter().enumerate() {
                    let sent = agent.send(SendChunk {
                        request: id,
                        tables: t.clone(),
                        tokens: piece.token_range,
                        prompt_len: submit.prompt_len,
                        is_last: piece.is_last && j + 1 == parts.len(),
                        to: None,
                        views: views.clone(),
                    });
                    if let Err(e) = sent {
                        refused = Some((r, e.to_string(), took));
                        break 'ranks;
                    }
                    took = true;
                }
            }
        }
        if let Some((rank, reason, took_some)) = refused {
            // Ranks that took a chunk end in an event; the slots come back after the last.
            self.release_outgoing_refused(id, rank, took_some);
            return Err(format!("request {id}: rank {rank}: {reason}"));
        }
        Ok(tables
            .into_iter()
            .map(|(rank, tables)| RankTables {
                rank,
                info: self.ranks[&rank].info.clone(),
                tables,
            })
            .collect())
    }

    /// A prefill rank `refused` refused a chunk of: the ranks after it never took the request,
    /// and neither did it unless `took_some` (an earlier chunk); the others are cancelled.
    fn release_outgoing_refused(&self, id: u64, refused: u32, took_some: bool) {
        let cancel: Vec<u32> = {
            let mut outgoing = lock(&self.outgoing);
            let Some(out) = outgoing.get_mut(&id) else {
                return;
            };
            out.pending
                .retain(|&r| r < refused || (r == refused && took_some));
            out.released = true;
            out.pending.iter().copied().collect()
        };
        // What a rank that took a chunk recorded goes with the request.
        for (_, agent) in self.agents_now() {
            agent.forget_recorded(&[id]);
        }
        for r in cancel {
            if let Some(agent) = self.agent(r) {
                let _ = agent.cancel(id);
            }
        }
        self.settle_outgoing(id);
    }

    /// Lets go of `controller`'s context request: once every rank's terminal event is in,
    /// its slots are free (they may be already) and its record is gone; a rank still sending
    /// is cancelled. Another controller's request is refused, untouched.
    fn release_outgoing(&self, id: u64, controller: ControllerId) -> Result<(), String> {
        let cancel: Vec<u32> = {
            let mut outgoing = lock(&self.outgoing);
            let Some(out) = outgoing.get_mut(&id) else {
                return Ok(());
            };
            if out.owner != controller {
                return Err(self.foreign(id, out.owner));
            }
            out.released = true;
            out.pending.iter().copied().collect()
        };
        for (_, agent) in self.agents_now() {
            agent.forget_recorded(&[id]);
        }
        for r in cancel {
            if let Some(agent) = self.agent(r) {
                let _ = agent.cancel(id);
            }
        }
        self.settle_outgoing(id);
        Ok(())
    }

    /// Whether a rank here keeps plans recorded for `id` (a replay would read its source
    /// slots).
    fn recorded(&self, id: u64) -> bool {
        self.record_plans && self.agents_now().iter().any(|(_, a)| a.has_recorded(id))
    }

    fn settle_outgoing(&self, id: u64) {
        let recorded = self.recorded(id);
        let mut outgoing = lock(&self.outgoing);
        self.settle_outgoing_locked(&mut outgoing, id, recorded);
    }

    /// Once every rank here has ended request `id` (no write reads its source slots any
    /// more), frees its slots — unless `recorded` (a replay may still read them) and it is
    /// not released — and drops the record of a released one. Under the `outgoing` lock, so
    /// whoever sees no rank pending sees the slots free too.
    fn settle_outgoing_locked(
        &self,
        outgoing: &mut HashMap<u64, Outgoing>,
        id: u64,
        recorded: bool,
    ) {
        let Some(out) = outgoing.get_mut(&id) else {
            return;
        };
        if !out.pending.is_empty() {
            return;
        }
        let freed = if out.released {
            outgoing.remove(&id).and_then(|out| out.allocation)
        } else if recorded {
            None
        } else {
            out.allocation.take()
        };
        if let Some(allocation) = freed {
            lock(&self.slots).free(&allocation);
        }
    }

    /// An agent's event.
    fn on_event(&self, rank: u32, event: Event) {
        let id = event.request();
        if !event.is_terminal() {
            return;
        }
        match self.role {
            Role::Prefill => {
                if let Event::Failed {
                    peer, kind, detail, ..
                } = &event
                {
                    let peer = peer.as_deref().map(tracing::field::display);
                    tracing::warn!(request = id, rank, peer, %kind, %detail, "send failed");
                }
                let recorded = self.recorded(id);
                let mut outgoing = lock(&self.outgoing);
                let Some(out) = outgoing.get_mut(&id) else {
                    return;
                };
                // Not this rank's to end (it never took the request, or ended it already).
                if !out.pending.remove(&rank) {
                    return;
                }
                if let Event::Sent {
                    bytes,
                    puts,
                    stages,
                    ..
                } = &event
                {
                    out.stats.merge(&RequestStats {
                        bytes: *bytes,
                        puts: *puts,
                        stages: *stages,
                        ..RequestStats::default()
                    });
                }
                self.settle_outgoing_locked(&mut outgoing, id, recorded);
            }
            Role::Decode => self.on_incoming_event(rank, event),
        }
    }

    /// Why a controller may not act on request `id`, which `owner` submitted.
    fn foreign(&self, id: u64, owner: ControllerId) -> String {
        format!(
            "request {id} belongs to another controller{}: only the control connection that \
             submitted it may act on it",
            self.closed(owner)
        )
    }

    /// Why `controller`'s `Submit` of an id held here (submitted by `owner`) is refused.
    fn duplicate(&self, id: u64, owner: ControllerId, controller: ControllerId) -> String {
        if owner == controller {
            format!("request {id} already exists")
        } else {
            format!(
                "request {id} already exists: it belongs to another controller{}",
                self.closed(owner)
            )
        }
    }

    /// What a refusal adds when `owner`'s connection has closed.
    fn closed(&self, owner: ControllerId) -> &'static str {
        if lock(&self.controllers).contains(&owner) {
            ""
        } else {
            " (its connection has closed)"
        }
    }

    /// The decode side of a request: slots for the DP group's ranks served here (they
    /// hold the canary), then each rank's agent expects it; the outcome goes to the
    /// controller as [`ControlMessage::Done`] once every rank's terminal event is in. The
    /// request is `controller`'s (whose connection `outbox` writes to).
    fn expect(
        self: &Arc<Self>,
        submit: Submit,
        outbox: &Outbox<ControlMessage>,
        controller: ControllerId,
    ) -> Result<(), String> {
        let id = submit.request;
        let PeerRef {
            instance: peer,
            endpoints,
        } = submit
            .peer
            .clone()
            .ok_or_else(|| format!("request {id}: no context peer"))?;
        if submit.cached > submit.prompt_len {
            return Err(format!(
                "request {id}: cached {} exceeds prompt_len {}",
                submit.cached, submit.prompt_len
            ));
        }
        let mut pieces = kvferry_plan::pieces(
            submit.prompt_len,
            self.model.tokens_per_block,
            submit.chunks.as_deref(),
        )
        .map_err(|e| format!("request {id}: {e}"))?;
        let tpb = self.tokens_per_block();
        let cached = submit.cached / tpb * tpb;
        let cached_prefix = (cached > 0).then_some(cached);
        for p in &mut pieces {
            p.dst_start_token = cached_prefix.into();
        }
        let group = self
            .group(submit.gen_dp_rank)
            .map_err(|e| format!("request {id}: {e}"))?;
        if group.is_empty() {
            let _ = outbox.send(ControlMessage::Done {
                request: id,
                result: Ok(RequestStats::default()),
            });
            return Ok(());
        }
        let tables = {
            let mut incoming = lock(&self.incoming);
            if let Some(inc) = incoming.get(&id) {
                return Err(self.duplicate(id, inc.owner, controller));
            }
            let blocks = submit.prompt_len.div_ceil(tpb);
            let allocation = lock(&self.slots)
                .allocate(submit.gen_dp_rank, blocks, id ^ 0x0009_e4e7)
                .map_err(|e| format!("request {id}: {e}"))?;
            // Free slots hold the canary already (primed at start, re-primed when freed).
            let tables: BTreeMap<u32, Vec<SlotTable>> = group
                .iter()
                .map(|&r| {
                    let info = &self.ranks[&r].info;
                    let t = slot_tables(
                        info,
                        submit.prompt_len,
                        submit.cached,
                        &allocation.assignment,
                    );
                    (r, t)
                })
                .collect();
            incoming.insert(
                id,
                Incoming {
                    owner: controller,
                    allocation: Some(allocation),
                    tables: tables.clone(),
                    pieces,
                    pending: group.iter().copied().collect(),
                    stats: RequestStats::default(),
                    errors: Vec::new(),
                    cancelled: None,
                    reply: Some(outbox.clone()),
                    released: false,
                },
            );
            tables
        };
        let mut accepted = 0;
        for (&r, t) in &tables {
            let result = match self.agent(r) {
                Some(agent) => agent
                    .expect(Expect {
                        request: id,
                        peer: peer.clone(),
                        endpoints: endpoints.clone(),
                        ctx_dp_rank: submit.ctx_dp_rank,
                        prompt_len: submit.prompt_len,
                        cached_prefix,
                        tables: t.clone(),
                        excluded_views: Vec::new(),
                    })
                    .map_err(|e| e.to_string()),
                None => Err("the server is stopping".to_string()),
            };
            match result {
                Ok(()) => accepted += 1,
                Err(e) => {
                    // This rank took nothing: no event will come from it.
                    let mut incoming = lock(&self.incoming);
                    if let Some(inc) = incoming.get_mut(&id) {
                        inc.pending.remove(&r);
                        inc.errors.push(format!("rank {r}: {e}"));
                    }
                }
            }
        }
        if accepted == 0 {
            let refused = lock(&self.incoming).remove(&id);
            let reason = match refused {
                Some(inc) => {
                    // No rank took it: nothing was written to its slots.
                    if let Some(allocation) = &inc.allocation {
                        lock(&self.slots).free(allocation);
                    }
                    inc.errors.join("; ")
                }
                None => "refused".into(),
            };
            return Err(format!("request {id}: {reason}"));
        }
        if accepted < tables.len() {
            // Half a request is no request: the ranks that took it are cancelled.
            let _ = self.cancel_incoming(id, "another rank refused it".into(), None);
        }
        self.settle_incoming(id);
        Ok(())
    }

    fn on_incoming_event(&self, rank: u32, event: Event) {
        let id = event.request();
        {
            let mut incoming = lock(&self.incoming);
            let Some(inc) = incoming.get_mut(&id) else {
                return;
            };
            if !inc.pending.remove(&rank) {
                return;
            }
            match event {
                Event::Received { stats, .. } => inc.stats.merge(&stats),
                Event::Cancelled { .. } => {
                    let why = inc.cancelled.clone().unwrap_or_else(|| "cancelled".into());
                    inc.errors.push(format!("rank {rank}: cancelled: {why}"));
                }
                Event::Failed {
                    peer, kind, detail, ..
                } => {
                    let peer = peer.map(|p| format!(" (peer {p})")).unwrap_or_default();
                    inc.errors
                        .push(format!("request {id}: rank {rank}: {kind}{peer}: {detail}"));
                }
                _ => {}
            }
        }
        self.settle_incoming(id);
    }

    /// Once every rank here has ended a request: re-primes and frees its slots if it is
    /// released, or failed (its record, with the reason, stays until the release), then
    /// reports it — so a controller told of a failure finds its slots free again.
    fn settle_incoming(&self, id: u64) {
        let mut incoming = lock(&self.incoming);
        let Some(inc) = incoming.get_mut(&id) else {
            return;
        };
        if !inc.pending.is_empty() {
            return;
        }
        let done = inc.reply.take().map(|reply| {
            let result = if inc.errors.is_empty() {
                Ok(inc.stats.clone())
            } else {
                Err(inc.errors.join("; "))
            };
            (reply, result)
        });
        let freed = if inc.released {
            incoming
                .remove(&id)
                .and_then(|inc| Some((inc.allocation?, inc.tables)))
        } else if !inc.errors.is_empty() {
            inc.allocation.take().map(|a| (a, inc.tables.clone()))
        } else {
            None
        };
        if freed.is_some() {
            // Counted before the lock goes, so `VerifyIdle` sees the slots held one way or
            // the other.
            self.repriming.fetch_add(1, Ordering::AcqRel);
        }
        drop(incoming);
        if let Some((allocation, tables)) = freed {
            self.reprime_and_free(&allocation, &tables);
            self.repriming.fetch_sub(1, Ordering::AcqRel);
        }
        if let Some((reply, result)) = done {
            let _ = reply.send(ControlMessage::Done {
                request: id,
                result,
            });
        }
    }

    /// Gives the slots of an ended request the canary again and returns them to the free
    /// lists.
    fn reprime_and_free(&self, allocation: &Allocation, tables: &BTreeMap<u32, Vec<SlotTable>>) {
        for (r, tables) in tables {
            let served = &self.ranks[r];
            if let Err(e) = prime_slots(&self.oracle, &served.info, &served.pools, tables) {
                tracing::warn!(rank = r, error = %error_chain(&e), "cannot re-prime released slots");
            }
        }
        lock(&self.slots).free(allocation);
    }

    /// Cancels a request on every rank still expecting it; its `Done` reports it. `by`: the
    /// controller asking (`None`: the server itself); another controller's request is
    /// refused, untouched.
    fn cancel_incoming(
        &self,
        id: u64,
        reason: String,
        by: Option<ControllerId>,
    ) -> Result<(), String> {
        let ranks: Vec<u32> = {
            let mut incoming = lock(&self.incoming);
            let Some(inc) = incoming.get_mut(&id) else {
                return Ok(());
            };
            if by.is_some_and(|c| c != inc.owner) {
                return Err(self.foreign(id, inc.owner));
            }
            inc.cancelled.get_or_insert(reason);
            inc.pending.iter().copied().collect()
        };
        for r in ranks {
            if let Some(agent) = self.agent(r) {
                let _ = agent.cancel(id);
            }
        }
        Ok(())
    }

    /// Lets go of `controller`'s generation request; once every rank's terminal event is in,
    /// its slots get the canary again and return to the free lists (they may be already) and
    /// its record is gone. Another controller's request is refused, untouched.
    fn release_incoming(&self, id: u64, controller: ControllerId) -> Result<(), String> {
        let pending = {
            let mut incoming = lock(&self.incoming);
            let Some(inc) = incoming.get_mut(&id) else {
                return Ok(());
            };
            if inc.owner != controller {
                return Err(self.foreign(id, inc.owner));
            }
            inc.released = true;
            !inc.pending.is_empty()
        };
        if pending {
            self.cancel_incoming(id, "released".into(), None)?;
        }
        self.settle_incoming(id);
        Ok(())
    }

    /// `controller`'s request in `incoming`, once every writer has reported, or why not.
    fn completed<'m>(
        &self,
        incoming: &'m HashMap<u64, Incoming>,
        request: u64,
        controller: ControllerId,
    ) -> Result<&'m Incoming, String> {
        let inc = incoming
            .get(&request)
            .ok_or_else(|| format!("request {request} is not held here"))?;
        if inc.owner != controller {
            return Err(self.foreign(request, inc.owner));
        }
        if !inc.pending.is_empty() {
            return Err(format!("request {request} has not completed"));
        }
        Ok(inc)
    }

    /// The slot tables `controller`'s completed request landed in, per rank here.
    fn incoming_tables(
        &self,
        request: u64,
        controller: ControllerId,
    ) -> Result<Vec<RankTables>, String> {
        let incoming = lock(&self.incoming);
        Ok(self
            .completed(&incoming, request, controller)?
            .tables
            .iter()
            .map(|(&rank, tables)| RankTables {
                rank,
                info: self.ranks[&rank].info.clone(),
                tables: tables.clone(),
            })
            .collect())
    }

    /// Checks `controller`'s completed request's destination slots with the oracle.
    fn verify(
        &self,
        request: u64,
        context: &[RankTables],
        controller: ControllerId,
    ) -> Result<VerifySummary, String> {
        // What the check needs, copied out: the oracle reads gigabytes, and the event pumps
        // must not wait for it.
        let (tables, pieces) = {
            let incoming = lock(&self.incoming);
            let inc = self.completed(&incoming, request, controller)?;
            if !inc.errors.is_empty() {
                return Err(format!(
                    "request {request} failed: {}",
                    inc.errors.join("; ")
                ));
            }
            (inc.tables.clone(), inc.pieces.clone())
        };
        let parts: Vec<ReceiverPart<'_>> = tables
            .iter()
            .map(|(r, t)| {
                let served = &self.ranks[r];
                ReceiverPart {
                    info: &served.info,
                    pools: &served.pools,
                    tables: t,
                    excluded: &[],
                }
            })
            .collect();
        let ctx: Vec<(&RankInfo, &[SlotTable])> = context
            .iter()
            .map(|t| (&t.info, t.tables.as_slice()))
            .collect();
        let report = verify_request(&self.oracle, &parts, &ctx, &pieces)
            .map_err(|e| format!("request {request}: {}", error_chain(&e)))?;
        Ok(summary(&report))
    }

    fn verify_idle(&self) -> Result<VerifySummary, String> {
        let agents: usize = self
            .agents_now()
            .iter()
            .map(|(_, a)| a.requests_held())
            .sum();
        // A request that failed keeps its record (and reason) until released, not its slots.
        let held = agents.max(
            lock(&self.incoming)
                .values()
                .filter(|inc| inc.allocation.is_some())
                .count(),
        );
        if held > 0 {
            return Err(format!("{held} requests still hold slots"));
        }
        // Slots taken from an ended request are free once they hold the canary again.
        let deadline = Instant::now() + self.timeout + REPLAY_GRACE;
        while self.repriming.load(Ordering::Acquire) > 0 {
            if Instant::now() >= deadline {
                return Err("released slots are still being re-primed".into());
            }
            thread::sleep(Duration::from_millis(1));
        }
        let ranks: Vec<_> = self
            .ranks
            .values()
            .map(|s| (&s.info, s.pools.as_ref()))
            .collect();
        let report = verify_idle(&self.oracle, &ranks).map_err(|e| error_chain(&e))?;
        Ok(summary(&report))
    }

    /// None of `requests` is held here for another controller than `controller`.
    fn check_owner(&self, requests: &[u64], controller: ControllerId) -> Result<(), String> {
        let outgoing = lock(&self.outgoing);
        match requests
            .iter()
            .find_map(|id| Some((*id, outgoing.get(id)?.owner)).filter(|&(_, o)| o != controller))
        {
            Some((id, owner)) => Err(self.foreign(id, owner)),
            None => Ok(()),
        }
    }

    /// Every one of `requests` was written (and recorded) by some rank here.
    fn check_recorded(&self, requests: &[u64]) -> Result<(), String> {
        let agents = self.agents_now();
        match requests
            .iter()
            .find(|&&id| !agents.iter().any(|(_, a)| a.has_recorded(id)))
        {
            Some(id) => Err(format!(
                "request {id} has no recorded plans here (not prefilled, not claimed yet, or \
                 released)"
            )),
            None => Ok(()),
        }
    }

    /// The bare replay of `requests`' recorded plans on every rank at once, timed from the
    /// first rank's first put to the last rank's last flush.
    fn replay(&self, requests: &[u64], controller: ControllerId) -> Result<BenchStats, String> {
        self.check_owner(requests, controller)?;
        self.check_recorded(requests)?;
        let mut waiting = Vec::new();
        for (r, agent) in self.agents_now() {
            let rx = agent
                .replay(requests)
                .map_err(|e| format!("prefill rank {r}: {e}"))?;
            waiting.extend(rx.map(|rx| (r, rx)));
        }
        let limit = Instant::now() + self.timeout + REPLAY_GRACE;
        let mut stats = BenchStats::default();
        let mut span: Option<(Instant, Instant)> = None;
        for (r, rx) in waiting {
            let left = limit.saturating_duration_since(Instant::now());
            let replay = rx
                .recv_timeout(left)
                .map_err(|_| format!("prefill rank {r}: the replay did not finish in time"))?
                .map_err(|e| format!("prefill rank {r}: {}", error_chain(&e)))?;
            stats.bytes += replay.written.bytes;
            stats.fragments += replay.written.fragments;
            stats.puts += replay.written.puts;
            stats.plans += replay.plans;
            stats.ranks += 1;
            stats.stages.merge(&Stages {
                puts_ns: replay.written.puts_ns,
                flush_ns: replay.written.flush_ns,
                ..Stages::default()
            });
            span = Some(match span {
                None => (replay.started, replay.finished),
                Some((a, b)) => (a.min(replay.started), b.max(replay.finished)),
            });
        }
        if let Some((started, finished)) = span {
            stats.elapsed_ns = finished.duration_since(started).as_nanos() as u64;
        }
        Ok(stats)
    }

    /// The recorded fragments of `requests` copied with memcpy between buffers shaped like
    /// the pools, one thread per prefill rank, timed from the first copy to the last.
    fn memcpy(&self, requests: &[u64], controller: ControllerId) -> Result<BenchStats, String> {
        let pairs = self.fragments(requests, controller)?;
        let mut arena = lock(&self.arena);
        let copied = arena.copy(&pairs).map_err(|e| error_chain(&e))?;
        Ok(BenchStats {
            elapsed_ns: copied.finished.duration_since(copied.started).as_nanos() as u64,
            bytes: copied.bytes,
            fragments: copied.fragments,
            puts: copied.fragments,
            plans: copied.plans,
            ranks: copied.ranks,
            stages: Stages {
                copy_ns: copied.copy_ns,
                ..Stages::default()
            },
        })
    }

    /// The prefill side's statistics of `requests`, once every rank here has ended each (a
    /// request not held here counts nothing; one another controller submitted refuses them
    /// all).
    fn outgoing_stats(
        &self,
        requests: &[u64],
        controller: ControllerId,
    ) -> Result<Vec<RequestStats>, String> {
        let deadline = Instant::now() + self.timeout + REPLAY_GRACE;
        loop {
            {
                let outgoing = lock(&self.outgoing);
                let mut stats = Vec::with_capacity(requests.len());
                let mut pending = None;
                for id in requests {
                    // Not held: another DP group's (none of its ranks is here), or released.
                    let Some(out) = outgoing.get(id) else {
                        stats.push(RequestStats::default());
                        continue;
                    };
                    if out.owner != controller {
                        return Err(self.foreign(*id, out.owner));
                    }
                    if !out.pending.is_empty() {
                        pending = Some(*id);
                        break;
                    }
                    stats.push(out.stats.clone());
                }
                match pending {
                    None => return Ok(stats),
                    Some(id) if Instant::now() >= deadline => {
                        return Err(format!(
                            "request {id} has not ended on every rank here after {} ms",
                            (self.timeout + REPLAY_GRACE).as_millis()
                        ));
                    }
                    Some(_) => {}
                }
            }
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// The recorded fragments of `requests`, per (prefill rank, decode rank) pair.
    fn fragments(
        &self,
        requests: &[u64],
        controller: ControllerId,
    ) -> Result<Vec<PairFragments>, String> {
        self.check_owner(requests, controller)?;
        self.check_recorded(requests)?;
        let mut pairs = Vec::new();
        for (r, agent) in self.agents_now() {
            pairs.extend(
                agent
                    .recorded_fragments(requests)
                    .map_err(|e| format!("prefill rank {r}: {e}"))?,
            );
        }
        Ok(pairs)
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

/// Serves one control connection until it closes or misbehaves: first the secure handshake
/// under the deployment's secret (a controller without it learns nothing and can do
/// nothing), then messages.
fn connection(shared: &Arc<Shared>, stream: TcpStream, pending: Pending) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "unknown".to_string(), |a| a.to_string());
    let _span = tracing::info_span!("control", %peer).entered();
    let _ = stream.set_nodelay(true);
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let Secured {
        mut reader, writer, ..
    } = match secure_accept::<ControlMessage>(stream, &shared.secret, deadline) {
        Ok((secured, _intent)) => secured,
        Err(e) => {
            tracing::info!(error = %error_chain(&e), "control handshake failed");
            return;
        }
    };
    // The first frame proves the controller holds the secret (its first record opens).
    let first = read_frame::<ControlMessage>(&mut reader);
    drop(pending);
    if first.is_err() && reader.records_opened() == 0 {
        // Not proven: it learns nothing.
        tracing::info!("control connection ended before it was proven");
        return;
    }
    let outbox = spawn_writer::<ControlMessage>(writer, peer.clone());
    // Proven: control connections may idle between requests.
    let _ = reader.get_mut().get_mut().settle(None);
    // The requests this connection submits are its own, also after it closes.
    let controller = Controller::open(shared);
    tracing::debug!(controller = controller.id, "control connection proven");
    let mut next = first;
    let refusal = loop {
        let message: ControlMessage = match next {
            Ok(m) => m,
            Err(e) if e.is_disconnect() => break None,
            Err(e) => break Some(error_chain(&e)),
        };
        tracing::trace!(kind = message.kind(), "message");
        if !shared.handle(&outbox, controller.id, message) {
            break None;
        }
        next = read_frame(&mut reader);
    };
    if let Some(reason) = refusal {
        tracing::warn!(%reason, "refusing connection");
        let _ = outbox.send(ControlMessage::Error {
            message: format!("connection refused: {reason}"),
        });
        drop(outbox);
        let stream = reader.get_mut();
        let _ = stream.get_mut().settle(Some(DRAIN));
        drain(stream, DRAIN);
    }
}

/// A proven control connection while it is open (its number leaves the open set when it is
/// dropped).
struct Controller<'a> {
    shared: &'a Shared,
    id: ControllerId,
}

impl<'a> Controller<'a> {
    fn open(shared: &'a Shared) -> Self {
        let id = shared.next_controller.fetch_add(1, Ordering::AcqRel);
        lock(&shared.controllers).insert(id);
        Controller { shared, id }
    }
}

impl Drop for Controller<'_> {
    fn drop(&mut self) {
        lock(&self.shared.controllers).remove(&self.id);
    }
}

/// The answer to a `Release` or `Cancel` of another controller's request.
fn refused(request: u64, message: String) -> ControlMessage {
    tracing::warn!(request, %message, "refused");
    ControlMessage::Refused { request, message }
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

/// The views of each layer-wise send of a chunk on a rank described by `info`: its views in
/// page-table order, split into `parts` runs as even as they go (at most one run per view);
/// one send of every view when `parts` is 0 or 1.
fn layer_parts(info: &RankInfo, parts: u32) -> Vec<Option<Vec<ViewId>>> {
    let views: Vec<ViewId> = info.page_table.view_ids().collect();
    let n = (parts as usize).min(views.len());
    if n <= 1 {
        return vec![None];
    }
    (0..n)
        .map(|k| Some(views[k * views.len() / n..(k + 1) * views.len() / n].to_vec()))
        .collect()
}
