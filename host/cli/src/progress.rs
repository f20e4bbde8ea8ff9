//! Progress on standard error for the commands that run longer than a second (`conform`,
//! `plan`, `demo`, `bench`): a spinner with what is going on and, where there is one, a count.
//! Shown only when standard error is a terminal and the command prints text: never into a
//! pipe, a log file or `--json` output.

use std::io::IsTerminal as _;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A spinner, or nothing when progress is not shown.
#[derive(Debug)]
pub struct Progress(Option<ProgressBar>);

impl Progress {
    /// A spinner saying `message`, when `wanted` (the command prints text) and standard error
    /// is a terminal; it ticks on its own until [`finish`](Self::finish).
    pub fn spinner(wanted: bool, message: impl Into<String>) -> Progress {
        if !wanted || !std::io::stderr().is_terminal() {
            return Progress(None);
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        let style = ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
        bar.set_style(style);
        bar.set_message(message.into());
        bar.enable_steady_tick(Duration::from_millis(120));
        Progress(Some(bar))
    }

    /// Says `message` from now on.
    pub fn set_message(&self, message: impl Into<String>) {
        if let Some(bar) = &self.0 {
            bar.set_message(message.into());
        }
    }

    /// Prints `line` above the spinner (or plainly, on standard output, without one).
    pub fn println(&self, line: impl AsRef<str>) {
        match &self.0 {
            Some(bar) => bar.suspend(|| println!("{}", line.as_ref())),
            None => println!("{}", line.as_ref()),
        }
    }

    /// Removes the spinner.
    pub fn finish(self) {
        if let Some(bar) = self.0 {
            bar.finish_and_clear();
        }
    }
}
