//! Slot tables that do not cover a request's tokens are refused where the request enters,
//! before any byte moves: a short table used to read as holes past its end, so a
//! 40-token request with 16-token blocks and two-entry tables moved 32 tokens and was
//! reported `Received` and `Sent`. Repeated slots are refused too; a table longer than the
//! range is allowed and only its covered blocks move.

use crate::support;

use std::time::Duration;

use kvferry_planner_abi::TokenRange;
use kvferry_transfer::Role;
use kvferry_transfer::Transport;
use kvferry_transfer::agent::{CallError, Event, SendChunk};

use support::*;

/// The request: 40 tokens, 16-token blocks (three blocks), tables of two.
const PROMPT: u64 = 40;

fn refused(e: Result<(), CallError>) -> String {
    match e {
        Err(CallError::Invalid { reason, .. }) => reason,
        other => panic!("a short table was taken: {other:?}"),
    }
}

#[test]
fn short_tables_are_refused_at_send_and_expect_and_nothing_moves() {
    for transport in [Transport::Shm, Transport::Tcp] {
        let model = model();
        let src = Engine::new("prefill", &model, pattern);
        let dst = Engine::new("decode", &model, |_, _| CANARY);
        let prefill = agent(Role::Prefill, &src, secret(), transport);
        let decode = agent(Role::Decode, &dst, secret(), transport);
        let endpoint = prefill.endpoint().unwrap().to_string();

        // Both short.
        let reason = refused(decode.expect(expecting(1, &endpoint, tables(&dst, &[4, 2]), PROMPT)));
        for part in ["2 entries of 16 tokens", "run to 40", "takes 3 entries"] {
            assert!(reason.contains(part), "{transport}: {part:?} in {reason}");
        }
        let reason = refused(prefill.send(whole(1, tables(&src, &[3, 6]), PROMPT)));
        assert!(reason.contains("takes 3 entries"), "{transport}: {reason}");

        // Only the decode's short: its expect is refused, so nothing can claim the send.
        let reason = refused(decode.expect(expecting(2, &endpoint, tables(&dst, &[4, 2]), PROMPT)));
        assert!(reason.contains("takes 3 entries"), "{transport}: {reason}");

        // Only the prefill's short: refused at send, as the engine's error (not a peer's
        // `protocol` failure at the decode).
        let reason = refused(prefill.send(whole(3, tables(&src, &[3, 6]), PROMPT)));
        assert!(reason.contains("layer group 0"), "{transport}: {reason}");

        // A chunk needs only its own tokens covered: tokens 0..32 with two entries is whole.
        // Then the rest with the full table; the request lands byte for byte.
        decode
            .expect(expecting(4, &endpoint, tables(&dst, &[4, 2, 7]), PROMPT))
            .unwrap();
        prefill
            .send(SendChunk {
                request: 4,
                tables: tables(&src, &[3, 6]),
                tokens: TokenRange { start: 0, end: 32 },
                prompt_len: PROMPT,
                is_last: false,
                to: Some("decode".into()),
                views: None,
            })
            .unwrap();
        let reason = refused(prefill.send(SendChunk {
            request: 4,
            tables: tables(&src, &[3, 6]),
            tokens: TokenRange {
                start: 32,
                end: PROMPT,
            },
            prompt_len: PROMPT,
            is_last: true,
            to: Some("decode".into()),
            views: None,
        }));
        assert!(reason.contains("takes 3 entries"), "{transport}: {reason}");
        prefill
            .send(SendChunk {
                request: 4,
                tables: tables(&src, &[3, 6, 1]),
                tokens: TokenRange {
                    start: 32,
                    end: PROMPT,
                },
                prompt_len: PROMPT,
                is_last: true,
                to: Some("decode".into()),
                views: None,
            })
            .unwrap();
        let got = wait(&decode, 4, Duration::from_secs(20));
        let Event::Received { stats, .. } = got else {
            panic!("{transport}: {got:?}");
        };
        let sent = wait(&prefill, 4, Duration::from_secs(20));
        assert!(
            matches!(sent, Event::Sent { bytes, .. } if bytes == stats.bytes),
            "{transport}: {sent:?}"
        );
        // Nothing of the refused requests was held or claimed.
        assert!(decode.poll().is_empty() && prefill.poll().is_empty());
        assert_eq!((prefill.requests_held(), decode.requests_held()), (0, 0));
        drop(decode);
        drop(prefill);
        // The last block holds 8 of its 16 tokens: only those rows move.
        check(&src, &dst, &[3, 6], &[4, 2], Some((1, 7)));
    }
}

#[test]
fn a_longer_table_moves_only_the_covered_blocks_and_repeated_slots_are_refused() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Shm);
    let decode = agent(Role::Decode, &dst, secret(), Transport::Shm);
    let endpoint = prefill.endpoint().unwrap().to_string();

    let reason = refused(decode.expect(expecting(1, &endpoint, tables(&dst, &[4, 2, 4]), PROMPT)));
    assert!(
        reason.contains("slot 4 is named for blocks 0 and 2"),
        "{reason}"
    );
    let reason = refused(prefill.send(whole(1, tables(&src, &[3, 3, 1]), PROMPT)));
    assert!(
        reason.contains("slot 3 is named for blocks 0 and 1"),
        "{reason}"
    );

    // Five entries for a three-block request: blocks 3 and 4 (slots 0 and 5 here) stay
    // untouched on the decode side.
    decode
        .expect(expecting(
            2,
            &endpoint,
            tables(&dst, &[4, 2, 7, 0, 5]),
            PROMPT,
        ))
        .unwrap();
    prefill
        .send(whole(2, tables(&src, &[3, 6, 1, 2, 4]), PROMPT))
        .unwrap();
    let got = wait(&decode, 2, Duration::from_secs(20));
    assert!(matches!(got, Event::Received { .. }), "{got:?}");
    assert!(matches!(
        wait(&prefill, 2, Duration::from_secs(20)),
        Event::Sent { .. }
    ));
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[3, 6], &[4, 2], Some((1, 7)));
}
