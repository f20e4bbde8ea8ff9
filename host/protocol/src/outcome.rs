//! How a request ended and where its time went: what the request machines report
//! ([`RequestOutcome`]) and the agents hand on to their engines.

use serde::{Deserialize, Serialize};

/// How a request ended on a rank: the one terminal outcome the request machines report
/// (`Action::Ended` of [`crate::prefill`] and [`crate::decode`]), which the agent hands on
/// to its engine as the event of the same name. A prefill rank's requests end `Sent`,
/// `Cancelled` or `Failed`; a decode rank's `Received`, `Cancelled` or `Failed`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    /// Prefill side: every expected receiver has its bytes.
    Sent {
        /// Bytes written to all receivers.
        bytes: u64,
        /// Puts issued for it.
        puts: u64,
        /// Where the time of its claims that ended well went.
        stages: Stages,
    },
    /// Decode side: every writer's last piece landed, and their bytes match this rank's own
    /// plan.
    Received {
        /// What it moved.
        stats: RequestStats,
    },
    /// The engine cancelled it.
    Cancelled,
    /// It failed.
    Failed {
        /// The peer it failed with, if one.
        peer: Option<String>,
        /// Why, in a word.
        kind: FailureKind,
        /// Why, in a sentence.
        detail: String,
    },
}

/// Why a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::Display, strum::AsRefStr)]
#[strum(serialize_all = "kebab-case")]
#[non_exhaustive]
pub enum FailureKind {
    /// The request's own parameters are wrong (slots outside the pool, a token range outside
    /// the prompt, a chunk out of order).
    Invalid,
    /// A peer is unreachable, or its connection ended or went silent.
    Peer,
    /// A peer was refused (secret, planner, `check_peer`), or it refused this rank.
    Refused,
    /// The planner failed or did not return within its deadline.
    Planner,
    /// Not every writer reported in time.
    Timeout,
    /// A `send` nobody claimed within the lease.
    Lease,
    /// A peer broke the protocol (completions out of order, byte counts that disagree).
    Protocol,
    /// Writing failed (UCX, a key that does not cover its pool, a quarantined peer).
    Write,
    /// The peer cancelled it.
    CancelledByPeer,
    /// A piece's bytes in this rank's slots do not match its writer's digest
    /// (the decode agent's integrity setting).
    Integrity,
}

/// Where one request's time went, in nanoseconds per stage, measured with a few monotonic
/// clock reads per piece (never per fragment) on the agents that took part, and summed over
/// the (prefill rank, decode rank) pairs that write it: pairs run at once, so the sum can
/// exceed the request's wall time.
///
/// Prefill side, per pair and piece: `plan` (describing both sides' rows and the planner's
/// `pair`), `validate` (`kvferry_plan::validate`, coalescing included), `puts` (issuing the
/// puts on the rank thread, waits for a full window included), `flush` (waiting for the
/// endpoint flush), `queue` (waiting for a planner worker and for the rank thread, where
/// requests in flight at once line up) and `control`: the rest of the time from the claim
/// to the completion — the claim and the planner's `targets`, connecting the endpoint, the
/// completion message. Decode side, per rank: `control` also counts the time from
/// `expect` until its claims are out and from the last completion to `Received`. What the
/// messages spend between the processes is in no stage. `gather` (prefill side: the rank
/// thread waiting for its gather thread) and `scatter` (decode side) are the bounce
/// path's, 0 for pieces that go fragment by fragment. `copy` is the memcpy baseline's copying
/// (`kvferry bench`), 0 on the agent path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stages {
    /// The planner's `pair`, with describing both sides' rows.
    pub plan_ns: u64,
    /// Validation and coalescing of the plan.
    pub validate_ns: u64,
    /// Waiting for the gather of bounced pieces into the staging buffer.
    pub gather_ns: u64,
    /// Issuing the puts.
    pub puts_ns: u64,
    /// Waiting for the flush that completes them.
    pub flush_ns: u64,
    /// Scattering bounced pieces from the arena into the slots, and (receiver) checking the
    /// pieces' integrity digests.
    pub scatter_ns: u64,
    /// Sender: computing the pieces' integrity digests its receivers asked for.
    pub digest_ns: u64,
    /// Side-channel work: claims, `targets`, connects, completions, `expect` to claim.
    pub control_ns: u64,
    /// Waiting for a planner worker or for the rank thread.
    pub queue_ns: u64,
    /// memcpy of the fragments (the bench's memcpy baseline only).
    pub copy_ns: u64,
}

impl Stages {
    /// Adds `other`, stage by stage.
    pub fn merge(&mut self, other: &Stages) {
        self.plan_ns += other.plan_ns;
        self.validate_ns += other.validate_ns;
        self.gather_ns += other.gather_ns;
        self.puts_ns += other.puts_ns;
        self.flush_ns += other.flush_ns;
        self.scatter_ns += other.scatter_ns;
        self.digest_ns += other.digest_ns;
        self.control_ns += other.control_ns;
        self.queue_ns += other.queue_ns;
        self.copy_ns += other.copy_ns;
    }

    /// Every stage added up.
    pub fn total_ns(&self) -> u64 {
        self.plan_ns
            + self.validate_ns
            + self.gather_ns
            + self.puts_ns
            + self.flush_ns
            + self.scatter_ns
            + self.digest_ns
            + self.control_ns
            + self.queue_ns
            + self.copy_ns
    }
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
    /// From the decode server's first `RequestData` to the last completion.
    pub latency_us: u64,
    /// Puts issued for it (prefill side; 0 on the decode side, which issues none): one
    /// per fragment and MiB, or per MiB of packed image for bounced pieces.
    pub puts: u64,
    /// Where the request's time went, summed over the ranks that report it.
    pub stages: Stages,
}

impl RequestStats {
    /// Adds another rank's part of the same request: counts and stages add up, the latency
    /// is the longest.
    pub fn merge(&mut self, other: &RequestStats) {
        self.bytes += other.bytes;
        self.fragments += other.fragments;
        self.writers += other.writers;
        self.pieces += other.pieces;
        self.latency_us = self.latency_us.max(other.latency_us);
        self.puts += other.puts;
        self.stages.merge(&other.stages);
    }
}
