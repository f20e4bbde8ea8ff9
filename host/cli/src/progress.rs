//! Progress on standard error for the commands that run longer than a second (`conform`,
//! `plan`, `demo`, `bench`): a spinner with what is going on and, where there is one, a count.
//! Shown only when standard error is a terminal and the command prints text: never into a
//! pipe, a log file or `--json` output.

use std::io::IsTerminal as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a shown spinner redraws.
const TICK: Duration = Duration::from_millis(120);

/// A spinner, or nothing when progress is not shown.
#[derive(Debug)]
pub struct Progress {
    bar: Option<ProgressBar>,
    /// For a spinner that shows only after a delay ([`spinner_after`](Self::spinner_after)):
    /// set once it is finished, so the delayed start never draws a finished spinner.
    finished: Option<Arc<Mutex<bool>>>,
}

impl Progress {
    /// A spinner saying `message`, when `wanted` (the command prints text) and standard error
    /// is a terminal; it ticks on its own until [`finish`](Self::finish).
    pub fn spinner(wanted: bool, message: impl Into<String>) -> Progress {
        let Some(bar) = new_bar(wanted, message, ProgressDrawTarget::stderr()) else {
            return Progress::none();
        };
        bar.enable_steady_tick(TICK);
        Progress {
            bar: Some(bar),
            finished: None,
        }
    }

    /// [`spinner`](Self::spinner), drawn only once `after` has passed without a
    /// [`finish`](Self::finish): a command that ends sooner leaves the terminal as it was.
    pub fn spinner_after(wanted: bool, after: Duration, message: impl Into<String>) -> Progress {
        let Some(bar) = new_bar(wanted, message, ProgressDrawTarget::hidden()) else {
            return Progress::none();
        };
        let finished = Arc::new(Mutex::new(false));
        let (gate, late) = (Arc::clone(&finished), bar.downgrade());
        // Without the thread the spinner is never shown, which costs nothing but the display.
        let _ = std::thread::Builder::new()
            .name("progress".into())
            .spawn(move || {
                std::thread::sleep(after);
                let done = gate.lock().unwrap_or_else(|e| e.into_inner());
                if let (false, Some(bar)) = (*done, late.upgrade()) {
                    bar.set_draw_target(ProgressDrawTarget::stderr());
                    bar.enable_steady_tick(TICK);
                }
            });
        Progress {
            bar: Some(bar),
            finished: Some(finished),
        }
    }

    fn none() -> Progress {
        Progress {
            bar: None,
            finished: None,
        }
    }

    /// Says `message` from now on.
    pub fn set_message(&self, message: impl Into<String>) {
        if let Some(bar) = &self.bar {
            bar.set_message(message.into());
        }
    }

    /// Prints `line` above the spinner (or plainly, on standard output, without one).
    pub fn println(&self, line: impl AsRef<str>) {
        match &self.bar {
            Some(bar) => bar.suspend(|| println!("{}", line.as_ref())),
            None => println!("{}", line.as_ref()),
        }
    }

    /// Removes the spinner.
    pub fn finish(self) {
        let done = self
            .finished
            .as_ref()
            .map(|f| f.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        if let Some(mut done) = done {
            *done = true;
        }
    }
}

/// A spinner saying `message` into `target`, when `wanted` and standard error is a terminal.
fn new_bar(
    wanted: bool,
    message: impl Into<String>,
    target: ProgressDrawTarget,
) -> Option<ProgressBar> {
    if !wanted || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::with_draw_target(None, target);
    let style = ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    bar.set_style(style);
    bar.set_message(message.into());
    Some(bar)
}
