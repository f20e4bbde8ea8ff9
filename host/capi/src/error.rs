//! Status codes, the thread-local last error, and the guard every entry point runs under.

use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};

use kvferry::agent::{CallError, StartError};

use kvferry::config::{ConfigError, error_chain};

/// What a call returned: `KVFERRY_OK` (0), or why it failed. Functions return it as an `int`;
/// `kvferry_last_error` then has the text. New codes may be
/// added; treat an unknown non-zero one as a failure.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum kvferry_status {
    /// Success.
    KVFERRY_OK = 0,
    /// A pointer argument that must not be NULL was NULL.
    KVFERRY_ERR_NULL_POINTER = 1,
    /// An argument is malformed (text that is not UTF-8, an array too long to address).
    KVFERRY_ERR_INVALID_ARGUMENT = 2,
    /// The configuration was refused: not JSON, no or another `version`, an unknown field, a
    /// value out of range, an invalid page table.
    KVFERRY_ERR_CONFIG = 3,
    /// No planner could be bound (unknown id, refused deployment, no plugin directory), or
    /// the bound planner refuses this rank.
    KVFERRY_ERR_PLANNER = 4,
    /// UCX refused: no context for the transport, or no worker.
    KVFERRY_ERR_UCX = 5,
    /// The engine's pools could not be registered.
    KVFERRY_ERR_MEMORY = 6,
    /// The side channel could not listen, or no address can be advertised.
    KVFERRY_ERR_LISTEN = 7,
    /// A thread or file descriptor could not be made.
    KVFERRY_ERR_RESOURCES = 8,
    /// The call does not fit the agent's role (`send` on a decode rank, ...).
    KVFERRY_ERR_ROLE = 9,
    /// The request's parameters are wrong (slots outside the pools, a token range outside
    /// the prompt, ...). Nothing was taken; no event follows.
    KVFERRY_ERR_INVALID_REQUEST = 10,
    /// The request id is in use.
    KVFERRY_ERR_DUPLICATE = 11,
    /// No such request: never seen, or it has ended.
    KVFERRY_ERR_UNKNOWN_REQUEST = 12,
    /// Peer metadata that cannot be used.
    KVFERRY_ERR_METADATA = 13,
    /// The agent is shutting down.
    KVFERRY_ERR_STOPPED = 14,
    /// The caller's buffer is too small; the length needed was written.
    KVFERRY_ERR_BUFFER_TOO_SMALL = 15,
    /// A bug in kvferry: a panic was caught at the boundary. The agent may be unusable.
    KVFERRY_ERR_PANIC = 16,
    /// An error this version of the C API does not classify.
    KVFERRY_ERR_INTERNAL = 17,
}

use kvferry_status::*;

impl kvferry_status {
    /// Every status, for [`name`](Self::name) lookups by number.
    pub(crate) const ALL: [kvferry_status; 18] = [
        KVFERRY_OK,
        KVFERRY_ERR_NULL_POINTER,
        KVFERRY_ERR_INVALID_ARGUMENT,
        KVFERRY_ERR_CONFIG,
        KVFERRY_ERR_PLANNER,
        KVFERRY_ERR_UCX,
        KVFERRY_ERR_MEMORY,
        KVFERRY_ERR_LISTEN,
        KVFERRY_ERR_RESOURCES,
        KVFERRY_ERR_ROLE,
        KVFERRY_ERR_INVALID_REQUEST,
        KVFERRY_ERR_DUPLICATE,
        KVFERRY_ERR_UNKNOWN_REQUEST,
        KVFERRY_ERR_METADATA,
        KVFERRY_ERR_STOPPED,
        KVFERRY_ERR_BUFFER_TOO_SMALL,
        KVFERRY_ERR_PANIC,
        KVFERRY_ERR_INTERNAL,
    ];

    /// The constant's name, as a C string.
    pub(crate) fn name(self) -> &'static std::ffi::CStr {
        match self {
            KVFERRY_OK => c"KVFERRY_OK",
            KVFERRY_ERR_NULL_POINTER => c"KVFERRY_ERR_NULL_POINTER",
            KVFERRY_ERR_INVALID_ARGUMENT => c"KVFERRY_ERR_INVALID_ARGUMENT",
            KVFERRY_ERR_CONFIG => c"KVFERRY_ERR_CONFIG",
            KVFERRY_ERR_PLANNER => c"KVFERRY_ERR_PLANNER",
            KVFERRY_ERR_UCX => c"KVFERRY_ERR_UCX",
            KVFERRY_ERR_MEMORY => c"KVFERRY_ERR_MEMORY",
            KVFERRY_ERR_LISTEN => c"KVFERRY_ERR_LISTEN",
            KVFERRY_ERR_RESOURCES => c"KVFERRY_ERR_RESOURCES",
            KVFERRY_ERR_ROLE => c"KVFERRY_ERR_ROLE",
            KVFERRY_ERR_INVALID_REQUEST => c"KVFERRY_ERR_INVALID_REQUEST",
            KVFERRY_ERR_DUPLICATE => c"KVFERRY_ERR_DUPLICATE",
            KVFERRY_ERR_UNKNOWN_REQUEST => c"KVFERRY_ERR_UNKNOWN_REQUEST",
            KVFERRY_ERR_METADATA => c"KVFERRY_ERR_METADATA",
            KVFERRY_ERR_STOPPED => c"KVFERRY_ERR_STOPPED",
            KVFERRY_ERR_BUFFER_TOO_SMALL => c"KVFERRY_ERR_BUFFER_TOO_SMALL",
            KVFERRY_ERR_PANIC => c"KVFERRY_ERR_PANIC",
            KVFERRY_ERR_INTERNAL => c"KVFERRY_ERR_INTERNAL",
        }
    }
}

/// A failed call: its status and its text.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: kvferry_status,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(status: kvferry_status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn null(what: &str) -> Self {
        Self::new(KVFERRY_ERR_NULL_POINTER, format!("{what} is NULL"))
    }
}

impl From<CallError> for Failure {
    fn from(e: CallError) -> Self {
        let status = match &e {
            CallError::Role { .. } => KVFERRY_ERR_ROLE,
            CallError::Invalid { .. } => KVFERRY_ERR_INVALID_REQUEST,
            CallError::Duplicate { .. } => KVFERRY_ERR_DUPLICATE,
            CallError::Unknown { .. } => KVFERRY_ERR_UNKNOWN_REQUEST,
            CallError::Metadata(_) => KVFERRY_ERR_METADATA,
            CallError::Stopped => KVFERRY_ERR_STOPPED,
            _ => KVFERRY_ERR_INTERNAL,
        };
        Self::new(status, error_chain(&e))
    }
}

impl From<StartError> for Failure {
    fn from(e: StartError) -> Self {
        let status = match &e {
            StartError::Config(_) => KVFERRY_ERR_CONFIG,
            StartError::Context { .. } | StartError::Worker(_) => KVFERRY_ERR_UCX,
            StartError::Memory(_) => KVFERRY_ERR_MEMORY,
            StartError::Planner { .. } => KVFERRY_ERR_PLANNER,
            StartError::Listen(_) => KVFERRY_ERR_LISTEN,
            StartError::Spawn(_) | StartError::Io(_) => KVFERRY_ERR_RESOURCES,
            _ => KVFERRY_ERR_INTERNAL,
        };
        Self::new(status, error_chain(&e))
    }
}

impl From<ConfigError> for Failure {
    fn from(e: ConfigError) -> Self {
        match e {
            ConfigError::Invalid(m) => Self::new(KVFERRY_ERR_CONFIG, m),
            ConfigError::Planner(m) => Self::new(KVFERRY_ERR_PLANNER, m),
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

fn set_last_error(message: &str) {
    // Interior NULs would cut the C string short; nothing kvferry writes has one.
    let text = CString::new(message.replace('\0', "\u{fffd}")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = Some(text));
}

fn clear_last_error() {
    LAST_ERROR.with(|e| *e.borrow_mut() = None);
}

/// Copies the last error into `buf` (see [`crate::kvferry_last_error`]).
///
/// # Safety
///
/// `buf` is NULL or valid for `cap` bytes of writes.
pub(crate) unsafe fn copy_last_error(buf: *mut c_char, cap: usize) -> usize {
    LAST_ERROR.with(|e| {
        let e = e.borrow();
        let bytes = e.as_ref().map_or(&[][..], |s| s.as_bytes());
        if !buf.is_null() && cap > 0 {
            let n = bytes.len().min(cap - 1);
            // SAFETY: the caller grants `cap` writable bytes at `buf`; `n + 1 <= cap`, and
            // `bytes` is our own buffer, which cannot overlap the caller's.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, n);
                *buf.add(n) = 0;
            }
        }
        bytes.len()
    })
}

/// Runs one entry point: clears the last error, runs `body` with panics caught, and turns
/// its outcome into a status (setting the last error on failure).
pub(crate) fn guard(call: &str, body: impl FnOnce() -> Result<(), Failure>) -> c_int {
    clear_last_error();
    let failure = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return KVFERRY_OK as c_int,
        Ok(Err(f)) => f,
        Err(panic) => Failure::new(
            KVFERRY_ERR_PANIC,
            format!("{call} panicked: {}", panic_text(&*panic)),
        ),
    };
    set_last_error(&format!("{call}: {}", failure.message));
    failure.status as c_int
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".into()
    }
}
