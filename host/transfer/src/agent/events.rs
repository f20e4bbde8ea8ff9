//! The agent's event queue, and the file descriptor that wakes an engine's event loop.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Mutex;

use kvferry_platform::EventFd;

pub use kvferry_protocol::FailureKind;
use kvferry_protocol::RequestOutcome;

use crate::outcome::{RequestStats, Stages};

/// What happened to a request. Each request ends in exactly one terminal event per side
/// ([`Event::is_terminal`]); once it is out, kvferry never touches the request's slots again.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// Prefill side: every receiver has the request's bytes; its source slots are the
    /// engine's again.
    Sent {
        /// The request.
        request: u64,
        /// Bytes written to all receivers.
        bytes: u64,
        /// Puts issued for it (bounced pieces take one per MiB of their packed image).
        puts: u64,
        /// Where its time went on this rank (see [`crate::outcome::Stages`]).
        stages: Stages,
    },
    /// Decode side: every expected writer's last piece landed.
    Received {
        /// The request.
        request: u64,
        /// What it moved.
        stats: RequestStats,
    },
    /// The engine's `cancel` took effect: no write reads or lands in its slots any more.
    Cancelled {
        /// The request.
        request: u64,
    },
    /// It failed; no write reads or lands in its slots any more.
    Failed {
        /// The request.
        request: u64,
        /// The peer concerned, if one is (`instance rank N (epoch ...)`).
        peer: Option<String>,
        /// What kind of failure.
        kind: FailureKind,
        /// What happened, in words.
        detail: String,
    },
}

impl Event {
    /// The event of a request's end as its machine reported it: both roles' agents hand
    /// every [`RequestOutcome`] on through this, variant for variant and field for field.
    pub(crate) fn ended(request: u64, outcome: RequestOutcome) -> Event {
        match outcome {
            RequestOutcome::Sent {
                bytes,
                puts,
                stages,
            } => Event::Sent {
                request,
                bytes,
                puts,
                stages,
            },
            RequestOutcome::Received { stats } => Event::Received { request, stats },
            RequestOutcome::Cancelled => Event::Cancelled { request },
            RequestOutcome::Failed { peer, kind, detail } => Event::Failed {
                request,
                peer,
                kind,
                detail,
            },
        }
    }

    /// The request the event is about.
    pub fn request(&self) -> u64 {
        match self {
            Event::Sent { request, .. }
            | Event::Received { request, .. }
            | Event::Cancelled { request }
            | Event::Failed { request, .. } => *request,
        }
    }

    /// Whether the event ends its request (every event so far does).
    pub fn is_terminal(&self) -> bool {
        true
    }
}

/// Every failure kind, in the order of [`AgentStats::failed`].
pub const FAILURE_KINDS: [FailureKind; 10] = [
    FailureKind::Invalid,
    FailureKind::Peer,
    FailureKind::Refused,
    FailureKind::Planner,
    FailureKind::Timeout,
    FailureKind::Lease,
    FailureKind::Protocol,
    FailureKind::Write,
    FailureKind::CancelledByPeer,
    FailureKind::Integrity,
];

/// Buckets of [`AgentStats::latency_us`].
pub const LATENCY_BUCKETS: usize = 28;

/// What an agent did since it started ([`crate::agent::Agent::stats`]): counters over its
/// requests' terminal events, and what it holds now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AgentStats {
    /// Requests that ended `Sent` (prefill side).
    pub sent: u64,
    /// Requests that ended `Received` (decode side).
    pub received: u64,
    /// Requests that ended `Cancelled`.
    pub cancelled: u64,
    /// Requests that ended `Failed`, by kind, in [`FAILURE_KINDS`] order.
    pub failed: [u64; FAILURE_KINDS.len()],
    /// Bytes of the requests that ended well (written by this rank, or into it).
    pub bytes: u64,
    /// Fragments written into this rank (decode side, as its writers reported them).
    pub fragments: u64,
    /// Pieces that landed in this rank (decode side; a chunk or layer-wise send is one).
    pub pieces: u64,
    /// Puts this rank issued (prefill side).
    pub puts: u64,
    /// Nanoseconds this rank spent planning and validating the requests that ended well.
    pub plan_ns: u64,
    /// Nanoseconds its rank thread spent in puts and flushes for them (prefill side).
    pub write_ns: u64,
    /// Requests that ended well by how long they took, in microseconds: bucket `k` counts
    /// those under `2^k` µs (at least `2^(k-1)`), the last one every longer one. Decode
    /// side: from `expect` to `Received`; prefill side: from the claim to `Sent` (the sum
    /// of its stages).
    pub latency_us: [u64; LATENCY_BUCKETS],
    /// The times [`latency_us`](Self::latency_us) counts, added up, in microseconds.
    pub latency_sum_us: u64,
    /// The same requests by the time this rank spent planning and validating them (in
    /// [`plan_ns`](Self::plan_ns)), bucketed as [`latency_us`](Self::latency_us).
    pub plan_us: [u64; LATENCY_BUCKETS],
    /// The same requests by the time they waited for a planner worker or the rank thread,
    /// bucketed as [`latency_us`](Self::latency_us).
    pub queue_us: [u64; LATENCY_BUCKETS],
    /// Nanoseconds the requests that ended well waited (the sum [`queue_us`](Self::queue_us)
    /// buckets).
    pub queue_ns: u64,
    /// Requests held now (not ended).
    pub in_flight: u64,
    /// Vetted peer connections now.
    pub peers: u64,
}

impl AgentStats {
    /// Requests that ended `Failed`, whatever the kind.
    pub fn failed_total(&self) -> u64 {
        self.failed.iter().sum()
    }

    /// The count of `Failed` requests of `kind`.
    pub fn failed_of(&self, kind: FailureKind) -> u64 {
        FAILURE_KINDS
            .iter()
            .position(|k| *k == kind)
            .map_or(0, |i| self.failed[i])
    }

    /// Counts a request that ended well: its time, and where its planning and queueing went.
    fn ended_well(&mut self, latency_us: u64, stages: &Stages) {
        fn bucket(us: u64) -> usize {
            ((u64::BITS - us.leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
        }
        let plan_ns = stages.plan_ns + stages.validate_ns;
        self.latency_us[bucket(latency_us)] += 1;
        self.latency_sum_us += latency_us;
        self.plan_us[bucket(plan_ns / 1000)] += 1;
        self.plan_ns += plan_ns;
        self.queue_us[bucket(stages.queue_ns / 1000)] += 1;
        self.queue_ns += stages.queue_ns;
    }

    fn count(&mut self, event: &Event) {
        match event {
            Event::Sent {
                bytes,
                puts,
                stages,
                ..
            } => {
                self.ended_well(stages.total_ns() / 1000, stages);
                self.sent += 1;
                self.bytes += bytes;
                self.puts += puts;
                self.write_ns += stages.puts_ns + stages.flush_ns;
            }
            Event::Received { stats, .. } => {
                self.ended_well(stats.latency_us, &stats.stages);
                self.received += 1;
                self.bytes += stats.bytes;
                self.fragments += stats.fragments;
                self.pieces += u64::from(stats.pieces);
            }
            Event::Cancelled { .. } => self.cancelled += 1,
            Event::Failed { kind, .. } => {
                if let Some(i) = FAILURE_KINDS.iter().position(|k| k == kind) {
                    self.failed[i] += 1;
                }
            }
        }
    }
}

/// A queue of events with an eventfd that is readable while events wait, and the counters
/// of every event pushed.
#[derive(Debug)]
pub(crate) struct Events {
    queue: Mutex<VecDeque<Event>>,
    stats: Mutex<AgentStats>,
    fd: EventFd,
}

impl Events {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Self {
            queue: Mutex::new(VecDeque::new()),
            stats: Mutex::new(AgentStats::default()),
            fd: EventFd::new()?,
        })
    }

    pub(crate) fn push(&self, event: Event) {
        tracing::debug!(request = event.request(), event = ?event, "event");
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .count(&event);
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(event);
        self.fd.signal();
    }

    pub(crate) fn rewake(&self) {
        self.fd.signal();
    }

    pub(crate) fn drain(&self) -> Vec<Event> {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        self.fd.clear();
        queue.drain(..).collect()
    }

    /// The counters so far (`in_flight` and `peers` are the caller's to fill in).
    pub(crate) fn stats(&self) -> AgentStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_outcome_becomes_the_event_of_the_same_name_with_the_same_fields() {
        let stages = Stages {
            plan_ns: 1,
            puts_ns: 2,
            flush_ns: 3,
            ..Stages::default()
        };
        let stats = RequestStats {
            bytes: 10,
            fragments: 2,
            writers: 1,
            pieces: 1,
            latency_us: 50,
            puts: 0,
            stages,
        };
        let cases = [
            (
                RequestOutcome::Sent {
                    bytes: 10,
                    puts: 4,
                    stages,
                },
                Event::Sent {
                    request: 7,
                    bytes: 10,
                    puts: 4,
                    stages,
                },
            ),
            (
                RequestOutcome::Received {
                    stats: stats.clone(),
                },
                Event::Received { request: 7, stats },
            ),
            (RequestOutcome::Cancelled, Event::Cancelled { request: 7 }),
            (
                RequestOutcome::Failed {
                    peer: Some("d0 rank 1".into()),
                    kind: FailureKind::Integrity,
                    detail: "a digest differs".into(),
                },
                Event::Failed {
                    request: 7,
                    peer: Some("d0 rank 1".into()),
                    kind: FailureKind::Integrity,
                    detail: "a digest differs".into(),
                },
            ),
            (
                RequestOutcome::Failed {
                    peer: None,
                    kind: FailureKind::Timeout,
                    detail: String::new(),
                },
                Event::Failed {
                    request: 7,
                    peer: None,
                    kind: FailureKind::Timeout,
                    detail: String::new(),
                },
            ),
        ];
        for (outcome, event) in cases {
            assert_eq!(Event::ended(7, outcome), event);
        }
    }
}
