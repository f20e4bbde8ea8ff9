//! The receiver's per-request state machine: which writers it waits on, which pieces came,
//! when the request is complete, failed, and quiescent.
//!
//! A decode rank asks every prefill rank its planner targets for the request's bytes
//! (one [`RequestData`](crate::RequestData) per (sender, receiver) pair). Each sender answers
//! with one [`Completion`] per piece, in piece order, after that piece's flush; the last
//! piece's completion says `is_last`. A [`RequestTracker`] is fed those completions and
//! answers what they mean:
//!
//! ```text
//!            Ok piece (not the last of every pair)
//!              ┌──────┐
//!              ▼      │
//!   ──────▶ InFlight ─┘ ── every pair's last piece Ok ──▶ Completed
//!              │
//!              └── a Failed piece, or fail() (timeout, cancel, peer lost) ──▶ Failed
//! ```
//!
//! Independently of the outcome, the tracker knows when the request is *quiescent*: every
//! pair reported its last piece (`is_last`, Ok or Failed), so no write of this request can
//! still land in the receiver's slots. Until then the slots must not be reused, even after the
//! request failed.
//!
//! Every completion is checked against what this request expects, because the peer is not
//! trusted: a pair that was never asked, a piece index past the request's piece count, a
//! piece out of order or repeated, a last piece that is not the last index, or anything after
//! a pair's last piece is a [`Violation`]. The caller fails the request on a violation: the
//! bytes of a request whose writer breaks the protocol cannot be vouched for.

use std::collections::BTreeMap;

use crate::{Completion, CompletionStatus};

/// A (sender rank, receiver rank) pair: one writer of a request.
pub type Pair = (u32, u32);

/// What the completions of a request added up to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Bytes the senders report written.
    pub bytes: u64,
    /// Fragments the senders report written.
    pub fragments: u64,
    /// Pieces reported Ok.
    pub pieces: u32,
    /// Pairs whose last piece was reported Ok.
    pub writers: u32,
}

/// Where a tracked request stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Some pair has not reported its last piece Ok, and nothing failed.
    InFlight,
    /// Every pair reported every piece Ok.
    Completed,
    /// A piece failed, the caller failed the request, or a writer broke the protocol.
    Failed,
}

/// A writer's failed piece, as reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PieceFailure {
    /// The writer.
    pub sender: u32,
    /// The receiver rank.
    pub receiver: u32,
    /// The piece.
    pub piece: u32,
    /// The writer's reason.
    pub reason: String,
    /// The writer's engine cancelled the request (not a failure of the write).
    pub cancelled: bool,
}

/// What one completion meant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tracked {
    /// A piece landed; the request still waits on others.
    Progress,
    /// This completion finished the request: every pair's every piece landed.
    Completed(Totals),
    /// This completion failed the request (the first failure; later ones are [`Tracked::Late`]).
    Failed(PieceFailure),
    /// The request had already ended (completed or failed); the completion only counts
    /// toward quiescence.
    Late,
}

/// A completion the request's protocol does not allow.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// The completion names another request.
    #[error("completion for request {found} fed to request {request}")]
    OtherRequest {
        /// The tracked request.
        request: u64,
        /// The request the completion names.
        found: u64,
    },
    /// No such writer was asked for this request.
    #[error(
        "prefill rank {sender} -> decode rank {receiver} was not asked to write request {request}"
    )]
    UnknownPair {
        /// The request.
        request: u64,
        /// The sender the completion names.
        sender: u32,
        /// The receiver the completion names.
        receiver: u32,
    },
    /// The piece index is not one of the request's pieces.
    #[error(
        "request {request}: prefill rank {sender} -> decode rank {receiver} reports piece {piece}, but \
         the request has {pieces} piece(s)"
    )]
    PieceOutOfRange {
        /// The request.
        request: u64,
        /// The writer.
        sender: u32,
        /// The receiver rank.
        receiver: u32,
        /// The piece reported.
        piece: u32,
        /// The request's piece count.
        pieces: u32,
    },
    /// Pieces of a pair must be reported in order, each once.
    #[error(
        "request {request}: prefill rank {sender} -> decode rank {receiver} reports piece {piece} \
         where piece {expected} is next"
    )]
    OutOfOrder {
        /// The request.
        request: u64,
        /// The writer.
        sender: u32,
        /// The receiver rank.
        receiver: u32,
        /// The piece reported.
        piece: u32,
        /// The piece expected next.
        expected: u32,
    },
    /// A successful piece claims to be the last, or the last piece does not say so.
    #[error(
        "request {request}: prefill rank {sender} -> decode rank {receiver} piece {piece} of {pieces} \
         {which}"
    )]
    BadLast {
        /// The request.
        request: u64,
        /// The writer.
        sender: u32,
        /// The receiver rank.
        receiver: u32,
        /// The piece reported.
        piece: u32,
        /// The request's piece count.
        pieces: u32,
        /// `is marked last` or `is not marked last`.
        which: &'static str,
    },
    /// The pair already reported its last piece.
    #[error(
        "request {request}: prefill rank {sender} -> decode rank {receiver} reports piece {piece} after \
         its last"
    )]
    AfterLast {
        /// The request.
        request: u64,
        /// The writer.
        sender: u32,
        /// The receiver rank.
        receiver: u32,
        /// The piece reported.
        piece: u32,
    },
}

#[derive(Clone, Copy, Debug, Default)]
struct PairState {
    /// The next piece index expected.
    next: u32,
    /// The pair reported its last piece (Ok or Failed).
    terminal: bool,
    /// The pair reported every piece Ok.
    finished: bool,
}

/// One request's writers, as its receiver tracks them.
#[derive(Clone, Debug)]
pub struct RequestTracker {
    request: u64,
    /// Pieces per pair, or `None` for a streamed request (chunks until `is_last`).
    pieces: Option<u32>,
    pairs: BTreeMap<Pair, PairState>,
    totals: Totals,
    phase: Phase,
}

impl RequestTracker {
    /// A request sent in `pieces` pieces (at least one) by each of `pairs`. A request no pair
    /// writes is complete (and quiescent) at once.
    pub fn new(request: u64, pieces: u32, pairs: impl IntoIterator<Item = Pair>) -> Self {
        let pairs: BTreeMap<Pair, PairState> = pairs
            .into_iter()
            .map(|p| (p, PairState::default()))
            .collect();
        let phase = if pairs.is_empty() {
            Phase::Completed
        } else {
            Phase::InFlight
        };
        Self {
            request,
            pieces: Some(pieces.max(1)),
            pairs,
            totals: Totals::default(),
            phase,
        }
    }

    /// A request each of `pairs` sends in as many pieces as it likes (chunked prefill as it
    /// happens): pieces come in order from 0, and the one marked `is_last` ends the pair.
    pub fn streaming(request: u64, pairs: impl IntoIterator<Item = Pair>) -> Self {
        Self {
            pieces: None,
            ..Self::new(request, 1, pairs)
        }
    }

    /// The request.
    pub fn request(&self) -> u64 {
        self.request
    }

    /// Where the request stands.
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// What the completions so far added up to.
    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// The writers asked, in order.
    pub fn pairs(&self) -> impl Iterator<Item = Pair> + '_ {
        self.pairs.keys().copied()
    }

    /// How many writers were asked.
    pub fn writers(&self) -> usize {
        self.pairs.len()
    }

    /// Whether `pair` was asked to write.
    pub fn expects(&self, pair: Pair) -> bool {
        self.pairs.contains_key(&pair)
    }

    /// Pairs that have not reported every piece Ok.
    pub fn missing(&self) -> impl Iterator<Item = Pair> + '_ {
        self.pairs
            .iter()
            .filter(|(_, s)| !s.finished)
            .map(|(p, _)| *p)
    }

    /// Pairs that have not reported their last piece: writers that may still write.
    pub fn open_pairs(&self) -> impl Iterator<Item = Pair> + '_ {
        self.pairs
            .iter()
            .filter(|(_, s)| !s.terminal)
            .map(|(p, _)| *p)
    }

    /// Whether no write of this request can still land: every pair reported its last piece.
    /// (A writer whose connection is gone can write no more either; the caller knows that.)
    pub fn quiescent(&self) -> bool {
        self.pairs.values().all(|s| s.terminal)
    }

    /// Fails the request from outside (timeout, cancel, release, peer lost). Returns whether
    /// it was in flight; a completed or failed request stays as it is.
    pub fn fail(&mut self) -> bool {
        if self.phase == Phase::InFlight {
            self.phase = Phase::Failed;
            true
        } else {
            false
        }
    }

    /// Feeds one completion.
    ///
    /// # Errors
    ///
    /// A [`Violation`] when the completion breaks the protocol: the request is then failed
    /// (if it was in flight). The pair's state is left as it was, so the request does not
    /// become quiescent on a writer's word it just broke: only a valid last piece, or the
    /// caller knowing the writer's connection is gone, lets its slots go.
    pub fn on_completion(&mut self, c: &Completion) -> Result<Tracked, Violation> {
        let (request, sender, receiver, piece) =
            (self.request, c.sender_rank, c.receiver_rank, c.piece);
        if c.request != request {
            return Err(Violation::OtherRequest {
                request,
                found: c.request,
            });
        }
        let pieces = self.pieces;
        let Some(state) = self.pairs.get_mut(&(sender, receiver)) else {
            return Err(Violation::UnknownPair {
                request,
                sender,
                receiver,
            });
        };
        let violation = if state.terminal {
            Some(Violation::AfterLast {
                request,
                sender,
                receiver,
                piece,
            })
        } else if let Some(pieces) = pieces.filter(|&n| piece >= n) {
            Some(Violation::PieceOutOfRange {
                request,
                sender,
                receiver,
                piece,
                pieces,
            })
        } else if piece < state.next || (c.status == CompletionStatus::Ok && piece != state.next) {
            // A failed piece may skip ahead (a plan that cannot be made is reported at the
            // piece it failed on, before any piece was written); a successful one may not.
            Some(Violation::OutOfOrder {
                request,
                sender,
                receiver,
                piece,
                expected: state.next,
            })
        } else {
            pieces
                .filter(|&n| c.status == CompletionStatus::Ok && c.is_last != (piece + 1 == n))
                .map(|pieces| Violation::BadLast {
                    request,
                    sender,
                    receiver,
                    piece,
                    pieces,
                    which: if c.is_last {
                        "is marked last"
                    } else {
                        "is not marked last"
                    },
                })
        };
        if let Some(v) = violation {
            if self.phase == Phase::InFlight {
                self.phase = Phase::Failed;
            }
            return Err(v);
        }
        state.next = piece + 1;
        if c.is_last {
            state.terminal = true;
        }
        match &c.status {
            CompletionStatus::Ok => {
                if self.phase != Phase::InFlight {
                    if c.is_last {
                        state.finished = true;
                    }
                    return Ok(Tracked::Late);
                }
                self.totals.bytes = self.totals.bytes.saturating_add(c.bytes);
                self.totals.fragments = self.totals.fragments.saturating_add(c.fragments);
                self.totals.pieces = self.totals.pieces.saturating_add(1);
                if c.is_last {
                    state.finished = true;
                    self.totals.writers += 1;
                }
                if self.pairs.values().all(|s| s.finished) {
                    self.phase = Phase::Completed;
                    Ok(Tracked::Completed(self.totals))
                } else {
                    Ok(Tracked::Progress)
                }
            }
            CompletionStatus::Failed(reason) | CompletionStatus::Cancelled(reason) => {
                if self.phase != Phase::InFlight {
                    return Ok(Tracked::Late);
                }
                self.phase = Phase::Failed;
                Ok(Tracked::Failed(PieceFailure {
                    sender,
                    receiver,
                    piece,
                    reason: reason.clone(),
                    cancelled: matches!(c.status, CompletionStatus::Cancelled(_)),
                }))
            }
        }
    }
}
