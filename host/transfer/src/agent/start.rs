//! Starting an agent ([`Agent::start`], [`Agent::start_on`]) and what a start checks,
//! binds and advertises.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Instant;

use kvferry_loader::BoundPlanner;
use kvferry_planner_abi::RankInfo;
use kvferry_planner_abi::ffi::RVec;
use kvferry_protocol::Role;
use kvferry_ucx::{Context, Worker};

use crate::bounce::{Arena, Staging};
use crate::memory::{MemoryKind, RankPools};
use crate::rank::RankThread;

use super::events::Events;
use super::planning::Planning;
use super::{
    Agent, AgentConfig, Inner, RankDescriptor, SLOW_LOCK, StartError, alarm, decode, dispatch,
    prefill, record, worker_proof,
};

impl Agent {
    /// Starts the agent: registers the engine's pools, builds the planner for this rank,
    /// starts the rank's UCX progress thread and, for a prefill rank, the side channel.
    ///
    /// # Safety
    ///
    /// Every pool of `config.rank.page_table` is engine-owned memory of the type it names: for
    /// as long as the agent lives, each pool's `[base, base + footprint)` is one live
    /// allocation (initialised host memory for DRAM; device memory on `config.cuda_device` for
    /// VRAM), not freed, whose bytes the engine leaves alone as the protocol requires —
    /// source slots unchanged from `send` until the request's terminal event, destination
    /// slots not relied on from `expect` until its terminal event. The agent writes nowhere
    /// else.
    ///
    /// # Errors
    ///
    /// See [`StartError`].
    pub unsafe fn start(config: AgentConfig, bound: BoundPlanner) -> Result<Agent, StartError> {
        check_config(&config, &bound)?;
        let memory = memory_kind(&config.rank);
        let context =
            config
                .transport
                .context_for(memory)
                .map_err(|source| StartError::Context {
                    transport: config.transport.clone(),
                    hint: config.transport.context_failure_hint(&source),
                    source,
                })?;
        let rank = config.rank.instance_rank;
        // SAFETY: the caller's contract (this function's `# Safety`) is the one
        // `RankPools::register` needs, for the same pools and the agent's whole life.
        let pools = unsafe {
            RankPools::register(
                &context,
                rank,
                &config.rank.page_table.pools,
                config.cuda_device,
            )
        }?;
        Self::start_inner(config, bound, context, Arc::new(pools))
    }

    /// Starts the agent over pools kvferry allocated ([`crate::memory::PoolAllocator`] on
    /// `context`), for a host that lets kvferry own its KV memory — `kvferry serve` does:
    /// over shared memory only UCX-allocated pools take one-sided puts (engine memory goes
    /// through UCX's active-message emulation). `config.rank`'s page table must name them:
    /// each pool inside the region of the same index, or the start is refused.
    ///
    /// # Safety
    ///
    /// `context` is the one `pools` were allocated on and was made by
    /// `config.transport.context_for` for the pools' memory kind. The pools' memory is
    /// kvferry's and lives as long as the agent; whoever writes or reads it through raw
    /// pointers does so only as the protocol allows (see [`start`](Self::start)).
    ///
    /// # Errors
    ///
    /// See [`StartError`]; [`StartError::Config`] when the page table does not lie inside
    /// the pools.
    pub unsafe fn start_on(
        config: AgentConfig,
        bound: BoundPlanner,
        context: Arc<Context>,
        pools: Arc<RankPools>,
    ) -> Result<Agent, StartError> {
        check_config(&config, &bound)?;
        let table = &config.rank.page_table.pools;
        if table.len() != pools.len() {
            return Err(StartError::Config(format!(
                "the page table names {} pools, {} were allocated",
                table.len(),
                pools.len()
            )));
        }
        for (index, p) in table.iter().enumerate() {
            let inside = pools.region(index).is_some_and(|r| {
                let start = r.remote_addr();
                p.base >= start
                    && p.base
                        .checked_add(p.footprint())
                        .is_some_and(|end| end <= start + r.len() as u64)
            });
            if !inside {
                return Err(StartError::Config(format!(
                    "pool {index} ({:#x}+{}) does not lie inside the memory allocated for it",
                    p.base,
                    p.footprint()
                )));
            }
        }
        Self::start_inner(config, bound, context, pools)
    }

    fn start_inner(
        config: AgentConfig,
        bound: BoundPlanner,
        context: Arc<Context>,
        pools: Arc<RankPools>,
    ) -> Result<Agent, StartError> {
        let rank = config.rank.instance_rank;
        let keys = pools.keys()?;
        let mut info = config.rank.clone();
        info.planner_id = bound.id().into();
        info.describer_id = bound.describer_id().into();
        let planner = bound
            .instantiate(&info)
            .map_err(|source| StartError::Planner {
                planner: bound.id().to_string(),
                source,
            })?;
        info.planner_blob =
            RVec::from(planner.describe().map_err(|source| StartError::Planner {
                planner: bound.id().to_string(),
                source,
            })?);
        let worker = Worker::new(&context).map_err(StartError::Worker)?;
        // A decode rank's worker keeps the challenges prefill ranks send it, which the
        // rank answers on their sessions (see `worker_proof`).
        let challenges = Arc::new(worker_proof::Challenges::default());
        if config.role == Role::Decode {
            let store = Arc::clone(&challenges);
            worker
                .set_am_handler(
                    worker_proof::WORKER_CHALLENGE_AM,
                    move |_header, payload| store.record(payload),
                )
                .map_err(StartError::Worker)?;
        }
        let (arena, staging) = bounce_memory(&config, &context, &pools)?;
        let bounces = staging.is_some();
        let thread = RankThread::spawn_bouncing(
            &config.instance,
            rank,
            worker,
            Arc::clone(&pools),
            config.transport.error_mode(),
            staging,
            config.executor,
        )?;

        let (listener, endpoint) = match config.role {
            Role::Prefill => {
                let listener = TcpListener::bind(&config.listen).map_err(|e| {
                    StartError::Listen(format!("cannot listen on {}: {e}", config.listen))
                })?;
                let local = listener
                    .local_addr()
                    .map_err(|e| StartError::Listen(e.to_string()))?;
                let endpoint = advertised(local, config.advertise.as_deref())?;
                (Some(listener), Some(endpoint))
            }
            Role::Decode => (None, None),
        };
        let metadata = kvferry_protocol::AgentMetadata {
            instance: config.instance.clone(),
            role: config.role,
            epoch: random_u64()?,
            planner_id: bound.id().into(),
            describer_id: bound.describer_id().into(),
            planner_version: bound.version().into(),
            label: config.label.clone(),
            endpoint: endpoint.clone(),
            rank: RankDescriptor {
                info: info.clone(),
                worker_address: thread.address().to_vec(),
                pools: keys,
                bounce: arena.as_ref().map(|a| a.key().clone()),
            },
        };
        let label = format!("{}-r{rank}", config.instance);
        let inner = Arc::new(Inner {
            events: Events::new()?,
            alarm: Arc::new(alarm::Alarm::default()),
            planning: Planning::new(&label, config.planner_timeout)?,
            dispatch: dispatch::Dispatch::new(&label)?,
            scatter: match &arena {
                Some(_) => Some(dispatch::Dispatch::with_threads(
                    &label,
                    "scatter",
                    SCATTER_THREADS,
                )?),
                None => None,
            },
            prefill: Mutex::new(prefill::State::new(
                kvferry_protocol::prefill::PrefillConfig {
                    rank: info.instance_rank,
                    me: format!("{} rank {}", config.instance, info.instance_rank),
                    lease: config.lease,
                    timeout: config.timeout,
                    max_stashed: config.max_stashed_bytes,
                },
            )),
            decode: Mutex::new(decode::State::new(kvferry_protocol::decode::DecodeConfig {
                instance: config.instance.clone(),
                rank: info.instance_rank,
                timeout: config.timeout,
                integrity: config.integrity,
            })),
            recorded: Mutex::new(record::Recorder::default()),
            challenges,
            config,
            info,
            bound,
            planner,
            _pools: pools,
            arena,
            bounces,
            thread,
            metadata,
            next_peer: AtomicU64::new(1),
            stopped: AtomicBool::new(false),
            _context: context,
        });
        let weak = Arc::downgrade(&inner);
        let alarm = Arc::clone(&inner.alarm);
        thread::Builder::new()
            .name(format!("reap-{label}"))
            .spawn(move || {
                // It sleeps until the next deadline (alarm.rs says why none is missed) and
                // holds no strong reference while it sleeps, so dropping the agent is not
                // held up by it. Keep-alives go by the clock: on a loaded host a sleep
                // overshoots, and keep-alives counted in turns reached the peer after its
                // timeout (measured: two vLLM CPU instances on 2 cores, 10 s apart).
                let mut last_ping: Option<Instant> = None;
                let mut woke_due: Option<Instant> = None;
                while let Some(inner) = weak.upgrade() {
                    if inner.stopped.load(Ordering::Acquire) {
                        break;
                    }
                    // A reaper that wakes seconds late means this process's threads are not
                    // being scheduled (a starved host), not that a lock was held: say which.
                    let woke = Instant::now();
                    if let Some(late) = woke_due.map(|due| woke.saturating_duration_since(due)) {
                        if late >= SLOW_LOCK {
                            tracing::warn!(
                                late_ms = late.as_millis() as u64,
                                "the agent's reaper woke late: this process's threads went unscheduled"
                            );
                        }
                    }
                    inner.reap();
                    let ping_every = (inner.config.peer_timeout / 3).max(alarm::DUE_AGAIN);
                    if last_ping.is_none_or(|at| at.elapsed() >= ping_every) {
                        last_ping = Some(Instant::now());
                        match inner.config.role {
                            Role::Prefill => prefill::ping(&inner),
                            Role::Decode => decode::ping(&inner),
                        }
                    }
                    let (next, horizon) = inner.deadlines();
                    let next_ping = last_ping.map(|at| at + ping_every);
                    let next = next.into_iter().chain(next_ping).min();
                    drop(inner);
                    let until = alarm::Alarm::wake_time(Instant::now(), next, horizon);
                    woke_due = Some(until);
                    alarm.sleep_until(until);
                }
            })?;
        if let Some(listener) = listener {
            prefill::listen(&inner, listener)?;
        }
        tracing::info!(
            agent = %inner.me(),
            role = %inner.config.role,
            planner = inner.bound.id(),
            endpoint = endpoint.as_deref().map(tracing::field::display),
            pools = inner.info.page_table.pools.len(),
            "agent started"
        );
        Ok(Agent { inner, endpoint })
    }
}

/// The checks every start makes before touching UCX.
fn check_config(config: &AgentConfig, bound: &BoundPlanner) -> Result<(), StartError> {
    if config.instance.is_empty() {
        return Err(StartError::Config("empty instance name".into()));
    }
    if config.rank.planner_id.as_str() != bound.id() && !config.rank.planner_id.is_empty() {
        return Err(StartError::Config(format!(
            "the rank names planner {}, the bound planner is {}",
            config.rank.planner_id,
            bound.id()
        )));
    }
    config
        .rank
        .page_table
        .validate()
        .map_err(|e| StartError::Config(format!("invalid page table: {e}")))?;
    if let Some(algorithm) = config.integrity {
        if config.role == Role::Decode && memory_kind(&config.rank) != MemoryKind::Host {
            return Err(StartError::Config(format!(
                "integrity {algorithm} reads the bytes that landed with the CPU: it needs host \
                 (DRAM) pools, and this rank has device pools"
            )));
        }
    }
    Ok(())
}

/// The bounce memory the rank's role and config ask for: a decode rank's arena, a
/// prefill rank's staging buffer, or neither (bounce off, or pools that mix host and device
/// memory). Device pools get device memory on their device (cargo feature `cuda`).
fn bounce_memory(
    config: &AgentConfig,
    context: &Arc<Context>,
    pools: &RankPools,
) -> Result<(Option<Arc<Arena>>, Option<Staging>), StartError> {
    let b = &config.bounce;
    if !b.may_bounce_over(&config.transport) {
        // Off, or auto within the node: nothing to allocate.
        return Ok((None, None));
    }
    let want = match config.role {
        Role::Decode => b.arena_bytes,
        Role::Prefill => b.staging_bytes.saturating_mul(2),
    };
    let what = match config.role {
        Role::Decode => "bounce arena",
        Role::Prefill => "bounce staging buffer",
    };
    let refused =
        |e: String| StartError::Config(format!("{what} (--bounce off starts without it): {e}"));
    let Some(copier) = bounce_copier(config, pools, want).map_err(refused)? else {
        return Ok((None, None));
    };
    match config.role {
        Role::Decode if b.arena_bytes > 0 => Arena::new(context, b.arena_bytes, copier)
            .map(|a| (Some(Arc::new(a)), None))
            .map_err(refused),
        Role::Prefill if b.staging_bytes > 0 => Staging::new(context, b.staging_bytes, copier)
            .map(|s| (None, Some(s)))
            .map_err(refused),
        _ => Ok((None, None)),
    }
}

/// How the rank's bounce memory copies, once `want` bytes of it are known to fit (checked
/// before anything is touched, like the pools): `None` where the rank does not bounce.
fn bounce_copier(
    config: &AgentConfig,
    pools: &RankPools,
    want: u64,
) -> Result<Option<crate::bounce::Copier>, String> {
    let vram = |p: &kvferry_planner_abi::PhysicalPool| {
        p.memory_type == kvferry_planner_abi::MemoryType::VRAM
    };
    let table = &config.rank.page_table.pools;
    if !table.iter().any(vram) {
        if let Some(budget) = kvferry_platform::HostBudget::measure() {
            if want > budget.bytes {
                return Err(format!("{want} bytes do not fit: {budget}"));
            }
        }
        return Ok(Some(crate::bounce::Copier::Host));
    }
    if !table.iter().all(vram) {
        tracing::info!(
            mode = %config.bounce.mode,
            "pools of host and device memory do not bounce (a gather copies one kind):              pieces go fragment by fragment"
        );
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        let Some(device) = pools.device() else {
            return Err("device pools without their device".into());
        };
        let free = device.free_memory().map_err(|e| {
            format!(
                "cannot ask cuda device {} for its memory: {}",
                device.ordinal(),
                kvferry_plan::error_chain(&e)
            )
        })?;
        if want > free as u64 {
            return Err(format!(
                "{want} bytes do not fit: cuda device {} has {free} bytes free",
                device.ordinal()
            ));
        }
        let copier =
            crate::cuda::DeviceCopier::new(device).map_err(|e| kvferry_plan::error_chain(&e))?;
        tracing::debug!(
            device = device.ordinal(),
            batched = copier.is_batched(),
            "bounced pieces gather and scatter in device memory"
        );
        Ok(Some(crate::bounce::Copier::Device(Arc::new(copier))))
    }
    #[cfg(not(feature = "cuda"))]
    {
        // Unreachable in practice: such a build refuses VRAM pools before this.
        let _ = pools;
        Ok(None)
    }
}

/// Device pools need UCX's CUDA transports in the context.
fn memory_kind(rank: &RankInfo) -> MemoryKind {
    if rank
        .page_table
        .pools
        .iter()
        .any(|p| p.memory_type == kvferry_planner_abi::MemoryType::VRAM)
    {
        MemoryKind::Cuda
    } else {
        MemoryKind::Host
    }
}

/// Threads scattering bounced pieces on a decode rank with an arena.
const SCATTER_THREADS: usize = 2;

fn random_u64() -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(u64::from_le_bytes(b))
}

/// The `host:port` to advertise for a listener bound to `local`.
fn advertised(local: SocketAddr, advertise: Option<&str>) -> Result<String, StartError> {
    if let Some(host) = advertise {
        let ip: IpAddr = host
            .parse()
            .map_err(|_| StartError::Listen(format!("advertise `{host}` is not an IP address")))?;
        if ip.is_unspecified() {
            return Err(StartError::Listen(format!(
                "advertise `{host}` is unspecified; peers cannot reach it"
            )));
        }
        return Ok(SocketAddr::new(ip, local.port()).to_string());
    }
    if !local.ip().is_unspecified() {
        return Ok(local.to_string());
    }
    let ip = kvferry_platform::first_interface_address(local.is_ipv6()).ok_or_else(|| {
        StartError::Listen(format!(
            "listening on {local}, but no interface that is up has a non-loopback address to \
             advertise; set `advertise` or listen on a specific address"
        ))
    })?;
    Ok(SocketAddr::new(ip, local.port()).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertised_endpoints_are_never_unspecified() {
        let lo: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(advertised(lo, None).unwrap(), "127.0.0.1:4000");
        let any: SocketAddr = "0.0.0.0:4000".parse().unwrap();
        assert_eq!(advertised(any, Some("10.1.2.3")).unwrap(), "10.1.2.3:4000");
        assert!(advertised(any, Some("0.0.0.0")).is_err());
        assert!(advertised(any, Some("host.example")).is_err());
        match advertised(any, None) {
            Ok(e) => {
                let ip: SocketAddr = e.parse().unwrap();
                assert!(!ip.ip().is_unspecified() && !ip.ip().is_loopback(), "{e}");
            }
            Err(e) => assert!(e.to_string().contains("no interface"), "{e}"),
        }
    }
}
