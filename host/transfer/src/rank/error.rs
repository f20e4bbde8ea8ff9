//! Why a rank thread's job failed, or why the thread could not start.

use kvferry_ucx::{Endpoint, ErrorMode, Op, Status};

use super::RemoteRank;
use crate::memory::BindError;

/// Why a job did not complete.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// No endpoint to the peer rank.
    #[error("cannot connect to {instance} rank {rank}")]
    Connect {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// A peer pool's remote key could not be unpacked.
    #[error("cannot unpack the remote key of {instance} rank {rank} pool {pool}")]
    UnpackKey {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// A peer pool's declared range is not what its remote key maps, so nothing is ever
    /// put through that key: over shared memory this process copies each put to the
    /// address UCX translates, and UCX translates any address (see
    /// [`kvferry_ucx::RemoteKey::check_range`]).
    #[error("{instance} rank {rank} declares pool {pool} at {base:#x} +{len}, but {reason}")]
    KeyRange {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// The pool.
        pool: usize,
        /// Its declared base.
        base: u64,
        /// Its declared length.
        len: u64,
        /// Why the range is refused.
        reason: &'static str,
        /// UCX's refusal (none where the CUDA driver refused a device range).
        #[source]
        source: Option<kvferry_ucx::Error>,
    },
    /// The peer's worker address or a pool's key names memory that is not the peer's own:
    /// a shared-memory key of another process, or its transports naming two processes
    /// ([`kvferry_ucx::PeerProcess`]); or a key that maps memory of this rank itself.
    #[error("{instance} rank {rank}{}: {reason}", pool_of(.pool))]
    KeyOwner {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// The pool whose key is refused (`None`: the worker address is).
        pool: Option<usize>,
        /// Why.
        reason: String,
    },
    /// A fragment's source is not inside one local pool.
    #[error(
        "fragment {fragment}: source {address:#x} +{len} is not inside one pool of rank {rank}"
    )]
    SourceOutside {
        /// Index of the fragment.
        fragment: usize,
        /// This rank.
        rank: u32,
        /// Source address.
        address: u64,
        /// Length.
        len: u64,
    },
    /// A fragment's destination is not inside one pool of the peer (or straddles two).
    #[error(
        "fragment {fragment}: destination {address:#x} +{len} is not inside one pool of \
         {instance} rank {rank}"
    )]
    DestinationOutside {
        /// Index of the fragment.
        fragment: usize,
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// Destination address.
        address: u64,
        /// Length.
        len: u64,
    },
    /// A put failed to start or complete.
    #[error("put to {instance} rank {rank} failed")]
    Put {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// The flush after the puts failed.
    #[error("flush to {instance} rank {rank} failed")]
    Flush {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// The job's deadline passed while its puts or flush were in flight.
    #[error(
        "writing to {instance} rank {rank} timed out after {waited_ms} ms waiting for its \
         {waiting} ({in_flight} operations still in flight are quarantined)"
    )]
    TimedOut {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// What the job was waiting for: `puts` or `flush`.
        waiting: &'static str,
        /// How long the job had run.
        waited_ms: u128,
        /// Operations (puts, and a flush) left in flight.
        in_flight: usize,
    },
    /// An earlier job to the peer rank gave up with operations in flight that have not
    /// finished yet.
    #[error(
        "{instance} rank {rank} has {in_flight} operations of an earlier job stuck in flight \
         for {stuck_ms} ms; not writing to it until they finish"
    )]
    Stuck {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// Operations still in flight.
        in_flight: usize,
        /// Since when (milliseconds ago) they are quarantined.
        stuck_ms: u128,
    },
    /// UCX reported the peer failed (its endpoint's error handler ran, or an operation failed
    /// with a peer-failure status): the receiver died or is unreachable. Only endpoints in
    /// [`ErrorMode::Peer`] report this.
    #[error("{instance} rank {rank} failed in UCX: {status}")]
    PeerFailed {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
        /// What UCX's error handler reported (else the failed operation's status).
        status: Status,
        /// The operation that failed, if one did (none when the job found the endpoint
        /// already failed).
        #[source]
        source: Option<kvferry_ucx::Error>,
    },
    /// The peer's registration ended (its control connection closed).
    #[error("{instance} rank {rank} is gone")]
    PeerGone {
        /// Peer instance.
        instance: String,
        /// Peer rank.
        rank: u32,
    },
    /// Gathering a bounced piece into the staging buffer failed (a device copy the CUDA
    /// driver refused): the piece fails as a failed put does.
    #[error("rank {rank}: gathering a bounced piece failed: {detail}")]
    Gather {
        /// The rank.
        rank: u32,
        /// The driver's error, with its causes.
        detail: String,
    },
    /// The rank thread is gone.
    #[error("rank {rank} thread has stopped")]
    Stopped {
        /// The rank.
        rank: u32,
    },
}

/// Why a rank thread could not start.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The worker address could not be read.
    #[error("rank {rank}: cannot read the worker address")]
    Address {
        /// The rank.
        rank: u32,
        /// UCX's error.
        source: kvferry_ucx::Error,
    },
    /// The worker already has endpoints (or other handles), so it cannot move to the thread.
    #[error("rank {rank}: its UCX worker is already in use, so it cannot move to its thread")]
    Shared {
        /// The rank.
        rank: u32,
    },
    /// The OS refused the eventfd that wakes the thread for its commands.
    #[error("rank {rank}: cannot create its thread's wake-up descriptor")]
    Wake {
        /// The rank.
        rank: u32,
        /// The OS error.
        source: std::io::Error,
    },
    /// The OS refused a thread.
    #[error("rank {rank}: cannot spawn its thread")]
    Thread {
        /// The rank.
        rank: u32,
        /// The OS error.
        source: std::io::Error,
    },
    /// The thread could not make its device pools' CUDA context current, so it ended.
    #[error("rank {rank}: its thread cannot serve device pools")]
    Bind {
        /// The rank.
        rank: u32,
        /// The device and the driver's error.
        source: BindError,
    },
    /// The thread ended before it reported that it started.
    #[error(
        "rank {rank}: its thread ended before it started{}",
        if *panicked { " (it panicked)" } else { "" }
    )]
    Died {
        /// The rank.
        rank: u32,
        /// Whether it panicked.
        panicked: bool,
    },
}

/// " declares pool N", for a [`WriteError::KeyOwner`] about one pool.
pub(in crate::rank) fn pool_of(pool: &Option<usize>) -> String {
    pool.map_or_else(String::new, |p| format!(" declares pool {p}, but"))
}

/// What a window that timed out with `e` was waiting for.
pub(in crate::rank) fn waiting_for(e: &kvferry_ucx::Error) -> &'static str {
    if e.op() == Op::Flush { "flush" } else { "puts" }
}

pub(in crate::rank) fn gone(dest: &RemoteRank) -> WriteError {
    WriteError::PeerGone {
        instance: dest.instance.clone(),
        rank: dest.rank,
    }
}

pub(in crate::rank) fn peer_failed(
    dest: &RemoteRank,
    status: Status,
    source: Option<kvferry_ucx::Error>,
) -> WriteError {
    WriteError::PeerFailed {
        instance: dest.instance.clone(),
        rank: dest.rank,
        status,
        source,
    }
}

/// Whether `status` says the peer or the link to it failed (a connection reset, an endpoint
/// timeout, UCX's link and endpoint failure ranges).
pub(in crate::rank) fn is_peer_failure(status: Status) -> bool {
    matches!(
        status,
        Status::CONNECTION_RESET | Status::NOT_CONNECTED | Status::ENDPOINT_TIMEOUT
    ) || (-89..=-40).contains(&status.code())
}

/// The job's error for UCX's `source` on `ep`: [`WriteError::PeerFailed`] if the endpoint
/// reports a failure (or, in peer mode, the operation failed with a peer-failure status,
/// should the handler not have run yet), else a put or flush error.
pub(in crate::rank) fn ucx_error(
    dest: &RemoteRank,
    ep: &Endpoint,
    source: kvferry_ucx::Error,
) -> WriteError {
    let failure = ep.failure().or_else(|| {
        (ep.error_mode() == ErrorMode::Peer && is_peer_failure(source.status()))
            .then(|| source.status())
    });
    if let Some(status) = failure {
        return peer_failed(dest, status, Some(source));
    }
    if source.op() == Op::Flush {
        WriteError::Flush {
            instance: dest.instance.clone(),
            rank: dest.rank,
            source,
        }
    } else {
        WriteError::Put {
            instance: dest.instance.clone(),
            rank: dest.rank,
            source,
        }
    }
}
