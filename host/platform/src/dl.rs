//! Which file an address was loaded from.

use std::ffi::{CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// The file of the loaded object (executable or shared library) that holds `address`, as the
/// dynamic loader names it; `None` when no loaded object holds it. Pass the address of a
/// function of the caller's own crate to learn where the caller was loaded from.
pub fn object_file_of(address: *const ()) -> Option<PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only looks `address` up in the loader's tables (it never reads through
    // it); `info` is writable and dladdr fills it, or returns 0 and it is left unread.
    let found = unsafe { libc::dladdr(address.cast(), info.as_mut_ptr()) };
    if found == 0 {
        return None;
    }
    // SAFETY: dladdr succeeded, so it initialised `info`.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr's `dli_fname` is a NUL-terminated path owned by the dynamic loader,
    // valid while the object stays loaded; it is copied before this returns.
    let file = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(OsStr::from_bytes(file.to_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_function_here_lies_in_this_test_executable() {
        let file = object_file_of(a_function_here_lies_in_this_test_executable as *const ())
            .expect("the test executable is a loaded object");
        let exe = std::env::current_exe().unwrap();
        assert_eq!(
            std::fs::canonicalize(file).unwrap(),
            std::fs::canonicalize(exe).unwrap()
        );
    }

    #[test]
    fn no_object_holds_address_zero() {
        assert_eq!(object_file_of(std::ptr::null()), None);
    }
}
