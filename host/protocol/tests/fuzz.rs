//! Bounded fuzzing of everything a peer controls: the frame reader and body decoder on
//! arbitrary and mutated bytes, and the session and request state machines on arbitrary
//! message sequences. A finding is a panic, an allocation out of proportion to the bytes
//! that arrived, or a state machine breaking its own rules.
//!
//! proptest rather than cargo-fuzz, so it runs on a stable toolchain on every commit; the
//! case counts keep it to seconds. For a longer hunt:
//! `PROPTEST_CASES=200000 cargo test --release -p kvferry-protocol --test fuzz`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Cursor;

use kvferry_planner_abi::{Mapping, SlotTable, TokenRange, ViewId};
use kvferry_protocol::{
    AcceptEvent, AcceptState, Acceptor, Completion, CompletionStatus, DialState, Dialer,
    HEADER_LEN, InstanceInfo, MAX_FRAME_BYTES, PROTOCOL_VERSION, PeerMessage, Phase, PoolKey,
    RankDescriptor, RequestData, RequestTracker, Role, Tracked, encode, read_frame,
};
use kvferry_testkit::builder::{Deploy, Model};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------
// Allocation accounting: the bytes this thread holds, and the most it held since a reset.

thread_local! {
    static HELD: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

struct Counting;

fn count(grow: usize, shrink: usize) {
    // `try_with`: allocations during thread teardown find the slots gone and go uncounted.
    let _ = HELD.try_with(|held| {
        let now = held.get().saturating_add(grow).saturating_sub(shrink);
        held.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// allocator contract is `System`'s; the counting touches only const-initialised
// thread-locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as received; the caller upholds `alloc`'s contract.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            count(layout.size(), 0);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(0, layout.size());
        // SAFETY: `ptr` came from this allocator (that is, from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as received; the caller upholds `realloc`'s contract.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            count(new_size, layout.size());
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The most this thread held beyond what it held before, while `f` ran.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = HELD.with(Cell::get);
    PEAK.with(|p| p.set(before));
    let out = f();
    (out, PEAK.with(Cell::get).saturating_sub(before))
}

/// What decoding `input` bytes may cost: the reader's first reservation, serde's cautious
/// pre-allocation per container (1 MiB), and a constant factor of the input.
fn allocation_bound(input: usize) -> usize {
    (2 << 20) + 16 * input
}

// ---------------------------------------------------------------------------------------
// Messages.

fn rank_infos() -> Vec<RankDescriptor> {
    let model = Model::gqa(2, 8, 64, 16);
    let mapping: Mapping = "tp2".parse().unwrap();
    let deploy = Deploy::new("fuzz", 1, mapping, &model);
    (0..2)
        .map(|r| RankDescriptor {
            info: deploy.rank(&model, r),
            worker_address: vec![r as u8; 24],
            pools: vec![PoolKey {
                base: 0x7f00_0000_0000,
                len: 1 << 20,
                rkey: vec![0xab; 40],
            }],
        })
        .collect()
}

fn instance(name: String, role: Role, ranks: usize) -> InstanceInfo {
    InstanceInfo {
        instance_name: name,
        role,
        planner_id: "kvferry.default".into(),
        describer_id: "kvferry.default_describer".into(),
        planner_version: "0.1.0".into(),
        label: "fuzz tp2".into(),
        ranks: rank_infos().into_iter().cycle().take(ranks).collect(),
    }
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("gen".to_string()),
        Just("ctx".to_string()),
        "[a-z]{0,6}"
    ]
}

fn role() -> impl Strategy<Value = Role> {
    prop_oneof![Just(Role::Context), Just(Role::Generation)]
}

fn request_data() -> impl Strategy<Value = RequestData> {
    (
        0u64..4,
        name(),
        0u32..4,
        0u32..4,
        proptest::collection::vec(proptest::collection::vec(any::<i64>(), 0..6), 0..3),
        (any::<u64>(), any::<u64>()),
        any::<u64>(),
        proptest::option::of(any::<u64>()),
        proptest::collection::vec((any::<u32>(), any::<u32>()), 0..3),
    )
        .prop_map(
            |(
                request,
                receiver,
                receiver_rank,
                sender_rank,
                tables,
                (start, end),
                prompt,
                dst,
                ex,
            )| {
                RequestData {
                    request,
                    receiver_instance: receiver,
                    receiver_rank,
                    sender_rank,
                    slot_tables: tables.into_iter().map(SlotTable::new).collect(),
                    token_range: TokenRange { start, end },
                    prompt_len: prompt,
                    dst_start_token: dst,
                    excluded_views: ex
                        .into_iter()
                        .map(|(group, view)| ViewId { group, view })
                        .collect(),
                }
            },
        )
}

fn completion() -> impl Strategy<Value = Completion> {
    (
        0u64..3,
        0u32..3,
        0u32..3,
        0u32..5,
        any::<bool>(),
        any::<u64>(),
        any::<u64>(),
        prop_oneof![
            3 => Just(CompletionStatus::Ok),
            1 => "[a-z ]{0,12}".prop_map(CompletionStatus::Failed),
        ],
    )
        .prop_map(
            |(request, sender_rank, receiver_rank, piece, is_last, bytes, fragments, status)| {
                Completion {
                    request,
                    sender_rank,
                    receiver_rank,
                    piece,
                    is_last,
                    bytes,
                    fragments,
                    status,
                }
            },
        )
}

fn message() -> impl Strategy<Value = PeerMessage> {
    prop_oneof![
        Just(PeerMessage::InstanceInfoRequest),
        (name(), role(), 0usize..3)
            .prop_map(|(n, r, k)| PeerMessage::InstanceInfo(instance(n, r, k))),
        (name(), role(), 0usize..3).prop_map(|(n, r, k)| PeerMessage::Register(instance(n, r, k))),
        name().prop_map(|instance| PeerMessage::Registered { instance }),
        "[a-z ]{0,12}".prop_map(|reason| PeerMessage::Refused { reason }),
        request_data().prop_map(PeerMessage::RequestData),
        completion().prop_map(PeerMessage::Completion),
        (0u64..4, "[a-z]{0,8}")
            .prop_map(|(request, reason)| PeerMessage::Cancel { request, reason }),
        "[a-z]{0,8}".prop_map(|message| PeerMessage::Error { message }),
    ]
}

/// A byte-level change to a frame.
#[derive(Clone, Debug)]
enum Mutation {
    Flip {
        at: usize,
        xor: u8,
    },
    Truncate {
        keep: usize,
    },
    Append(Vec<u8>),
    /// Rewrites the header's length field (the body stays as it is).
    Length(u32),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 1u8..=255).prop_map(|(at, xor)| Mutation::Flip { at, xor }),
        1 => any::<usize>().prop_map(|keep| Mutation::Truncate { keep }),
        1 => proptest::collection::vec(any::<u8>(), 1..16).prop_map(Mutation::Append),
        1 => any::<u32>().prop_map(Mutation::Length),
    ]
}

fn mutate(frame: &mut Vec<u8>, m: &Mutation) {
    match m {
        Mutation::Flip { at, xor } => {
            let i = at % frame.len();
            frame[i] ^= xor;
        }
        Mutation::Truncate { keep } => frame.truncate(keep % (frame.len() + 1)),
        Mutation::Append(bytes) => frame.extend_from_slice(bytes),
        Mutation::Length(len) => {
            if frame.len() >= HEADER_LEN {
                frame[6..10].copy_from_slice(&len.to_le_bytes());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Properties.

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    /// Any bytes at all, after a header that may or may not be well formed: an error or a
    /// message, never a panic, and memory in proportion to what arrived — a header that
    /// claims 64 MiB followed by a few bytes costs kilobytes.
    #[test]
    fn arbitrary_frames_decode_or_fail_cleanly(
        magic_ok in any::<bool>(),
        version_ok in any::<bool>(),
        magic in any::<[u8; 4]>(),
        version in any::<u16>(),
        claimed in prop_oneof![any::<u32>(), 0u32..4096, Just(MAX_FRAME_BYTES as u32)],
        body in proptest::collection::vec(any::<u8>(), 0..4096),
    ) {
        let mut frame = Vec::with_capacity(HEADER_LEN + body.len());
        frame.extend_from_slice(if magic_ok { b"KVFR" } else { &magic });
        frame.extend_from_slice(&(if version_ok { PROTOCOL_VERSION } else { version }).to_le_bytes());
        frame.extend_from_slice(&claimed.to_le_bytes());
        frame.extend_from_slice(&body);
        let (result, peak) = peak_during(|| read_frame::<PeerMessage>(&mut Cursor::new(&frame)));
        prop_assert!(peak <= allocation_bound(frame.len()), "{peak} bytes for a {}-byte frame", frame.len());
        if let Ok(message) = result {
            // Whatever decodes is a message that encodes back to the same body.
            let again = encode(&message).unwrap();
            prop_assert_eq!(&again[HEADER_LEN..], &frame[HEADER_LEN..HEADER_LEN + again.len() - HEADER_LEN]);
        }
    }

    /// Valid frames round-trip; mutated ones decode to some message or fail by name, never
    /// panic, within the same memory bound.
    #[test]
    fn mutated_frames_never_panic(
        message in message(),
        mutations in proptest::collection::vec(mutation(), 0..4),
    ) {
        let mut frame = encode(&message).unwrap();
        let back = read_frame::<PeerMessage>(&mut Cursor::new(&frame)).unwrap();
        prop_assert_eq!(&back, &message);
        for m in &mutations {
            if !frame.is_empty() {
                mutate(&mut frame, m);
            }
        }
        let (_result, peak) = peak_during(|| read_frame::<PeerMessage>(&mut Cursor::new(&frame)));
        prop_assert!(peak <= allocation_bound(frame.len()), "{peak} bytes for a {}-byte frame", frame.len());
    }

    /// The context side's session, fed any sequence of peer messages with accept and refuse
    /// decisions in between: never panics, a closed session stays closed, and it hands up a
    /// request only from a registered peer, for a rank that peer registered.
    #[test]
    fn acceptor_keeps_its_rules_under_any_sequence(
        steps in proptest::collection::vec((message(), 0u8..4), 0..24),
    ) {
        let mut acceptor = Acceptor::new();
        for (message, decision) in steps {
            let was_closed = *acceptor.state() == AcceptState::Closed;
            let registered = match acceptor.state() {
                AcceptState::Registered { instance, ranks } => Some((instance.clone(), *ranks)),
                _ => None,
            };
            let result = acceptor.receive(message);
            if was_closed {
                prop_assert!(result.is_err(), "a closed session took a message");
            }
            if let Ok(Some(AcceptEvent::RequestData(data))) = &result {
                let (instance, ranks) = registered.clone().expect("request data before registration");
                prop_assert_eq!(&data.receiver_instance, &instance);
                prop_assert!(data.receiver_rank < ranks);
            }
            if let Ok(Some(AcceptEvent::Register(info))) = &result {
                prop_assert_eq!(info.role, Role::Generation);
            }
            match decision {
                0 if *acceptor.state() == AcceptState::Vetting => {
                    prop_assert!(acceptor.accept("ctx").is_ok());
                    let is_registered = matches!(acceptor.state(), AcceptState::Registered { .. });
                    prop_assert!(is_registered);
                }
                1 => {
                    let _ = acceptor.accept("ctx");
                }
                2 if *acceptor.state() == AcceptState::Vetting => {
                    let _ = acceptor.refuse("no".into());
                    prop_assert_eq!(acceptor.state(), &AcceptState::Closed);
                }
                _ => {}
            }
        }
    }

    /// The generation side's session under any sequence: never panics, a closed session
    /// stays closed, and completions reach the caller only once registered.
    #[test]
    fn dialer_keeps_its_rules_under_any_sequence(
        steps in proptest::collection::vec((message(), any::<bool>()), 0..24),
    ) {
        let (mut dialer, _first) = Dialer::new();
        for (message, register) in steps {
            let before = dialer.state().clone();
            let result = dialer.receive(message);
            if before == DialState::Closed {
                prop_assert!(result.is_err(), "a closed session took a message");
            }
            if let Ok(kvferry_protocol::DialEvent::Completion(_)) = &result {
                prop_assert_eq!(&before, &DialState::Ready);
            }
            if register {
                let vetting = *dialer.state() == DialState::Vetting;
                let out = dialer.register(instance("gen".into(), Role::Generation, 1));
                prop_assert_eq!(out.is_ok(), vetting);
            }
        }
    }

    /// A request's tracker, fed any completions from any peer, with outside failures mixed
    /// in: never panics, never leaves a terminal phase, completes at most once and only when
    /// every asked writer reported every piece, in order, and is quiescent once complete.
    #[test]
    fn tracker_completes_only_on_every_piece_of_every_writer(
        pairs in proptest::collection::btree_set((0u32..3, 0u32..3), 0..4),
        pieces in 1u32..4,
        feed in proptest::collection::vec((completion(), 0u8..16), 0..40),
    ) {
        let mut tracker = RequestTracker::new(1, pieces, pairs.iter().copied());
        let mut completed_events = 0;
        for (c, outside) in feed {
            let before = tracker.phase().clone();
            if outside == 0 {
                let _ = tracker.fail();
            } else if let Ok(Tracked::Completed(totals)) = tracker.on_completion(&c) {
                completed_events += 1;
                prop_assert_eq!(totals.writers as usize, pairs.len());
                prop_assert_eq!(totals.pieces, pieces * pairs.len() as u32);
            }
            if before != Phase::InFlight {
                prop_assert_eq!(tracker.phase(), &before, "left a terminal phase");
            }
            if *tracker.phase() == Phase::Completed {
                prop_assert!(tracker.quiescent());
                prop_assert_eq!(tracker.missing().count(), 0);
            }
        }
        prop_assert!(completed_events <= 1);
    }
}
