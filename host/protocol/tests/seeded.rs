//! What the seeded simulations of the request machines share: a small deterministic
//! generator, the seeds a run tries, and the run itself — each seed's steps then its finish,
//! the seed and its last logged steps printed when an invariant fails, and the outcomes
//! tallied so a run that stops reaching some way a request ends fails too.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// splitmix64: small, fast, and the same on every machine.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// Outcomes seen over a run, by kind.
pub type Tally = BTreeMap<String, u32>;

/// One seed's world.
pub trait Simulated {
    /// One step, drawn from the seed.
    fn step(&mut self);
    /// Runs what is left to its end and checks the end state.
    fn finish(&mut self);
    /// What happened, a line per event.
    fn log(&self) -> &[String];
    /// Adds this seed's outcomes, by kind.
    fn tally(&self, tally: &mut Tally);
}

/// Runs `steps` steps then the finish of each seed of this run (`KVFERRY_SIM_SEED`, default
/// 0, and `KVFERRY_SIM_SEEDS`, default 10,000, so a failure names the seed to rerun alone);
/// with 1,000 seeds or more, every kind in `kinds` must have been reached.
pub fn run<S: Simulated>(make: impl Fn(u64) -> S, steps: usize, kinds: &[&str]) {
    let var = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (first, count) = (var("KVFERRY_SIM_SEED", 0), var("KVFERRY_SIM_SEEDS", 10_000));
    let mut tally = Tally::new();
    for seed in first..first + count {
        let mut sim = make(seed);
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for _ in 0..steps {
                sim.step();
            }
            sim.finish();
        }));
        if let Err(e) = ran {
            eprintln!("seed {seed} failed; the last steps:");
            let log = sim.log();
            for line in &log[log.len().saturating_sub(60)..] {
                eprintln!("  {line}");
            }
            std::panic::resume_unwind(e);
        }
        sim.tally(&mut tally);
    }
    eprintln!("outcomes over {count} seeds: {tally:?}");
    if count >= 1000 {
        // The run reached every way a request ends, or it proves less than it says.
        for kind in kinds {
            assert!(
                tally.contains_key(*kind),
                "no request ended as {kind}: {tally:?}"
            );
        }
    }
}

/// A driver's timer sleeps until the deadline it last read, or the machine's horizon at most:
/// no handler may make a deadline it would miss. `at`: when the step began; `before` and
/// `after`: the machine's `poll_timeout` around it.
pub fn check_horizon(
    at: Instant,
    horizon: Duration,
    before: Option<Instant>,
    after: Option<Instant>,
) {
    let bound = before.map_or(at + horizon, |b| b.min(at + horizon));
    if let Some(after) = after {
        assert!(
            after >= bound,
            "a new deadline {:?} after the step's start, inside the horizon {horizon:?} (the \
             earliest before the step: {:?} after it)",
            after.saturating_duration_since(at),
            before.map(|b| b.saturating_duration_since(at)),
        );
    }
}
