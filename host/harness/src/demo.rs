//! `kvferry demo`: a prefill and a decode server (one agent per rank each) as child
//! processes on loopback — or servers already running elsewhere (`--prefill-at`, `--gen-at`:
//! another host or namespace, one process per rank or one per instance) — a stream of
//! requests through them, every destination byte checked.
//!
//! The controller starts both `kvferry serve` children (the running executable, each on a
//! free port it reports on stdout, both holding a fresh random deployment secret), asks
//! every server which ranks it runs ([`crate::drive::Side`]), then runs the requests in
//! batches of `in_flight`:
//!
//! 1. `Submit` each request to the prefill servers holding its DP group (slots allocated,
//!    filled by the oracle — the "prefill" — and handed to the agents with `send`) and
//!    collect the context tables;
//! 2. `Submit` them all to the decode servers at once (each rank's agent `expect`s it
//!    from the prefill instance's endpoints) and wait for every `Done` — the transfer
//!    phase, timed for the throughput and per request for the latencies;
//! 3. `Verify` each completed request on the decode server (its slots: covered bytes
//!    hold their tags, the rest the canary), then `Release` it on both servers.
//!
//! At the end the decode server checks that every pool holds only its canary, and both
//! children are shut down (killed on every error path).

use std::collections::VecDeque;
use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use kvferry_planner_abi::Mapping;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use kvferry_plan::chunk_ranges;
use kvferry_platform::HostBudget;
use kvferry_testkit::layout::{ModelSpec, PoolOptions, build_instance, bytes_text};
use kvferry_testkit::oracle::LocalMemory;
use kvferry_transfer::agent::BounceMode;
use kvferry_transfer::{MemoryKind, Role, TransportSpec};

use crate::control::{RankTables, Submit};
pub use crate::drive::DemoError;
use crate::drive::Side;

/// How long a child may take to report its control address.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a child that closed its stdout before listening may take to exit.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of a child's standard error kept to explain why it did not start.
const STDERR_TAIL: usize = 32;
/// In the line a server prints once it listens, before its control address.
pub const CONTROL_ON: &str = "control on ";
/// In the line a prefill server prints once it listens, before its peer address.
pub const LISTENING: &str = "listening on ";
/// Where `kvferry serve --metrics-listen` prints its metrics address.
pub const METRICS_ON: &str = "metrics on ";

/// Where `kvferry serve` reads the deployment secret when no `--secret-file` is given.
pub use kvferry_transfer::agent::SECRET_ENV;

/// A random secret made once per controller process, for the servers it starts.
pub fn session_secret() -> String {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SECRET
        .get_or_init(|| {
            let bytes: [u8; 24] = rand::random();
            bytes.iter().map(|b| format!("{b:02x}")).collect()
        })
        .clone()
}

/// The secret a controller proves to the servers it drives: the one in `file` when given, else
/// [`SECRET_ENV`] when set (servers it did not start hold the deployment's), else the
/// [`session_secret`] of the servers it starts itself.
///
/// # Errors
///
/// `file` cannot be read or holds an unusable secret, or [`SECRET_ENV`] does.
pub fn controller_secret(file: Option<&Path>) -> Result<kvferry_protocol::Secret, DemoError> {
    let (secret, source) = if let Some(file) = file {
        let secret = kvferry_transfer::agent::load_secret(Some(file));
        (secret, format!("--secret-file {}", file.display()))
    } else if std::env::var_os(SECRET_ENV).is_some() {
        (
            kvferry_transfer::agent::load_secret(None),
            SECRET_ENV.to_string(),
        )
    } else {
        let secret = kvferry_protocol::Secret::new(session_secret()).map_err(Into::into);
        (secret, "the session's secret".to_string())
    };
    secret.map_err(|e| DemoError::Invalid(format!("{source}: {}", kvferry_plan::error_chain(&e))))
}

/// The addresses a `kvferry serve` process listens on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerAddrs {
    /// Its control listener (the controller's connection).
    pub control: String,
    /// A prefill server's agent endpoints, comma-separated (what decode ranks dial).
    pub peer: Option<String>,
    /// Its `/metrics` listener (`--metrics-listen`).
    pub metrics: Option<String>,
}

impl ServerAddrs {
    /// The addresses in the line `kvferry serve` prints once it listens (`... control on
    /// HOST:PORT listening on HOST:PORT`), if it is that line.
    pub fn parse(line: &str) -> Option<ServerAddrs> {
        let after = |marker: &str| {
            line.split(marker)
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .map(|a| a.trim_end_matches(',').to_string())
        };
        Some(ServerAddrs {
            control: after(CONTROL_ON)?,
            peer: after(LISTENING),
            metrics: after(METRICS_ON),
        })
    }

    /// The peer address, or an error naming the role.
    pub fn peer(&self) -> Result<&str, DemoError> {
        self.peer.as_deref().ok_or(DemoError::Child {
            role: "prefill",
            message: "reported no peer address".into(),
        })
    }
}

/// The two `kvferry serve` children of a loopback pair, as `demo` and `bench` start them.
#[derive(Clone, Debug)]
pub struct LoopbackPair {
    /// The `kvferry` executable to start the servers from.
    pub exe: PathBuf,
    /// Config file passed to the servers (`--config`).
    pub config_file: Option<PathBuf>,
    /// Model, dtype and block size (the prefill side's).
    pub model: ModelSpec,
    /// The decode side's block size, when it differs from the prefill side's.
    pub gen_tokens_per_block: Option<u32>,
    /// The context deployment spec, as typed (e.g. `dep2`).
    pub ctx_spec: String,
    /// The generation deployment spec.
    pub gen_spec: String,
    /// The context mapping (parsed `ctx_spec`).
    pub prefill: Mapping,
    /// The generation mapping.
    pub decode: Mapping,
    /// UCX transports and network devices of both servers.
    pub transport: TransportSpec,
    /// Bounce transfers of both servers (`--bounce`).
    pub bounce: BounceMode,
    /// MiB of each decode rank's bounce arena (`--bounce-arena-mb`).
    pub bounce_arena_mb: u64,
    /// Where both servers' pools live.
    pub memory: MemoryKind,
    /// CUDA pools: the device of every rank (`None`: each server's default).
    pub cuda_device: Option<usize>,
    /// Planner id for both servers (`None`: their own default selection).
    pub planner: Option<String>,
    /// Seed of prompt lengths and slot placement; salt of the oracle.
    pub seed: u64,
    /// Per-request timeout (`--timeout-ms`) of both servers.
    pub timeout: Duration,
    /// The decode server's integrity digest (`--integrity`), if any.
    pub integrity: Option<kvferry_transfer::agent::Integrity>,
}

impl LoopbackPair {
    /// Model, dtype and block size, and the decode side's block size when it differs.
    pub fn model_label(&self) -> String {
        match self.gen_tokens_per_block {
            Some(g) => format!("{} (decode tpb{g})", self.model),
            None => self.model.to_string(),
        }
    }

    /// The smaller of the two sides' block sizes.
    pub fn smallest_block(&self) -> u32 {
        self.gen_tokens_per_block
            .unwrap_or(self.model.tokens_per_block)
            .min(self.model.tokens_per_block)
            .max(1)
    }

    /// Refuses, before either server starts, a pair whose pools cannot be laid out or would
    /// not fit this host together: both servers run here, and each checks only its own pools
    /// against what is available when it starts (pools are touched later), so two that fit
    /// alone could still exhaust the machine together. `prefill` and `gen` are each side's
    /// (PAGED, STATE) slots per pool; `sized_by` names the flags that sized them. Device pools
    /// (`--memory cuda`) are left to the servers.
    ///
    /// # Errors
    ///
    /// [`DemoError::Invalid`] naming `sized_by`, the bytes and the budget.
    pub fn check_pools(
        &self,
        prefill: (u64, u64),
        decode: (u64, u64),
        sized_by: &str,
    ) -> Result<(), DemoError> {
        let tpb = self.model.tokens_per_block;
        let sized_by = match self.gen_tokens_per_block {
            Some(g) => {
                format!("{sized_by} and --ctx-tokens-per-block {tpb} --gen-tokens-per-block {g}")
            }
            None => format!("{sized_by} and --tokens-per-block {tpb}"),
        };
        let gen_model = match self.gen_tokens_per_block {
            Some(tpb) => self.model.clone().with_tokens_per_block(tpb),
            None => self.model.clone(),
        };
        let sides = [
            ("prefill", &self.prefill, &self.model, prefill),
            ("decode", &self.decode, &gen_model, decode),
        ];
        let mut bytes = [0u64; 2];
        for (i, (role, mapping, model, (paged, state))) in sides.into_iter().enumerate() {
            let options = PoolOptions {
                paged_slots: paged,
                state_slots: state,
                ..PoolOptions::default()
            };
            // Addresses only: nothing is allocated.
            let mut space = LocalMemory::new();
            let mut alloc = |rank: u32, pool: usize, n: u64| {
                bytes[i] = bytes[i].saturating_add(n);
                space.reserve(n, format!("rank {rank} pool {pool}"))
            };
            build_instance(model, mapping, role, "check", &options, &mut alloc)
                .map_err(|e| DemoError::Invalid(format!("{sized_by}: {e}")))?;
        }
        if self.memory != MemoryKind::Host {
            return Ok(());
        }
        let Some(budget) = HostBudget::measure() else {
            return Ok(());
        };
        let total = bytes[0].saturating_add(bytes[1]);
        if total > budget.bytes {
            return Err(DemoError::Invalid(format!(
                "{sized_by}: the two servers' host pools would not fit: {} in all (context {}, \
                 generation {}), {budget}",
                bytes_text(u128::from(total)),
                bytes_text(u128::from(bytes[0])),
                bytes_text(u128::from(bytes[1])),
            )));
        }
        Ok(())
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// The servers.
    pub pair: LoopbackPair,
    /// Requests to run.
    pub requests: u64,
    /// The longest prompt; lengths are drawn from `1..=max_prompt_len`.
    pub max_prompt_len: u64,
    /// Send in chunks of this many tokens.
    pub chunk: Option<u64>,
    /// Send each chunk in this many layer-wise parts (0 or 1: whole).
    pub layer_parts: u32,
    /// Prompt tokens the receiver already caches (clamped to each prompt).
    pub cached: u64,
    /// Requests in flight at once.
    pub in_flight: usize,
    /// Control addresses of running prefill servers to drive instead of starting one.
    pub ctx_at: Vec<String>,
    /// Control addresses of running decode servers (with `ctx_at`).
    pub gen_at: Vec<String>,
    /// The file holding the secret of the servers `ctx_at` and `gen_at` name (else
    /// [`SECRET_ENV`]); see [`controller_secret`].
    pub secret_file: Option<PathBuf>,
}

/// Latency percentiles in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// What the demo did and found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DemoReport {
    /// The planner both servers bound.
    pub planner: String,
    /// Its library version.
    pub planner_version: String,
    /// Model, dtype and block size.
    pub model: String,
    /// Context deployment.
    pub prefill: String,
    /// Generation deployment.
    pub decode: String,
    /// `shm` or `tcp`.
    pub transport: String,
    /// `host` or `cuda`: where the pools lived.
    pub memory: String,
    /// Requests run.
    pub requests: u64,
    /// Requests that failed (transfer or verification).
    pub failed: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Fragments written.
    pub fragments: u64,
    /// Sum of the transfer phases' wall time, seconds.
    pub transfer_seconds: f64,
    /// `bytes / transfer_seconds`, in GB/s (10^9 bytes).
    pub gbps: f64,
    /// Per-request transfer latency (first `RequestData` to last completion).
    pub latency_ms: Percentiles,
    /// Destination bytes the oracle checked over all requests.
    pub verified_bytes: u64,
    /// Whether every request completed and every byte matched, idle pools included.
    pub verified: bool,
    /// The first errors and mismatches.
    pub errors: Vec<String>,
}

impl fmt::Display for DemoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvferry demo: {}, prefill {} -> decode {} over {}, {} memory",
            self.model, self.prefill, self.decode, self.transport, self.memory
        )?;
        writeln!(f, "planner    {} {}", self.planner, self.planner_version)?;
        writeln!(
            f,
            "requests   {} ({} ok, {} failed)",
            self.requests,
            self.requests - self.failed,
            self.failed
        )?;
        writeln!(
            f,
            "bytes      {} in {} fragments",
            kvferry_testkit::units::bytes(self.bytes),
            self.fragments
        )?;
        writeln!(
            f,
            "transfer   {:.4} s, {:.2} GB/s",
            self.transfer_seconds, self.gbps
        )?;
        writeln!(
            f,
            "latency    p50 {:.3} ms, p90 {:.3} ms, p99 {:.3} ms",
            self.latency_ms.p50, self.latency_ms.p90, self.latency_ms.p99
        )?;
        write!(
            f,
            "verified   {} ({} destination bytes checked)",
            if self.verified { "yes" } else { "NO" },
            self.verified_bytes
        )?;
        for e in &self.errors {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

/// Child processes killed (and reaped) when dropped. Each child's stdin pipe stays open in
/// its `Child` until then (the child exits when it closes).
pub(crate) struct Children(pub(crate) Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

impl Children {
    /// Waits up to `limit` for every child to exit by itself.
    pub(crate) fn wait_exit(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        for child in &mut self.0 {
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Arguments of `kvferry serve` for one side of a loopback pair: `role` with deployment
/// `spec`, `slots` PAGED and `state` STATE slots per pool, free ports on 127.0.0.1.
pub fn serve_args(
    pair: &LoopbackPair,
    role: &str,
    spec: &str,
    slots: u64,
    state: u64,
) -> Vec<String> {
    let mut args = Vec::new();
    if let Some(file) = &pair.config_file {
        args.extend(["--config".to_string(), file.display().to_string()]);
    }
    args.extend(
        [
            "serve",
            "--role",
            role,
            "--model",
            pair.model.name(),
            "--deployment",
            spec,
            "--dtype",
            pair.model.dtype.as_ref(),
        ]
        .map(String::from),
    );
    let tokens_per_block = match role {
        "decode" => pair.gen_tokens_per_block,
        _ => None,
    }
    .unwrap_or(pair.model.tokens_per_block);
    args.extend([
        "--tokens-per-block".to_string(),
        tokens_per_block.to_string(),
        "--listen".to_string(),
        "127.0.0.1:0".to_string(),
        "--control".to_string(),
        "127.0.0.1:0".to_string(),
        "--transport".to_string(),
        pair.transport.transports.to_string(),
        "--memory".to_string(),
        pair.memory.to_string(),
        "--slots".to_string(),
        slots.to_string(),
        "--state-slots".to_string(),
        state.to_string(),
        "--seed".to_string(),
        pair.seed.to_string(),
        "--timeout-ms".to_string(),
        pair.timeout.as_millis().to_string(),
        "--bounce".to_string(),
        pair.bounce.to_string(),
        "--bounce-arena-mb".to_string(),
        pair.bounce_arena_mb.to_string(),
    ]);
    if let Some(device) = pair.cuda_device {
        args.extend(["--cuda-device".to_string(), device.to_string()]);
    }
    if let Some(devices) = &pair.transport.net_devices {
        args.extend(["--net-devices".to_string(), devices.clone()]);
    }
    if pair.transport.ucx_peer_errors {
        args.push("--ucx-peer-errors".to_string());
    }
    if let Some(digest) = pair.integrity {
        args.extend(["--integrity".to_string(), digest.to_string()]);
    }
    if let Some(p) = &pair.planner {
        args.extend(["--planner".to_string(), p.to_string()]);
    }
    args
}

/// Starts one server child; returns it and its addresses.
///
/// The child's standard error is passed through to ours, and its last lines are kept: a child
/// that exits before it listens (say, `--memory cuda` without a CUDA driver) is reported with
/// its own error message.
///
/// # Errors
///
/// [`DemoError::Child`] if the child cannot be started, exits before it listens (with its
/// exit status and error), or does not report its control address in time.
pub fn spawn_server(
    exe: &PathBuf,
    args: &[String],
    role: &'static str,
) -> Result<(Child, ServerAddrs), DemoError> {
    let mut cmd = Command::new(exe);
    cmd.args(args);
    spawn_serve_command(cmd, role)
}

/// [`spawn_server`] for a `kvferry serve` command the caller built (environment included:
/// a `KVFERRY_LOG` or `RUST_LOG` the caller set is kept; otherwise the child inherits ours, or
/// logs warnings only).
///
/// # Errors
///
/// As [`spawn_server`].
pub fn spawn_serve_command(
    cmd: Command,
    role: &'static str,
) -> Result<(Child, ServerAddrs), DemoError> {
    spawn_serve_logged(cmd, role, |line| {
        let _ = writeln!(std::io::stderr(), "{line}");
    })
}

/// [`spawn_serve_command`], handing every line of the child's standard error to `log` (on a
/// thread of its own, until the child closes it) instead of passing it through to ours. The
/// lines that explain a child that did not start are kept all the same.
///
/// # Errors
///
/// As [`spawn_server`].
pub fn spawn_serve_logged(
    mut cmd: Command,
    role: &'static str,
    log: impl FnMut(&str) + Send + 'static,
) -> Result<(Child, ServerAddrs), DemoError> {
    let exe = PathBuf::from(cmd.get_program());
    // The child exits when this pipe closes, i.e. when the controller ends in any way.
    cmd.arg("--exit-with-stdin")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::piped());
    let log_vars = [kvferry_transfer::logging::ENV, "RUST_LOG"];
    let log_chosen = cmd
        .get_envs()
        .any(|(key, _)| log_vars.iter().any(|v| key == *v))
        || kvferry_transfer::logging::from_env().is_some();
    if !log_chosen {
        cmd.env(kvferry_transfer::logging::ENV, "kvferry=warn,warn");
    }
    // The servers one controller starts share a secret nobody else knows, unless the caller
    // chose one (for the child, or for this whole process).
    let secret_chosen = cmd.get_envs().any(|(key, _)| key == SECRET_ENV);
    if !secret_chosen && std::env::var_os(SECRET_ENV).is_none() {
        cmd.env(SECRET_ENV, session_secret());
    }
    let mut child = cmd.spawn().map_err(|e| DemoError::Child {
        role,
        message: format!("cannot start {}: {e}", exe.display()),
    })?;
    let tail = Arc::new(Mutex::new(VecDeque::new()));
    let listening = Arc::new(AtomicBool::new(false));
    let stderr = child.stderr.take().and_then(|stderr| {
        pass_stderr(stderr, role, Arc::clone(&tail), Arc::clone(&listening), log)
    });
    let Some(stdout) = child.stdout.take() else {
        let _ = child.kill();
        return Err(DemoError::Child {
            role,
            message: "no stdout".into(),
        });
    };
    let (tx, rx) = mpsc::channel();
    let _ = thread::Builder::new()
        .name(format!("{role}-stdout"))
        .spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if !sent {
                    if let Some(addrs) = ServerAddrs::parse(&line) {
                        let _ = tx.send(addrs);
                        sent = true;
                    }
                }
            }
        });
    let message = match rx.recv_timeout(STARTUP_TIMEOUT) {
        Ok(addr) => {
            listening.store(true, Ordering::Release);
            return Ok((child, addr));
        }
        // Its stdout closed without the address: the child is exiting.
        Err(RecvTimeoutError::Disconnected) => {
            let status = wait_exit(&mut child, EXIT_TIMEOUT);
            format!("exited before it listened ({})", describe(status))
        }
        Err(RecvTimeoutError::Timeout) => {
            let _ = child.kill();
            let status = child.wait().ok();
            format!(
                "did not report its control address within {} s ({})",
                STARTUP_TIMEOUT.as_secs(),
                describe(status)
            )
        }
    };
    // The child is gone, so its stderr reaches its end: every line is in the tail.
    if let Some(stderr) = stderr {
        let _ = stderr.join();
    }
    let lines = tail.lock().map(|t| t.clone()).unwrap_or_default();
    Err(DemoError::Child {
        role,
        message: match child_error(&lines) {
            Some(error) => format!("{message}: {error}"),
            None => format!("{message}, with nothing on its standard error"),
        },
    })
}

/// Hands a child's standard error to `log` line by line, keeping the last [`STDERR_TAIL`]
/// lines in `tail`. Until the child is `listening`, its `kvferry: ...` line (how `main`
/// reports the error it exits with) is kept back: the error that it did not start quotes it.
fn pass_stderr(
    stderr: impl Read + Send + 'static,
    role: &str,
    tail: Arc<Mutex<VecDeque<String>>>,
    listening: Arc<AtomicBool>,
    mut log: impl FnMut(&str) + Send + 'static,
) -> Option<JoinHandle<()>> {
    thread::Builder::new()
        .name(format!("{role}-stderr"))
        .spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if listening.load(Ordering::Acquire) || !line.starts_with("kvferry: ") {
                    log(&line);
                }
                if let Ok(mut tail) = tail.lock() {
                    if tail.len() == STDERR_TAIL {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            }
        })
        .ok()
}

/// Waits up to `limit` for `child` to exit, then kills it.
fn wait_exit(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) => thread::sleep(Duration::from_millis(20)),
            Err(_) => break,
        }
    }
    let _ = child.kill();
    child.wait().ok()
}

fn describe(status: Option<ExitStatus>) -> String {
    status.map_or_else(|| "exit status unknown".into(), |s| s.to_string())
}

/// What a failed `kvferry serve` said: its last `kvferry: ...` line (how `main` reports an
/// error), else its last non-empty line.
fn child_error(lines: &VecDeque<String>) -> Option<String> {
    lines
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("kvferry: "))
        .or_else(|| lines.iter().rev().map(|l| l.trim()).find(|l| !l.is_empty()))
        .map(str::to_string)
}

/// `--cached TOKENS` (demo, plan): the receiver caches whole blocks of `gen_tokens_per_block`,
/// so a prefix that ends inside one is refused rather than rounded down without a word.
///
/// # Errors
///
/// The message naming the flag and the block size.
pub fn check_cached(cached: u64, gen_tokens_per_block: u32) -> Result<(), String> {
    let tpb = u64::from(gen_tokens_per_block.max(1));
    if cached % tpb == 0 {
        return Ok(());
    }
    Err(format!(
        "--cached {cached} must be a multiple of the receiver's block size {tpb} (it caches \
         whole blocks)"
    ))
}

/// Runs the demo.
///
/// # Errors
///
/// A child that does not start, a control connection that fails, or a server that answers
/// out of protocol. Failed requests and mismatches are in the report.
pub fn run(config: &DemoConfig) -> Result<DemoReport, DemoError> {
    if config.requests == 0 || config.max_prompt_len == 0 {
        return Err(DemoError::Invalid(
            "--requests and --prompt-len must be positive".into(),
        ));
    }
    let tpb = u64::from(config.pair.model.tokens_per_block);
    if let Some(chunk) = config.chunk {
        if chunk == 0 || chunk % tpb != 0 {
            return Err(DemoError::Invalid(format!(
                "--chunk {chunk} must be a positive multiple of the block size {tpb}"
            )));
        }
    }
    check_cached(
        config.cached,
        config
            .pair
            .gen_tokens_per_block
            .unwrap_or(config.pair.model.tokens_per_block),
    )
    .map_err(DemoError::Invalid)?;
    let in_flight = config.in_flight.max(1);
    // Blocks of the side with the smaller ones (each side's pools take that many slots).
    let smallest = u64::from(config.pair.smallest_block());
    let sized_by = format!(
        "--prompt-len {} with --in-flight {in_flight}",
        config.max_prompt_len
    );
    let slots = (in_flight as u64)
        .checked_mul(config.max_prompt_len.div_ceil(smallest))
        .and_then(|n| n.checked_add(4))
        .ok_or_else(|| {
            DemoError::Invalid(format!(
                "{sized_by}: more than 2^64 slots per pool ({smallest} tokens per block)"
            ))
        })?;
    let state = (in_flight as u64).saturating_add(2);
    if config.ctx_at.is_empty() {
        config
            .pair
            .check_pools((slots, state), (slots, state), &sized_by)?;
    }

    let mut children = Children(Vec::new());
    let (ctx_at, gen_at) = match (&config.ctx_at[..], &config.gen_at[..]) {
        ([], []) => {
            let (ctx_child, ctx_addr) = spawn_server(
                &config.pair.exe,
                &serve_args(&config.pair, "prefill", &config.pair.ctx_spec, slots, state),
                "prefill",
            )?;
            children.0.push(ctx_child);
            let (gen_child, gen_addr) = spawn_server(
                &config.pair.exe,
                &serve_args(&config.pair, "decode", &config.pair.gen_spec, slots, state),
                "decode",
            )?;
            children.0.push(gen_child);
            (vec![ctx_addr.control], vec![gen_addr.control])
        }
        ([_, ..], [_, ..]) => (config.ctx_at.clone(), config.gen_at.clone()),
        _ => {
            return Err(DemoError::Invalid(
                "--ctx-at and --gen-at go together (the control addresses of running \
                 servers of both sides)"
                    .into(),
            ));
        }
    };
    let secret = controller_secret(config.secret_file.as_deref())?;
    let prefill = Side::connect(Role::Prefill, &ctx_at, &secret)?;
    let decode = Side::connect(Role::Decode, &gen_at, &secret)?;
    check_side(&prefill, &config.pair.prefill)?;
    check_side(&decode, &config.pair.decode)?;
    let peer = prefill.peer();

    let mut report = DemoReport {
        model: config.pair.model_label(),
        prefill: config.pair.ctx_spec.clone(),
        decode: config.pair.gen_spec.clone(),
        transport: config.pair.transport.to_string(),
        memory: config.pair.memory.to_string(),
        requests: config.requests,
        planner: decode.info().planner_id.clone(),
        planner_version: decode.info().planner_version.clone(),
        ..DemoReport::default()
    };

    let (ctx_groups, gen_groups) = (prefill.dp_groups(), decode.dp_groups());
    let mut rng = StdRng::seed_from_u64(config.pair.seed);
    let mut latencies = Vec::new();
    let mut transfer = Duration::ZERO;
    let mut all_ok = true;
    let note = |report: &mut DemoReport, e: String| {
        if report.errors.len() < 16 {
            report.errors.push(e);
        }
    };

    let mut next = 0u64;
    while next < config.requests {
        let batch_len = (config.requests - next).min(in_flight as u64);
        let submits: Vec<Submit> = (next..next + batch_len)
            .map(|id| {
                let prompt_len = rng.gen_range(1..=config.max_prompt_len);
                Submit {
                    request: id,
                    prompt_len,
                    ctx_dp_rank: (id % u64::from(ctx_groups)) as u32,
                    gen_dp_rank: (id % u64::from(gen_groups)) as u32,
                    chunks: config.chunk.map(|c| chunk_ranges(prompt_len, c)),
                    layer_parts: config.layer_parts,
                    cached: config.cached.min(prompt_len),
                    peer: None,
                }
            })
            .collect();
        next += batch_len;

        // Prefill on the prefill side.
        let mut batch: Vec<(Submit, Vec<RankTables>)> = Vec::new();
        for (s, result) in submits.iter().zip(prefill.prefill(&submits)?) {
            match result {
                Ok(tables) => batch.push((s.clone(), tables)),
                Err(e) => {
                    all_ok = false;
                    report.failed += 1;
                    note(&mut report, format!("request {}: prefill: {e}", s.request));
                    prefill.release(s)?;
                }
            }
        }

        // Transfer phase: everything in flight at once.
        let started = Instant::now();
        let sent: Vec<Submit> = batch.iter().map(|(s, _)| s.clone()).collect();
        let wait = config.pair.timeout + Duration::from_secs(30);
        let results = decode.transfer(&sent, &peer, wait)?;
        transfer += started.elapsed();

        // Verify, then release.
        for ((s, context), result) in batch.iter().zip(results) {
            match result {
                Ok(stats) => {
                    report.bytes += stats.bytes;
                    report.fragments += stats.fragments;
                    latencies.push(stats.latency_us as f64 / 1000.0);
                    match decode.verify(s, context)? {
                        Ok(summary) => {
                            report.verified_bytes += summary.bytes_checked;
                            if !summary.ok {
                                all_ok = false;
                                report.failed += 1;
                                note(
                                    &mut report,
                                    format!("request {}: {}", s.request, summary.detail),
                                );
                            }
                        }
                        Err(e) => {
                            all_ok = false;
                            report.failed += 1;
                            note(&mut report, format!("request {}: verify: {e}", s.request));
                        }
                    }
                }
                Err(e) => {
                    all_ok = false;
                    report.failed += 1;
                    note(&mut report, e);
                }
            }
            decode.release(s)?;
            prefill.release(s)?;
        }
    }

    match decode.verify_idle()? {
        Ok(s) => {
            report.verified_bytes += s.bytes_checked;
            if !s.ok {
                all_ok = false;
                note(&mut report, format!("idle pools: {}", s.detail));
            }
        }
        Err(e) => {
            all_ok = false;
            note(&mut report, format!("idle pools: {e}"));
        }
    }

    // Servers this demo started stop with it (the decode side first, so it does not
    // watch its context peer go away); servers it was pointed at keep running.
    if !children.0.is_empty() {
        decode.shutdown();
        prefill.shutdown();
        children.wait_exit(Duration::from_secs(5));
    }

    report.transfer_seconds = transfer.as_secs_f64();
    report.gbps = if report.transfer_seconds > 0.0 {
        report.bytes as f64 / report.transfer_seconds / 1e9
    } else {
        0.0
    };
    report.latency_ms = percentiles(&mut latencies);
    report.verified = all_ok;
    Ok(report)
}

/// Refuses servers whose instance is not the deployment the controller was told.
pub(crate) fn check_side(side: &Side, mapping: &Mapping) -> Result<(), DemoError> {
    let info = side.info();
    if info.world != mapping.world_size() {
        return Err(DemoError::Invalid(format!(
            "{} instance {} has {} ranks, the deployment given ({mapping}) has {}",
            info.role,
            info.instance,
            info.world,
            mapping.world_size()
        )));
    }
    Ok(())
}

/// Nearest-rank percentiles of `values` (sorted in place).
pub fn percentiles(values: &mut [f64]) -> Percentiles {
    if values.is_empty() {
        return Percentiles::default();
    }
    values.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let rank = (q * values.len() as f64).ceil() as usize;
        values[rank.clamp(1, values.len()) - 1]
    };
    Percentiles {
        p50: at(0.50),
        p90: at(0.90),
        p99: at(0.99),
    }
}
