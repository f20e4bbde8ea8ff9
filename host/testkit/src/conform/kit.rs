//! The kit the conformance tests share: a planner under test, building one out of tree,
//! plugin folders, named cases, fragments in canonical form.
//!
//! A planner under test is a [`PlannerUnderTest`]: a root module, either linked statically
//! (`my_planner::planner_module()`) or loaded from its `.so` ([`PlannerUnderTest::loaded`]). Cases name
//! themselves, so a failure in a matrix can be rerun alone with `KVFERRY_CASE=<name>`.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error_chain;
use crate::scenario::{Scenario, ScenarioReport};
use kvferry_loader::{BindError, BoundPlanner, Registry};
use kvferry_planner_abi::{
    Deployment, ErrorKind, Mapping, PlanError, RankInfo, TransferPlanner, host::PlannerModuleRef,
};

/// The environment variable that restricts a case matrix to the cases whose name contains it.
pub const CASE_FILTER_ENV: &str = "KVFERRY_CASE";

/// A planner as the tests drive it.
#[derive(Clone, Debug)]
pub struct PlannerUnderTest {
    registry: Arc<Registry>,
    id: String,
    /// One bind per deployment: a matrix asks about the same few dozen deployments hundreds
    /// of times, and each bind crosses the plugin boundary and logs which planner it bound.
    bindings: Arc<Mutex<HashMap<String, Result<BoundPlanner, String>>>>,
}

impl PlannerUnderTest {
    fn new(registry: Arc<Registry>, id: String) -> Self {
        Self {
            registry,
            id,
            bindings: Arc::default(),
        }
    }

    /// A statically linked planner.
    pub fn linked(module: PlannerModuleRef) -> Self {
        let id = module.id();
        let registry = Registry::from_modules([(module, format!("linked {id}"))]);
        Self::new(Arc::new(registry), id)
    }

    /// The planner `id` from the plugin libraries in `dir`.
    ///
    /// # Panics
    ///
    /// When `dir` holds no planner with that id (a test set-up error).
    pub fn loaded(dir: &Path, id: &str) -> Self {
        let registry = Registry::scan(&[dir.to_path_buf()]);
        assert!(
            registry.planner(id).is_some(),
            "no planner {id} in {} (skipped: {:?})",
            dir.display(),
            registry.skipped()
        );
        Self::new(Arc::new(registry), id.to_string())
    }

    /// Planner `id` of an existing registry (`kvferry conform --planner ID`).
    ///
    /// # Errors
    ///
    /// No loaded planner has that id: the error lists the known ones.
    pub fn from_registry(registry: Arc<Registry>, id: &str) -> Result<Self, String> {
        if registry.planner(id).is_none() {
            let known: Vec<&str> = registry.planners().iter().map(|p| p.id.as_str()).collect();
            return Err(format!(
                "no planner `{id}` on the plugin path (known: {})",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ));
        }
        Ok(Self::new(registry, id.to_string()))
    }

    /// The planner in one library file (`kvferry conform PATH`), loaded with every check the
    /// host makes.
    ///
    /// # Errors
    ///
    /// The file could not be loaded (the loader's reason), or holds no planner.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let registry = Registry::scan_files(&[path.to_path_buf()]);
        if let Some(skipped) = registry.skipped().first() {
            return Err(error_chain(&skipped.reason));
        }
        let id = registry
            .planners()
            .first()
            .map(|p| p.id.clone())
            .ok_or_else(|| format!("{}: no planner loaded", path.display()))?;
        Ok(Self::new(Arc::new(registry), id))
    }

    /// Where the planner comes from (its file, or the label of a linked one).
    pub fn source(&self) -> PathBuf {
        self.registry
            .planner(&self.id)
            .map(|p| p.path.clone())
            .unwrap_or_default()
    }

    /// Asks the planner whether it supports `deployment`, as a host's bind would.
    ///
    /// # Errors
    ///
    /// The planner's error: `UNSUPPORTED` with its reason, `PANICKED`, ...
    pub fn check_deployment(&self, deployment: &Deployment) -> Result<(), PlanError> {
        match self.registry.bind(&self.id, deployment) {
            Ok(_) => Ok(()),
            Err(BindError::Unsupported { error, .. }) => Err(*error),
            Err(other) => Err(PlanError::unsupported(error_chain(&other))),
        }
    }

    /// The planner id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Binds the planner for a deployment of `architecture`.
    ///
    /// # Errors
    ///
    /// The registry's refusal with its causes, as text.
    pub fn bind(&self, architecture: &str, mapping: Mapping) -> Result<BoundPlanner, String> {
        let deployment = Deployment {
            architecture: architecture.into(),
            mapping,
        };
        let mut bindings = self
            .bindings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        bindings
            .entry(deployment.to_string())
            .or_insert_with(|| {
                self.registry
                    .bind(&self.id, &deployment)
                    .map_err(|e| error_chain(&e))
            })
            .clone()
    }

    /// Runs `scenario` with this planner on both sides.
    ///
    /// # Errors
    ///
    /// A bind refusal or any scenario error, as text naming the side.
    pub fn run(&self, scenario: &Scenario) -> Result<ScenarioReport, String> {
        self.run_scenario(scenario).0
    }

    /// [`run`](Self::run), also returning the kind of the planner error that stopped the
    /// scenario, if one did (a refusal is `UNSUPPORTED` or `PEER_INCOMPATIBLE`).
    pub fn run_scenario(
        &self,
        scenario: &Scenario,
    ) -> (Result<ScenarioReport, String>, Option<ErrorKind>) {
        let arch = scenario.model.architecture();
        let ctx = match self.bind(arch, scenario.ctx_mapping) {
            Ok(b) => b,
            Err(e) => return (Err(format!("context: {e}")), Some(ErrorKind::UNSUPPORTED)),
        };
        let decode = match self.bind(arch, scenario.gen_mapping) {
            Ok(b) => b,
            Err(e) => {
                return (
                    Err(format!("generation: {e}")),
                    Some(ErrorKind::UNSUPPORTED),
                );
            }
        };
        let ctx_factory =
            |r: &RankInfo| -> Result<Arc<dyn TransferPlanner>, PlanError> { ctx.instantiate(r) };
        let gen_factory =
            |r: &RankInfo| -> Result<Arc<dyn TransferPlanner>, PlanError> { decode.instantiate(r) };
        let mut scenario = scenario.clone();
        scenario.planner_id = self.id.clone();
        match scenario.run(&ctx_factory, &gen_factory) {
            Ok(report) => (Ok(report), None),
            Err(e) => {
                let kind = e.planner_error_kind();
                (Err(error_chain(&e)), kind)
            }
        }
    }
}

/// The directory cargo writes the workspace's `.so` files to, found from the running test
/// executable (`target/<profile>/deps/<test>` → `target/<profile>`).
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let deps = exe.parent().expect("the executable's directory");
    deps.parent().unwrap_or(deps).to_path_buf()
}

/// The kvferry repository this testkit was built from (`host/testkit/../..`), for tests that
/// build the out-of-tree workspaces in it.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("host/testkit sits two levels below the repository root")
        .to_path_buf()
}

/// The target folder of every out-of-tree workspace's build, relative to the repository root
/// (`scripts/test` and `.ci/run` build the planner template's own tests and lints there too).
pub const OUT_OF_TREE_TARGET: &str = "target/out-of-tree/shared";

/// The profile setting every out-of-tree build shares, as an environment variable: the
/// fixtures' workspaces build without debug info and the template's would with it, which
/// would compile their common dependencies twice.
pub const OUT_OF_TREE_PROFILE: (&str, &str) = ("CARGO_PROFILE_DEV_DEBUG", "false");

/// Builds a cargo workspace that is not part of this one (the planner template, the loading
/// fault fixtures: `dir` relative to [`repo_root`]) in the debug profile and returns the
/// folder holding its `.so` files.
///
/// Every such workspace builds into one folder, [`OUT_OF_TREE_TARGET`] beside this build,
/// with the same profile ([`OUT_OF_TREE_PROFILE`]), so the dependencies they share (abi_stable
/// and its tree, at the versions their lockfiles agree on) compile once for all of them; the
/// libraries they build have distinct names. Each uses its committed `Cargo.lock` with
/// `--locked`, so nothing is written into the source tree and no crate version is resolved
/// anew. Call it once per test binary (behind a `OnceLock`): concurrent callers serialise on
/// cargo's own lock of the target folder.
///
/// # Panics
///
/// When cargo cannot run or the build fails (a test set-up error).
pub fn build_out_of_tree(dir: &str) -> PathBuf {
    let manifest = repo_root().join(dir).join("Cargo.toml");
    let target = build_dir()
        .parent()
        .map_or_else(build_dir, Path::to_path_buf)
        .join(
            OUT_OF_TREE_TARGET
                .strip_prefix("target/")
                .unwrap_or(OUT_OF_TREE_TARGET),
        );
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let (profile_var, profile_value) = OUT_OF_TREE_PROFILE;
    let status = std::process::Command::new(cargo)
        .env(profile_var, profile_value)
        .arg("build")
        .arg("--locked")
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target)
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET_DIR")
        .status()
        .unwrap_or_else(|e| panic!("run cargo to build {}: {e}", manifest.display()));
    assert!(
        status.success(),
        "building {} failed: {status} (if cargo says its Cargo.lock needs updating, a \
         dependency of the workspace changed: refresh the lock with `cargo metadata \
         --format-version 1 --manifest-path {} >/dev/null` and commit it)",
        manifest.display(),
        manifest.display()
    );
    target.join("debug")
}

/// A temporary plugin directory holding only the named planner libraries from
/// [`build_dir`], so a scan loads nothing else (cargo's `deps/` also holds proc-macro
/// libraries).
///
/// # Panics
///
/// When a library is missing: build the workspace first (`cargo build --workspace`).
pub fn plugin_dir_with(libraries: &[&str]) -> tempdir::TempPlugins {
    tempdir::TempPlugins::new(&build_dir(), libraries)
}

/// A self-deleting plugin directory.
pub mod tempdir {
    use std::path::{Path, PathBuf};

    /// A directory under the system temp dir, removed on drop.
    #[derive(Debug)]
    pub struct TempPlugins {
        path: PathBuf,
    }

    impl TempPlugins {
        pub(crate) fn new(from: &Path, libraries: &[&str]) -> Self {
            use std::sync::atomic::{AtomicU64, Ordering};
            static NEXT: AtomicU64 = AtomicU64::new(0);
            let path = std::env::temp_dir().join(format!(
                "kvferry-plugins-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&path).expect("create a temporary plugin directory");
            for lib in libraries {
                // Cargo uplifts a cdylib next to the binaries when it builds it as a root
                // unit, and leaves it in `deps/` when it built it only as a dependency.
                let src = [from.join(lib), from.join("deps").join(lib)]
                    .into_iter()
                    .find(|p| p.is_file())
                    .unwrap_or_else(|| {
                        panic!(
                            "{} is missing: run `cargo build --workspace` first",
                            from.join(lib).display()
                        )
                    });
                std::fs::copy(&src, path.join(lib)).expect("copy a planner library");
            }
            Self { path }
        }

        /// The directory.
        pub fn path(&self) -> &Path {
            &self.path
        }
    }

    impl Drop for TempPlugins {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// One named request of a case matrix.
#[derive(Clone, Debug)]
pub struct Case {
    /// A name that identifies the case (model, topologies, request shape, seed).
    pub name: String,
    /// The request.
    pub scenario: Scenario,
    /// The field a refusal of this case names when the semantics rule it out (e.g.
    /// `tokens_per_block` for block sizes that do not divide); `None` for a case every
    /// planner should run. A refusal of such a case is expected; a planner that accepts it
    /// must still move every byte right.
    pub expected_refusal: Option<String>,
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// Whether `case` passes the [`CASE_FILTER_ENV`] filter.
pub fn selected(case: &Case) -> bool {
    std::env::var(CASE_FILTER_ENV).map_or(true, |f| case.name.contains(&f))
}

/// Canonical form of a set of fragments: sorted by destination, with fragments that continue
/// each other on both sides merged. Two plans that move exactly the same bytes from exactly
/// the same places have the same canonical form, however they were cut.
pub fn canonical(fragments: impl IntoIterator<Item = (u64, u64, u64)>) -> Vec<(u64, u64, u64)> {
    let mut v: Vec<(u64, u64, u64)> = fragments.into_iter().filter(|f| f.2 > 0).collect();
    v.sort_by_key(|&(s, d, _)| (d, s));
    let mut out: Vec<(u64, u64, u64)> = Vec::with_capacity(v.len());
    for (s, d, l) in v {
        if let Some(last) = out.last_mut() {
            if last.1 + last.2 == d && last.0 + last.2 == s {
                last.2 += l;
                continue;
            }
        }
        out.push((s, d, l));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::canonical;

    #[test]
    fn canonical_merges_only_what_continues_on_both_sides() {
        let a = canonical([(100, 1000, 10), (110, 1010, 5), (200, 1015, 5)]);
        assert_eq!(a, vec![(100, 1000, 15), (200, 1015, 5)]);
        let b = canonical([(200, 1015, 5), (100, 1000, 15)]);
        assert_eq!(a, b);
        assert_ne!(a, canonical([(100, 1000, 15), (201, 1015, 5)]));
    }
}
