//! Bounded fuzzing of everything a peer controls: the frame reader and body decoder on
//! arbitrary and mutated bytes, and the session and request state machines on arbitrary
//! message sequences. A finding is a panic, an allocation out of proportion to the bytes
//! that arrived, or a state machine breaking its own rules.
//!
//! Covered: `AgentMessage` frames (`KVFA`, every variant) on arbitrary and mutated bytes,
//! `AgentMetadata::from_bytes` on the same, `RequestTracker` under arbitrary completions,
//! and both sides of `AgentSession` under arbitrary
//! messages and forged handshakes (a wrong secret, a proof replayed from another connection,
//! a proof reflected back), with an honest dial/accept pair over real frames as the control.
//!
//! proptest rather than cargo-fuzz, so it runs on a stable toolchain on every commit; the
//! case counts keep it to seconds. For a longer hunt:
//! `PROPTEST_CASES=200000 cargo test --release -p kvferry-protocol --test fuzz`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Cursor;
use std::sync::OnceLock;

use kvferry_planner_abi::{Mapping, SlotTable, TokenRange, ViewId};
use kvferry_protocol::agent::{NONCE_LEN, Nonce, Proof};
use kvferry_protocol::{
    AgentError, AgentEvent, AgentMessage, AgentMetadata, AgentSession, AgentState, Completion,
    CompletionStatus, HEADER_LEN, MAX_FRAME_BYTES, PROTOCOL_VERSION, Phase, PoolKey,
    RankDescriptor, RequestData, RequestTracker, Role, Secret, Tracked, WireError, encode,
    read_frame,
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
            bounce: None,
        })
        .collect()
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
                    bounce: None,
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
                    bounce: None,
                }
            },
        )
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

// ---------------------------------------------------------------------------------------
// Agent messages: the protocol two transfer agents speak (magic `KVFA`).

/// The two rank descriptions every agent strategy draws from, built once.
fn cached_ranks() -> &'static [RankDescriptor] {
    static RANKS: OnceLock<Vec<RankDescriptor>> = OnceLock::new();
    RANKS.get_or_init(rank_infos)
}

fn agent_metadata(role: impl Strategy<Value = Role>) -> impl Strategy<Value = AgentMetadata> {
    (
        (name(), role, any::<u64>()),
        (
            "[a-z._]{0,16}",
            "[a-z._]{0,16}",
            "[0-9.]{0,6}",
            "[a-z0-9 ]{0,12}",
        ),
        proptest::option::of("[a-z0-9.:]{0,16}"),
        (0usize..2, proptest::collection::vec(any::<u8>(), 0..32)),
        proptest::collection::vec(
            (
                any::<u64>(),
                any::<u64>(),
                proptest::collection::vec(any::<u8>(), 0..48),
            ),
            0..3,
        ),
    )
        .prop_map(
            |(
                (instance, role, epoch),
                (planner_id, describer_id, planner_version, label),
                endpoint,
                (which, worker_address),
                pools,
            )| {
                let mut rank = cached_ranks()[which].clone();
                rank.worker_address = worker_address;
                rank.pools = pools
                    .into_iter()
                    .map(|(base, len, rkey)| PoolKey { base, len, rkey })
                    .collect();
                AgentMetadata {
                    instance,
                    role,
                    epoch,
                    planner_id,
                    describer_id,
                    planner_version,
                    label,
                    endpoint,
                    rank,
                }
            },
        )
}

fn nonce() -> impl Strategy<Value = Nonce> {
    any::<[u8; NONCE_LEN]>()
}

/// Any agent message, every variant.
fn agent_message() -> impl Strategy<Value = AgentMessage> {
    prop_oneof![
        nonce().prop_map(|nonce| AgentMessage::Hello { nonce }),
        (nonce(), nonce()).prop_map(|(nonce, proof)| AgentMessage::Challenge { nonce, proof }),
        nonce().prop_map(|proof| AgentMessage::Proof { proof }),
        agent_metadata(role()).prop_map(|m| AgentMessage::Metadata(Box::new(m))),
        "[a-z ]{0,12}".prop_map(|reason| AgentMessage::Refused { reason }),
        request_data().prop_map(AgentMessage::RequestData),
        completion().prop_map(AgentMessage::Completion),
        (0u64..4, "[a-z]{0,8}")
            .prop_map(|(request, reason)| AgentMessage::Cancel { request, reason }),
        Just(AgentMessage::Ping),
        "[a-z]{0,8}".prop_map(|message| AgentMessage::Error { message }),
    ]
}

/// A secret's bytes (the shortest accepted and longer).
fn key() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 16..40)
}

fn secret(key: &[u8]) -> Secret {
    Secret::new(key.to_vec()).unwrap()
}

/// A secret other than the session's: another key, or none at all.
fn wrong_secret(key: &Option<Vec<u8>>) -> Secret {
    key.as_deref().map_or_else(Secret::unauthenticated, secret)
}

fn wrong_key() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![3 => key().prop_map(Some), 1 => Just(None)]
}

/// A message through the codec, as the peer's reader sees it.
fn wire(message: &AgentMessage) -> AgentMessage {
    read_frame(&mut Cursor::new(encode(message).unwrap())).unwrap()
}

/// The messages an honest pair on the right secret exchanged over nonces `dialer` and
/// `acceptor`: the acceptor's `Challenge` and the dialer's `Proof`, for replaying elsewhere.
fn recorded(right: &Secret, dialer: Nonce, acceptor: Nonce) -> (AgentMessage, AgentMessage) {
    let me = AgentMetadata {
        role: Role::Generation,
        ..context_self()
    };
    let (mut d, hello) = AgentSession::dial(right.clone(), dialer, me);
    let mut a = AgentSession::accept(right.clone(), acceptor);
    let Ok(AgentEvent::Reply(challenge)) = a.receive(hello) else {
        panic!("an acceptor answers Hello with its challenge")
    };
    let Ok(AgentEvent::Reply(answer)) = d.receive(challenge[0].clone()) else {
        panic!("a dialer on the right secret answers the challenge")
    };
    (challenge[0].clone(), answer[0].clone())
}

/// One step of a peer talking to an acceptor: a message, a forged or honest proof worked
/// out from what the connection has shown so far, or the caller's decision.
#[derive(Clone, Debug)]
enum AcceptStep {
    /// Any message at all.
    Any(AgentMessage),
    Hello(Nonce),
    /// A proof of another secret (or none) over this connection's nonces.
    WrongSecret(Option<Vec<u8>>),
    /// The right secret's proof over this connection's nonces, swapped.
    Swapped,
    /// A dialer's `Proof` recorded on another connection (the right secret, its nonces).
    Replayed {
        dialer: Nonce,
        acceptor: Nonce,
    },
    /// The acceptor's own challenge proof sent back as the dialer's.
    Reflected,
    /// The right proof: the model's only way in.
    Honest,
    /// Metadata of a generation rank (the role an acceptor wants).
    Generation(Box<AgentMetadata>),
    /// The caller admits (with its own metadata) or refuses the peer.
    Admit,
    Refuse,
}

fn accept_step() -> impl Strategy<Value = AcceptStep> {
    prop_oneof![
        6 => agent_message().prop_map(AcceptStep::Any),
        1 => nonce().prop_map(AcceptStep::Hello),
        1 => wrong_key().prop_map(AcceptStep::WrongSecret),
        1 => Just(AcceptStep::Swapped),
        1 => (nonce(), nonce())
            .prop_map(|(dialer, acceptor)| AcceptStep::Replayed { dialer, acceptor }),
        1 => Just(AcceptStep::Reflected),
        1 => Just(AcceptStep::Honest),
        2 => agent_metadata(Just(Role::Generation)).prop_map(|m| AcceptStep::Generation(Box::new(m))),
        1 => Just(AcceptStep::Admit),
        1 => Just(AcceptStep::Refuse),
    ]
}

/// How a peer opens a connection to an acceptor before anything goes: a well-formed Hello
/// and a forged proof, the recorded Hello and Proof of another connection, a Hello and any
/// step, or the first steps of an honest handshake (none, or up to all, so the tail is
/// fuzzed against a session in each state).
fn accept_opening() -> impl Strategy<Value = Vec<AcceptStep>> {
    let forged = prop_oneof![
        wrong_key().prop_map(AcceptStep::WrongSecret),
        Just(AcceptStep::Swapped),
        Just(AcceptStep::Reflected),
    ];
    prop_oneof![
        3 => (nonce(), forged).prop_map(|(d, step)| vec![AcceptStep::Hello(d), step]),
        2 => (nonce(), nonce()).prop_map(|(dialer, acceptor)| vec![
            AcceptStep::Hello(dialer),
            AcceptStep::Replayed { dialer, acceptor },
        ]),
        2 => (nonce(), accept_step()).prop_map(|(d, step)| vec![AcceptStep::Hello(d), step]),
        4 => (nonce(), agent_metadata(Just(Role::Generation)), 0usize..=4).prop_map(|(d, m, k)| {
            let mut honest = vec![
                AcceptStep::Hello(d),
                AcceptStep::Honest,
                AcceptStep::Generation(Box::new(m)),
                AcceptStep::Admit,
            ];
            honest.truncate(k);
            honest
        }),
    ]
}

/// One step of a peer answering a dialer.
#[derive(Clone, Debug)]
enum DialStep {
    Any(AgentMessage),
    /// A challenge with acceptor nonce `.1`, proved with another secret (or none).
    WrongSecret(Option<Vec<u8>>, Nonce),
    /// The right secret's challenge over this dialer's nonce and `.0`, nonces swapped.
    Swapped(Nonce),
    /// A `Challenge` recorded on another connection (the right secret, its nonces).
    Replayed {
        dialer: Nonce,
        acceptor: Nonce,
    },
    /// A dialer's proof (generation label) passed off as the acceptor's: the dialer's own
    /// answer for this nonce, reflected back.
    Reflected(Nonce),
    /// The right challenge: the model's only way in.
    Honest(Nonce),
    /// Metadata of a context rank (the role a dialer wants).
    Context(Box<AgentMetadata>),
    /// The caller accepts (`ready`) or refuses the vetted peer.
    Ready,
    Refuse,
}

fn dial_step() -> impl Strategy<Value = DialStep> {
    prop_oneof![
        6 => agent_message().prop_map(DialStep::Any),
        1 => (wrong_key(), nonce()).prop_map(|(k, a)| DialStep::WrongSecret(k, a)),
        1 => nonce().prop_map(DialStep::Swapped),
        1 => (nonce(), nonce()).prop_map(|(dialer, acceptor)| DialStep::Replayed { dialer, acceptor }),
        1 => nonce().prop_map(DialStep::Reflected),
        1 => nonce().prop_map(DialStep::Honest),
        2 => agent_metadata(Just(Role::Context)).prop_map(|m| DialStep::Context(Box::new(m))),
        1 => Just(DialStep::Ready),
        1 => Just(DialStep::Refuse),
    ]
}

/// How an acceptor (or an impostor) first answers a dialer: a forged challenge, a recorded
/// one, or the first steps of an honest handshake (none, or up to all).
fn dial_opening() -> impl Strategy<Value = Vec<DialStep>> {
    prop_oneof![
        1 => (wrong_key(), nonce()).prop_map(|(k, a)| vec![DialStep::WrongSecret(k, a)]),
        1 => nonce().prop_map(|a| vec![DialStep::Swapped(a)]),
        1 => nonce().prop_map(|a| vec![DialStep::Reflected(a)]),
        2 => (nonce(), nonce())
            .prop_map(|(dialer, acceptor)| vec![DialStep::Replayed { dialer, acceptor }]),
        4 => (nonce(), agent_metadata(Just(Role::Context)), 0usize..=3).prop_map(|(a, m, k)| {
            let mut honest = vec![
                DialStep::Honest(a),
                DialStep::Context(Box::new(m)),
                DialStep::Ready,
            ];
            honest.truncate(k);
            honest
        }),
    ]
}

/// Any body after a header that may or may not be an agent frame's (magic `KVFA`, this
/// version, any claimed length), as `arbitrary_frames_decode_or_fail_cleanly` builds them.
fn agent_header_and_body() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<[u8; 4]>(),
        any::<u16>(),
        prop_oneof![any::<u32>(), 0u32..4096, Just(MAX_FRAME_BYTES as u32)],
        proptest::collection::vec(any::<u8>(), 0..4096),
    )
        .prop_map(|(magic_ok, version_ok, magic, version, claimed, body)| {
            let mut frame = Vec::with_capacity(HEADER_LEN + body.len());
            frame.extend_from_slice(if magic_ok { b"KVFA" } else { &magic });
            let version = if version_ok {
                PROTOCOL_VERSION
            } else {
                version
            };
            frame.extend_from_slice(&version.to_le_bytes());
            frame.extend_from_slice(&claimed.to_le_bytes());
            frame.extend_from_slice(&body);
            frame
        })
}

/// An acceptor's own metadata, for `admit`.
fn context_self() -> AgentMetadata {
    AgentMetadata {
        instance: "ctx".into(),
        role: Role::Context,
        epoch: 7,
        planner_id: "kvferry.default".into(),
        describer_id: "kvferry.default_describer".into(),
        planner_version: "0.1.0".into(),
        label: "fuzz".into(),
        endpoint: Some("127.0.0.1:1".into()),
        rank: cached_ranks()[1].clone(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// Agent frames: any bytes after any header decode to a message (one that survives the
    /// codec again) or fail by name, never panic, within the peer frames' memory bound.
    #[test]
    fn arbitrary_agent_frames_decode_or_fail_cleanly(frame in agent_header_and_body()) {
        let (result, peak) = peak_during(|| read_frame::<AgentMessage>(&mut Cursor::new(&frame)));
        prop_assert!(peak <= allocation_bound(frame.len()), "{peak} bytes for a {}-byte frame", frame.len());
        if let Ok(message) = result {
            prop_assert_eq!(wire(&message), message);
        }
    }

    /// Every agent message round-trips; mutated frames of them decode or fail by name,
    /// never panic, within the bound. The same frame under another family's magic is refused.
    #[test]
    fn mutated_agent_frames_never_panic(
        message in agent_message(),
        mutations in proptest::collection::vec(mutation(), 0..4),
    ) {
        let mut frame = encode(&message).unwrap();
        prop_assert_eq!(&frame[..4], b"KVFA");
        let back = read_frame::<AgentMessage>(&mut Cursor::new(&frame)).unwrap();
        prop_assert_eq!(&back, &message);
        let mut other = frame.clone();
        other[..4].copy_from_slice(b"KVFC");
        let other_family = read_frame::<AgentMessage>(&mut Cursor::new(&other));
        prop_assert!(matches!(other_family, Err(WireError::BadMagic { .. })), "{other_family:?}");
        for m in &mutations {
            if !frame.is_empty() {
                mutate(&mut frame, m);
            }
        }
        let (_result, peak) = peak_during(|| read_frame::<AgentMessage>(&mut Cursor::new(&frame)));
        prop_assert!(peak <= allocation_bound(frame.len()), "{peak} bytes for a {}-byte frame", frame.len());
    }

    /// `AgentMetadata::from_bytes` (what an engine hands `add_peer`) on arbitrary bytes:
    /// metadata that survives the codec again, or an error; never a panic, within the bound.
    #[test]
    fn arbitrary_metadata_bytes_read_or_fail_cleanly(bytes in agent_header_and_body()) {
        let (result, peak) = peak_during(|| AgentMetadata::from_bytes(&bytes));
        prop_assert!(peak <= allocation_bound(bytes.len()), "{peak} bytes for {} bytes", bytes.len());
        if let Ok(m) = result {
            prop_assert_eq!(AgentMetadata::from_bytes(&m.to_bytes().unwrap()).unwrap(), m);
        }
    }

    /// Metadata bytes round-trip; another message's frame or trailing bytes are refused;
    /// mutated bytes read or fail, never panic, within the bound.
    #[test]
    fn mutated_metadata_bytes_never_panic(
        metadata in agent_metadata(role()),
        other in agent_message(),
        extra in proptest::collection::vec(any::<u8>(), 1..8),
        mutations in proptest::collection::vec(mutation(), 0..4),
    ) {
        let mut bytes = metadata.to_bytes().unwrap();
        prop_assert_eq!(&AgentMetadata::from_bytes(&bytes).unwrap(), &metadata);
        let mut longer = bytes.clone();
        longer.extend_from_slice(&extra);
        let trailing = AgentMetadata::from_bytes(&longer);
        prop_assert!(matches!(trailing, Err(WireError::Trailing { .. })), "{trailing:?}");
        if !matches!(other, AgentMessage::Metadata(_)) {
            prop_assert!(AgentMetadata::from_bytes(&encode(&other).unwrap()).is_err());
        }
        for m in &mutations {
            if !bytes.is_empty() {
                mutate(&mut bytes, m);
            }
        }
        let (_result, peak) = peak_during(|| AgentMetadata::from_bytes(&bytes));
        prop_assert!(peak <= allocation_bound(bytes.len()), "{peak} bytes for {} bytes", bytes.len());
    }

    /// An honest dialer and acceptor on one secret (or both on none), every message through
    /// the codec, always reach ready on both sides and then carry requests, completions,
    /// cancels and pings: the control that keeps the negative properties below from
    /// passing vacuously. On different secrets (or one side without) the dialer refuses the
    /// challenge and its metadata never leaves.
    #[test]
    fn honest_agents_handshake_and_mismatched_ones_do_not(
        key in key(),
        none in any::<bool>(),
        other in wrong_key(),
        mismatched in any::<bool>(),
        (d, a) in (nonce(), nonce()),
        generation in agent_metadata(Just(Role::Generation)),
        ctx in agent_metadata(Just(Role::Context)),
        request in request_data(),
        done in completion(),
    ) {
        let right = if none { Secret::unauthenticated() } else { secret(&key) };
        let dialer_secret = if mismatched { wrong_secret(&other) } else { right.clone() };
        let mismatched = dialer_secret != right;
        let (mut dialer, hello) = AgentSession::dial(dialer_secret, d, generation.clone());
        let mut acceptor = AgentSession::accept(right, a);
        prop_assert_eq!(dialer.state(), AgentState::AwaitChallenge);
        prop_assert_eq!(acceptor.state(), AgentState::AwaitHello);

        let Ok(AgentEvent::Reply(challenge)) = acceptor.receive(wire(&hello)) else {
            return Err(TestCaseError::fail("the acceptor did not answer Hello"));
        };
        prop_assert_eq!(challenge.len(), 1);
        prop_assert!(!acceptor.authenticated());
        let answer = dialer.receive(wire(&challenge[0]));
        if mismatched {
            prop_assert_eq!(answer, Err(AgentError::Unauthenticated));
            prop_assert_eq!(dialer.state(), AgentState::Closed);
            prop_assert!(!dialer.authenticated());
            return Ok(());
        }
        let Ok(AgentEvent::Reply(answer)) = answer else {
            return Err(TestCaseError::fail(format!("the dialer refused an honest challenge: {answer:?}")));
        };
        prop_assert!(dialer.authenticated());
        prop_assert_eq!(answer.len(), 2);
        prop_assert_eq!(acceptor.receive(wire(&answer[0])), Ok(AgentEvent::Nothing));
        prop_assert!(acceptor.authenticated());
        prop_assert_eq!(
            acceptor.receive(wire(&answer[1])),
            Ok(AgentEvent::Metadata(Box::new(generation)))
        );
        prop_assert_eq!(acceptor.state(), AgentState::Vetting);
        let admitted = acceptor.admit(ctx.clone()).unwrap();
        prop_assert_eq!(acceptor.state(), AgentState::Ready);
        prop_assert_eq!(dialer.receive(wire(&admitted)), Ok(AgentEvent::Metadata(Box::new(ctx))));
        prop_assert_eq!(dialer.state(), AgentState::Vetting);
        dialer.ready().unwrap();
        prop_assert_eq!(dialer.state(), AgentState::Ready);

        let sent = AgentMessage::RequestData(request.clone());
        prop_assert_eq!(acceptor.receive(wire(&sent)), Ok(AgentEvent::RequestData(Box::new(request))));
        let cancel = AgentMessage::Cancel { request: 3, reason: "late".into() };
        prop_assert_eq!(
            acceptor.receive(wire(&cancel)),
            Ok(AgentEvent::Cancel { request: 3, reason: "late".into() })
        );
        prop_assert_eq!(dialer.receive(wire(&AgentMessage::Completion(done.clone()))), Ok(AgentEvent::Completion(done)));
        prop_assert_eq!(dialer.receive(wire(&AgentMessage::Ping)), Ok(AgentEvent::Nothing));
        prop_assert_eq!(acceptor.receive(wire(&AgentMessage::Ping)), Ok(AgentEvent::Nothing));
        prop_assert_eq!(dialer.state(), AgentState::Ready);
        prop_assert_eq!(acceptor.state(), AgentState::Ready);
    }

    /// A context rank's session, fed any messages after any opening (a wrong secret's proof,
    /// a proof recorded on another connection, its own challenge proof reflected, an honest
    /// handshake): never panics, is authenticated and hands up the peer's metadata only
    /// after the right secret's proof over this connection's nonces, hands up requests only
    /// once admitted, and takes nothing after an error.
    #[test]
    fn agent_acceptor_admits_only_a_peer_that_proved_the_secret(
        key in key(),
        own in nonce(),
        opening in accept_opening(),
        tail in proptest::collection::vec(accept_step(), 0..16),
    ) {
        let right = secret(&key);
        let mut acceptor = AgentSession::accept(right.clone(), own);
        // What the connection has shown: the Hello answered, the challenge proof sent.
        let mut hello: Option<Nonce> = None;
        let mut challenge: Option<Proof> = None;
        // The model: whether the right proof over this connection's nonces arrived in time.
        // Which proof is the right one is decided by how the step made it (the right key,
        // the generation label, the Hello's nonce and this acceptor's), never by the library.
        let mut proved = false;
        let zero = [0u8; NONCE_LEN];
        for step in opening.into_iter().chain(tail) {
            let before = acceptor.state();
            let d = hello.unwrap_or(zero);
            let (message, honest) = match step {
                AcceptStep::Any(m) => (m, false),
                AcceptStep::Hello(nonce) => (AgentMessage::Hello { nonce }, false),
                AcceptStep::WrongSecret(k) => (
                    AgentMessage::Proof { proof: wrong_secret(&k).prove(Role::Generation, &d, &own) },
                    k.as_deref() == Some(key.as_slice()),
                ),
                AcceptStep::Swapped => (
                    AgentMessage::Proof { proof: right.prove(Role::Generation, &own, &d) },
                    d == own,
                ),
                AcceptStep::Replayed { dialer, acceptor: theirs } => (
                    recorded(&right, dialer, theirs).1,
                    dialer == d && theirs == own,
                ),
                AcceptStep::Reflected => {
                    (AgentMessage::Proof { proof: challenge.unwrap_or(zero) }, false)
                }
                AcceptStep::Honest => (
                    AgentMessage::Proof { proof: right.prove(Role::Generation, &d, &own) },
                    true,
                ),
                AcceptStep::Generation(m) => (AgentMessage::Metadata(m), false),
                AcceptStep::Admit => {
                    // The dialer's call is refused on this side, whatever the state.
                    prop_assert!(acceptor.clone().ready().is_err());
                    let out = acceptor.admit(context_self());
                    prop_assert_eq!(out.is_ok(), before == AgentState::Vetting, "{:?}", out);
                    prop_assert_eq!(
                        acceptor.state(),
                        if out.is_ok() { AgentState::Ready } else { before }
                    );
                    continue;
                }
                AcceptStep::Refuse => {
                    let out = acceptor.refuse("no".into());
                    prop_assert!(matches!(out, AgentMessage::Refused { .. }), "{out:?}");
                    prop_assert_eq!(acceptor.state(), AgentState::Closed);
                    continue;
                }
            };
            let right_proof = before == AgentState::AwaitProof && honest;
            let fed_hello = match &message {
                AgentMessage::Hello { nonce } if before == AgentState::AwaitHello => Some(*nonce),
                _ => None,
            };
            let result = acceptor.receive(message);
            let after = acceptor.state();
            if before == AgentState::Closed {
                prop_assert!(result.is_err(), "a closed session took a message: {result:?}");
            }
            if result.is_err() {
                prop_assert_eq!(after, AgentState::Closed);
            }
            if before == AgentState::AwaitProof && after != AgentState::Closed {
                prop_assert!(right_proof, "authenticated by a proof that is not the right one");
            }
            proved |= right_proof && result.is_ok();
            match &result {
                Ok(AgentEvent::Reply(reply)) => {
                    let h = fed_hello.expect("a reply to anything but the first Hello");
                    hello = Some(h);
                    let [AgentMessage::Challenge { nonce, proof }] = reply.as_slice() else {
                        return Err(TestCaseError::fail(format!("a reply other than one challenge: {reply:?}")));
                    };
                    prop_assert_eq!(nonce, &own);
                    prop_assert!(right.verify(Role::Context, &h, &own, proof));
                    challenge = Some(*proof);
                }
                Ok(AgentEvent::Metadata(m)) => {
                    prop_assert!(proved, "metadata handed up from an unproved peer");
                    prop_assert_eq!(before, AgentState::AwaitMetadata);
                    prop_assert_eq!(m.role, Role::Generation);
                }
                Ok(AgentEvent::RequestData(_) | AgentEvent::Cancel { .. }) => {
                    prop_assert!(proved);
                    prop_assert_eq!(before, AgentState::Ready);
                }
                Ok(AgentEvent::Completion(_)) => {
                    return Err(TestCaseError::fail("an acceptor took a completion"));
                }
                Ok(AgentEvent::Nothing) => {
                    prop_assert!(right_proof || before == AgentState::Ready, "Nothing from {before:?}");
                }
                Err(_) => {}
            }
            prop_assert!(proved || !acceptor.authenticated(), "authenticated without the secret");
        }
    }

    /// A generation rank's session, fed any messages after any opening (a wrong secret's
    /// challenge, a challenge recorded on another connection, a dialer's own proof reflected
    /// back, an honest handshake): never panics, sends its proof and metadata, is
    /// authenticated and takes the acceptor's metadata only after the right secret's
    /// challenge over its own nonce, takes completions only once ready, and nothing after
    /// an error.
    #[test]
    fn agent_dialer_trusts_only_an_acceptor_that_proved_the_secret(
        key in key(),
        own in nonce(),
        generation in agent_metadata(Just(Role::Generation)),
        opening in dial_opening(),
        tail in proptest::collection::vec(dial_step(), 0..16),
    ) {
        let right = secret(&key);
        let (mut dialer, hello) = AgentSession::dial(right.clone(), own, generation.clone());
        prop_assert_eq!(hello, AgentMessage::Hello { nonce: own });
        // The model, as for the acceptor: the right challenge is the one made with the right
        // key, the context label, this dialer's nonce and the challenge's own.
        let mut proved = false;
        for step in opening.into_iter().chain(tail) {
            let before = dialer.state();
            let (message, honest) = match step {
                DialStep::Any(m) => (m, false),
                DialStep::WrongSecret(k, nonce) => (
                    AgentMessage::Challenge {
                        nonce,
                        proof: wrong_secret(&k).prove(Role::Context, &own, &nonce),
                    },
                    k.as_deref() == Some(key.as_slice()),
                ),
                DialStep::Swapped(nonce) => (
                    AgentMessage::Challenge { nonce, proof: right.prove(Role::Context, &nonce, &own) },
                    nonce == own,
                ),
                DialStep::Replayed { dialer: theirs, acceptor } => {
                    (recorded(&right, theirs, acceptor).0, theirs == own)
                }
                DialStep::Reflected(nonce) => (
                    AgentMessage::Challenge { nonce, proof: right.prove(Role::Generation, &own, &nonce) },
                    false,
                ),
                DialStep::Honest(nonce) => (
                    AgentMessage::Challenge { nonce, proof: right.prove(Role::Context, &own, &nonce) },
                    true,
                ),
                DialStep::Context(m) => (AgentMessage::Metadata(m), false),
                DialStep::Ready => {
                    // The acceptor's call is refused on this side, whatever the state.
                    prop_assert!(dialer.clone().admit(context_self()).is_err());
                    let out = dialer.ready();
                    prop_assert_eq!(out.is_ok(), before == AgentState::Vetting, "{:?}", out);
                    prop_assert_eq!(
                        dialer.state(),
                        if out.is_ok() { AgentState::Ready } else { before }
                    );
                    continue;
                }
                DialStep::Refuse => {
                    let out = dialer.refuse("no".into());
                    prop_assert!(matches!(out, AgentMessage::Error { .. }), "{out:?}");
                    prop_assert_eq!(dialer.state(), AgentState::Closed);
                    continue;
                }
            };
            let right_challenge = match &message {
                AgentMessage::Challenge { nonce, .. }
                    if before == AgentState::AwaitChallenge && honest => Some(*nonce),
                _ => None,
            };
            let result = dialer.receive(message);
            let after = dialer.state();
            if before == AgentState::Closed {
                prop_assert!(result.is_err(), "a closed session took a message: {result:?}");
            }
            if result.is_err() {
                prop_assert_eq!(after, AgentState::Closed);
            }
            if before == AgentState::AwaitChallenge && after != AgentState::Closed {
                prop_assert!(right_challenge.is_some(), "authenticated by a challenge that is not the right one");
            }
            proved |= right_challenge.is_some() && result.is_ok();
            match &result {
                Ok(AgentEvent::Reply(reply)) => {
                    let Some(theirs) = right_challenge else {
                        return Err(TestCaseError::fail("the dialer's proof and metadata went to an unproved peer"));
                    };
                    let expected = vec![
                        AgentMessage::Proof { proof: right.prove(Role::Generation, &own, &theirs) },
                        AgentMessage::Metadata(Box::new(generation.clone())),
                    ];
                    prop_assert_eq!(reply.as_slice(), expected.as_slice());
                }
                Ok(AgentEvent::Metadata(m)) => {
                    prop_assert!(proved, "metadata taken from an unproved acceptor");
                    prop_assert_eq!(before, AgentState::AwaitMetadata);
                    prop_assert_eq!(m.role, Role::Context);
                }
                Ok(AgentEvent::Completion(_)) => {
                    prop_assert!(proved);
                    prop_assert_eq!(before, AgentState::Ready);
                }
                Ok(AgentEvent::RequestData(_) | AgentEvent::Cancel { .. }) => {
                    return Err(TestCaseError::fail("a dialer took a request"));
                }
                Ok(AgentEvent::Nothing) => prop_assert_eq!(before, AgentState::Ready),
                Err(_) => {}
            }
            prop_assert!(proved || !dialer.authenticated(), "authenticated without the secret");
        }
    }
}
