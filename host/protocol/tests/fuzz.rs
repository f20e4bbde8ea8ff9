//! Bounded fuzzing of everything a peer controls: the frame reader and body decoder on
//! arbitrary and mutated bytes, and the session and request state machines on arbitrary
//! message sequences. A finding is a panic, an allocation out of proportion to the bytes
//! that arrived, or a state machine breaking its own rules.
//!
//! Covered: `AgentMessage` frames (`KVFA`, every variant) on arbitrary and mutated bytes,
//! `AgentMetadata::from_bytes` on the same, `RequestTracker` under arbitrary completions,
//! the secure handshake (`secure::accept` on arbitrary and mutated first messages under a
//! memory bound, `secure::dial` on forged and mutated replies through a relay that forwards
//! or alters what passes, records mutated in flight), and both sides of `AgentSession` under
//! arbitrary message sequences, with honest pairs as the control.
//!
//! proptest rather than cargo-fuzz, so it runs on a stable toolchain on every commit; the
//! case counts keep it to seconds. For a longer hunt:
//! `PROPTEST_CASES=200000 cargo test --release -p kvferry-protocol --test suite fuzz::`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{Cursor, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::OnceLock;

use kvferry_planner_abi::{Mapping, SlotTable, TokenRange, ViewId};
use kvferry_protocol::secure::{self, HandshakeError, Intent, MAX_HELLO, PREAMBLE_LEN};
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
    prop_oneof![Just(Role::Prefill), Just(Role::Decode)]
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
                    integrity: None,
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
            1 => "[a-z ]{0,12}".prop_map(CompletionStatus::Cancelled),
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
                    digest: None,
                    views: None,
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

/// A change to a handshake message that stays within it: bytes appended after a handshake
/// message are the first record's, which the record properties cover.
fn handshake_mutation() -> impl Strategy<Value = Mutation> {
    mutation().prop_filter("within the message", |m| !matches!(m, Mutation::Append(_)))
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

/// Any agent message, every variant.
fn agent_message() -> impl Strategy<Value = AgentMessage> {
    prop_oneof![
        agent_metadata(role()).prop_map(|m| AgentMessage::Metadata(Box::new(m))),
        "[a-z ]{0,12}".prop_map(|reason| AgentMessage::Refused { reason }),
        request_data().prop_map(AgentMessage::RequestData),
        completion().prop_map(AgentMessage::Completion),
        (0u64..4, "[a-z]{0,8}")
            .prop_map(|(request, reason)| AgentMessage::Cancel { request, reason }),
        Just(AgentMessage::Ping),
        any::<u64>().prop_map(|request| AgentMessage::Hold { request }),
        "[a-z]{0,8}".prop_map(|message| AgentMessage::Error { message }),
        Just(AgentMessage::ProveWorker),
        proptest::collection::vec(any::<u8>(), 0..40)
            .prop_map(|challenge| AgentMessage::WorkerProof { challenge }),
    ]
}

/// A secret's bytes (the shortest accepted and longer).
fn key() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 16..48)
        .prop_filter("not blank", |k| !k.iter().all(u8::is_ascii_whitespace))
}

fn secret(key: &[u8]) -> Secret {
    Secret::new(key.to_vec()).unwrap()
}

fn wire(message: &AgentMessage) -> AgentMessage {
    read_frame(&mut Cursor::new(encode(message).unwrap())).unwrap()
}

/// An in-memory connection: reads what is queued, keeps what is written.
#[derive(Default)]
struct Pipe {
    input: Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl Read for Pipe {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Pipe {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn intent() -> Intent {
    Intent {
        endpoint: "10.0.0.1:7000".into(),
    }
}

/// A dialer's first message on `secret` (its reply never comes).
fn first_message(secret: &Secret) -> Vec<u8> {
    let mut pipe = Pipe::default();
    let _ = secure::dial::<AgentMessage>(&mut pipe, secret, &intent());
    pipe.output
}

/// The acceptor's result, the dialer's, and whether the relay changed the reply.
type Relayed = (
    Result<(secure::Channel, Intent), HandshakeError>,
    Result<secure::Channel, HandshakeError>,
    bool,
);

/// A dialer and an acceptor with a relay between them that forwards the first message and
/// passes the reply through `alter`: the acceptor's result, then the dialer's, and whether
/// the relay changed the reply.
fn relayed(dialer: &Secret, acceptor: &Secret, alter: impl FnOnce(&mut Vec<u8>)) -> Relayed {
    let (mut d_end, mut relay_d) = UnixStream::pair().unwrap();
    let (mut relay_a, mut a_end) = UnixStream::pair().unwrap();
    let d = dialer.clone();
    let dialing =
        std::thread::spawn(move || secure::dial::<AgentMessage>(&mut d_end, &d, &intent()));
    let a = acceptor.clone();
    let accepting = std::thread::spawn(move || secure::accept::<AgentMessage>(&mut a_end, &a));
    let mut pre = [0u8; PREAMBLE_LEN];
    relay_d.read_exact(&mut pre).unwrap();
    let len = usize::from(u16::from_le_bytes([pre[6], pre[7]]));
    let mut first = vec![0u8; len];
    relay_d.read_exact(&mut first).unwrap();
    relay_a.write_all(&pre).unwrap();
    relay_a.write_all(&first).unwrap();
    let accepted = accepting.join().unwrap();
    let mut reply = Vec::new();
    relay_a.shutdown(std::net::Shutdown::Write).unwrap();
    relay_a.read_to_end(&mut reply).unwrap();
    let honest = reply.clone();
    alter(&mut reply);
    relay_d.write_all(&reply).unwrap();
    relay_d.shutdown(std::net::Shutdown::Write).unwrap();
    let dialed = dialing.join().unwrap();
    (accepted, dialed, reply != honest)
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
        role: Role::Prefill,
        epoch: 7,
        planner_id: "kvferry.default".into(),
        describer_id: "kvferry.default_describer".into(),
        planner_version: "0.1.0".into(),
        label: "fuzz".into(),
        endpoint: Some("127.0.0.1:1".into()),
        rank: cached_ranks()[1].clone(),
    }
}

/// What an unauthenticated peer may make an acceptor hold: its first message and the
/// handshake's own state, nothing in proportion to what it claims.
const HANDSHAKE_BOUND: usize = 64 << 10;

/// A first message that may or may not be a handshake's: any preamble (this family's magic
/// and version, or not; any claimed length) and any bytes after it.
fn handshake_bytes() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<bool>(),
        any::<[u8; 4]>(),
        any::<u16>(),
        prop_oneof![any::<u16>(), 0u16..64, Just(MAX_HELLO as u16)],
        proptest::collection::vec(any::<u8>(), 0..1200),
    )
        .prop_map(|(ours, magic, version, claimed, body)| {
            let mut b = Vec::with_capacity(PREAMBLE_LEN + body.len());
            b.extend_from_slice(if ours { b"KVFA" } else { &magic });
            let version = if ours { PROTOCOL_VERSION } else { version };
            b.extend_from_slice(&version.to_le_bytes());
            b.extend_from_slice(&claimed.to_le_bytes());
            b.extend_from_slice(&body);
            b
        })
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

}

proptest! {
    // Each case runs X25519 handshakes (unoptimised in the test profile): fewer cases.
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any bytes an unauthenticated peer sends as its first message: the acceptor makes no
    /// channel, answers at most an empty reply, never panics, and holds no more than the
    /// handshake bound whatever length the bytes claim.
    #[test]
    fn arbitrary_first_messages_open_no_channel(bytes in handshake_bytes(), key in key()) {
        let right = secret(&key);
        let mut pipe = Pipe { input: Cursor::new(bytes), output: Vec::new() };
        let (result, peak) = peak_during(|| secure::accept::<AgentMessage>(&mut pipe, &right));
        prop_assert!(result.is_err(), "a channel from arbitrary bytes");
        prop_assert!(peak <= HANDSHAKE_BOUND, "{peak} bytes held before authentication");
        prop_assert!(pipe.output.is_empty() || pipe.output == [0, 0], "{:?}", pipe.output);
    }

    /// An honest first message opens; the same message changed anywhere (a flipped byte, cut
    /// short, its length field rewritten) opens nothing, under the right secret
    /// or any other.
    #[test]
    fn mutated_first_messages_open_no_channel(
        key in key(),
        other in key(),
        mutations in proptest::collection::vec(handshake_mutation(), 1..4),
    ) {
        let right = secret(&key);
        let honest = first_message(&right);
        let mut pipe = Pipe { input: Cursor::new(honest.clone()), output: Vec::new() };
        let (channel, intent_seen) = secure::accept::<AgentMessage>(&mut pipe, &right).unwrap();
        drop(channel);
        prop_assert_eq!(intent_seen, intent());
        let mut bytes = honest.clone();
        for m in &mutations {
            if !bytes.is_empty() {
                mutate(&mut bytes, m);
            }
        }
        let changed = bytes != honest;
        let mut pipe = Pipe { input: Cursor::new(bytes.clone()), output: Vec::new() };
        let result = secure::accept::<AgentMessage>(&mut pipe, &right);
        prop_assert!(result.is_ok() != changed, "changed {changed}: {:?}", result.err());
        if other != key {
            let mut pipe = Pipe { input: Cursor::new(honest), output: Vec::new() };
            let result = secure::accept::<AgentMessage>(&mut pipe, &secret(&other));
            prop_assert!(matches!(result, Err(HandshakeError::Unauthenticated)), "{result:?}");
            prop_assert_eq!(pipe.output, vec![0u8, 0]);
        }
    }

    /// Through a relay: forwarding the handshake honestly makes a channel between the two
    /// ends (whose binding the relay cannot compute); any change to the reply makes none.
    /// On different secrets nothing opens either way. Then records the relay alters in flight
    /// never open, and the bytes read are always a prefix of what was sent.
    #[test]
    fn a_relay_gets_no_channel_and_alters_nothing(
        key in key(),
        other in proptest::option::of(key()),
        reply_mutations in proptest::collection::vec(handshake_mutation(), 0..3),
        record_mutations in proptest::collection::vec(mutation(), 0..3),
        payload in proptest::collection::vec(any::<u8>(), 1..2000),
    ) {
        let right = secret(&key);
        let acceptor_secret = other.as_deref().map_or_else(|| right.clone(), secret);
        let same = other.as_ref().is_none_or(|o| *o == key);
        let (accepted, dialed, altered) = relayed(&right, &acceptor_secret, |reply| {
            for m in &reply_mutations {
                if !reply.is_empty() {
                    mutate(reply, m);
                }
            }
        });
        prop_assert_eq!(accepted.is_ok(), same);
        prop_assert_eq!(dialed.is_ok(), same && !altered, "{:?}", dialed.as_ref().err());
        let (Ok((a, _)), Ok(d)) = (accepted, dialed) else { return Ok(()) };
        prop_assert_eq!(a.binding(), d.binding());
        let (mut reader, _) = a.split(Pipe::default(), Pipe::default());
        let (_, mut writer) = d.split(Pipe::default(), Pipe::default());
        writer.write_all(&payload).unwrap();
        writer.flush().unwrap();
        let mut records = writer.get_ref().output.clone();
        let honest = records.clone();
        for m in &record_mutations {
            if !records.is_empty() {
                mutate(&mut records, m);
            }
        }
        reader.get_mut().input = Cursor::new(records.clone());
        let mut got = Vec::new();
        let result = reader.read_to_end(&mut got);
        prop_assert!(payload.starts_with(&got), "bytes that were never sent were read");
        if records != honest {
            prop_assert!(result.is_err() || got.len() < payload.len(), "an altered record opened");
        } else {
            prop_assert_eq!(got, payload);
        }
    }

}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// An acceptor's session under any message sequence: it takes metadata only from a
    /// decode rank and only first, a worker proof only after asking for one, requests
    /// and cancels only once it admitted that rank, never a completion, and nothing once
    /// closed.
    #[test]
    fn agent_acceptor_takes_requests_only_after_admitting_metadata(
        messages in proptest::collection::vec(agent_message(), 0..12),
        admit_at in proptest::option::of(0usize..12),
        challenge_at in proptest::option::of(0usize..12),
    ) {
        let mut acceptor = AgentSession::accept();
        prop_assert_eq!(acceptor.state(), AgentState::AwaitMetadata);
        for (i, message) in messages.into_iter().enumerate() {
            if challenge_at == Some(i) {
                let before = acceptor.state();
                let out = acceptor.challenge();
                prop_assert_eq!(out.is_ok(), before == AgentState::Vetting);
                if out.is_ok() {
                    prop_assert_eq!(acceptor.state(), AgentState::AwaitWorkerProof);
                }
            }
            if admit_at == Some(i) {
                let before = acceptor.state();
                let out = acceptor.admit(context_self());
                prop_assert_eq!(out.is_ok(), before == AgentState::Vetting);
            }
            let before = acceptor.state();
            let result = acceptor.receive(wire(&message));
            if result.is_err() {
                prop_assert_eq!(acceptor.state(), AgentState::Closed);
            }
            match &result {
                Ok(AgentEvent::Metadata(m)) => {
                    prop_assert_eq!(before, AgentState::AwaitMetadata);
                    prop_assert_eq!(m.role, Role::Decode);
                }
                Ok(
                    AgentEvent::RequestData(_)
                    | AgentEvent::Cancel { .. }
                    | AgentEvent::Hold { .. }
                    | AgentEvent::Nothing,
                ) => {
                    prop_assert_eq!(before, AgentState::Ready);
                }
                Ok(AgentEvent::WorkerProof(_)) => {
                    prop_assert_eq!(before, AgentState::AwaitWorkerProof);
                    prop_assert_eq!(acceptor.state(), AgentState::Vetting);
                }
                Ok(AgentEvent::Completion(_) | AgentEvent::ProveWorker) => {
                    return Err(TestCaseError::fail("an acceptor took a dialer's message"));
                }
                Err(AgentError::PeerError { .. } | AgentError::Unexpected { .. } | AgentError::Role { .. }) => {}
                Err(e) => return Err(TestCaseError::fail(format!("unexpected {e}"))),
            }
        }
    }

    /// A dialer's session under any message sequence: it takes the acceptor's metadata only
    /// from a prefill rank and only first, completions only once ready, and nothing once
    /// closed; its first message is its own metadata.
    #[test]
    fn agent_dialer_takes_completions_only_once_ready(
        generation in agent_metadata(Just(Role::Decode)),
        messages in proptest::collection::vec(agent_message(), 0..12),
        ready_at in proptest::option::of(0usize..12),
    ) {
        let (mut dialer, first) = AgentSession::dial(generation.clone());
        prop_assert_eq!(first, AgentMessage::Metadata(Box::new(generation)));
        for (i, message) in messages.into_iter().enumerate() {
            if ready_at == Some(i) {
                let before = dialer.state();
                prop_assert!(dialer.clone().admit(context_self()).is_err());
                prop_assert_eq!(dialer.ready().is_ok(), before == AgentState::Vetting);
            }
            let before = dialer.state();
            let result = dialer.receive(wire(&message));
            if result.is_err() {
                prop_assert_eq!(dialer.state(), AgentState::Closed);
            }
            match &result {
                Ok(AgentEvent::Metadata(m)) => {
                    prop_assert_eq!(before, AgentState::AwaitMetadata);
                    prop_assert_eq!(m.role, Role::Prefill);
                }
                Ok(AgentEvent::Completion(_) | AgentEvent::Nothing) => {
                    prop_assert_eq!(before, AgentState::Ready);
                }
                Ok(AgentEvent::ProveWorker) => {
                    prop_assert_eq!(before, AgentState::AwaitMetadata);
                    prop_assert_eq!(dialer.state(), AgentState::AwaitMetadata);
                }
                Ok(other) => return Err(TestCaseError::fail(format!("a dialer took {other:?}"))),
                Err(_) => {}
            }
        }
    }
}
