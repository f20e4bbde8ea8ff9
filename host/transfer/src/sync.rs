//! The agent's state locks: poison-tolerant, and logged when waited for or held long.
//!
//! Every role's state, the bounce arena and the device copier's stream pool are taken through
//! [`lock`], so a stall anywhere on a rank shows up in the log with where the lock was taken.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A role's state lock held or waited for this long is logged (with where it was taken):
/// every side-channel reader, the reaper's keep-alives and the planner pool queue behind it,
/// so a long hold is a stall of every request on this rank.
pub(crate) const SLOW_LOCK: Duration = Duration::from_secs(1);

/// Takes a role's state lock (a poisoned lock is taken as it is: its state stays consistent
/// between statements). Waits and holds longer than [`SLOW_LOCK`] are logged.
#[track_caller]
pub(crate) fn lock<T>(m: &Mutex<T>) -> Locked<'_, T> {
    let at = std::panic::Location::caller();
    let guard = match m.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => {
            let asked = Instant::now();
            let g = m.lock().unwrap_or_else(|e| e.into_inner());
            let waited = asked.elapsed();
            if waited >= SLOW_LOCK {
                tracing::warn!(
                    waited_ms = waited.as_millis() as u64,
                    at = %at,
                    "waited long for the agent's state lock"
                );
            }
            g
        }
    };
    Locked {
        guard,
        at,
        since: Instant::now(),
    }
}

/// A held role state lock (see [`lock`]).
pub(crate) struct Locked<'a, T> {
    guard: MutexGuard<'a, T>,
    at: &'static std::panic::Location<'static>,
    since: Instant,
}

impl<T> std::ops::Deref for Locked<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> std::ops::DerefMut for Locked<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for Locked<'_, T> {
    fn drop(&mut self) {
        let held = self.since.elapsed();
        if held >= SLOW_LOCK {
            tracing::warn!(
                held_ms = held.as_millis() as u64,
                at = %self.at,
                "held the agent's state lock long"
            );
        }
    }
}
