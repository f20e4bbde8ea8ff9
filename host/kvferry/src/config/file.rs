//! The command line's configuration file (`kvferry --config FILE`, else `KVFERRY_CONFIG`):
//! the planner to bind and where planners load from, overridden by the environment
//! (`KVFERRY_PLANNER`, `KVFERRY_PLUGIN_DIR`), overridden by command-line flags (see
//! [`kvferry_loader::select_planner_id`] and [`kvferry_loader::plugin_dirs`]).
//!
//! The file is either those two keys alone, or an agent's whole configuration (the one
//! [`super::load`] reads, `version` and all), so an operator can point `kvferry check` at the
//! very file the engines read; JSON or TOML either way.
//!
//! ```toml
//! planner = "kvferry.deepseek_mla_latent"   # default: kvferry.default
//! plugin_dir = "/opt/kvferry/planners"      # default: the kvferry executable's directory
//! ```

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The environment variable naming the command line's configuration file.
pub const CONFIG_ENV: &str = "KVFERRY_CONFIG";

/// What the command line takes from its configuration file. Unknown keys are refused, so a
/// typo does not silently fall back to a default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileConfig {
    /// Planner id to bind.
    pub planner: Option<String>,
    /// Directories to load planners from, in order (relative ones are taken relative to the
    /// file's folder).
    pub plugin_dirs: Vec<PathBuf>,
    /// When the file is an agent's whole configuration: its other top-level keys, sorted
    /// (`transport`, `instance`, ...), which the command line does not take from it — a
    /// command that would otherwise run without them refuses them by name.
    pub unread: Vec<String>,
}

/// The two keys alone.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Keys {
    planner: Option<String>,
    plugin_dir: Option<super::PlannerDirs>,
}

/// Why the configuration file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a configuration.
    #[error("invalid config file {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong, with the field (and the TOML parser's line and column).
        #[source]
        source: super::ConfigError,
    },
}

impl FileConfig {
    /// Reads and parses a configuration file. A relative plugin directory is taken relative
    /// to the file's folder.
    ///
    /// # Errors
    ///
    /// [`FileConfigError::Read`] or [`FileConfigError::Parse`], naming the file.
    pub fn load(path: &Path) -> Result<Self, FileConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| FileConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut config = Self::parse(&text).map_err(|source| FileConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        for dir in config.plugin_dirs.iter_mut().filter(|d| d.is_relative()) {
            *dir = base.join(&*dir);
        }
        Ok(config)
    }

    /// Parses configuration text: the two keys alone, or (with a `version`) an agent's whole
    /// configuration, read as strictly as [`super::load`] reads it.
    ///
    /// # Errors
    ///
    /// What is wrong, naming the field.
    pub fn parse(text: &str) -> Result<Self, super::ConfigError> {
        let value = super::value_of(text)?;
        let (planner, dirs, unread) = if value.get("version").is_some() {
            let c = super::read(text)?;
            let mut unread: Vec<String> = value
                .as_object()
                .map(|o| o.keys().cloned().collect())
                .unwrap_or_default();
            unread.retain(|k| !matches!(k.as_str(), "version" | "planner" | "plugin_dir"));
            unread.sort();
            (c.planner, c.plugin_dir, unread)
        } else {
            let keys: Keys = serde_json::from_value(value)
                .map_err(|e| super::ConfigError::Invalid(format!("config: {e}")))?;
            (keys.planner, keys.plugin_dir, Vec::new())
        };
        Ok(Self {
            planner: planner.filter(|p| !p.trim().is_empty()),
            plugin_dirs: dirs.map(super::PlannerDirs::into_vec).unwrap_or_default(),
            unread,
        })
    }

    /// Loads the file named by `flag`, else by `env` (the value of [`CONFIG_ENV`]), else
    /// returns the empty configuration.
    ///
    /// # Errors
    ///
    /// As [`FileConfig::load`].
    pub fn discover(flag: Option<&Path>, env: Option<&str>) -> Result<Self, FileConfigError> {
        match flag
            .map(Path::to_path_buf)
            .or_else(|| env.filter(|v| !v.is_empty()).map(PathBuf::from))
        {
            Some(path) => Self::load(&path),
            None => Ok(Self::default()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_keys() {
        let c = FileConfig::parse("planner = \"x.y\"\nplugin_dir = \"/p\"\n").unwrap();
        assert_eq!(c.planner.as_deref(), Some("x.y"));
        assert_eq!(c.plugin_dirs, vec![PathBuf::from("/p")]);
    }

    #[test]
    fn refuses_unknown_keys_naming_them() {
        let err = FileConfig::parse("planer = \"x\"").unwrap_err().to_string();
        assert!(err.contains("unknown field `planer`"), "{err}");
    }

    #[test]
    fn an_agents_whole_configuration_serves_too() {
        let agent =
            super::super::tests::minimal(r#", "planner": "auto", "plugin_dir": ["/a", "b"]"#);
        let c = FileConfig::parse(&agent).unwrap();
        assert_eq!(c.planner.as_deref(), Some("auto"));
        assert_eq!(c.plugin_dirs, vec![PathBuf::from("/a"), PathBuf::from("b")]);
        // What the command line does not take from it, for a command to refuse by name.
        assert_eq!(
            c.unread,
            ["architecture", "instance", "rank", "role", "secret"]
        );
        assert!(
            FileConfig::parse("planner = \"x.y\"")
                .unwrap()
                .unread
                .is_empty()
        );
        // Read as strictly as an agent reads it.
        let typo = super::super::tests::minimal(r#", "planer": "auto""#);
        let err = FileConfig::parse(&typo).unwrap_err().to_string();
        assert!(err.contains("unknown field `planer`"), "{err}");
        let v2 = agent.replacen("\"version\": 1", "\"version\": 2", 1);
        let err = FileConfig::parse(&v2).unwrap_err().to_string();
        assert!(err.contains("version 2 is not supported"), "{err}");
    }

    #[test]
    fn relative_plugin_dir_is_relative_to_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvferry.toml");
        std::fs::write(&path, "plugin_dir = \"plugins\"").unwrap();
        let c = FileConfig::load(&path).unwrap();
        assert_eq!(c.plugin_dirs, vec![dir.path().join("plugins")]);
    }

    #[test]
    fn a_parse_error_names_the_file_and_keeps_the_parser_error_as_source() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvferry.toml");
        std::fs::write(&path, "planer = \"x\"").unwrap();
        let err = FileConfig::load(&path).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("invalid config file {}", path.display())
        );
        let source = std::error::Error::source(&err).expect("the parser's error");
        assert!(
            source.to_string().contains("unknown field `planer`"),
            "{source}"
        );
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = FileConfig::discover(None, Some("/nonexistent/kvferry.toml")).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/kvferry.toml"),
            "{err}"
        );
        assert_eq!(
            FileConfig::discover(None, None).unwrap(),
            FileConfig::default()
        );
    }
}
