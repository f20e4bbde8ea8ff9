//! What a prefill rank keeps of `RequestData` that arrived before its request was sent
//! (the decode side may ask first), and of cancels and ends it must remember for a while:
//! bounded in bytes, and expired by age.
//!
//! The bytes come from a peer, so the stash must not grow without bound however many ids a
//! peer invents: past [`Stash::limit`] bytes a new entry is refused (the caller fails that
//! piece at once, so the receiver hears of it instead of waiting for its timeout), and every
//! push first drops entries older than the time to live.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::RequestData;

/// The bytes a `RequestData` holds, as the stash counts them: its slot ids, its excluded
/// views, its receiver's name and a fixed overhead.
pub fn request_data_bytes(data: &RequestData) -> usize {
    const OVERHEAD: usize = 128;
    let slots: usize = data.slot_tables.iter().map(|t| t.slots.len() * 8).sum();
    OVERHEAD + slots + data.excluded_views.len() * 8 + data.receiver_instance.len()
}

#[derive(Debug)]
struct Entry<T> {
    item: T,
    bytes: usize,
    at: Instant,
}

/// Items waiting for their request, by request id.
#[derive(Debug)]
pub struct Stash<T> {
    by_request: HashMap<u64, Vec<Entry<T>>>,
    bytes: usize,
    limit: usize,
    ttl: Duration,
}

impl<T> Stash<T> {
    /// A stash holding at most `limit` bytes, each entry for at most `ttl`.
    pub fn new(limit: usize, ttl: Duration) -> Self {
        Self {
            by_request: HashMap::new(),
            bytes: 0,
            limit,
            ttl,
        }
    }

    /// The byte limit.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// When the oldest entry arrived, if any (its expiry is the stash's next deadline).
    pub fn oldest(&self) -> Option<Instant> {
        self.by_request.values().flatten().map(|e| e.at).min()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.by_request.is_empty()
    }

    /// Keeps `item` (of `bytes`) for `request`, after dropping expired entries; gives it
    /// back if it does not fit.
    pub fn push(&mut self, request: u64, item: T, bytes: usize, now: Instant) -> Result<(), T> {
        let ttl = self.ttl;
        self.retain(|_, at| now.saturating_duration_since(at) < ttl);
        if self.bytes.saturating_add(bytes) > self.limit {
            return Err(item);
        }
        self.bytes += bytes;
        self.by_request.entry(request).or_default().push(Entry {
            item,
            bytes,
            at: now,
        });
        Ok(())
    }

    /// Everything kept for `request`, in arrival order.
    pub fn take(&mut self, request: u64) -> Vec<T> {
        let entries = self.by_request.remove(&request).unwrap_or_default();
        self.bytes -= entries.iter().map(|e| e.bytes).sum::<usize>();
        entries.into_iter().map(|e| e.item).collect()
    }

    /// The first entry of `request` for which `pick` holds.
    pub fn find(&self, request: u64, mut pick: impl FnMut(&T) -> bool) -> Option<&T> {
        self.by_request
            .get(&request)?
            .iter()
            .map(|e| &e.item)
            .find(|item| pick(item))
    }

    /// Keeps the entries of `request` for which `keep` holds.
    pub fn retain_request(&mut self, request: u64, mut keep: impl FnMut(&T) -> bool) {
        if let Some(entries) = self.by_request.get_mut(&request) {
            let before: usize = entries.iter().map(|e| e.bytes).sum();
            entries.retain(|e| keep(&e.item));
            let after: usize = entries.iter().map(|e| e.bytes).sum();
            self.bytes -= before - after;
            if entries.is_empty() {
                self.by_request.remove(&request);
            }
        }
    }

    /// Keeps the entries for which `keep(item, arrival)` holds, across every request.
    pub fn retain(&mut self, mut keep: impl FnMut(&T, Instant) -> bool) {
        let mut dropped = 0;
        self.by_request.retain(|_, entries| {
            entries.retain(|e| {
                let kept = keep(&e.item, e.at);
                if !kept {
                    dropped += e.bytes;
                }
                kept
            });
            !entries.is_empty()
        });
        self.bytes -= dropped;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_in_bytes_and_counted_back_down() {
        let t0 = Instant::now();
        let mut stash = Stash::new(100, Duration::from_secs(60));
        assert!(stash.push(1, "a", 60, t0).is_ok());
        assert_eq!(stash.push(2, "b", 50, t0), Err("b"), "60 + 50 > 100");
        assert!(stash.push(1, "c", 40, t0).is_ok());
        assert_eq!(stash.bytes(), 100);
        assert_eq!(stash.take(1), ["a", "c"]);
        assert_eq!(stash.bytes(), 0);
        assert!(stash.take(1).is_empty());
    }

    #[test]
    fn expired_entries_make_room() {
        let t0 = Instant::now();
        let mut stash = Stash::new(100, Duration::from_secs(10));
        stash.push(1, "old", 90, t0).unwrap();
        assert_eq!(
            stash.push(2, "new", 20, t0 + Duration::from_secs(5)),
            Err("new")
        );
        stash
            .push(2, "new", 20, t0 + Duration::from_secs(11))
            .unwrap();
        assert!(stash.take(1).is_empty(), "expired");
        assert_eq!(stash.bytes(), 20);
    }

    #[test]
    fn retain_counts_what_it_drops() {
        let t0 = Instant::now();
        let mut stash = Stash::new(1000, Duration::from_secs(60));
        for (request, peer) in [(1, 'x'), (1, 'y'), (2, 'x')] {
            stash.push(request, peer, 10, t0).unwrap();
        }
        stash.retain_request(1, |p| *p != 'x');
        assert_eq!(stash.bytes(), 20);
        stash.retain(|p, _| *p != 'x');
        assert_eq!(stash.bytes(), 10);
        assert_eq!(stash.take(1), ['y']);
        assert!(stash.take(2).is_empty());
    }

    #[test]
    fn a_request_data_is_counted_by_its_slots() {
        let data = RequestData {
            request: 1,
            receiver_instance: "gen".into(),
            receiver_rank: 0,
            sender_rank: 0,
            slot_tables: vec![kvferry_planner_abi::SlotTable::new(0..1000)],
            token_range: kvferry_planner_abi::TokenRange { start: 0, end: 1 },
            prompt_len: 1,
            dst_start_token: None,
            excluded_views: vec![],
            bounce: None,
            integrity: None,
        };
        assert_eq!(request_data_bytes(&data), 128 + 8000 + 3);
    }
}
