//! What `ucp_rkey_ptr` translates, and how `RemoteKey::check_range` uses it to refuse a peer
//! range that its key does not map (a hostile declaration would otherwise make our puts write
//! at a wild address: over shared memory the sender copies them itself).

use crate::common;

use std::sync::Arc;

use common::Transport;
use kvferry_ucx::{Context, Endpoint, MemRegion, Op, RangeCheck, RemoteKey, Status, Worker};

/// A multiple of 2 MiB, so the segment is exactly this long whether or not UCX backs it with
/// huge pages: one byte past it is outside it.
const LEN: u64 = 2 << 20;

/// A target region of `LEN` bytes in `target_ctx`, and its key unpacked on an endpoint from
/// a worker of `initiator_ctx`. The workers and the region live as long as the key is used.
struct Target {
    key: RemoteKey,
    base: u64,
    _ep: Endpoint,
    _region: MemRegion,
    _workers: (Worker, Worker),
}

fn target(target_ctx: &Arc<Context>, initiator_ctx: &Arc<Context>, region: MemRegion) -> Target {
    let b = Worker::new(target_ctx).unwrap();
    let a = Worker::new(initiator_ctx).unwrap();
    let ep = a.connect(&b.address().unwrap()).unwrap();
    let key = ep
        .unpack_rkey(region.pack_rkey().unwrap().as_bytes())
        .unwrap();
    Target {
        key,
        base: region.remote_addr(),
        _ep: ep,
        _region: region,
        _workers: (a, b),
    }
}

fn allocated(tls: &str) -> Target {
    let target_ctx = Context::builder().tls(tls).build().unwrap();
    let initiator_ctx = Context::builder().tls(tls).build().unwrap();
    let region = MemRegion::allocate(&target_ctx, LEN as usize).unwrap();
    target(&target_ctx, &initiator_ctx, region)
}

/// The shared-memory selections: both mappers together (sysv allocates first), and each alone.
const SHM: [&str; 3] = ["posix,sysv,self", "posix,self", "sysv,self"];

fn refused(result: Result<RangeCheck, kvferry_ucx::Error>) -> Status {
    let err = result.expect_err("range should be refused");
    assert_eq!(err.op(), Op::RkeyPtr, "{err:?}");
    err.status()
}

/// The measured behaviour `check_range` is built on: over `posix` and `sysv`, UCX translates
/// every address by one constant offset, inside the segment or not (UCX 1.22.0 and 1.13.1).
#[test]
fn rkey_ptr_translates_any_address_over_shm() {
    for tls in SHM {
        let t = allocated(tls);
        let start = t.key.ptr(t.base).unwrap() as u64;
        let offset = start.wrapping_sub(t.base);
        for raddr in [
            t.base + LEN - 1,
            t.base + LEN,
            t.base + (64 << 20),
            t.base - 4096,
            0x1000,
            0,
            u64::MAX,
        ] {
            let local = t
                .key
                .ptr(raddr)
                .unwrap_or_else(|e| panic!("{tls}: {raddr:#x}: {e:?}"));
            assert_eq!(
                (local as u64).wrapping_sub(raddr),
                offset,
                "{tls}: {raddr:#x} translated by another offset"
            );
        }
    }
}

/// A key no transport here can map fails for every address, inside or not: UCX answers per
/// key, so a wild address never makes a mappable key look unmappable.
#[test]
fn rkey_ptr_is_unreachable_for_every_address_of_an_unmappable_key() {
    let tcp = Transport::Tcp.context();
    let over_tcp = target(
        &tcp,
        &Transport::Tcp.context(),
        MemRegion::allocate(&tcp, LEN as usize).unwrap(),
    );
    let shm = Transport::Shm.context();
    let mut backing = vec![0u8; LEN as usize];
    // SAFETY: `backing` outlives the region (the target drops before it) and nothing else
    // touches it meanwhile.
    let registered =
        unsafe { MemRegion::register(&shm, backing.as_mut_ptr(), backing.len()) }.unwrap();
    let over_shm = target(&shm, &Transport::Shm.context(), registered);
    for t in [&over_tcp, &over_shm] {
        for raddr in [t.base, t.base + LEN - 1, t.base + LEN, 0x1000, 0] {
            let err = t.key.ptr(raddr).unwrap_err();
            assert_eq!(
                (err.op(), err.status()),
                (Op::RkeyPtr, Status::UNREACHABLE),
                "{raddr:#x}"
            );
        }
        assert_eq!(t.key.check_range(0x1000, 64), Ok(RangeCheck::NotMappable));
        assert_eq!(t.key.check_range(t.base, LEN), Ok(RangeCheck::NotMappable));
    }
    drop(over_shm);
    drop(backing);
}

#[test]
fn check_range_accepts_what_the_segment_holds() {
    for tls in SHM {
        let t = allocated(tls);
        for (base, len) in [
            (t.base, LEN),
            (t.base, 1),
            (t.base + LEN - 1, 1),
            (t.base + 100, 200),
        ] {
            assert_eq!(
                t.key.check_range(base, len),
                Ok(RangeCheck::Mapped),
                "{tls}: {base:#x} +{len}"
            );
        }
    }
}

/// A wild base with a real key, and every range that leaves the segment, is refused by name
/// (and nothing is written: the test process survives).
#[test]
fn check_range_refuses_what_leaves_the_segment() {
    // This context moves host memory only, so a translation outside the segment is an error
    // rather than a device address for the caller to check.
    assert!(
        Transport::Shm
            .context()
            .memory_types()
            .unwrap()
            .iter()
            .all(|t| t.is_host())
    );
    for tls in SHM {
        let t = allocated(tls);
        for (base, len) in [
            (0x1000, LEN),
            (0x1000, 64),
            (0, 1),
            (t.base, LEN + 1),
            (t.base + LEN - 1, 2),
            (t.base - 1, 2),
            (t.base - 4096, LEN),
        ] {
            assert_eq!(
                refused(t.key.check_range(base, len)),
                Status::INVALID_ADDR,
                "{tls}: {base:#x} +{len}"
            );
        }
        assert_eq!(refused(t.key.check_range(t.base, 0)), Status::INVALID_PARAM);
        assert_eq!(
            refused(t.key.check_range(u64::MAX, 2)),
            Status::INVALID_PARAM
        );
        assert_eq!(
            refused(t.key.check_range(1 << 63, 1 << 63)),
            Status::INVALID_PARAM
        );
    }
}
