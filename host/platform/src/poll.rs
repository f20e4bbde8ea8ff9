//! Waiting for one descriptor to become readable.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

/// Waits up to `timeout` (at most `i32::MAX` milliseconds; rounded down) for `fd` to be
/// readable; whether it is. A signal that interrupts the wait counts as a timeout. A
/// descriptor that is not open is an error, not undefined behaviour: poll reports it.
///
/// # Errors
///
/// `fd` is not an open descriptor, or poll failed.
pub fn wait_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
    let mut entry = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let millis = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: `entry` is one live, writable pollfd and the count says one; poll reads the
    // descriptor number only (an invalid one comes back as POLLNVAL).
    let ready = unsafe { libc::poll(&mut entry, 1, millis) };
    if ready < 0 {
        let error = io::Error::last_os_error();
        return if error.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(error)
        };
    }
    if entry.revents & libc::POLLNVAL != 0 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    Ok(entry.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_that_is_not_open_is_an_error() {
        // poll skips a negative descriptor, as it documents.
        assert!(!wait_readable(-1, Duration::ZERO).unwrap());
        let error = wait_readable(1 << 20, Duration::ZERO).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EBADF));
    }
}
