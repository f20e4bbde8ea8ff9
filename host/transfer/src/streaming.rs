//! Copies into a peer's shared mapping (the rank thread's direct copies over shared memory)
//! with non-temporal stores, which write whole cache lines to memory without reading them
//! first and without evicting the sender's cache for bytes only the receiver will read.
//!
//! Measured on the 2-core machine (4 MiB of L2 a core). A C loop, 40 MiB per round from a
//! 1 GiB source ring into a 1 GiB `memfd` mapped shared, as a peer's pool is: `memmove`
//! 5.8–5.9 ms, SSE2 streaming stores 3.9–4.8 ms — 1.2× at 16 KiB fragments, 1.3–1.4× from
//! 64 KiB, 1.5× at 1–4 MiB. But a job that fits in the caches is faster with `memmove`:
//! `kvferry bench --sweep --transport shm` (one request of 256 KiB–4 MiB fragments, both ways
//! alternating, two passes) ran 1.2–1.6× faster with `memmove` up to 8 MiB a request and
//! 1.05–1.30× faster streaming from 16 MiB. So a job streams from [`STREAM_MIN_JOB_BYTES`],
//! its fragments from [`STREAM_MIN_BYTES`]; everything else (and off x86-64, and ranges that
//! overlap) is `memmove`, as before.

/// Jobs (one piece to one receiver) of at least this many bytes stream their fragments.
pub(crate) const STREAM_MIN_JOB_BYTES: u64 = 16 << 20;
/// Fragments of a streaming job of at least this many bytes are copied with streaming stores.
pub(crate) const STREAM_MIN_BYTES: usize = 16 << 10;

/// Copies `n` bytes from `src` to `dst`, as [`std::ptr::copy`] does; with `stream` (the job
/// is at least [`STREAM_MIN_JOB_BYTES`]), ranges of at least [`STREAM_MIN_BYTES`] that do not
/// overlap are written with non-temporal stores on x86-64, followed by a store fence, so the
/// bytes are ordered before whatever the caller writes next (a completion message).
///
/// # Safety
///
/// As for [`std::ptr::copy`]: `src` must be valid for reads of `n` bytes and `dst` valid for
/// writes of `n` bytes (they may overlap).
pub(crate) unsafe fn copy_to_peer(src: *const u8, dst: *mut u8, n: usize, stream: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        let (s, d) = (src as usize, dst as usize);
        let disjoint = s.saturating_add(n) <= d || d.saturating_add(n) <= s;
        if stream && n >= STREAM_MIN_BYTES && disjoint {
            // SAFETY: the caller's contract, and the two ranges do not overlap.
            unsafe { stream_copy(src, dst, n) };
            return;
        }
    }
    // SAFETY: the caller's contract, which is `ptr::copy`'s.
    unsafe { std::ptr::copy(src, dst, n) }
}

/// The streaming copy: `memcpy` up to the destination's first 16-byte boundary, then 64
/// bytes (one cache line) at a time with unaligned loads and aligned non-temporal stores,
/// the tail with `memcpy`, and a store fence.
///
/// # Safety
///
/// `src` valid for reads of `n` bytes, `dst` valid for writes of `n` bytes, the two not
/// overlapping.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(mut src: *const u8, mut dst: *mut u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    let head = dst.align_offset(16).min(n);
    // SAFETY: `head <= n`, inside both ranges, which do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        src = src.add(head);
        dst = dst.add(head);
    }
    let rest = n - head;
    for _ in 0..rest / 64 {
        // SAFETY: 64 bytes remain in both ranges at `src` and `dst`; `dst` is 16-byte aligned
        // (the head brought it there and every step adds 64), as `_mm_stream_si128` needs;
        // the loads are unaligned ones. SSE2 is part of x86-64, so the intrinsics exist on
        // every target this compiles for.
        unsafe {
            let a = _mm_loadu_si128(src.cast::<__m128i>());
            let b = _mm_loadu_si128(src.add(16).cast::<__m128i>());
            let c = _mm_loadu_si128(src.add(32).cast::<__m128i>());
            let d = _mm_loadu_si128(src.add(48).cast::<__m128i>());
            _mm_stream_si128(dst.cast::<__m128i>(), a);
            _mm_stream_si128(dst.add(16).cast::<__m128i>(), b);
            _mm_stream_si128(dst.add(32).cast::<__m128i>(), c);
            _mm_stream_si128(dst.add(48).cast::<__m128i>(), d);
            src = src.add(64);
            dst = dst.add(64);
        }
    }
    // SAFETY: the last `rest % 64` bytes of both ranges; the fence orders the streaming
    // stores before every later store of this thread.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, rest % 64);
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 131 + i / 251) as u8).collect()
    }

    /// Every length around the cache-line and threshold edges, every destination and source
    /// misalignment: the copied bytes are the source's, and the bytes around them untouched.
    #[test]
    fn copies_exactly_the_range_at_every_alignment() {
        let lengths = [
            0,
            1,
            63,
            64,
            65,
            STREAM_MIN_BYTES - 1,
            STREAM_MIN_BYTES,
            STREAM_MIN_BYTES + 1,
            STREAM_MIN_BYTES + 63,
            100_003,
        ];
        for (n, stream) in lengths.into_iter().flat_map(|n| [(n, true), (n, false)]) {
            for src_off in [0, 1, 7, 16] {
                for dst_off in [0, 3, 15, 16, 33] {
                    let src = pattern(n + src_off);
                    let mut dst = vec![0xA5u8; n + dst_off + 64];
                    // SAFETY: `n` bytes from `src_off` of `src` and from `dst_off` of `dst`
                    // lie inside the two vectors, which are distinct.
                    unsafe {
                        copy_to_peer(
                            src.as_ptr().add(src_off),
                            dst.as_mut_ptr().add(dst_off),
                            n,
                            stream,
                        )
                    };
                    assert_eq!(&dst[dst_off..dst_off + n], &src[src_off..], "n {n}");
                    assert!(dst[..dst_off].iter().all(|&b| b == 0xA5), "n {n}: before");
                    assert!(
                        dst[dst_off + n..].iter().all(|&b| b == 0xA5),
                        "n {n}: after"
                    );
                }
            }
        }
    }

    /// Overlapping ranges keep `ptr::copy`'s meaning (the source as it was before the copy).
    #[test]
    fn overlapping_ranges_copy_as_memmove_does() {
        let n = STREAM_MIN_BYTES * 2;
        for shift in [1usize, 64, 4096] {
            let original = pattern(n + shift);
            let mut forward = original.clone();
            let mut backward = original.clone();
            let p = forward.as_mut_ptr();
            // SAFETY: both ranges of `n` bytes lie inside `forward`; overlap is allowed.
            unsafe { copy_to_peer(p, p.add(shift), n, true) };
            assert_eq!(&forward[shift..], &original[..n]);
            let p = backward.as_mut_ptr();
            // SAFETY: as above.
            unsafe { copy_to_peer(p.add(shift), p, n, true) };
            assert_eq!(&backward[..n], &original[shift..]);
        }
    }
}
