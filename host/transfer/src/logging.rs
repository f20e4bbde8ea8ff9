//! One logging story for every way kvferry runs: the CLI, the C library, the Python package and
//! the example engines all choose what to log the same way.
//!
//! - `KVFERRY_LOG` (the `RUST_LOG` directive syntax: `info`, `kvferry_transfer=debug,warn`)
//!   chooses; `RUST_LOG` is honoured when `KVFERRY_LOG` is not set; otherwise each entry point
//!   has its default (the CLI `kvferry=info,warn`, the C library and the engines `warn`, Python
//!   the level of its `kvferry` logger).
//! - Records go to standard error, with colour only when standard error is a terminal (never
//!   into a pipe or a log file). The Python package sends them through Python's `logging`
//!   instead ([`filter`] is its half of this).
//! - A directive that does not parse is reported once, as a warning naming it, and the default
//!   applies: a typo in an environment variable never stops an engine.

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// The environment variable that chooses what kvferry logs.
pub const ENV: &str = "KVFERRY_LOG";

/// The directives the environment chose: `KVFERRY_LOG` when set and not empty, else
/// `RUST_LOG` when set and not empty, with the variable's name.
pub fn from_env() -> Option<(&'static str, String)> {
    [ENV, "RUST_LOG"].into_iter().find_map(|name| {
        std::env::var(name)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .map(|v| (name, v))
    })
}

/// The filter to log with: the environment's directives ([`from_env`]) or `default`, and, when
/// the environment's did not parse, the warning to log once the logger is installed.
///
/// # Panics
///
/// When `default` itself does not parse (a programming error in the caller).
pub fn filter(default: &str) -> (EnvFilter, Option<String>) {
    choose(from_env(), default)
}

fn choose(chosen: Option<(&str, String)>, default: &str) -> (EnvFilter, Option<String>) {
    let fallback = || EnvFilter::try_new(default).expect("the built-in log filter parses");
    match chosen {
        None => (fallback(), None),
        Some((name, directives)) => match EnvFilter::try_new(&directives) {
            Ok(filter) => (filter, None),
            Err(e) => (
                fallback(),
                Some(format!(
                    "{name}={directives:?} is not a log filter ({e}); logging `{default}`"
                )),
            ),
        },
    }
}

/// Installs the process's logger to standard error with [`filter`]`(default)`, colour only on
/// a terminal. Returns false, changing nothing, when the process already has one (an engine
/// that installed its own keeps it).
pub fn init_stderr(default: &str) -> bool {
    let (filter, warning) = filter(default);
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init()
        .is_ok();
    if let (true, Some(warning)) = (installed, warning) {
        tracing::warn!("{warning}");
    }
    installed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_chooses_and_a_bad_filter_falls_back_by_name() {
        let (f, warning) = choose(Some((ENV, "kvferry_transfer=debug".into())), "warn");
        assert!(warning.is_none());
        assert_eq!(f.to_string(), "kvferry_transfer=debug");

        let (f, warning) = choose(None, "kvferry=info,warn");
        assert!(warning.is_none());
        assert!(f.to_string().contains("kvferry=info"), "{f}");

        let (f, warning) = choose(Some(("RUST_LOG", "kvferry=loud".into())), "warn");
        assert_eq!(f.to_string(), "warn");
        let warning = warning.expect("a warning for the bad filter");
        assert!(
            warning.starts_with("RUST_LOG=\"kvferry=loud\" is not a log filter"),
            "{warning}"
        );
        assert!(warning.ends_with("logging `warn`"), "{warning}");
    }
}
