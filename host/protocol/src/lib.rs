//! kvferry-protocol: the control-plane wire format, sans I/O — the secure channel every
//! connection runs in ([`secure`]), versioned, size-capped frames inside it, the agents'
//! side-channel messages ([`agent`]), and what a request's completions add up to
//! ([`tracker`]).
//!
//! A connection starts with a Noise handshake keyed by the deployment's [`Secret`]
//! ([`secure::dial`], [`secure::accept`]); after it, the frames below travel inside encrypted,
//! authenticated records ([`secure::SecureReader`], [`secure::SecureWriter`]). Every frame is
//! a 10-byte header followed by the body:
//!
//! ```text
//! offset 0  magic    4 bytes  one per message family (Frame::MAGIC): b"KVFA" for AgentMessage
//! offset 4  version  u16 LE   PROTOCOL_VERSION
//! offset 6  length   u32 LE   body bytes, at most MAX_FRAME_BYTES
//! offset 10 body     bincode 2 (serde, standard config) of one message
//! ```
//!
//! The body is decoded with `bincode::config::standard()` under a limit of the smallest of
//! 64 KiB, 1 MiB, 4 MiB, 16 MiB and [`MAX_FRAME_BYTES`] that is at least 64 times the body,
//! so lengths claimed inside the body (strings, sequences) can never make the decoder
//! reserve more than 256 times the body plus 64 KiB, and a body must be consumed exactly (trailing bytes are refused). A frame
//! with a wrong magic, another version, an oversized length or an undecodable body is an
//! error naming what is wrong; servers answer it with an error message and close only that
//! connection. Each message family has its own magic, so a client of one family that
//! connects to the listener of another is refused at its first frame, by name.
//!
//! bincode is flagged unmaintained (RUSTSEC-2025-0141, every version; its authors call it
//! complete). It stays the body codec this project was specified with, confined to
//! [`encode`] and [`decode_body`], so swapping it touches this module alone.
//!
//! # Agent messages ([`AgentMessage`])
//!
//! Between a decode rank and a prefill rank's side channel, inside the secure channel:
//! `Metadata` both ways, then `RequestData` (a claim, per
//! receiver and sender rank pair), `Completion` per piece after its flush, `Cancel`, `Ping`;
//! `Refused` and `Error` end the connection. [`AgentSession`] says which may come when.
//!
//! Test and benchmark controllers speak their own message family on their own listener (the
//! `kvferry` CLI's control protocol), never this one.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod agent;
pub mod decode;
pub mod exec;
pub mod outcome;
pub mod prefill;
pub mod secure;
pub mod stash;
pub mod tracker;

pub use agent::{
    AgentError, AgentEvent, AgentMessage, AgentMetadata, AgentSession, AgentState, PeerIdentity,
};
pub use outcome::{FailureKind, RequestOutcome, RequestStats, Stages};
pub use secure::{Secret, SecretError};
pub use tracker::{Pair, Phase, PieceFailure, RequestTracker, Totals, Tracked, Violation};

use std::fmt;
use std::io::{self, Read, Write};

use bincode::error::DecodeError;
use kvferry_planner_abi::{RankInfo, SlotTable, TokenRange, ViewId};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The protocol version this build speaks; a frame of any other version is refused.
/// 2: the peer and control message families were split (each with its own magic).
/// 4: every connection runs in the Noise channel ([`secure`]); the agent's own proofs
/// (`Hello`, `Challenge`, `Proof`) are gone.
/// 6: a [`Completion`] names the views of a layer-wise piece.
pub const PROTOCOL_VERSION: u16 = 6;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 10;
/// The largest frame body accepted or sent: 64 MiB.
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// What [`read_frame`] reserves for a body before its bytes arrive.
const BODY_CHUNK: usize = 64 << 10;

/// Why a frame could not be read, decoded or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The peer closed the connection between frames.
    #[error("connection closed")]
    Closed,
    /// Reading or writing the socket failed (a frame cut short included).
    #[error("i/o")]
    Io(#[from] io::Error),
    /// The frame does not start with the magic of the message family expected.
    #[error("bad magic {found:02x?}: not a kvferry {family} frame (expected {expected:02x?})")]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
        /// The magic expected.
        expected: [u8; 4],
        /// The message family expected, e.g. `agent`.
        family: &'static str,
    },
    /// The frame's protocol version is not [`PROTOCOL_VERSION`].
    #[error("protocol version {found} is not supported (this build speaks {PROTOCOL_VERSION})")]
    Version {
        /// The version found.
        found: u16,
    },
    /// The frame's length exceeds [`MAX_FRAME_BYTES`].
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    Oversized {
        /// The length claimed (or, when sending, encoded).
        len: u64,
        /// The limit.
        max: usize,
    },
    /// The body is not a message of this protocol version.
    #[error("undecodable frame body of {len} bytes")]
    Decode {
        /// Body length.
        len: usize,
        /// bincode's reason.
        #[source]
        source: bincode::error::DecodeError,
    },
    /// The body holds bytes after the message.
    #[error("frame body has {extra} trailing bytes after its message")]
    Trailing {
        /// Bytes left over.
        extra: usize,
    },
    /// The message could not be encoded.
    #[error("cannot encode message")]
    Encode(#[source] bincode::error::EncodeError),
}

impl WireError {
    /// Whether the error is the peer going away rather than bad input.
    pub fn is_disconnect(&self) -> bool {
        match self {
            WireError::Closed => true,
            WireError::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            ),
            _ => false,
        }
    }
}

/// Which side of a transfer an instance is: `context` (alias `ctx`) or `generation` (alias
/// `gen`) on the command line.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    strum::AsRefStr,
    strum::Display,
    strum::EnumString,
    strum::VariantNames,
)]
#[strum(parse_err_ty = String, parse_err_fn = unknown_role)]
pub enum Role {
    /// A prefill rank (TensorRT-LLM: context): it owns the source cache and writes. Also read
    /// as `context` and `ctx`.
    #[strum(to_string = "prefill", serialize = "context", serialize = "ctx")]
    Prefill,
    /// A decode rank (TensorRT-LLM: generation): it owns the destination cache and receives.
    /// Also read as `generation` and `gen`.
    #[strum(to_string = "decode", serialize = "generation", serialize = "gen")]
    Decode,
}

fn unknown_role(name: &str) -> String {
    unknown_name::<Role>("role", name)
}

/// The error of parsing a name none of `T`'s variants answers to, listing those that do:
/// ``unknown role `x` (known: prefill, decode)`` for `what` = `role`. The `FromStr` of
/// [`Role`] and of `kvferry-transfer`'s `Transport` and `MemoryKind` report it (through
/// `#[strum(parse_err_fn = ...)]`); the testkit, which does not depend on this crate, words
/// its `LayoutError` for unknown presets and dtypes the same way.
pub fn unknown_name<T: strum::VariantNames>(what: &str, name: &str) -> String {
    format!(
        "unknown {what} `{name}` (known: {})",
        T::VARIANTS.join(", ")
    )
}

/// One remotely writable pool of a rank: where it is and the key to write it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolKey {
    /// Address of the pool's first byte in its owner's address space.
    pub base: u64,
    /// Bytes of the mapped region.
    pub len: u64,
    /// The packed UCX remote key.
    pub rkey: Vec<u8>,
}

/// What a rank advertises: its [`RankInfo`] plus the host-only facts beside it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankDescriptor {
    /// The planner-visible description.
    pub info: RankInfo,
    /// The rank's UCX worker address.
    pub worker_address: Vec<u8>,
    /// One key per pool of `info.page_table.pools`, in order.
    pub pools: Vec<PoolKey>,
    /// A decode rank's bounce arena, if it has one: writers put bounced pieces into
    /// the regions of it that [`RequestData::bounce`] offers.
    pub bounce: Option<PoolKey>,
}

/// A receiver rank's request to one sender rank: where the request's bytes must go.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestData {
    /// The request id both sides know.
    pub request: u64,
    /// The receiving instance.
    pub receiver_instance: String,
    /// The receiving rank.
    pub receiver_rank: u32,
    /// The sender rank asked to write.
    pub sender_rank: u32,
    /// The receiver's slot tables, one per layer group of its page table.
    pub slot_tables: Vec<SlotTable>,
    /// Tokens the receiver wants (the whole prompt; senders may send it in chunks).
    pub token_range: TokenRange,
    /// The request's prompt length.
    pub prompt_len: u64,
    /// Block-aligned token where the receiver's table starts to matter (cached prefix).
    pub dst_start_token: Option<u64>,
    /// Receiver views that must not be written.
    pub excluded_views: Vec<ViewId>,
    /// A region of the receiver's bounce arena reserved for this request, if it offers one.
    pub bounce: Option<BounceOffer>,
    /// The digest the receiver asks of every piece ([`Completion::digest`]), if any.
    pub integrity: Option<Integrity>,
}

/// An end-to-end integrity digest of a piece's bytes: the hash of its *packed image*, the
/// bytes the piece writes in the order of their destination addresses. A sender computes it
/// over its source bytes in that order, a receiver over the bytes that landed in its slots by
/// its own plan of the piece, so neither the plan's cuts nor its order matter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Integrity {
    /// XXH3, 64 bits (`xxhash-rust`).
    Xxh3,
    /// CRC-32C (Castagnoli, `crc32c`; hardware instructions where the CPU has them).
    Crc32c,
}

impl Integrity {
    /// The configuration and command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            Integrity::Xxh3 => "xxh3",
            Integrity::Crc32c => "crc32c",
        }
    }
}

impl fmt::Display for Integrity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Integrity {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "xxh3" => Ok(Integrity::Xxh3),
            "crc32c" => Ok(Integrity::Crc32c),
            other => Err(format!(
                "unknown integrity digest `{other}` (expected `xxh3` or `crc32c`)"
            )),
        }
    }
}

/// A sender's digest of one piece ([`Integrity`]): what the receiver recomputes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceDigest {
    /// The tokens the piece covers (the receiver plans them to know which bytes to hash).
    pub tokens: TokenRange,
    /// The digest of the piece's packed image (a CRC-32C in the low 32 bits).
    pub value: u64,
}

/// A region of a receiver's bounce arena ([`RankDescriptor::bounce`]) that one writer may
/// fill with the packed images of its pieces of one request, one after another from the
/// region's start (`transfer-semantics.md` §9).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BounceOffer {
    /// Where the region starts, in bytes from the arena's base.
    pub offset: u64,
    /// Its length.
    pub len: u64,
}

/// Where a bounced piece's packed image was put: the receiver scatters it by its own plan
/// of the piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BouncedPiece {
    /// Bytes from the offered region's start.
    pub offset: u64,
    /// The tokens the piece covers (the receiver plans them to know where its bytes go).
    pub tokens: TokenRange,
}

/// How one piece of a sender's work ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CompletionStatus {
    /// Every fragment was written and the endpoint flushed: the bytes are visible.
    Ok,
    /// Nothing may be assumed about the piece's bytes.
    Failed(String),
    /// The sender's engine cancelled the request: this is the pair's last piece, and nothing
    /// may be assumed about its bytes.
    Cancelled(String),
}

/// A sender's report on one piece, sent only after the piece's flush completed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Completion {
    /// The request.
    pub request: u64,
    /// The writing rank.
    pub sender_rank: u32,
    /// The rank written to.
    pub receiver_rank: u32,
    /// Index of the piece (chunk).
    pub piece: u32,
    /// Whether this is the sender's last piece for the receiver.
    pub is_last: bool,
    /// Bytes written.
    pub bytes: u64,
    /// Fragments (puts before splitting) written.
    pub fragments: u64,
    /// The outcome.
    pub status: CompletionStatus,
    /// Set when the piece went through the receiver's bounce region instead of straight
    /// into its slots: `bytes` is then the packed image's length.
    pub bounce: Option<BouncedPiece>,
    /// The piece's digest, when the receiver asked for one ([`RequestData::integrity`]) and
    /// the piece was written.
    pub digest: Option<PieceDigest>,
    /// The sender's views the piece carries, when it carries only some of them (a layer-wise
    /// send: the layers computed so far); `None`, every view. The receiver plans a bounced
    /// or digested piece over these views only, so they must be the sender's own and
    /// distinct.
    pub views: Option<Vec<ViewId>>,
}

/// A family of messages with its own frame magic.
pub trait Frame: Serialize + DeserializeOwned {
    /// The first four bytes of every frame of this family.
    const MAGIC: [u8; 4];
    /// The family's name, for errors (`agent`, `control`).
    const FAMILY: &'static str;
    /// The message's name, for logs.
    fn kind(&self) -> &'static str;
    /// The refusal text, if this is the family's "error, closing" message.
    fn error_text(&self) -> Option<&str> {
        None
    }
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME_BYTES>()
}

/// A header of family `M` for a body of `len` bytes.
pub fn header<M: Frame>(len: usize) -> Result<[u8; HEADER_LEN], WireError> {
    let len32 = u32::try_from(len)
        .ok()
        .filter(|&n| n as usize <= MAX_FRAME_BYTES)
        .ok_or(WireError::Oversized {
            len: len as u64,
            max: MAX_FRAME_BYTES,
        })?;
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&M::MAGIC);
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[6..].copy_from_slice(&len32.to_le_bytes());
    Ok(h)
}

/// Checks a header; returns the body length it announces.
///
/// # Errors
///
/// A wrong magic, another version, or a length above [`MAX_FRAME_BYTES`].
pub fn parse_header<M: Frame>(h: &[u8; HEADER_LEN]) -> Result<usize, WireError> {
    let mut magic = [0u8; 4];
    magic.copy_from_slice(&h[..4]);
    if magic != M::MAGIC {
        return Err(WireError::BadMagic {
            found: magic,
            expected: M::MAGIC,
            family: M::FAMILY,
        });
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != PROTOCOL_VERSION {
        return Err(WireError::Version { found: version });
    }
    let len = u32::from_le_bytes([h[6], h[7], h[8], h[9]]);
    if len as usize > MAX_FRAME_BYTES {
        return Err(WireError::Oversized {
            len: u64::from(len),
            max: MAX_FRAME_BYTES,
        });
    }
    Ok(len as usize)
}

/// A whole frame (header and body) for `message`.
///
/// # Errors
///
/// The message cannot be encoded, or its body exceeds [`MAX_FRAME_BYTES`].
pub fn encode<M: Frame>(message: &M) -> Result<Vec<u8>, WireError> {
    let body = bincode::serde::encode_to_vec(message, config()).map_err(WireError::Encode)?;
    let mut frame = Vec::with_capacity(HEADER_LEN + body.len());
    frame.extend_from_slice(&header::<M>(body.len())?);
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Decodes a frame body (without its header).
///
/// # Errors
///
/// [`WireError::Decode`] for bytes that are not a message, [`WireError::Trailing`] for bytes
/// after it.
pub fn decode_body<M: Frame>(body: &[u8]) -> Result<M, WireError> {
    // The limit bounds what lengths claimed inside the body may make the decoder reserve:
    // a string's bytes, a sequence's elements (claimed at their in-memory size). An honest
    // body never claims more than its element sizes over their smallest encodings (an empty
    // `RVec` is 32 bytes in memory and one byte on the wire), so the limit is the smallest
    // tier at least 64 times the body. A 74-byte frame whose flipped string length claimed
    // 7 MB under one fixed 64 MiB limit (found by the fuzz suite) now gets 64 KiB; a 57 KB
    // fragment export needs more than its own size (it claims 40 bytes per 8-byte fragment).
    fn tier<M: Frame, const LIMIT: usize>(body: &[u8]) -> Result<(M, usize), DecodeError> {
        bincode::serde::decode_from_slice(body, bincode::config::standard().with_limit::<LIMIT>())
    }
    let decoded = match body.len().saturating_mul(64) {
        n if n <= 64 << 10 => tier::<M, { 64 << 10 }>(body),
        n if n <= 1 << 20 => tier::<M, { 1 << 20 }>(body),
        n if n <= 4 << 20 => tier::<M, { 4 << 20 }>(body),
        n if n <= 16 << 20 => tier::<M, { 16 << 20 }>(body),
        _ => tier::<M, MAX_FRAME_BYTES>(body),
    };
    let (message, used) = decoded.map_err(|source| WireError::Decode {
        len: body.len(),
        source,
    })?;
    if used != body.len() {
        return Err(WireError::Trailing {
            extra: body.len() - used,
        });
    }
    Ok(message)
}

/// Writes one frame.
///
/// # Errors
///
/// As [`encode`], or the write failing.
pub fn write_frame<M: Frame>(w: &mut impl Write, message: &M) -> Result<(), WireError> {
    let frame = encode(message)?;
    w.write_all(&frame)?;
    w.flush()?;
    Ok(())
}

/// Fills `buf` from `r`: `Ok(false)` when the stream ended cleanly before its first byte, an
/// [`io::ErrorKind::UnexpectedEof`] naming `what` when it ended part way.
pub(crate) fn read_start(r: &mut impl Read, buf: &mut [u8], what: &str) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("{what} cut short after {got} bytes"),
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Reads one frame and decodes it.
///
/// # Errors
///
/// [`WireError::Closed`] at a clean end of stream before a header, any header or body error,
/// or the read failing (a frame cut short is [`io::ErrorKind::UnexpectedEof`]).
pub fn read_frame<M: Frame>(r: &mut impl Read) -> Result<M, WireError> {
    let mut h = [0u8; HEADER_LEN];
    if !read_start(r, &mut h, "frame header")? {
        return Err(WireError::Closed);
    }
    let len = parse_header::<M>(&h)?;
    // The body buffer grows with the bytes that actually arrive: a header claiming 64 MiB
    // followed by nothing must not cost 64 MiB (one per connection adds up).
    let mut body = Vec::with_capacity(len.min(BODY_CHUNK));
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() < len {
        return Err(WireError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("frame body cut short: {} of {len} bytes", body.len()),
        )));
    }
    decode_body(&body)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages whose in-memory size is largest against their encoding: many empty
    /// strings (24 bytes each in memory, one on the wire) and empty slot tables (32 and 1).
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Sparse(Vec<String>, Vec<SlotTable>);

    impl Frame for Sparse {
        const MAGIC: [u8; 4] = *b"TEST";
        const FAMILY: &'static str = "test";
        fn kind(&self) -> &'static str {
            "Sparse"
        }
    }

    #[test]
    fn honest_bodies_that_claim_far_more_than_their_size_still_decode() {
        for n in [1usize, 100, 1_000, 20_000, 300_000] {
            let m = Sparse(vec![String::new(); n], vec![SlotTable::new([]); n]);
            let frame = encode(&m).unwrap();
            let back: Sparse = decode_body(&frame[HEADER_LEN..]).unwrap();
            assert_eq!(back, m, "{n}");
        }
    }

    #[test]
    fn header_round_trips() {
        let h = header::<AgentMessage>(1234).unwrap();
        assert_eq!(parse_header::<AgentMessage>(&h).unwrap(), 1234);
        assert!(matches!(
            header::<AgentMessage>(MAX_FRAME_BYTES + 1),
            Err(WireError::Oversized { .. })
        ));
    }

    #[test]
    fn roles_parse_by_name_and_alias_and_print_their_name() {
        for (name, role) in [
            ("prefill", Role::Prefill),
            ("decode", Role::Decode),
            ("context", Role::Prefill),
            ("ctx", Role::Prefill),
            ("generation", Role::Decode),
            ("gen", Role::Decode),
        ] {
            assert_eq!(name.parse::<Role>(), Ok(role), "{name}");
        }
        assert_eq!(Role::Prefill.to_string(), "prefill");
        assert_eq!(Role::Decode.as_ref(), "decode");
        assert_eq!(
            "Context".parse::<Role>(),
            Err("unknown role `Context` (known: prefill, decode)".to_string())
        );
    }
}
