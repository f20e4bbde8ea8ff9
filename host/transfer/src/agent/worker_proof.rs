//! Worker proofs: a decode rank shows that the UCX worker it declared is its own before
//! a prefill rank writes to it.
//!
//! Without the proof, a peer holding the deployment's secret could declare another process's
//! worker address and keys and have the prefill rank put wherever it names in that process
//! (over tcp the keys cannot be checked against what they map). So a prefill rank, once it
//! has connected to the declared worker, sends it a fresh random challenge as a UCX active
//! message ([`WORKER_CHALLENGE_AM`]), tagged for the session
//! ([`worker_challenge_tag`]: a hash of the handshake hash), and asks the peer on the
//! session ([`AgentMessage::ProveWorker`](kvferry_protocol::AgentMessage::ProveWorker)) to
//! send the challenge back. Only the process that owns the worker saw it; it answers only the
//! challenge tagged for the session it is asked on, so another process's worker cannot be
//! made to answer for the peer, even through a session the peer holds with that process.
//! Nothing is written to a worker before its proof.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

pub(crate) use kvferry_protocol::agent::{
    WORKER_CHALLENGE_AM, WORKER_CHALLENGE_LEN, worker_challenge_tag,
};

use super::lock;

/// Challenges a decode rank's worker keeps at most (the oldest go first).
const KEPT: usize = 1024;

/// A challenge's active-message payload: the session's tag, then the random bytes.
pub(crate) const PAYLOAD_LEN: usize = 32 + WORKER_CHALLENGE_LEN;

/// The challenges a decode rank's worker received, by session tag.
#[derive(Debug, Default)]
pub(crate) struct Challenges {
    recent: Mutex<VecDeque<([u8; 32], [u8; WORKER_CHALLENGE_LEN])>>,
    arrived: Condvar,
}

impl Challenges {
    /// Keeps a challenge that arrived at the worker (its active-message payload); anything
    /// not of a challenge's size is dropped.
    pub(crate) fn record(&self, payload: &[u8]) {
        if payload.len() != PAYLOAD_LEN {
            return;
        }
        let (tag, challenge) = payload.split_at(32);
        let mut t = [0u8; 32];
        t.copy_from_slice(tag);
        let mut c = [0u8; WORKER_CHALLENGE_LEN];
        c.copy_from_slice(challenge);
        let mut recent = lock(&self.recent);
        if recent.len() >= KEPT {
            recent.pop_front();
        }
        recent.push_back((t, c));
        self.arrived.notify_all();
    }

    /// The challenge tagged `tag`, waiting for it until `deadline` (the active message may
    /// come after the request on the session); taken, so it answers once.
    pub(crate) fn take(
        &self,
        tag: &[u8; 32],
        deadline: Instant,
    ) -> Option<[u8; WORKER_CHALLENGE_LEN]> {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(i) = recent.iter().position(|(t, _)| t == tag) {
                return recent.remove(i).map(|(_, c)| c);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            recent = self
                .arrived
                .wait_timeout(recent, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// A fresh challenge for the session bound by `binding`: its random bytes and the active
/// message's payload.
pub(crate) fn new_challenge(
    binding: &[u8; 32],
) -> std::io::Result<([u8; WORKER_CHALLENGE_LEN], Vec<u8>)> {
    let mut c = [0u8; WORKER_CHALLENGE_LEN];
    getrandom::getrandom(&mut c).map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut payload = worker_challenge_tag(binding).to_vec();
    payload.extend_from_slice(&c);
    Ok((c, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_challenge_answers_only_its_own_session_and_only_once() {
        let store = Challenges::default();
        let (c, payload) = new_challenge(&[1; 32]).unwrap();
        store.record(&payload);
        store.record(&payload[..10]);
        let soon = Instant::now() + Duration::from_millis(20);
        assert_eq!(store.take(&worker_challenge_tag(&[2; 32]), soon), None);
        let soon = Instant::now() + Duration::from_millis(20);
        assert_eq!(store.take(&worker_challenge_tag(&[1; 32]), soon), Some(c));
        let soon = Instant::now() + Duration::from_millis(20);
        assert_eq!(store.take(&worker_challenge_tag(&[1; 32]), soon), None);
    }
}
