//! Which UCX this process runs: the build it was linked against, the copies actually mapped,
//! and the transports and devices a context selects (what `kvferry doctor` prints).

use std::ffi::CStr;
use std::fs;
use std::os::raw::{c_char, c_int};
use std::path::{Path, PathBuf};
use std::ptr;

use ucx_sys as sys;

use crate::{Context, Error, Op, Status};

/// The UCX this crate was built against (`ucx-sys`'s build-time choice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linked {
    /// The library directory linked against, which is also the binaries' rpath.
    pub lib_dir: &'static str,
    /// Which rule chose it: `KVFERRY_UCX_DIR`, the workspace's wheel, or pkg-config.
    pub source: &'static str,
    /// The headers' UCP API version, `major.minor`.
    pub api_version: &'static str,
}

/// The UCX this crate was built against.
pub fn linked() -> Linked {
    Linked {
        lib_dir: sys::linked::LIB_DIR,
        source: sys::linked::SOURCE,
        api_version: sys::linked::API_VERSION,
    }
}

/// The loaded library's `(major, minor, release)`.
#[doc(alias = "ucp_get_version")]
pub fn release() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: the three out-pointers are valid for writes of one `c_uint` each.
    unsafe { sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}

/// The UCX core libraries (`libucp`, `libuct`, `libucs`, `libucm`, under any soname a
/// repackager gave them, e.g. `libucp-1a2b3c4d.so.0`) mapped into this process, sorted, from
/// `/proc/self/maps`. Empty where that file cannot be read.
pub fn loaded_libraries() -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = mapped_files()
        .into_iter()
        .filter(|path| is_core_library(path))
        .collect();
    found.sort();
    found.dedup();
    found
}

/// Every file mapped into this process, in `/proc/self/maps` order (with repeats). Empty
/// where that file cannot be read.
pub fn mapped_files() -> Vec<PathBuf> {
    let maps = read_maps().unwrap_or_default();
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.starts_with('/'))
        .map(PathBuf::from)
        .collect()
}

/// This process's memory map, as the kernel prints it: the one reader of `/proc/self/maps`.
fn read_maps() -> std::io::Result<String> {
    fs::read_to_string("/proc/self/maps")
}

/// One line of `/proc/self/maps`: `start-end perms offset dev inode [path]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mapping<'a> {
    start: usize,
    end: usize,
    /// `rwxs` / `rwxp`: the `s` (shared) or `p` (private) flag is last.
    perms: &'a str,
    offset: u64,
    /// `major:minor` of the backing file's device, and its inode: which file is mapped
    /// (a System V segment is `00:01` and its id; anonymous memory is inode 0).
    dev: &'a str,
    inode: u64,
}

impl<'a> Mapping<'a> {
    fn parse(line: &'a str) -> Option<Mapping<'a>> {
        let mut fields = line.split_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let perms = fields.next()?;
        let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
        let dev = fields.next()?;
        let inode = fields.next()?.parse().ok()?;
        Some(Mapping {
            start: usize::from_str_radix(start, 16).ok()?,
            end: usize::from_str_radix(end, 16).ok()?,
            perms,
            offset,
            dev,
            inode,
        })
    }

    /// Readable, writable and shared: what UCX's shared-memory transports map a peer's
    /// segment as (`mmap(MAP_SHARED)` of a `posix` file, `shmat` of a `sysv` segment).
    fn is_shared_rw(&self) -> bool {
        let p = self.perms.as_bytes();
        p.len() == 4 && p[0] == b'r' && p[1] == b'w' && p[3] == b's'
    }

    /// Whether `next` continues this mapping: adjacent, same file, the next bytes of it.
    fn continues_into(&self, next: &Mapping<'_>) -> bool {
        next.start == self.end
            && next.dev == self.dev
            && next.inode == self.inode
            && Some(next.offset) == self.offset.checked_add((self.end - self.start) as u64)
    }
}

/// Whether `[start, start + len)` lies inside readable, writable, shared mappings of one file
/// in this process (one mapping, or adjacent ones continuing each other), per
/// `/proc/self/maps`.
///
/// # Errors
///
/// `/proc/self/maps` cannot be read.
pub(crate) fn shared_rw_mapping_covers(start: usize, len: usize) -> std::io::Result<bool> {
    Ok(maps_cover(&read_maps()?, start, len))
}

/// The file a shared mapping of this process that holds `address` maps: its device
/// (`major:minor`) and inode, per `/proc/self/maps`. Two mappings of one `posix` segment or
/// one `sysv` segment (device `00:01`, inode its id) name the same file wherever they are
/// mapped; `None` for an address in no mapping, a private one, or anonymous memory (inode 0),
/// which no peer's key can name.
///
/// # Errors
///
/// `/proc/self/maps` cannot be read.
pub fn shared_file_at(address: usize) -> std::io::Result<Option<(String, u64)>> {
    Ok(file_at(&read_maps()?, address))
}

fn file_at(maps: &str, address: usize) -> Option<(String, u64)> {
    maps.lines()
        .filter_map(Mapping::parse)
        .find(|m| m.start <= address && address < m.end)
        .filter(|m| m.perms.ends_with('s') && m.inode != 0)
        .map(|m| (m.dev.to_string(), m.inode))
}

/// [`shared_rw_mapping_covers`] over the text of a maps file.
fn maps_cover(maps: &str, start: usize, len: usize) -> bool {
    let Some(end) = start.checked_add(len) else {
        return false;
    };
    // The kernel prints mappings in address order.
    let mut mappings = maps.lines().filter_map(Mapping::parse);
    let Some(mut last) = mappings.find(|m| m.start <= start && start < m.end) else {
        return false;
    };
    if !last.is_shared_rw() {
        return false;
    }
    while last.end < end {
        match mappings.next() {
            Some(next) if last.continues_into(&next) && next.is_shared_rw() => last = next,
            _ => return false,
        }
    }
    true
}

/// Every distinct `libucp` mapped into this process. More than one means two UCX copies are
/// live in one process — typically an engine's (or NIXL's bundled) UCX beside the one kvferry
/// was linked against — which deadlocks or corrupts memory; one copy must go (README "Which
/// UCX").
pub fn loaded_copies() -> Vec<PathBuf> {
    loaded_libraries()
        .into_iter()
        .filter(|p| file_name(p).starts_with("libucp"))
        .collect()
}

fn file_name(path: &Path) -> &str {
    path.file_name().and_then(|n| n.to_str()).unwrap_or("")
}

fn is_core_library(path: &Path) -> bool {
    let name = file_name(path);
    ["libucp", "libuct", "libucs", "libucm"].iter().any(|core| {
        name.strip_prefix(core)
            .is_some_and(|rest| rest.starts_with(".so") || rest.starts_with('-'))
    })
}

/// The directory UCX loads its transport modules from: `ucx/` next to the `libucs` that is
/// mapped (UCX's own rule, `UCX_MODULE_DIR` aside).
pub fn module_dir() -> Option<PathBuf> {
    loaded_libraries()
        .into_iter()
        .find(|p| file_name(p).starts_with("libucs"))
        .and_then(|p| p.parent().map(|dir| dir.join("ucx")))
}

/// One transport resource a context selected: a transport on a device (`tcp` on `eth0`,
/// `posix` on `memory`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    /// The transport (`tcp`, `posix`, `sysv`, `cma`, `self`, `cuda_copy`, `cuda_ipc`, `rc`...).
    pub transport: String,
    /// The device (`lo`, `eth0`, `memory`, `mlx5_0:1`, `cuda`...).
    pub device: String,
}

unsafe extern "C" {
    fn open_memstream(buffer: *mut *mut c_char, size: *mut usize) -> *mut sys::FILE;
    fn fclose(stream: *mut sys::FILE) -> c_int;
    fn free(ptr: *mut std::os::raw::c_void);
}

impl Context {
    /// The transport resources (transport, device) this context selected, in UCX's order,
    /// after `UCX_TLS` and `UCX_NET_DEVICES` (or their builder overrides) filtered them.
    ///
    /// Wraps `ucp_context_print_info`, read back through an in-memory `FILE`.
    ///
    /// # Errors
    ///
    /// [`Op::ContextQuery`] with [`Status::NO_MEMORY`] if the in-memory stream cannot be
    /// opened.
    #[doc(alias = "ucp_context_print_info")]
    pub fn resources(&self) -> Result<Vec<Resource>, Error> {
        Ok(parse_resources(&self.print_info()?))
    }

    /// The UCT components UCX loaded for this context (`self`, `tcp`, `posix`, `cuda_cpy`,
    /// `cuda_ipc`, `ib`...): a component whose module or driver library did not load is
    /// absent, whatever `UCX_TLS` asks for.
    ///
    /// # Errors
    ///
    /// As [`resources`](Self::resources).
    pub fn components(&self) -> Result<Vec<String>, Error> {
        Ok(parse_components(&self.print_info()?))
    }

    /// What `ucp_context_print_info` prints for this context: components, memory domains
    /// and resources.
    ///
    /// # Errors
    ///
    /// As [`resources`](Self::resources).
    pub fn print_info(&self) -> Result<String, Error> {
        let mut buffer: *mut c_char = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: both out-pointers are valid for writes; glibc owns the buffer until `fclose`,
        // after which it is ours to read and `free`.
        let stream = unsafe { open_memstream(&mut buffer, &mut size) };
        if stream.is_null() {
            return Err(Error::new(Op::ContextQuery, Status::NO_MEMORY));
        }
        // SAFETY: `self` is a live context and `stream` an open, writable stream.
        unsafe { sys::ucp_context_print_info(self.as_raw(), stream) };
        // SAFETY: `stream` is open and closed exactly once; closing flushes into `buffer`.
        unsafe { fclose(stream) };
        if buffer.is_null() {
            return Ok(String::new());
        }
        // SAFETY: after `fclose`, `buffer` is a NUL-terminated heap string of `size` bytes
        // that nothing else references.
        let text = unsafe { CStr::from_ptr(buffer) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: `buffer` was allocated by `open_memstream` (malloc) and is freed once.
        unsafe { free(buffer.cast()) };
        Ok(text)
    }
}

/// The `resource N : md M dev D flags -- transport/device` lines of
/// `ucp_context_print_info`.
fn parse_resources(info: &str) -> Vec<Resource> {
    info.lines()
        .filter(|line| line.trim_start_matches(['#', ' ']).starts_with("resource"))
        .filter_map(|line| line.rsplit_once("-- "))
        .filter_map(|(_, name)| name.trim().split_once('/'))
        .map(|(transport, device)| Resource {
            transport: transport.to_string(),
            device: device.to_string(),
        })
        .collect()
}

/// The `component N : name` lines of `ucp_context_print_info`.
fn parse_components(info: &str) -> Vec<String> {
    info.lines()
        .map(|line| line.trim_start_matches(['#', ' ']))
        .filter(|line| line.starts_with("component"))
        .filter_map(|line| line.split_once(':'))
        .map(|(_, name)| name.trim().to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_resource_lines() {
        let info = "#\n# UCP context\n#\n#     component 0  :  self\n#            md 1  :  \
                    component 1  tcp \n#\n#      resource 0  :  md 0  dev 0  flags -- \
                    self/memory\n#      resource 2  :  md 1  dev 2  flags -- tcp/lo\n#\n";
        assert_eq!(
            parse_resources(info),
            [
                Resource {
                    transport: "self".into(),
                    device: "memory".into()
                },
                Resource {
                    transport: "tcp".into(),
                    device: "lo".into()
                }
            ]
        );
    }

    #[test]
    fn reads_component_lines() {
        let info = "#     component 0  :  self\n#     component 1  :  cuda_cpy\n#            md 0  :  \
                    component 0  self \n";
        assert_eq!(parse_components(info), ["self", "cuda_cpy"]);
    }

    #[test]
    fn core_libraries_by_name() {
        for yes in [
            "/usr/lib/x86_64-linux-gnu/libucp.so.0.0.0",
            "/opt/nixl.libs/libucp-1a2b3c.so.0.0.0",
            "/x/libucm.so.0",
        ] {
            assert!(is_core_library(Path::new(yes)), "{yes}");
        }
        for no in [
            "/x/libucs_signal.so.0",
            "/x/ucx/libuct_cma.so.0",
            "/x/libucpx.so",
            "/x/libucp.a",
        ] {
            assert!(!is_core_library(Path::new(no)), "{no}");
        }
    }

    const MAPS: &str = "\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000100000 rw-s 00000000 00:01 6651954                    /SYSV00000000 (deleted)
7f0000100000-7f0000200000 rw-s 00000000 00:01 6651960                    /SYSV00000000 (deleted)
7f0000300000-7f0000380000 rw-s 00000000 00:1b 4793                       /dev/shm/ucx_shm_posix_27a24f8f (deleted)
7f0000380000-7f0000400000 rw-s 00080000 00:1b 4793                       /dev/shm/ucx_shm_posix_27a24f8f (deleted)
7f0000400000-7f0000500000 r--s 00000000 00:1b 4800                       /dev/shm/ro
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
";

    #[test]
    fn a_range_is_covered_only_by_shared_writable_mappings_of_one_file() {
        let cover = |start: usize, len: usize| maps_cover(MAPS, start, len);
        // Inside one segment, to its last byte.
        assert!(cover(0x7f00_0000_0000, 0x10_0000));
        assert!(cover(0x7f00_000f_ffff, 1));
        // One byte past it, into the next segment (another file), or before any mapping.
        assert!(!cover(0x7f00_0000_0000, 0x10_0001));
        assert!(!cover(0x7f00_0010_0000 - 1, 2));
        assert!(!cover(0x1000, 64));
        assert!(!cover(0x7f00_0020_0000, 1));
        // One file mapped in two adjacent pieces counts as one.
        assert!(cover(0x7f00_0030_0000, 0x10_0000));
        assert!(!cover(0x7f00_0030_0000, 0x10_0001));
        // Private, read-only, or wrapping around.
        assert!(!cover(0x55d0_c0a0_0000, 16));
        assert!(!cover(0x7ffd_0000_0000, 16));
        assert!(!cover(0x7f00_0040_0000, 16));
        assert!(!cover(usize::MAX, 2));
    }

    #[test]
    fn a_shared_file_is_named_by_device_and_inode_wherever_it_is_mapped() {
        let at = |a: usize| file_at(MAPS, a);
        assert_eq!(at(0x7f00_0000_0010), Some(("00:01".into(), 6651954)));
        assert_eq!(at(0x7f00_0038_0000), Some(("00:1b".into(), 4793)));
        assert_eq!(at(0x7f00_0030_0000), at(0x7f00_003f_ffff));
        // Private or anonymous memory, and no mapping at all: no file a key could name.
        assert_eq!(at(0x55d0_c0a0_0000), None);
        assert_eq!(at(0x7ffd_0000_0000), None);
        assert_eq!(at(0x1000), None);
    }

    #[test]
    fn this_process_maps_the_linked_ucx_once() {
        let ctx = Context::builder().tls("self").build().unwrap();
        let copies = loaded_copies();
        assert_eq!(copies.len(), 1, "{copies:?}");
        let linked_dir = fs::canonicalize(linked().lib_dir).unwrap();
        let loaded = fs::canonicalize(copies[0].parent().unwrap()).unwrap();
        assert_eq!(loaded, linked_dir, "the rpath should pick the linked UCX");
        let (major, minor, _) = release();
        assert_eq!(format!("{major}.{minor}"), linked().api_version);
        assert!(
            ctx.resources()
                .unwrap()
                .iter()
                .any(|r| r.transport == "self")
        );
        assert!(module_dir().unwrap().ends_with("ucx"));
    }
}
