//! An eventfd: a 64-bit counter behind a descriptor that is readable while it is non-zero.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// A non-blocking, close-on-exec eventfd this value owns.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A fresh eventfd with a zero counter.
    ///
    /// # Errors
    ///
    /// The kernel refused one (descriptor limit, memory).
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; a negative return is an error, reported below.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            // SAFETY: `raw` is a fresh descriptor this value alone owns from here on.
            fd: unsafe { OwnedFd::from_raw_fd(raw) },
        })
    }

    /// Adds one to the counter, making the descriptor readable. A full counter (EAGAIN)
    /// leaves it readable too, which is all a waiter needs, so nothing is reported.
    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to a descriptor this value owns.
        let _ = unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// Resets the counter to zero, so the descriptor is not readable until the next
    /// [`signal`](Self::signal). Never blocks.
    pub fn clear(&self) {
        let mut counter: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64 from a descriptor this value owns;
        // non-blocking, so a zero counter returns EAGAIN, which is ignored.
        let _ = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut counter as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::wait_readable;

    #[test]
    fn readable_from_signal_until_clear() {
        let fd = EventFd::new().unwrap();
        let quick = Duration::from_millis(10);
        assert!(!wait_readable(fd.as_raw_fd(), quick).unwrap());
        fd.signal();
        fd.signal();
        assert!(wait_readable(fd.as_raw_fd(), quick).unwrap());
        fd.clear();
        assert!(!wait_readable(fd.as_raw_fd(), quick).unwrap());
        // Clearing a zero counter does not block.
        fd.clear();
    }
}
