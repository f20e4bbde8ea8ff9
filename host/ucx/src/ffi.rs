//! The only code that interprets UCX return conventions (openssl's `cvt`, git2's `try_call!`).

use std::os::raw::c_void;
use std::ptr::NonNull;

use ucx_sys::{ucs_status_ptr_t, ucs_status_t};

use crate::Status;

/// `UCS_OK` becomes `Ok`; every other code is an error.
///
/// Synchronous UCX calls never return `UCS_INPROGRESS`; if one did, treating it as a failure is
/// the conservative reading.
pub(crate) fn check(status: ucs_status_t) -> Result<(), Status> {
    if status == ucs_status_t::UCS_OK {
        Ok(())
    } else {
        Err(Status::from_raw(status))
    }
}

/// Decodes the `ucs_status_ptr_t` of a `*_nbx` call: null is "completed in place" (`None`), an
/// error code is `Err`, anything else is a request handle the caller now owns.
pub(crate) fn check_ptr(ptr: ucs_status_ptr_t) -> Result<Option<RawRequest>, Status> {
    if ucx_sys::UCS_PTR_IS_ERR(ptr) {
        Err(Status::from_raw(ucx_sys::UCS_PTR_RAW_STATUS(ptr)))
    } else if ucx_sys::UCS_PTR_IS_PTR(ptr) {
        Ok(NonNull::new(ptr).map(RawRequest))
    } else {
        Ok(None)
    }
}

/// A request handle returned by a `*_nbx` call, not yet released with `ucp_request_free`.
///
/// It has no `Drop`: [`crate::Request`] decides when UCX is done with it.
#[derive(Debug)]
pub(crate) struct RawRequest(NonNull<c_void>);

impl RawRequest {
    pub(crate) fn as_ptr(&self) -> *mut c_void {
        self.0.as_ptr()
    }
}

/// A byte slice from a C `(pointer, length)` pair that allows `(null, 0)` (UCX passes null data
/// for empty active-message payloads, which `slice::from_raw_parts` does not accept).
///
/// # Safety
///
/// 1. If `len > 0`, `ptr` is valid for reads of `len` bytes for `'a`.
/// 2. Those bytes are initialised and not written while the slice lives.
pub(crate) unsafe fn bytes<'a>(ptr: *const c_void, len: usize) -> &'a [u8] {
    if len == 0 {
        &[]
    } else {
        // SAFETY: `len > 0`, so the caller guarantees `ptr` is valid, initialised and unaliased
        // by writers for `len` bytes for `'a`; `u8` has no alignment requirement.
        unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_the_three_cases() {
        assert!(matches!(check_ptr(std::ptr::null_mut()), Ok(None)));
        let err = ucx_sys::UCS_STATUS_PTR(ucs_status_t::UCS_ERR_CANCELED);
        assert_eq!(check_ptr(err).unwrap_err(), Status::CANCELED);
        let mut slot = 0u64;
        let req = check_ptr((&raw mut slot).cast()).unwrap().unwrap();
        assert_eq!(req.as_ptr(), (&raw mut slot).cast());
    }

    #[test]
    fn check_accepts_only_ok() {
        assert!(check(ucs_status_t::UCS_OK).is_ok());
        assert!(check(ucs_status_t::UCS_INPROGRESS).is_err());
        assert_eq!(check(ucs_status_t::UCS_ERR_BUSY), Err(Status::BUSY));
    }
}
