//! The oracle on UCX pools: fill a request's source slots, prime destination slots with the
//! canary, check a request's destination slots, check idle pools.
//!
//! Every oracle call of the transfer code goes through this module. The oracle reads and
//! writes whole slots through [`PoolMemory`]; `UcxPools` implements it over a rank's UCX
//! regions (host pools directly, device pools through their CUDA copies, see
//! [`RankPools::read`]), and every call here is scoped to the slots its request owns
//! ([`Extent::RequestSlots`]), so bytes of other requests in flight are never touched or
//! judged.

use std::cell::RefCell;

use kvferry_planner_abi::{PairRequest, RankInfo, SlotTable, ViewId};

use kvferry_plan::RequestSide;
use kvferry_testkit::oracle::{
    Delivery, Extent, MemoryError, Oracle, OracleError, PoolMemory, VerifyReport,
};
use kvferry_transfer::harness::memory::{CopyError, RankPools};

/// Why the oracle could not fill or check UCX pools.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The oracle refused the geometry or the slot tables, or a slot lies outside its pool.
    #[error(transparent)]
    Oracle(#[from] OracleError),
    /// A device pool could not be copied to or from.
    #[error(transparent)]
    Copy(#[from] CopyError),
}

/// One receiver rank of a request, for [`verify_request`].
#[derive(Clone, Copy, Debug)]
pub struct ReceiverPart<'a> {
    /// The rank.
    pub info: &'a RankInfo,
    /// Its pools.
    pub pools: &'a RankPools,
    /// Its slot tables for the request.
    pub tables: &'a [SlotTable],
    /// Views it excluded.
    pub excluded: &'a [ViewId],
}

/// Oracle access to the UCX pools of some ranks of this process.
///
/// Reads copy out of the regions; writes copy in. Writes are only sound while the host owns
/// the slots written (see the memory module's slot ownership): the constructors that allow
/// writing are `unsafe` for that reason.
///
/// A failed device copy stops the oracle (as an unreadable range) and is kept in `failure`;
/// [`UcxPools::finish`] reports it instead of the oracle's error.
struct UcxPools<'a> {
    ranks: Vec<&'a RankPools>,
    writable: bool,
    failure: RefCell<Option<CopyError>>,
}

impl<'a> UcxPools<'a> {
    /// Read-only access.
    fn reading(ranks: Vec<&'a RankPools>) -> Self {
        Self {
            ranks,
            writable: false,
            failure: RefCell::new(None),
        }
    }

    /// Read-write access.
    ///
    /// # Safety
    ///
    /// For as long as the value lives, the host owns every slot the oracle will write through
    /// it: no local put reads those bytes and no peer writes them.
    unsafe fn writing(ranks: Vec<&'a RankPools>) -> Self {
        Self {
            ranks,
            writable: true,
            failure: RefCell::new(None),
        }
    }

    fn locate(&self, address: u64, len: u64) -> Result<(&'a RankPools, usize, usize), MemoryError> {
        self.ranks
            .iter()
            .find_map(|r| r.locate(address, len).map(|(p, off)| (*r, p, off)))
            .ok_or(MemoryError::Unmapped { address, len })
    }

    /// Keeps a failed copy for [`finish`](Self::finish); the oracle sees an unreadable range.
    fn failed(&self, error: CopyError) -> MemoryError {
        let pool = format!("rank {} pool {}", error.rank, error.pool);
        self.failure.borrow_mut().get_or_insert(error);
        MemoryError::NotBacked { pool }
    }

    /// The oracle's result, or the device copy that stopped it.
    fn finish<T>(self, result: Result<T, OracleError>) -> Result<T, VerifyError> {
        match self.failure.into_inner() {
            Some(error) => Err(VerifyError::Copy(error)),
            None => Ok(result?),
        }
    }
}

impl PoolMemory for UcxPools<'_> {
    fn read(&self, address: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        let (rank, pool, offset) = self.locate(address, out.len() as u64)?;
        rank.read(pool, offset, out).map_err(|e| self.failed(e))
    }

    fn write(&mut self, address: u64, data: &[u8]) -> Result<(), MemoryError> {
        let (rank, pool, offset) = self.locate(address, data.len() as u64)?;
        assert!(
            self.writable,
            "the oracle wrote through read-only pool access"
        );
        // SAFETY: `writable` is only set by `UcxPools::writing`, whose caller guarantees the
        // host owns every slot written while the value lives; `locate` checked the range lies
        // inside the pool.
        unsafe { rank.write(pool, offset, data) }.map_err(|e| self.failed(e))
    }

    /// Never: the oracle asks this only of a request's context pools, to check that their
    /// bytes stayed unchanged, and those always live in another process here (the context
    /// server's). Their addresses say nothing about this process: two `serve` processes that
    /// allocate the same way map their pools at the same addresses, and answering by address
    /// had the oracle read the generation pools as the context's (a spurious "source bytes
    /// differ" in CI).
    fn is_backed(&self, _base: u64) -> bool {
        false
    }
}

/// Writes the canary over every byte of every pool of a rank (once, at start).
///
/// # Errors
///
/// The oracle cannot model the rank.
pub fn prime_all(oracle: &Oracle, info: &RankInfo, pools: &RankPools) -> Result<(), VerifyError> {
    // SAFETY: called at start-up, before the rank's keys are published: no request holds a
    // slot, no put reads the pools and no peer can write them.
    let mut memory = unsafe { UcxPools::writing(vec![pools]) };
    let result = oracle.prime_destination(&mut memory, info).map(|_| ());
    memory.finish(result)
}

/// Writes the canary over a request's slots of a receiver rank.
///
/// # Errors
///
/// The oracle cannot model the rank, or a table names a slot outside its pool.
pub fn prime_slots(
    oracle: &Oracle,
    info: &RankInfo,
    pools: &RankPools,
    tables: &[SlotTable],
) -> Result<(), VerifyError> {
    // SAFETY: the slots belong to a request no writer has been asked to fill yet, or whose
    // writers have all finished (release): the host owns them (memory module docs).
    let mut memory = unsafe { UcxPools::writing(vec![pools]) };
    let side = RequestSide::new(info, tables);
    let result = oracle
        .prime_destination_in(&mut memory, side, Extent::RequestSlots)
        .map(|_| ());
    memory.finish(result)
}

/// Writes a request's logical tags into its slots of a sender rank (the demo's "prefill").
///
/// # Errors
///
/// The oracle cannot model the rank, or a table names a slot outside its pool.
pub fn fill_slots(
    oracle: &Oracle,
    info: &RankInfo,
    pools: &RankPools,
    tables: &[SlotTable],
) -> Result<(), VerifyError> {
    // SAFETY: the slots belong to a request no receiver has asked for yet: no put reads
    // them and no peer writes a context pool (memory module docs).
    let mut memory = unsafe { UcxPools::writing(vec![pools]) };
    let side = RequestSide::new(info, tables);
    let result = oracle
        .fill_source_in(&mut memory, side, Extent::RequestSlots)
        .map(|_| ());
    memory.finish(result)
}

/// Checks a completed request's slots on every receiver rank: covered bytes hold their tags,
/// the rest of those slots still hold the canary.
///
/// `context` is every rank of the prefill DP group that served the request, with its slot
/// tables; `pieces` every piece the senders planned.
///
/// # Errors
///
/// The oracle cannot model a rank, or a table names a slot outside its pool. Mismatches are
/// in the report.
pub fn verify_request(
    oracle: &Oracle,
    receivers: &[ReceiverPart<'_>],
    context: &[(&RankInfo, &[SlotTable])],
    pieces: &[PairRequest],
) -> Result<VerifyReport, VerifyError> {
    let memory = UcxPools::reading(receivers.iter().map(|r| r.pools).collect());
    let receiver_sides: Vec<RequestSide<'_>> = receivers
        .iter()
        .map(|part| RequestSide {
            info: part.info,
            slot_tables: part.tables,
            excluded: part.excluded,
        })
        .collect();
    // The prefill ranks' pools live in another process: the oracle reads their geometry and
    // tables only (`UcxPools::is_backed` is false for them, whatever their addresses).
    let context_sides: Vec<RequestSide<'_>> = context
        .iter()
        .map(|(info, tables)| RequestSide::new(info, tables))
        .collect();
    let result = oracle.verify_in(
        &memory,
        &Delivery {
            prefill: &context_sides,
            receivers: &receiver_sides,
            pieces,
        },
        Extent::RequestSlots,
    );
    memory.finish(result)
}

/// Checks that every byte of every pool of the ranks holds its canary (no request holds a
/// slot).
///
/// # Errors
///
/// The oracle cannot model a rank.
pub fn verify_idle(
    oracle: &Oracle,
    ranks: &[(&RankInfo, &RankPools)],
) -> Result<VerifyReport, VerifyError> {
    let memory = UcxPools::reading(ranks.iter().map(|(_, pools)| *pools).collect());
    let empty: Vec<Vec<SlotTable>> = ranks
        .iter()
        .map(|(info, _)| vec![SlotTable::default(); info.page_table.groups.len()])
        .collect();
    let sides: Vec<RequestSide<'_>> = ranks
        .iter()
        .zip(&empty)
        .map(|((info, _), tables)| RequestSide::new(info, tables))
        .collect();
    let result = oracle.verify(
        &memory,
        &Delivery {
            prefill: &[],
            receivers: &sides,
            pieces: &[],
        },
    );
    memory.finish(result)
}
