//! Which process a peer's shared-memory transports and remote keys belong to, read from the
//! bytes UCX packs (its worker address, its remote keys), so that a peer can only have this
//! process write into memory of the process whose worker it proved.
//!
//! # Why
//!
//! Over shared memory UCX writes where the *key* says, not where the endpoint goes: a
//! `posix`, `sysv` or `xpmem` put is a copy into the segment the unpacked key mapped
//! (1.22.0 `src/uct/sm/base/sm_ep.c:20-45`), and the segment is whatever the key names
//! (`posix`: `/proc/<pid>/fd/<fd>`, `sysv`: a segment id, `xpmem`: a process's segment id),
//! whoever it belongs to. A worker proof shows that the peer owns the worker its address
//! names, and nothing about its keys: a peer holding the deployment's secret proved its own
//! worker and declared another decode process's pool key, and the prefill rank copied into
//! that process. Lanes are chosen per transport (1.22.0
//! `src/ucp/wireup/select.c`), so even one worker address can name the `posix` receive FIFO
//! of one process and the `cma` target of another.
//!
//! # What is checked
//!
//! [`PeerProcess::of_address`] walks the packed worker address ([`address_entries`]) and
//! derives, from every shared-memory transport it has, the process that owns it: `posix` (its
//! receive FIFO's segment id names `/proc/<pid>/fd/<fd>` of the owner), `cma` (its address is
//! the pid that `process_vm_writev` targets), `sysv` (its FIFO's segment, whose creator the
//! kernel tells), `xpmem` (the owner's process-wide segment id). They must all be one process.
//! [`PeerProcess::check_key`] then reads every entry of a packed remote key that UCX would
//! unpack for that address (the entry's md index names the address's transport entry, as UCP
//! itself maps them: 1.22.0 `src/ucp/wireup/wireup.c:1455-1527`) and requires its segment to
//! be that process's: a `posix` key's pid, a `sysv` segment's creator, an `xpmem` segment id.
//! A `knem` key (an opaque kernel cookie) cannot be checked and is refused; so is a `posix`
//! key without a pid (`UCX_POSIX_USE_PROC_LINK=n`).
//!
//! # What it cannot see
//!
//! Network keys (`tcp`, InfiniBand `rc`/`dc`/`ud`) are resolved by the receiver's own UCX
//! against its own registrations, so a forged one reaches nothing here, but who registered an
//! InfiniBand region cannot be read from its key. `cuda_ipc` keys name another process's
//! device allocation; their owner is not checked here. A process that can itself open
//! another's `posix` segment (same user, `/proc/<pid>/fd`) can pass it off as its own: it
//! gains nothing it did not have. Pids are compared within the peer's pid namespace (UCX
//! refuses `posix` and `cma` peers in another namespace); a `sysv` creator is the kernel's,
//! in this process's namespace.
//!
//! # Layouts (UCX 1.13.1 and 1.22.0; host byte order)
//!
//! ```text
//! worker address (src/ucp/wireup/address.c):
//!   v1: u8 version | flags << 4          v2: u8 version | minor << 4, u8 flags
//!   u64 uuid (always in v1)   [u64 client id]   [u8 len, name: debug info]
//!   0xff: no devices; else devices until one whose length byte has bit 7:
//!     u8 md (bit 7: no transports; index: low 7 bits from 1.19, low 5 up to 1.18)
//!     u8 flags | len (bit 7 last, bit 6 paths follow, bit 5 system device follows)
//!     [u8 paths] [u8 sys_dev] device address[len]
//!     unless empty, transports until one whose length byte has bit 7:
//!       u16 crc16(name)  attributes (16 bytes v1, 8 v2)
//!       u8 flags | len (bit 7 last, bit 6 endpoint addresses follow)  iface address[len]
//!       [ { u8 len, ep address[len], u8 lane (bit 7 last) } ... ]
//!   v2 extends an md index of 0x7f, a device length of 0x1f and an iface length of 0x3f
//!   with a following byte.
//! iface addresses:  posix  u64 FIFO segment id [u32 pid namespace]
//!                   sysv   u64 FIFO segment id (a shmid)
//!                   xpmem  u64 FIFO address, i64 segment id
//!                   cma    i32 pid (bit 31: u32 pid namespace follows)
//! transport keys:   posix  u64 segment id, u64 address, u64 length
//!                   sysv   u32 shmid, u64 owner address
//!                   xpmem  i64 segment id, u64 address, u64 length
//! posix segment id: bit 63 procfs (then pid = bits 0-29, fd = bits 30-59), bit 62 shm_open,
//!                   bit 61 hugetlb, bit 60 pid namespace
//! ```
//!
//! (1.22.0: `mm_posix.c:33-65,152-174`, `mm_sysv.c:23-26`, `mm_xpmem.c:45-53`,
//! `mm_iface.h:126-129`, `cma_iface.h:14,27-35`, `address.c:125-229,1235-1497`.)

use std::fmt;

/// CRC-16 of a transport's name, as the worker address carries it (`ucs_crc16_string`,
/// CRC-16/X-25).
const fn crc16(name: &[u8]) -> u16 {
    let mut crc: u16 = 0xffff;
    let mut i = 0;
    while i < name.len() {
        crc ^= name[i] as u16;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x8408
            } else {
                crc >> 1
            };
            bit += 1;
        }
        i += 1;
    }
    !crc
}

/// A shared-memory transport, or `self`: the transports whose keys map memory into the
/// process that unpacks them, or whose puts go to a process the address names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ShmTransport {
    /// POSIX shared memory (`posix`).
    Posix,
    /// System V shared memory (`sysv`).
    Sysv,
    /// XPMEM (`xpmem`).
    Xpmem,
    /// Cross-memory attach (`cma`): no keys; puts go to the pid in its address.
    Cma,
    /// KNEM (`knem`).
    Knem,
    /// One worker to itself (`self`).
    Loopback,
}

impl ShmTransport {
    const ALL: [ShmTransport; 6] = [
        ShmTransport::Posix,
        ShmTransport::Sysv,
        ShmTransport::Xpmem,
        ShmTransport::Cma,
        ShmTransport::Knem,
        ShmTransport::Loopback,
    ];

    /// UCX's name of the transport.
    pub fn name(self) -> &'static str {
        match self {
            ShmTransport::Posix => "posix",
            ShmTransport::Sysv => "sysv",
            ShmTransport::Xpmem => "xpmem",
            ShmTransport::Cma => "cma",
            ShmTransport::Knem => "knem",
            ShmTransport::Loopback => "self",
        }
    }

    /// The transport whose name has checksum `csum`, if it is one of these.
    pub fn of_checksum(csum: u16) -> Option<ShmTransport> {
        Self::ALL
            .into_iter()
            .find(|t| crc16(t.name().as_bytes()) == csum)
    }
}

impl fmt::Display for ShmTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One transport entry of a packed worker address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddressEntry {
    /// The packer's memory-domain index of the transport (the bit its remote keys' entries
    /// carry).
    pub md_index: u8,
    /// CRC-16 of the transport's name.
    pub checksum: u16,
    /// The transport's interface address.
    pub iface: Vec<u8>,
}

impl AddressEntry {
    /// The transport, when it is a shared-memory one (or `self`).
    pub fn shm(&self) -> Option<ShmTransport> {
        ShmTransport::of_checksum(self.checksum)
    }
}

/// Why a packed worker address cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("its worker address ({len} bytes) cannot be read: {what} at byte {offset}")]
pub struct AddressFormatError {
    len: usize,
    offset: usize,
    what: &'static str,
}

/// The transport entries of packed worker address `address` (what `ucp_worker_get_address`
/// returns), as a UCX of release `(major, minor)` packs it (see the module docs).
///
/// # Errors
///
/// A field that runs past the end, or a version this module does not know (UCX's unified
/// mode packs no lengths and cannot be read: it fails here on a length or a version).
pub fn address_entries(
    address: &[u8],
    release: (u32, u32),
) -> Result<Vec<AddressEntry>, AddressFormatError> {
    let mut r = Reader {
        bytes: address,
        at: 0,
    };
    let first = r.u8("the header")?;
    let v2 = match first & 0x0f {
        0 => false,
        1 => true,
        _ => return Err(r.fail("an address version other than v1 and v2")),
    };
    let flags = if v2 {
        r.u8("the header's flags")?
    } else {
        first >> 4
    };
    // The worker's uuid is always there in v1 (the flag came in 1.12, the uuid before it).
    if !v2 || flags & 0x2 != 0 {
        r.skip(8, "the worker uuid")?;
    }
    if flags & 0x4 != 0 {
        r.skip(8, "the client id")?;
    }
    if flags & 0x1 != 0 {
        let len = r.u8("the worker name's length")?;
        r.skip(usize::from(len), "the worker name")?;
    }
    let mut out = Vec::new();
    if r.peek() == Some(0xff) {
        return Ok(out);
    }
    let md_mask = if v2 || release >= (1, 19) { 0x7f } else { 0x1f };
    let attr_len = if v2 { 8 } else { 16 };
    loop {
        let md = r.u8("a device's md byte")?;
        let empty = md & 0x80 != 0;
        let mut md_index = md & md_mask;
        if v2 && md_index == 0x7f {
            md_index = r.u8("a device's extended md index")?;
        }
        let dev = r.u8("a device's length byte")?;
        let last_device = dev & 0x80 != 0;
        let mut dev_len = usize::from(dev & DEV_LEN_MASK);
        if v2 && dev_len == usize::from(DEV_LEN_MASK) {
            dev_len = usize::from(r.u8("a device's extended length")?);
        }
        if dev & 0x40 != 0 {
            r.skip(1, "a device's path count")?;
        }
        if dev & 0x20 != 0 {
            r.skip(1, "a device's system device")?;
        }
        r.skip(dev_len, "a device address")?;
        if !empty {
            loop {
                let checksum = u16::from_ne_bytes([
                    r.u8("a transport's name checksum")?,
                    r.u8("a transport's name checksum")?,
                ]);
                r.skip(attr_len, "a transport's attributes")?;
                let b = r.u8("a transport's length byte")?;
                let mut len = usize::from(b & IFACE_LEN_MASK);
                if v2 && len == usize::from(IFACE_LEN_MASK) {
                    len = usize::from(r.u8("a transport's extended length")?);
                }
                let iface = r.take(len, "an interface address")?.to_vec();
                if b & 0x40 != 0 {
                    loop {
                        let ep_len = r.u8("an endpoint address's length")?;
                        r.skip(usize::from(ep_len), "an endpoint address")?;
                        if r.u8("an endpoint address's lane")? & 0x80 != 0 {
                            break;
                        }
                    }
                }
                out.push(AddressEntry {
                    md_index,
                    checksum,
                    iface,
                });
                if b & 0x80 != 0 {
                    break;
                }
            }
        }
        if last_device {
            return Ok(out);
        }
    }
}

/// A device's address length in its length byte (`UCP_ADDRESS_DEVICE_LEN_MASK`).
const DEV_LEN_MASK: u8 = 0x1f;
/// An interface's address length in its length byte (`UCP_ADDRESS_IFACE_LEN_MASK`).
const IFACE_LEN_MASK: u8 = 0x3f;

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn fail(&self, what: &'static str) -> AddressFormatError {
        AddressFormatError {
            len: self.bytes.len(),
            offset: self.at,
            what,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], AddressFormatError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(self.fail(what));
        };
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn skip(&mut self, n: usize, what: &'static str) -> Result<(), AddressFormatError> {
        self.take(n, what).map(|_| ())
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, AddressFormatError> {
        Ok(self.take(1, what)?[0])
    }
}

/// A `posix` segment id: bit 63 says the pid and fd follow (`UCT_POSIX_SEG_FLAG_PROCFS`).
const POSIX_PROCFS: u64 = 1 << 63;
/// The pid's bits in a procfs segment id (`UCT_POSIX_PROCFS_MMID_PID_BITS`).
const POSIX_PID_MASK: u64 = (1 << 30) - 1;
/// The pid-namespace flag of a `cma` address (`UCT_CMA_IFACE_ADDR_FLAG_PID_NS`).
const CMA_PID_NS: u32 = 1 << 31;

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    let b = bytes.get(at..at + 8)?;
    Some(u64::from_ne_bytes(b.try_into().ok()?))
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at + 4)?;
    Some(u32::from_ne_bytes(b.try_into().ok()?))
}

/// The process a peer's worker address names, by its shared-memory transports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerProcess {
    /// The pid every pid-naming transport agrees on, and the first transport that named it.
    pid: Option<(u32, ShmTransport)>,
    /// The owner's `xpmem` segment id, if the address has `xpmem`.
    xpmem: Option<u64>,
    /// Shared-memory transports by the packer's md index.
    mds: Vec<(u8, ShmTransport)>,
}

/// Why a peer's worker address or remote key is refused: what it names and whose it is.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OwnerError {
    /// The worker address cannot be read, so no key can be tied to it.
    #[error(transparent)]
    Address(#[from] AddressFormatError),
    /// Two transports of one worker address name different processes.
    #[error(
        "its worker address names two processes: {first} names process {first_pid}, {second} \
         process {second_pid}"
    )]
    TwoProcesses {
        /// The first transport.
        first: ShmTransport,
        /// The process it names.
        first_pid: u32,
        /// The transport that disagrees.
        second: ShmTransport,
        /// The process it names.
        second_pid: u32,
    },
    /// A key's segment belongs to another process than the peer's worker.
    #[error(
        "its {transport} key names memory of process {owner}, but its worker is {}",
        peer_pid(.peer)
    )]
    Foreign {
        /// The key's transport.
        transport: ShmTransport,
        /// The process the key's segment belongs to.
        owner: u64,
        /// The peer's process, if its address names one.
        peer: Option<u32>,
    },
    /// A key whose owner cannot be told.
    #[error("its {transport} key cannot be tied to its worker: {why}")]
    Unverifiable {
        /// The key's transport.
        transport: ShmTransport,
        /// Why.
        why: String,
    },
    /// The key itself is malformed.
    #[error("its key cannot be read: {0}")]
    Key(String),
}

fn peer_pid(peer: &Option<u32>) -> String {
    match peer {
        Some(p) => format!("process {p}"),
        None => "in no process its address names".into(),
    }
}

impl PeerProcess {
    /// The process `address` (a packed worker address from a UCX of the loaded release's
    /// layout) names through its shared-memory transports.
    ///
    /// # Errors
    ///
    /// An address that cannot be read, or transports that name different processes.
    pub fn of_address(address: &[u8]) -> Result<PeerProcess, OwnerError> {
        let (major, minor, _) = crate::library::release();
        Self::of_entries(&address_entries(address, (major, minor))?)
    }

    fn of_entries(entries: &[AddressEntry]) -> Result<PeerProcess, OwnerError> {
        let mut out = PeerProcess {
            pid: None,
            xpmem: None,
            mds: Vec::new(),
        };
        for e in entries {
            let Some(t) = e.shm() else { continue };
            out.mds.push((e.md_index, t));
            let pid = match t {
                ShmTransport::Posix => u64_at(&e.iface, 0)
                    .filter(|s| s & POSIX_PROCFS != 0)
                    .map(|s| (s & POSIX_PID_MASK) as u32),
                ShmTransport::Cma => u32_at(&e.iface, 0).map(|v| v & !CMA_PID_NS),
                ShmTransport::Sysv => u64_at(&e.iface, 0)
                    .and_then(|id| i32::try_from(id).ok())
                    .and_then(|id| kvferry_platform::sysv_segment_creator(id).ok())
                    .map(|(pid, _)| pid),
                ShmTransport::Xpmem => {
                    out.xpmem = u64_at(&e.iface, 8);
                    None
                }
                ShmTransport::Knem | ShmTransport::Loopback => None,
            };
            match (pid, out.pid) {
                (Some(p), None) => out.pid = Some((p, t)),
                (Some(p), Some((q, first))) if p != q => {
                    return Err(OwnerError::TwoProcesses {
                        first,
                        first_pid: q,
                        second: t,
                        second_pid: p,
                    });
                }
                _ => {}
            }
        }
        Ok(out)
    }

    /// The peer's process, when a transport of its address names it.
    pub fn pid(&self) -> Option<u32> {
        self.pid.map(|(p, _)| p)
    }

    /// Checks that every entry of packed remote key `key` that UCX would unpack for this
    /// address maps memory of the peer's process (see the module docs). Entries of
    /// transports other than shared memory are left to the receiver's UCX.
    ///
    /// # Errors
    ///
    /// A shared-memory entry whose segment is another process's, or whose owner cannot be
    /// told (no pid in a `posix` key, a `knem` key, a `sysv` segment the kernel does not
    /// describe).
    pub fn check_key(&self, key: &[u8]) -> Result<(), OwnerError> {
        for (md_index, entry) in key_entries(key)? {
            let Some(&(_, transport)) = self.mds.iter().find(|(m, _)| *m == md_index) else {
                continue;
            };
            let owner = match transport {
                ShmTransport::Posix => {
                    let seg = u64_at(entry, 0).ok_or_else(|| short(transport, entry))?;
                    if seg & POSIX_PROCFS == 0 {
                        return Err(OwnerError::Unverifiable {
                            transport,
                            why: "it names its segment by file name, not by process \
                                  (UCX_POSIX_USE_PROC_LINK=n on the peer; keep the default)"
                                .into(),
                        });
                    }
                    seg & POSIX_PID_MASK
                }
                ShmTransport::Sysv => {
                    let id = u32_at(entry, 0).ok_or_else(|| short(transport, entry))?;
                    let (pid, _) = i32::try_from(id)
                        .map_err(|_| format!("segment id {id} is not a System V id"))
                        .and_then(|id| {
                            kvferry_platform::sysv_segment_creator(id)
                                .map_err(|e| format!("segment {id}: {e}"))
                        })
                        .map_err(|why| OwnerError::Unverifiable { transport, why })?;
                    u64::from(pid)
                }
                ShmTransport::Xpmem => {
                    let seg = u64_at(entry, 0).ok_or_else(|| short(transport, entry))?;
                    if Some(seg) != self.xpmem {
                        return Err(OwnerError::Foreign {
                            transport,
                            owner: seg,
                            peer: self.pid(),
                        });
                    }
                    continue;
                }
                ShmTransport::Knem => {
                    return Err(OwnerError::Unverifiable {
                        transport,
                        why: "a knem key is an opaque kernel cookie".into(),
                    });
                }
                // `self` reaches only the worker that unpacks it; `cma` has no keys.
                ShmTransport::Loopback | ShmTransport::Cma => continue,
            };
            if self.pid().map(u64::from) != Some(owner) {
                return Err(OwnerError::Foreign {
                    transport,
                    owner,
                    peer: self.pid(),
                });
            }
        }
        Ok(())
    }
}

impl PeerProcess {
    /// Where, in the peer's own address space, each shared-memory segment that key `key`
    /// names starts (`posix` and `xpmem`: the key's address field; `sysv`: the owner's
    /// attach address): translated through the unpacked key, such an address gives the start
    /// of the key's own mapping here, whatever the peer declared, so a pool can be required
    /// to lie in that mapping and not in another one the translation happens to reach.
    /// Entries UCX would not unpack for this address, and unreadable ones, give nothing.
    pub fn segment_starts(&self, key: &[u8]) -> Vec<u64> {
        let Ok(entries) = key_entries(key) else {
            return Vec::new();
        };
        entries
            .into_iter()
            .filter_map(|(md_index, entry)| {
                let (_, t) = self.mds.iter().find(|(m, _)| *m == md_index)?;
                match t {
                    ShmTransport::Posix | ShmTransport::Xpmem => u64_at(entry, 8),
                    ShmTransport::Sysv => u64_at(entry, 4),
                    _ => None,
                }
            })
            .collect()
    }
}

fn short(transport: ShmTransport, entry: &[u8]) -> OwnerError {
    OwnerError::Key(format!(
        "its {transport} entry has {} bytes, fewer than its segment id",
        entry.len()
    ))
}

/// The transport entries of packed remote key `key`: `(md index, bytes)` for every bit of
/// its md map, lowest first.
fn key_entries(key: &[u8]) -> Result<Vec<(u8, &[u8])>, OwnerError> {
    let md_map = u64_at(key, 0).ok_or_else(|| OwnerError::Key("no md map".into()))?;
    let mut at = crate::rkey_format::HEADER_LEN;
    let mut out = Vec::new();
    let mut bits = md_map;
    while bits != 0 {
        let md = bits.trailing_zeros() as u8;
        bits &= bits - 1;
        let size = usize::from(
            *key.get(at)
                .ok_or_else(|| OwnerError::Key(format!("no size byte for md {md}")))?,
        );
        let entry = key
            .get(at + 1..at + 1 + size)
            .ok_or_else(|| OwnerError::Key(format!("md {md}'s entry runs past the end")))?;
        out.push((md, entry));
        at += 1 + size;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_are_ucx_s() {
        // Read off UCX's CRC-16/X-25 (`ucs_crc16_string`); the X-25 check value first.
        assert_eq!(crc16(b"123456789"), 0x906e);
        for (name, csum) in [
            ("posix", 0xd3a7),
            ("sysv", 0x538d),
            ("xpmem", 0x83dd),
            ("cma", 0x8b47),
            ("knem", 0x1377),
            ("self", 0x7563),
        ] {
            assert_eq!(crc16(name.as_bytes()), csum, "{name}");
        }
        assert_eq!(ShmTransport::of_checksum(0x538d), Some(ShmTransport::Sysv));
        assert_eq!(ShmTransport::of_checksum(crc16(b"tcp")), None);
    }

    fn entry(md_index: u8, name: &str, iface: Vec<u8>) -> AddressEntry {
        AddressEntry {
            md_index,
            checksum: crc16(name.as_bytes()),
            iface,
        }
    }

    fn posix_seg(pid: u64, fd: u64) -> u64 {
        POSIX_PROCFS | (1 << 62) | (fd << 30) | pid
    }

    fn key(entries: &[(u8, Vec<u8>)]) -> Vec<u8> {
        let md_map = entries.iter().fold(0u64, |m, (md, _)| m | 1 << md);
        let mut k = md_map.to_ne_bytes().to_vec();
        k.push(0);
        for (_, e) in entries {
            k.push(e.len() as u8);
            k.extend_from_slice(e);
        }
        k.push(0xff);
        k
    }

    fn posix_key(pid: u64, fd: u64) -> Vec<u8> {
        let mut e = posix_seg(pid, fd).to_ne_bytes().to_vec();
        e.extend_from_slice(&0x7f00_0000_0000u64.to_ne_bytes());
        e.extend_from_slice(&(1u64 << 20).to_ne_bytes());
        e
    }

    #[test]
    fn transports_naming_two_processes_are_refused() {
        let posix = entry(1, "posix", posix_seg(4242, 17).to_ne_bytes().to_vec());
        let cma = entry(3, "cma", 4343u32.to_ne_bytes().to_vec());
        let e = PeerProcess::of_entries(&[posix.clone(), cma]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "its worker address names two processes: posix names process 4242, cma process 4343"
        );
        let same = entry(3, "cma", (4242u32 | CMA_PID_NS).to_ne_bytes().to_vec());
        let peer = PeerProcess::of_entries(&[posix, same]).unwrap();
        assert_eq!(peer.pid(), Some(4242));
    }

    #[test]
    fn a_posix_key_of_another_process_is_refused_and_its_own_passes() {
        let peer = PeerProcess::of_entries(&[
            entry(0, "self", vec![0; 8]),
            entry(1, "posix", posix_seg(4242, 17).to_ne_bytes().to_vec()),
            entry(5, "tcp", vec![0; 4]),
        ])
        .unwrap();
        // Its own segment (another fd of the same process), with self and tcp entries beside.
        let own = key(&[(0, vec![1; 8]), (1, posix_key(4242, 21)), (5, vec![])]);
        peer.check_key(&own).unwrap();
        let foreign = key(&[(0, vec![1; 8]), (1, posix_key(777, 21))]);
        assert_eq!(
            peer.check_key(&foreign).unwrap_err().to_string(),
            "its posix key names memory of process 777, but its worker is process 4242"
        );
        // No pid in the key: the segment is a file name.
        let mut named = posix_key(4242, 21);
        named[7] &= 0x7f;
        let e = peer.check_key(&key(&[(1, named)])).unwrap_err();
        assert!(e.to_string().contains("UCX_POSIX_USE_PROC_LINK"), "{e}");
        // An entry no transport of the address matches is not unpacked by UCX.
        peer.check_key(&key(&[(9, posix_key(777, 1))])).unwrap();
        assert_eq!(peer.segment_starts(&own), vec![0x7f00_0000_0000]);
        assert_eq!(peer.segment_starts(&key(&[(9, posix_key(777, 1))])), vec![]);
        // A key cut inside an entry.
        let mut cut = key(&[(1, posix_key(4242, 21))]);
        cut.truncate(20);
        assert!(matches!(peer.check_key(&cut), Err(OwnerError::Key(_))));
    }

    #[test]
    fn xpmem_keys_match_the_address_segment_and_knem_cannot_be_told() {
        let mut iface = 0x7f00_0000_1000u64.to_ne_bytes().to_vec();
        iface.extend_from_slice(&0x0000_0001_0000_1092u64.to_ne_bytes());
        let peer =
            PeerProcess::of_entries(&[entry(2, "xpmem", iface), entry(4, "knem", vec![])]).unwrap();
        let xkey = |seg: u64| {
            let mut e = seg.to_ne_bytes().to_vec();
            e.extend_from_slice(&[0; 16]);
            e
        };
        peer.check_key(&key(&[(2, xkey(0x0000_0001_0000_1092))]))
            .unwrap();
        assert!(matches!(
            peer.check_key(&key(&[(2, xkey(0x0000_0001_0000_2000))])),
            Err(OwnerError::Foreign { .. })
        ));
        assert!(matches!(
            peer.check_key(&key(&[(4, vec![0; 16])])),
            Err(OwnerError::Unverifiable { .. })
        ));
    }

    #[test]
    fn truncated_addresses_are_refused_by_field() {
        let e = address_entries(&[0x20, 1, 2], (1, 22)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "its worker address (3 bytes) cannot be read: the worker uuid at byte 1"
        );
        assert!(address_entries(&[], (1, 22)).is_err());
        assert!(address_entries(&[0x05], (1, 22)).is_err());
        // A v1 address with a uuid and no devices.
        let mut empty = vec![0x20];
        empty.extend_from_slice(&[0; 8]);
        empty.push(0xff);
        assert_eq!(address_entries(&empty, (1, 22)).unwrap(), vec![]);
    }
}
