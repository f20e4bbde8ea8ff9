//! The UCP application context.

use std::ffi::CString;
use std::fmt;
use std::ptr;
use std::sync::Arc;

use ucx_sys as sys;

use crate::ffi::check;
use crate::status::WithOp;
use crate::{Error, MemoryTypes, Op, Status};

/// A UCP context (`ucp_context_h`) with the RMA, active-message and wake-up features.
///
/// Created through [`Context::builder`] (or [`Context::new`] for UCX's own configuration) and
/// shared through `Arc`: workers and memory regions keep it alive.
///
/// The context is created with `mt_workers_shared`, so its own operations (memory mapping,
/// remote-key packing, worker creation) are internally locked and it is `Send + Sync`.
///
/// `Drop` wraps `ucp_cleanup`.
#[doc(alias = "ucp_context_h")]
pub struct Context {
    handle: sys::ucp_context_h,
}

// SAFETY: the context is created with `mt_workers_shared = 1` and `build` verifies through
// `ucp_context_query` that UCX reports `UCS_THREAD_MODE_MULTI` for it, i.e. UCX serialises
// context-level calls (`ucp_mem_map`, `ucp_rkey_pack`, `ucp_worker_create`, ...) with its own
// lock. The handle itself is an immutable pointer.
unsafe impl Send for Context {}
// SAFETY: as above; every method takes `&self` and relies on UCX's context lock.
unsafe impl Sync for Context {}

impl Context {
    /// A builder for a context with configuration overrides.
    pub fn builder() -> ContextBuilder {
        ContextBuilder::default()
    }

    /// A context configured only by UCX's environment (`UCX_TLS`, `UCX_NET_DEVICES`, ...).
    ///
    /// # Errors
    ///
    /// As [`ContextBuilder::build`].
    pub fn new() -> Result<Arc<Context>, Error> {
        Context::builder().build()
    }

    /// The memory types this context can map and move: always [`MemoryType::HOST`], plus
    /// device memory when UCX was built with that device's support and its transports loaded
    /// (`cuda` needs a UCX configured `--with-cuda`, whose `ucx_info -d` lists `cuda_copy`).
    ///
    /// Wraps `ucp_context_query` with `UCP_ATTR_FIELD_MEMORY_TYPES`.
    ///
    /// # Errors
    ///
    /// [`Op::ContextQuery`] if UCX cannot answer the query.
    ///
    /// [`MemoryType::HOST`]: crate::MemoryType::HOST
    #[doc(alias = "ucp_context_query")]
    #[doc(alias = "UCP_ATTR_FIELD_MEMORY_TYPES")]
    pub fn memory_types(&self) -> Result<MemoryTypes, Error> {
        let mut attr = sys::ucp_context_attr_t {
            field_mask: sys::UCP_ATTR_FIELD_MEMORY_TYPES as u64,
            ..Default::default()
        };
        // SAFETY: `self.handle` is live for `&self`; `attr` is initialised with a field mask
        // naming only `memory_types`, which UCX fills in (and the struct is the size the
        // headers declare, so UCX writes nothing outside it).
        check(unsafe { sys::ucp_context_query(self.handle, &mut attr) }).op(Op::ContextQuery)?;
        Ok(MemoryTypes::from_bits(attr.memory_types))
    }

    pub(crate) fn as_raw(&self) -> sys::ucp_context_h {
        self.handle
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: `handle` came from a successful `ucp_init` and is released exactly once, here.
        // Workers and memory regions hold an `Arc<Context>`, so none of them is left.
        unsafe { sys::ucp_cleanup(self.handle) };
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("handle", &self.handle)
            .finish()
    }
}

/// Builds a [`Context`], applying UCX configuration overrides on top of the environment.
///
/// Override names are UCX configuration keys without the `UCX_` prefix, exactly as
/// `ucx_info -c` lists them: `.config("RNDV_THRESH", "inf")` has the effect of
/// `UCX_RNDV_THRESH=inf`. An override wins over the environment variable.
#[derive(Clone, Debug, Default)]
pub struct ContextBuilder {
    overrides: Vec<(String, String)>,
}

impl ContextBuilder {
    /// Selects the transports (`UCX_TLS`), e.g. `"posix,sysv,self"` for the shared-memory fast
    /// path or `"tcp"` (usually with [`net_devices`](Self::net_devices)`("lo")` on one host).
    pub fn tls(self, tls: impl Into<String>) -> ContextBuilder {
        self.config("TLS", tls)
    }

    /// Selects the network devices (`UCX_NET_DEVICES`), e.g. `"lo"`.
    pub fn net_devices(self, devices: impl Into<String>) -> ContextBuilder {
        self.config("NET_DEVICES", devices)
    }

    /// Sets any UCX configuration key (without the `UCX_` prefix).
    pub fn config(mut self, name: impl Into<String>, value: impl Into<String>) -> ContextBuilder {
        self.overrides.push((name.into(), value.into()));
        self
    }

    /// Reads the configuration, applies the overrides and creates the context.
    ///
    /// Wraps `ucp_config_read`, `ucp_config_modify`, `ucp_init` and `ucp_config_release`.
    ///
    /// # Errors
    ///
    /// * [`Op::ConfigRead`] if UCX cannot parse its environment.
    /// * [`Op::ConfigModify`] for a value UCX cannot parse, or a name or value containing NUL
    ///   ([`Status::INVALID_PARAM`]). Note that UCX 1.13 accepts *unknown* keys without error
    ///   (it keeps them for transport-level configuration), so a misspelt key is ignored.
    /// * [`Op::Init`] if no transport is usable, or [`Status::UNSUPPORTED`] if this UCX build
    ///   cannot share a context between threads (it was configured without `--enable-mt`).
    #[doc(alias = "ucp_init")]
    #[doc(alias = "ucp_config_read")]
    #[doc(alias = "ucp_config_modify")]
    pub fn build(self) -> Result<Arc<Context>, Error> {
        let config = Config::read()?;
        for (name, value) in &self.overrides {
            config.modify(name, value)?;
        }

        let params = sys::ucp_params_t {
            field_mask: (sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED)
                as u64,
            features: (sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP) as u64,
            mt_workers_shared: 1,
            ..Default::default()
        };
        let mut handle = ptr::null_mut();
        // SAFETY: `params` is initialised and names only the fields set above; `config.0` is a
        // live configuration released after this call (by `Config`'s drop); `handle` is a valid
        // out-pointer.
        check(unsafe { sys::ucp_init(&params, config.0, &mut handle) }).op(Op::Init)?;
        let context = Context { handle };

        let mut attr = sys::ucp_context_attr_t {
            field_mask: sys::UCP_ATTR_FIELD_THREAD_MODE as u64,
            ..Default::default()
        };
        // SAFETY: `context.handle` is live; `attr` is initialised with a field mask naming only
        // `thread_mode`, which UCX fills in.
        check(unsafe { sys::ucp_context_query(context.handle, &mut attr) }).op(Op::ContextQuery)?;
        if attr.thread_mode != sys::UCS_THREAD_MODE_MULTI {
            return Err(Error::new(Op::Init, Status::UNSUPPORTED));
        }
        let copies = crate::library::loaded_copies();
        if copies.len() > 1 {
            tracing::warn!(
                copies = ?copies,
                "more than one UCX is loaded in this process; two copies deadlock or corrupt \
                 each other (kvferry doctor; README \"Which UCX\")"
            );
        }
        Ok(Arc::new(context))
    }
}

/// A `ucp_config_t` read from the environment, released on drop.
struct Config(*mut sys::ucp_config_t);

impl Config {
    fn read() -> Result<Config, Error> {
        let mut config = ptr::null_mut();
        // SAFETY: null `env_prefix` and `filename` select the defaults (`UCX_` and no file);
        // `config` is a valid out-pointer.
        check(unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut config) })
            .op(Op::ConfigRead)?;
        Ok(Config(config))
    }

    fn modify(&self, name: &str, value: &str) -> Result<(), Error> {
        let invalid = |_| Error::new(Op::ConfigModify, Status::INVALID_PARAM);
        let name = CString::new(name).map_err(invalid)?;
        let value = CString::new(value).map_err(invalid)?;
        // SAFETY: `self.0` is a live configuration; both strings are NUL-terminated and outlive
        // the call (UCX copies the value).
        check(unsafe { sys::ucp_config_modify(self.0, name.as_ptr(), value.as_ptr()) })
            .op(Op::ConfigModify)
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from a successful `ucp_config_read` and is released once, here;
        // `ucp_init` does not keep a reference to it.
        unsafe { sys::ucp_config_release(self.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_config_value_is_reported() {
        let err = Context::builder()
            .config("RNDV_THRESH", "not-a-size")
            .build()
            .unwrap_err();
        assert_eq!(err.op(), Op::ConfigModify);
    }

    #[test]
    fn nul_in_override_is_invalid_param() {
        let err = Context::builder().tls("tcp\0posix").build().unwrap_err();
        assert_eq!(
            (err.op(), err.status()),
            (Op::ConfigModify, Status::INVALID_PARAM)
        );
    }

    #[test]
    fn every_context_reports_host_memory() {
        for ctx in [
            Context::builder().tls("posix,sysv,self").build().unwrap(),
            Context::builder()
                .tls("tcp")
                .net_devices("lo")
                .build()
                .unwrap(),
            Context::new().unwrap(),
        ] {
            let types = ctx.memory_types().unwrap();
            // Only presence of host memory is asserted: a CUDA-enabled UCX reports more.
            assert!(
                types.contains(crate::MemoryType::HOST),
                "no host memory in {types}"
            );
        }
    }

    #[test]
    fn shm_and_tcp_contexts_build() {
        Context::builder().tls("posix,sysv,self").build().unwrap();
        Context::builder()
            .tls("tcp")
            .net_devices("lo")
            .build()
            .unwrap();
    }
}
