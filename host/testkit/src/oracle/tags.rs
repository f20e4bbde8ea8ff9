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
    let whole = out.len() / 8 * 8;
    let (body, tail) = out.split_at_mut(whole);
    let w = i / 8;
    words(seed, w, body);
    if !tail.is_empty() {
        let n = tail.len();
        tail.copy_from_slice(&word(seed, w + (whole / 8) as u64).to_le_bytes()[..n]);
    }
}

/// Whole words `w ..` of the stream into `out` (a multiple of 8 bytes long). The oracle spends
/// half its time here, so where the CPU has AVX2 it hashes four words at once; the bytes are
/// the same.
fn words(seed: u64, w: u64, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has the feature `words_avx2` is compiled for, checked just above.
        unsafe { words_avx2(seed, w, out) };
        return;
    }
    words_portable(seed, w, out);
}

fn words_portable(seed: u64, w: u64, out: &mut [u8]) {
    for (k, chunk) in out.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(seed, w + k as u64).to_le_bytes());
    }
}

/// [`words_portable`], four words per step.
///
/// # Safety
///
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
// The intrinsics are `unsafe` before Rust 1.87 (the MSRV is older) and safe inside this
// function from then on.
#[allow(unused_unsafe)]
unsafe fn words_avx2(seed: u64, w: u64, out: &mut [u8]) {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi64, _mm256_mul_epu32, _mm256_set_epi64x, _mm256_set1_epi64x,
        _mm256_slli_epi64, _mm256_srli_epi64, _mm256_storeu_si256, _mm256_xor_si256,
    };
    // The low 64 bits of a * b in each lane, from 32-bit halves (AVX2 has no 64-bit multiply).
    #[inline(always)]
    fn mul(a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: only called from `words_avx2`, on a CPU with AVX2.
        unsafe {
            let low = _mm256_mul_epu32(a, b);
            let cross = _mm256_add_epi64(
                _mm256_mul_epu32(_mm256_srli_epi64::<32>(a), b),
                _mm256_mul_epu32(a, _mm256_srli_epi64::<32>(b)),
            );
            _mm256_add_epi64(low, _mm256_slli_epi64::<32>(cross))
        }
    }
    #[inline(always)]
    fn shift_xor(x: __m256i) -> __m256i {
        // SAFETY: as `mul`.
        unsafe { _mm256_xor_si256(x, _mm256_srli_epi64::<33>(x)) }
    }
    let done = (out.len() / 32 * 4) as u64;
    // SAFETY: the CPU has AVX2 (this function's contract); the casts reinterpret bits, so the
    // lanes do `word`'s u64 arithmetic.
    unsafe {
        let golden = _mm256_set1_epi64x(GOLDEN as i64);
        let m1 = _mm256_set1_epi64x(0xff51_afd7_ed55_8ccd_u64 as i64);
        let m2 = _mm256_set1_epi64x(0xc4ce_b9fe_1a85_ec53_u64 as i64);
        let seeds = _mm256_set1_epi64x(seed as i64);
        let four = _mm256_set1_epi64x(4);
        let mut index =
            _mm256_add_epi64(_mm256_set1_epi64x(w as i64), _mm256_set_epi64x(3, 2, 1, 0));
        for block in out.chunks_exact_mut(32) {
            let x = shift_xor(_mm256_xor_si256(seeds, mul(index, golden)));
            let x = shift_xor(mul(x, m1));
            let x = shift_xor(mul(x, m2));
            // `block` is 32 writable bytes and the store is unaligned; x86 is little endian,
            // so lane j lands as `word(seed, w + j).to_le_bytes()` at byte 8 j.
            _mm256_storeu_si256(block.as_mut_ptr().cast::<__m256i>(), x);
            index = _mm256_add_epi64(index, four);
        }
    }
    let tail = out.len() / 32 * 32;
    words_portable(seed, w + done, &mut out[tail..]);
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
    fn every_path_writes_the_same_words() {
        for (w, len) in [
            (0u64, 0usize),
            (3, 8),
            (5, 64),
            (1 << 40, 72),
            (7, 4096 + 56),
        ] {
            let mut fast = vec![0u8; len];
            let mut plain = vec![0u8; len];
            words(99, w, &mut fast);
            words_portable(99, w, &mut plain);
            assert_eq!(fast, plain, "{len} bytes from word {w}");
        }
    }

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
