//! Bounce transfers between two agents in one process (`transfer-semantics.md` §9): the
//! prefill rank gathers each piece into its staging buffer and puts the packed image into
//! the decode rank's arena, which scatters it by its own plan. Every destination slot must
//! hold its source's bytes and every other byte its canary, with bounce on and off, over
//! tcp and shm; a request too large for the arena goes fragment by fragment; a writer that
//! lies about a bounced piece fails its request by name and moves no byte into the slots; a
//! cancel with bounced puts in flight ends only after them, and nothing is scattered after it.

use crate::support;

use std::time::Duration;

use kvferry_transfer::Role;
use kvferry_transfer::Transport;
use kvferry_transfer::agent::{Agent, BounceConfig, BounceMode, Event, FailureKind};

use support::*;

fn bouncing(role: Role, engine: &Engine, transport: Transport, bounce: BounceConfig) -> Agent {
    start(role, engine, secret(), bound(), |config| {
        config.transport = transport.into();
        config.bounce = bounce;
    })
}

fn on() -> BounceConfig {
    BounceConfig {
        mode: BounceMode::On,
        // Small halves, so a request takes several chunks through the staging buffer.
        staging_bytes: 24 << 10,
        ..BounceConfig::default()
    }
}

#[test]
fn a_chunked_request_bounces_byte_for_byte_over_tcp_and_shm() {
    for transport in [Transport::Tcp, Transport::Shm] {
        for bounce in [on(), BounceConfig::off()] {
            let model = model();
            let src = Engine::new("prefill", &model, pattern);
            let dst = Engine::new("decode", &model, |_, _| CANARY);
            let prefill = bouncing(Role::Prefill, &src, transport, bounce);
            let decode = bouncing(Role::Decode, &dst, transport, bounce);
            let got = chunked_request(&prefill, &decode, &src, &dst);
            let Event::Received { stats, .. } = got else {
                panic!("{transport} bounce {}: {got:?}", bounce.mode);
            };
            assert_eq!(stats.pieces, 2);
            // Scattered here exactly when bouncing.
            assert_eq!(
                stats.stages.scatter_ns > 0,
                bounce.mode == BounceMode::On,
                "{transport} bounce {}: {stats:?}",
                bounce.mode
            );
            drop(decode);
            drop(prefill);
            check(&src, &dst, &[3, 6, 1, 7], &[4, 2, 7, 5], Some((5, 0)));
        }
    }
}

#[test]
fn auto_bounces_small_fragments_over_tcp_and_not_within_the_node() {
    // Head dims 32 and 64: 8 KiB and 16 KiB slots, below and at auto's 16 KiB threshold on
    // the mean fragment.
    for (transport, head_dim, bounced) in [
        (Transport::Tcp, 32, true),
        (Transport::Tcp, 64, false),
        (Transport::Shm, 32, false),
    ] {
        let model = kvferry_testkit::builder::Model::gqa(2, 2, head_dim, 16);
        let src = Engine::new("prefill", &model, pattern);
        let dst = Engine::new("decode", &model, |_, _| CANARY);
        let auto = BounceConfig {
            mode: BounceMode::Auto,
            min_blocks: 1,
            ..BounceConfig::default()
        };
        let prefill = bouncing(Role::Prefill, &src, transport, auto);
        let decode = bouncing(Role::Decode, &dst, transport, auto);
        let Event::Received { stats, .. } = chunked_request(&prefill, &decode, &src, &dst) else {
            panic!("{transport}: not received");
        };
        assert_eq!(
            stats.stages.scatter_ns > 0,
            bounced,
            "{transport}, head dim {head_dim}: {stats:?}"
        );
        drop(decode);
        drop(prefill);
        check(&src, &dst, &[3, 6, 1, 7], &[4, 2, 7, 5], Some((5, 0)));
    }
}

#[test]
fn a_request_larger_than_the_arena_goes_fragment_by_fragment() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let small = BounceConfig {
        arena_bytes: 4096,
        ..on()
    };
    let prefill = bouncing(Role::Prefill, &src, Transport::Tcp, on());
    let decode = bouncing(Role::Decode, &dst, Transport::Tcp, small);
    let Event::Received { stats, .. } = chunked_request(&prefill, &decode, &src, &dst) else {
        panic!("not received");
    };
    assert_eq!(stats.stages.scatter_ns, 0, "{stats:?}");
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[3, 6, 1, 7], &[4, 2, 7, 5], Some((5, 0)));
}

#[test]
fn regions_are_reused_request_after_request() {
    // An arena that holds one request at a time: each must give its region back.
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let slot_bytes: u64 = dst.info.page_table.pools.iter().map(|p| p.slot_bytes).sum();
    let one = BounceConfig {
        arena_bytes: 2 * slot_bytes,
        ..on()
    };
    let prefill = bouncing(Role::Prefill, &src, Transport::Tcp, on());
    let decode = bouncing(Role::Decode, &dst, Transport::Tcp, one);
    let endpoint = prefill.endpoint().unwrap().to_string();
    for (k, (s, d)) in [([0i64, 1], [2i64, 3]), ([4, 5], [6, 7]), ([2, 3], [0, 1])]
        .into_iter()
        .enumerate()
    {
        let id = 100 + k as u64;
        decode
            .expect(expecting(id, &endpoint, tables(&dst, &d), 32))
            .unwrap();
        prefill.send(whole(id, tables(&src, &s), 32)).unwrap();
        let Event::Received { stats, .. } = wait(&decode, id, Duration::from_secs(20)) else {
            panic!("request {id} not received");
        };
        assert!(stats.stages.scatter_ns > 0, "request {id} did not bounce");
        assert!(matches!(
            wait(&prefill, id, Duration::from_secs(20)),
            Event::Sent { .. }
        ));
    }
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[0, 1, 4, 5, 2, 3], &[2, 3, 6, 7, 0, 1], None);
}

#[test]
fn a_cancel_with_bounced_puts_in_flight_scatters_nothing_after_cancelled() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let mut dst = Engine::new("decode", &model, |_, _| CANARY);
    let (gate, flushing) = FlushGate::new(Duration::from_millis(400));
    let hook: std::sync::Arc<dyn kvferry_transfer::harness::rank::WriteHook> = gate;
    let prefill = start(Role::Prefill, &src, secret(), bound(), |config| {
        config.transport = Transport::Tcp.into();
        config.bounce = on();
        config.harness.hook = Some(hook);
    });
    let decode = bouncing(Role::Decode, &dst, Transport::Tcp, on());
    cancel_mid_write(prefill, decode, &src, &mut dst, flushing);
}

mod hostile {
    use super::*;

    use kvferry_protocol::BouncedPiece;

    /// A prefill rank under a real one's description that answers every claim with a
    /// successful bounced last piece of `bytes` bytes at `offset`, writing nothing.
    fn lying_bouncer(real: &Agent, bytes: u64, offset: u64) -> String {
        lying_context(real, move |d| {
            assert!(d.bounce.is_some(), "no region offered: {d:?}");
            let piece = BouncedPiece {
                offset,
                tokens: d.token_range,
            };
            made_up_completion(d, bytes, Some(piece))
        })
    }

    #[test]
    fn a_bounced_piece_of_the_wrong_length_or_place_is_refused_and_scatters_nothing() {
        let model = model();
        let src = Engine::new("prefill", &model, pattern);
        let dst = Engine::new("decode", &model, |_, _| CANARY);
        let real = bouncing(Role::Prefill, &src, Transport::Tcp, on());
        let slot_bytes: u64 = dst.info.page_table.pools.iter().map(|p| p.slot_bytes).sum();
        let right = 2 * slot_bytes;
        for (request, bytes, offset, says) in [
            (21, 4096, 0, "own plan of them says"),
            (22, right, 1 << 40, "region whose next free byte"),
        ] {
            let decode = bouncing(Role::Decode, &dst, Transport::Tcp, on());
            let endpoint = lying_bouncer(&real, bytes, offset);
            decode
                .expect(expecting(request, &endpoint, tables(&dst, &[0, 1]), 32))
                .unwrap();
            match wait(&decode, request, Duration::from_secs(10)) {
                Event::Failed { kind, detail, .. } => {
                    assert_eq!(kind, FailureKind::Protocol, "{detail}");
                    assert!(detail.contains(says), "{detail}");
                }
                other => panic!("a lying bounce was believed: {other:?}"),
            }
        }
        drop(real);
        check(&src, &dst, &[], &[], None);
    }
}
