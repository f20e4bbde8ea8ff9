//! Bounded fuzzing of `Endpoint::unpack_rkey` with what a peer controls: real packed keys
//! from live regions (`tcp`, and `sysv` and `posix` shared memory), truncated, extended and
//! mutated, fed to the real unpack path. A finding is a crash (the test binary dies), a
//! truncated key that is not refused before UCX sees it, or an error that is not a clean
//! `ucp_ep_rkey_unpack` error.
//!
//! UCX parses a key without a length, so before the layout check a 1-byte key, or the first 4
//! bytes of a 9-byte `tcp` key, crashed the process with SIGSEGV inside
//! `ucp_ep_rkey_unpack` (and this test binary does, with the check disabled). Mutations that
//! keep the layout and the transport keys (a memory type, edits that cancel out) reach UCX and
//! must unpack or fail cleanly; forged transport keys are beyond what the layout check can
//! catch (see `mutated_real_keys_unpack_or_fail_cleanly`).
//!
//! proptest rather than cargo-fuzz, so it runs on a stable toolchain on every commit; the
//! case count keeps it to seconds. For a longer hunt:
//! `PROPTEST_CASES=100000 cargo test -p kvferry-ucx --test suite rkey_fuzz::`, adding
//! `KVFERRY_RKEY_FUZZ_FORGED=1` to unpack forged transport keys too.

use std::cell::Cell;
use std::sync::Arc;

use kvferry_ucx::rkey_format::{HEADER_LEN, check_packed_rkey};
use kvferry_ucx::{
    Context, Endpoint, Error, KeyFormatError, KeyLayout, MemRegion, Op, RemoteKey, Status, Worker,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// A peer's region, its real packed key, and an endpoint to that peer from another context.
struct Target {
    tls: &'static str,
    key: Vec<u8>,
    ep: Endpoint,
    _region: MemRegion,
    _workers: (Worker, Worker),
}

impl Target {
    fn new(tls: &'static str) -> Target {
        let context = || -> Arc<Context> {
            let builder = Context::builder().tls(tls);
            let builder = if tls == "tcp" {
                builder.net_devices("lo")
            } else {
                builder
            };
            builder.build().expect("UCX context")
        };
        let (target_ctx, initiator_ctx) = (context(), context());
        let region = MemRegion::allocate(&target_ctx, 64 << 10).expect("region");
        let key = region.pack_rkey().expect("pack").into_bytes();
        let target = Worker::new(&target_ctx).expect("worker");
        let initiator = Worker::new(&initiator_ctx).expect("worker");
        let ep = initiator
            .connect(&target.address().expect("address"))
            .expect("endpoint");
        Target {
            tls,
            key,
            ep,
            _region: region,
            _workers: (initiator, target),
        }
    }

    fn unpack(&self, key: &[u8]) -> Result<RemoteKey, Error> {
        self.ep.unpack_rkey(key)
    }
}

/// `tcp` (no transport key: 9 bytes with UCX 1.22.0, 10 with 1.13.1), and shared memory whose
/// allocation lands in `sysv` (tried first) or in `posix`: keys with `self`, `sysv` and
/// `posix` entries.
fn targets() -> Vec<Target> {
    let targets: Vec<Target> = ["tcp", "posix,sysv,self", "posix,self"]
        .into_iter()
        .map(Target::new)
        .collect();
    for t in &targets {
        t.unpack(&t.key)
            .unwrap_or_else(|e| panic!("{}: the real key does not unpack: {e:?}", t.tls));
    }
    targets
}

/// The refusal of a key the layout check caught: no UCX call was made.
fn refusal(result: Result<RemoteKey, Error>) -> KeyFormatError {
    let err = result.expect_err("a malformed key must be refused");
    assert_eq!(
        (err.op(), err.status()),
        (Op::RkeyUnpack, Status::INVALID_PARAM)
    );
    *err.key_format()
        .unwrap_or_else(|| panic!("refused by UCX, not by the check: {err:?}"))
}

#[test]
fn every_truncation_of_a_real_key_is_refused_before_ucx() {
    for t in targets() {
        for cut in 0..t.key.len() {
            let why = refusal(t.unpack(&t.key[..cut]));
            // Reported as a key too short for what it declares.
            assert!(
                matches!(
                    why,
                    KeyFormatError::HeaderTruncated { .. }
                        | KeyFormatError::MdMapNeedsMore { .. }
                        | KeyFormatError::EntrySizeMissing { .. }
                        | KeyFormatError::EntryPastEnd { .. }
                        | KeyFormatError::SysDevMissing { .. }
                        | KeyFormatError::DistancesUnterminated { .. }
                        | KeyFormatError::DistanceTruncated { .. }
                ),
                "{}: {cut} of {} bytes: {why:?}",
                t.tls,
                t.key.len()
            );
        }
    }
}

/// The reported crashes: a 1-byte key, and the first 4 bytes of a real `tcp` key (9 bytes
/// with UCX 1.22.0, where no domain registers memory; 10 with 1.13.1, an empty entry).
#[test]
fn the_reported_crashes_are_clean_errors() {
    let tcp = Target::new("tcp");
    for len in [1, 4] {
        let err = tcp.unpack(&tcp.key[..len]).unwrap_err();
        assert_eq!(
            chain(&err),
            format!(
                "ucp_ep_rkey_unpack not called: malformed remote key: {len} byte{}, fewer than \
                 the 9 of its header (a 64-bit md map and a memory type)",
                if len == 1 { "" } else { "s" }
            )
        );
    }
    assert_eq!(
        refusal(tcp.unpack(&[])),
        KeyFormatError::HeaderTruncated { len: 0 }
    );
}

/// `Display` of `err` and its sources, joined by ": ".
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        text = format!("{text}: {c}");
        cause = c.source();
    }
    text
}

#[test]
fn an_oversized_length_byte_or_a_trailing_byte_is_refused() {
    for t in targets() {
        let mut longer = t.key.clone();
        longer.push(0);
        assert!(
            matches!(
                refusal(t.unpack(&longer)),
                KeyFormatError::TrailingBytes { .. }
            ),
            "{}",
            t.tls
        );
        if t.key[..8] == [0; 8] {
            continue; // no entries, so no length byte
        }
        let mut oversized = t.key.clone();
        oversized[9] = 255;
        assert!(
            matches!(
                refusal(t.unpack(&oversized)),
                KeyFormatError::EntryPastEnd { size: 255, .. }
            ),
            "{}",
            t.tls
        );
    }
}

/// One change to a key.
#[derive(Clone, Debug)]
enum Edit {
    /// Overwrite the byte at (index modulo the length).
    Set(usize, u8),
    /// Flip one bit of the byte at (index modulo the length).
    Flip(usize, u8),
    /// Insert a byte before (index modulo the length + 1).
    Insert(usize, u8),
    /// Remove the byte at (index modulo the length).
    Remove(usize),
    /// Keep the first (index modulo the length) bytes.
    Truncate(usize),
    /// Append bytes.
    Append(Vec<u8>),
    /// Overwrite the memory-type byte (a value near the valid range: random ones are refused).
    MemType(u8),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        4 => (any::<usize>(), 0u8..8).prop_map(|(i, bit)| Edit::Flip(i, bit)),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Insert(i, b)),
        1 => any::<usize>().prop_map(Edit::Remove),
        1 => any::<usize>().prop_map(Edit::Truncate),
        1 => prop::collection::vec(any::<u8>(), 1..8).prop_map(Edit::Append),
        2 => (0u8..12).prop_map(Edit::MemType),
    ]
}

fn apply(key: &mut Vec<u8>, edit: &Edit) {
    let len = key.len();
    match *edit {
        Edit::Set(i, b) if len > 0 => key[i % len] = b,
        Edit::Flip(i, bit) if len > 0 => key[i % len] ^= 1 << bit,
        Edit::Insert(i, b) => key.insert(i % (len + 1), b),
        Edit::Remove(i) if len > 0 => {
            key.remove(i % len);
        }
        Edit::Truncate(i) if len > 0 => key.truncate(i % len),
        Edit::Append(ref bytes) => key.extend_from_slice(bytes),
        Edit::MemType(m) if len > 8 => key[8] = m,
        _ => {}
    }
}

/// The transport keys of a key that passed the layout check, by memory domain.
fn transport_keys(key: &[u8]) -> Vec<(u32, &[u8])> {
    let md_map = u64::from_ne_bytes(key[..8].try_into().expect("8 bytes"));
    let mut at = HEADER_LEN;
    let mut keys = Vec::new();
    for domain in (0..64).filter(|d| md_map >> d & 1 == 1) {
        let size = usize::from(key[at]);
        keys.push((domain, &key[at + 1..at + 1 + size]));
        at += 1 + size;
    }
    keys
}

/// Real keys under 1 to 4 random edits: each unpack returns a key or a clean
/// `ucp_ep_rkey_unpack` error, the layout check and the unpack path agree, and a proper
/// prefix of the real key is always refused before UCX.
///
/// A mutated key that passes the layout check reaches UCX only if every memory domain's
/// transport key is still the real one (the header or trailer changed, or edits cancelled
/// out). A forged transport key is outside what the check can catch, and outside what this
/// test can promise: each transport reads its own struct and believes it. Measured with
/// Debian's UCX 1.13.1 (built with assertions): a `posix` key whose length field is 0 aborts
/// the process (`mm_posix.c:360 Assertion 'length > 0' failed` in `uct_posix_rkey_unpack`),
/// and forged `posix` and `sysv` keys map or attach what they name. Such keys are counted,
/// not unpacked, unless `KVFERRY_RKEY_FUZZ_FORGED=1` (a hunt with a UCX built without
/// assertions: 300 000 cases ran clean with the 1.22.0 wheel).
#[test]
fn mutated_real_keys_unpack_or_fail_cleanly() {
    let targets = targets();
    let layout = KeyLayout::loaded();
    let (reached_ucx, forged) = (Cell::new(0u32), Cell::new(0u32));
    let unpack_forged = std::env::var_os("KVFERRY_RKEY_FUZZ_FORGED").is_some_and(|v| v == "1");
    let default = Config::default(); // reads PROPTEST_CASES
    let mut runner = TestRunner::new(Config {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            default.cases
        } else {
            1024
        },
        failure_persistence: None,
        ..default
    });
    let strategy = (0..targets.len(), prop::collection::vec(edit(), 1..=4));
    runner
        .run(&strategy, |(which, edits)| {
            let t = &targets[which];
            let mut key = t.key.clone();
            for e in &edits {
                apply(&mut key, e);
            }
            let checked = check_packed_rkey(&key, layout);
            if key.len() < t.key.len() && t.key.starts_with(&key) {
                prop_assert!(
                    checked.is_err(),
                    "{}: a {}-byte prefix passed",
                    t.tls,
                    key.len()
                );
            }
            if checked.is_ok() && !unpack_forged && transport_keys(&key) != transport_keys(&t.key) {
                forged.set(forged.get() + 1);
                return Ok(());
            }
            match t.unpack(&key) {
                Ok(rkey) => {
                    prop_assert!(checked.is_ok());
                    reached_ucx.set(reached_ucx.get() + 1);
                    drop(rkey);
                }
                Err(err) => {
                    prop_assert_eq!(err.op(), Op::RkeyUnpack);
                    prop_assert!(err.status().code() < 0, "{:?}", err);
                    prop_assert_eq!(err.key_format(), checked.as_ref().err());
                    if checked.is_ok() {
                        reached_ucx.set(reached_ucx.get() + 1);
                    }
                }
            }
            Ok::<(), TestCaseError>(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
    eprintln!(
        "{} cases: {} reached UCX, {} forged transport keys left out",
        runner.config().cases,
        reached_ucx.get(),
        forged.get()
    );
    assert!(
        reached_ucx.get() > 0,
        "no mutated key passed the layout check: UCX's side went untested"
    );
}

/// Every memory-type byte on every real key: the release's types reach UCX (and unpack or
/// fail cleanly), the rest are refused before it (UCX indexes tables with the byte).
#[test]
fn every_memory_type_byte_unpacks_or_is_refused() {
    let layout = KeyLayout::loaded();
    for t in targets() {
        for mem_type in 0..=u8::MAX {
            let mut key = t.key.clone();
            key[8] = mem_type;
            let result = t.unpack(&key);
            if mem_type < layout.memory_types() {
                if let Err(err) = result {
                    assert_eq!(
                        (err.op(), err.key_format()),
                        (Op::RkeyUnpack, None),
                        "{}: memory type {mem_type}",
                        t.tls
                    );
                }
            } else {
                assert!(
                    matches!(
                        refusal(result),
                        KeyFormatError::UnknownMemoryType { mem_type: m, .. } if m == mem_type
                    ),
                    "{}: memory type {mem_type}",
                    t.tls
                );
            }
        }
    }
}
