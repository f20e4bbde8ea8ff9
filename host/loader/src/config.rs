//! Configuration: a TOML file (`--config`, else `KVFERRY_CONFIG`), overridden by the
//! environment (`KVFERRY_PLANNER`, `KVFERRY_PLUGIN_DIR`), overridden by command-line flags
//! (see [`crate::select_planner_id`] and [`crate::plugin_dirs`]).
//!
//! ```toml
//! planner = "kvferry.deepseek_mla_latent"   # default: kvferry.default
//! plugin_dir = "/opt/kvferry/planners"      # default: the kvferry executable's directory
//! ```

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The environment variable naming the config file. The planner and plugin-directory
/// variables belong to the crate root ([`crate::plugin_dirs`]), which reads them.
pub const CONFIG_ENV: &str = "KVFERRY_CONFIG";

/// The config file's contents. Unknown keys are refused, so a typo does not silently fall
/// back to a default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Planner id to bind.
    pub planner: Option<String>,
    /// Directory to load planners from.
    pub plugin_dir: Option<PathBuf>,
}

/// Why the config file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML for [`Config`].
    #[error("invalid config file {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said, with line and column.
        #[source]
        source: toml::de::Error,
    },
}

impl Config {
    /// Reads and parses a config file. A relative `plugin_dir` is taken relative to the
    /// file's directory.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Read`] or [`ConfigError::Parse`], naming the file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut config = toml::from_str::<Self>(&text).map_err(|source| ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        if let Some(dir) = &config.plugin_dir {
            if dir.is_relative() {
                let base = path.parent().unwrap_or(Path::new("."));
                config.plugin_dir = Some(base.join(dir));
            }
        }
        Ok(config)
    }

    /// Parses config text.
    ///
    /// # Errors
    ///
    /// The parser's message.
    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())
    }

    /// Loads the file named by `flag`, else by `env` (the value of [`CONFIG_ENV`]), else
    /// returns the empty config.
    ///
    /// # Errors
    ///
    /// As [`Config::load`].
    pub fn discover(flag: Option<&Path>, env: Option<&str>) -> Result<Self, ConfigError> {
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
        let c = Config::parse("planner = \"x.y\"\nplugin_dir = \"/p\"\n").unwrap();
        assert_eq!(c.planner.as_deref(), Some("x.y"));
        assert_eq!(c.plugin_dir.as_deref(), Some(Path::new("/p")));
    }

    #[test]
    fn refuses_unknown_keys_naming_them() {
        let err = Config::parse("planer = \"x\"").unwrap_err();
        assert!(err.contains("unknown field `planer`"), "{err}");
    }

    #[test]
    fn relative_plugin_dir_is_relative_to_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvferry.toml");
        std::fs::write(&path, "plugin_dir = \"plugins\"").unwrap();
        let c = Config::load(&path).unwrap();
        assert_eq!(c.plugin_dir.unwrap(), dir.path().join("plugins"));
    }

    #[test]
    fn a_parse_error_names_the_file_and_keeps_the_parser_error_as_source() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvferry.toml");
        std::fs::write(&path, "planer = \"x\"").unwrap();
        let err = Config::load(&path).unwrap_err();
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
        let err = Config::discover(None, Some("/nonexistent/kvferry.toml")).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/kvferry.toml"),
            "{err}"
        );
        assert_eq!(Config::discover(None, None).unwrap(), Config::default());
    }
}
