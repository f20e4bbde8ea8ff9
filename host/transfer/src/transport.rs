//! The UCX transports a rank moves bytes with: a preset ([`Transport`]: `shm`, `tcp`), UCX's
//! own choice (`auto`) or an explicit `UCX_TLS` list, plus network devices
//! ([`TransportSpec`]), and the UCX context each makes for host or CUDA pools.

use std::fmt;
use std::sync::Arc;

use kvferry_protocol::unknown_name;
use kvferry_ucx::{Context, ErrorMode};

use crate::memory::MemoryKind;

/// The UCX transports an instance uses: `shm` or `tcp` on the command line.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    strum::AsRefStr,
    strum::Display,
    strum::EnumString,
    strum::VariantNames,
)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = String,
    parse_err_fn = unknown_transport
)]
pub enum Transport {
    /// Intra-node shared memory (`UCX_TLS=posix,sysv,self`): one-sided puts into
    /// UCX-allocated pools, copied straight into the peer's mapping.
    ///
    /// `cma` is left out: UCX 1.22 (unlike 1.13) picks cma's zero-copy for puts above about
    /// 4 KiB, one `process_vm_writev` system call per put, which moved Llama-3-70B's 8 KiB
    /// fragments at 2.2 GB/s here against 9.3 GB/s without it (same build, same sitting).
    Shm,
    /// Loopback TCP (`UCX_TLS=tcp`, `UCX_NET_DEVICES=lo`): puts emulated with active messages.
    Tcp,
}

fn unknown_transport(name: &str) -> String {
    unknown_name::<Transport>("transport", name)
}

impl Transport {
    /// A UCX context for this transport, for host pools.
    ///
    /// # Errors
    ///
    /// UCX cannot create the context.
    pub fn context(self) -> Result<Arc<Context>, kvferry_ucx::Error> {
        self.context_for(MemoryKind::Host)
    }

    /// The `UCX_TLS` of this transport for pools in `memory`: CUDA pools add UCX's CUDA
    /// transports (`cuda_copy`, and `cuda_ipc` between processes on one node), without which
    /// a CUDA-enabled UCX would not report CUDA memory for the context.
    pub fn tls(self, memory: MemoryKind) -> &'static str {
        match (self, memory) {
            (Transport::Shm, MemoryKind::Host) => "posix,sysv,self",
            (Transport::Shm, MemoryKind::Cuda) => "posix,sysv,self,cuda_copy,cuda_ipc",
            (Transport::Tcp, MemoryKind::Host) => "tcp",
            (Transport::Tcp, MemoryKind::Cuda) => "tcp,cuda_copy",
        }
    }

    /// The `UCX_NET_DEVICES` this transport sets, if any.
    pub fn net_devices(self) -> Option<&'static str> {
        match self {
            Transport::Shm => None,
            Transport::Tcp => Some("lo"),
        }
    }

    /// A UCX context for this transport and pools in `memory` (see [`tls`](Self::tls)).
    ///
    /// # Errors
    ///
    /// UCX cannot create the context.
    pub fn context_for(self, memory: MemoryKind) -> Result<Arc<Context>, kvferry_ucx::Error> {
        let builder = Context::builder().tls(self.tls(memory));
        match self.net_devices() {
            Some(devices) => builder.net_devices(devices),
            None => builder,
        }
        .build()
    }
}

/// Which transports a UCX context may use.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Transports {
    /// One of kvferry's presets (`shm`, `tcp`): its `UCX_TLS` is pinned ([`Transport::tls`]).
    Preset(Transport),
    /// UCX's own choice: nothing is pinned, so UCX uses every transport it finds (`rc`, `dc`,
    /// `ud` over InfiniBand/RoCE where present, shared memory within a node, `tcp`,
    /// `cuda_ipc`/`cuda_copy` for device memory), or what `UCX_TLS` in the environment says.
    Auto,
    /// An explicit `UCX_TLS` list, e.g. `rc_x,sm,self` or `^cma`.
    List(String),
}

/// The UCX transports and network devices of an agent or instance: `--transport
/// shm|tcp|auto|<a UCX_TLS list>` and `--net-devices DEV[,DEV]` on the command line.
///
/// `UCX_*` variables in the environment are respected wherever kvferry pins nothing: `auto`
/// and lists leave `UCX_NET_DEVICES` to UCX unless devices are given, and `tcp` pins `lo`
/// only when neither the devices nor `UCX_NET_DEVICES` are given.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TransportSpec {
    /// The transports.
    pub transports: Transports,
    /// The network devices (`UCX_NET_DEVICES` syntax: `eth0`, `mlx5_0:1`, `veth0,veth1`).
    pub net_devices: Option<String>,
    /// Open endpoints in UCX's peer-failure mode where the transports support it (see
    /// [`error_mode`](Self::error_mode)); off by default: it costs tcp its native put.
    pub ucx_peer_errors: bool,
}

impl From<Transport> for TransportSpec {
    fn from(t: Transport) -> Self {
        Self {
            transports: Transports::Preset(t),
            net_devices: None,
            ucx_peer_errors: false,
        }
    }
}

impl std::str::FromStr for TransportSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let transports = match s {
            "auto" => Transports::Auto,
            _ => match s.parse::<Transport>() {
                Ok(t) => Transports::Preset(t),
                Err(_) if valid_list(s) => Transports::List(s.to_string()),
                Err(_) => {
                    return Err(format!(
                        "unknown transport `{s}` (known: shm, tcp, auto, or a UCX_TLS list of \
                         names such as `rc_x,sm,self`)"
                    ));
                }
            },
        };
        Ok(Self {
            transports,
            net_devices: None,
            ucx_peer_errors: false,
        })
    }
}

/// A UCX_TLS list: names of letters, digits and `_`, separated by commas, optionally led by
/// `^` (exclusion).
fn valid_list(s: &str) -> bool {
    let body = s.strip_prefix('^').unwrap_or(s);
    !body.is_empty()
        && body.split(',').all(|name| {
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
}

impl fmt::Display for Transports {
    /// As `--transport` takes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transports::Preset(t) => write!(f, "{t}"),
            Transports::Auto => f.write_str("auto"),
            Transports::List(l) => f.write_str(l),
        }
    }
}

impl fmt::Display for TransportSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.transports)?;
        if let Some(d) = &self.net_devices {
            write!(f, " on {d}")?;
        }
        Ok(())
    }
}

impl TransportSpec {
    /// The UCX settings this selection pins for pools in `memory` (`TLS`, `NET_DEVICES`);
    /// what it does not pin, UCX takes from its environment.
    pub fn ucx_settings(&self, memory: MemoryKind) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        match &self.transports {
            Transports::Preset(t) => out.push(("TLS", t.tls(memory).to_string())),
            Transports::Auto => {}
            Transports::List(l) => out.push(("TLS", l.clone())),
        }
        let env_devices = std::env::var_os("UCX_NET_DEVICES").is_some();
        match (&self.net_devices, &self.transports) {
            (Some(d), _) => out.push(("NET_DEVICES", d.clone())),
            (None, Transports::Preset(t)) if !env_devices => {
                if let Some(d) = t.net_devices() {
                    out.push(("NET_DEVICES", d.to_string()));
                }
            }
            _ => {}
        }
        out
    }

    /// The error handling mode of the endpoints a sender opens over these transports.
    ///
    /// [`ErrorMode::None`] unless [`ucx_peer_errors`](Self::ucx_peer_errors) asks for UCX's
    /// peer-failure mode, because that mode costs the wire: measured here (UCX 1.22.0,
    /// `kvferry bench --model deepseek-v3 --ctx dep4 --gen dep4 --prompt-len 4096 --transport
    /// tcp --rounds 3`, release, one sitting) 1.03 GB/s with it against 2.94 without — under
    /// peer mode UCX gives up tcp's native zero-copy put for its active-message emulation
    /// (the same 1 GB/s as `UCX_TCP_PUT_ENABLE=n`). Without it a dead receiver is still
    /// noticed at once: its side-channel connection closes and UCX fails the puts to it
    /// ("connection reset by remote peer", measured); a silent one (stopped, or its link cut)
    /// at the peer timeout of the side channel's keep-alives, or at the write's deadline.
    ///
    /// With `ucx_peer_errors`, [`ErrorMode::Peer`] (a dead or unreachable receiver fails its
    /// puts through UCX's error handler, see the `rank` module) unless the selection is shared
    /// memory alone, which UCX cannot carry in that mode (`posix`, `sysv` and `self` have no
    /// peer-failure support: measured with `ucx_info -d`, UCX 1.22.0 and 1.13.1): the `shm`
    /// preset, and a `UCX_TLS` list whose every name is one of `posix`, `sysv`, `self`, `sm`,
    /// `shm`, `cuda_copy`, `cuda_ipc`. `auto` neither: under peer mode UCX drops shared memory
    /// for every endpoint, ranks on one node included — `kvferry demo --model llama-3-70b
    /// --ctx tp1 --gen tp1 --requests 8 --prompt-len 512 --transport auto` ran at 0.37 and
    /// 0.35 GB/s (tcp's 0.35) against 1.70 for `shm`. Where UCX refuses an endpoint in peer
    /// mode, the executor connects without it.
    pub fn error_mode(&self) -> ErrorMode {
        match &self.transports {
            _ if !self.ucx_peer_errors => ErrorMode::None,
            Transports::Auto => ErrorMode::None,
            _ if self.is_node_local() => ErrorMode::None,
            _ => ErrorMode::Peer,
        }
    }

    /// Whether every transport named moves bytes within the node only: the `shm` preset, or
    /// a `UCX_TLS` list whose every name is one of `posix`, `sysv`, `self`, `sm`, `shm`,
    /// `cuda_copy`, `cuda_ipc`. There a put already is a copy, so bouncing does not pay
    /// ([`crate::bounce::BounceMode::Auto`]).
    pub fn is_node_local(&self) -> bool {
        const SHARED_MEMORY: [&str; 7] = [
            "posix",
            "sysv",
            "self",
            "sm",
            "shm",
            "cuda_copy",
            "cuda_ipc",
        ];
        match &self.transports {
            Transports::Preset(Transport::Shm) => true,
            Transports::List(l) => {
                !l.starts_with('^') && l.split(',').all(|t| SHARED_MEMORY.contains(&t))
            }
            _ => false,
        }
    }

    /// What to tell a user whose context for this selection failed with `e`, beyond UCX's
    /// own words ("no such device" for a transport list that names nothing UCX has): empty
    /// when there is nothing to add.
    pub fn context_failure_hint(&self, e: &kvferry_ucx::Error) -> String {
        if e.status() != kvferry_ucx::Status::NO_DEVICE {
            return String::new();
        }
        let devices = self
            .net_devices
            .as_deref()
            .map(|d| format!(" on devices `{d}`"))
            .unwrap_or_default();
        match &self.transports {
            Transports::List(l) => format!(
                " (UCX has none of the transports `{l}`{devices}: `ucx_info -d` lists what it \
                 has; kvferry's presets are shm and tcp, and auto lets UCX choose)"
            ),
            _ if !devices.is_empty() => format!(
                " (UCX found no usable transport{devices}: `kvferry doctor` shows what each \
                 transport selects here)"
            ),
            _ => String::new(),
        }
    }

    /// A UCX context with these settings, for pools in `memory`.
    ///
    /// # Errors
    ///
    /// UCX cannot create the context (an unknown transport or device included;
    /// [`context_failure_hint`](Self::context_failure_hint) says more when it can).
    pub fn context_for(&self, memory: MemoryKind) -> Result<Arc<Context>, kvferry_ucx::Error> {
        self.ucx_settings(memory)
            .into_iter()
            .fold(Context::builder(), |b, (k, v)| b.config(k, v))
            .build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_specs_parse_presets_auto_and_ucx_lists() {
        let spec = |s: &str| s.parse::<TransportSpec>();
        assert_eq!(spec("tcp").unwrap(), Transport::Tcp.into());
        assert_eq!(spec("auto").unwrap().transports, Transports::Auto);
        assert_eq!(
            spec("rc_x,sm,self").unwrap().transports,
            Transports::List("rc_x,sm,self".into())
        );
        assert_eq!(
            spec("^cma").unwrap().transports,
            Transports::List("^cma".into())
        );
        for bad in ["", "rc x", "tcp,,self", "TCP;rm"] {
            let e = spec(bad).unwrap_err();
            assert!(e.contains("unknown transport"), "{bad}: {e}");
        }
        let mut veth = spec("tcp").unwrap();
        veth.net_devices = Some("veth0".into());
        assert_eq!(
            veth.ucx_settings(MemoryKind::Host),
            vec![
                ("TLS", "tcp".to_string()),
                ("NET_DEVICES", "veth0".to_string())
            ]
        );
        assert!(
            spec("auto")
                .unwrap()
                .ucx_settings(MemoryKind::Host)
                .is_empty()
        );
        assert_eq!(veth.to_string(), "tcp on veth0");
    }

    /// Peer error handling everywhere but shared memory alone, which UCX cannot carry in it.
    #[test]
    fn error_mode_is_peer_unless_the_transports_are_shared_memory_alone() {
        let mode = |s: &str| {
            let mut spec = s.parse::<TransportSpec>().unwrap();
            assert_eq!(spec.error_mode(), ErrorMode::None, "{s}: off by default");
            spec.ucx_peer_errors = true;
            spec.error_mode()
        };
        for shm in [
            "shm",
            "auto",
            "posix,sysv,self",
            "sm,self",
            "posix,sysv,self,cuda_copy,cuda_ipc",
        ] {
            assert_eq!(mode(shm), ErrorMode::None, "{shm}");
        }
        for peer in ["tcp", "rc_x,sm,self", "tcp,posix", "^cma", "^tcp", "cma"] {
            assert_eq!(mode(peer), ErrorMode::Peer, "{peer}");
        }
    }

    #[test]
    fn transports_and_memory_kinds_parse_and_print_their_names() {
        for (name, transport) in [("shm", Transport::Shm), ("tcp", Transport::Tcp)] {
            assert_eq!(name.parse::<Transport>(), Ok(transport));
            assert_eq!(transport.to_string(), name);
            assert_eq!(transport.as_ref(), name);
        }
        assert_eq!(
            "rdma".parse::<Transport>(),
            Err("unknown transport `rdma` (known: shm, tcp)".to_string())
        );
        for (name, memory) in [("host", MemoryKind::Host), ("cuda", MemoryKind::Cuda)] {
            assert_eq!(name.parse::<MemoryKind>(), Ok(memory));
            assert_eq!(memory.to_string(), name);
            assert_eq!(memory.as_ref(), name);
        }
        assert_eq!(
            "gpu".parse::<MemoryKind>(),
            Err("unknown memory `gpu` (known: host, cuda)".to_string())
        );
    }
}
