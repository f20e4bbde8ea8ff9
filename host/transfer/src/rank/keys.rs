//! What a rank thread checks of a peer's pools before it puts anything through their keys:
//! that each declared range lies inside what its key maps ([`check_key_range`]), and that a key
//! mapped here is neither a file of this rank's own memory ([`refuse_own_file`]) nor translates
//! a pool into another mapping than its own segment ([`in_own_segment`]).

use std::ptr::NonNull;

use kvferry_protocol::PoolKey;
use kvferry_ucx::{PeerProcess, RangeCheck, RemoteKey, Status};

use super::{RemoteRank, WriteError};
use crate::bounce::Staging;
use crate::memory::RankPools;

/// The shared files ([`kvferry_ucx::library::shared_file_at`]) this rank's pools and staging
/// buffer map: what no peer's key may map here.
pub(super) fn own_files(pools: &RankPools, staging: Option<&Staging>) -> Vec<(String, u64)> {
    let staging = staging.map(Staging::region);
    let mut files: Vec<(String, u64)> = (0..pools.len())
        .filter_map(|p| pools.region(p))
        .chain(staging)
        .filter_map(|r| {
            kvferry_ucx::library::shared_file_at(r.as_ptr() as usize)
                .ok()
                .flatten()
        })
        .collect();
    files.sort();
    files.dedup();
    files
}

/// Refuses a peer's pool that `local` (where its key translated its base here) shows to be a
/// mapping of one of `own` — this rank's own memory, which a peer may name only to have a
/// rank overwrite its own sources.
pub(super) fn refuse_own_file(own: &[(String, u64)], local: NonNull<u8>) -> Result<(), String> {
    match kvferry_ucx::library::shared_file_at(local.as_ptr() as usize) {
        Ok(Some(file)) if own.contains(&file) => Err(format!(
            "its key maps this rank's own memory (file {} inode {}): a peer's key may name              only its own",
            file.0, file.1
        )),
        Ok(_) => Ok(()),
        Err(e) => Err(format!(
            "/proc/self/maps cannot be read to tell whose memory its key maps: {e}"
        )),
    }
}

/// Refuses a pool whose base, translated by its key to `local`, lies in another shared file
/// than the segment the key itself names (UCX translates every address by one offset, so a
/// key whose address field is forged can reach another peer's segment mapped here).
pub(super) fn in_own_segment(
    peer: &PeerProcess,
    packed: &[u8],
    key: &RemoteKey,
    local: NonNull<u8>,
) -> Result<(), String> {
    let file = |at: usize| kvferry_ucx::library::shared_file_at(at).ok().flatten();
    let found = file(local.as_ptr() as usize);
    let own: Vec<_> = peer
        .segment_starts(packed)
        .into_iter()
        .filter_map(|start| key.ptr(start).ok())
        .filter_map(|p| file(p as usize))
        .collect();
    match found {
        Some(f) if own.contains(&f) => Ok(()),
        // A key no shared-memory entry of which UCX unpacks here maps nothing this names.
        _ if own.is_empty() => Ok(()),
        _ => Err(
            "its key translates that range into another mapping than the segment the key              names"
                .into(),
        ),
    }
}

/// Checks that pool `pool` of `dest`, declared as `declared`, lies inside what its unpacked
/// `key` maps ([`RemoteKey::check_range`]); a device range (`cuda_ipc`) is checked with the
/// CUDA driver, and refused in a build without the `cuda` feature. Returns the local address of
/// the declared base when the key maps the range into a shared host mapping here ([`Mapped`]).
pub(super) fn check_key_range(
    dest: &RemoteRank,
    pool: usize,
    declared: &PoolKey,
    key: &RemoteKey,
) -> Result<Option<NonNull<u8>>, WriteError> {
    let refuse = |reason, source| WriteError::KeyRange {
        instance: dest.instance.clone(),
        rank: dest.rank,
        pool,
        base: declared.base,
        len: declared.len,
        reason,
        source,
    };
    match key.check_range(declared.base, declared.len) {
        // The base translated when the range was checked; it translates alike again.
        Ok(RangeCheck::Mapped) => Ok(key.ptr(declared.base).ok().and_then(NonNull::new)),
        Ok(RangeCheck::NotMappable) => Ok(None),
        Ok(RangeCheck::Device { local }) => {
            #[cfg(feature = "cuda")]
            if crate::cuda::device_allocation_holds(local as u64, declared.len) {
                return Ok(None);
            }
            let _ = local;
            Err(refuse(
                if cfg!(feature = "cuda") {
                    "its key translates that range outside every shared host mapping and \
                     every single cuda allocation of this process"
                } else {
                    "its key translates that range outside every shared host mapping, and \
                     this build (without the cuda feature) cannot check device memory"
                },
                None,
            ))
        }
        Ok(_) => Err(refuse(
            "ucx reports a range check this build does not know",
            None,
        )),
        Err(e) => Err(refuse(
            match e.status() {
                Status::INVALID_ADDR => "its key does not map that range into this process",
                Status::INVALID_PARAM => "that range is empty or wraps around",
                Status::IO_ERROR => "/proc/self/maps cannot be read to check it",
                _ => "its key does not translate the whole range",
            },
            Some(e),
        )),
    }
}
