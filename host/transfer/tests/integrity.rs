//! End-to-end integrity digests (`AgentConfig::integrity`): a decode rank that asks for
//! them gets `Received` only when every piece's bytes in its slots hash as its writer's
//! source bytes did — over tcp and shm, bounced or not, with either digest — and a writer
//! whose bytes never landed, though it reports every one of them, fails the request as
//! `FailureKind::Integrity`, naming the piece.

use crate::support;

use std::time::Duration;

use kvferry_planner_abi::TokenRange;
use kvferry_protocol::{Completion, Integrity, PieceDigest};
use kvferry_transfer::Role;
use kvferry_transfer::Transport;
use kvferry_transfer::agent::{Agent, BounceConfig, BounceMode, Event, FailureKind};

use support::*;

fn with_integrity(
    role: Role,
    engine: &Engine,
    transport: Transport,
    bounce: BounceConfig,
    integrity: Option<Integrity>,
) -> Agent {
    start(role, engine, secret(), bound(), |config| {
        config.transport = transport.into();
        config.bounce = bounce;
        config.integrity = integrity;
    })
}

fn bounce_on() -> BounceConfig {
    BounceConfig {
        mode: BounceMode::On,
        staging_bytes: 24 << 10,
        ..BounceConfig::default()
    }
}

#[test]
fn every_piece_checks_out_over_tcp_and_shm_bounced_or_not() {
    for transport in [Transport::Tcp, Transport::Shm] {
        for bounce in [BounceConfig::off(), bounce_on()] {
            for algorithm in [Integrity::Xxh3, Integrity::Crc32c] {
                let model = model();
                let src = Engine::new("prefill", &model, pattern);
                let dst = Engine::new("decode", &model, |_, _| CANARY);
                // The sender computes what the receiver asks, whatever its own setting.
                let prefill = with_integrity(Role::Prefill, &src, transport, bounce, None);
                let decode = with_integrity(Role::Decode, &dst, transport, bounce, Some(algorithm));
                let got = chunked_request(&prefill, &decode, &src, &dst);
                let Event::Received { stats, .. } = got else {
                    panic!("{transport} bounce {} {algorithm}: {got:?}", bounce.mode);
                };
                assert_eq!(stats.pieces, 2);
                assert!(
                    stats.stages.scatter_ns > 0,
                    "{transport} bounce {} {algorithm}: the check takes time",
                    bounce.mode
                );
                drop(decode);
                drop(prefill);
                check(&src, &dst, &[3, 6, 1, 7], &[4, 2, 7, 5], Some((5, 0)));
            }
        }
    }
}

/// A prefill rank that answers the claim for tokens 0..32 with exactly the bytes this rank's
/// plan expects, and a digest, but writes nothing: only the digest can tell.
fn lying_with_a_digest(real: &Agent, digest: Option<PieceDigest>) -> String {
    // 32 tokens of 4 layers × 8 KV heads × 128 × 2 bytes, K and V.
    const PLANNED: u64 = 32 * 4 * 8 * 128 * 2 * 2;
    lying_context(real, move |d| Completion {
        digest,
        ..made_up_completion(d, PLANNED, None)
    })
}

#[test]
fn a_writer_that_writes_nothing_but_reports_every_byte_fails_as_integrity() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let real = with_integrity(
        Role::Prefill,
        &src,
        Transport::Tcp,
        BounceConfig::off(),
        None,
    );
    let tokens = TokenRange { start: 0, end: 32 };
    for algorithm in [Integrity::Xxh3, Integrity::Crc32c] {
        let decode = with_integrity(
            Role::Decode,
            &dst,
            Transport::Tcp,
            BounceConfig::off(),
            Some(algorithm),
        );
        let endpoint = lying_with_a_digest(
            &real,
            Some(PieceDigest {
                tokens,
                value: 0x1234,
            }),
        );
        decode
            .expect(expecting(9, &endpoint, tables(&dst, &[0, 1]), 32))
            .unwrap();
        match wait(&decode, 9, Duration::from_secs(10)) {
            Event::Failed { kind, detail, .. } => {
                assert_eq!(kind, FailureKind::Integrity, "{detail}");
                assert!(detail.contains("piece 0 (tokens 0..32)"), "{detail}");
                assert!(
                    detail.contains(&format!("the {algorithm} digest")),
                    "{detail}"
                );
                assert!(detail.contains("0x0000000000001234"), "{detail}");
            }
            other => panic!("{algorithm}: bytes that never came were received: {other:?}"),
        }
        // A writer that leaves the digest out is refused too, by name. To a decode rank of
        // its own: a second liar under `real`'s identity is refused by one that holds a live
        // link to the first (see `squatting.rs`).
        drop(decode);
        let decode = with_integrity(
            Role::Decode,
            &dst,
            Transport::Tcp,
            BounceConfig::off(),
            Some(algorithm),
        );
        let endpoint = lying_with_a_digest(&real, None);
        decode
            .expect(expecting(10, &endpoint, tables(&dst, &[0, 1]), 32))
            .unwrap();
        match wait(&decode, 10, Duration::from_secs(10)) {
            Event::Failed { kind, detail, .. } => {
                assert_eq!(kind, FailureKind::Protocol, "{detail}");
                assert!(detail.contains("without the"), "{detail}");
            }
            other => panic!("{algorithm}: a piece without its digest was taken: {other:?}"),
        }
    }
    // Without the digest the same lie is believed: what the option is for.
    let decode = with_integrity(
        Role::Decode,
        &dst,
        Transport::Tcp,
        BounceConfig::off(),
        None,
    );
    let endpoint = lying_with_a_digest(&real, None);
    decode
        .expect(expecting(11, &endpoint, tables(&dst, &[0, 1]), 32))
        .unwrap();
    let got = wait(&decode, 11, Duration::from_secs(10));
    assert!(matches!(got, Event::Received { .. }), "{got:?}");
    drop(decode);
    drop(real);
    check(&src, &dst, &[], &[], None);
}

/// A decode rank cannot check device memory with the CPU: refused at start, by name.
#[test]
fn integrity_over_device_pools_is_refused_at_start() {
    let model = model();
    let mut dst = Engine::new("decode", &model, |_, _| CANARY);
    for p in dst.info.page_table.pools.iter_mut() {
        p.memory_type = kvferry_planner_abi::MemoryType::VRAM;
    }
    let mut config = kvferry_transfer::agent::AgentConfig::new(
        "decode",
        Role::Decode,
        dst.info.clone(),
        secret(),
    );
    config.integrity = Some(Integrity::Xxh3);
    // SAFETY: refused before any pool is touched (the configuration is checked first).
    let refused = unsafe { Agent::start(config, bound()) }.unwrap_err();
    let message = refused.to_string();
    assert!(message.contains("integrity xxh3"), "{message}");
    assert!(message.contains("device pools"), "{message}");
}
