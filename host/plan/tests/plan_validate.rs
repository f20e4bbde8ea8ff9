//! Plan validation rules and coalescing.

use kvferry_plan::{End, PlanFailure, PlanRejected, RequestSide, plan_transfer, validate};
use kvferry_planner_abi::{
    GroupKind, LayerGroupRows, PairRequest, PeerTargets, PlanError, RankInfo, TransferPlan,
    TransferPlanner, ViewId, ffi::RVec,
};
use kvferry_testkit::error_chain;

/// Rows of one view at `addresses`, `row_bytes` each, with stride `stride`.
fn rows(addresses: &[u64], row_bytes: u64, stride: u64) -> LayerGroupRows {
    LayerGroupRows {
        view: ViewId { group: 0, view: 0 },
        kind: GroupKind::PAGED,
        ordinals: (0..addresses.len() as u64).collect(),
        addresses: RVec::from(addresses.to_vec()),
        row_bytes,
        row_stride: stride,
        span_start: 0,
        span_end: addresses.len() as u64,
    }
}

fn plan(fragments: &[(u64, u64, u64)]) -> TransferPlan {
    let mut p = TransferPlan::new();
    for &(s, d, n) in fragments {
        p.push(s, d, n);
    }
    p
}

const SRC: u64 = 0x10_0000;
const DST: u64 = 0x90_0000;

#[test]
fn whole_rows_pass_and_adjacent_fragments_coalesce() {
    // Source rows 0, 1, 2 adjacent; destination rows 0, 1 adjacent, row 2 elsewhere.
    let mine = [rows(&[SRC, SRC + 100, SRC + 200], 100, 100)];
    let theirs = [rows(&[DST, DST + 100, DST + 1000], 100, 100)];
    let p = plan(&[
        (SRC, DST, 60),
        (SRC + 60, DST + 60, 40),
        (SRC + 100, DST + 100, 100),
        (SRC + 200, DST + 1000, 100),
    ]);
    let v = validate(p.clone(), &mine, &theirs).unwrap();
    assert_eq!(v.planned_fragments(), 4);
    assert_eq!(v.len(), 2);
    assert_eq!(v.total_bytes(), 300);
    assert!(!v.is_empty());
    let f: Vec<_> = v.fragments().collect();
    assert_eq!(f, [(SRC, DST, 200), (SRC + 200, DST + 1000, 100)]);
}

#[test]
fn fragment_may_span_byte_adjacent_rows() {
    let mine = [rows(&[SRC, SRC + 100], 100, 100)];
    let theirs = [rows(&[DST + 100, DST], 100, 100)];
    let v = validate(plan(&[(SRC, DST, 200)]), &mine, &theirs).unwrap();
    assert_eq!(v.len(), 1);
}

#[test]
fn padded_rows_are_not_adjacent() {
    let mine = [rows(&[SRC, SRC + 164], 100, 164)];
    let theirs = [rows(&[DST, DST + 100], 100, 100)];
    let err = validate(plan(&[(SRC, DST, 200)]), &mine, &theirs).unwrap_err();
    assert_eq!(
        err,
        PlanRejected::OutsideRows {
            fragment: 0,
            end: End::Source,
            address: SRC,
            len: 200
        }
    );
}

#[test]
fn destination_outside_rows_names_the_fragment() {
    let mine = [rows(&[SRC, SRC + 4096], 4096, 4096)];
    let theirs = [rows(&[DST, DST + 8192], 4096, 4096)];
    let p = plan(&[(SRC, DST, 4096), (SRC + 4096, DST + 4096, 4096)]);
    let err = validate(p.clone(), &mine, &theirs).unwrap_err();
    assert_eq!(err.fragment(), Some(1));
    let text = err.to_string();
    assert_eq!(
        text,
        format!(
            "fragment 1: destination {:#x} +4096 lies outside the peer's rows for this request",
            DST + 4096
        )
    );
    // One byte past a row's end is outside too.
    let err = validate(plan(&[(SRC, DST + 1, 4096)]), &mine, &theirs).unwrap_err();
    assert!(matches!(
        err,
        PlanRejected::OutsideRows {
            end: End::Destination,
            ..
        }
    ));
    // A source before every row.
    let err = validate(plan(&[(SRC - 1, DST, 1)]), &mine, &theirs).unwrap_err();
    assert!(err.to_string().contains("source"), "{err}");
    assert!(err.to_string().contains("this rank's rows"), "{err}");
}

#[test]
fn overlapping_destinations_are_rejected() {
    let mine = [rows(&[SRC, SRC + 100], 100, 100)];
    let theirs = [rows(&[DST], 100, 100)];
    let p = plan(&[(SRC, DST + 50, 50), (SRC + 100, DST, 60)]);
    let err = validate(p.clone(), &mine, &theirs).unwrap_err();
    assert!(matches!(
        err,
        PlanRejected::OverlappingDestinations {
            first: 0,
            second: 1,
            ..
        }
    ));
    assert!(
        err.to_string()
            .starts_with("fragments 0 and 1: destinations"),
        "{err}"
    );
    // Touching is fine.
    let p = plan(&[(SRC, DST + 50, 50), (SRC + 100, DST, 50)]);
    assert!(validate(p.clone(), &mine, &theirs).is_ok());
    // A duplicate write of the same bytes is an overlap.
    let p = plan(&[(SRC, DST, 10), (SRC + 100, DST, 10)]);
    assert!(validate(p.clone(), &mine, &theirs).is_err());
}

#[test]
fn length_zero_and_overflow_are_rejected() {
    let mine = [rows(&[SRC], 100, 100)];
    let theirs = [rows(&[DST], 100, 100)];
    let mut p = plan(&[(SRC, DST, 10)]);
    p.len.push(5);
    let err = validate(p.clone(), &mine, &theirs).unwrap_err();
    assert_eq!(
        err,
        PlanRejected::LengthMismatch {
            src: 1,
            dst: 1,
            len: 2
        }
    );
    assert_eq!(
        err.to_string(),
        "plan arrays differ in length: 1 sources, 1 destinations, 2 lengths"
    );
    let err = validate(plan(&[(SRC, DST, 10), (SRC, DST + 20, 0)]), &mine, &theirs).unwrap_err();
    assert_eq!(err, PlanRejected::ZeroLength { fragment: 1 });
    let err = validate(plan(&[(u64::MAX - 4, DST, 10)]), &mine, &theirs).unwrap_err();
    assert!(matches!(
        err,
        PlanRejected::Overflow {
            fragment: 0,
            end: End::Source,
            ..
        }
    ));
}

#[test]
fn an_empty_plan_is_valid() {
    let v = validate(TransferPlan::new(), &[], &[]).unwrap();
    assert!(v.is_empty());
    assert_eq!(v.total_bytes(), 0);
}

#[test]
fn large_shuffled_plans_validate() {
    // 100,000 rows of 64 bytes, every other slot, shuffled order on the destination: nothing
    // may coalesce, and the overlap check must see every row (its cost is measured by the
    // `plan_transfer` criterion benchmark, not asserted here).
    let n = 100_000u64;
    let src: Vec<u64> = (0..n).map(|k| SRC + k * 128).collect();
    let dst: Vec<u64> = (0..n).map(|k| DST + ((k * 7919) % n) * 128).collect();
    let mine = [rows(&src, 64, 128)];
    let theirs = [rows(&dst, 64, 128)];
    let mut p = TransferPlan::new();
    for k in 0..n as usize {
        p.push(src[k], dst[k], 64);
    }
    let v = validate(p.clone(), &mine, &theirs).unwrap();
    assert_eq!(v.len(), n as usize);
    assert_eq!(v.total_bytes(), 64 * n);
}

/// A planner returning a fixed plan, to drive `plan_transfer`.
struct Fixed(TransferPlan);

impl TransferPlanner for Fixed {
    fn check_peer(&self, _: &RankInfo, _: &RankInfo) -> Result<(), PlanError> {
        Ok(())
    }
    fn targets(&self, _: &RankInfo, _: &RankInfo, _: u32) -> Result<PeerTargets, PlanError> {
        Ok(PeerTargets {
            ranks: RVec::from(vec![0]),
            uniform: true,
        })
    }
    fn pair(
        &self,
        _: &RankInfo,
        _: &RankInfo,
        _: &[LayerGroupRows],
        _: &[LayerGroupRows],
        _: &PairRequest,
    ) -> Result<TransferPlan, PlanError> {
        if self.0.src.first() == Some(&0) {
            return Err(PlanError::unsupported("no"));
        }
        Ok(self.0.clone())
    }
}

#[test]
fn plan_transfer_describes_pairs_and_validates() {
    use kvferry_planner_abi::{Mapping, SlotTable};
    use kvferry_testkit::layout::{ModelSpec, PoolOptions, Preset, build_rank};
    let m = Mapping::SINGLE;
    let options = PoolOptions {
        paged_slots: 4,
        ..PoolOptions::default()
    };
    let model = ModelSpec::new(Preset::DeepseekV3);
    let mut base = 0x1_0000_0000u64;
    let mut alloc = |_: u32, _: usize, bytes: u64| {
        base += bytes + (1 << 20);
        base
    };
    let ctx = build_rank(&model, &m, "ctx", "p", 0, &options, &mut alloc).unwrap();
    let gen_rank = build_rank(&model, &m, "gen", "p", 0, &options, &mut alloc).unwrap();
    let row = ctx.page_table.pools[0].slot_bytes;
    let (cb, gb) = (
        ctx.page_table.pools[0].base,
        gen_rank.page_table.pools[0].base,
    );
    let ctx_slots = [SlotTable::new([2, 0])];
    let gen_slots = [SlotTable::new([1, 3])];
    let me = RequestSide::new(&ctx, &ctx_slots);
    let peer = RequestSide::new(&gen_rank, &gen_slots);
    let request = PairRequest::whole(64);

    let good = plan(&[(cb + 2 * row, gb + row, row), (cb, gb + 3 * row, row)]);
    let v = plan_transfer(&Fixed(good), me, peer, &request).unwrap();
    assert_eq!((v.len(), v.total_bytes()), (2, 2 * row));

    // Slot 1 of the source is not in the request.
    let bad = plan(&[(cb + row, gb + row, row)]);
    let err = plan_transfer(&Fixed(bad), me, peer, &request).unwrap_err();
    assert!(matches!(
        err,
        PlanFailure::Rejected(PlanRejected::OutsideRows {
            end: End::Source,
            ..
        })
    ));
    // The message names the step, the rule is the source, and the chain says each once.
    let chain = error_chain(&err);
    assert!(
        chain.starts_with("plan rejected: fragment 0: source"),
        "{chain}"
    );
    assert_eq!(chain.matches("fragment 0").count(), 1, "{chain}");

    let err = plan_transfer(&Fixed(plan(&[(0, 0, 1)])), me, peer, &request).unwrap_err();
    assert!(matches!(err, PlanFailure::Planner(_)), "{err}");
    assert_eq!(error_chain(&err), "the planner failed: unsupported: no");

    let too_many = [SlotTable::new([0]), SlotTable::new([1])];
    let err = plan_transfer(
        &Fixed(TransferPlan::new()),
        me,
        RequestSide::new(&gen_rank, &too_many),
        &request,
    )
    .unwrap_err();
    assert!(matches!(err, PlanFailure::DescribePeer(_)), "{err}");
    let chain = error_chain(&err);
    assert!(
        chain.starts_with("cannot describe the peer's rows: invalid input: "),
        "{chain}"
    );
}

/// Overlap detection agrees with a brute-force pairwise check on plans shaped like planner
/// output (runs of ascending destinations, one run per row) and on shuffled ones, with and
/// without a planted overlap: the run-based fast path must never hide one, and the error
/// must name the same pair the full check names.
#[test]
fn overlap_check_agrees_with_brute_force() {
    const ROW: u64 = 1024;
    const ROWS: u64 = 64;
    // Destination rows in groups of four byte-adjacent rows with gaps between the groups:
    // the checker buckets fragments by merged interval, so both one-row and several-row
    // intervals are exercised.
    let dst_row = |r: u64| DST + r * ROW + r / 4 * 64;
    let dst_rows: Vec<u64> = (0..ROWS).map(dst_row).collect();
    let src_rows: Vec<u64> = (0..ROWS).map(|r| SRC + r * ROW).collect();
    let (mine, theirs) = ([rows(&src_rows, ROW, ROW)], [rows(&dst_rows, ROW, ROW)]);
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move |bound: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % bound
    };
    let (mut valid, mut rejected) = (0, 0);
    for case in 0..400 {
        // Fragments of 16..128 bytes at random offsets inside random rows, each row's run
        // ascending; runs of several rows may share a row (interleaving spans).
        let mut fragments = Vec::new();
        for _ in 0..1 + next(12) {
            let row = next(ROWS);
            let mut offset = next(64);
            while offset < ROW - 16 {
                // A fragment may run into the next row where that one is byte-adjacent (not
                // the last of a group of four), which puts it in two rows' address ranges.
                let room = if row % 4 == 3 || row + 1 == ROWS {
                    ROW - offset
                } else {
                    2 * ROW - offset
                };
                let n = (16 + next(112)).min(room);
                let k = fragments.len() as u64;
                fragments.push((SRC + k % ROWS * ROW, dst_row(row) + offset, n));
                offset += n + next(3) * 8;
                if next(8) == 0 {
                    break;
                }
            }
        }
        if case % 3 == 0 && fragments.len() > 1 {
            // Plant a copy of one fragment's destination elsewhere in the plan.
            let (a, b) = (next(fragments.len() as u64), next(fragments.len() as u64));
            fragments[b as usize].1 = fragments[a as usize].1;
            fragments[b as usize].2 = fragments[a as usize].2;
        }
        if case % 2 == 1 {
            for k in (1..fragments.len()).rev() {
                fragments.swap(k, next(k as u64 + 1) as usize);
            }
        }
        // Sources: any in-row address will do (overlapping sources are allowed).
        for f in fragments.iter_mut() {
            f.0 = SRC + (f.0 - SRC) / ROW * ROW;
        }
        let p = plan(&fragments);
        let expected = brute_force_overlap(&fragments);
        match (validate(p.clone(), &mine, &theirs), expected) {
            (Ok(_), None) => valid += 1,
            (Err(PlanRejected::OverlappingDestinations { first, second, .. }), Some(_)) => {
                assert!(
                    first < second && brute_force_overlaps(&fragments, first, second),
                    "case {case}: named {first}, {second}, which do not overlap"
                );
                rejected += 1;
            }
            (got, want) => panic!("case {case}: validate {got:?}, brute force {want:?}"),
        }
    }
    assert!(
        valid > 100 && rejected > 50,
        "{valid} valid, {rejected} rejected"
    );
}

fn brute_force_overlaps(fragments: &[(u64, u64, u64)], i: usize, j: usize) -> bool {
    let ((_, a, m), (_, b, n)) = (fragments[i], fragments[j]);
    i != j && a < b + n && b < a + m
}

fn brute_force_overlap(fragments: &[(u64, u64, u64)]) -> Option<(usize, usize)> {
    (0..fragments.len())
        .flat_map(|i| (i + 1..fragments.len()).map(move |j| (i, j)))
        .find(|&(i, j)| brute_force_overlaps(fragments, i, j))
}
