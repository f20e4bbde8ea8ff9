//! The agent's configuration: one object, versioned, read strictly — what the C API's
//! `kvferry_agent_start`, Python's `kvferry.Agent`, the examples and a Rust engine read alike.
//! It is JSON (text whose first character, after white space, is `{`) or TOML (anything
//! else): the same fields either way, `[rank]` and `[[rank.page_table.pools]]` being TOML's
//! spelling of the nested objects. [`load_file`] reads a file, resolving a relative
//! `plugin_dir` against the file's folder.
//!
//! Fields a configuration leaves out fall back to the environment, so one file can serve
//! every host of a deployment and each host set what is its own: [`ENV_TRANSPORT`],
//! [`ENV_NET_DEVICES`], [`ENV_ADVERTISE`], the secret from `KVFERRY_SECRET` (kept out of
//! files and command lines) and `KVFERRY_PLANNER` / `KVFERRY_PLUGIN_DIR` (see
//! [`crate::registry`]). A field the configuration gives always wins, as the CLI's flags do.
//!
//! The planner ABI's types ([`RankInfo`], [`PageTable`], ...) derive serde, but for bincode
//! between hosts: their code sets (`MemoryType`, `GroupKind`, `LayoutKind`) serialise as bare
//! integers and unknown fields pass silently. An engine writes this JSON by hand, so kvferry
//! reads its own mirror of them instead: names for every code (`"dram"`, `"paged"`, `"hnd"`),
//! defaults for what most views leave at one value, and `deny_unknown_fields` everywhere, so a
//! typo is an error naming the field rather than a silent default. The C API's README
//! (`host/capi/README.md`) lists every field.

use std::path::{Path, PathBuf};

mod file;
pub use file::{CONFIG_ENV, FileConfig, FileConfigError};
use std::str::FromStr;
use std::time::Duration;

use kvferry_loader::{BoundPlanner, Registry};
use kvferry_planner_abi::ffi::{RString, RVec};
use kvferry_planner_abi::{
    BufferEntry, Deployment, GroupKind, LayerGroup, LayoutKind, LocalLayer, Mapping, MemoryType,
    PageTable, PhysicalPool, PoolView, RankInfo, RoleLayout,
};
use kvferry_transfer::agent::{AgentConfig, BounceMode, SECRET_ENV, Secret};
use kvferry_transfer::{Role, TransportSpec};
use serde::Deserialize;

/// The transport of a configuration without `transport` (`shm`, `tcp`, `auto` or a UCX_TLS
/// list).
pub const ENV_TRANSPORT: &str = "KVFERRY_TRANSPORT";
/// The network devices of a configuration without `net_devices` (UCX_NET_DEVICES syntax).
pub const ENV_NET_DEVICES: &str = "KVFERRY_NET_DEVICES";
/// The address a prefill rank advertises when its configuration has no `advertise`.
pub const ENV_ADVERTISE: &str = "KVFERRY_ADVERTISE";

/// The configuration version this library reads (`"version": 1`).
const CONFIG_VERSION: u64 = crate::CONFIG_VERSION as u64;

/// Why a configuration was refused, and which status the C caller gets for it.
#[derive(Debug)]
pub enum ConfigError {
    /// The text is not a configuration this library reads.
    Invalid(String),
    /// No planner could be bound (unknown id, refused deployment, nothing loaded).
    Planner(String),
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigError::Invalid(m) | ConfigError::Planner(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    fn invalid(message: impl Into<String>) -> Self {
        Self::Invalid(message.into())
    }
}

/// Version 1 of the configuration.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigV1 {
    version: u64,
    instance: String,
    role: String,
    #[serde(default)]
    label: String,
    architecture: String,
    planner: Option<String>,
    plugin_dir: Option<PlannerDirs>,
    rank: RankJson,
    transport: Option<String>,
    net_devices: Option<String>,
    #[serde(default)]
    ucx_peer_errors: bool,
    listen: Option<String>,
    advertise: Option<String>,
    secret: Option<String>,
    secret_hex: Option<String>,
    previous_secret: Option<String>,
    previous_secret_hex: Option<String>,
    timeout_ms: Option<u64>,
    lease_ms: Option<u64>,
    peer_timeout_ms: Option<u64>,
    handshake_timeout_ms: Option<u64>,
    planner_timeout_ms: Option<u64>,
    max_connections: Option<usize>,
    max_stashed_bytes: Option<usize>,
    cuda_device: Option<usize>,
    bounce: Option<String>,
    bounce_arena_mb: Option<u64>,
    integrity: Option<String>,
}

/// One plugin directory, or several (scanned in order).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum PlannerDirs {
    One(PathBuf),
    Many(Vec<PathBuf>),
}

impl PlannerDirs {
    fn into_vec(self) -> Vec<PathBuf> {
        match self {
            PlannerDirs::One(p) => vec![p],
            PlannerDirs::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RankJson {
    mapping: String,
    instance_rank: u32,
    tp_rank: Option<u32>,
    pp_rank: Option<u32>,
    cp_rank: Option<u32>,
    dp_size: Option<u32>,
    dp_rank: Option<u32>,
    layers_per_pp: Vec<u32>,
    page_table: PageTableJson,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PageTableJson {
    tokens_per_block: u32,
    pools: Vec<PoolJson>,
    groups: Vec<GroupJson>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolJson {
    base: u64,
    slot_bytes: u64,
    slot_stride: Option<u64>,
    num_slots: u64,
    #[serde(default = "dram")]
    memory_type: String,
}

fn dram() -> String {
    "dram".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupJson {
    #[serde(default = "paged")]
    kind: String,
    window: Option<u64>,
    layers: Vec<LayerJson>,
    views: Vec<ViewJson>,
}

fn paged() -> String {
    "paged".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerJson {
    local: u32,
    global: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ViewJson {
    pool: u32,
    entries: Vec<EntryJson>,
    roles: Vec<String>,
    layout: LayoutJson,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryJson {
    local_layer: u32,
    offset: u64,
    size: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayoutJson {
    kind: String,
    dtype: String,
    elem_bits: u32,
    #[serde(default = "one")]
    num_shards: u32,
    #[serde(default)]
    shard_index: u32,
    #[serde(default = "one")]
    num_replicas: u32,
    #[serde(default)]
    replica_index: u32,
    #[serde(default)]
    shard_unit_bytes: u64,
    #[serde(default)]
    section_bytes: Vec<u64>,
}

fn one() -> u32 {
    1
}

/// A parsed configuration: the agent's, and how to bind its planner.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) agent: AgentConfig,
    binding: Binding,
}

/// The part of a configuration planning needs: the rank, its role, and how to bind its
/// planner (no secret, transport or timeouts).
#[derive(Debug)]
pub(crate) struct RankConfig {
    pub(crate) role: Role,
    pub(crate) rank: RankInfo,
    pub(crate) binding: Binding,
}

/// How a configuration binds its planner.
#[derive(Debug)]
pub(crate) struct Binding {
    deployment: Deployment,
    planner: Option<String>,
    plugin_dirs: Option<Vec<PathBuf>>,
}

/// Parses a configuration (strictly, its version first) and binds its planner (the crate
/// docs say how the planner id and plugin directories are chosen): what
/// [`Agent::start`](kvferry_transfer::agent::Agent::start) takes.
pub fn load(text: &str) -> Result<(AgentConfig, BoundPlanner), ConfigError> {
    let parsed = parse(text)?;
    let bound = parsed.bind()?;
    Ok((parsed.agent, bound))
}

/// [`load`] for a file (JSON or TOML by its content), naming the file in every error; a
/// relative `plugin_dir` is taken relative to the file's folder.
pub fn load_file(path: &Path) -> Result<(AgentConfig, BoundPlanner), ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigError::invalid(format!("cannot read config file {}: {e}", path.display()))
    })?;
    let named = |e: ConfigError| match e {
        ConfigError::Invalid(m) => ConfigError::Invalid(format!("{}: {m}", path.display())),
        other => other,
    };
    let mut parsed = parse(&text).map_err(named)?;
    if let Some(dirs) = &mut parsed.binding.plugin_dirs {
        let base = path.parent().unwrap_or(Path::new("."));
        for dir in dirs.iter_mut().filter(|d| d.is_relative()) {
            *dir = base.join(&*dir);
        }
    }
    let bound = parsed.bind()?;
    Ok((parsed.agent, bound))
}

/// Reads one environment variable; tests pass their own.
type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Parses a configuration: the version first (so a newer one is refused as such, not for
/// its new fields), then every field strictly, with the process's environment for the
/// fields it leaves out.
pub(crate) fn parse(text: &str) -> Result<Parsed, ConfigError> {
    parse_with(text, &process_env)
}

fn parse_with(text: &str, env: Env<'_>) -> Result<Parsed, ConfigError> {
    let c = read(text)?;
    let RankConfig {
        role,
        rank,
        binding,
    } = read_rank(&c)?;
    let mut secret = match (&c.secret, &c.secret_hex, env(SECRET_ENV)) {
        (None, None, Some(from_env)) => Secret::new(from_env.into_bytes())
            .map_err(|e| ConfigError::invalid(format!("{SECRET_ENV}: {e}")))?,
        _ => secret(c.secret.as_deref(), c.secret_hex.as_deref(), "secret")?,
    };
    if c.previous_secret.is_some() || c.previous_secret_hex.is_some() {
        // During a change of secret: peers that still prove the previous one are accepted.
        let previous = self::secret(
            c.previous_secret.as_deref(),
            c.previous_secret_hex.as_deref(),
            "previous_secret",
        )?;
        secret = secret.also_accepting(previous);
    }
    let mut agent = AgentConfig::new(&c.instance, role, rank, secret);
    agent.label = c.label;
    let mut transport = match (&c.transport, env(ENV_TRANSPORT)) {
        (Some(t), _) => TransportSpec::from_str(t)
            .map_err(|e| ConfigError::invalid(format!("config: transport: {e}")))?,
        (None, Some(t)) => TransportSpec::from_str(t.trim())
            .map_err(|e| ConfigError::invalid(format!("{ENV_TRANSPORT}: {e}")))?,
        (None, None) => agent.transport.clone(),
    };
    if let Some(devices) = c
        .net_devices
        .filter(|d| !d.is_empty())
        .or_else(|| env(ENV_NET_DEVICES).map(|d| d.trim().to_string()))
    {
        transport.net_devices = Some(devices);
    }
    transport.ucx_peer_errors = c.ucx_peer_errors;
    agent.transport = transport;
    if let Some(listen) = c.listen {
        agent.listen = listen;
    }
    agent.advertise = c
        .advertise
        .or_else(|| env(ENV_ADVERTISE).map(|a| a.trim().to_string()));
    let ms = |field: &str, v: Option<u64>, default: Duration| match v {
        None => Ok(default),
        Some(0) => Err(ConfigError::invalid(format!(
            "config: \"{field}\" must be above 0"
        ))),
        Some(v) => Ok(Duration::from_millis(v)),
    };
    agent.timeout = ms("timeout_ms", c.timeout_ms, agent.timeout)?;
    agent.lease = ms("lease_ms", c.lease_ms, agent.lease)?;
    agent.peer_timeout = ms("peer_timeout_ms", c.peer_timeout_ms, agent.peer_timeout)?;
    agent.handshake_timeout = ms(
        "handshake_timeout_ms",
        c.handshake_timeout_ms,
        agent.handshake_timeout,
    )?;
    agent.planner_timeout = ms(
        "planner_timeout_ms",
        c.planner_timeout_ms,
        agent.planner_timeout,
    )?;
    match c.max_connections {
        Some(0) => {
            return Err(ConfigError::invalid(
                "config: \"max_connections\" must be above 0",
            ));
        }
        Some(n) => agent.max_connections = n,
        None => {}
    }
    if let Some(n) = c.max_stashed_bytes {
        agent.max_stashed_bytes = n;
    }
    agent.cuda_device = c.cuda_device;
    if let Some(mode) = &c.bounce {
        agent.bounce.mode = BounceMode::from_str(mode)
            .map_err(|e| ConfigError::invalid(format!("config: bounce: {e}")))?;
    }
    if let Some(mb) = c.bounce_arena_mb {
        agent.bounce.arena_bytes = mb.checked_mul(1 << 20).ok_or_else(|| {
            ConfigError::invalid(format!("config: \"bounce_arena_mb\" {mb} overflows"))
        })?;
    }
    match c.integrity.as_deref() {
        None | Some("off") => {}
        Some(name) => {
            agent.integrity =
                Some(name.parse().map_err(|e| {
                    ConfigError::invalid(format!("config: integrity: {e} or `off`"))
                })?);
        }
    }
    Ok(Parsed { agent, binding })
}

/// The rank part of a configuration (strictly parsed): what planning needs, and all of it
/// (a configuration without a secret is still a rank's description).
pub(crate) fn parse_rank(text: &str) -> Result<RankConfig, ConfigError> {
    read_rank(&read(text)?)
}

fn read_rank(c: &ConfigV1) -> Result<RankConfig, ConfigError> {
    if c.instance.is_empty() {
        return Err(ConfigError::invalid("config: \"instance\" is empty"));
    }
    let role = Role::from_str(&c.role).map_err(|e| ConfigError::invalid(format!("config: {e}")))?;
    let mapping: Mapping = c
        .rank
        .mapping
        .parse()
        .map_err(|e| ConfigError::invalid(format!("config: rank.mapping: {e}")))?;
    let rank = rank_info(&c.instance, &mapping, &c.rank)?;
    Ok(RankConfig {
        role,
        rank,
        binding: Binding {
            deployment: Deployment {
                architecture: RString::from(c.architecture.as_str()),
                mapping,
            },
            planner: c.planner.clone().filter(|p| !p.trim().is_empty()),
            plugin_dirs: c.plugin_dir.clone().map(PlannerDirs::into_vec),
        },
    })
}

/// The text as a JSON value: JSON when it starts with `{` (after white space), else TOML.
fn value_of(text: &str) -> Result<serde_json::Value, ConfigError> {
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        return serde_json::from_str(text)
            .map_err(|e| ConfigError::invalid(format!("config is not JSON: {e}")));
    }
    let table: toml::Table = toml::from_str(text).map_err(|e| {
        ConfigError::invalid(format!(
            "config is neither JSON (it does not start with `{{`) nor TOML: {}",
            e.to_string().trim_end()
        ))
    })?;
    serde_json::to_value(table)
        .map_err(|e| ConfigError::invalid(format!("config: TOML value has no JSON form: {e}")))
}

/// The version check, then the strict parse.
fn read(text: &str) -> Result<ConfigV1, ConfigError> {
    let value = value_of(text)?;
    let object = value
        .as_object()
        .ok_or_else(|| ConfigError::invalid("config must be a JSON object or a TOML table"))?;
    match object.get("version") {
        None => {
            return Err(ConfigError::invalid(format!(
                "config has no \"version\" (this library reads version {CONFIG_VERSION})"
            )));
        }
        Some(v) if v.as_u64() == Some(CONFIG_VERSION) => {}
        Some(v) => {
            return Err(ConfigError::invalid(format!(
                "config version {v} is not supported (this library reads version \
                 {CONFIG_VERSION})"
            )));
        }
    }
    let c: ConfigV1 =
        serde_json::from_value(value).map_err(|e| ConfigError::invalid(format!("config: {e}")))?;
    debug_assert_eq!(c.version, CONFIG_VERSION);
    Ok(c)
}

impl Parsed {
    /// Loads the planners and binds the configured one ([`Binding::bind`]).
    pub(crate) fn bind(&self) -> Result<BoundPlanner, ConfigError> {
        self.binding.bind()
    }
}

impl Binding {
    /// Loads the planners and binds the configured one (see the crate docs for the order in
    /// which the planner id and the plugin directories are chosen).
    pub(crate) fn bind(&self) -> Result<BoundPlanner, ConfigError> {
        let env_planner = std::env::var(kvferry_loader::PLANNER_ENV).ok();
        let id = kvferry_loader::select_planner_id(
            self.planner.as_deref(),
            env_planner.as_deref(),
            None,
        );
        let dirs = match &self.plugin_dirs {
            Some(dirs) => dirs.clone(),
            None => crate::default_plugin_dirs(),
        };
        if dirs.is_empty() {
            return Err(ConfigError::Planner(format!(
                "no plugin directory to load planner {id} from: set \"plugin_dir\" in the \
                 config or {} (an installed library also looks in kvferry/planners or \
                 planners beside itself)",
                kvferry_loader::PLUGIN_DIR_ENV
            )));
        }
        let registry = Registry::scan(&dirs);
        registry.bind(id, &self.deployment).map_err(|e| {
            let mut text = error_chain(&e);
            if registry.planners().is_empty() {
                let shown: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
                text.push_str(&format!(
                    " (no planner loaded from {}; {} file(s) skipped)",
                    shown.join(":"),
                    registry.skipped().len()
                ));
                for skipped in registry.skipped().iter().take(3) {
                    text.push_str(&format!("; {}", skipped.reason));
                }
            }
            ConfigError::Planner(text)
        })
    }
}

/// `error: source: source ...`: an error and its sources, each once.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let next = s.to_string();
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = s.source();
    }
    text
}

/// The secret named `name` (`secret` or `previous_secret`), as text or as `{name}_hex`.
fn secret(text: Option<&str>, hex: Option<&str>, name: &str) -> Result<Secret, ConfigError> {
    let bytes = match (text, hex) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::invalid(format!(
                "config: give \"{name}\" or \"{name}_hex\", not both"
            )));
        }
        (None, None) => {
            return Err(ConfigError::invalid(format!(
                "config: no \"{name}\" (or \"{name}_hex\"{}): every agent of a deployment \
                 proves one shared secret",
                if name == "secret" {
                    format!(", or {SECRET_ENV} in the environment")
                } else {
                    String::new()
                }
            )));
        }
        (Some(t), None) => t.as_bytes().to_vec(),
        (None, Some(h)) => decode_hex(h).ok_or_else(|| {
            ConfigError::invalid(format!("config: \"{name}_hex\" is not hexadecimal"))
        })?,
    };
    Secret::new(bytes).map_err(|e| ConfigError::invalid(format!("config: {name}: {e}")))
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    let text = text.trim();
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

fn rank_info(instance: &str, mapping: &Mapping, r: &RankJson) -> Result<RankInfo, ConfigError> {
    let world = mapping.world_size();
    if r.instance_rank >= world {
        return Err(ConfigError::invalid(format!(
            "config: rank.instance_rank {} is not below the {world} ranks of {mapping}",
            r.instance_rank
        )));
    }
    // Coordinates default to the numbering every host uses (`Mapping::coords`, CP-minor).
    let at = mapping.coords(r.instance_rank);
    let tp_rank = r.tp_rank.unwrap_or(at.tp);
    let pp_rank = r.pp_rank.unwrap_or(at.pp);
    let cp_rank = r.cp_rank.unwrap_or(at.cp);
    for (name, value, size) in [
        ("tp_rank", tp_rank, mapping.tp),
        ("pp_rank", pp_rank, mapping.pp),
        ("cp_rank", cp_rank, mapping.cp),
    ] {
        if value >= size {
            return Err(ConfigError::invalid(format!(
                "config: rank.{name} {value} is not below its size {size} in {mapping}"
            )));
        }
    }
    let (dp_size, dp_rank) = if mapping.attention_dp {
        (mapping.tp, tp_rank)
    } else {
        (1, 0)
    };
    let dp_size = r.dp_size.unwrap_or(dp_size);
    let dp_rank = r.dp_rank.unwrap_or(dp_rank);
    if dp_size == 0 || dp_rank >= dp_size {
        return Err(ConfigError::invalid(format!(
            "config: rank.dp_rank {dp_rank} is not below dp_size {dp_size}"
        )));
    }
    if r.layers_per_pp.len() != mapping.pp as usize {
        return Err(ConfigError::invalid(format!(
            "config: rank.layers_per_pp has {} entries for pp {}",
            r.layers_per_pp.len(),
            mapping.pp
        )));
    }
    // The planner id is filled in by the agent from the planner it binds.
    let mut info = RankInfo::new(
        instance,
        mapping,
        r.instance_rank,
        r.layers_per_pp.clone(),
        page_table(&r.page_table)?,
    );
    (info.tp_rank, info.pp_rank, info.cp_rank) = (tp_rank, pp_rank, cp_rank);
    (info.dp_size, info.dp_rank) = (dp_size, dp_rank);
    Ok(info)
}

fn page_table(t: &PageTableJson) -> Result<PageTable, ConfigError> {
    let pools = t
        .pools
        .iter()
        .enumerate()
        .map(|(p, pool)| {
            Ok(PhysicalPool {
                base: pool.base,
                slot_bytes: pool.slot_bytes,
                slot_stride: pool.slot_stride.unwrap_or(pool.slot_bytes),
                num_slots: pool.num_slots,
                memory_type: code(
                    &format!("rank.page_table.pools[{p}].memory_type"),
                    &pool.memory_type,
                    MEMORY_TYPES,
                )?,
            })
        })
        .collect::<Result<RVec<_>, ConfigError>>()?;
    let groups = t
        .groups
        .iter()
        .enumerate()
        .map(|(g, group)| {
            let at = format!("rank.page_table.groups[{g}]");
            let views = group
                .views
                .iter()
                .enumerate()
                .map(|(v, view)| {
                    let l = &view.layout;
                    Ok(PoolView {
                        pool: view.pool,
                        entries: view
                            .entries
                            .iter()
                            .map(|e| BufferEntry {
                                local_layer: e.local_layer,
                                offset: e.offset,
                                size: e.size,
                            })
                            .collect(),
                        roles: view
                            .roles
                            .iter()
                            .map(|r| RString::from(r.as_str()))
                            .collect(),
                        layout: RoleLayout {
                            kind: code(
                                &format!("{at}.views[{v}].layout.kind"),
                                &l.kind,
                                LAYOUT_KINDS,
                            )?,
                            dtype: RString::from(l.dtype.as_str()),
                            elem_bits: l.elem_bits,
                            num_shards: l.num_shards,
                            shard_index: l.shard_index,
                            num_replicas: l.num_replicas,
                            replica_index: l.replica_index,
                            shard_unit_bytes: l.shard_unit_bytes,
                            section_bytes: RVec::from(l.section_bytes.clone()),
                        },
                    })
                })
                .collect::<Result<RVec<_>, ConfigError>>()?;
            Ok(LayerGroup {
                kind: code(&format!("{at}.kind"), &group.kind, GROUP_KINDS)?,
                window: group.window.into(),
                layers: group
                    .layers
                    .iter()
                    .map(|l| LocalLayer {
                        local: l.local,
                        global: l.global,
                    })
                    .collect(),
                views,
            })
        })
        .collect::<Result<RVec<_>, ConfigError>>()?;
    let table = PageTable {
        tokens_per_block: t.tokens_per_block,
        pools,
        groups,
    };
    table
        .validate()
        .map_err(|e| ConfigError::invalid(format!("config: rank.page_table: {e}")))?;
    Ok(table)
}

/// The spellings of the page table's codes, read by the parser and written by
/// [`rank_config`].
const MEMORY_TYPES: &[(&str, MemoryType)] =
    &[("dram", MemoryType::DRAM), ("vram", MemoryType::VRAM)];
const LAYOUT_KINDS: &[(&str, LayoutKind)] = &[
    ("hnd", LayoutKind::HND),
    ("nhd", LayoutKind::NHD),
    ("replicated", LayoutKind::REPLICATED),
    ("sectioned", LayoutKind::SECTIONED),
];
const GROUP_KINDS: &[(&str, GroupKind)] =
    &[("paged", GroupKind::PAGED), ("state", GroupKind::STATE)];

/// The name of `value` among `known`; a code this version does not spell is written as its
/// number's debug form, which the parser refuses by name.
fn name_of<T: PartialEq + std::fmt::Debug>(value: T, known: &[(&'static str, T)]) -> String {
    known
        .iter()
        .find(|(_, c)| *c == value)
        .map_or_else(|| format!("{value:?}"), |(n, _)| (*n).to_string())
}

/// One rank's configuration as [`load`] and [`crate::planning::PairPlanner::new`] read it:
/// `version`, `instance`, `role` (`context` or `generation`), `architecture`, `planner` (when
/// given) and `rank` — its place in `mapping` and its whole page table. Nothing else: an agent
/// needs a secret (and takes its transport and timeouts) added to it. Reading it back gives
/// `rank` again (its planner ids aside, which the agent fills in from the planner it binds).
/// What an engine, or a benchmark, hands to another process that plans for this rank.
pub fn rank_config(
    role: Role,
    architecture: &str,
    planner: Option<&str>,
    mapping: &Mapping,
    rank: &RankInfo,
) -> serde_json::Value {
    use serde_json::json;
    let t = &rank.page_table;
    let pools: Vec<_> = t
        .pools
        .iter()
        .map(|p| {
            json!({
                "base": p.base,
                "slot_bytes": p.slot_bytes,
                "slot_stride": p.slot_stride,
                "num_slots": p.num_slots,
                "memory_type": name_of(p.memory_type, MEMORY_TYPES),
            })
        })
        .collect();
    let groups: Vec<_> = t
        .groups
        .iter()
        .map(|g| {
            let views: Vec<_> = g
                .views
                .iter()
                .map(|v| {
                    let l = &v.layout;
                    json!({
                        "pool": v.pool,
                        "entries": v.entries.iter().map(|e| json!({
                            "local_layer": e.local_layer, "offset": e.offset, "size": e.size,
                        })).collect::<Vec<_>>(),
                        "roles": v.roles.iter().map(|r| r.as_str()).collect::<Vec<_>>(),
                        "layout": {
                            "kind": name_of(l.kind, LAYOUT_KINDS),
                            "dtype": l.dtype.as_str(),
                            "elem_bits": l.elem_bits,
                            "num_shards": l.num_shards,
                            "shard_index": l.shard_index,
                            "num_replicas": l.num_replicas,
                            "replica_index": l.replica_index,
                            "shard_unit_bytes": l.shard_unit_bytes,
                            "section_bytes": l.section_bytes.as_slice(),
                        },
                    })
                })
                .collect();
            let mut group = json!({
                "kind": name_of(g.kind, GROUP_KINDS),
                "layers": g.layers.iter().map(|l| json!({"local": l.local, "global": l.global}))
                    .collect::<Vec<_>>(),
                "views": views,
            });
            if let Some(window) = g.window() {
                group["window"] = json!(window);
            }
            group
        })
        .collect();
    let mut config = json!({
        "version": CONFIG_VERSION,
        "instance": rank.instance_name.as_str(),
        "role": match role { Role::Prefill => "context", Role::Decode => "generation" },
        "architecture": architecture,
        "rank": {
            "mapping": mapping.to_string(),
            "instance_rank": rank.instance_rank,
            "tp_rank": rank.tp_rank,
            "pp_rank": rank.pp_rank,
            "cp_rank": rank.cp_rank,
            "dp_size": rank.dp_size,
            "dp_rank": rank.dp_rank,
            "layers_per_pp": rank.layers_per_pp.as_slice(),
            "page_table": {
                "tokens_per_block": t.tokens_per_block,
                "pools": pools,
                "groups": groups,
            },
        },
    });
    if let Some(planner) = planner {
        config["planner"] = json!(planner);
    }
    config
}

/// The code named `name` among `known`, or an error listing them.
fn code<T: Copy>(field: &str, name: &str, known: &[(&str, T)]) -> Result<T, ConfigError> {
    known
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, c)| *c)
        .ok_or_else(|| {
            let names: Vec<&str> = known.iter().map(|(n, _)| *n).collect();
            ConfigError::invalid(format!(
                "config: {field} `{name}` is unknown (known: {})",
                names.join(", ")
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn minimal(extra: &str) -> String {
        format!(
            r#"{{"version": 1, "instance": "p", "role": "context", "architecture": "llama",
               "secret": "0123456789abcdef", "rank": {{"mapping": "tp2", "instance_rank": 1,
               "layers_per_pp": [1], "page_table": {{"tokens_per_block": 16,
               "pools": [{{"base": 4096, "slot_bytes": 1024, "num_slots": 4}}],
               "groups": [{{"layers": [{{"local": 0, "global": 0}}],
               "views": [{{"pool": 0, "entries": [{{"local_layer": 0, "offset": 0,
               "size": 1024}}], "roles": ["key"], "layout": {{"kind": "hnd", "dtype": "bf16",
               "elem_bits": 16, "num_shards": 2, "shard_index": 1}}}}]}}]}}}}{extra}}}"#
        )
    }

    /// Every preset's rank, on deployments that give it every kind of group (PAGED, STATE,
    /// windows, MLA latents, padding between slots), written by [`rank_config`] and read back.
    #[test]
    fn rank_config_reads_back_as_the_same_rank() {
        use kvferry_testkit::layout::{ModelSpec, PoolOptions, Preset, build_rank};
        let cases = [
            (Preset::DeepseekV3, "dep4"),
            (Preset::Llama3_70b, "tp4pp2"),
            (Preset::Qwen3Next80bA3b, "tp2"),
            (Preset::GptOss120b, "tp2cp2"),
        ];
        for (preset, deployment) in cases {
            let mapping: Mapping = deployment.parse().unwrap();
            let model = ModelSpec::new(preset);
            let options = PoolOptions {
                paged_slots: 8,
                state_slots: 2,
                slot_padding: 64,
                memory_type: MemoryType::DRAM,
            };
            for r in 0..mapping.world_size() {
                let mut next = 1u64 << 32;
                let mut alloc = |_: u32, _: usize, bytes: u64| {
                    let base = next;
                    next += bytes.next_multiple_of(4096);
                    base
                };
                let mut built =
                    build_rank(&model, &mapping, "p", "any", r, &options, &mut alloc).unwrap();
                for role in [Role::Prefill, Role::Decode] {
                    let value =
                        rank_config(role, model.architecture(), Some("any"), &mapping, &built);
                    let read = parse_rank(&value.to_string())
                        .unwrap_or_else(|e| panic!("{deployment} rank {r}: {e}\n{value:#}"));
                    assert_eq!(read.role, role);
                    assert_eq!(read.binding.planner.as_deref(), Some("any"));
                    assert_eq!(read.binding.deployment.mapping, mapping);
                    // The agent fills these in from the planner it binds.
                    (built.planner_id, built.describer_id) =
                        (read.rank.planner_id.clone(), read.rank.describer_id.clone());
                    assert_eq!(read.rank, built, "{preset:?} {deployment} rank {r}");
                }
            }
        }
    }

    #[test]
    fn a_minimal_config_fills_the_defaults() {
        let p = parse(&minimal("")).unwrap();
        let a = &p.agent;
        assert_eq!(a.role, Role::Prefill);
        assert_eq!(a.rank.tp_size, 2);
        assert_eq!(a.rank.tp_rank, 1);
        assert_eq!(a.rank.page_table.pools[0].slot_stride, 1024);
        assert_eq!(a.rank.page_table.pools[0].memory_type, MemoryType::DRAM);
        assert_eq!(a.rank.page_table.groups[0].kind, GroupKind::PAGED);
        assert_eq!(a.timeout, Duration::from_secs(30));
        assert_eq!(
            a.transport.to_string(),
            TransportSpec::from_str("tcp").unwrap().to_string()
        );
        assert!(p.binding.planner.is_none() && p.binding.plugin_dirs.is_none());
    }

    #[test]
    fn every_field_is_read() {
        let p = parse(&minimal(
            r#", "label": "l", "planner": "auto", "plugin_dir": ["/a", "/b"],
               "transport": "shm", "net_devices": "eth0", "listen": "127.0.0.1:0",
               "advertise": "127.0.0.1", "timeout_ms": 1000, "lease_ms": 2000,
               "peer_timeout_ms": 3000, "handshake_timeout_ms": 6000,
               "planner_timeout_ms": 4000, "max_connections": 7,
               "max_stashed_bytes": 1024, "cuda_device": 1, "integrity": "crc32c""#,
        ))
        .unwrap();
        let a = &p.agent;
        assert_eq!(a.label, "l");
        assert_eq!(p.binding.planner.as_deref(), Some("auto"));
        assert_eq!(p.binding.plugin_dirs.unwrap().len(), 2);
        assert_eq!(a.transport.net_devices.as_deref(), Some("eth0"));
        assert_eq!(a.listen, "127.0.0.1:0");
        assert_eq!(a.advertise.as_deref(), Some("127.0.0.1"));
        assert_eq!(a.timeout, Duration::from_secs(1));
        assert_eq!(a.lease, Duration::from_secs(2));
        assert_eq!(a.peer_timeout, Duration::from_secs(3));
        assert_eq!(a.handshake_timeout, Duration::from_secs(6));
        assert_eq!(a.planner_timeout, Duration::from_secs(4));
        assert_eq!(a.max_connections, 7);
        assert_eq!(a.max_stashed_bytes, 1024);
        assert_eq!(a.cuda_device, Some(1));
        assert_eq!(
            a.integrity,
            Some(kvferry_transfer::agent::Integrity::Crc32c)
        );
    }

    fn refusal(text: &str) -> String {
        match parse(text) {
            Err(ConfigError::Invalid(m)) => m,
            other => panic!("not refused as invalid: {other:?}"),
        }
    }

    #[test]
    fn versions_fields_and_codes_are_refused_by_name() {
        assert!(refusal("{").contains("not JSON"));
        assert!(refusal("[1]").contains("JSON object"));
        assert!(refusal(r#"{"instance": "p"}"#).contains("no \"version\""));
        let v2 = minimal("").replacen("\"version\": 1", "\"version\": 2", 1);
        assert!(
            refusal(&v2).contains("version 2 is not supported"),
            "{}",
            refusal(&v2)
        );
        let typo = refusal(&minimal(r#", "timeout": 5"#));
        assert!(typo.contains("unknown field `timeout`"), "{typo}");
        let kind = minimal("").replace("\"hnd\"", "\"hdn\"");
        let kind = refusal(&kind);
        assert!(
            kind.contains("layout.kind `hdn` is unknown (known: hnd"),
            "{kind}"
        );
        let short = minimal("").replace("0123456789abcdef", "short");
        assert!(refusal(&short).contains("at least 16 bytes"));
        let both = refusal(&minimal(r#", "secret_hex": "00""#));
        assert!(both.contains("not both"), "{both}");
        let blank = refusal(&minimal(r#", "previous_secret": "                ""#));
        assert!(
            blank.contains("previous_secret") && blank.contains("whitespace"),
            "{blank}"
        );
        let rotating = parse(&minimal(
            r#", "previous_secret": "the previous secret, 32 bytes.""#,
        ));
        assert!(format!("{:?}", rotating.unwrap().agent.secret).contains("1 more accepted"));
        let rank = minimal("").replace("\"instance_rank\": 1", "\"instance_rank\": 2");
        assert!(refusal(&rank).contains("not below the 2 ranks"));
        let role = refusal(&minimal("").replace("\"context\"", "\"producer\""));
        assert!(
            role.contains("unknown role `producer` (known: prefill, decode)"),
            "{role}"
        );
        let prefill = minimal("").replace("\"context\"", "\"prefill\"");
        assert_eq!(parse(&prefill).unwrap().agent.role, Role::Prefill);
        assert!(refusal(&minimal(r#", "timeout_ms": 0"#)).contains("above 0"));
        let dp = minimal("").replace(
            "\"instance_rank\": 1",
            "\"instance_rank\": 1, \"dp_rank\": 1",
        );
        assert!(
            refusal(&dp).contains("dp_rank 1 is not below dp_size 1"),
            "{}",
            refusal(&dp)
        );
    }

    /// [`minimal`] in TOML.
    const MINIMAL_TOML: &str = r#"
version = 1
instance = "p"
role = "context"
architecture = "llama"
secret = "0123456789abcdef"

[rank]
mapping = "tp2"
instance_rank = 1
layers_per_pp = [1]

[rank.page_table]
tokens_per_block = 16
pools = [{ base = 4096, slot_bytes = 1024, num_slots = 4 }]

[[rank.page_table.groups]]
layers = [{ local = 0, global = 0 }]

[[rank.page_table.groups.views]]
pool = 0
entries = [{ local_layer = 0, offset = 0, size = 1024 }]
roles = ["key"]
layout = { kind = "hnd", dtype = "bf16", elem_bits = 16, num_shards = 2, shard_index = 1 }
"#;

    #[test]
    fn toml_reads_as_json_does() {
        let json = parse(&minimal("")).unwrap();
        let toml = parse(MINIMAL_TOML).unwrap();
        assert_eq!(format!("{:?}", toml.agent), format!("{:?}", json.agent));
        let typo = refusal(&format!("timeout = 5\n{MINIMAL_TOML}"));
        assert!(typo.contains("unknown field `timeout`"), "{typo}");
        let broken = refusal("version = 1\ninstance = ");
        assert!(
            broken.contains("neither JSON") && broken.contains("TOML"),
            "{broken}"
        );
        let v2 = refusal(&MINIMAL_TOML.replacen("version = 1", "version = 2", 1));
        assert!(v2.contains("version 2 is not supported"), "{v2}");
    }

    #[test]
    fn the_environment_fills_what_the_config_leaves_out() {
        let env = |name: &str| match name {
            ENV_TRANSPORT => Some("shm".to_string()),
            ENV_NET_DEVICES => Some("eth1".to_string()),
            ENV_ADVERTISE => Some("10.0.0.7".to_string()),
            SECRET_ENV => Some("a secret from the environment".to_string()),
            _ => None,
        };
        let no_secret = minimal("").replace(r#""secret": "0123456789abcdef","#, "");
        let a = parse_with(&no_secret, &env).unwrap().agent;
        assert_eq!(a.transport.to_string(), "shm on eth1");
        assert_eq!(a.transport.net_devices.as_deref(), Some("eth1"));
        assert_eq!(a.advertise.as_deref(), Some("10.0.0.7"));
        let from_env = "a secret from the environment".len();
        assert!(format!("{:?}", a.secret).contains(&format!("({from_env} bytes")));
        // What the configuration gives wins.
        let given =
            minimal(r#", "transport": "tcp", "net_devices": "eth0", "advertise": "10.0.0.1""#);
        let a = parse_with(&given, &env).unwrap().agent;
        assert_eq!(a.transport.net_devices.as_deref(), Some("eth0"));
        assert_eq!(a.advertise.as_deref(), Some("10.0.0.1"));
        assert!(format!("{:?}", a.secret).contains("(16 bytes"));
        // A bad value names the variable.
        let bad = |name: &str| (name == ENV_TRANSPORT).then(|| "carrier-pigeon".to_string());
        match parse_with(&minimal(""), &bad) {
            Err(ConfigError::Invalid(m)) => assert!(m.starts_with(ENV_TRANSPORT), "{m}"),
            other => panic!("not refused: {other:?}"),
        }
        let short = |name: &str| (name == SECRET_ENV).then(|| "short".to_string());
        match parse_with(&no_secret, &short) {
            Err(ConfigError::Invalid(m)) => {
                assert!(m.starts_with(SECRET_ENV) && m.contains("16 bytes"), "{m}")
            }
            other => panic!("not refused: {other:?}"),
        }
        match parse_with(&no_secret, &|_| None) {
            Err(ConfigError::Invalid(m)) => assert!(m.contains(SECRET_ENV), "{m}"),
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn a_file_is_named_in_its_errors_and_anchors_a_relative_plugin_dir() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("absent.toml");
        let e = load_file(&missing).unwrap_err().to_string();
        assert!(e.contains("absent.toml"), "{e}");
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{").unwrap();
        let e = load_file(&bad).unwrap_err().to_string();
        assert!(e.contains("bad.json") && e.contains("not JSON"), "{e}");
        // No planner loads from the (empty) relative folder: the refusal names it, anchored.
        std::fs::create_dir(dir.path().join("planners")).unwrap();
        let file = dir.path().join("agent.toml");
        std::fs::write(&file, format!("plugin_dir = \"planners\"\n{MINIMAL_TOML}")).unwrap();
        match load_file(&file) {
            Err(ConfigError::Planner(m)) => {
                let anchored = dir.path().join("planners").display().to_string();
                assert!(m.contains(&anchored), "{m}");
            }
            other => panic!("bound a planner from an empty folder: {other:?}"),
        }
    }

    #[test]
    fn hex_secrets_decode() {
        assert_eq!(decode_hex("00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(decode_hex("0g"), None);
        assert_eq!(decode_hex("abc"), None);
        assert!(secret(None, Some(&"ab".repeat(16)), "secret").is_ok());
        assert!(secret(None, Some("abab"), "secret").is_err());
    }
}
