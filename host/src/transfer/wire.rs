//! The control protocol: versioned, size-limited frames carrying bincode-encoded messages.
//!
//! Every frame is a 10-byte header followed by the body:
//!
//! ```text
//! offset 0  magic    4 bytes  b"KVFR"
//! offset 4  version  u16 LE   PROTOCOL_VERSION
//! offset 6  length   u32 LE   body bytes, at most MAX_FRAME_BYTES
//! offset 10 body     bincode 2 (serde, standard config) of one Message
//! ```
//!
//! The body is decoded with `bincode::config::standard().with_limit::<MAX_FRAME_BYTES>()`,
//! so a length claimed inside the body (a vector, a string) can never allocate more than the
//! frame limit, and a body must be consumed exactly (trailing bytes are refused). A frame
//! with a wrong magic, another version, an oversized length or an undecodable body is an
//! error naming what is wrong; servers answer it with [`Message::Error`] and close only that
//! connection.
//!
//! # Messages
//!
//! | message | direction | answer |
//! |---|---|---|
//! | [`Message::InstanceInfoRequest`] | generation → context | [`Message::InstanceInfo`] |
//! | [`Message::Register`] | generation → context | [`Message::Registered`] or [`Message::Refused`] |
//! | [`Message::RequestData`] | generation → context, per (receiver, sender) rank pair | [`Message::Completion`], per piece, after the flush |
//! | [`Message::Cancel`] | either way | none |
//! | [`Message::Submit`] | controller → context, then generation | [`Message::Submitted`] (context) or [`Message::Done`] (generation) |
//! | [`Message::Verify`] | controller → generation | [`Message::Verified`] |
//! | [`Message::Release`] | controller → either | [`Message::Released`] |
//! | [`Message::VerifyIdle`] | controller → generation | [`Message::IdleVerified`] |
//! | [`Message::Shutdown`] | controller → either | the process exits |
//! | [`Message::Bench`] | controller → context | [`Message::BenchDone`] |
//! | [`Message::Error`] | server → anyone | the connection closes |

use std::io::{self, Read, Write};

use kvferry_planner_abi::{RankInfo, SlotTable, TokenRange, ViewId};
use serde::{Deserialize, Serialize};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KVFR";
/// The protocol version this build speaks; a frame of any other version is refused.
pub const PROTOCOL_VERSION: u16 = 1;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 10;
/// The largest frame body accepted or sent: 64 MiB.
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// Why a frame could not be read, decoded or written.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The peer closed the connection between frames.
    #[error("connection closed")]
    Closed,
    /// Reading or writing the socket failed (a frame cut short included).
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The frame does not start with [`MAGIC`].
    #[error("bad magic {found:02x?}: not a kvferry control frame (expected {MAGIC:02x?})")]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
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
    #[error("undecodable frame body of {len} bytes: {reason}")]
    Decode {
        /// Body length.
        len: usize,
        /// bincode's reason.
        reason: String,
    },
    /// The body holds bytes after the message.
    #[error("frame body has {extra} trailing bytes after its message")]
    Trailing {
        /// Bytes left over.
        extra: usize,
    },
    /// The message could not be encoded.
    #[error("cannot encode message: {0}")]
    Encode(String),
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

/// Which side of a transfer an instance is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Role {
    /// The prefill server: it owns the source cache and writes.
    Context,
    /// The decode server: it owns the destination cache and receives.
    Generation,
}

impl Role {
    /// `context` or `generation`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Context => "context",
            Role::Generation => "generation",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "context" | "ctx" => Ok(Role::Context),
            "generation" | "gen" => Ok(Role::Generation),
            _ => Err(format!("unknown role `{s}` (known: context, generation)")),
        }
    }
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
}

/// Everything an instance advertises about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceInfo {
    /// The instance's name (unique per process).
    pub instance_name: String,
    /// Context or generation.
    pub role: Role,
    /// The bound planner's id.
    pub planner_id: String,
    /// The bound planner's describer id.
    pub describer_id: String,
    /// The bound planner library's version.
    pub planner_version: String,
    /// Model and deployment, for messages (e.g. `deepseek-v3 fp8 tpb32 dep2`).
    pub label: String,
    /// Every rank, in instance-rank order.
    pub ranks: Vec<RankDescriptor>,
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
}

/// How one piece of a sender's work ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CompletionStatus {
    /// Every fragment was written and the endpoint flushed: the bytes are visible.
    Ok,
    /// Nothing may be assumed about the piece's bytes.
    Failed(String),
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
}

/// A demo request, as the controller submits it to both servers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Submit {
    /// Request id, unique per controller run.
    pub request: u64,
    /// Prompt length in tokens.
    pub prompt_len: u64,
    /// The context DP group serving it.
    pub ctx_dp_rank: u32,
    /// The generation DP group receiving it.
    pub gen_dp_rank: u32,
    /// Sender-side chunks (block-aligned); `None` sends the prompt in one piece.
    pub chunks: Option<Vec<TokenRange>>,
    /// Prompt tokens the receiver already holds.
    pub cached: u64,
    /// Generation side only: the context server's control address (`host:port`).
    pub peer: Option<String>,
}

/// The slot tables of one rank for one request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankTables {
    /// The rank.
    pub rank: u32,
    /// One table per layer group.
    pub tables: Vec<SlotTable>,
}

/// What a completed request moved.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestStats {
    /// Bytes written into the receiver ranks.
    pub bytes: u64,
    /// Fragments written.
    pub fragments: u64,
    /// (sender, receiver) rank pairs that reported.
    pub writers: u32,
    /// Pieces reported over all writers.
    pub pieces: u32,
    /// From the generation server's first `RequestData` to the last completion.
    pub latency_us: u64,
}

/// The oracle's verdict, as it travels.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifySummary {
    /// Whether every checked byte matched.
    pub ok: bool,
    /// Destination bytes checked.
    pub bytes_checked: u64,
    /// Of those, bytes the request covers.
    pub bytes_covered: u64,
    /// Bytes that differ.
    pub mismatched_bytes: u64,
    /// The oracle's report text.
    pub detail: String,
}

/// What a context server's bare replay of recorded plans moved, and how long it took
/// ([`Message::Bench`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BenchStats {
    /// From the first rank's first put to the last rank's last flush, in nanoseconds.
    pub elapsed_ns: u64,
    /// Bytes written.
    pub bytes: u64,
    /// Fragments written (after coalescing).
    pub fragments: u64,
    /// Puts issued (fragments split at the executor's largest put).
    pub puts: u64,
    /// Plans replayed (one window and one flush each).
    pub plans: u64,
    /// Context ranks that replayed.
    pub ranks: u32,
}

/// One control message.
///
/// New messages are appended, so the encoding of the others does not change.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    /// Asks a context server for its [`InstanceInfo`].
    InstanceInfoRequest,
    /// A context server's description.
    InstanceInfo(InstanceInfo),
    /// A generation instance registers its ranks with a context server.
    Register(InstanceInfo),
    /// The registration was accepted.
    Registered {
        /// The context instance's name.
        instance: String,
    },
    /// The registration (or the peer) was refused.
    Refused {
        /// Which rank refused which, and the planner's field-level reason.
        reason: String,
    },
    /// A receiver rank's request description, to one target sender rank.
    RequestData(RequestData),
    /// A sender's report on one piece.
    Completion(Completion),
    /// Abandon a request.
    Cancel {
        /// The request.
        request: u64,
        /// Why.
        reason: String,
    },
    /// Controller: run a request.
    Submit(Submit),
    /// Context server: the request is prefilled (slots allocated and filled), or why not.
    Submitted {
        /// The request.
        request: u64,
        /// The context DP group's slot tables.
        result: Result<Vec<RankTables>, String>,
    },
    /// Generation server: the request completed, or why it failed.
    Done {
        /// The request.
        request: u64,
        /// What it moved.
        result: Result<RequestStats, String>,
    },
    /// Controller: check a completed request's destination bytes with the oracle.
    Verify {
        /// The request.
        request: u64,
        /// The context DP group's slot tables (from [`Message::Submitted`]).
        context: Vec<RankTables>,
    },
    /// The oracle's verdict on a request.
    Verified {
        /// The request.
        request: u64,
        /// The verdict, or why it could not be reached.
        result: Result<VerifySummary, String>,
    },
    /// Controller: free a request's slots.
    Release {
        /// The request.
        request: u64,
    },
    /// The request's slots are free (or quarantined until its writers are done).
    Released {
        /// The request.
        request: u64,
    },
    /// Controller: check that every pool holds only its canary (no request in flight).
    VerifyIdle,
    /// The verdict on the idle pools.
    IdleVerified {
        /// The verdict, or why it could not be reached.
        result: Result<VerifySummary, String>,
    },
    /// Controller: exit the server process.
    Shutdown,
    /// The sender of this message refuses the connection; it closes it next.
    Error {
        /// What was wrong.
        message: String,
    },
    /// Controller (benchmark): write the plans a context server recorded for these requests
    /// again, with a bare put loop on the same endpoints and memory, and time it. The
    /// requests must be complete and still held on both sides. Needs `--record-plans`.
    Bench {
        /// The requests whose plans are replayed.
        requests: Vec<u64>,
    },
    /// The replay's totals and time, or why it failed.
    BenchDone {
        /// The totals, or the reason.
        result: Result<BenchStats, String>,
    },
}

impl Message {
    /// The message's name, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::InstanceInfoRequest => "InstanceInfoRequest",
            Message::InstanceInfo(_) => "InstanceInfo",
            Message::Register(_) => "Register",
            Message::Registered { .. } => "Registered",
            Message::Refused { .. } => "Refused",
            Message::RequestData(_) => "RequestData",
            Message::Completion(_) => "Completion",
            Message::Cancel { .. } => "Cancel",
            Message::Submit(_) => "Submit",
            Message::Submitted { .. } => "Submitted",
            Message::Done { .. } => "Done",
            Message::Verify { .. } => "Verify",
            Message::Verified { .. } => "Verified",
            Message::Release { .. } => "Release",
            Message::Released { .. } => "Released",
            Message::VerifyIdle => "VerifyIdle",
            Message::IdleVerified { .. } => "IdleVerified",
            Message::Shutdown => "Shutdown",
            Message::Error { .. } => "Error",
            Message::Bench { .. } => "Bench",
            Message::BenchDone { .. } => "BenchDone",
        }
    }
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME_BYTES>()
}

/// A header for a body of `len` bytes.
pub fn header(len: usize) -> Result<[u8; HEADER_LEN], WireError> {
    let len32 = u32::try_from(len)
        .ok()
        .filter(|&n| n as usize <= MAX_FRAME_BYTES)
        .ok_or(WireError::Oversized {
            len: len as u64,
            max: MAX_FRAME_BYTES,
        })?;
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[6..].copy_from_slice(&len32.to_le_bytes());
    Ok(h)
}

/// Checks a header; returns the body length it announces.
///
/// # Errors
///
/// A wrong magic, another version, or a length above [`MAX_FRAME_BYTES`].
pub fn parse_header(h: &[u8; HEADER_LEN]) -> Result<usize, WireError> {
    let mut magic = [0u8; 4];
    magic.copy_from_slice(&h[..4]);
    if magic != MAGIC {
        return Err(WireError::BadMagic { found: magic });
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
pub fn encode(message: &Message) -> Result<Vec<u8>, WireError> {
    let body = bincode::serde::encode_to_vec(message, config())
        .map_err(|e| WireError::Encode(e.to_string()))?;
    let mut frame = Vec::with_capacity(HEADER_LEN + body.len());
    frame.extend_from_slice(&header(body.len())?);
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Decodes a frame body (without its header).
///
/// # Errors
///
/// [`WireError::Decode`] for bytes that are not a message, [`WireError::Trailing`] for bytes
/// after it.
pub fn decode_body(body: &[u8]) -> Result<Message, WireError> {
    let (message, used): (Message, usize) = bincode::serde::decode_from_slice(body, config())
        .map_err(|e| WireError::Decode {
            len: body.len(),
            reason: e.to_string(),
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
pub fn write_frame(w: &mut impl Write, message: &Message) -> Result<(), WireError> {
    let frame = encode(message)?;
    w.write_all(&frame)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame and decodes it.
///
/// # Errors
///
/// [`WireError::Closed`] at a clean end of stream before a header, any header or body error,
/// or the read failing (a frame cut short is [`io::ErrorKind::UnexpectedEof`]).
pub fn read_frame(r: &mut impl Read) -> Result<Message, WireError> {
    let mut h = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Err(WireError::Closed),
            Ok(0) => {
                return Err(WireError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("frame header cut short after {got} bytes"),
                )));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    let len = parse_header(&h)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    decode_body(&body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = header(1234).unwrap();
        assert_eq!(parse_header(&h).unwrap(), 1234);
        assert!(matches!(
            header(MAX_FRAME_BYTES + 1),
            Err(WireError::Oversized { .. })
        ));
    }
}
