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
//! overlap) is `memmove`, as before. A job's copies, streaming or not, are shared with a
//! helper thread from [`SHARE_MIN_JOB_BYTES`] ([`CopyHelper`], [`Halves`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender, TryRecvError};
use std::sync::{Arc, OnceLock};
use std::thread;

/// Jobs (one piece to one receiver) of at least this many bytes stream their fragments.
pub(crate) const STREAM_MIN_JOB_BYTES: u64 = 16 << 20;
/// Fragments of a streaming job of at least this many bytes are copied with streaming stores.
pub(crate) const STREAM_MIN_BYTES: usize = 16 << 10;
/// Jobs of at least this many bytes share their direct copies with a helper thread
/// ([`Halves`]), streaming or not. One 128-token DeepSeek-V3 request over shm (4.3 MiB in
/// one job, dep1 → dep1) went from 0.60–0.62 ms to 0.44–0.68 (median 0.48) with it, a
/// 64-token one (2.2 MiB) from 0.42 to 0.35–0.41; at 32 tokens (1.1 MiB, about 55 µs of
/// copying) the helper's wake-up ate the gain (docs/BENCHMARKS.md "Two threads for
/// cache-sized copies").
pub(crate) const SHARE_MIN_JOB_BYTES: u64 = 2 << 20;

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

/// A run to copy: source address, destination address, bytes (addresses as integers, so a
/// list of them crosses to the helper thread).
pub(crate) type Run = (usize, usize, usize);

/// Makes every copy of `runs` in order, as [`copy_to_peer`] with `stream`.
///
/// # Safety
///
/// As [`Halves::run`]: every run's source valid for reads and destination valid for writes
/// of its bytes for the duration of the call.
unsafe fn copy_runs(runs: &[Run], stream: bool) {
    for &(src, dst, n) in runs {
        // SAFETY: the caller's contract.
        unsafe { copy_to_peer(src as *const u8, dst as *mut u8, n, stream) };
    }
}

/// A job's copies, split between the rank thread and a helper thread: on the
/// 2-core machine one thread streams 8.2–8.8 GB/s into a shared mapping and two 10.6 GB/s
/// (4 MiB) to 14.2–16.1 GB/s (16–128 MiB; a C loop, 2 threads each copying half).
/// [`Halves::run`] hands the helper the second half of the bytes, copies the first itself,
/// and returns only once the helper has finished, so the memory behind every run need only
/// outlive that call.
pub(crate) struct CopyHelper {
    tasks: Sender<(Arc<[Run]>, bool, Sender<()>)>,
}

impl CopyHelper {
    /// Starts the helper thread (`copy-LABEL`); it ends when the helper is dropped.
    pub(crate) fn spawn(label: &str) -> std::io::Result<Self> {
        let (tasks, rx) = mpsc::channel::<(Arc<[Run]>, bool, Sender<()>)>();
        thread::Builder::new()
            .name(format!("copy-{label}"))
            .spawn(move || {
                for (runs, stream, done) in rx {
                    // SAFETY: `Halves::run` sent these runs with its caller's promise (valid
                    // ranges until it returns) and does not return before the `done` below
                    // is sent or this thread is gone.
                    unsafe { copy_runs(&runs, stream) };
                    let _ = done.send(());
                }
            })?;
        Ok(Self { tasks })
    }
}

/// Jobs sharing their copies being copied in this process now (by rank threads, helpers
/// not counted).
static SHARING: AtomicUsize = AtomicUsize::new(0);

/// A job that may share its copies, counted in [`SHARING`] while it lives.
pub(crate) struct Sharing(());

impl Sharing {
    /// Counts one more such job; whether it may take a helper: only while the jobs
    /// copying at once, each with a helper, need no more threads than the machine has cores
    /// (on the 2-core machine, a job alone). Where every core already has a rank thread
    /// copying, a helper adds only switching: Llama-3-70B tp4 → tp8, four rank threads each
    /// streaming 84 MB jobs, ran at 11.2 GB/s with a helper each against 12.4 without.
    pub(crate) fn start() -> (Self, bool) {
        // Asked once: the answer reads the affinity mask and the cgroup's quota files.
        static CORES: OnceLock<usize> = OnceLock::new();
        let cores = *CORES
            .get_or_init(|| thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get));
        let copying = SHARING.fetch_add(1, Ordering::AcqRel) + 1;
        (Self(()), copying.saturating_mul(2) <= cores)
    }
}

impl Drop for Sharing {
    fn drop(&mut self) {
        SHARING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A job's copies, gathered before any is made (see [`CopyHelper`]).
pub(crate) struct Halves {
    runs: Vec<Run>,
    bytes: usize,
    /// Whether the job streams ([`copy_to_peer`]'s `stream`).
    stream: bool,
}

impl Halves {
    /// No copies yet, for a job that streams (`stream`) or not.
    pub(crate) fn new(stream: bool) -> Self {
        Self {
            runs: Vec::new(),
            bytes: 0,
            stream,
        }
    }

    /// Whether no copy was added (a job whose fragments all go as UCX puts).
    pub(crate) fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Adds a copy of `n` bytes from `src` to `dst`.
    pub(crate) fn push(&mut self, src: *const u8, dst: *mut u8, n: usize) {
        if n > 0 {
            self.runs.push((src as usize, dst as usize, n));
            self.bytes += n;
        }
    }

    /// Whether the span from the lowest source byte to the highest and the same span of
    /// the destinations do not meet (so no run reads what another writes; destinations never
    /// overlap each other in a validated plan).
    fn sources_apart_from_destinations(&self) -> bool {
        let span = |pick: fn(&Run) -> usize| {
            self.runs.iter().fold((usize::MAX, 0usize), |(lo, hi), r| {
                let at = pick(r);
                (lo.min(at), hi.max(at.saturating_add(r.2)))
            })
        };
        let (src_lo, src_hi) = span(|r| r.0);
        let (dst_lo, dst_hi) = span(|r| r.1);
        src_hi <= dst_lo || dst_hi <= src_lo
    }

    /// Makes every copy, as [`copy_to_peer`] with `stream`: the second half of the bytes on
    /// `helper` (when there is one, it is running, and there are at least two cache lines),
    /// the rest on this thread, calling `idle` while it waits for the helper; returns once
    /// every byte is copied. A helper that is gone leaves its half to this thread.
    ///
    /// # Safety
    ///
    /// Every run's source valid for reads and destination valid for writes of its bytes
    /// until this returns (each pair may overlap, as for [`std::ptr::copy`]).
    pub(crate) unsafe fn run(self, helper: Option<&CopyHelper>, mut idle: impl FnMut()) {
        let apart = self.sources_apart_from_destinations();
        let Self {
            runs,
            bytes,
            stream,
        } = self;
        let split = (bytes / 2) & !4095;
        // Two threads copy at once only where no byte one writes is a byte the other reads
        // (a peer's mapping apart from this rank's pools, as it always is but for a key that
        // names memory of this process): otherwise the copies go one after another, in order.
        let Some(helper) = helper.filter(|_| split >= 4096 && apart) else {
            // SAFETY: the caller's contract.
            unsafe { copy_runs(&runs, stream) };
            return;
        };
        // The first `split` bytes stay here, the rest go to the helper; the run that
        // straddles the split is cut at a page boundary of the job's bytes.
        let mut theirs = Vec::new();
        let mut seen = 0;
        let mut mine = Vec::with_capacity(runs.len());
        for (src, dst, n) in runs {
            if seen >= split {
                theirs.push((src, dst, n));
            } else if seen + n <= split {
                mine.push((src, dst, n));
            } else {
                let keep = split - seen;
                mine.push((src, dst, keep));
                theirs.push((src + keep, dst + keep, n - keep));
            }
            seen += n;
        }
        let (done_tx, done) = mpsc::channel();
        // Shared with the helper's task, so this thread can still copy it if the helper
        // cannot.
        let theirs: Arc<[Run]> = theirs.into();
        let handed = helper
            .tasks
            .send((Arc::clone(&theirs), stream, done_tx))
            .is_ok();
        // SAFETY: the caller's contract.
        unsafe { copy_runs(&mine, stream) };
        if handed {
            loop {
                match done.try_recv() {
                    Ok(()) => return,
                    Err(TryRecvError::Empty) => idle(),
                    // Its thread ended with the task unfinished (dropped unread when the
                    // thread went, as a copy cannot panic): nothing of it is being copied
                    // any more, so this thread copies that half.
                    Err(TryRecvError::Disconnected) => break,
                }
            }
        }
        // SAFETY: the caller's contract.
        unsafe { copy_runs(&theirs, stream) };
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

    /// A job's runs split between this thread and the helper (or copied here without one,
    /// or with the helper gone): every destination byte is its source's, nothing around the
    /// runs is touched, whatever the split cuts through.
    #[test]
    fn halves_copy_every_run_with_or_without_a_helper() {
        let helper = CopyHelper::spawn("test").unwrap();
        // A helper whose thread is gone: its channel has no receiver.
        let (closed, _) = mpsc::channel();
        let gone = CopyHelper { tasks: closed };
        let lengths = [1usize, 4096, 100_003, 3 << 20, 64, 7 << 20, 12_345];
        let total: usize = lengths.iter().sum();
        let src = pattern(total);
        let cases = [Some(&helper), None, Some(&gone)]
            .into_iter()
            .flat_map(|which| [(which, true), (which, false)]);
        for (which, stream) in cases {
            // Every run lands 17 bytes further along its own gap in the destination.
            let mut dst = vec![0xA5u8; total + lengths.len() * 64];
            let mut halves = Halves::new(stream);
            let (mut from, mut to) = (0, 0);
            for &n in &lengths {
                to += 17;
                // SAFETY: the runs lie inside `src` and `dst`, which live past `run`.
                unsafe { halves.push(src.as_ptr().add(from), dst.as_mut_ptr().add(to), n) };
                from += n;
                to += n + 47;
            }
            let mut idled = 0;
            // SAFETY: as above; the vectors are distinct.
            unsafe { halves.run(which, || idled += 1) };
            let (mut from, mut to) = (0, 0);
            for &n in &lengths {
                assert!(
                    dst[to..to + 17].iter().all(|&b| b == 0xA5),
                    "gap before {n}"
                );
                to += 17;
                assert_eq!(&dst[to..to + n], &src[from..from + n], "run of {n}");
                from += n;
                to += n;
                assert!(dst[to..to + 47].iter().all(|&b| b == 0xA5), "gap after {n}");
                to += 47;
            }
        }
    }

    /// Runs that read what others write are copied one after another, in order, on this
    /// thread, as `ptr::copy` would, even with a helper.
    #[test]
    fn halves_that_overlap_are_copied_in_order() {
        let helper = CopyHelper::spawn("test").unwrap();
        let n = 1 << 20;
        let original = pattern(3 * n);
        let mut buf = original.clone();
        let p = buf.as_mut_ptr();
        let mut halves = Halves::new(true);
        // SAFETY: every run lies inside `buf`, which lives past `run`; overlap is allowed.
        unsafe {
            halves.push(p.add(n), p, n); // [n, 2n) -> [0, n)
            halves.push(p.add(2 * n), p.add(n), n); // [2n, 3n) -> [n, 2n), after the first
        }
        assert!(!halves.sources_apart_from_destinations());
        // SAFETY: as above.
        unsafe { halves.run(Some(&helper), || {}) };
        assert_eq!(&buf[..n], &original[n..2 * n]);
        assert_eq!(&buf[n..2 * n], &original[2 * n..]);
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
