//! Each range rule at its exact edge and one byte either side: rows one padding byte apart
//! are not adjacent, a fragment may end on its row's last byte and not one past it, two
//! destinations may touch and may not share one byte, in a flat plan, in a compressed one,
//! and between the plans of two writers. A one-byte slip in any of these checks fails here.

use kvferry_plan::{
    End, PlanRejected, ValidatedPlan, WriterOverlap, overlapping_writers, validate,
    validate_compressed,
};
use kvferry_planner_abi::{
    CompressedPlan, GroupKind, LayerGroupRows, PlanPattern, TransferPlan, ViewId, ffi::RVec,
};

const SRC: u64 = 0x10_0000;
const DST: u64 = 0x90_0000;
/// Bytes of every row here.
const ROW: u64 = 100;

/// Rows of view `view` at `addresses`, `ROW` bytes each, `stride` apart.
fn rows_of(view: u32, addresses: &[u64], stride: u64) -> LayerGroupRows {
    LayerGroupRows {
        view: ViewId { group: 0, view },
        kind: GroupKind::PAGED,
        ordinals: (0..addresses.len() as u64).collect(),
        addresses: RVec::from(addresses.to_vec()),
        row_bytes: ROW,
        row_stride: stride,
        span_start: 0,
        span_end: addresses.len() as u64,
    }
}

/// `n` rows from `base`, `stride` apart (one view).
fn rows(base: u64, n: u64, stride: u64) -> Vec<LayerGroupRows> {
    let addresses: Vec<u64> = (0..n).map(|r| base + r * stride).collect();
    vec![rows_of(0, &addresses, stride)]
}

fn plan(fragments: &[(u64, u64, u64)]) -> TransferPlan {
    let mut p = TransferPlan::new();
    for &(s, d, n) in fragments {
        p.push(s, d, n);
    }
    p
}

fn outside(fragment: usize, end: End, address: u64, len: u64) -> PlanRejected {
    PlanRejected::OutsideRows {
        fragment,
        end,
        address,
        len,
    }
}

fn overlap(first: (usize, u64, u64), second: (usize, u64, u64)) -> PlanRejected {
    PlanRejected::OverlappingDestinations {
        first: first.0,
        first_address: first.1,
        first_len: first.2,
        second: second.0,
        second_address: second.1,
        second_len: second.2,
    }
}

/// Rows one padding byte apart (stride `ROW + 1`) on one side, byte-adjacent rows on the
/// other: a fragment may fill a row to its last byte but not cross the padding byte, start
/// on it, or end on it; on the adjacent side it may cross. Checked with the padded rows at
/// the source, then at the destination.
#[test]
fn rows_one_padding_byte_apart_are_not_adjacent() {
    // Three adjacent rows, so every fragment tried fits the adjacent side.
    let padded = |base| rows(base, 2, ROW + 1);
    let adjacent = |base| rows(base, 3, ROW);
    for end in [End::Source, End::Destination] {
        let (mine, theirs) = match end {
            End::Source => (padded(SRC), adjacent(DST)),
            End::Destination => (adjacent(SRC), padded(DST)),
        };
        let (p0, a0) = match end {
            End::Source => (SRC, DST),
            End::Destination => (DST, SRC),
        };
        // A fragment `(padded address, adjacent address, len)` in the plan's order.
        let at = |padded: u64, adjacent: u64, len: u64| match end {
            End::Source => (padded, adjacent, len),
            End::Destination => (adjacent, padded, len),
        };
        let check = |fragments: &[(u64, u64, u64)]| validate(plan(fragments), &mine, &theirs);

        // Just inside: each row whole, one after the other (the second found from the first
        // row's hint), and each row's last byte alone.
        let whole = check(&[at(p0, a0, ROW), at(p0 + ROW + 1, a0 + ROW, ROW)]).unwrap();
        assert_eq!((whole.len(), whole.total_bytes()), (2, 2 * ROW), "{end}");
        check(&[at(p0 + ROW - 1, a0, 1)]).unwrap();
        check(&[at(p0 + ROW + 1, a0, 1)]).unwrap();
        check(&[at(p0 + 2 * ROW, a0, 1)]).unwrap();
        // Across the byte-adjacent rows of the other side: allowed.
        check(&[
            at(p0 + ROW - 1, a0 + ROW - 1, 1),
            at(p0 + ROW + 1, a0 + ROW, 1),
        ])
        .unwrap();
        check(&[at(p0, a0, 1), at(p0 + 1, a0 + ROW - 1, 2)]).unwrap();

        // One byte beyond, each way the padding byte can be touched.
        for (address, len) in [
            (p0 + ROW - 1, 2),     // the last byte of row 0 and the padding byte
            (p0 + ROW - 1, 3),     // across the padding byte into row 1
            (p0, 2 * ROW + 1),     // both rows whole, padding included
            (p0 + 1, ROW),         // row 0 from its second byte, one byte past its end
            (p0 + ROW, 1),         // the padding byte alone
            (p0 + ROW, ROW + 1),   // row 1 from the padding byte before it
            (p0 + ROW + 2, ROW),   // one byte past the end of row 1
            (p0 + 2 * ROW + 1, 1), // the byte after row 1
            (p0 - 1, 1),           // the byte before row 0
            (p0 - 1, ROW + 1),     // row 0 from the byte before it
        ] {
            assert_eq!(
                check(&[at(address, a0, len)]).unwrap_err(),
                outside(0, end, address, len),
                "{end} {address:#x} +{len}"
            );
        }
        // The same breach as the second fragment of a plan, found from the first's hint.
        assert_eq!(
            check(&[at(p0, a0, ROW), at(p0 + ROW - 1, a0 + ROW, 2)]).unwrap_err(),
            outside(1, end, p0 + ROW - 1, 2),
            "{end}"
        );
        assert_eq!(
            check(&[at(p0, a0, ROW), at(p0 + ROW, a0 + ROW, 1)]).unwrap_err(),
            outside(1, end, p0 + ROW, 1),
            "{end}"
        );
    }
}

/// Byte-adjacent slots are one range only where the request holds both: with slot 1 not
/// held, slots 0 and 2 are a whole row apart, and a fragment may run to the last byte of
/// slot 0 and no further.
#[test]
fn a_slot_the_request_does_not_hold_is_not_adjacent() {
    let mine = [rows_of(0, &[SRC, SRC + 2 * ROW], ROW)];
    let theirs = rows(DST, 3, ROW);
    let check = |fragments: &[(u64, u64, u64)]| validate(plan(fragments), &mine, &theirs);
    check(&[(SRC, DST, ROW), (SRC + 2 * ROW, DST + ROW, ROW)]).unwrap();
    check(&[(SRC + ROW - 1, DST, 1)]).unwrap();
    for (address, len) in [(SRC + ROW - 1, 2), (SRC + ROW, 1), (SRC + 2 * ROW - 1, 1)] {
        assert_eq!(
            check(&[(address, DST, len)]).unwrap_err(),
            outside(0, End::Source, address, len)
        );
    }
    // Held, the same slots are one range.
    let held = rows(SRC, 3, ROW);
    validate(plan(&[(SRC + ROW - 1, DST, 2)]), &held, &theirs).unwrap();
    validate(plan(&[(SRC, DST, 3 * ROW)]), &held, &theirs).unwrap();
    assert_eq!(
        validate(plan(&[(SRC, DST, 3 * ROW + 1)]), &held, &rows(DST, 4, ROW)).unwrap_err(),
        outside(0, End::Source, SRC, 3 * ROW + 1)
    );
}

/// Two destinations that share exactly one byte are an overlap, named by both fragments in
/// index order, whichever comes first in the plan, inside one row and across two
/// byte-adjacent rows; two that touch are not.
#[test]
fn destinations_sharing_one_byte_overlap_and_touching_ones_do_not() {
    // Destination rows 0 and 1 adjacent, row 2 apart; enough source rows for every fragment.
    let mine = rows(SRC, 4, ROW);
    let theirs = [rows_of(0, &[DST, DST + ROW, DST + 10 * ROW], ROW)];
    let check = |fragments: &[(u64, u64, u64)]| validate(plan(fragments), &mine, &theirs);

    // Inside one row, in either order.
    check(&[(SRC, DST, 50), (SRC + ROW, DST + 50, 10)]).unwrap();
    assert_eq!(
        check(&[(SRC, DST, 50), (SRC + ROW, DST + 49, 10)]).unwrap_err(),
        overlap((0, DST, 50), (1, DST + 49, 10))
    );
    check(&[(SRC, DST + 50, 10), (SRC + ROW, DST, 50)]).unwrap();
    assert_eq!(
        check(&[(SRC, DST + 49, 10), (SRC + ROW, DST, 50)]).unwrap_err(),
        overlap((0, DST + 49, 10), (1, DST, 50))
    );
    // A one-byte fragment on the last byte of another.
    assert_eq!(
        check(&[(SRC, DST, ROW), (SRC + ROW, DST + ROW - 1, 1)]).unwrap_err(),
        overlap((0, DST, ROW), (1, DST + ROW - 1, 1))
    );
    // Across the adjacent rows: a fragment starting in row 0 reaches one byte into row 1.
    check(&[(SRC, DST + 50, 50), (SRC + ROW, DST + ROW, 10)]).unwrap();
    assert_eq!(
        check(&[(SRC, DST + 50, 51), (SRC + ROW, DST + ROW, 10)]).unwrap_err(),
        overlap((0, DST + 50, 51), (1, DST + ROW, 10))
    );
    assert_eq!(
        check(&[(SRC + ROW, DST + ROW, 10), (SRC, DST + 50, 51)]).unwrap_err(),
        overlap((0, DST + ROW, 10), (1, DST + 50, 51))
    );
    // Across rows, with a fragment of another row between the two in plan order.
    assert_eq!(
        check(&[
            (SRC, DST, 2 * ROW),
            (SRC + 2 * ROW, DST + 10 * ROW, 10),
            (SRC + 3 * ROW, DST + 2 * ROW - 1, 1),
        ])
        .unwrap_err(),
        overlap((0, DST, 2 * ROW), (2, DST + 2 * ROW - 1, 1))
    );
    check(&[
        (SRC, DST, 2 * ROW - 1),
        (SRC + 2 * ROW, DST + 10 * ROW, 10),
        (SRC + 3 * ROW, DST + 2 * ROW - 1, 1),
    ])
    .unwrap();
}

/// Compressed plans: the same one-byte edges inside one pattern and between two patterns that
/// land in one row; destination rows that share one byte cannot be told apart by row, so
/// such a plan takes the flat rules (and its overlap is caught), while byte-adjacent rows
/// stay compressed.
#[test]
fn compressed_destinations_sharing_one_byte_overlap() {
    let pattern = |fragments: &[(u64, u64, u64)], pairs: &[(u32, u32)]| {
        let mut p = PlanPattern::new(0, 0);
        for &(s, d, n) in fragments {
            p.push_fragment(s, d, n);
        }
        for &(s, d) in pairs {
            p.push_rows(s, d);
        }
        p
    };
    let compressed = |patterns: Vec<PlanPattern>| CompressedPlan {
        patterns: patterns.into(),
    };
    let mine = rows(SRC, 4, ROW);
    let theirs = [rows_of(0, &[DST, DST + 10 * ROW], ROW)];
    let check = |patterns| validate_compressed(compressed(patterns), &mine, &theirs);

    // Inside one pattern (one row pair: fragment indices are the pattern's).
    check(vec![pattern(&[(0, 0, 50), (50, 50, 50)], &[(0, 0)])]).unwrap();
    assert_eq!(
        check(vec![pattern(&[(0, 0, 50), (50, 49, 10)], &[(0, 0)])]).unwrap_err(),
        overlap((0, DST, 50), (1, DST + 49, 10))
    );
    assert_eq!(
        check(vec![pattern(&[(50, 49, 10), (0, 0, 50)], &[(0, 0)])]).unwrap_err(),
        overlap((0, DST + 49, 10), (1, DST, 50))
    );
    // Two patterns landing in row 1 (fragments 0..2 are the first pattern's two rows).
    let low = || pattern(&[(0, 0, 50)], &[(0, 0), (1, 1)]);
    check(vec![low(), pattern(&[(50, 50, 50)], &[(2, 1)])]).unwrap();
    assert_eq!(
        check(vec![low(), pattern(&[(49, 49, 51)], &[(2, 1)])]).unwrap_err(),
        overlap((1, DST + 10 * ROW, 50), (2, DST + 10 * ROW + 49, 51))
    );

    // Rows one byte apart, byte-adjacent, and sharing one byte: whole rows 0 and 1.
    let whole = || compressed(vec![pattern(&[(0, 0, ROW)], &[(0, 0), (1, 1)])]);
    for (stride, compressed_form) in [(ROW + 1, true), (ROW, true)] {
        let theirs = rows(DST, 2, stride);
        let v = validate_compressed(whole(), &mine, &theirs).unwrap();
        assert_eq!(v.is_compressed(), compressed_form, "stride {stride}");
        assert_eq!(v.total_bytes(), 2 * ROW);
    }
    let shared = rows(DST, 2, ROW - 1);
    assert_eq!(
        validate_compressed(whole(), &mine, &shared).unwrap_err(),
        overlap((0, DST, ROW), (1, DST + ROW - 1, ROW))
    );
    // Without the shared byte (row 1 from its second byte), the plan passes the flat rules.
    let v = validate_compressed(
        compressed(vec![
            pattern(&[(0, 0, ROW)], &[(0, 0)]),
            pattern(&[(1, 1, ROW - 1)], &[(1, 1)]),
        ]),
        &mine,
        &shared,
    )
    .unwrap();
    assert!(!v.is_compressed());
}

/// Two writers into one receiver that share exactly one byte are reported, with that byte;
/// writers that touch are not. Compressed, flat and mixed plans alike.
#[test]
fn writers_sharing_one_byte_are_reported_and_touching_ones_are_not() {
    let mine = rows(SRC, 2, ROW);
    let theirs = rows(DST, 2, ROW);
    // A writer of bytes `[from, to)` of destination row `row`, compressed or flat.
    let compressed = |row: u32, from: u64, to: u64| {
        let mut p = PlanPattern::new(0, 0);
        p.push_fragment(from, from, to - from);
        p.push_rows(row, row);
        let plan = CompressedPlan {
            patterns: vec![p].into(),
        };
        let v = validate_compressed(plan, &mine, &theirs).unwrap();
        assert!(v.is_compressed());
        v
    };
    let flat = |row: u32, from: u64, to: u64| {
        let at = u64::from(row) * ROW + from;
        validate(plan(&[(SRC + at, DST + at, to - from)]), &mine, &theirs).unwrap()
    };
    type Writer<'a> = &'a dyn Fn(u32, u64, u64) -> ValidatedPlan;
    let forms: [(&str, Writer); 2] = [("compressed", &compressed), ("flat", &flat)];
    for (a_form, a) in forms {
        for (b_form, b) in forms {
            let (low, touching, sharing) = (a(0, 0, 50), b(0, 50, ROW), b(0, 49, ROW));
            assert_eq!(
                overlapping_writers(&[&low, &touching]),
                None,
                "{a_form} and {b_form}"
            );
            assert_eq!(
                overlapping_writers(&[&low, &sharing]),
                Some(WriterOverlap {
                    first: 0,
                    second: 1,
                    address: DST + 49,
                    len: 1
                }),
                "{a_form} and {b_form}"
            );
            // The other way round, behind a writer of the adjacent row that shares nothing.
            let next_row = b(1, 0, ROW);
            assert_eq!(
                overlapping_writers(&[&next_row, &sharing, &low]),
                Some(WriterOverlap {
                    first: 1,
                    second: 2,
                    address: DST + 49,
                    len: 1
                }),
                "{a_form} and {b_form}"
            );
            assert_eq!(
                overlapping_writers(&[&next_row, &touching, &low]),
                None,
                "{a_form} and {b_form}"
            );
        }
    }
}

/// A compressed pattern's fragment may end on its row's last byte, on either side, and not
/// one byte past it (rows one padding byte apart, so the byte past is no row's).
#[test]
fn a_pattern_fragment_ends_on_its_rows_last_byte() {
    let mine = rows(SRC, 2, ROW + 1);
    let theirs = rows(DST, 2, ROW + 1);
    let check = |s: u64, d: u64, n: u64| {
        let mut p = PlanPattern::new(0, 0);
        p.push_fragment(s, d, n);
        p.push_rows(0, 0);
        p.push_rows(1, 1);
        let plan = CompressedPlan {
            patterns: vec![p].into(),
        };
        validate_compressed(plan, &mine, &theirs)
    };
    for (s, d, n) in [
        (0, 0, ROW),
        (ROW - 1, 0, 1),
        (0, ROW - 1, 1),
        (1, 0, ROW - 1),
    ] {
        let v = check(s, d, n).unwrap_or_else(|e| panic!("{s} {d} +{n}: {e}"));
        assert_eq!(v.total_bytes(), 2 * n);
    }
    for (s, d, n, end, offset) in [
        (0, 0, ROW + 1, End::Source, 0),
        (ROW, 0, 1, End::Source, ROW),
        (1, 0, ROW, End::Source, 1),
        (0, ROW, 1, End::Destination, ROW),
        (0, 1, ROW, End::Destination, 1),
    ] {
        assert_eq!(
            check(s, d, n).unwrap_err(),
            PlanRejected::PatternOutsideRow {
                pattern: 0,
                fragment: 0,
                end,
                offset,
                len: n,
                row_bytes: ROW
            },
            "{s} {d} +{n}"
        );
    }
}
