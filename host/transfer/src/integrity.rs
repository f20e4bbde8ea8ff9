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
}
