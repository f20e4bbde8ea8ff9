//! The agent's checks of what a peer declares, at their exact edges: a prefill rank's pool key
//! must cover its whole pool (a key one byte short is refused, one of exactly the pool's
//! footprint is taken), a decode rank's bounce offer must lie inside the arena it
//! declared (an offer ending on the arena's last byte is taken, one byte past is refused),
//! and a piece bounces only into an offered region it fits to the byte.

use crate::support;

use kvferry_planner_abi::{SlotTable, TokenRange};
use std::time::Duration;

use kvferry_protocol::{
    AgentEvent, AgentMessage, AgentMetadata, AgentSession, BounceOffer, Completion,
    CompletionStatus, RequestData, read_frame, write_frame,
};
use kvferry_transfer::Role;
use kvferry_transfer::Transport;
use kvferry_transfer::agent::{BounceConfig, BounceMode, CallError, Event, SendChunk};

use support::*;

/// A prefill rank's metadata whose pool keys are cut or moved a byte at a time: the agent
/// takes a key covering exactly the pool's footprint (or more: what the key really maps is
/// the rank thread's check), and refuses one a byte short, or starting a byte off the pool,
/// naming the pool.
#[test]
fn a_pool_key_one_byte_short_of_its_pool_is_refused() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let real = AgentMetadata::from_bytes(&prefill.local_metadata().unwrap()).unwrap();
    let pools = real.rank.info.page_table.pools.len();
    decode
        .add_peer(&real.to_bytes().unwrap())
        .expect("the real metadata");

    for p in 0..pools {
        let (base, footprint) = {
            let pool = &real.rank.info.page_table.pools[p];
            (pool.base, pool.footprint())
        };
        let with = |key_base: u64, key_len: u64| {
            let mut m = real.clone();
            m.rank.pools[p].base = key_base;
            m.rank.pools[p].len = key_len;
            decode.add_peer(&m.to_bytes().unwrap())
        };
        for len in [footprint, footprint + 1] {
            with(base, len).unwrap_or_else(|e| panic!("pool {p}: a {len}-byte key: {e}"));
        }
        for (key_base, key_len) in [
            (base, footprint - 1),
            (base, 1),
            (base + 1, footprint),
            (base - 1, footprint + 1),
        ] {
            match with(key_base, key_len) {
                Err(CallError::Metadata(reason)) => assert_eq!(
                    reason,
                    format!(
                        "pool {p}: its key covers {key_base:#x}+{key_len} but the pool spans \
                         {base:#x}+{footprint}"
                    )
                ),
                other => panic!("pool {p}: key {key_base:#x}+{key_len} taken: {other:?}"),
            }
        }
    }
}

/// A claim of a 32-token request for 33 tokens, offering `bounce`: refused either way, and
/// the reason says whether the offer passed (the token check comes after it).
fn claim(tables: Vec<SlotTable>, bounce: Option<BounceOffer>) -> AgentMessage {
    AgentMessage::RequestData(RequestData {
        request: 1,
        receiver_instance: "decode".into(),
        receiver_rank: 0,
        sender_rank: 0,
        slot_tables: tables,
        token_range: TokenRange { start: 0, end: 33 },
        prompt_len: 32,
        dst_start_token: None,
        excluded_views: Vec::new(),
        bounce,
        integrity: None,
    })
}

/// The next completion the prefill rank sends.
fn completion(s: &mut SecurePeer, session: &mut AgentSession) -> Completion {
    loop {
        let m: AgentMessage = read_frame(s).unwrap();
        match session.receive(m).unwrap() {
            AgentEvent::Completion(c) => return c,
            AgentEvent::Nothing => {}
            other => panic!("{other:?}"),
        }
    }
}

fn refusal(s: &mut SecurePeer, session: &mut AgentSession) -> String {
    loop {
        let m: AgentMessage = read_frame(s).unwrap();
        match session.receive(m).unwrap() {
            AgentEvent::Completion(c) => match &c.status {
                CompletionStatus::Failed(reason) => {
                    assert!(c.is_last && c.bytes == 0, "{c:?}");
                    return reason.clone();
                }
                other => panic!("a hostile claim was answered {other:?}: {c:?}"),
            },
            AgentEvent::Nothing => {}
            other => panic!("{other:?}"),
        }
    }
}

/// Offers of the region at each edge of the arena a decode rank declared: the whole
/// arena, its last byte, its first byte pass; one byte longer, one byte later, one byte
/// past its end, and offers whose end overflows are refused by name. A rank that declared
/// no arena may offer nothing.
#[test]
fn a_bounce_offer_one_byte_past_the_declared_arena_is_refused() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let on = BounceConfig {
        mode: BounceMode::On,
        arena_bytes: 1 << 20,
        ..BounceConfig::default()
    };
    let decode = start(Role::Decode, &dst, secret(), bound(), |config| {
        config.transport = Transport::Tcp.into();
        config.bounce = on;
    });
    let me = AgentMetadata::from_bytes(&decode.local_metadata().unwrap()).unwrap();
    let arena = me.rank.bounce.as_ref().expect("a declared arena").len;
    assert!(arena >= 1 << 20, "{arena}");
    let endpoint = prefill.endpoint().unwrap().to_string();
    let (mut s, mut session, _hand) = authenticated(&endpoint, &decode);
    let mut offer = |offset: u64, len: u64| {
        let tables = tables(&dst, &[0, 1]);
        write_frame(&mut s, &claim(tables, Some(BounceOffer { offset, len }))).unwrap();
        refusal(&mut s, &mut session)
    };
    let passed = "tokens 0..33 of a 32-token prompt";
    for (offset, len) in [(0, arena), (arena - 1, 1), (0, 1), (1, arena - 1)] {
        assert_eq!(offer(offset, len), passed, "{offset}+{len}");
    }
    for (offset, len) in [
        (0, arena + 1),
        (1, arena),
        (arena, 1),
        (arena - 1, 2),
        (u64::MAX, 1),
        (1, u64::MAX),
    ] {
        assert_eq!(
            offer(offset, len),
            format!(
                "it offers bounce region {offset}+{len}, which is not inside its declared arena"
            )
        );
    }
    drop(s);
    drop(decode);

    // No arena declared: no offer is inside it.
    let plain = start(Role::Decode, &dst, secret(), bound(), |config| {
        config.transport = Transport::Tcp.into();
        config.bounce = BounceConfig::off();
    });
    let me = AgentMetadata::from_bytes(&plain.local_metadata().unwrap()).unwrap();
    assert!(me.rank.bounce.is_none());
    let (mut s, mut session, _hand) = authenticated(&endpoint, &plain);
    write_frame(
        &mut s,
        &claim(
            tables(&dst, &[0, 1]),
            Some(BounceOffer { offset: 0, len: 1 }),
        ),
    )
    .unwrap();
    assert_eq!(
        refusal(&mut s, &mut session),
        "it offers bounce region 0+1, which is not inside its declared arena"
    );
    write_frame(&mut s, &claim(tables(&dst, &[0, 1]), None)).unwrap();
    assert_eq!(refusal(&mut s, &mut session), passed);
    drop(s);
    drop(plain);
    drop(prefill);
    check(&src, &dst, &[], &[], None);
}

/// A piece goes through the offered region only when it fits it to the byte: into a region
/// of exactly its size, at the arena's very end, it bounces; into one a byte short it goes
/// fragment by fragment (its completion says which). The region is offered by a session
/// posing as a bouncing decode rank, whose worker (the real rank's) takes the puts.
#[test]
fn a_piece_bounces_only_into_an_offered_region_it_fits_to_the_byte() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let on = BounceConfig {
        mode: BounceMode::On,
        arena_bytes: 1 << 20,
        ..BounceConfig::default()
    };
    let bouncing = |role, engine| {
        start(role, engine, secret(), bound(), |config| {
            config.transport = Transport::Tcp.into();
            config.bounce = on;
        })
    };
    let prefill = bouncing(Role::Prefill, &src);
    let decode = bouncing(Role::Decode, &dst);
    let me = AgentMetadata::from_bytes(&decode.local_metadata().unwrap()).unwrap();
    let arena = me.rank.bounce.as_ref().expect("a declared arena").len;
    // Two whole blocks of every pool.
    let total: u64 = 2 * dst
        .info
        .page_table
        .pools
        .iter()
        .map(|p| p.slot_bytes)
        .sum::<u64>();
    let (mut s, mut session, _hand) = authenticated(prefill.endpoint().unwrap(), &decode);
    for (request, len, bounced) in [
        (11, total, true),
        (12, total - 1, false),
        (13, total + 1, true),
    ] {
        prefill
            .send(SendChunk {
                request,
                tables: tables(&src, &[0, 1]),
                tokens: TokenRange { start: 0, end: 32 },
                prompt_len: 32,
                is_last: true,
                to: Some("decode".into()),
                views: None,
            })
            .unwrap();
        let offer = BounceOffer {
            offset: arena - len,
            len,
        };
        let claim = AgentMessage::RequestData(RequestData {
            request,
            receiver_instance: "decode".into(),
            receiver_rank: 0,
            sender_rank: 0,
            slot_tables: tables(&dst, &[0, 1]),
            token_range: TokenRange { start: 0, end: 32 },
            prompt_len: 32,
            dst_start_token: None,
            excluded_views: Vec::new(),
            bounce: Some(offer),
            integrity: None,
        });
        write_frame(&mut s, &claim).unwrap();
        let c = completion(&mut s, &mut session);
        assert_eq!(c.status, CompletionStatus::Ok, "{offer:?}: {c:?}");
        assert!(c.is_last, "{c:?}");
        assert_eq!(c.bytes, total, "{c:?}");
        assert_eq!(
            c.bounce.map(|b| b.offset),
            bounced.then_some(0),
            "a {len}-byte region for a {total}-byte piece: {c:?}"
        );
        assert!(
            matches!(
                wait(&prefill, request, Duration::from_secs(10)),
                Event::Sent { .. }
            ),
            "request {request}"
        );
    }
}
