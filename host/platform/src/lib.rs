//! kvferry-platform: what kvferry asks of the operating system, beneath safe interfaces. As
//! quinn-udp holds quinn's socket calls, this crate holds the system calls of the host crates
//! (`kvferry-ucx`, `kvferry-transfer`, the `kvferry` facade, `kvferry-harness`), each `unsafe` block with a
//! `// SAFETY:` comment, so that no caller needs one to:
//!
//! - [`EventFd`]: a counter descriptor that is readable while it is non-zero (an agent's
//!   wake-up descriptor, which engines poll beside their own);
//! - [`wait_readable`], [`wait_any_readable`]: poll one descriptor, or a few, with a timeout
//!   to the nanosecond (a rank thread sleeps on its command descriptor and its UCX worker's;
//!   a UCX worker waiting on its own puts naps 100 µs on its descriptor);
//! - [`first_interface_address`]: the first non-loopback address of an interface that is up
//!   (what an agent advertises when it listens on every interface);
//! - [`send_now`]: what a blocking socket takes without waiting (a connection's outbox writes
//!   a message at once from the thread that sends it when nothing is queued before it);
//! - [`object_file_of`]: the file the object holding an address was loaded from (where an
//!   installed library finds its planners);
//! - [`HostBudget`]: the host memory this process may still allocate;
//! - [`sysv_segment_creator`]: the process that created a System V shared-memory segment (a
//!   peer's `sysv` key is accepted only when its segment is the peer's own).
//!
//! UCX's calls are `kvferry-ucx`'s, and the memory an engine lends an agent (registered with
//! UCX, read and written at checked offsets) is `kvferry-transfer`'s: those calls carry the
//! engine's promise about its memory, which only the transfer layer can check.

#![deny(missing_docs)]

mod budget;
mod dl;
mod eventfd;
mod net;
mod poll;
mod shm;
pub mod units;

pub use budget::HostBudget;
pub use dl::object_file_of;
pub use eventfd::EventFd;
pub use net::{first_interface_address, send_now};
pub use poll::{MAX_WAIT_FDS, wait_any_readable, wait_readable};
pub use shm::sysv_segment_creator;
