//! kvferry-loader: finds planner libraries, checks them before `dlopen`, loads them, and binds
//! the one a deployment uses. The only host crate that loads code at run time.
//!
//! This is the only crate of kvferry that loads code at run time. [`Registry::scan`] walks
//! the plugin directories ([`plugin_dirs`]) and, for every `*.so` file, checks its ELF
//! structure, `dlopen`s it, reads its root module ([`PlannerModuleRef`]) and records the
//! planner's id, describer id and version. Files that cannot be used are kept, with the
//! reason, in [`Registry::skipped`] (`kvferry planners --all` lists them). [`Registry::bind`]
//! then picks the planner named by [`select_planner_id`] and asks it whether it supports the
//! deployment — or, for `auto`, asks every planner ([`Registry::candidates`]) and binds the
//! most specific one that says yes ([`Registry::bind_auto`]).
//!
//! # Trust model
//!
//! Loading a library runs its initialisers (ELF constructors, `.init_array`) and its root
//! module constructor inside the kvferry process, with kvferry's privileges, before any check
//! of ours can say no. A planner library is therefore as trusted as the `kvferry` binary
//! itself: **only put planners you built or trust on the plugin path.** The checks made here
//! (ELF structure, abi_stable's layout and version checks, unique ids) catch accidents — a
//! truncated copy, a stale build against an older `planner-abi`, a file that is not a planner —
//! not malice. Plans a planner returns are validated by the `plan` module before a byte
//! moves, whoever wrote the planner.
//!
//! # Libraries are never unloaded
//!
//! A loaded library stays mapped until the process exits, including libraries that were
//! loaded and then refused (duplicate ids, unsupported deployments): planner objects, strings
//! and vtables may point into it, and abi_stable leaks the handle on purpose. Planners must not
//! rely on destructors of statics or on being unloaded.

#![deny(missing_docs)]

mod elf;

/*
Maintainer notes.

- Never use `RootModule::load_from_file`/`load_from_directory`: they cache one module per
  root-module *type*, so a second planner silently comes back as the first (measured, see
  platform-notes §5). `lib_header_from_path(..)?.init_root_module::<PlannerModuleRef>()` per
  file has no such cache. Loading the same path twice returns the same `dlopen` handle, so the
  scan skips a file it has already seen (same canonical path) before calling it a duplicate.
- A truncated `.so` kills the process with SIGBUS inside `dlopen` (the loader maps a
  `PT_LOAD` segment past the end of the file and touches it). `elf::check` (src/elf.rs)
  reads the headers first, with the `object` crate's ELF reader over a `ReadCache` (plain file
  reads of the header tables only), and refuses any file whose tables or loadable segments
  run past its end. `object`'s errors are static strings, so `elf.rs` works out which part
  ran past the end, and where, for `LoadError::Truncated`; keep that when upgrading `object`.
  The file could still change between the check and the `dlopen`; the plugin directory is
  trusted (see the trust model), so that window is accepted.
- A panic that unwinds out of a plugin ends the process (abi_stable's guard exits). The
  export macro in `planner-abi` catches panics in every planner entry point, and abi_stable
  catches a panic in the root module constructor (`InitPanicked`).
- abi_stable's `AbiInstability` text is tens of kilobytes (both type layouts in full); only
  its `Error:` lines, with their expected/found values, are kept.
*/

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use abi_stable::library::{LibraryError, RootModule, RootModuleError, lib_header_from_path};
use kvferry_planner_abi::host::{AnyPlannerModule, PlannerModuleRef, abi_0_2_0};
use kvferry_planner_abi::{
    DEFAULT_DESCRIBER_ID, Deployment, DeploymentRefusal, PlanError, RankInfo, Specificity,
    TransferPlanner,
};
use serde::Serialize;

/// Environment variable holding the plugin directories, colon-separated.
pub const PLUGIN_DIR_ENV: &str = "KVFERRY_PLUGIN_DIR";

/// Environment variable naming the planner to bind.
pub const PLANNER_ENV: &str = "KVFERRY_PLANNER";

/// The planner bound when neither a flag, the environment nor the config names one.
pub const DEFAULT_PLANNER_ID: &str = "kvferry.default";

/// The planner "id" that asks for automatic selection ([`Registry::bind_auto`]).
pub const AUTO_PLANNER_ID: &str = "auto";

/// The most `Error:` lines of an abi_stable layout report kept in [`LoadError::AbiMismatch`].
const MAX_ABI_LINES: usize = 10;

/// The plugin directories to scan, in order.
///
/// 1. `KVFERRY_PLUGIN_DIR` ([`PLUGIN_DIR_ENV`]), colon-separated, if set and not empty;
/// 2. else `config_dirs`, the configuration's `plugin_dir` (one or several), if any;
/// 3. else the directory of the running executable, so that cargo's build output works with
///    no configuration (`target/debug/libkvferry_planner_*.so` next to `target/debug/kvferry`),
///    then [`INSTALLED_PLANNERS`] beside it when that exists (`scripts/install`'s layout:
///    `PREFIX/bin/kvferry` and `PREFIX/lib/kvferry/planners/`).
///
/// Reads the process environment; [`plugin_dirs_from`] is the same rule with every input
/// passed in.
pub fn plugin_dirs(config_dirs: &[PathBuf]) -> Vec<PathBuf> {
    let env = std::env::var_os(PLUGIN_DIR_ENV);
    let exe = std::env::current_exe().ok();
    plugin_dirs_from(env.as_deref(), config_dirs, exe.as_deref())
}

/// [`plugin_dirs`] with its inputs passed in: the value of `KVFERRY_PLUGIN_DIR` (`env`), the
/// config's `plugin_dir`, and the path of the running executable.
///
/// Empty entries of `env` (`a::b`, a trailing `:`) are ignored; an `env` with no non-empty
/// entry counts as unset. Returns no directory only when every input is absent.
pub fn plugin_dirs_from(
    env: Option<&OsStr>,
    config_dirs: &[PathBuf],
    exe: Option<&Path>,
) -> Vec<PathBuf> {
    if let Some(env) = env {
        let dirs: Vec<PathBuf> = std::env::split_paths(env)
            .filter(|p| !p.as_os_str().is_empty())
            .collect();
        if !dirs.is_empty() {
            return dirs;
        }
    }
    if !config_dirs.is_empty() {
        return config_dirs.to_vec();
    }
    let Some(dir) = exe.and_then(Path::parent) else {
        return Vec::new();
    };
    let mut dirs = vec![dir.to_path_buf()];
    if let Some(installed) = dir.parent().map(|prefix| prefix.join(INSTALLED_PLANNERS)) {
        if installed.is_dir() {
            dirs.push(installed);
        }
    }
    dirs
}

/// Where an installed prefix keeps its planners (`scripts/install`): `PREFIX/lib/kvferry/planners`,
/// beside `PREFIX/bin/kvferry` and `PREFIX/lib/libkvferry.so`.
pub const INSTALLED_PLANNERS: &str = "lib/kvferry/planners";

/// The id of the planner to bind: the command-line `flag`, else `KVFERRY_PLANNER` (`env`),
/// else the config's `planner`, else [`DEFAULT_PLANNER_ID`]. Empty values count as unset.
pub fn select_planner_id<'a>(
    flag: Option<&'a str>,
    env: Option<&'a str>,
    config: Option<&'a str>,
) -> &'a str {
    [flag, env, config]
        .into_iter()
        .flatten()
        .map(str::trim)
        .find(|id| !id.is_empty())
        .unwrap_or(DEFAULT_PLANNER_ID)
}

/// Why a file on the plugin path was not loaded.
///
/// Every variant names the file; [`DuplicateId`](Self::DuplicateId) names both files.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum LoadError {
    /// A plugin directory could not be listed, or a file in it could not be read.
    #[error("{}: cannot read: {message}", path.display())]
    Read {
        /// The directory or file.
        path: PathBuf,
        /// The I/O error.
        message: String,
    },
    /// The file is not an ELF64 shared object for this machine: wrong magic, class, byte
    /// order, ELF version, object type or machine, or a malformed header or header table
    /// (e.g. entries of the wrong size, no program headers). Checked before `dlopen`.
    #[error("{}: not a loadable ELF shared object: {detail}", path.display())]
    NotElf {
        /// The file.
        path: PathBuf,
        /// What is wrong, e.g. `bad magic` or `machine 183 (aarch64), this host is x86_64`.
        detail: String,
    },
    /// The ELF header, the program or section header table, or a `PT_LOAD` segment runs
    /// past the end of the file (a partial copy). Checked before `dlopen`, which would crash
    /// the process with SIGBUS on such a file.
    #[error(
        "{}: truncated: {part} ends at byte {end} but the file has {file_size} bytes",
        path.display()
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What runs past the end: `ELF header`, `program header table`,
        /// `section header table`, or `PT_LOAD segment <n>` (index in the program headers).
        part: String,
        /// Where that part ends.
        end: u64,
        /// The file's size.
        file_size: u64,
    },
    /// `dlopen` failed (missing dependency, unresolved symbol, ...).
    #[error("{}: cannot load: {message}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The dynamic loader's message.
        message: String,
    },
    /// The library loaded but exports no abi_stable root module: it is not a planner.
    #[error("{}: not a planner: no root module symbol `{symbol}`", path.display())]
    NotAPlanner {
        /// The file.
        path: PathBuf,
        /// The symbol that was looked up.
        symbol: String,
    },
    /// The library's root module, or a type reachable from it, has a different layout than
    /// the host's `planner-abi` (or the library uses an incompatible abi_stable): it was built
    /// against another version of the interface.
    #[error("{}: planner ABI mismatch: {}", path.display(), summary.join("; "))]
    AbiMismatch {
        /// The file.
        path: PathBuf,
        /// abi_stable's report, reduced to its deduplicated `Error:` lines (at most ten,
        /// then a count of the rest).
        summary: Vec<String>,
    },
    /// The library was built against a `planner-abi` version this host cannot load (abi_stable
    /// requires the same major version, and for `0.y` a minor version at least the host's).
    #[error(
        "{}: built against planner-abi {found}, this host needs {expected} or a compatible \
         version",
        path.display()
    )]
    IncompatibleVersion {
        /// The file.
        path: PathBuf,
        /// The host's `planner-abi` version.
        expected: String,
        /// The library's (or the unparseable version string).
        found: String,
    },
    /// The library's root module constructor returned an error.
    #[error("{}: root module constructor failed: {message}", path.display())]
    InitFailed {
        /// The file.
        path: PathBuf,
        /// The constructor's error.
        message: String,
    },
    /// The library's root module constructor panicked; abi_stable caught the panic inside
    /// the library (its message went to the library's panic hook, usually stderr).
    #[error("{}: root module constructor panicked", path.display())]
    InitPanicked {
        /// The file.
        path: PathBuf,
    },
    /// A second file provides a planner id already loaded from an earlier file; the second
    /// is refused (directories in order, files by name).
    #[error(
        "{}: duplicate planner id `{id}`, already loaded from {}",
        second.display(),
        first.display()
    )]
    DuplicateId {
        /// The planner id.
        id: String,
        /// The file the id was first loaded from (kept).
        first: PathBuf,
        /// The file refused.
        second: PathBuf,
    },
}

impl LoadError {
    /// The file (or directory) that was refused.
    pub fn path(&self) -> &Path {
        match self {
            Self::Read { path, .. }
            | Self::NotElf { path, .. }
            | Self::Truncated { path, .. }
            | Self::Open { path, .. }
            | Self::NotAPlanner { path, .. }
            | Self::AbiMismatch { path, .. }
            | Self::IncompatibleVersion { path, .. }
            | Self::InitFailed { path, .. }
            | Self::InitPanicked { path } => path,
            Self::DuplicateId { second, .. } => second,
        }
    }
}

/// Why a planner could not be bound.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BindError {
    /// No loaded planner has the requested id.
    #[error(
        "no planner `{id}`: {}{}",
        known_list(known, dirs),
        skipped_hint(*skipped)
    )]
    UnknownPlanner {
        /// The requested id.
        id: String,
        /// The ids of the loaded planners.
        known: Vec<String>,
        /// The directories that were scanned.
        dirs: Vec<PathBuf>,
        /// How many files were skipped while scanning.
        skipped: usize,
    },
    /// The planner's rows come from a describer this host does not implement.
    #[error(
        "planner `{id}` ({}) needs describer `{describer_id}`, this host has only `{}`",
        path.display(),
        DEFAULT_DESCRIBER_ID
    )]
    UnknownDescriber {
        /// The planner id.
        id: String,
        /// The describer it asks for.
        describer_id: String,
        /// Where the planner was loaded from.
        path: PathBuf,
    },
    /// The planner does not support the deployment (or its check panicked); its answer, with
    /// the reason, is the `source()`.
    #[error("planner `{id}` ({}) does not support {deployment}", path.display())]
    Unsupported {
        /// The planner id.
        id: String,
        /// Where the planner was loaded from.
        path: PathBuf,
        /// The deployment it was asked about, as `<architecture> <mapping>`.
        deployment: String,
        /// The planner's answer, with its reason.
        #[source]
        error: Box<PlanError>,
    },
    /// Automatic selection found no loaded planner that supports the deployment.
    #[error("no planner supports {deployment}: {}", refusal_list(refusals))]
    NoCandidate {
        /// The deployment, as `<architecture> <mapping>`.
        deployment: String,
        /// Every loaded planner's id and its reason.
        refusals: Vec<(String, String)>,
    },
    /// Automatic selection found two supporting planners of the same, highest specificity.
    #[error(
        "automatic selection for {deployment} is ambiguous: `{first}` ({}) and `{second}` ({}) \
         both support it at specificity {specificity}; name one with --planner or \
         KVFERRY_PLANNER, or remove one from the plugin path",
        first_path.display(),
        second_path.display()
    )]
    Ambiguous {
        /// The deployment, as `<architecture> <mapping>`.
        deployment: String,
        /// The specificity both declare.
        specificity: Specificity,
        /// One planner id.
        first: String,
        /// Its file.
        first_path: PathBuf,
        /// The other planner id.
        second: String,
        /// Its file.
        second_path: PathBuf,
    },
}

fn refusal_list(refusals: &[(String, String)]) -> String {
    if refusals.is_empty() {
        return "no planner was loaded".to_string();
    }
    refusals
        .iter()
        .map(|(id, reason)| format!("`{id}` refuses: {reason}"))
        .collect::<Vec<_>>()
        .join("; ")
}

fn known_list(known: &[String], dirs: &[PathBuf]) -> String {
    let dirs = if dirs.is_empty() {
        "no plugin directory".to_string()
    } else {
        dirs.iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if known.is_empty() {
        format!("no planner was loaded (searched {dirs})")
    } else {
        format!("known planners are {} (searched {dirs})", known.join(", "))
    }
}

fn skipped_hint(skipped: usize) -> String {
    match skipped {
        0 => String::new(),
        1 => "; 1 file was skipped, see `kvferry planners --all`".to_string(),
        n => format!("; {n} files were skipped, see `kvferry planners --all`"),
    }
}

/// A loaded planner, as `kvferry planners` lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlannerInfo {
    /// The planner id.
    pub id: String,
    /// The describer id.
    pub describer_id: String,
    /// The planner library's version.
    pub version: String,
    /// The file it was loaded from, or the label given to [`Registry::from_modules`].
    pub path: PathBuf,
    /// How specific the planner declares itself (automatic selection prefers the highest).
    #[serde(serialize_with = "specificity_value")]
    pub specificity: Specificity,
}

fn specificity_value<S: serde::Serializer>(s: &Specificity, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_u32(s.0)
}

/// One planner's answer to "do you support this deployment?", as `kvferry check` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The planner.
    pub info: PlannerInfo,
    /// `Ok` if it supports the deployment (and this host has its describer), else why not.
    pub verdict: Result<(), CandidateRefusal>,
}

/// Why a candidate cannot be bound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CandidateRefusal {
    /// The planner refused the deployment (or its check panicked).
    Planner(Box<PlanError>),
    /// The planner needs a describer this host does not implement.
    UnknownDescriber(String),
}

impl CandidateRefusal {
    /// The planner's field-level refusal, when it gave one.
    pub fn deployment_refusal(&self) -> Option<&DeploymentRefusal> {
        match self {
            CandidateRefusal::Planner(e) => e.deployment_refusal(),
            CandidateRefusal::UnknownDescriber(_) => None,
        }
    }
}

impl fmt::Display for CandidateRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CandidateRefusal::Planner(e) => f.write_str(e.message()),
            CandidateRefusal::UnknownDescriber(d) => write!(
                f,
                "needs describer `{d}`, this host has only `{DEFAULT_DESCRIBER_ID}`"
            ),
        }
    }
}

/// A file the scan did not load, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedFile {
    /// The file (for a duplicate id, the refused second file).
    pub path: PathBuf,
    /// Why.
    pub reason: LoadError,
}

impl Serialize for SkippedFile {
    /// `{ "path": ..., "message": <the reason's text>, "reason": { "kind": ..., fields } }`.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut s = serializer.serialize_struct("SkippedFile", 3)?;
        s.serialize_field("path", &self.path)?;
        s.serialize_field("message", &self.reason.to_string())?;
        s.serialize_field("reason", &self.reason)?;
        s.end()
    }
}

/// The planners found on the plugin path, and the files that were skipped.
///
/// Build it with [`Registry::scan`] (plugin directories) or [`Registry::from_modules`]
/// (statically linked planners), then [`bind`](Registry::bind) one planner.
#[derive(Debug)]
pub struct Registry {
    planners: Vec<PlannerInfo>,
    modules: Vec<AnyPlannerModule>,
    skipped: Vec<SkippedFile>,
    dirs: Vec<PathBuf>,
}

impl Registry {
    /// Loads every planner library in `dirs`: directories in order, in each the regular files
    /// (or links to them) whose name ends in `.so`, by name. Never fails: files that cannot be
    /// used are recorded in [`skipped`](Self::skipped) and logged.
    ///
    /// Loading runs each library's initialisers in this process, and the libraries stay
    /// loaded for the life of the process: see the [module docs](self) for the trust model.
    ///
    /// # Errors
    ///
    /// Recorded per file, as a [`LoadError`]:
    /// - [`Read`](LoadError::Read): a directory could not be listed or a file read;
    /// - [`NotElf`](LoadError::NotElf): not an ELF64 shared object for this machine;
    /// - [`Truncated`](LoadError::Truncated): a header table or loadable segment runs past
    ///   the end of the file;
    /// - [`Open`](LoadError::Open): `dlopen` failed;
    /// - [`NotAPlanner`](LoadError::NotAPlanner): no root module;
    /// - [`AbiMismatch`](LoadError::AbiMismatch): built against a different interface layout;
    /// - [`IncompatibleVersion`](LoadError::IncompatibleVersion): built against an
    ///   incompatible `planner-abi` version;
    /// - [`InitFailed`](LoadError::InitFailed) / [`InitPanicked`](LoadError::InitPanicked):
    ///   the root module constructor failed or panicked;
    /// - [`DuplicateId`](LoadError::DuplicateId): an earlier file has the same planner id.
    pub fn scan(dirs: &[PathBuf]) -> Registry {
        let mut registry = Registry::empty(dirs.to_vec());
        let mut seen_files = HashSet::new();
        for dir in dirs {
            let files = match list_plugin_files(dir) {
                Ok(files) => files,
                Err(reason) => {
                    registry.skip(reason);
                    continue;
                }
            };
            for path in files {
                registry.load_once(&path, &mut seen_files);
            }
        }
        registry
    }

    /// Loads the given planner library files, in order, with the same checks as
    /// [`scan`](Self::scan) (`kvferry conform PATH`). [`dirs`](Self::dirs) is empty.
    pub fn scan_files(files: &[PathBuf]) -> Registry {
        let mut registry = Registry::empty(Vec::new());
        let mut seen_files = HashSet::new();
        for path in files {
            registry.load_once(path, &mut seen_files);
        }
        registry
    }

    fn load_once(&mut self, path: &Path, seen_files: &mut HashSet<PathBuf>) {
        // The same file reached twice (a directory listed twice, a link) is the same
        // library: `dlopen` would hand back the same handle. Load it once.
        let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        if !seen_files.insert(canonical) {
            tracing::debug!(file = %path.display(), "plugin file already scanned");
            return;
        }
        match load(path) {
            Ok((module, info)) => self.add(module, info),
            Err(reason) => self.skip(reason),
        }
    }

    /// A registry of statically linked planners, each with a label shown where a file path
    /// would be (e.g. `static:kvferry.default`). Tests and benchmarks pass
    /// `some_planner_crate::planner_module()`, which `export_planner!` generates. A repeated
    /// id is skipped as [`LoadError::DuplicateId`], as in [`scan`](Self::scan).
    pub fn from_modules<P: Into<PathBuf>>(
        modules: impl IntoIterator<Item = (PlannerModuleRef, P)>,
    ) -> Registry {
        let mut registry = Registry::empty(Vec::new());
        for (module, label) in modules {
            let module = AnyPlannerModule::Current(module);
            let info = info_of(module, label.into());
            registry.add(module, info);
        }
        registry
    }

    fn empty(dirs: Vec<PathBuf>) -> Registry {
        Registry {
            planners: Vec::new(),
            modules: Vec::new(),
            skipped: Vec::new(),
            dirs,
        }
    }

    fn add(&mut self, module: AnyPlannerModule, info: PlannerInfo) {
        if let Some(first) = self.planners.iter().find(|p| p.id == info.id) {
            let reason = LoadError::DuplicateId {
                id: info.id,
                first: first.path.clone(),
                second: info.path,
            };
            self.skip(reason);
            return;
        }
        tracing::debug!(
            planner = %info.id,
            version = %info.version,
            interface = module.interface(),
            file = %info.path.display(),
            "planner loaded"
        );
        self.planners.push(info);
        self.modules.push(module);
    }

    fn skip(&mut self, reason: LoadError) {
        // Other shared objects may share a plugin directory (the C API's library sits next
        // to the binaries): not being a planner is news only when asked (`planners --all`).
        if matches!(reason, LoadError::NotAPlanner { .. }) {
            tracing::debug!("skipping plugin file: {reason}");
        } else {
            tracing::warn!("skipping plugin file: {reason}");
        }
        self.skipped.push(SkippedFile {
            path: reason.path().to_path_buf(),
            reason,
        });
    }

    /// The loaded planners, in scan order.
    pub fn planners(&self) -> &[PlannerInfo] {
        &self.planners
    }

    /// The loaded planner with this id.
    pub fn planner(&self, id: &str) -> Option<&PlannerInfo> {
        self.planners.iter().find(|p| p.id == id)
    }

    /// The files that were not loaded, in scan order, with the reason.
    pub fn skipped(&self) -> &[SkippedFile] {
        &self.skipped
    }

    /// The directories that were scanned (empty for [`from_modules`](Self::from_modules)).
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Asks every loaded planner whether it supports `deployment`, in scan order.
    pub fn candidates(&self, deployment: &Deployment) -> Vec<Candidate> {
        self.planners
            .iter()
            .zip(&self.modules)
            .map(|(info, module)| Candidate {
                info: info.clone(),
                verdict: verdict(info, module, deployment),
            })
            .collect()
    }

    /// Automatic selection: among the loaded planners that support `deployment` (and whose
    /// describer this host implements), the one with the highest declared [`Specificity`].
    /// A model-specific planner thus wins over `kvferry.default`; two at the same highest
    /// specificity are refused, naming both files, rather than picked by load order.
    ///
    /// # Errors
    ///
    /// [`BindError::NoCandidate`] (every planner's reason listed) or
    /// [`BindError::Ambiguous`].
    pub fn bind_auto(&self, deployment: &Deployment) -> Result<BoundPlanner, BindError> {
        let candidates = self.candidates(deployment);
        let mut accepted: Vec<&Candidate> =
            candidates.iter().filter(|c| c.verdict.is_ok()).collect();
        accepted.sort_by_key(|c| std::cmp::Reverse(c.info.specificity));
        let (best, runner_up) = match accepted.as_slice() {
            [] => {
                return Err(BindError::NoCandidate {
                    deployment: deployment.to_string(),
                    refusals: candidates
                        .iter()
                        .filter_map(|c| {
                            let reason = c.verdict.as_ref().err()?;
                            Some((c.info.id.clone(), reason.to_string()))
                        })
                        .collect(),
                });
            }
            [best] => (best, None),
            [best, second, ..] => (best, Some(second)),
        };
        if let Some(second) = runner_up.filter(|s| s.info.specificity == best.info.specificity) {
            return Err(BindError::Ambiguous {
                deployment: deployment.to_string(),
                specificity: best.info.specificity,
                first: best.info.id.clone(),
                first_path: best.info.path.clone(),
                second: second.info.id.clone(),
                second_path: second.info.path.clone(),
            });
        }
        tracing::info!(
            planner = %best.info.id,
            specificity = %best.info.specificity,
            candidates = accepted.len(),
            "automatic selection"
        );
        self.bind_named(&best.info.id, deployment)
    }

    /// Binds planner `id` for `deployment`, after asking the planner whether it supports it;
    /// [`AUTO_PLANNER_ID`] (`auto`) binds by [`bind_auto`](Self::bind_auto) instead. Logs
    /// which planner (id, version, file) is bound.
    ///
    /// # Errors
    ///
    /// - [`BindError::UnknownPlanner`]: no loaded planner has `id` (the error lists the
    ///   known ids, and points at `kvferry planners --all` if files were skipped);
    /// - [`BindError::UnknownDescriber`]: the planner needs a describer this host lacks;
    /// - [`BindError::Unsupported`]: the planner refused the deployment, with its reason;
    /// - for `auto`, those of [`bind_auto`](Self::bind_auto).
    pub fn bind(&self, id: &str, deployment: &Deployment) -> Result<BoundPlanner, BindError> {
        if id == AUTO_PLANNER_ID {
            return self.bind_auto(deployment);
        }
        self.bind_named(id, deployment)
    }

    fn bind_named(&self, id: &str, deployment: &Deployment) -> Result<BoundPlanner, BindError> {
        let Some(index) = self.planners.iter().position(|p| p.id == id) else {
            return Err(BindError::UnknownPlanner {
                id: id.to_string(),
                known: self.planners.iter().map(|p| p.id.clone()).collect(),
                dirs: self.dirs.clone(),
                skipped: self.skipped.len(),
            });
        };
        let info = &self.planners[index];
        let module = self.modules[index];
        if info.describer_id != DEFAULT_DESCRIBER_ID {
            return Err(BindError::UnknownDescriber {
                id: info.id.clone(),
                describer_id: info.describer_id.clone(),
                path: info.path.clone(),
            });
        }
        module
            .check_deployment(deployment)
            .map_err(|error| BindError::Unsupported {
                id: info.id.clone(),
                path: info.path.clone(),
                deployment: deployment.to_string(),
                error: Box::new(error),
            })?;
        tracing::info!(
            planner = %info.id,
            version = %info.version,
            file = %info.path.display(),
            deployment = %deployment,
            "bound planner"
        );
        Ok(BoundPlanner {
            info: info.clone(),
            module,
        })
    }
}

fn verdict(
    info: &PlannerInfo,
    module: &AnyPlannerModule,
    deployment: &Deployment,
) -> Result<(), CandidateRefusal> {
    if info.describer_id != DEFAULT_DESCRIBER_ID {
        return Err(CandidateRefusal::UnknownDescriber(
            info.describer_id.clone(),
        ));
    }
    module
        .check_deployment(deployment)
        .map_err(|e| CandidateRefusal::Planner(Box::new(e)))
}

/// A planner bound to a deployment: builds one planner object per rank.
#[derive(Clone, Debug)]
pub struct BoundPlanner {
    info: PlannerInfo,
    module: AnyPlannerModule,
}

impl BoundPlanner {
    /// The planner id.
    pub fn id(&self) -> &str {
        &self.info.id
    }

    /// The describer id.
    pub fn describer_id(&self) -> &str {
        &self.info.describer_id
    }

    /// The planner library's version.
    pub fn version(&self) -> &str {
        &self.info.version
    }

    /// The file the planner was loaded from (or its static label).
    pub fn path(&self) -> &Path {
        &self.info.path
    }

    /// Id, describer id, version and path together.
    pub fn info(&self) -> &PlannerInfo {
        &self.info
    }

    /// Builds the planner object for one rank.
    ///
    /// # Errors
    ///
    /// Whatever the planner's constructor returns; a panic in it comes back as
    /// [`ErrorKind::PANICKED`](kvferry_planner_abi::ErrorKind::PANICKED).
    pub fn instantiate(&self, me: &RankInfo) -> Result<Arc<dyn TransferPlanner>, PlanError> {
        let planner = self.module.instantiate(me)?;
        Ok(Arc::from(planner))
    }
}

/// The candidate files of one plugin directory: names ending in `.so` that are regular files
/// (following links), sorted by name.
fn list_plugin_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let read_error = |e: std::io::Error| LoadError::Read {
        path: dir.to_path_buf(),
        message: e.to_string(),
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_error)? {
        let path = entry.map_err(read_error)?.path();
        let is_so = path.extension().is_some_and(|ext| ext == "so");
        if is_so && std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Checks, loads and reads one planner library.
///
/// A library whose layout this version's interface refuses is tried against the 0.2.0
/// layouts before it is skipped (see `kvferry_planner_abi::host::AnyPlannerModule`); the
/// error reported is the one against the current interface.
fn load(path: &Path) -> Result<(AnyPlannerModule, PlannerInfo), LoadError> {
    elf::check(path)?;
    let header = lib_header_from_path(path).map_err(|e| map_library_error(path, e))?;
    let module = match header.init_root_module::<PlannerModuleRef>() {
        Ok(module) => AnyPlannerModule::Current(module),
        Err(error @ LibraryError::AbiInstability(_)) => {
            match header.init_root_module::<abi_0_2_0::PlannerModuleRef>() {
                Ok(module) => AnyPlannerModule::Abi0_2_0(module),
                Err(_) => return Err(map_library_error(path, error)),
            }
        }
        Err(error) => return Err(map_library_error(path, error)),
    };
    Ok((module, info_of(module, path.to_path_buf())))
}

fn info_of(module: AnyPlannerModule, path: PathBuf) -> PlannerInfo {
    PlannerInfo {
        id: module.id(),
        describer_id: module.describer(),
        version: module.library_version(),
        path,
        specificity: module.specificity_level(),
    }
}

/// Maps abi_stable's loader error to ours (see `abi_stable::library::LibraryError`).
fn map_library_error(path: &Path, error: LibraryError) -> LoadError {
    let path = path.to_path_buf();
    match error {
        LibraryError::OpenError { err, .. } => LoadError::Open {
            path,
            message: err.to_string(),
        },
        LibraryError::GetSymbolError { symbol, .. } => LoadError::NotAPlanner {
            path,
            symbol: String::from_utf8_lossy(&symbol)
                .trim_end_matches('\0')
                .to_string(),
        },
        LibraryError::ParseVersionError(e) => LoadError::IncompatibleVersion {
            path,
            expected: PlannerModuleRef::VERSION_STRINGS.to_string(),
            found: one_line(&e.to_string()),
        },
        LibraryError::IncompatibleVersionNumber {
            expected_version,
            actual_version,
            ..
        } => LoadError::IncompatibleVersion {
            path,
            expected: expected_version.to_string(),
            found: actual_version.to_string(),
        },
        LibraryError::RootModule { err, .. } => match err {
            RootModuleError::Returned(e) => LoadError::InitFailed {
                path,
                message: one_line(&e.to_string()),
            },
            RootModuleError::Unwound => LoadError::InitPanicked { path },
        },
        LibraryError::AbiInstability(report) => {
            let report = report.to_string();
            // The whole report is long; it is what a planner author needs to find the type.
            tracing::debug!(path = %path.display(), %report, "abi_stable's layout report");
            LoadError::AbiMismatch {
                path,
                summary: summarize_abi_report(&report),
            }
        }
        LibraryError::InvalidAbiHeader(found) => {
            let expected = abi_stable::library::AbiHeader::VALUE;
            LoadError::AbiMismatch {
                path,
                summary: vec![format!(
                    "abi_stable ABI header differs: library {}.{}, host {}.{}",
                    found.abi_major, found.abi_minor, expected.abi_major, expected.abi_minor
                )],
            }
        }
        LibraryError::InvalidCAbi { expected, found } => LoadError::AbiMismatch {
            path,
            summary: vec![format!(
                "C ABI differs: expected {}, found {}",
                one_line(&expected.to_string()),
                one_line(&found.to_string())
            )],
        },
        LibraryError::Many(errors) => {
            let mut mapped = errors.into_iter().map(|e| map_library_error(&path, e));
            let Some(mut first) = mapped.next() else {
                return LoadError::Open {
                    path,
                    message: "the loader reported an empty list of errors".to_string(),
                };
            };
            if let LoadError::AbiMismatch { summary, .. } = &mut first {
                for other in mapped {
                    if let LoadError::AbiMismatch { summary: more, .. } = other {
                        summary.extend(more);
                    }
                }
                *summary = cap_lines(dedup(std::mem::take(summary)));
            }
            first
        }
    }
}

/// Collapses a multi-line message into one line.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Reduces abi_stable's layout report to its `Error:` lines, each with the first line of its
/// `Expected:` and `Found:` values, deduplicated, at most [`MAX_ABI_LINES`] plus a count.
fn summarize_abi_report(report: &str) -> Vec<String> {
    let lines: Vec<&str> = report.lines().map(str::trim).collect();
    let mut summary = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(what) = line.strip_prefix("Error:") else {
            continue;
        };
        // This error's lines run up to the next `Error:` line.
        let block = &lines[i + 1..];
        let block = &block[..block
            .iter()
            .position(|l| l.starts_with("Error:"))
            .unwrap_or(block.len())];
        let value = |label: &str| {
            let at = block.iter().position(|l| *l == label)?;
            let first = block[at + 1..].iter().find(|l| !l.is_empty())?;
            Some(first.strip_prefix("field_name:").unwrap_or(first))
        };
        let what = what.trim();
        summary.push(match (value("Expected:"), value("Found:")) {
            (Some(expected), Some(found)) => {
                format!("{what} (expected {expected}, found {found})")
            }
            _ => what.to_string(),
        });
    }
    if summary.is_empty() {
        let first = lines
            .iter()
            .find(|l| !l.is_empty())
            .copied()
            .unwrap_or("no details");
        summary.push(first.chars().take(200).collect());
    }
    cap_lines(dedup(summary))
}

fn dedup(lines: Vec<String>) -> Vec<String> {
    let mut seen = HashSet::new();
    lines
        .into_iter()
        .filter(|l| seen.insert(l.clone()))
        .collect()
}

fn cap_lines(mut lines: Vec<String>) -> Vec<String> {
    if lines.len() > MAX_ABI_LINES {
        let rest = lines.len() - MAX_ABI_LINES;
        lines.truncate(MAX_ABI_LINES);
        lines.push(format!("... and {rest} more"));
    }
    lines
}

impl fmt::Display for PlannerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} (describer {}, specificity {}) {}",
            self.id,
            self.version,
            self.describer_id,
            self.specificity,
            self.path.display()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugin_dirs_prefers_env_then_config_then_exe_dir() {
        let exe = Path::new("/opt/kvferry/bin/kvferry");
        let config = &[PathBuf::from("/etc/kvferry/plugins")];
        assert_eq!(
            plugin_dirs_from(Some(OsStr::new("/a:/b")), config, Some(exe)),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert_eq!(
            plugin_dirs_from(Some(OsStr::new("/a::/b:")), &[], None),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert_eq!(
            plugin_dirs_from(Some(OsStr::new("")), config, Some(exe)),
            config.to_vec()
        );
        assert_eq!(
            plugin_dirs_from(Some(OsStr::new(":")), &[], Some(exe)),
            vec![PathBuf::from("/opt/kvferry/bin")]
        );
        assert_eq!(
            plugin_dirs_from(None, &[], Some(exe)),
            vec![PathBuf::from("/opt/kvferry/bin")]
        );
        assert!(plugin_dirs_from(None, &[], None).is_empty());
    }

    #[test]
    fn an_installed_command_also_finds_the_installed_planners() {
        let prefix = tempfile::tempdir().unwrap();
        let exe = prefix.path().join("bin/kvferry");
        std::fs::create_dir_all(prefix.path().join(INSTALLED_PLANNERS)).unwrap();
        assert_eq!(
            plugin_dirs_from(None, &[], Some(&exe)),
            vec![
                prefix.path().join("bin"),
                prefix.path().join(INSTALLED_PLANNERS)
            ]
        );
    }

    #[test]
    fn planner_id_precedence() {
        assert_eq!(select_planner_id(Some("f"), Some("e"), Some("c")), "f");
        assert_eq!(select_planner_id(None, Some("e"), Some("c")), "e");
        assert_eq!(select_planner_id(Some(""), Some(" "), Some("c")), "c");
        assert_eq!(select_planner_id(None, None, None), DEFAULT_PLANNER_ID);
    }

    #[test]
    fn abi_report_is_reduced_to_error_lines() {
        let mut report = String::from("Layout of expected type:\n    huge\n\n");
        for _ in 0..3 {
            report.push_str("\nError:incompatible type size\nExpected:\n    48\nFound:\n    56\n");
        }
        report.push_str("\nError:too many fields\nExpected:\n    3\nFound:\n    4\n");
        report.push_str("\nError:mismatched package\n");
        let summary = summarize_abi_report(&report);
        assert_eq!(
            summary,
            vec![
                "incompatible type size (expected 48, found 56)",
                "too many fields (expected 3, found 4)",
                "mismatched package",
            ]
        );
        let many: String = (0..25)
            .map(|i| format!("\nError:problem {i}\nExpected:\n    a\nFound:\n    b\n"))
            .collect();
        let summary = summarize_abi_report(&many);
        assert_eq!(summary.len(), MAX_ABI_LINES + 1);
        assert_eq!(summary.last().unwrap(), "... and 15 more");
    }

    #[test]
    fn unknown_planner_lists_known_ids_and_points_at_skipped_files() {
        let error = BindError::UnknownPlanner {
            id: "acme.x".into(),
            known: vec![
                "kvferry.default".into(),
                "kvferry.deepseek_mla_latent".into(),
            ],
            dirs: vec![PathBuf::from("/plugins")],
            skipped: 2,
        };
        assert_eq!(
            error.to_string(),
            "no planner `acme.x`: known planners are kvferry.default, \
             kvferry.deepseek_mla_latent (searched /plugins); 2 files were skipped, see \
             `kvferry planners --all`"
        );
    }
}
