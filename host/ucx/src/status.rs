//! UCX status codes and this crate's error type.

use std::ffi::CStr;
use std::fmt;

use ucx_sys::ucs_status_t;

use crate::rkey_format::KeyFormatError;

/// A UCX status code (`ucs_status_t`), as returned by a failed call or a failed request.
///
/// Any code is representable, including ones this crate does not name. `Display` prints UCX's
/// own message (`ucs_status_string`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status(ucs_status_t);

impl Status {
    /// No resources are available to initiate the operation (`UCS_ERR_NO_RESOURCE`).
    pub const NO_RESOURCE: Status = Status(ucs_status_t::UCS_ERR_NO_RESOURCE);
    /// Input/output error (`UCS_ERR_IO_ERROR`).
    pub const IO_ERROR: Status = Status(ucs_status_t::UCS_ERR_IO_ERROR);
    /// Out of memory (`UCS_ERR_NO_MEMORY`).
    pub const NO_MEMORY: Status = Status(ucs_status_t::UCS_ERR_NO_MEMORY);
    /// Invalid parameter (`UCS_ERR_INVALID_PARAM`); also returned by this crate for arguments it
    /// rejects before calling UCX.
    pub const INVALID_PARAM: Status = Status(ucs_status_t::UCS_ERR_INVALID_PARAM);
    /// Invalid address (`UCS_ERR_INVALID_ADDR`); also returned by this crate for a peer range
    /// that a remote key does not map ([`RemoteKey::check_range`]).
    ///
    /// [`RemoteKey::check_range`]: crate::RemoteKey::check_range
    pub const INVALID_ADDR: Status = Status(ucs_status_t::UCS_ERR_INVALID_ADDR);
    /// Destination is unreachable (`UCS_ERR_UNREACHABLE`).
    pub const UNREACHABLE: Status = Status(ucs_status_t::UCS_ERR_UNREACHABLE);
    /// No such element, e.g. an unknown configuration key (`UCS_ERR_NO_ELEM`).
    pub const NO_ELEM: Status = Status(ucs_status_t::UCS_ERR_NO_ELEM);
    /// Device is busy (`UCS_ERR_BUSY`).
    pub const BUSY: Status = Status(ucs_status_t::UCS_ERR_BUSY);
    /// Request canceled (`UCS_ERR_CANCELED`).
    pub const CANCELED: Status = Status(ucs_status_t::UCS_ERR_CANCELED);
    /// Operation timed out (`UCS_ERR_TIMED_OUT`).
    pub const TIMED_OUT: Status = Status(ucs_status_t::UCS_ERR_TIMED_OUT);
    /// Unsupported operation (`UCS_ERR_UNSUPPORTED`).
    pub const UNSUPPORTED: Status = Status(ucs_status_t::UCS_ERR_UNSUPPORTED);
    /// No such device (`UCS_ERR_NO_DEVICE`): e.g. none of the transports or devices a
    /// context was limited to exists.
    pub const NO_DEVICE: Status = Status(ucs_status_t::UCS_ERR_NO_DEVICE);
    /// Endpoint is not connected (`UCS_ERR_NOT_CONNECTED`).
    pub const NOT_CONNECTED: Status = Status(ucs_status_t::UCS_ERR_NOT_CONNECTED);
    /// Connection reset by remote peer (`UCS_ERR_CONNECTION_RESET`).
    pub const CONNECTION_RESET: Status = Status(ucs_status_t::UCS_ERR_CONNECTION_RESET);
    /// Endpoint timeout (`UCS_ERR_ENDPOINT_TIMEOUT`).
    pub const ENDPOINT_TIMEOUT: Status = Status(ucs_status_t::UCS_ERR_ENDPOINT_TIMEOUT);

    pub(crate) fn from_raw(raw: ucs_status_t) -> Status {
        Status(raw)
    }

    /// The numeric `ucs_status_t` value (negative for errors).
    pub fn code(self) -> i8 {
        self.0.0
    }

    /// UCX's description of the code, e.g. `"Request canceled"`.
    #[doc(alias = "ucs_status_string")]
    pub fn message(self) -> &'static str {
        let code = self.code();
        // `ucs_status_string` formats codes it has no literal for into one static buffer, which
        // races with every other caller; only ask it about codes the header names (and its
        // switch lists, see ucs/type/status.c).
        if !((-25..=1).contains(&code) || code == ucs_status_t::UCS_ERR_ENDPOINT_TIMEOUT.0) {
            return if (-59..=-40).contains(&code) {
                "Unknown link failure"
            } else if (-89..=-60).contains(&code) {
                "Unknown endpoint failure"
            } else {
                "Unknown error"
            };
        }
        // SAFETY: for the codes above `ucs_status_string` returns a pointer to a string literal:
        // non-null, NUL-terminated and valid for the life of the loaded library, which is never
        // unloaded.
        let text = unsafe { CStr::from_ptr(ucx_sys::ucs_status_string(self.0)) };
        text.to_str().unwrap_or("Unknown error")
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Status({}: {})", self.code(), self.message())
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message().to_lowercase())
    }
}

impl std::error::Error for Status {}

/// The UCX call that failed.
///
/// `Display` prints the C function's name, so logs can be matched against the UCX
/// documentation directly.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
#[non_exhaustive]
pub enum Op {
    /// Completing an active-message receive (`ucp_am_recv_data_nbx`).
    AmRecvData,
    /// Sending an active message (`ucp_am_send_nbx`).
    AmSend,
    /// Applying a configuration override (`ucp_config_modify`).
    ConfigModify,
    /// Reading the UCX configuration (`ucp_config_read`).
    ConfigRead,
    /// Querying the context (`ucp_context_query`).
    ContextQuery,
    /// Closing an endpoint (`ucp_ep_close_nbx`).
    EpClose,
    /// Creating an endpoint (`ucp_ep_create`).
    EpCreate,
    /// Flushing an endpoint (`ucp_ep_flush_nbx`).
    Flush,
    /// Creating the context (`ucp_init`).
    Init,
    /// Mapping or allocating memory (`ucp_mem_map`).
    MemMap,
    /// Querying a mapping (`ucp_mem_query`).
    MemQuery,
    /// A one-sided write (`ucp_put_nbx`).
    Put,
    /// Packing a memory region's remote key (`ucp_rkey_pack`).
    RkeyPack,
    /// Translating a peer address through its remote key (`ucp_rkey_ptr`), or a declared
    /// range that the key does not map ([`RemoteKey::check_range`]).
    ///
    /// [`RemoteKey::check_range`]: crate::RemoteKey::check_range
    RkeyPtr,
    /// Unpacking a peer's remote key (`ucp_ep_rkey_unpack`).
    RkeyUnpack,
    /// Installing an active-message handler (`ucp_worker_set_am_recv_handler`).
    SetAmHandler,
    /// Getting the worker's address (`ucp_worker_get_address`).
    WorkerAddress,
    /// Creating a worker (`ucp_worker_create`).
    WorkerCreate,
    /// Arming a worker's wake-up descriptor (`ucp_worker_arm`).
    WorkerArm,
    /// Getting a worker's wake-up descriptor (`ucp_worker_get_efd`).
    WorkerEventFd,
}

impl Op {
    /// The name of the wrapped C function.
    pub fn c_name(self) -> &'static str {
        match self {
            Op::AmRecvData => "ucp_am_recv_data_nbx",
            Op::AmSend => "ucp_am_send_nbx",
            Op::ConfigModify => "ucp_config_modify",
            Op::ConfigRead => "ucp_config_read",
            Op::ContextQuery => "ucp_context_query",
            Op::EpClose => "ucp_ep_close_nbx",
            Op::EpCreate => "ucp_ep_create",
            Op::Flush => "ucp_ep_flush_nbx",
            Op::Init => "ucp_init",
            Op::MemMap => "ucp_mem_map",
            Op::MemQuery => "ucp_mem_query",
            Op::Put => "ucp_put_nbx",
            Op::RkeyPack => "ucp_rkey_pack",
            Op::RkeyPtr => "ucp_rkey_ptr",
            Op::RkeyUnpack => "ucp_ep_rkey_unpack",
            Op::SetAmHandler => "ucp_worker_set_am_recv_handler",
            Op::WorkerAddress => "ucp_worker_get_address",
            Op::WorkerCreate => "ucp_worker_create",
            Op::WorkerArm => "ucp_worker_arm",
            Op::WorkerEventFd => "ucp_worker_get_efd",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.c_name())
    }
}

/// A failed UCX operation: which call failed ([`Op`]) and the status it failed with.
///
/// `Display` names the call ("ucp_put_nbx failed"); the UCX status is the error's `source()`.
/// A peer's remote key that this crate refused before UCX saw it is the exception: the call
/// was not made ("ucp_ep_rkey_unpack not called: malformed remote key"), the status is
/// [`Status::INVALID_PARAM`], and the source is what is wrong with the key
/// ([`key_format`](Self::key_format)).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Error {
    op: Op,
    status: Status,
    malformed_key: Option<KeyFormatError>,
}

impl Error {
    /// An error for `op` failing with `status`.
    pub fn new(op: Op, status: Status) -> Error {
        Error {
            op,
            status,
            malformed_key: None,
        }
    }

    /// [`Op::RkeyUnpack`] refused before the call: the key's layout is wrong.
    pub(crate) fn refused_key(why: KeyFormatError) -> Error {
        Error {
            op: Op::RkeyUnpack,
            status: Status::INVALID_PARAM,
            malformed_key: Some(why),
        }
    }

    /// The call that failed.
    pub fn op(&self) -> Op {
        self.op
    }

    /// The status it failed with.
    pub fn status(&self) -> Status {
        self.status
    }

    /// What is wrong with a peer's packed remote key, when the error is that key's refusal
    /// (before `ucp_ep_rkey_unpack`, which would have read past its end).
    pub fn key_format(&self) -> Option<&KeyFormatError> {
        self.malformed_key.as_ref()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.malformed_key {
            Some(_) => write!(f, "{} not called: malformed remote key", self.op),
            None => write!(f, "{} failed", self.op),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.malformed_key {
            Some(why) => Some(why),
            None => Some(&self.status),
        }
    }
}

/// Attaches the failing [`Op`] to a bare [`Status`].
pub(crate) trait WithOp<T> {
    fn op(self, op: Op) -> Result<T, Error>;
}

impl<T> WithOp<T> for Result<T, Status> {
    fn op(self, op: Op) -> Result<T, Error> {
        self.map_err(|status| Error::new(op, status))
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn named_codes_have_library_messages() {
        for code in (-25..=1).chain([-80]) {
            let message = Status(ucs_status_t(code)).message();
            assert!(!message.starts_with("Unknown"), "{code}: {message}");
        }
        assert_eq!(Status::CANCELED.message(), "Request canceled");
    }

    #[test]
    fn unnamed_codes_do_not_reach_the_static_buffer() {
        assert_eq!(Status(ucs_status_t(-45)).message(), "Unknown link failure");
        assert_eq!(
            Status(ucs_status_t(-70)).message(),
            "Unknown endpoint failure"
        );
        assert_eq!(Status(ucs_status_t(-99)).message(), "Unknown error");
        assert_eq!(Status(ucs_status_t(7)).message(), "Unknown error");
    }

    #[test]
    fn a_refused_key_names_what_is_wrong_with_it() {
        let why = KeyFormatError::HeaderTruncated { len: 4 };
        let err = Error::refused_key(why);
        assert_eq!(
            err.to_string(),
            "ucp_ep_rkey_unpack not called: malformed remote key"
        );
        assert_eq!(
            err.source().unwrap().to_string(),
            "4 bytes, fewer than the 9 of its header (a 64-bit md map and a memory type)"
        );
        assert_eq!(
            (err.op(), err.status(), err.key_format()),
            (Op::RkeyUnpack, Status::INVALID_PARAM, Some(&why))
        );
        assert_eq!(
            Error::new(Op::RkeyUnpack, Status::UNREACHABLE).key_format(),
            None
        );
    }

    #[test]
    fn error_names_the_call_and_sources_the_status() {
        let err = Error::new(Op::Put, Status::IO_ERROR);
        assert_eq!(err.to_string(), "ucp_put_nbx failed");
        assert_eq!(err.source().unwrap().to_string(), "input/output error");
        assert_eq!(
            format!("{:?}", Status::IO_ERROR),
            "Status(-3: Input/output error)"
        );
    }
}
