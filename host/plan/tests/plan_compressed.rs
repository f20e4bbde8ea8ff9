//! Compressed plans: each validation rule, agreement with the flat rules on the same plans,
//! and the lazy expansion (merging across rows included).

use kvferry_plan::{End, PlanRejected, validate, validate_compressed};
use kvferry_planner_abi::{
    CompressedPlan, GroupKind, LayerGroupRows, PlanPattern, TransferPlan, ViewId, ffi::RVec,
};

/// Rows of view `view` at `addresses`, `row_bytes` each.
fn rows(view: u32, addresses: &[u64], row_bytes: u64) -> LayerGroupRows {
    LayerGroupRows {
        view: ViewId { group: 0, view },
        kind: GroupKind::PAGED,
        ordinals: (0..addresses.len() as u64).collect(),
        addresses: RVec::from(addresses.to_vec()),
        row_bytes,
        row_stride: row_bytes,
        span_start: 0,
        span_end: addresses.len() as u64,
    }
}

fn pattern(
    entries: (u32, u32),
    fragments: &[(u64, u64, u64)],
    pairs: &[(u32, u32)],
) -> PlanPattern {
    let mut p = PlanPattern::new(entries.0, entries.1);
    for &(s, d, n) in fragments {
        p.push_fragment(s, d, n);
    }
    for &(s, d) in pairs {
        p.push_rows(s, d);
    }
    p
}

fn compressed(patterns: Vec<PlanPattern>) -> CompressedPlan {
    CompressedPlan {
        patterns: patterns.into(),
    }
}

const SRC: u64 = 0x10_0000;
const DST: u64 = 0x90_0000;
const ROW: u64 = 256;

/// Four source rows, adjacent; four destination rows: 0 and 1 adjacent, 2 and 3 apart.
fn sides() -> (Vec<LayerGroupRows>, Vec<LayerGroupRows>) {
    let src: Vec<u64> = (0..4).map(|r| SRC + r * ROW).collect();
    let dst = [DST, DST + ROW, DST + 10 * ROW, DST + 20 * ROW];
    (vec![rows(0, &src, ROW)], vec![rows(0, &dst, ROW)])
}

#[test]
fn a_pattern_expands_in_plan_order_and_merges_across_adjacent_rows() {
    let (mine, theirs) = sides();
    // Whole rows in two halves: the halves merge inside each row, and rows 0 and 1 (adjacent
    // on both sides) merge into one write.
    let plan = compressed(vec![pattern(
        (0, 0),
        &[(0, 0, 128), (128, 128, 128)],
        &[(0, 0), (1, 1), (2, 2), (3, 3)],
    )]);
    let flat = plan.expand(&mine, &theirs).unwrap();
    assert_eq!(flat.fragments(), 8);
    let v = validate_compressed(plan.clone(), &mine, &theirs).unwrap();
    assert!(v.is_compressed());
    assert_eq!(v.planned_fragments(), 8);
    assert_eq!(v.total_bytes(), 4 * ROW);
    let got: Vec<_> = v.fragments().collect();
    assert_eq!(
        got,
        vec![
            (SRC, DST, 2 * ROW),
            (SRC + 2 * ROW, DST + 10 * ROW, ROW),
            (SRC + 3 * ROW, DST + 20 * ROW, ROW),
        ]
    );
    assert_eq!(v.len(), got.len());
    assert_eq!(v.fragments().len(), got.len());
    // The flat form of the same plan validates to the same writes.
    let f = validate(flat, &mine, &theirs).unwrap();
    assert!(!f.is_compressed());
    assert_eq!(f.fragments().collect::<Vec<_>>(), got);
}

#[test]
fn an_empty_plan_and_empty_patterns_move_nothing() {
    let (mine, theirs) = sides();
    let v = validate_compressed(CompressedPlan::new(), &mine, &theirs).unwrap();
    assert!(v.is_empty());
    let v = validate_compressed(
        compressed(vec![
            pattern((0, 0), &[], &[(0, 0), (0, 0)]),
            pattern((0, 0), &[(0, 0, 8)], &[]),
        ]),
        &mine,
        &theirs,
    )
    .unwrap();
    assert!(v.is_empty());
    assert_eq!(v.fragments().count(), 0);
    assert_eq!(v.total_bytes(), 0);
}

#[test]
fn each_rule_is_named() {
    let (mine, theirs) = sides();
    let check = |p: PlanPattern| validate_compressed(compressed(vec![p]), &mine, &theirs);

    let mut p = pattern((0, 0), &[(0, 0, 8)], &[(0, 0)]);
    p.dst_offset.push(8);
    let e = check(p).unwrap_err();
    assert_eq!(
        e,
        PlanRejected::PatternLengthMismatch {
            pattern: 0,
            what: "fragment"
        }
    );
    assert!(e.to_string().contains("fragment arrays differ"), "{e}");

    let mut p = pattern((0, 0), &[(0, 0, 8)], &[(0, 0)]);
    p.src_row.push(1);
    assert_eq!(
        check(p).unwrap_err(),
        PlanRejected::PatternLengthMismatch {
            pattern: 0,
            what: "row-pair"
        }
    );

    let e = check(pattern((0, 3), &[(0, 0, 8)], &[(0, 0)])).unwrap_err();
    assert_eq!(
        e,
        PlanRejected::PatternEntry {
            pattern: 0,
            end: End::Destination,
            entry: 3,
            entries: 1
        }
    );
    assert_eq!(
        e.to_string(),
        "pattern 0: destination rows entry 3 does not exist (1 entries)"
    );
    assert!(matches!(
        check(pattern((1, 0), &[(0, 0, 8)], &[(0, 0)])).unwrap_err(),
        PlanRejected::PatternEntry {
            end: End::Source,
            ..
        }
    ));

    assert_eq!(
        check(pattern((0, 0), &[(0, 0, 8), (8, 8, 0)], &[(0, 0)])).unwrap_err(),
        PlanRejected::PatternZeroLength {
            pattern: 0,
            fragment: 1
        }
    );

    // A fragment may not run past its row, even into a byte-adjacent one.
    let e = check(pattern((0, 0), &[(200, 0, 57)], &[(0, 0)])).unwrap_err();
    assert_eq!(
        e,
        PlanRejected::PatternOutsideRow {
            pattern: 0,
            fragment: 0,
            end: End::Source,
            offset: 200,
            len: 57,
            row_bytes: ROW
        }
    );
    assert!(e.to_string().contains("outside the 256-byte row"), "{e}");
    assert!(matches!(
        check(pattern((0, 0), &[(0, u64::MAX, 2)], &[(0, 0)])).unwrap_err(),
        PlanRejected::PatternOutsideRow {
            end: End::Destination,
            ..
        }
    ));

    let e = check(pattern((0, 0), &[(0, 0, 8)], &[(0, 0), (1, 4)])).unwrap_err();
    assert_eq!(
        e,
        PlanRejected::PatternMissingRow {
            pattern: 0,
            pair: 1,
            end: End::Destination,
            row: 4,
            rows: 4
        }
    );
    assert_eq!(
        e.to_string(),
        "pattern 0 row pair 1: destination row 4 does not exist (4 rows)"
    );

    let high = [rows(0, &[u64::MAX - 100], ROW)];
    let e = validate_compressed(
        compressed(vec![pattern((0, 0), &[(0, 0, 8)], &[(0, 0)])]),
        &high,
        &theirs,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            PlanRejected::PatternRowOverflow {
                end: End::Source,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn too_many_fragments_once_expanded_are_refused_without_expanding() {
    // 70,000 fragments × 70,000 row pairs: 4.9e9 fragments, refused from the counts alone.
    let src: Vec<u64> = (0..70_000).map(|r| SRC + r * 65_536).collect();
    let dst: Vec<u64> = (0..70_000).map(|r| DST + (1 << 32) + r * 65_536).collect();
    let (mine, theirs) = ([rows(0, &src, 65_536)], [rows(0, &dst, 65_536)]);
    let mut p = PlanPattern::new(0, 0);
    for k in 0..70_000 {
        p.push_fragment(0, 0, 1 + k % 3);
    }
    for r in 0..70_000 {
        p.push_rows(r, r);
    }
    let e = validate_compressed(compressed(vec![p]), &mine, &theirs).unwrap_err();
    assert!(
        matches!(e, PlanRejected::TooManyFragments { fragments } if fragments == 4_900_000_000),
        "{e:?}"
    );
}

#[test]
fn overlaps_inside_a_pattern_across_its_rows_and_between_patterns_are_refused() {
    let (mine, theirs) = sides();
    // Inside one pattern: bytes 100..140 written twice in every row.
    let e = validate_compressed(
        compressed(vec![pattern(
            (0, 0),
            &[(0, 0, 140), (140, 100, 40)],
            &[(0, 0)],
        )]),
        &mine,
        &theirs,
    )
    .unwrap_err();
    assert_eq!(
        e,
        PlanRejected::OverlappingDestinations {
            first: 0,
            first_address: DST,
            first_len: 140,
            second: 1,
            second_address: DST + 100,
            second_len: 40
        }
    );
    // One pattern naming destination row 2 twice.
    let e = validate_compressed(
        compressed(vec![pattern(
            (0, 0),
            &[(0, 0, 16)],
            &[(0, 0), (1, 2), (3, 2)],
        )]),
        &mine,
        &theirs,
    )
    .unwrap_err();
    assert_eq!(
        e,
        PlanRejected::OverlappingDestinations {
            first: 1,
            first_address: DST + 10 * ROW,
            first_len: 16,
            second: 2,
            second_address: DST + 10 * ROW,
            second_len: 16
        }
    );
    // Two patterns into the same rows: disjoint halves pass, overlapping ones do not.
    let halves = compressed(vec![
        pattern((0, 0), &[(0, 0, 128)], &[(0, 0), (1, 1)]),
        pattern((0, 0), &[(128, 128, 128)], &[(2, 1), (3, 0)]),
    ]);
    assert!(validate_compressed(halves, &mine, &theirs).is_ok());
    let e = validate_compressed(
        compressed(vec![
            pattern((0, 0), &[(0, 0, 128)], &[(0, 0), (1, 1)]),
            pattern((0, 0), &[(128, 120, 100)], &[(2, 3), (3, 1)]),
        ]),
        &mine,
        &theirs,
    )
    .unwrap_err();
    assert_eq!(
        e,
        PlanRejected::OverlappingDestinations {
            first: 1,
            first_address: DST + ROW,
            first_len: 128,
            second: 3,
            second_address: DST + ROW + 120,
            second_len: 100
        }
    );
}

#[test]
fn two_views_of_one_pool_share_rows_and_are_checked_together() {
    // K and V views over one pool: the same slots, described twice.
    let src: Vec<u64> = (0..4).map(|r| SRC + r * ROW).collect();
    let dst: Vec<u64> = (0..4).map(|r| DST + r * 2 * ROW).collect();
    let mine = [rows(0, &src, ROW)];
    let theirs = [rows(0, &dst, ROW), rows(1, &dst, ROW)];
    let k = pattern((0, 0), &[(0, 0, 128)], &[(0, 0), (1, 1)]);
    let v_ok = pattern((0, 1), &[(128, 128, 128)], &[(0, 0), (1, 1)]);
    let v_bad = pattern((0, 1), &[(128, 64, 128)], &[(2, 3), (3, 1)]);
    assert!(validate_compressed(compressed(vec![k.clone(), v_ok]), &mine, &theirs).is_ok());
    let e = validate_compressed(compressed(vec![k, v_bad]), &mine, &theirs).unwrap_err();
    assert!(
        matches!(
            e,
            PlanRejected::OverlappingDestinations { second_address, .. }
                if second_address == DST + 2 * ROW + 64
        ),
        "{e:?}"
    );
}

#[test]
fn partly_overlapping_rows_fall_back_to_the_flat_rules() {
    // A destination pool whose stride (128) is below its slot size (256): rows 0 and 1
    // share bytes 128..256 of row 0. The compressed rules cannot tell rows apart; the flat
    // ones, on the expansion, catch the overlap.
    let mine = [rows(0, &[SRC, SRC + ROW], ROW)];
    let theirs = [rows(0, &[DST, DST + 128], ROW)];
    let overlapping = compressed(vec![pattern((0, 0), &[(0, 0, 256)], &[(0, 0), (1, 1)])]);
    assert!(matches!(
        validate_compressed(overlapping, &mine, &theirs).unwrap_err(),
        PlanRejected::OverlappingDestinations { .. }
    ));
    let disjoint = compressed(vec![pattern((0, 0), &[(0, 0, 128)], &[(0, 0), (1, 1)])]);
    let v = validate_compressed(disjoint, &mine, &theirs).unwrap();
    assert!(!v.is_compressed());
    assert_eq!(
        v.fragments().collect::<Vec<_>>(),
        vec![(SRC, DST, 128), (SRC + ROW, DST + 128, 128)]
    );
}

/// Random compressed plans over rows shared by two views (some destination rows described
/// twice), with and without planted overlaps: the compressed rules accept exactly the plans
/// the flat rules accept on their expansion, and accepted plans write the same fragments.
#[test]
fn compressed_rules_agree_with_the_flat_rules_on_the_expansion() {
    const ROWS: u64 = 24;
    let src: Vec<u64> = (0..ROWS).map(|r| SRC + r * ROW).collect();
    // Destination rows in pairs of byte-adjacent rows (so merges across rows happen).
    let dst: Vec<u64> = (0..ROWS).map(|r| DST + r * ROW + r / 2 * 512).collect();
    let mine = [rows(0, &src, ROW), rows(1, &src[..ROWS as usize / 2], ROW)];
    // Entry 1 describes the second half of entry 0's rows again (a second view of the pool).
    let theirs = [rows(0, &dst, ROW), rows(1, &dst[ROWS as usize / 2..], ROW)];
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move |bound: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % bound
    };
    let (mut accepted, mut refused) = (0, 0);
    for case in 0..600 {
        let mut patterns = Vec::new();
        for _ in 0..1 + next(3) {
            let (se, de) = (next(2) as u32, next(2) as u32);
            let (s_rows, d_rows) = (
                mine[se as usize].len() as u64,
                theirs[de as usize].len() as u64,
            );
            let mut p = PlanPattern::new(se, de);
            let mut offset = next(32);
            while offset + 8 <= ROW {
                let n = (8 + next(96)).min(ROW - offset);
                let src_offset = if next(2) == 0 {
                    offset
                } else {
                    next(ROW - n + 1)
                };
                p.push_fragment(src_offset, offset, n);
                offset += n + next(3) * 16;
                if next(5) == 0 {
                    break;
                }
            }
            if case % 5 == 0 && p.fragments_per_row() > 1 {
                // Plant an overlap inside the pattern.
                let f = next(p.fragments_per_row() as u64) as usize;
                let g = (f + 1) % p.fragments_per_row();
                p.dst_offset[g] = p.dst_offset[f];
                p.len[g] = p.len[f];
                p.src_offset[g] = p.src_offset[g].min(ROW - p.len[g]);
            }
            let mut used = std::collections::BTreeSet::new();
            for _ in 0..1 + next(6) {
                let d = next(d_rows) as u32;
                // Mostly distinct destination rows; sometimes one twice.
                if used.insert(d) || case % 7 == 0 {
                    p.push_rows(next(s_rows) as u32, d);
                }
            }
            patterns.push(p);
        }
        let plan = compressed(patterns);
        let flat = plan.expand(&mine, &theirs).unwrap();
        let got = validate_compressed(plan.clone(), &mine, &theirs);
        let want = validate(flat.clone(), &mine, &theirs);
        match (&got, &want) {
            (Ok(g), Ok(w)) => {
                assert_eq!(
                    g.fragments().collect::<Vec<_>>(),
                    w.fragments().collect::<Vec<_>>(),
                    "case {case}: {plan:?}"
                );
                assert_eq!(g.len(), w.len(), "case {case}");
                assert_eq!(g.total_bytes(), w.total_bytes(), "case {case}");
                assert_eq!(g.planned_fragments(), w.planned_fragments(), "case {case}");
                accepted += 1;
            }
            (
                Err(PlanRejected::OverlappingDestinations {
                    first,
                    second,
                    first_address,
                    first_len,
                    second_address,
                    second_len,
                }),
                Err(PlanRejected::OverlappingDestinations { .. }),
            ) => {
                // The pair named overlaps, and is what the expansion holds at those indices.
                assert!(first < second, "case {case}");
                let at = |k: usize| (flat.dst[k], flat.len[k]);
                assert_eq!(at(*first), (*first_address, *first_len), "case {case}");
                assert_eq!(at(*second), (*second_address, *second_len), "case {case}");
                assert!(
                    first_address < &(second_address + second_len)
                        && second_address < &(first_address + first_len),
                    "case {case}"
                );
                refused += 1;
            }
            _ => panic!("case {case}: compressed {got:?}, flat {want:?}\n{plan:?}"),
        }
    }
    assert!(
        accepted > 150 && refused > 150,
        "{accepted} accepted, {refused} refused"
    );
}

#[test]
fn flat_and_compressed_forms_of_one_plan_are_interchangeable_for_an_executor() {
    let (mine, theirs) = sides();
    let plan = compressed(vec![pattern(
        (0, 0),
        &[(0, 64, 32), (32, 0, 32)],
        &[(3, 0), (2, 1), (1, 2)],
    )]);
    let flat: TransferPlan = plan.expand(&mine, &theirs).unwrap();
    let a = validate_compressed(plan, &mine, &theirs).unwrap();
    let b = validate(flat, &mine, &theirs).unwrap();
    assert_eq!(
        a.fragments().collect::<Vec<_>>(),
        b.fragments().collect::<Vec<_>>()
    );
}

#[test]
fn writers_into_one_receiver_must_write_disjoint_bytes() {
    use kvferry_plan::{WriterOverlap, overlapping_writers};
    let (mine, theirs) = sides();
    // Two writers, each half of every row: disjoint. The same half twice: the overlap, with
    // the writers' indices and the first shared range.
    let half = |offset: u64| {
        validate_compressed(
            compressed(vec![pattern(
                (0, 0),
                &[(offset, offset, 128)],
                &[(0, 0), (1, 1), (2, 2)],
            )]),
            &mine,
            &theirs,
        )
        .unwrap()
    };
    let (low, high, low_again) = (half(0), half(128), half(0));
    assert_eq!(overlapping_writers(&[&low, &high]), None);
    let found = overlapping_writers(&[&low, &high, &low_again]).unwrap();
    assert_eq!((found.first, found.second, found.len), (0, 2, 128));
    assert!(
        [DST, DST + ROW, DST + 10 * ROW].contains(&found.address),
        "{found}"
    );
    assert_eq!(
        WriterOverlap {
            first: 0,
            second: 2,
            address: DST,
            len: 128
        }
        .to_string(),
        "writers 0 and 2 both write 0x900000 +128"
    );
    // Flat plans (or a mix) are compared range by range, with the same answers.
    let flat = |offset: u64| {
        let mut p = TransferPlan::new();
        for (s, d) in [(0, 0), (1, 1), (2, 2)] {
            p.push(SRC + s * ROW + offset, theirs[0].addresses[d] + offset, 128);
        }
        validate(p, &mine, &theirs).unwrap()
    };
    let (flat_low, flat_high) = (flat(0), flat(128));
    assert_eq!(overlapping_writers(&[&flat_low, &flat_high]), None);
    assert_eq!(overlapping_writers(&[&low, &flat_high]), None);
    let found = overlapping_writers(&[&flat_high, &low, &flat_low]).unwrap();
    assert_eq!((found.first, found.second), (1, 2), "{found}");
    assert_eq!(found.address, DST);
    // One writer alone, and no writer, never overlap.
    assert_eq!(overlapping_writers(&[&low]), None);
    assert_eq!(overlapping_writers(&[]), None);
}
