//! Keeping panics out of C (git2's `panic::wrap`).
//!
//! UCX calls our active-message trampoline from inside `ucp_worker_progress`. A panic must not
//! unwind through UCX's C frames (that aborts at best), so the trampoline runs the Rust closure
//! under `catch_unwind`, stashes the payload here, returns a plain status to UCX, and
//! [`crate::Worker::progress`] resumes the unwind once `ucp_worker_progress` has returned.

use std::any::Any;
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};

/// The first panic payload caught during one call into UCX, waiting to be resumed.
#[derive(Default)]
pub(crate) struct PanicSlot(Cell<Option<Box<dyn Any + Send>>>);

impl PanicSlot {
    /// Runs `f`, catching a panic into the slot (the first one wins; later ones are dropped,
    /// as only one unwind can be resumed). Returns `None` if `f` panicked.
    pub(crate) fn wrap<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        // `AssertUnwindSafe`: whatever `f` leaves half-updated is observed only after the panic
        // has been resumed, exactly as if it had unwound normally (the handler that panicked is
        // also marked poisoned by the caller and never called again).
        match panic::catch_unwind(AssertUnwindSafe(f)) {
            Ok(value) => Some(value),
            Err(payload) => {
                match self.0.take() {
                    None => self.0.set(Some(payload)),
                    Some(first) => {
                        self.0.set(Some(first));
                        // A payload's destructor may itself panic; that must not escape either.
                        let _ = panic::catch_unwind(AssertUnwindSafe(|| drop(payload)));
                    }
                }
                None
            }
        }
    }

    /// Resumes a stashed panic, if any.
    pub(crate) fn resume(&self) {
        if let Some(payload) = self.0.take() {
            panic::resume_unwind(payload);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_first_panic_and_resumes_it() {
        let slot = PanicSlot::default();
        assert_eq!(slot.wrap(|| 3), Some(3));
        slot.resume(); // nothing stashed: no-op
        assert_eq!(slot.wrap(|| panic!("first")), None::<()>);
        assert_eq!(slot.wrap(|| panic!("second")), None::<()>);
        let payload = panic::catch_unwind(AssertUnwindSafe(|| slot.resume())).unwrap_err();
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"first"));
        slot.resume(); // taken: no-op
    }
}
