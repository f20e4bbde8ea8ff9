//! The host's interface addresses, and sending on a socket without waiting.

use std::io;
use std::net::{IpAddr, Ipv6Addr, TcpStream};
use std::os::fd::AsRawFd;

/// The first non-loopback address of an interface that is up: IPv4 unless `v6`; for IPv6,
/// neither loopback nor link-local (`fe80::/10`, which needs a scope to be reached). `None`
/// when there is none, or the list cannot be read.
pub fn first_interface_address(v6: bool) -> Option<IpAddr> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `list`, freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cursor = list;
    while !cursor.is_null() && found.is_none() {
        // SAFETY: `cursor` is a node of the list getifaddrs returned, not yet freed.
        let node = unsafe { &*cursor };
        cursor = node.ifa_next;
        let up = node.ifa_flags & (libc::IFF_UP as u32) != 0;
        let loopback = node.ifa_flags & (libc::IFF_LOOPBACK as u32) != 0;
        if !up || loopback || node.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: `ifa_addr` is non-null and points at a sockaddr whose family says its type.
        let family = i32::from(unsafe { (*node.ifa_addr).sa_family });
        if family == libc::AF_INET && !v6 {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*(node.ifa_addr as *const libc::sockaddr_in) };
            found = Some(IpAddr::from(
                u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
            ));
        } else if family == libc::AF_INET6 && v6 {
            // SAFETY: an AF_INET6 address is a sockaddr_in6.
            let sin6 = unsafe { &*(node.ifa_addr as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            if !ip.is_loopback() && (ip.segments()[0] & 0xffc0) != 0xfe80 {
                found = Some(IpAddr::V6(ip));
            }
        }
    }
    // SAFETY: `list` came from getifaddrs and is freed once; no node is used after this.
    unsafe { libc::freeifaddrs(list) };
    found
}

/// Sends what of `buf` the socket takes now, without waiting and without raising `SIGPIPE`
/// (`send` with `MSG_DONTWAIT | MSG_NOSIGNAL`): the bytes sent, which may be fewer than
/// `buf.len()`. The socket itself stays in whatever mode it is in, so a blocking socket
/// shared with another thread (a writer that waits on it, a reader) is left as it was.
///
/// # Errors
///
/// [`io::ErrorKind::WouldBlock`] when the socket's send buffer is full, and what `send`
/// reports otherwise (a reset or closed connection, an interrupted call).
pub fn send_now(socket: &TcpStream, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live, readable slice and `send` reads at most `buf.len()` bytes of
    // it; the descriptor is the stream's own, open while `socket` is borrowed (a closed one
    // comes back as EBADF, not undefined behaviour).
    let sent = unsafe {
        libc::send(
            socket.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sent as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_a_loopback_or_link_local_address() {
        if let Some(ip) = first_interface_address(false) {
            assert!(
                ip.is_ipv4() && !ip.is_loopback() && !ip.is_unspecified(),
                "{ip}"
            );
        }
        if let Some(IpAddr::V6(ip)) = first_interface_address(true) {
            assert!(
                !ip.is_loopback() && (ip.segments()[0] & 0xffc0) != 0xfe80,
                "{ip}"
            );
        }
    }

    #[test]
    fn send_now_stops_at_a_full_socket_and_fails_on_a_closed_one() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let socket = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut peer, _) = listener.accept().unwrap();
        // A blocking socket whose peer does not read: taken until its buffers fill, then
        // WouldBlock, never a wait.
        let chunk = vec![5u8; 1 << 20];
        let mut taken = 0usize;
        let full = loop {
            match send_now(&socket, &chunk) {
                Ok(n) => taken += n,
                Err(e) => break e,
            }
            assert!(taken < 1 << 30, "a socket took 1 GiB unread");
        };
        assert_eq!(full.kind(), io::ErrorKind::WouldBlock, "{full}");
        assert!(taken > 0);
        // Still blocking for everyone else: the peer reads what was taken.
        let mut back = vec![0u8; taken];
        peer.read_exact(&mut back).unwrap();
        assert!(back.iter().all(|&b| b == 5));
        // The peer gone: an error (reset or broken pipe), not SIGPIPE.
        drop(peer);
        let mut closed = None;
        for _ in 0..100 {
            if let Err(e) = send_now(&socket, &chunk) {
                if e.kind() != io::ErrorKind::WouldBlock {
                    closed = Some(e);
                    break;
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let closed = closed.expect("sends to a closed connection kept succeeding");
        assert!(
            matches!(
                closed.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ),
            "{closed}"
        );
    }
}
