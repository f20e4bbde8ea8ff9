//! `kvferry doctor`: which UCX this process actually loaded and what it can do here — the
//! first thing to run when a transfer picks the wrong NIC or refuses device memory.
//!
//! Everything is asked of the libraries this process mapped (not of a `ucx_info` on `PATH`,
//! which may be another build): the version and file of every UCX core library, the
//! transport modules next to them, and, for each `--transport` kvferry offers, a UCX context
//! created exactly as `serve` creates it, with the resources (transport/device) it selected
//! and the memory types it can register. CUDA is looked at from the kernel's side too
//! (`/proc/driver/nvidia`), so "GPUs present but UCX cannot use them" is named as a problem.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use kvferry::{MemoryKind, Transport};
use kvferry_ucx::{Context, Op, Status, library};
use serde::Serialize;

/// Names the UCX library directory this process is meant to load when it is not the one the
/// build linked against: a bundle from `scripts/gpu-check --bundle` runs with its own copy of
/// UCX on `LD_LIBRARY_PATH`, away from this checkout.
pub const EXPECTED_UCX_DIR_ENV: &str = "KVFERRY_UCX_EXPECTED_DIR";

/// Everything doctor found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// This build of kvferry.
    pub kvferry: String,
    /// The planner ABI it loads planners against (a planner needs a compatible
    /// `kvferry-planner-abi`: the same 0.x).
    pub planner_abi: String,
    /// The UCX library.
    pub ucx: UcxReport,
    /// The CUDA driver and devices, as the kernel lists them.
    pub cuda: CudaReport,
    /// One entry per transport and memory kind: what a context for it selects.
    pub transports: Vec<TransportReport>,
    /// `UCX_*` variables set in the environment (they override kvferry's choices).
    pub ucx_env: Vec<(String, String)>,
    /// Problems found; empty when all is well.
    pub problems: Vec<String>,
}

/// The UCX library of this process.
#[derive(Clone, Debug, Serialize)]
pub struct UcxReport {
    /// `major.minor.release` of the loaded library.
    pub version: String,
    /// The library directory this build was linked against (and its rpath).
    pub linked_dir: String,
    /// Which rule chose it.
    pub linked_source: String,
    /// The headers' API version.
    pub linked_api: String,
    /// The core libraries mapped into this process.
    pub loaded: Vec<PathBuf>,
    /// Where the transport modules are loaded from.
    pub module_dir: Option<PathBuf>,
    /// The transport modules there (`cma`, `cuda`, `ib`, ...).
    pub modules: Vec<String>,
    /// Whether this UCX was built with CUDA transports (a `libuct_cuda` module).
    pub cuda_transports_built: bool,
    /// Whether a context can be shared between threads (`--enable-mt`), as kvferry needs.
    pub multi_threaded: bool,
}

/// The CUDA driver and devices.
#[derive(Clone, Debug, Serialize)]
pub struct CudaReport {
    /// The first line of `/proc/driver/nvidia/version`, if the kernel driver is loaded.
    pub driver: Option<String>,
    /// GPUs the kernel driver lists (`/proc/driver/nvidia/gpus/*`).
    pub gpus: usize,
    /// The `libcuda` mapped into this process after UCX loaded its CUDA module, if any.
    pub libcuda: Option<PathBuf>,
    /// Whether kvferry itself can load `libcuda` (as `--memory cuda` does); `None` in a build
    /// without the `cuda` feature.
    pub libcuda_loadable: Option<bool>,
}

/// What one transport selects.
#[derive(Clone, Debug, Serialize)]
pub struct TransportReport {
    /// `shm` or `tcp`.
    pub transport: String,
    /// The pool memory the context is for (`host`, `cuda`).
    pub memory: String,
    /// The `UCX_TLS` kvferry sets.
    pub ucx_tls: String,
    /// The `UCX_NET_DEVICES` kvferry sets, if any.
    pub ucx_net_devices: Option<String>,
    /// `transport/device` pairs the context selected.
    pub resources: Vec<String>,
    /// Memory types the context can register (`host`, `cuda`, ...).
    pub memory_types: Vec<String>,
    /// Why the context could not be created.
    pub error: Option<String>,
    /// Why a CUDA row has nothing to offer on a host without a GPU: expected there, so not
    /// an error (and not a problem).
    pub note: Option<String>,
}

impl TransportReport {
    /// The row of `transport` pools in `memory`, before anything is asked of UCX.
    fn new(transport: Transport, memory: MemoryKind, ucx_net_devices: Option<String>) -> Self {
        TransportReport {
            transport: transport.to_string(),
            memory: memory.to_string(),
            ucx_tls: transport.tls(memory).to_string(),
            ucx_net_devices,
            resources: Vec::new(),
            memory_types: Vec::new(),
            error: None,
            note: None,
        }
    }

    /// On a host without a GPU, a CUDA row that failed is expected to: its error becomes a
    /// note.
    fn expected_without_gpu(mut self, gpus: usize) -> Self {
        if gpus == 0 && self.memory == MemoryKind::Cuda.to_string() {
            if let Some(error) = self.error.take() {
                self.note = Some(format!("no GPU on this host: {error}"));
            }
        }
        self
    }
}

/// Runs every check. `net_devices` overrides the devices the tcp transport asks for (default
/// `lo`, as `serve` uses).
pub fn diagnose(net_devices: Option<&str>) -> Report {
    let mut problems = Vec::new();
    let mut transports = Vec::new();
    let mut multi_threaded = true;
    // GPUs the kernel lists: without one, CUDA rows that fail are expected to.
    let gpus = fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    // UCX warns on stdout about every transport `UCX_TLS` names that it lacks; without a
    // loaded CUDA component the CUDA rows are answered without asking it.
    let cuda_components = Context::builder()
        .tls("self")
        .build()
        .and_then(|ctx| ctx.components())
        .map(|c| {
            c.into_iter()
                .filter(|c| c.starts_with("cuda"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    for transport in [Transport::Shm, Transport::Tcp] {
        for memory in [MemoryKind::Host, MemoryKind::Cuda] {
            // `--net-devices` replaces the devices of transports that name any.
            let devices = transport
                .net_devices()
                .map(|d| net_devices.unwrap_or(d).to_string());
            if memory == MemoryKind::Cuda && cuda_components.is_empty() {
                let mut row = TransportReport::new(transport, memory, devices);
                row.error = Some(
                    "UCX loaded no CUDA component (no libuct_cuda module, or libcuda.so.1 did \
                     not load)"
                        .into(),
                );
                transports.push(row.expected_without_gpu(gpus));
                continue;
            }
            let (report, single_threaded) = probe(transport, memory, devices);
            multi_threaded &= !single_threaded;
            transports.push(report.expected_without_gpu(gpus));
        }
    }
    // After the contexts: UCX has loaded (or failed to load) its CUDA module by now.
    let loaded = library::loaded_libraries();
    let module_dir = library::module_dir();
    let modules = module_dir.as_deref().map(modules_in).unwrap_or_default();
    let cuda_transports_built = modules.iter().any(|m| m == "cuda");
    let (major, minor, release) = library::release();
    let linked = library::linked();
    let ucx = UcxReport {
        version: format!("{major}.{minor}.{release}"),
        linked_dir: linked.lib_dir.to_string(),
        linked_source: linked.source.to_string(),
        linked_api: linked.api_version.to_string(),
        loaded,
        module_dir,
        modules,
        cuda_transports_built,
        multi_threaded,
    };
    let cuda = CudaReport {
        driver: fs::read_to_string("/proc/driver/nvidia/version")
            .ok()
            .and_then(|v| v.lines().next().map(str::to_string)),
        gpus,
        libcuda: mapped("libcuda.so"),
        libcuda_loadable: libcuda_loadable(),
    };

    let copies = library::loaded_copies();
    if copies.len() > 1 {
        problems.push(format!(
            "{} UCX copies are loaded in one process ({}): they deadlock or corrupt each other; \
             build kvferry against the one the rest of the process uses (KVFERRY_UCX_DIR)",
            copies.len(),
            join(&copies)
        ));
    }
    if let Some(first) = copies.first() {
        let loaded_dir = first.parent().map(canonical);
        let expected = std::env::var_os(EXPECTED_UCX_DIR_ENV).filter(|d| !d.is_empty());
        if let Some(expected) = expected {
            let expected = PathBuf::from(expected);
            if loaded_dir != Some(canonical(&expected)) {
                problems.push(format!(
                    "the loaded UCX ({}) is not the one {EXPECTED_UCX_DIR_ENV} names ({})",
                    first.display(),
                    expected.display()
                ));
            }
        } else if loaded_dir != Some(canonical(Path::new(linked.lib_dir))) {
            problems.push(format!(
                "the loaded UCX ({}) is not the one this build linked against ({}): \
                 LD_LIBRARY_PATH or an earlier-loaded libucp.so.0 won",
                first.display(),
                linked.lib_dir
            ));
        }
    }
    for t in transports
        .iter()
        .filter(|t| t.memory == MemoryKind::Host.to_string())
    {
        if let Some(error) = &t.error {
            problems.push(format!(
                "--transport {} cannot start (UCX_TLS={}): {error}",
                t.transport, t.ucx_tls
            ));
        }
    }
    // A CUDA row that fails on a host with GPUs is a problem too: the problems below name
    // the cause when no row registers CUDA memory; here, a row that fails beside one that
    // does.
    if cuda.gpus > 0 && registers_cuda(&transports) {
        for t in transports
            .iter()
            .filter(|t| t.memory == MemoryKind::Cuda.to_string())
        {
            if let Some(error) = &t.error {
                problems.push(format!(
                    "--transport {} --memory cuda cannot start (UCX_TLS={}): {error}",
                    t.transport, t.ucx_tls
                ));
            }
        }
    }
    if !multi_threaded {
        problems.push(
            "this UCX cannot share a context between threads (configured without \
             --enable-mt); kvferry needs it"
                .into(),
        );
    }
    if cuda.gpus > 0 && cuda.libcuda_loadable == Some(false) {
        problems.push(format!(
            "{} GPU(s) present but kvferry cannot load libcuda (no user-space CUDA driver on \
             the library path?): --memory cuda will refuse to start",
            cuda.gpus
        ));
    }
    if cuda.gpus > 0 && !registers_cuda(&transports) {
        problems.push(if !cuda_transports_built {
            format!(
                "{} GPU(s) present but this UCX has no CUDA transports (no libuct_cuda in {}): \
                 device pools will be refused; use a CUDA-enabled UCX (scripts/setup's wheel, \
                 or KVFERRY_UCX_DIR)",
                cuda.gpus,
                ucx.module_dir
                    .as_deref()
                    .map_or("?".into(), |d| d.display().to_string())
            )
        } else if cuda.libcuda.is_none() {
            format!(
                "{} GPU(s) present but libcuda.so.1 did not load (no user-space CUDA driver on \
                 the library path?): device pools will be refused",
                cuda.gpus
            )
        } else {
            format!(
                "{} GPU(s) present and UCX loaded libcuda, but no context reports CUDA memory",
                cuda.gpus
            )
        });
    }
    let ucx_env = std::env::vars()
        .filter(|(k, _)| k.starts_with("UCX_"))
        .collect();
    Report {
        kvferry: env!("CARGO_PKG_VERSION").to_string(),
        planner_abi: kvferry_planner_abi::ABI_VERSION.to_string(),
        ucx,
        cuda,
        transports,
        ucx_env,
        problems,
    }
}

/// Whether kvferry can load `libcuda` (cudarc's probe, which `--memory cuda` runs first).
fn libcuda_loadable() -> Option<bool> {
    #[cfg(feature = "cuda")]
    return Some(kvferry::cuda_driver_present());
    #[cfg(not(feature = "cuda"))]
    None
}

/// The context `serve` would create for `transport` and `memory`, and whether UCX refused it
/// for lack of multi-threading.
fn probe(
    transport: Transport,
    memory: MemoryKind,
    devices: Option<String>,
) -> (TransportReport, bool) {
    let mut builder = Context::builder().tls(transport.tls(memory));
    if let Some(devices) = &devices {
        builder = builder.net_devices(devices.clone());
    }
    let mut report = TransportReport::new(transport, memory, devices);
    match builder.build() {
        Ok(ctx) => {
            match ctx.resources() {
                Ok(resources) => {
                    report.resources = resources
                        .iter()
                        .map(|r| format!("{}/{}", r.transport, r.device))
                        .collect();
                }
                Err(e) => report.error = Some(kvferry_plan::error_chain(&e)),
            }
            match ctx.memory_types() {
                Ok(types) => {
                    report.memory_types = types
                        .iter()
                        .map(|t| {
                            t.name()
                                .map_or_else(|| format!("{}", t.raw()), str::to_string)
                        })
                        .collect();
                }
                Err(e) => report.error = Some(kvferry_plan::error_chain(&e)),
            }
        }
        Err(e) => {
            report.error = Some(kvferry_plan::error_chain(&e));
            return (
                report,
                e.op() == Op::Init && e.status() == Status::UNSUPPORTED,
            );
        }
    }
    (report, false)
}

/// Module names in UCX's module directory: `libuct_cma.so.0` → `cma`, `libucm_cuda.so` → `cuda`.
fn modules_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|name| {
            let stem = name.split(".so").next()?;
            let module = stem
                .strip_prefix("libuct_")
                .or_else(|| stem.strip_prefix("libucm_"))
                .or_else(|| stem.strip_prefix("libucx_perftest_"))?;
            name.contains(".so").then(|| module.to_string())
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The first file mapped into this process whose name starts with `prefix`.
fn mapped(prefix: &str) -> Option<PathBuf> {
    library::mapped_files().into_iter().find(|path| {
        path.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(prefix))
    })
}

/// Whether some context of `transports` can register CUDA device memory.
fn registers_cuda(transports: &[TransportReport]) -> bool {
    transports
        .iter()
        .any(|t| t.memory_types.iter().any(|m| m == "cuda"))
}

fn canonical(path: &Path) -> PathBuf {
    fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

fn join(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Report {
    /// Whether some context can register CUDA device memory.
    pub fn cuda_registrable(&self) -> bool {
        registers_cuda(&self.transports)
    }

    /// The report as text, one topic per block.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let u = &self.ucx;
        let yes_no = |b: bool| if b { "yes" } else { "no" };
        let _ = writeln!(
            out,
            "kvferry  {} (planner ABI {})",
            self.kvferry, self.planner_abi
        );
        let _ = writeln!(out, "UCX      {} ({})", u.version, join(&u.loaded));
        let _ = writeln!(
            out,
            "         linked against {} ({}), API {}",
            u.linked_dir, u.linked_source, u.linked_api
        );
        let _ = writeln!(
            out,
            "         multi-threaded: {}; CUDA transports built: {}; modules: {} in {}",
            yes_no(u.multi_threaded),
            yes_no(u.cuda_transports_built),
            if u.modules.is_empty() {
                "none".to_string()
            } else {
                u.modules.join(" ")
            },
            u.module_dir
                .as_deref()
                .map_or("?".into(), |d| d.display().to_string())
        );
        if let Some(dir) = &u.module_dir {
            if let Some(bin) = dir.parent().and_then(Path::parent).map(|p| p.join("bin")) {
                if bin.join("ucx_info").exists() {
                    let _ = writeln!(
                        out,
                        "         its tools: LD_LIBRARY_PATH={} {}/ucx_info -d",
                        dir.parent().map_or("?".into(), |p| p.display().to_string()),
                        bin.display()
                    );
                }
            }
        }
        let c = &self.cuda;
        let _ = writeln!(
            out,
            "CUDA     driver: {}; GPUs: {}; libcuda in this process: {}",
            c.driver.as_deref().unwrap_or("not loaded"),
            c.gpus,
            c.libcuda
                .as_deref()
                .map_or("no".into(), |p| p.display().to_string())
        );
        for t in &self.transports {
            let devices = t
                .ucx_net_devices
                .as_deref()
                .map(|d| format!(" UCX_NET_DEVICES={d}"))
                .unwrap_or_default();
            let label = format!("{} {}", t.transport, t.memory);
            let what = match (&t.error, &t.note) {
                (Some(e), _) => format!("error: {e}"),
                (None, Some(note)) => format!("note: {note}"),
                (None, None) => format!(
                    "{}; registers: {}",
                    if t.resources.is_empty() {
                        "no resources".to_string()
                    } else {
                        t.resources.join(" ")
                    },
                    t.memory_types.join(" ")
                ),
            };
            let _ = writeln!(out, "{label:<8} UCX_TLS={}{devices}: {what}", t.ucx_tls);
        }
        if !self.ucx_env.is_empty() {
            let vars: Vec<String> = self
                .ucx_env
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let _ = writeln!(out, "env      {}", vars.join(" "));
        }
        if self.problems.is_empty() {
            let _ = writeln!(out, "problems none");
        } else {
            for p in &self.problems {
                let _ = writeln!(out, "problem  {p}");
            }
        }
        out
    }
}
