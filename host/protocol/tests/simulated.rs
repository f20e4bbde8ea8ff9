//! A request's completions between simulated prefill and decode ranks, with no
//! sockets: every message goes through the agent frame codec as bytes, and the generation
//! side's `RequestTracker` decides what they add up to — in order, interleaved, failed,
//! hostile, or with bytes flipped on the wire.

use kvferry_planner_abi::TokenRange;
use kvferry_protocol::{
    AgentMessage, Completion, CompletionStatus, Frame, HEADER_LEN, Phase, RequestData,
    RequestTracker, Totals, Tracked, Violation, decode_body, encode, parse_header,
};

/// One message across the "wire": encoded, header checked, body decoded.
fn wire(message: &AgentMessage) -> AgentMessage {
    let frame = encode(message).expect("encodes");
    let header: [u8; HEADER_LEN] = frame[..HEADER_LEN].try_into().unwrap();
    let len = parse_header::<AgentMessage>(&header).expect("header");
    assert_eq!(len, frame.len() - HEADER_LEN);
    decode_body(&frame[HEADER_LEN..]).expect("body")
}

fn request_data(request: u64, receiver: &str, receiver_rank: u32, sender_rank: u32) -> RequestData {
    RequestData {
        request,
        receiver_instance: receiver.into(),
        receiver_rank,
        sender_rank,
        slot_tables: Vec::new(),
        token_range: TokenRange { start: 0, end: 100 },
        prompt_len: 100,
        dst_start_token: None,
        excluded_views: Vec::new(),
        bounce: None,
        integrity: None,
    }
}

fn ok(request: u64, pair: (u32, u32), piece: u32, is_last: bool, bytes: u64) -> Completion {
    Completion {
        request,
        sender_rank: pair.0,
        receiver_rank: pair.1,
        piece,
        is_last,
        bytes,
        fragments: 1,
        status: CompletionStatus::Ok,
        bounce: None,
        digest: None,
        views: None,
    }
}

fn failed(request: u64, pair: (u32, u32), piece: u32, is_last: bool) -> Completion {
    Completion {
        status: CompletionStatus::Failed("flush failed".into()),
        bounce: None,
        bytes: 0,
        fragments: 0,
        ..ok(request, pair, piece, is_last, 0)
    }
}

#[test]
fn a_chunked_request_between_two_tp2_instances_completes_once() {
    // The decode side asks both prefill ranks for both of its ranks' bytes, in 3 pieces.
    let pairs = [(0, 0), (1, 0), (0, 1), (1, 1)];
    let mut tracker = RequestTracker::new(7, 3, pairs);
    for &(c, g) in &pairs {
        let msg = AgentMessage::RequestData(request_data(7, "gen", g, c));
        let AgentMessage::RequestData(d) = wire(&msg) else {
            panic!("expected RequestData");
        };
        assert_eq!((d.sender_rank, d.receiver_rank), (c, g));
    }

    // The prefill side answers each pair in piece order; pairs interleave.
    let mut events = Vec::new();
    for piece in 0..3 {
        for &pair in pairs.iter().rev() {
            let msg = AgentMessage::Completion(ok(7, pair, piece, piece == 2, 1000));
            let AgentMessage::Completion(c) = wire(&msg) else {
                panic!("expected a completion");
            };
            events.push(tracker.on_completion(&c).unwrap());
        }
    }
    let completed: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, Tracked::Completed(_)))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        completed,
        vec![11],
        "completes exactly at the last completion"
    );
    assert_eq!(
        events[11],
        Tracked::Completed(Totals {
            bytes: 12_000,
            fragments: 12,
            pieces: 12,
            writers: 4
        })
    );
    assert_eq!(tracker.phase(), &Phase::Completed);
    assert!(tracker.quiescent());
    assert_eq!(tracker.missing().count(), 0);
}

#[test]
fn every_interleaving_of_ordered_pieces_completes_at_the_last_one() {
    // A small xorshift: shuffles of 3 pairs x 4 pieces that keep each pair's order.
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let pairs = [(0, 0), (1, 0), (2, 0)];
    for _ in 0..200 {
        let mut cursors = [0u32; 3];
        let mut tracker = RequestTracker::new(1, 4, pairs);
        for step in 0..12 {
            let open: Vec<usize> = (0..3).filter(|&i| cursors[i] < 4).collect();
            let i = open[(next() % open.len() as u64) as usize];
            let piece = cursors[i];
            cursors[i] += 1;
            let event = tracker
                .on_completion(&ok(1, pairs[i], piece, piece == 3, 10))
                .unwrap();
            if step == 11 {
                assert!(matches!(event, Tracked::Completed(t) if t.bytes == 120));
            } else {
                assert_eq!(event, Tracked::Progress);
                assert!(!tracker.quiescent());
            }
        }
    }
}

#[test]
fn a_failed_piece_fails_the_request_but_its_slots_wait_for_every_last_piece() {
    let pairs = [(0, 0), (1, 0)];
    let mut t = RequestTracker::new(9, 2, pairs);
    assert_eq!(
        t.on_completion(&ok(9, (0, 0), 0, false, 5)).unwrap(),
        Tracked::Progress
    );
    match t.on_completion(&failed(9, (1, 0), 0, false)).unwrap() {
        Tracked::Failed(f) => {
            assert_eq!((f.sender, f.receiver, f.piece), (1, 0, 0));
            assert_eq!(f.reason, "flush failed");
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    assert_eq!(t.phase(), &Phase::Failed);
    assert!(!t.quiescent(), "both writers still have a piece to report");
    assert_eq!(
        t.on_completion(&ok(9, (0, 0), 1, true, 5)).unwrap(),
        Tracked::Late
    );
    assert!(!t.quiescent());
    assert_eq!(
        t.on_completion(&ok(9, (1, 0), 1, true, 5)).unwrap(),
        Tracked::Late
    );
    assert!(t.quiescent());
    assert_eq!(
        t.totals().bytes,
        5,
        "bytes after the failure are not counted"
    );
}

#[test]
fn a_plan_failure_may_report_at_a_later_piece_as_the_last() {
    let mut t = RequestTracker::new(2, 4, [(0, 0)]);
    assert!(matches!(
        t.on_completion(&failed(2, (0, 0), 2, true)).unwrap(),
        Tracked::Failed(_)
    ));
    assert!(t.quiescent());
}

#[test]
fn failing_from_outside_keeps_the_slots_until_every_writer_is_done() {
    let mut t = RequestTracker::new(3, 1, [(0, 0), (0, 1)]);
    assert!(t.fail());
    assert!(!t.fail(), "failing twice reports nothing new");
    assert_eq!(t.phase(), &Phase::Failed);
    assert_eq!(
        t.on_completion(&ok(3, (0, 0), 0, true, 8)).unwrap(),
        Tracked::Late
    );
    assert!(!t.quiescent());
    assert_eq!(t.missing().collect::<Vec<_>>(), vec![(0, 1)]);
    assert_eq!(
        t.on_completion(&ok(3, (0, 1), 0, true, 8)).unwrap(),
        Tracked::Late
    );
    assert!(t.quiescent());
}

#[test]
fn a_request_nobody_writes_is_complete_and_quiescent_at_once() {
    let t = RequestTracker::new(4, 1, []);
    assert_eq!(t.phase(), &Phase::Completed);
    assert!(t.quiescent());
}

#[test]
fn hostile_completions_are_violations_named_by_request_pair_and_piece() {
    let fresh = || RequestTracker::new(11, 2, [(0, 0), (1, 0)]);
    let cases: Vec<(Vec<Completion>, &str)> = vec![
        (
            vec![ok(12, (0, 0), 0, false, 1)],
            "completion for request 12 fed to request 11",
        ),
        (
            vec![ok(11, (5, 0), 0, false, 1)],
            "prefill rank 5 -> decode rank 0 was not asked to write request 11",
        ),
        (
            vec![ok(11, (0, 0), 2, true, 1)],
            "request 11: prefill rank 0 -> decode rank 0 reports piece 2, but the request has 2 piece(s)",
        ),
        (
            vec![ok(11, (0, 0), 1, true, 1)],
            "request 11: prefill rank 0 -> decode rank 0 reports piece 1 where piece 0 is next",
        ),
        (
            vec![ok(11, (0, 0), 0, false, 1), ok(11, (0, 0), 0, false, 1)],
            "request 11: prefill rank 0 -> decode rank 0 reports piece 0 where piece 1 is next",
        ),
        (
            vec![ok(11, (0, 0), 0, true, 1)],
            "request 11: prefill rank 0 -> decode rank 0 piece 0 of 2 is marked last",
        ),
        (
            vec![ok(11, (0, 0), 0, false, 1), ok(11, (0, 0), 1, false, 1)],
            "request 11: prefill rank 0 -> decode rank 0 piece 1 of 2 is not marked last",
        ),
        (
            vec![
                ok(11, (0, 0), 0, false, 1),
                ok(11, (0, 0), 1, true, 1),
                ok(11, (0, 0), 1, true, 1),
            ],
            "request 11: prefill rank 0 -> decode rank 0 reports piece 1 after its last",
        ),
    ];
    for (completions, expected) in cases {
        let mut t = fresh();
        let (last, before) = completions.split_last().unwrap();
        for c in before {
            t.on_completion(c).unwrap();
        }
        let v: Violation = t.on_completion(last).unwrap_err();
        assert_eq!(v.to_string(), expected);
        if !matches!(
            v,
            Violation::OtherRequest { .. } | Violation::UnknownPair { .. }
        ) {
            assert_eq!(t.phase(), &Phase::Failed, "{expected}: the request fails");
        }
        assert!(
            !t.quiescent(),
            "{expected}: a broken writer does not free the slots"
        );
    }
}

#[test]
fn hostile_byte_flips_never_panic_the_codec_or_the_tracker() {
    let messages = [
        AgentMessage::RequestData(request_data(1, "gen", 0, 0)),
        AgentMessage::Completion(ok(1, (0, 0), 0, true, 3)),
        AgentMessage::Completion(failed(1, (0, 0), 0, true)),
        AgentMessage::Cancel {
            request: 1,
            reason: "gone".into(),
        },
    ];
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for message in &messages {
        let frame = encode(message).unwrap();
        for _ in 0..300 {
            let mut body = frame[HEADER_LEN..].to_vec();
            for _ in 0..1 + next() % 4 {
                let at = (next() % body.len() as u64) as usize;
                body[at] ^= 1 << (next() % 8);
            }
            // Either an error naming the problem, or some well-formed message, which the
            // tracker then accepts or refuses without panicking.
            if let Ok(m) = decode_body::<AgentMessage>(&body) {
                let _ = m.kind();
                if let AgentMessage::Completion(c) = m {
                    let _ = RequestTracker::new(1, 1, [(0, 0)]).on_completion(&c);
                }
            }
        }
    }
}

/// A failed piece may skip ahead (a plan that cannot be made is reported at the piece it
/// failed on), up to the request's last piece and no further; it may not go back. A failed
/// piece that repeats one already reported — the one just before, or any earlier — is out
/// of order and does not end the writer: the receiver keeps the slots on the word of a peer
/// that just broke the protocol.
#[test]
fn a_failed_piece_may_skip_ahead_to_the_last_piece_but_never_repeat_one() {
    let pair = (0, 0);
    let pieces = 3;
    // Pieces 0 and 1 reported Ok: piece 2 is next.
    let two_done = || {
        let mut t = RequestTracker::new(5, pieces, [pair, (1, 0)]);
        t.on_completion(&ok(5, pair, 0, false, 1)).unwrap();
        t.on_completion(&ok(5, pair, 1, false, 1)).unwrap();
        t
    };
    for repeated in [1, 0] {
        for is_last in [true, false] {
            let mut t = two_done();
            let v = t
                .on_completion(&failed(5, pair, repeated, is_last))
                .unwrap_err();
            assert_eq!(
                v,
                Violation::OutOfOrder {
                    request: 5,
                    sender: 0,
                    receiver: 0,
                    piece: repeated,
                    expected: 2
                },
                "a repeated failed piece {repeated}, last {is_last}"
            );
            assert_eq!(t.phase(), &Phase::Failed);
            assert!(t.open_pairs().any(|p| p == pair), "the writer is not ended");
            assert!(!t.quiescent());
            // Its real last piece still ends it.
            assert_eq!(
                t.on_completion(&failed(5, pair, 2, true)).unwrap(),
                Tracked::Late
            );
            assert!(!t.open_pairs().any(|p| p == pair));
        }
    }
    // The next piece itself may fail, and so may the last one (skipping ahead to it).
    let mut t = two_done();
    assert!(matches!(
        t.on_completion(&failed(5, pair, 2, true)).unwrap(),
        Tracked::Failed(f) if f.piece == 2
    ));
    let mut t = RequestTracker::new(5, pieces, [pair]);
    assert!(matches!(
        t.on_completion(&failed(5, pair, pieces - 1, true)).unwrap(),
        Tracked::Failed(f) if f.piece == pieces - 1
    ));
    assert!(t.quiescent());
    // One past the last piece is no piece of the request, failed or not.
    for status in [true, false] {
        let mut t = RequestTracker::new(5, pieces, [pair]);
        let c = if status {
            failed(5, pair, pieces, true)
        } else {
            ok(5, pair, pieces, true, 1)
        };
        assert_eq!(
            t.on_completion(&c).unwrap_err(),
            Violation::PieceOutOfRange {
                request: 5,
                sender: 0,
                receiver: 0,
                piece: pieces,
                pieces
            }
        );
        assert!(!t.quiescent());
    }
}

/// The same for a streamed request (no piece count): a failed piece repeating the one just
/// reported is a violation, not the writer's end.
#[test]
fn a_streamed_writer_cannot_end_on_a_repeated_failed_piece() {
    let pair = (2, 1);
    let mut t = RequestTracker::streaming(6, [pair]);
    t.on_completion(&ok(6, pair, 0, false, 1)).unwrap();
    t.on_completion(&ok(6, pair, 1, false, 1)).unwrap();
    assert_eq!(
        t.on_completion(&failed(6, pair, 1, true)).unwrap_err(),
        Violation::OutOfOrder {
            request: 6,
            sender: 2,
            receiver: 1,
            piece: 1,
            expected: 2
        }
    );
    assert!(!t.quiescent());
    assert_eq!(
        t.on_completion(&failed(6, pair, 2, true)).unwrap(),
        Tracked::Late
    );
    assert!(t.quiescent());
}
