//! What the `kvferry` CLI's integration tests share: the one way they run the binary
//! ([`Kvferry`]) and, in [`transfer`], the `kvferry serve` children and the controller of
//! the two-process transfer tests. Each test binary uses a different subset, hence the
//! `dead_code` allowance.
#![allow(dead_code)]

pub mod transfer;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// The `RUST_LOG` of runs whose log is not under test: warnings only.
pub const QUIET: &str = "kvferry=warn,warn";

/// The deployment secret every server a test starts holds (unless the test sets another).
pub const SECRET: &str = "the tests' deployment secret, 48 bytes long....";

/// A run of this build's `kvferry` binary with no planner configuration from the
/// environment (`KVFERRY_PLUGIN_DIR`, `KVFERRY_PLANNER`, `KVFERRY_CONFIG` and `KVFERRY_LOG`
/// removed), the tests' deployment secret ([`SECRET`]) and the test's own `RUST_LOG`; the builder methods
/// add what a test needs.
#[derive(Debug)]
pub struct Kvferry {
    cmd: Command,
}

impl Default for Kvferry {
    fn default() -> Self {
        Self::new()
    }
}

impl Kvferry {
    pub fn new() -> Kvferry {
        let mut cmd = Command::new(kvferry_exe());
        cmd.env_remove("KVFERRY_PLUGIN_DIR")
            .env_remove("KVFERRY_PLANNER")
            .env_remove("KVFERRY_CONFIG")
            .env_remove("KVFERRY_LOG")
            .env("KVFERRY_SECRET", SECRET);
        Kvferry { cmd }
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.cmd.arg(arg);
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.cmd.args(args);
        self
    }

    pub fn env(mut self, key: &str, value: impl AsRef<OsStr>) -> Self {
        self.cmd.env(key, value);
        self
    }

    pub fn env_remove(mut self, key: &str) -> Self {
        self.cmd.env_remove(key);
        self
    }

    /// Loads planners from `dir` alone (`KVFERRY_PLUGIN_DIR`).
    pub fn plugin_dir(self, dir: &Path) -> Self {
        self.env("KVFERRY_PLUGIN_DIR", dir)
    }

    /// Selects the planner through the environment (`KVFERRY_PLANNER`).
    pub fn planner(self, id: &str) -> Self {
        self.env("KVFERRY_PLANNER", id)
    }

    /// Reads the config file `file` (`KVFERRY_CONFIG`).
    pub fn config(self, file: &Path) -> Self {
        self.env("KVFERRY_CONFIG", file)
    }

    /// Logs what `filter` (a `RUST_LOG` value) selects.
    pub fn log(self, filter: &str) -> Self {
        self.env("RUST_LOG", filter)
    }

    /// Logs warnings only ([`QUIET`]).
    pub fn quiet(self) -> Self {
        self.log(QUIET)
    }

    /// The command, to spawn it.
    pub fn command(self) -> Command {
        self.cmd
    }

    /// Runs it to its end (stdin empty) and returns what it printed.
    pub fn output(mut self) -> Output {
        let run = self.describe();
        self.cmd
            .output()
            .unwrap_or_else(|e| panic!("cannot run {run}: {e}"))
    }

    /// Runs it, fails the test (showing both streams) unless it succeeds, and returns its
    /// standard output.
    pub fn stdout(self) -> String {
        let run = self.describe();
        let out = self.output();
        let (stdout, stderr) = text(&out);
        assert!(
            out.status.success(),
            "{run} failed ({}):\n{stdout}\n{stderr}",
            out.status
        );
        stdout
    }

    /// Runs it, fails the test (showing both streams) unless it fails, and returns its
    /// standard error.
    pub fn stderr_of_failure(self) -> String {
        let run = self.describe();
        let out = self.output();
        let (stdout, stderr) = text(&out);
        assert!(
            !out.status.success(),
            "{run} succeeded, and should not have:\n{stdout}\n{stderr}"
        );
        stderr
    }

    /// [`stdout`](Self::stdout), parsed as one JSON value.
    pub fn json(self) -> Value {
        let run = self.describe();
        let stdout = self.stdout();
        serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("{run} printed no JSON ({e}):\n{stdout}"))
    }

    /// `kvferry ARGS`, for messages.
    fn describe(&self) -> String {
        let args: Vec<_> = self.cmd.get_args().map(OsStr::to_string_lossy).collect();
        format!("kvferry {}", args.join(" "))
    }
}

/// The path of a Hugging Face config among the testkit's fixtures.
pub fn hf_config(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testkit/tests/fixtures/hf")
        .join(name)
        .display()
        .to_string()
}

/// Standard output and standard error of `out`, as text.
pub fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Names the `kvferry` binary the tests run instead of this build's: a bundle from
/// `scripts/gpu-check --bundle` runs its test binaries on a machine without this checkout.
pub const EXE_ENV: &str = "KVFERRY_TEST_EXE";

/// The `kvferry` binary under test: [`EXE_ENV`] if set, else the one cargo built with the tests.
pub fn kvferry_exe() -> PathBuf {
    std::env::var_os(EXE_ENV)
        .filter(|p| !p.is_empty())
        .map_or_else(
            || PathBuf::from(env!("CARGO_BIN_EXE_kvferry")),
            PathBuf::from,
        )
}

/// The directory of the `kvferry` binary, where cargo puts the in-tree planners.
pub fn build_dir() -> PathBuf {
    kvferry_exe().parent().unwrap().to_path_buf()
}
