//! End-to-end integrity digests of pieces ([`kvferry_protocol::Integrity`]): the hash of a
//! piece's packed image, the bytes it writes in the order of their destination addresses.
//!
//! The sender hashes its source bytes in that order (its plan's gather list,
//! [`kvferry_plan::bounce::gather_list`]); the receiver hashes the bytes that landed in its
//! slots by its own plan of the piece ([`kvferry_plan::bounce::scatter_runs`]). The image
//! depends only on the set of destination bytes and what was written there, so how either
//! plan cuts or orders its fragments does not matter. Host memory only: a digest reads the
//! bytes with the CPU.

use kvferry_protocol::Integrity;

/// A running digest.
pub(crate) enum Digest {
    Xxh3(Box<xxhash_rust::xxh3::Xxh3>),
    Crc32c(u32),
}

impl Digest {
    pub(crate) fn new(algorithm: Integrity) -> Digest {
        match algorithm {
            Integrity::Xxh3 => Digest::Xxh3(Box::default()),
            Integrity::Crc32c => Digest::Crc32c(0),
        }
    }

    pub(crate) fn update(&mut self, bytes: &[u8]) {
        match self {
            Digest::Xxh3(h) => h.update(bytes),
            Digest::Crc32c(crc) => *crc = crc32c::crc32c_append(*crc, bytes),
        }
    }

    /// The digest (a CRC-32C in the low 32 bits).
    pub(crate) fn finish(&self) -> u64 {
        match self {
            Digest::Xxh3(h) => h.digest(),
            Digest::Crc32c(crc) => u64::from(*crc),
        }
    }
}

/// A CRC-32C of at least this many bytes is computed by two threads, each over half of the
/// runs, and the halves combined (`crc32c_combine`): the one digest of the whole, in about half
/// the time where a second core is free.
pub(crate) const SPLIT_MIN_BYTES: u64 = 4 << 20;

/// The digest of the bytes at `runs` (`(address, len)` in this process), in order.
///
/// # Safety
///
/// Every run is initialised host memory of this process, readable for the whole call and
/// written by no one during it (a piece's bytes: sources held from `send` to the request's
/// end, or destinations whose writer has flushed and reported).
pub(crate) unsafe fn digest_runs(
    algorithm: Integrity,
    runs: impl IntoIterator<Item = (u64, u64)>,
) -> u64 {
    let runs: Vec<(u64, u64)> = runs.into_iter().filter(|&(_, len)| len > 0).collect();
    let total: u64 = runs.iter().map(|&(_, len)| len).sum();
    if algorithm != Integrity::Crc32c || total < SPLIT_MIN_BYTES {
        // SAFETY: the caller's contract, passed on.
        return unsafe { digest_in_order(algorithm, runs) };
    }
    // The runs up to half the bytes, and the rest (a run that straddles the middle is cut).
    let (mut first, mut second) = (Vec::new(), Vec::new());
    let mut left = total / 2;
    for (address, len) in runs {
        let here = len.min(left);
        if here > 0 {
            first.push((address, here));
        }
        if here < len {
            second.push((address + here, len - here));
        }
        left -= here;
    }
    let second_len = total - total / 2;
    let (a, b) = std::thread::scope(|scope| {
        // SAFETY: the caller's contract covers every run, and so each part of one; the scope
        // joins the thread before the call returns.
        let other = scope.spawn(move || unsafe { digest_in_order(algorithm, second) });
        // SAFETY: as above.
        let a = unsafe { digest_in_order(algorithm, first) };
        (a, other.join())
    });
    match b {
        Ok(b) => u64::from(crc32c::crc32c_combine(
            a as u32,
            b as u32,
            second_len as usize,
        )),
        // The helper cannot panic on readable memory; if it did, nothing is vouched for.
        Err(_) => u64::MAX,
    }
}

/// [`digest_runs`] on this thread alone.
///
/// # Safety
///
/// As [`digest_runs`].
unsafe fn digest_in_order(algorithm: Integrity, runs: Vec<(u64, u64)>) -> u64 {
    let mut digest = Digest::new(algorithm);
    for (address, len) in runs {
        if len == 0 {
            continue;
        }
        // SAFETY: by this function's contract the run is readable, initialised and unchanged
        // for the call; a run of a validated plan lies inside one pool, whose length fits
        // `usize` (it was registered).
        let bytes =
            unsafe { std::slice::from_raw_parts(address as usize as *const u8, len as usize) };
        digest.update(bytes);
    }
    digest.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest_of(algorithm: Integrity, parts: &[&[u8]]) -> u64 {
        let runs = parts.iter().map(|p| (p.as_ptr() as u64, p.len() as u64));
        // SAFETY: every run is a slice borrowed for the call.
        unsafe { digest_runs(algorithm, runs) }
    }

    /// The digest of runs is the digest of their concatenation, whatever the cuts: what lets
    /// two plans that cut one image differently agree.
    #[test]
    fn runs_hash_as_their_concatenation() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
        for algorithm in [Integrity::Xxh3, Integrity::Crc32c] {
            let whole = digest_of(algorithm, &[&bytes]);
            let cut = digest_of(
                algorithm,
                &[
                    &bytes[..1],
                    &bytes[1..4096],
                    &bytes[4096..4096],
                    &bytes[4096..],
                ],
            );
            assert_eq!(whole, cut, "{algorithm}");
            let mut other = bytes.clone();
            other[5000] ^= 1;
            assert_ne!(
                whole,
                digest_of(algorithm, &[&other]),
                "{algorithm}: one flipped bit"
            );
        }
        // Known values: CRC-32C of "123456789" is 0xE3069283; XXH3-64 of nothing is
        // 0x2D06800538D394C2.
        assert_eq!(digest_of(Integrity::Crc32c, &[b"123456789"]), 0xE306_9283);
        assert_eq!(digest_of(Integrity::Xxh3, &[]), 0x2D06_8005_38D3_94C2);
    }

    /// A CRC-32C large enough to be split over two threads is the CRC-32C of the whole, for
    /// any cuts (a run that straddles the middle, an odd total, many small runs).
    #[test]
    fn a_split_crc_is_the_crc_of_the_whole() {
        let len = SPLIT_MIN_BYTES as usize * 2 + 12_345;
        let bytes: Vec<u8> = (0..len as u64).map(|i| (i * 131 + i / 977) as u8).collect();
        let want = u64::from(crc32c::crc32c(&bytes));
        assert_eq!(digest_of(Integrity::Crc32c, &[&bytes]), want);
        let (a, rest) = bytes.split_at(len / 3 + 1);
        let (b, c) = rest.split_at(len / 2 - 7);
        assert_eq!(digest_of(Integrity::Crc32c, &[a, b, c]), want);
        let many: Vec<&[u8]> = bytes.chunks(8192 + 13).collect();
        assert_eq!(digest_of(Integrity::Crc32c, &many), want);
    }
}
