//! The reaper's alarm clock. The reaper sleeps until the earliest deadline it knows of (the
//! request machine's `poll_timeout`, the planner watchdog's, the next keep-alive), and at most
//! the machine's horizon or [`MAX_SLEEP`]. No handler makes a deadline sooner than the horizon
//! after it runs (the machines say so, and their simulations check it), so nothing the
//! drivers do needs to wake it; the cap bounds how late it sees what nothing announces (a
//! registration the rank thread ended, a planner call past its deadline). A deadline still
//! due after its turn (a late-write wait polling for a quiet worker) is looked at again after
//! [`DUE_AGAIN`], the fixed tick the reaper had before. Stopping the agent rings it.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The longest the reaper sleeps.
pub(crate) const MAX_SLEEP: Duration = Duration::from_millis(100);
/// How soon the reaper looks again at a deadline its turn left due.
pub(crate) const DUE_AGAIN: Duration = Duration::from_millis(20);

/// The reaper's alarm: shared by the reaper thread (which must not hold the agent while it
/// sleeps) and the agent's drivers.
#[derive(Debug, Default)]
pub(crate) struct Alarm {
    /// Rung since the reaper last slept (or while it was awake).
    rung: Mutex<bool>,
    bell: Condvar,
}

impl Alarm {
    /// When the reaper should next wake, `now` being the end of its turn, `next` the
    /// earliest deadline it knows of and `horizon` its machine's.
    pub(crate) fn wake_time(now: Instant, next: Option<Instant>, horizon: Duration) -> Instant {
        let cap = now + horizon.clamp(DUE_AGAIN, MAX_SLEEP);
        match next {
            Some(at) if at > now => at.min(cap),
            Some(_) => now + DUE_AGAIN,
            None => cap,
        }
    }

    /// Sleeps until `until`, or until rung (a ring while the reaper was awake counts, so a
    /// stop is not lost between its check and its sleep).
    pub(crate) fn sleep_until(&self, until: Instant) {
        let mut rung = self.rung.lock().unwrap_or_else(|e| e.into_inner());
        while !*rung {
            let now = Instant::now();
            if now >= until {
                break;
            }
            rung = self
                .bell
                .wait_timeout(rung, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *rung = false;
    }

    /// Wakes the reaper now (the agent stops).
    pub(crate) fn ring(&self) {
        *self.rung.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.bell.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::thread;

    use super::*;

    #[test]
    fn wake_time_keeps_deadlines_within_the_cap() {
        let now = Instant::now();
        let hour = Duration::from_secs(3600);
        let soon = now + Duration::from_millis(5);
        assert_eq!(Alarm::wake_time(now, Some(soon), hour), soon);
        let late = now + Duration::from_secs(30);
        assert_eq!(Alarm::wake_time(now, Some(late), hour), now + MAX_SLEEP);
        assert_eq!(Alarm::wake_time(now, None, hour), now + MAX_SLEEP);
        // A short horizon (a short lease or timeout) shortens the sleep, to the old tick at
        // least.
        let short = Duration::from_millis(50);
        assert_eq!(Alarm::wake_time(now, None, short), now + short);
        assert_eq!(Alarm::wake_time(now, None, Duration::ZERO), now + DUE_AGAIN);
        // A deadline its turn left due is looked at again shortly, not in a busy loop.
        assert_eq!(Alarm::wake_time(now, Some(now), hour), now + DUE_AGAIN);
    }

    #[test]
    fn a_ring_wakes_the_sleeper_and_one_while_awake_is_not_lost() {
        let alarm = Arc::new(Alarm::default());
        let sleeper = {
            let alarm = Arc::clone(&alarm);
            thread::spawn(move || {
                let asleep = Instant::now();
                alarm.sleep_until(asleep + Duration::from_secs(60));
                asleep.elapsed()
            })
        };
        // Most likely asleep by then; rung before it sleeps, it does not sleep at all.
        thread::sleep(Duration::from_millis(20));
        alarm.ring();
        assert!(sleeper.join().unwrap() < Duration::from_secs(60));
        // Rung while awake: the next sleep ends at once, and the ring is spent.
        alarm.ring();
        let asleep = Instant::now();
        alarm.sleep_until(asleep + Duration::from_secs(60));
        assert!(asleep.elapsed() < Duration::from_secs(60));
        let asleep = Instant::now();
        alarm.sleep_until(asleep + Duration::from_millis(30));
        assert!(asleep.elapsed() >= Duration::from_millis(30));
    }
}
