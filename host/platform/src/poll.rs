//! Waiting for one descriptor to become readable.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

/// Waits up to `timeout` (to the nanosecond, as `ppoll` takes it: a worker's 100 µs nap is
/// one) for `fd` to be readable; whether it is. A signal that interrupts the wait counts as a
/// timeout. A descriptor that is not open is an error, not undefined behaviour: poll reports
/// it.
///
/// # Errors
///
/// `fd` is not an open descriptor, or poll failed.
pub fn wait_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
    wait_any_readable(&[fd], timeout)
}

/// Waits up to `timeout` (as [`wait_readable`]) for any of `fds` (at most
/// [`MAX_WAIT_FDS`]) to be readable; whether one is. A negative descriptor is skipped.
///
/// # Errors
///
/// One of `fds` is not an open descriptor, there are more than [`MAX_WAIT_FDS`], or poll
/// failed.
pub fn wait_any_readable(fds: &[RawFd], timeout: Duration) -> io::Result<bool> {
    if fds.len() > MAX_WAIT_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} descriptors to wait on, at most {MAX_WAIT_FDS}",
                fds.len()
            ),
        ));
    }
    let mut entries = [libc::pollfd {
        fd: -1,
        events: libc::POLLIN,
        revents: 0,
    }; MAX_WAIT_FDS];
    for (entry, &fd) in entries.iter_mut().zip(fds) {
        entry.fd = fd;
    }
    let entries = &mut entries[..fds.len()];
    let timeout = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: timeout.subsec_nanos().into(),
    };
    // SAFETY: `entries` is a live, writable slice of pollfds and the count is its length
    // (at most MAX_WAIT_FDS); the timeout is a valid timespec and no signal mask is passed;
    // ppoll reads the descriptor numbers only (an invalid one comes back as POLLNVAL).
    let ready = unsafe {
        libc::ppoll(
            entries.as_mut_ptr(),
            entries.len() as libc::nfds_t,
            &timeout,
            std::ptr::null(),
        )
    };
    if ready < 0 {
        let error = io::Error::last_os_error();
        return if error.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(error)
        };
    }
    if entries.iter().any(|e| e.revents & libc::POLLNVAL != 0) {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    Ok(entries
        .iter()
        .any(|e| e.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0))
}

/// The most descriptors [`wait_any_readable`] takes at once.
pub const MAX_WAIT_FDS: usize = 8;

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    #[test]
    fn a_descriptor_that_is_not_open_is_an_error() {
        // poll skips a negative descriptor, as it documents.
        assert!(!wait_readable(-1, Duration::ZERO).unwrap());
        let error = wait_readable(1 << 20, Duration::ZERO).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EBADF));
    }

    #[test]
    fn any_of_several_descriptors_wakes_the_wait() {
        let (a, b) = (
            crate::EventFd::new().unwrap(),
            crate::EventFd::new().unwrap(),
        );
        let fds = [a.as_raw_fd(), -1, b.as_raw_fd()];
        let quick = Duration::from_millis(10);
        assert!(!wait_any_readable(&fds, quick).unwrap());
        b.signal();
        assert!(wait_any_readable(&fds, quick).unwrap());
        b.clear();
        a.signal();
        assert!(wait_any_readable(&fds, quick).unwrap());
        let error = wait_any_readable(&[a.as_raw_fd(); MAX_WAIT_FDS + 1], quick).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput);
        let error = wait_any_readable(&[a.as_raw_fd(), 1 << 20], quick).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EBADF));
    }
}
