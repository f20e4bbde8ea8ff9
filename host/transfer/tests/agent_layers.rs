//! Layer-wise sends between two agents in one process: a Llama-shaped model laid out as vLLM
//! keeps it (each layer its own group, view and pool), its prompt sent chunk by chunk and,
//! inside each chunk, layer by layer, as the engine computes them. Every destination slot
//! must hold its source's bytes and every other byte its canary — over tcp and shm, with
//! bounce transfers and with per-piece digests, which the receiver checks by planning each
//! layer-wise piece over the views it names. The receiver completes only once every layer
//! of every chunk landed; a send that breaks the sequence is refused and takes nothing.

use crate::support;

use std::time::Duration;

use kvferry_planner_abi::{TokenRange, ViewId};
use kvferry_protocol::Integrity;
use kvferry_testkit::builder::Model;
use kvferry_transfer::Role;
use kvferry_transfer::Transport;
use kvferry_transfer::agent::{Agent, AgentConfig, BounceConfig, BounceMode, Event, SendChunk};

use support::*;

const LAYERS: u32 = 4;

/// 4 layers, 8 KV heads of 128, 16 tokens per block, one group per layer.
fn per_layer() -> Model {
    Model {
        layer_groups: true,
        ..model()
    }
}

fn layer(l: u32) -> ViewId {
    ViewId { group: l, view: 0 }
}

fn part(
    engine: &Engine,
    slots: &[i64],
    tokens: TokenRange,
    prompt: u64,
    views: Option<Vec<ViewId>>,
    is_last: bool,
) -> SendChunk {
    SendChunk {
        request: 7,
        tables: tables(engine, slots),
        tokens,
        prompt_len: prompt,
        is_last,
        to: Some("decode".into()),
        views,
    }
}

/// Sends request 7 (70 tokens, 5 blocks) in two chunks, each layer by layer, and returns
/// the decode side's terminal event.
fn layer_by_layer(prefill: &Agent, decode: &Agent, src: &Engine, dst: &Engine) -> Event {
    let src_slots = [3i64, 6, 1, 7, 5];
    let dst_slots = [4i64, 2, 7, 5, 0];
    let prompt = 70;
    let endpoint = prefill.endpoint().unwrap().to_string();
    decode
        .expect(expecting(7, &endpoint, tables(dst, &dst_slots), prompt))
        .unwrap();
    let chunks = [
        (&src_slots[..2], TokenRange { start: 0, end: 32 }),
        (
            &src_slots[..],
            TokenRange {
                start: 32,
                end: prompt,
            },
        ),
    ];
    for (slots, tokens) in chunks {
        for l in 0..LAYERS {
            let last = tokens.end == prompt && l + 1 == LAYERS;
            prefill
                .send(part(src, slots, tokens, prompt, Some(vec![layer(l)]), last))
                .unwrap();
        }
    }
    let got = wait(decode, 7, Duration::from_secs(20));
    let sent = wait(prefill, 7, Duration::from_secs(20));
    assert!(matches!(sent, Event::Sent { .. }), "{sent:?}");
    got
}

fn with(role: Role, engine: &Engine, tweak: impl FnOnce(&mut AgentConfig)) -> Agent {
    start(role, engine, secret(), bound(), tweak)
}

#[test]
fn a_request_sent_layer_by_layer_lands_byte_for_byte() {
    let bounce_on = BounceConfig {
        mode: BounceMode::On,
        staging_bytes: 24 << 10,
        ..BounceConfig::default()
    };
    // (transport, bounce, digests)
    let cases = [
        (Transport::Tcp, BounceConfig::off(), None),
        (Transport::Shm, BounceConfig::off(), None),
        (Transport::Tcp, bounce_on, None),
        (Transport::Tcp, BounceConfig::off(), Some(Integrity::Xxh3)),
        (Transport::Shm, bounce_on, Some(Integrity::Xxh3)),
    ];
    for (transport, bounce, integrity) in cases {
        let case = format!("{transport} bounce {} digests {integrity:?}", bounce.mode);
        let model = per_layer();
        let src = Engine::new("prefill", &model, pattern);
        let dst = Engine::new("decode", &model, |_, _| CANARY);
        assert_eq!(src.info.page_table.groups.len(), LAYERS as usize);
        let prefill = with(Role::Prefill, &src, |c| {
            c.transport = transport.into();
            c.bounce = bounce;
        });
        let decode = with(Role::Decode, &dst, |c| {
            c.transport = transport.into();
            c.bounce = bounce;
            c.integrity = integrity;
        });
        let got = layer_by_layer(&prefill, &decode, &src, &dst);
        let Event::Received { stats, .. } = got else {
            panic!("{case}: {got:?}");
        };
        // Two chunks of four layers each.
        assert_eq!(stats.pieces, 2 * LAYERS, "{case}: {stats:?}");
        // The agents' own counters say the same.
        let (sent, got) = (prefill.stats(), decode.stats());
        assert_eq!((sent.sent, got.received), (1, 1), "{case}");
        assert_eq!(got.pieces, u64::from(2 * LAYERS), "{case}");
        assert_eq!(got.bytes, stats.bytes, "{case}");
        assert_eq!(sent.bytes, stats.bytes, "{case}");
        assert_eq!(got.latency_us.iter().sum::<u64>(), 1, "{case}");
        assert_eq!((got.failed_total(), got.in_flight), (0, 0), "{case}");
        // Scattering and digest checks take time here exactly when they happen.
        assert_eq!(
            stats.stages.scatter_ns > 0,
            bounce.mode == BounceMode::On || integrity.is_some(),
            "{case}: {stats:?}"
        );
        drop(decode);
        drop(prefill);
        check(&src, &dst, &[3, 6, 1, 7], &[4, 2, 7, 5], Some((5, 0)));
    }
}

#[test]
fn the_receiver_completes_only_once_every_layer_landed() {
    let model = per_layer();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();
    let (slots, prompt) = ([2i64, 5], 20);
    decode
        .expect(expecting(7, &endpoint, tables(&dst, &slots), prompt))
        .unwrap();
    let all = TokenRange {
        start: 0,
        end: prompt,
    };
    // Layers 0 and 2 first, then 1: three of four.
    for views in [vec![layer(0), layer(2)], vec![layer(1)]] {
        prefill
            .send(part(&src, &slots, all, prompt, Some(views), false))
            .unwrap();
    }
    // Those layers land; the request is not done while layer 3 is not sent.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let pool = |l: usize| dst.bytes(l)[2 * 16 * 8 * 128 * 2 * 2 + 5] != CANARY;
    while !(pool(0) && pool(1) && pool(2)) {
        assert!(decode.poll().is_empty(), "an event before the last layer");
        assert!(
            std::time::Instant::now() < deadline,
            "layers 0-2 never landed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(decode.poll().is_empty(), "an event before the last layer");
    assert!(!pool(3), "layer 3 written before it was sent");
    // `views: None` carries every view not sent yet: layer 3.
    prefill
        .send(part(&src, &slots, all, prompt, None, true))
        .unwrap();
    let got = wait(&decode, 7, Duration::from_secs(20));
    let Event::Received { stats, .. } = got else {
        panic!("{got:?}");
    };
    assert_eq!(stats.pieces, 3);
    assert!(matches!(
        wait(&prefill, 7, Duration::from_secs(20)),
        Event::Sent { .. }
    ));
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[2], &[2], Some((5, 5)));
}

#[test]
fn sends_that_break_the_layer_sequence_are_refused_and_take_nothing() {
    let model = per_layer();
    let src = Engine::new("prefill", &model, pattern);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let slots = [1i64, 2, 3];
    let prompt = 40;
    let first = TokenRange { start: 0, end: 32 };
    let rest = TokenRange {
        start: 32,
        end: prompt,
    };
    let refused = |s: SendChunk, needle: &str| {
        let err = prefill.send(s).unwrap_err().to_string();
        assert!(err.contains(needle), "{needle:?} not in: {err}");
    };
    refused(
        part(&src, &slots, first, prompt, Some(vec![]), false),
        "names no view",
    );
    refused(
        part(&src, &slots, first, prompt, Some(vec![layer(9)]), false),
        "view (group 9, view 0) is not a view of this rank's page table",
    );
    refused(
        part(
            &src,
            &slots,
            first,
            prompt,
            Some(vec![layer(1), layer(1)]),
            false,
        ),
        "named twice",
    );
    // A first chunk that ends the prompt with every view must say it is the last.
    refused(
        part(
            &src,
            &slots,
            TokenRange {
                start: 0,
                end: prompt,
            },
            prompt,
            None,
            false,
        ),
        "is_last must mark exactly",
    );
    prefill
        .send(part(
            &src,
            &slots,
            first,
            prompt,
            Some(vec![layer(0)]),
            false,
        ))
        .unwrap();
    refused(
        part(&src, &slots, first, prompt, Some(vec![layer(0)]), false),
        "view (group 0, view 0) of tokens 0..32 was sent already",
    );
    refused(
        part(&src, &slots, rest, prompt, Some(vec![layer(1)]), false),
        "3 view(s) of tokens 0..32 are not sent yet",
    );
    prefill
        .send(part(&src, &slots, first, prompt, None, false))
        .unwrap();
    // The chunk is whole: the next starts where it ended; the last send ends the prompt.
    refused(
        part(&src, &slots, first, prompt, Some(vec![layer(1)]), false),
        "does not follow 32",
    );
    refused(
        part(&src, &slots, rest, prompt, None, false),
        "is_last must mark exactly",
    );
    prefill
        .send(part(
            &src,
            &slots,
            rest,
            prompt,
            Some(vec![layer(3)]),
            false,
        ))
        .unwrap();
    refused(
        part(&src, &slots, rest, prompt, Some(vec![layer(0)]), true),
        "is_last must mark exactly",
    );
    prefill
        .send(part(
            &src,
            &slots,
            rest,
            prompt,
            Some(vec![layer(0), layer(1), layer(2)]),
            true,
        ))
        .unwrap();
    // Nothing more after the last.
    refused(
        part(&src, &slots, rest, prompt, Some(vec![layer(0)]), false),
        "unknown or has ended",
    );
}
