/*!
Safe UCX (UCP) for kvferry: contexts, workers, endpoints, one-sided puts and active messages.

This is the only crate that calls into `ucx-sys`; nothing else in the workspace names it. Every
UCX object has one owning type whose `Drop` releases it, and handles that keep their parent
alive (`Rc` for the thread-bound ones, `Arc` for the context) encode the destruction order UCX
needs, whatever order the values are dropped in; only source bytes are borrowed:

```text
Arc<Context> ◄─┬─ Worker ◄── Endpoint ◄── RemoteKey
               │    ▲            ▲            ▲
               │    │            └─ Request<'a>, PutWindow<'a> ─┘ (a put's key)
               │    │                 └─ 'a: borrows its source bytes
               │    └─ progress(), active-message handlers
               └─ MemRegion (ucp_mem_map)
```

An arrow points at what a value keeps alive: a remote key keeps its endpoint open (so
`ucp_rkey_destroy` runs before `ucp_ep_close_nbx`), an endpoint keeps the UCX worker (so it is
closed before `ucp_worker_destroy`), and a request or window keeps what its operations use.
So endpoints and keys may outlive the `Worker` value that made them, and a long-lived owner can
keep them in plain maps and drop them whenever it is done with a peer.

Regions map host memory, or device memory of a [`MemoryType`] the context supports
([`Context::memory_types`], [`MemRegion::register_with_memory_type`]).

# Typical use

```no_run
use std::sync::Arc;
use kvferry_ucx::{Context, MemRegion, PutWindow, Worker};

# fn main() -> Result<(), kvferry_ucx::Error> {
let ctx = Context::builder().tls("posix,sysv,self").build()?;
// Target side: UCX-allocated memory is the one-sided shared-memory fast path.
let target_worker = Worker::new(&ctx)?;
let target = MemRegion::allocate(&ctx, 1 << 20)?;
let (address, rkey, base) = (target_worker.address()?, target.pack_rkey()?, target.remote_addr());

// Initiator side (normally another process; the three values travel out of band).
let worker = Worker::new(&ctx)?;
let ep = worker.connect(&address)?;
let rkey = ep.unpack_rkey(rkey.as_bytes())?;
let src = vec![7u8; 1 << 20];
let mut window = PutWindow::new(&ep);
for (i, chunk) in src.chunks(64 << 10).enumerate() {
    window.put(chunk, base + (i * (64 << 10)) as u64, &rkey)?;
}
window.finish()?; // every put done and flushed: remotely visible
# Ok(())
# }
```

# Progress

Nothing happens unless a worker is progressed ([`Worker::progress`]); [`Request::wait`] and
[`PutWindow`] progress the initiator's worker for you. The **target** worker must be progressed
too, by its own thread or loop: wire-up always needs it, and so do puts into registered (rather
than UCX-allocated) memory and every put over `tcp`, which UCX emulates with active messages.

# Threads

A [`Context`] is `Send + Sync` and shared through `Arc`. Workers run in
`UCS_THREAD_MODE_SERIALIZED` (one thread at a time), so a [`Worker`] and every handle sharing
its UCX worker (endpoints, remote keys, requests, put windows) are neither `Send` nor `Sync`:
they stay on one thread. To move a worker to the thread that progresses it, move it before
connecting anything: [`Worker::into_send`] gives a [`SendWorker`] (`Send`; only the last handle
on a worker converts), and [`SendWorker::into_worker`] takes it back on the other side.

# Trust

Worker addresses and packed remote keys are parsed by UCX without a length. An address must be
bytes produced by a peer's [`Worker::address`], delivered intact (only its version byte is
checked). A packed remote key is checked before UCX sees it ([`rkey_format`]): one that is
truncated, has bytes left over, or whose md map, entry sizes, memory type or distance list
disagree with its length or with the loaded UCX's layout is refused with a [`KeyFormatError`]
naming the field, instead of being read past its end.

A key that passes that check has a sound container, not sound contents: each transport reads
its own part without a size and believes it. A peer that forges one can still
- make a transport read past its entry (a size byte smaller than the transport's struct): it
  reads the zero padding [`Endpoint::unpack_rkey`] adds, not the heap beyond;
- stop the process where UCX is built with assertions: Debian's 1.13.1 aborts on a `posix` key
  whose length is 0 (`mm_posix.c:360`, measured by the `rkey_fuzz` test's forged mode);
- at unpack, make `posix` open and map a file of its choice that this user can open (any
  `/proc/<pid>/fd/<fd>`, any `shm_open` name, with a length of its choice), `sysv` attach any
  segment this user can, and `cuda_ipc` import another process's handle;
- over shared memory (and `gdr_copy`), choose where puts through the key land in this process:
  the key carries the owner's address, which UCX subtracts. [`RemoteKey::check_range`] only
  confines a declared range to one shared, writable mapping of this process: a forged owner
  address can aim it at another one, such as this process's own UCX-allocated pools.

A peer is trusted anyway: holding a remote key, it can write the memory the key describes.

The addresses a peer says its keys cover are not trusted: UCX translates any address through a
shared-memory key, inside its segment or not, and this process copies the put there.
[`RemoteKey::check_range`] checks a declared range before anything is put through the key.
*/

#![deny(missing_docs)]

mod callback;
mod context;
mod endpoint;
mod ffi;
pub mod library;
mod memory;
mod memtype;
mod request;
pub mod rkey_format;
pub mod shm_owner;
mod status;
mod window;
mod worker;

use std::ffi::CStr;

pub use context::{Context, ContextBuilder};
pub use endpoint::{AmProto, Endpoint, ErrorMode, RangeCheck, RemoteKey};
pub use memory::{MemRegion, PackedRkey};
pub use memtype::{MemoryType, MemoryTypes};
pub use request::Request;
pub use rkey_format::{KeyFormatError, KeyLayout};
pub use shm_owner::{OwnerError, PeerProcess};
pub use status::{Error, Op, Status};
pub use window::PutWindow;
pub use worker::{NAP, SPIN_BEFORE_YIELD, SendWorker, Worker, YIELDS_BEFORE_NAP};

/// The version of the loaded UCX library, e.g. `"1.22.0"` ([`library`] says which file).
#[doc(alias = "ucp_get_version_string")]
pub fn version() -> &'static str {
    // SAFETY: `ucp_get_version_string` takes no arguments and returns a pointer to a static,
    // NUL-terminated string literal inside the (never unloaded) library.
    let version = unsafe { CStr::from_ptr(ucx_sys::ucp_get_version_string()) };
    version.to_str().unwrap_or("unknown")
}

/// Compile-time checks of the thread-safety claims in the crate docs.
///
/// ```compile_fail
/// fn sync<T: Sync>() {}
/// sync::<kvferry_ucx::Worker>(); // a worker is progressed by one thread at a time
/// ```
///
/// ```compile_fail
/// fn send<T: Send>() {}
/// send::<kvferry_ucx::Worker>(); // endpoints may share it: move it through `into_send`
/// ```
///
/// ```compile_fail
/// fn send<T: Send>() {}
/// send::<kvferry_ucx::Endpoint>(); // endpoints stay with their worker's thread
/// ```
///
/// ```compile_fail
/// fn send<T: Send>() {}
/// send::<kvferry_ucx::RemoteKey>();
/// ```
///
/// ```compile_fail
/// fn send<T: Send>() {}
/// send::<kvferry_ucx::Request<'static>>();
/// ```
///
/// ```compile_fail
/// fn send<T: Send>() {}
/// send::<kvferry_ucx::PutWindow<'static>>();
/// ```
///
/// ```compile_fail
/// fn sync<T: Sync>() {}
/// sync::<kvferry_ucx::SendWorker>(); // movable, never shared
/// ```
///
/// ```compile_fail
/// # use kvferry_ucx::{Endpoint, RemoteKey};
/// fn put_then_free(ep: &Endpoint, rkey: &RemoteKey) {
///     let src = vec![1u8; 64];
///     let req = ep.put(&src, 0, rkey).unwrap();
///     drop(src); // error: `src` is borrowed by the in-flight put
///     req.wait().unwrap();
/// }
/// ```
///
/// The same code with the request finished first compiles:
///
/// ```
/// # use kvferry_ucx::{Endpoint, RemoteKey};
/// fn put_then_free(ep: &Endpoint, rkey: &RemoteKey) {
///     let src = vec![1u8; 64];
///     let req = ep.put(&src, 0, rkey).unwrap();
///     req.wait().unwrap();
///     drop(src);
/// }
/// // Requests and windows borrow only their sources: the endpoint and key may go first.
/// fn outlive(ep: kvferry_ucx::Endpoint, rkey: kvferry_ucx::RemoteKey, src: &[u8]) {
///     let req = ep.put(src, 0, &rkey).unwrap();
///     drop(rkey);
///     drop(ep);
///     req.wait().unwrap();
/// }
/// fn send<T: Send>() {}
/// fn sync<T: Send + Sync>() {}
/// send::<kvferry_ucx::SendWorker>();
/// sync::<kvferry_ucx::Context>();
/// sync::<kvferry_ucx::MemRegion>();
/// ```
#[cfg(doctest)]
pub struct ThreadSafetyDocTests;
