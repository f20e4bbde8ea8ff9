//! Tag streams: the hashes that turn a run's logical coordinates into bytes, addressable at
//! any offset, and the background patterns (canary, foreign) around them.

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// Stands for "no token" in the seed of a STATE run.
pub(super) const NO_TOKEN: u64 = u64::MAX;

/// MurmurHash3's 64-bit finalizer: a bijection that mixes every input bit into every output bit.
fn fmix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

pub(super) fn combine(h: u64, v: u64) -> u64 {
    fmix(h.wrapping_mul(GOLDEN).rotate_left(29) ^ v)
}

pub(super) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Word `w` of the stream keyed by `seed`.
#[inline]
fn word(seed: u64, w: u64) -> u64 {
    fmix(seed ^ w.wrapping_mul(GOLDEN))
}

/// Bytes `start .. start + out.len()` of the stream keyed by `seed`.
pub(super) fn stream(seed: u64, start: u64, out: &mut [u8]) {
    let mut out = out;
    let mut i = start;
    let lead = (i % 8) as usize;
    if lead != 0 {
        let bytes = word(seed, i / 8).to_le_bytes();
        let n = (8 - lead).min(out.len());
        out[..n].copy_from_slice(&bytes[lead..lead + n]);
        out = &mut out[n..];
        i += n as u64;
    }
    let mut w = i / 8;
    let mut words = out.chunks_exact_mut(8);
    for chunk in &mut words {
        chunk.copy_from_slice(&word(seed, w).to_le_bytes());
        w += 1;
    }
    let tail = words.into_remainder();
    if !tail.is_empty() {
        let n = tail.len();
        tail.copy_from_slice(&word(seed, w).to_le_bytes()[..n]);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Background {
    Canary = 1,
    Foreign = 2,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct BackgroundSeed {
    pub(super) kind: Background,
    pub(super) seed: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_is_addressable_at_any_byte() {
        let mut whole = vec![0u8; 100];
        stream(42, 3, &mut whole);
        for split in [0usize, 1, 5, 7, 8, 13, 99, 100] {
            let mut parts = vec![0u8; 100];
            let (a, b) = parts.split_at_mut(split);
            stream(42, 3, a);
            stream(42, 3 + split as u64, b);
            assert_eq!(parts, whole, "split at {split}");
        }
        let mut short = [0u8; 3];
        stream(42, 9, &mut short);
        assert_eq!(short, whole[6..9]);
        let mut other = vec![0u8; 100];
        stream(43, 3, &mut other);
        assert_ne!(other, whole);
    }
}
