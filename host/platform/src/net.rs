//! The host's interface addresses.

use std::net::{IpAddr, Ipv6Addr};

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
}
