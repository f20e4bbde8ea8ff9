//! What a request moved, and the callback that hands its slots back.

use serde::{Deserialize, Serialize};

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

/// What a context server's bare replay of recorded plans moved, and how long it took
/// ([`crate::ContextServer::replay`]).
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

/// Called once kvferry will never touch a request's slots again (no write reads or lands in
/// them any more): the caller may reuse them. It may run on a kvferry thread with internal
/// locks held: it must not call back into the server; hand the news to a channel.
pub type OnFree = Box<dyn FnOnce() + Send>;
