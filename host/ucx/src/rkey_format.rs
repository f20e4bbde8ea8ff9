//! The layout of a packed remote key (what `ucp_rkey_pack` writes), checked before UCX parses
//! a peer's key.
//!
//! `ucp_ep_rkey_unpack(ep, rkey_buffer, &rkey)` takes no length (`src/ucp/api/ucp.h:3009` in
//! UCX 1.13.1, `:3301` in 1.22.0): it calls `ucp_ep_rkey_unpack_reachable(ep, buffer, 0, ..)`
//! (`src/ucp/core/ucp_rkey.c:483` in 1.13.1, `:1065` in 1.22.0) and walks the bytes with
//! unchecked pointer bumps (`ucs_serialize_next`, `src/ucs/type/serialize.h`). A short key
//! makes it read past the buffer: a 1-byte key, or the first 4 bytes of a 9-byte one, gives a
//! garbage 64-bit md map whose bits each make it skip a garbage "size" and hand garbage to a
//! transport's unpack, which crashed the process. [`check_packed_rkey`] refuses every key whose
//! UCP container would make UCX read outside it, with an error saying which field is wrong.
//!
//! # Layout
//!
//! All integers in host byte order (the packer stores them with plain stores), no padding:
//!
//! ```text
//! u64  md_map              bit i set: an entry for the *sender's* memory domain i
//! u8   mem_type            a ucs_memory_type_t of the sender's release
//! for each set bit of md_map, lowest first:
//!      u8  size            the MD's rkey_packed_size
//!      [u8; size]          the transport's packed key
//! only from UCX 1.20, only when md_map != 0:
//! u8   sys_dev             0xff: unknown; bit 7: the peer needs a remote flush
//! only when sys_dev != 0xff:
//!      { u8 device (< 64, ascending), u8 latency, u8 bandwidth } per topology device
//!      u8  0xff            terminator
//! ```
//!
//! - Up to 1.19 `ucp_rkey_pack` packs with the system device unknown, so nothing follows the
//!   entries: 1.13.1 `ucp_rkey_pack` (`src/ucp/core/ucp_rkey.c:216-269`, `mem_info.sys_dev =
//!   UCS_SYS_DEVICE_ID_UNKNOWN` at `:248`) through `ucp_rkey_pack_common` (`:119-190`); the
//!   same in 1.10.0 (`ucp_rkey_pack_uct`) and 1.19.0 (`ucp_rkey.c:582,599`). Unpack reads the
//!   header and every entry, reachable or not (1.13.1 `ucp_rkey.c:384,407,415-417`).
//! - From 1.20 ("Since UCX 1.20: always pack sys_dev for non-empty rkeys", 1.22.0
//!   `ucp_rkey.c:236-246`) `ucp_rkey_pack_memh` (`:182-272`) adds the system device, its
//!   distances and the terminator (`pack_terminator`, `:263-265`). With the length 0 it is
//!   given, `ucp_rkey_extract_sys_dev` reads the system-device byte whenever the peer is newer
//!   than 1.19 (`:844-863`), and `ucp_rkey_unpack_lanes_distance` then reads 3-byte entries
//!   until a 0xff, unbounded (`:806-842`, `buffer_end = UINTPTR_MAX` at `:891-898`).
//! - `ucp_rkey_pack` returns exactly `ucp_rkey_packed_size` bytes in every release (asserted:
//!   1.13.1 `ucp_rkey.c:257`, 1.22.0 `:760-761`), so a byte left over is a framing error.
//!
//! # What passing does not mean
//!
//! The check covers the UCP container only. Each transport's own key is read by its
//! `rkey_unpack`, which gets no size either (1.22.0 `src/uct/base/uct_md.c:350-358`) and reads
//! its fixed struct: an entry whose size byte is smaller than that struct, or whose contents
//! are forged, still reaches it. `Endpoint::unpack_rkey` hands UCX a copy padded with zeros so
//! that such a read stays inside memory this crate owns; what a forged key can still do is in
//! the crate docs ("Trust").

use std::fmt;
use std::sync::OnceLock;

/// Bytes of the fixed header: `ucp_md_map_t` (a `uint64_t`, `src/ucp/core/ucp_types.h:35,39`
/// in 1.13.1 and 1.22.0; 64 bits since 1.10) and the memory-type byte.
pub const HEADER_LEN: usize = 8 + 1;

/// `UCS_SYS_DEVICE_ID_UNKNOWN` (`src/ucs/sys/topo/base/topo.h:26` in 1.22.0): an unknown
/// system device, and the terminator of the distance list.
const SYS_DEVICE_UNKNOWN: u8 = 0xff;

/// A packed `ucp_rkey_packed_distance_t`: device, latency, bandwidth (1.22.0
/// `ucp_rkey.c:27-31`).
const DISTANCE_LEN: usize = 3;

/// Distances are packed for the bits of a 64-bit `ucp_sys_dev_map_t` (1.22.0
/// `src/ucp/core/ucp_types.h:53-54`), lowest first, so device ids are below 64 and ascend.
const DISTANCE_DEVICES: u8 = 64;

/// The packed-key layout of one UCX release: what [`check_packed_rkey`] expects.
///
/// Keys are checked against the layout of the UCX loaded in this process
/// ([`KeyLayout::loaded`]), so both peers must run releases with the same layout: up to 1.19,
/// or 1.20 and later. A key from the other side of that line is refused by name (a 1.13 key
/// lacks the system-device byte a 1.22 receiver reads; a 1.22 key has bytes no 1.13 packer
/// writes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyLayout {
    release: (u32, u32),
    sys_dev_trailer: bool,
    memory_types: u8,
}

impl KeyLayout {
    /// The layout of UCX `major.minor`, from the sources of 1.10.0 to 1.22.0. A later release
    /// is assumed to keep 1.22's layout (nothing newer was reviewed).
    pub fn for_release(major: u32, minor: u32) -> KeyLayout {
        let release = (major, minor);
        KeyLayout {
            release,
            sys_dev_trailer: release >= (1, 20),
            memory_types: memory_types(release),
        }
    }

    /// The layout of the UCX loaded in this process (`ucp_get_version`), decided once.
    pub fn loaded() -> KeyLayout {
        static LOADED: OnceLock<KeyLayout> = OnceLock::new();
        *LOADED.get_or_init(|| {
            let (major, minor, _) = crate::library::release();
            if (major, minor) > LAST_REVIEWED {
                tracing::warn!(
                    ucx = %crate::version(),
                    "remote keys are checked against UCX {}.{}'s packed layout, the newest \
                     reviewed; a newer UCX that changed it would have its keys refused",
                    LAST_REVIEWED.0,
                    LAST_REVIEWED.1
                );
            }
            KeyLayout::for_release(major, minor)
        })
    }

    /// The release, `(major, minor)`.
    pub fn release(self) -> (u32, u32) {
        self.release
    }

    /// Whether a key with a non-empty md map ends with a system device (and, for a known
    /// device, its distances and a 0xff terminator): UCX 1.20 and later.
    pub fn has_sys_dev_trailer(self) -> bool {
        self.sys_dev_trailer
    }

    /// `UCS_MEMORY_TYPE_LAST` of the release: the valid memory-type bytes are `0..` this.
    pub fn memory_types(self) -> u8 {
        self.memory_types
    }
}

impl fmt::Display for KeyLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UCX {}.{}", self.release.0, self.release.1)
    }
}

/// The newest release whose packer and unpacker were read for this module.
const LAST_REVIEWED: (u32, u32) = (1, 22);

/// `UCS_MEMORY_TYPE_LAST` per release (`src/ucs/memory/memory_type.h`, enum
/// `ucs_memory_type`): HOST, CUDA, CUDA_MANAGED, ROCM, ROCM_MANAGED up to 1.15; RDMA from 1.16;
/// ZE_HOST, ZE_DEVICE, ZE_MANAGED from 1.17; GAUDI from 1.21. New types are appended, so a
/// key's type is an index UCX uses as is (e.g. `ucs_memory_type_names[]`, and
/// `worker->mem_type_ep[]` in 1.22.0 `src/ucp/core/ucp_worker.h:356`): one past the range
/// reads outside those arrays.
fn memory_types(release: (u32, u32)) -> u8 {
    match release {
        r if r < (1, 16) => 5,
        (1, 16) => 6,
        r if r < (1, 21) => 9,
        _ => 10,
    }
}

/// What is wrong with a packed remote key: the field that does not fit the key's length or
/// the release's layout. `Display` reads as a description of the key ("4 bytes, fewer than
/// the 9 of its header...").
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyFormatError {
    /// Not even the md map and the memory type fit.
    #[error(
        "{len} byte{}, fewer than the {HEADER_LEN} of its header (a 64-bit md map and a memory \
         type)",
        plural(.len)
    )]
    HeaderTruncated {
        /// The key's length.
        len: usize,
    },
    /// The memory-type byte is not a memory type of the release.
    #[error("memory type {mem_type}, but {layout} knows only 0 to {}", .layout.memory_types() - 1)]
    UnknownMemoryType {
        /// The memory-type byte.
        mem_type: u8,
        /// The layout checked against.
        layout: KeyLayout,
    },
    /// The md map names more memory domains than the key has bytes for, even with every
    /// transport key empty.
    #[error(
        "{len} bytes, but its md map {md_map:#x} names {domains} memory domain{}, whose entries \
         need at least {needed}",
        plural(&(*.domains as usize))
    )]
    MdMapNeedsMore {
        /// The key's length.
        len: usize,
        /// The md map.
        md_map: u64,
        /// Memory domains in the map.
        domains: u32,
        /// The fewest bytes a key with this map has.
        needed: usize,
    },
    /// The key ends before the size byte of a memory domain's entry.
    #[error("{len} bytes, ending before the size byte of memory domain {domain}'s entry")]
    EntrySizeMissing {
        /// The key's length.
        len: usize,
        /// The memory domain (its bit in the md map).
        domain: u32,
    },
    /// A memory domain's entry declares a transport key that runs past the end.
    #[error(
        "{len} bytes, but the entry of memory domain {domain} at byte {offset} declares a \
         {size}-byte transport key, which would end at byte {end}"
    )]
    EntryPastEnd {
        /// The key's length.
        len: usize,
        /// The memory domain (its bit in the md map).
        domain: u32,
        /// Where the entry's size byte is.
        offset: usize,
        /// The size byte.
        size: u8,
        /// Where the transport key would end.
        end: usize,
    },
    /// UCX 1.20 and later: no system-device byte after the entries of a non-empty md map.
    #[error("{len} bytes, ending before the system-device byte {layout} packs after the entries")]
    SysDevMissing {
        /// The key's length.
        len: usize,
        /// The layout checked against.
        layout: KeyLayout,
    },
    /// UCX 1.20 and later: the distance list of a known system device has no 0xff terminator
    /// (UCX would read on until it met one).
    #[error(
        "{len} bytes, and the distance list of system device {sys_dev:#04x} has no 0xff \
         terminator"
    )]
    DistancesUnterminated {
        /// The key's length.
        len: usize,
        /// The system-device byte.
        sys_dev: u8,
    },
    /// UCX 1.20 and later: a 3-byte distance entry is cut off by the end of the key.
    #[error("{len} bytes, cutting off the 3-byte distance entry at byte {offset}")]
    DistanceTruncated {
        /// The key's length.
        len: usize,
        /// Where the entry starts.
        offset: usize,
    },
    /// UCX 1.20 and later: a distance names a device no packer writes there: 64 or more, or
    /// not above the one before.
    #[error(
        "its distance entry at byte {offset} names device {device}{}; devices are below 64 \
         and ascend",
        after(.previous)
    )]
    DistanceDevice {
        /// Where the entry starts.
        offset: usize,
        /// The device byte.
        device: u8,
        /// The device of the entry before, if any.
        previous: Option<u8>,
    },
    /// Bytes follow the complete key: no packer of the release writes them.
    #[error(
        "{len} bytes, but a {layout} key with this content is {consumed}: {} trailing byte{}",
        .len - .consumed,
        plural(&(.len - .consumed))
    )]
    TrailingBytes {
        /// The key's length.
        len: usize,
        /// The bytes the key's content accounts for.
        consumed: usize,
        /// The layout checked against.
        layout: KeyLayout,
    },
}

fn plural(n: &usize) -> &'static str {
    if *n == 1 { "" } else { "s" }
}

fn after(previous: &Option<u8>) -> String {
    previous.map_or_else(String::new, |p| format!(" after device {p}"))
}

/// Checks that `bytes` is a complete packed remote key of `layout`: UCX's unpack of it reads
/// the header, every entry's size byte and declared bytes, and (1.20 and later) the system
/// device and its distance list, all inside `bytes`, and nothing is left over.
///
/// # Errors
///
/// The first field that does not fit, as a [`KeyFormatError`].
pub fn check_packed_rkey(bytes: &[u8], layout: KeyLayout) -> Result<(), KeyFormatError> {
    let len = bytes.len();
    let Some((md_map, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(KeyFormatError::HeaderTruncated { len });
    };
    let Some(&mem_type) = rest.first() else {
        return Err(KeyFormatError::HeaderTruncated { len });
    };
    // Host order: `*ucs_serialize_next(&p, ucp_md_map_t) = md_map` (1.22.0 ucp_rkey.c:210).
    let md_map = u64::from_ne_bytes(*md_map);
    if mem_type >= layout.memory_types {
        return Err(KeyFormatError::UnknownMemoryType { mem_type, layout });
    }

    // Every entry has at least its size byte; from 1.20 a non-empty map adds the system
    // device (`ucp_rkey_packed_size`, 1.22.0 ucp_rkey.c:55-89).
    let domains = md_map.count_ones();
    let trailer = layout.sys_dev_trailer && md_map != 0;
    let needed = HEADER_LEN + domains as usize + usize::from(trailer);
    if len < needed {
        return Err(KeyFormatError::MdMapNeedsMore {
            len,
            md_map,
            domains,
            needed,
        });
    }

    // `ucs_for_each_bit(remote_md_index, remote_md_map)`: a size byte, then that many bytes,
    // for every bit (1.13.1 ucp_rkey.c:415-417; 1.22.0 :982-984).
    let mut offset = HEADER_LEN;
    let mut bits = md_map;
    while bits != 0 {
        let domain = bits.trailing_zeros();
        bits &= bits - 1;
        let Some(&size) = bytes.get(offset) else {
            return Err(KeyFormatError::EntrySizeMissing { len, domain });
        };
        let end = offset + 1 + usize::from(size);
        if end > len {
            return Err(KeyFormatError::EntryPastEnd {
                len,
                domain,
                offset,
                size,
                end,
            });
        }
        offset = end;
    }

    if trailer {
        let Some(&sys_dev) = bytes.get(offset) else {
            return Err(KeyFormatError::SysDevMissing { len, layout });
        };
        offset += 1;
        if sys_dev != SYS_DEVICE_UNKNOWN {
            offset = check_distances(bytes, offset, sys_dev)?;
        }
    }

    if offset != len {
        return Err(KeyFormatError::TrailingBytes {
            len,
            consumed: offset,
            layout,
        });
    }
    Ok(())
}

/// The distance list from `offset` to its terminator: whole 3-byte entries of ascending
/// devices below 64, then 0xff (1.22.0 `ucp_rkey.c:257-265`; read by `:819-830`). Returns the
/// offset past the terminator.
fn check_distances(bytes: &[u8], mut offset: usize, sys_dev: u8) -> Result<usize, KeyFormatError> {
    let len = bytes.len();
    let mut previous = None;
    loop {
        let Some(&device) = bytes.get(offset) else {
            return Err(KeyFormatError::DistancesUnterminated { len, sys_dev });
        };
        if device == SYS_DEVICE_UNKNOWN {
            return Ok(offset + 1);
        }
        if offset + DISTANCE_LEN > len {
            return Err(KeyFormatError::DistanceTruncated { len, offset });
        }
        // UCX indexes a 255-slot table with any device but 0xff (1.22.0 ucp_rkey.c:813), so
        // this is a consistency check: no packer writes anything else.
        if device >= DISTANCE_DEVICES || previous.is_some_and(|p| device <= p) {
            return Err(KeyFormatError::DistanceDevice {
                offset,
                device,
                previous,
            });
        }
        previous = Some(device);
        offset += DISTANCE_LEN;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UCX_1_13: KeyLayout = KeyLayout {
        release: (1, 13),
        sys_dev_trailer: false,
        memory_types: 5,
    };
    const UCX_1_22: KeyLayout = KeyLayout {
        release: (1, 22),
        sys_dev_trailer: true,
        memory_types: 10,
    };
    const HOST: u8 = 0;
    const CUDA: u8 = 1;

    /// A key of `entries` (memory domain, transport key), then `trailer` as is.
    fn pack(entries: &[(u32, &[u8])], mem_type: u8, trailer: &[u8]) -> Vec<u8> {
        let md_map = entries.iter().fold(0u64, |map, &(md, _)| map | 1 << md);
        let mut key = md_map.to_ne_bytes().to_vec();
        key.push(mem_type);
        let mut entries = entries.to_vec();
        entries.sort_by_key(|&(md, _)| md);
        for (_, tl) in entries {
            key.push(u8::try_from(tl.len()).unwrap());
            key.extend_from_slice(tl);
        }
        key.extend_from_slice(trailer);
        key
    }

    // Transport keys of the sizes their packers write (FORMAT.md, 1.22.0 on x86_64).
    const IB: [u8; 8] = [0x78, 0x56, 0, 0, 0x34, 0x12, 0, 0];
    const XPMEM: [u8; 24] = [0x5a; 24];
    const POSIX: [u8; 24] = [0x24; 24];
    const SYSV: [u8; 12] = [0x0c; 12];
    const GDR: [u8; 24] = [0x11; 24];

    fn cuda_ipc(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + 3) as u8).collect()
    }

    /// 1.22, CUDA memory on device 2 with the flush bit, distances to devices 0 to 3.
    fn v122_cuda() -> Vec<u8> {
        let mut trailer = vec![0x80 | 2];
        for device in 0..4 {
            trailer.extend_from_slice(&[device, 0xff, 0x9c]);
        }
        trailer.push(SYS_DEVICE_UNKNOWN);
        pack(
            &[(0, &IB), (2, &[]), (4, &cuda_ipc(192)), (5, &GDR)],
            CUDA,
            &trailer,
        )
    }

    fn valid(layout: KeyLayout) -> Vec<Vec<u8>> {
        let mut keys = vec![
            // tcp only (no domain registers memory) or a zero-length region: 9 bytes.
            pack(&[], HOST, &[]),
        ];
        if layout.sys_dev_trailer {
            keys.extend([
                pack(&[(0, &IB), (1, &[]), (3, &XPMEM)], HOST, &[0xff]),
                pack(&[(1, &POSIX), (2, &SYSV), (3, &[])], HOST, &[0xff]),
                v122_cuda(),
                // A known device and no topology devices: the terminator alone.
                pack(&[(0, &IB)], CUDA, &[0x01, 0xff]),
                pack(&[(63, &[0xab; 255])], HOST, &[0xff]),
            ]);
        } else {
            keys.extend([
                pack(&[(0, &IB), (1, &[]), (3, &XPMEM)], HOST, &[]),
                pack(&[(1, &POSIX), (2, &SYSV), (3, &[])], HOST, &[]),
                pack(&[(4, &cuda_ipc(112))], CUDA, &[]),
                pack(&[(63, &[0xab; 255])], HOST, &[]),
            ]);
        }
        keys
    }

    /// The reads `ucp_ep_rkey_unpack` makes on `key` (length 0, every domain reachable, a
    /// peer newer than 1.19, an rkey-config cache miss: the most it reads), modelling each
    /// transport key as its declared bytes. `None` as soon as one falls outside `key`.
    fn ucx_reads(key: &[u8], layout: KeyLayout) -> Option<()> {
        let at = |i: usize| key.get(i).copied();
        let md_map = u64::from_ne_bytes(key.get(..8)?.try_into().ok()?);
        at(8)?;
        let mut p = HEADER_LEN;
        for _ in 0..md_map.count_ones() {
            let size = usize::from(at(p)?);
            if size > 0 {
                at(p + size)?;
            }
            p += 1 + size;
        }
        if layout.sys_dev_trailer && md_map != 0 {
            let sys_dev = at(p)?;
            p += 1;
            if sys_dev != SYS_DEVICE_UNKNOWN {
                while at(p)? != SYS_DEVICE_UNKNOWN {
                    at(p + DISTANCE_LEN - 1)?;
                    p += DISTANCE_LEN;
                }
            }
        }
        Some(())
    }

    #[test]
    fn layouts_follow_the_release() {
        assert_eq!(KeyLayout::for_release(1, 13), UCX_1_13);
        assert_eq!(KeyLayout::for_release(1, 22), UCX_1_22);
        let shape = |major, minor| {
            let l = KeyLayout::for_release(major, minor);
            (l.has_sys_dev_trailer(), l.memory_types())
        };
        assert_eq!(shape(1, 10), (false, 5));
        assert_eq!(shape(1, 15), (false, 5));
        assert_eq!(shape(1, 16), (false, 6));
        assert_eq!(shape(1, 19), (false, 9));
        assert_eq!(shape(1, 20), (true, 9));
        assert_eq!(shape(1, 21), (true, 10));
        assert_eq!(shape(1, 30), (true, 10));
        assert_eq!(UCX_1_22.to_string(), "UCX 1.22");
    }

    #[test]
    fn the_loaded_layout_is_the_loaded_release() {
        let (major, minor, _) = crate::library::release();
        assert_eq!(KeyLayout::loaded().release(), (major, minor));
    }

    #[test]
    fn valid_keys_pass() {
        for layout in [UCX_1_13, UCX_1_22] {
            for key in valid(layout) {
                assert_eq!(
                    check_packed_rkey(&key, layout),
                    Ok(()),
                    "{layout}: {key:02x?}"
                );
                assert!(ucx_reads(&key, layout).is_some());
            }
        }
        assert_eq!(
            v122_cuda().len(),
            HEADER_LEN + (1 + 8) + 1 + (1 + 192) + (1 + 24) + 1 + 4 * 3 + 1
        );
    }

    #[test]
    fn every_truncation_is_refused() {
        for layout in [UCX_1_13, UCX_1_22] {
            for key in valid(layout) {
                for cut in 0..key.len() {
                    let refused = check_packed_rkey(&key[..cut], layout);
                    assert!(
                        refused.is_err(),
                        "{layout}: {cut} of {} bytes passed",
                        key.len()
                    );
                }
            }
        }
    }

    #[test]
    fn the_reported_crashes_are_refused_by_name() {
        for layout in [UCX_1_13, UCX_1_22] {
            let refused = check_packed_rkey(&[0], layout).unwrap_err();
            assert_eq!(refused, KeyFormatError::HeaderTruncated { len: 1 });
            assert_eq!(
                refused.to_string(),
                "1 byte, fewer than the 9 of its header (a 64-bit md map and a memory type)"
            );
            // The first 4 bytes of a real 9-byte tcp key.
            let tcp = pack(&[], HOST, &[]);
            assert_eq!(tcp.len(), 9);
            assert_eq!(
                check_packed_rkey(&tcp[..4], layout),
                Err(KeyFormatError::HeaderTruncated { len: 4 })
            );
        }
    }

    #[test]
    fn a_map_naming_more_domains_than_bytes_is_named() {
        let mut key = 0b1001u64.to_ne_bytes().to_vec();
        key.push(HOST);
        let refused = check_packed_rkey(&key, UCX_1_13).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "9 bytes, but its md map 0x9 names 2 memory domains, whose entries need at least 11"
        );
        // 1.22 also needs the system device.
        assert!(matches!(
            check_packed_rkey(&key, UCX_1_22),
            Err(KeyFormatError::MdMapNeedsMore { needed: 12, .. })
        ));
        let mut key = u64::MAX.to_ne_bytes().to_vec();
        key.push(HOST);
        key.extend_from_slice(&[0; 63]);
        assert_eq!(
            check_packed_rkey(&key, UCX_1_13),
            Err(KeyFormatError::MdMapNeedsMore {
                len: 72,
                md_map: u64::MAX,
                domains: 64,
                needed: 73
            })
        );
    }

    #[test]
    fn an_oversized_length_byte_is_refused() {
        for layout in [UCX_1_13, UCX_1_22] {
            // The last entry (xpmem, domain 3) claims one byte more than it has.
            let mut key = valid(layout)[1].clone();
            let at = HEADER_LEN + 1 + IB.len() + 1;
            assert_eq!(key[at], 24);
            key[at] = 25;
            let refused = check_packed_rkey(&key, layout).unwrap_err();
            if layout.sys_dev_trailer {
                // It swallows the system device, then runs out.
                assert_eq!(
                    refused,
                    KeyFormatError::SysDevMissing {
                        len: key.len(),
                        layout
                    }
                );
            } else {
                assert_eq!(
                    refused,
                    KeyFormatError::EntryPastEnd {
                        len: key.len(),
                        domain: 3,
                        offset: at,
                        size: 25,
                        end: key.len() + 1
                    }
                );
                assert_eq!(
                    refused.to_string(),
                    "44 bytes, but the entry of memory domain 3 at byte 19 declares a 25-byte \
                     transport key, which would end at byte 45"
                );
            }
            // The first entry claims 255 bytes.
            key[HEADER_LEN] = 255;
            assert!(matches!(
                check_packed_rkey(&key, layout),
                Err(KeyFormatError::EntryPastEnd {
                    domain: 0,
                    size: 255,
                    ..
                })
            ));
            // An entry that swallows the next size bytes leaves later domains without one.
            let mut key = valid(layout)[1].clone();
            key[HEADER_LEN] = u8::try_from(key.len() - HEADER_LEN - 1).unwrap();
            assert!(matches!(
                check_packed_rkey(&key, layout),
                Err(KeyFormatError::EntrySizeMissing { len: _, domain: 1 })
            ));
        }
    }

    #[test]
    fn trailing_bytes_are_refused() {
        for layout in [UCX_1_13, UCX_1_22] {
            for mut key in valid(layout) {
                let len = key.len();
                key.push(0);
                let refused = check_packed_rkey(&key, layout).unwrap_err();
                assert_eq!(
                    refused,
                    KeyFormatError::TrailingBytes {
                        len: len + 1,
                        consumed: len,
                        layout
                    }
                );
                assert!(
                    refused.to_string().ends_with(": 1 trailing byte"),
                    "{refused}"
                );
            }
        }
    }

    #[test]
    fn a_key_of_the_other_layout_is_refused() {
        let v113 = valid(UCX_1_13)[1].clone();
        assert_eq!(
            check_packed_rkey(&v113, UCX_1_22).unwrap_err().to_string(),
            "44 bytes, ending before the system-device byte UCX 1.22 packs after the entries"
        );
        let v122 = valid(UCX_1_22)[1].clone();
        assert!(matches!(
            check_packed_rkey(&v122, UCX_1_13),
            Err(KeyFormatError::TrailingBytes { .. })
        ));
        // The empty key is the same in both.
        assert_eq!(check_packed_rkey(&valid(UCX_1_13)[0], UCX_1_22), Ok(()));
    }

    #[test]
    fn memory_types_are_those_of_the_release() {
        let key = |mem_type| pack(&[(0, &IB)], mem_type, &[SYS_DEVICE_UNKNOWN]);
        assert_eq!(check_packed_rkey(&key(9), UCX_1_22), Ok(()));
        let refused = check_packed_rkey(&key(10), UCX_1_22).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "memory type 10, but UCX 1.22 knows only 0 to 9"
        );
        // GAUDI (9) came in 1.21.
        assert!(matches!(
            check_packed_rkey(&key(9), KeyLayout::for_release(1, 20)),
            Err(KeyFormatError::UnknownMemoryType { mem_type: 9, .. })
        ));
        let key = pack(&[(0, &IB)], 5, &[]);
        assert!(matches!(
            check_packed_rkey(&key, UCX_1_13),
            Err(KeyFormatError::UnknownMemoryType { mem_type: 5, .. })
        ));
    }

    #[test]
    fn distance_list_faults_are_named() {
        let key = v122_cuda();
        let n = key.len();
        let first = n - 1 - 4 * DISTANCE_LEN;
        // The terminator replaced by a device: an entry cut off.
        let mut k = key.clone();
        k[n - 1] = 4;
        assert_eq!(
            check_packed_rkey(&k, UCX_1_22),
            Err(KeyFormatError::DistanceTruncated {
                len: n,
                offset: n - 1
            })
        );
        // The terminator dropped.
        assert_eq!(
            check_packed_rkey(&key[..n - 1], UCX_1_22)
                .unwrap_err()
                .to_string(),
            format!(
                "{} bytes, and the distance list of system device 0x82 has no 0xff terminator",
                n - 1
            )
        );
        // Device 64, then a device that does not ascend.
        let mut k = key.clone();
        k[first] = 64;
        assert_eq!(
            check_packed_rkey(&k, UCX_1_22).unwrap_err().to_string(),
            format!(
                "its distance entry at byte {first} names device 64; devices are below 64 and \
                 ascend"
            )
        );
        let mut k = key.clone();
        k[first + DISTANCE_LEN] = 0;
        assert_eq!(
            check_packed_rkey(&k, UCX_1_22),
            Err(KeyFormatError::DistanceDevice {
                offset: first + DISTANCE_LEN,
                device: 0,
                previous: Some(0)
            })
        );
        // An unknown system device followed by distances: trailing bytes.
        let mut k = key.clone();
        k[first - 1] = SYS_DEVICE_UNKNOWN;
        assert!(matches!(
            check_packed_rkey(&k, UCX_1_22),
            Err(KeyFormatError::TrailingBytes { consumed, .. }) if consumed == first
        ));
    }

    /// xorshift64: deterministic, no dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Whatever the check passes, UCX's walk of the container stays inside the key: valid
    /// keys under random overwrites, insertions and truncations, and random short buffers
    /// with sparse md maps.
    #[test]
    fn passed_keys_keep_ucx_inside_them() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut passed = 0;
        for layout in [UCX_1_13, UCX_1_22] {
            let mut check = |key: &[u8]| {
                if check_packed_rkey(key, layout).is_ok() {
                    passed += 1;
                    assert!(ucx_reads(key, layout).is_some(), "{layout}: {key:02x?}");
                }
            };
            for key in valid(layout) {
                for _ in 0..2000 {
                    let mut k = key.clone();
                    for _ in 0..=rng.below(3) {
                        let byte = rng.next() as u8;
                        match rng.below(4) {
                            0 | 1 if !k.is_empty() => {
                                let i = rng.below(k.len());
                                k[i] = byte;
                            }
                            2 => {
                                let i = rng.below(k.len() + 1);
                                k.insert(i, byte);
                            }
                            _ if !k.is_empty() => k.truncate(rng.below(k.len())),
                            _ => {}
                        }
                    }
                    check(&k);
                }
            }
            for _ in 0..10_000 {
                let mut k: Vec<u8> = (0..rng.below(24)).map(|_| rng.next() as u8).collect();
                if k.len() >= 8 && rng.next() % 2 == 0 {
                    let sparse = rng.next() & rng.next() & rng.next() & 0xff;
                    k[..8].copy_from_slice(&sparse.to_ne_bytes());
                }
                check(&k);
            }
        }
        assert!(
            passed > 100,
            "only {passed} inputs passed: the property says little"
        );
    }
}
