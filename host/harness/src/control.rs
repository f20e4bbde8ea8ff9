//! The control protocol between a test or benchmark controller (`kvferry demo`, `kvferry
//! bench`, the tests) and a `kvferry serve` process: its own message family
//! ([`ControlMessage`], magic `KVFC`) on its own listener, bound to loopback unless told
//! otherwise. It drives what an engine would do around its agents — allocate slots, prefill
//! and `send`, `expect`, release — plus what only a test does: fill and check bytes with the
//! oracle, replay plans for the bench, shut the server down. None of it reaches the agents'
//! peer protocol.
//!
//! A server answers for the ranks it serves (all of its instance, or one with `serve
//! --rank N`): a `Submit` for a DP group none of its ranks belongs to is answered at once
//! with no tables (context) or an empty `Done` (generation), so a controller may send every
//! message to every server of a side and merge the answers.
//!
//! A request belongs to the control connection that submitted it (its `Submit` made a record
//! here): every other message naming it — `Release`, `Cancel`, `Verify`, `Stats`, `Bench`,
//! `Fragments`, `Memcpy`, `Tables`, a second `Submit` of its id — is refused on any other connection,
//! naming the request and saying it belongs to another controller; in the message's own
//! answer where it has a result, as [`ControlMessage::Refused`] for `Release` and `Cancel`.
//! The refusal leaves the request and both connections as they were. A request outlives the
//! connection that submitted it and stays its own: no other connection takes it over. A
//! request no record here holds (not submitted here, or released) belongs to nobody:
//! `Release` answers `Released`, `Cancel` nothing, the others as before.
//!
//! | message | to | answer |
//! |---|---|---|
//! | [`ControlMessage::InfoRequest`] | either | [`ControlMessage::Info`] |
//! | [`ControlMessage::Submit`] | context, then generation | [`ControlMessage::Submitted`] (context) or [`ControlMessage::Done`] (generation) |
//! | [`ControlMessage::Verify`] | generation | [`ControlMessage::Verified`] |
//! | [`ControlMessage::Tables`] | generation | [`ControlMessage::TablesDone`] |
//! | [`ControlMessage::Release`] | either | [`ControlMessage::Released`], or [`ControlMessage::Refused`] (another controller's) |
//! | [`ControlMessage::Cancel`] | generation | none (the request's `Done` reports it), or [`ControlMessage::Refused`] (another controller's) |
//! | [`ControlMessage::VerifyIdle`] | generation | [`ControlMessage::IdleVerified`] |
//! | [`ControlMessage::Bench`] | context | [`ControlMessage::BenchDone`] |
//! | [`ControlMessage::Fragments`] | context | [`ControlMessage::FragmentsDone`] |
//! | [`ControlMessage::Stats`] | context | [`ControlMessage::StatsDone`] |
//! | [`ControlMessage::Memcpy`] | context | [`ControlMessage::MemcpyDone`] |
//! | [`ControlMessage::Shutdown`] | either | the server process exits |
//! | [`ControlMessage::Error`] | server → controller | the connection closes |

use kvferry_planner_abi::{RankInfo, SlotTable, TokenRange};
use kvferry_protocol::{Frame, Role};
use kvferry_transfer::RequestStats;
use kvferry_transfer::harness::{BenchStats, PairFragments};
use serde::{Deserialize, Serialize};

/// A request, as the controller submits it to both servers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Submit {
    /// Request id, unique per controller run.
    pub request: u64,
    /// Prompt length in tokens.
    pub prompt_len: u64,
    /// The prefill DP group serving it.
    pub ctx_dp_rank: u32,
    /// The decode DP group receiving it.
    pub gen_dp_rank: u32,
    /// Sender-side chunks (block-aligned); `None` sends the prompt in one piece.
    pub chunks: Option<Vec<TokenRange>>,
    /// Layer-wise sends: each chunk goes in this many sends, each carrying the next run of
    /// the prefill rank's views (page-table order); 0 or 1 sends every view at once.
    pub layer_parts: u32,
    /// Prompt tokens the receiver already holds.
    pub cached: u64,
    /// Decode side only: the prefill instance that sends it.
    pub peer: Option<PeerRef>,
}

/// A prefill instance as a decode server reaches it: its name and the side-channel
/// endpoints of its ranks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerRef {
    /// The instance's name.
    pub instance: String,
    /// Its ranks' agent endpoints (`host:port`), any order.
    pub endpoints: Vec<String>,
}

/// What a server is and which ranks it serves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// The instance's name.
    pub instance: String,
    /// Context or generation.
    pub role: Role,
    /// The bound planner's id.
    pub planner_id: String,
    /// Its library version.
    pub planner_version: String,
    /// Model and deployment (e.g. `deepseek-v3 fp8 tpb32 dep2`).
    pub label: String,
    /// Ranks of the whole instance.
    pub world: u32,
    /// The ranks this server runs an agent for, in rank order.
    pub ranks: Vec<ServedRank>,
}

/// One rank a server runs an agent for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServedRank {
    /// Its description, with its pools' real addresses.
    pub info: RankInfo,
    /// A prefill rank's side-channel endpoint.
    pub endpoint: Option<String>,
}

/// The slot tables of one rank for one request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankTables {
    /// The rank.
    pub rank: u32,
    /// Its description (what the oracle needs to model its bytes).
    pub info: RankInfo,
    /// One table per layer group.
    pub tables: Vec<SlotTable>,
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

impl VerifySummary {
    /// A verdict with nothing checked yet: ok until a part says otherwise.
    pub fn clean() -> Self {
        VerifySummary {
            ok: true,
            ..VerifySummary::default()
        }
    }

    /// Adds another server's verdict on its part: ok only if both are, counts add up, the
    /// report text of a failed part is kept.
    pub fn merge(&mut self, other: &VerifySummary) {
        self.ok &= other.ok;
        self.bytes_checked += other.bytes_checked;
        self.bytes_covered += other.bytes_covered;
        self.mismatched_bytes += other.mismatched_bytes;
        if !other.ok {
            self.detail.push_str(&other.detail);
        }
    }
}

/// One control message.
///
/// New messages are appended, so the encoding of the others does not change.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ControlMessage {
    /// Asks a server what it holds.
    InfoRequest,
    /// What the server is and serves.
    Info(ServerInfo),
    /// Run a request.
    Submit(Submit),
    /// Prefill server: the request is prefilled (slots allocated and filled), or why not.
    Submitted {
        /// The request.
        request: u64,
        /// The prefill DP group's slot tables.
        result: Result<Vec<RankTables>, String>,
    },
    /// Decode server: the request completed, or why it failed.
    Done {
        /// The request.
        request: u64,
        /// What it moved.
        result: Result<RequestStats, String>,
    },
    /// Check a completed request's destination bytes with the oracle.
    Verify {
        /// The request.
        request: u64,
        /// The prefill DP group's slot tables (from [`ControlMessage::Submitted`]).
        context: Vec<RankTables>,
    },
    /// Send the slot tables a completed request landed in, per rank served here (with the
    /// rank's description): what another transfer layer, planning the same request with
    /// kvferry's plans, writes to (`kvferry bench --export-workload`).
    Tables {
        /// The request.
        request: u64,
    },
    /// A request's destination slot tables, or why not.
    TablesDone {
        /// The request.
        request: u64,
        /// Per rank served here that holds it.
        result: Result<Vec<RankTables>, String>,
    },
    /// The oracle's verdict on a request.
    Verified {
        /// The request.
        request: u64,
        /// The verdict, or why it could not be reached.
        result: Result<VerifySummary, String>,
    },
    /// Let go of a request: its slots are free once kvferry lets go of them (they may be
    /// already: a prefill server frees them once every rank here ended the request, unless
    /// its plans are recorded for a replay; a decode server once it failed on every rank
    /// here), and its record (statistics, verdict) is gone.
    Release {
        /// The request.
        request: u64,
    },
    /// The request's slots are free (or quarantined until its writers are done).
    Released {
        /// The request.
        request: u64,
    },
    /// Abandon a request in flight.
    Cancel {
        /// The request.
        request: u64,
        /// Why.
        reason: String,
    },
    /// Check that every pool holds only its canary (no request in flight).
    VerifyIdle,
    /// The verdict on the idle pools.
    IdleVerified {
        /// The verdict, or why it could not be reached.
        result: Result<VerifySummary, String>,
    },
    /// Exit the server process.
    Shutdown,
    /// Write the plans a prefill server recorded for these requests again with a bare put
    /// loop on the same endpoints and memory, and time it. The requests must be complete and
    /// still held on both sides. Needs `--record-plans`.
    Bench {
        /// The requests whose plans are replayed.
        requests: Vec<u64>,
    },
    /// The replay's totals and time, or why it failed.
    BenchDone {
        /// The totals, or the reason.
        result: Result<BenchStats, String>,
    },
    /// The server refuses the connection; it closes it next.
    Error {
        /// What was wrong.
        message: String,
    },
    /// Send the fragments of the plans a prefill server recorded for these requests, per
    /// (prefill rank, decode rank) pair and relative to each side's pools: what
    /// [`ControlMessage::Bench`] would put (`kvferry bench --export-fragments`). Needs
    /// `--record-plans`.
    Fragments {
        /// The requests whose plans are exported.
        requests: Vec<u64>,
    },
    /// The recorded fragments, or why not (also when they would not fit one frame).
    FragmentsDone {
        /// The pairs, or the reason.
        result: Result<Vec<PairFragments>, String>,
    },
    /// Send the prefill side's statistics of these requests (bytes sent and the stages of
    /// its ranks, [`kvferry_transfer::Stages`]) once every rank here has ended them. A
    /// request not held here (another DP group's, or released) counts nothing; one another
    /// controller submitted refuses the whole answer.
    Stats {
        /// The requests.
        requests: Vec<u64>,
    },
    /// The statistics, one per request in the order asked, or why not.
    StatsDone {
        /// Per request, or the reason.
        result: Result<Vec<RequestStats>, String>,
    },
    /// Copy the fragments a prefill server recorded for these requests with `memcpy`
    /// between host buffers shaped like both sides' pools, in the server's process, one
    /// thread per prefill rank, and time it (`kvferry_transfer::harness::copy`; `kvferry bench`'s
    /// memcpy baseline). Needs `--record-plans`.
    Memcpy {
        /// The requests whose fragments are copied.
        requests: Vec<u64>,
    },
    /// The copy's totals and time (the copies in `stages.copy_ns`), or why it failed.
    MemcpyDone {
        /// The totals, or the reason.
        result: Result<BenchStats, String>,
    },
    /// The answer to a [`ControlMessage::Release`] or [`ControlMessage::Cancel`] of a request
    /// another control connection submitted: nothing was done, and this connection stays
    /// open.
    Refused {
        /// The request.
        request: u64,
        /// Why (it names the request and says it belongs to another controller).
        message: String,
    },
}

impl Frame for ControlMessage {
    const MAGIC: [u8; 4] = *b"KVFC";
    const FAMILY: &'static str = "control";

    fn kind(&self) -> &'static str {
        match self {
            ControlMessage::InfoRequest => "InfoRequest",
            ControlMessage::Info(_) => "Info",
            ControlMessage::Submit(_) => "Submit",
            ControlMessage::Submitted { .. } => "Submitted",
            ControlMessage::Done { .. } => "Done",
            ControlMessage::Verify { .. } => "Verify",
            ControlMessage::Verified { .. } => "Verified",
            ControlMessage::Tables { .. } => "Tables",
            ControlMessage::TablesDone { .. } => "TablesDone",
            ControlMessage::Release { .. } => "Release",
            ControlMessage::Released { .. } => "Released",
            ControlMessage::Cancel { .. } => "Cancel",
            ControlMessage::VerifyIdle => "VerifyIdle",
            ControlMessage::IdleVerified { .. } => "IdleVerified",
            ControlMessage::Shutdown => "Shutdown",
            ControlMessage::Bench { .. } => "Bench",
            ControlMessage::BenchDone { .. } => "BenchDone",
            ControlMessage::Error { .. } => "Error",
            ControlMessage::Fragments { .. } => "Fragments",
            ControlMessage::FragmentsDone { .. } => "FragmentsDone",
            ControlMessage::Stats { .. } => "Stats",
            ControlMessage::StatsDone { .. } => "StatsDone",
            ControlMessage::Memcpy { .. } => "Memcpy",
            ControlMessage::MemcpyDone { .. } => "MemcpyDone",
            ControlMessage::Refused { .. } => "Refused",
        }
    }

    fn error_text(&self) -> Option<&str> {
        match self {
            ControlMessage::Error { message } => Some(message),
            _ => None,
        }
    }
}
