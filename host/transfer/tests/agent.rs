//! Two agents in one process, each over "engine" memory the test owns: a prefill rank and a
//! decode rank of a GQA model, tp1 -> tp1. Every destination slot of a request must hold its
//! source slot's bytes afterwards and every other destination byte its canary; a wrong
//! secret is refused by name and moves nothing; a cancel ends in exactly one event.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use kvferry_plan::error_chain;
use kvferry_planner_abi::{SlotTable, TokenRange};
use kvferry_transfer::Role;
use kvferry_transfer::Transport;
use kvferry_transfer::agent::{
    Agent, AgentConfig, DecodeAgent, Event, FailureKind, PrefillAgent, Secret, SendChunk,
};
use kvferry_transfer::harness::rank::WriteHook;

use support::*;

#[test]
fn a_chunked_request_lands_byte_for_byte_over_tcp_and_shm() {
    for transport in [Transport::Tcp, Transport::Shm] {
        let model = model();
        let src = Engine::new("prefill", &model, pattern);
        let dst = Engine::new("decode", &model, |_, _| CANARY);
        let prefill = agent(Role::Prefill, &src, secret(), transport);
        let decode = agent(Role::Decode, &dst, secret(), transport);
        let endpoint = prefill.endpoint().unwrap().to_string();
        assert!(endpoint.starts_with("127.0.0.1:"), "{endpoint}");

        // 5 blocks of 16 tokens, prompt 70 tokens, sent in two chunks; scattered slots.
        let src_slots = [3i64, 6, 1, 7, 5];
        let dst_slots = [4i64, 2, 7, 5, 0];
        let prompt = 70;
        decode
            .expect(expecting(7, &endpoint, tables(&dst, &dst_slots), prompt))
            .unwrap();
        prefill
            .send(SendChunk {
                request: 7,
                tables: tables(&src, &src_slots[..2]),
                tokens: TokenRange { start: 0, end: 32 },
                prompt_len: prompt,
                is_last: false,
                to: Some("decode".into()),
                views: None,
            })
            .unwrap();
        prefill
            .send(SendChunk {
                request: 7,
                tables: tables(&src, &src_slots),
                tokens: TokenRange {
                    start: 32,
                    end: prompt,
                },
                prompt_len: prompt,
                is_last: true,
                to: Some("decode".into()),
                views: None,
            })
            .unwrap();
        let got = wait(&decode, 7, Duration::from_secs(20));
        let Event::Received { stats, .. } = got else {
            panic!("{transport}: {got:?}");
        };
        assert_eq!(stats.pieces, 2, "{transport}");
        let sent = wait(&prefill, 7, Duration::from_secs(20));
        assert!(
            matches!(sent, Event::Sent { bytes, .. } if bytes == stats.bytes),
            "{sent:?}"
        );
        assert_eq!((prefill.requests_held(), decode.requests_held()), (0, 0));
        drop(decode);
        drop(prefill);
        // The last block holds 6 of its 16 tokens: only those rows move.
        check(
            &src,
            &dst,
            &src_slots[..4],
            &dst_slots[..4],
            Some((src_slots[4], dst_slots[4])),
        );
    }
}

#[test]
fn typed_agents_start_only_for_their_role_and_move_a_request() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let config = |role, engine: &Engine| {
        let mut c = AgentConfig::new(role_name(role), role, engine.info.clone(), secret());
        c.listen = "127.0.0.1:0".into();
        c
    };
    // SAFETY: the engines' buffers outlive the agents, which are dropped first.
    let wrong = unsafe { DecodeAgent::start(config(Role::Prefill, &src), bound()) };
    let text = error_chain(&wrong.unwrap_err());
    assert!(
        text.contains("role is prefill, but a decode agent was asked for"),
        "{text}"
    );
    // SAFETY: as above.
    let wrong = unsafe { PrefillAgent::start(config(Role::Decode, &dst), bound()) };
    let text = error_chain(&wrong.unwrap_err());
    assert!(
        text.contains("role is decode, but a prefill agent was asked for"),
        "{text}"
    );

    // SAFETY: as above.
    let prefill = unsafe { PrefillAgent::start(config(Role::Prefill, &src), bound()) }.unwrap();
    // SAFETY: as above.
    let decode = unsafe { DecodeAgent::start(config(Role::Decode, &dst), bound()) }.unwrap();
    let slots = [2i64, 5];
    decode
        .expect(expecting(3, prefill.endpoint(), tables(&dst, &slots), 32))
        .unwrap();
    prefill.send(whole(3, tables(&src, &slots), 32)).unwrap();
    let received = wait(decode.as_agent(), 3, Duration::from_secs(20));
    assert!(matches!(received, Event::Received { .. }), "{received:?}");
    let sent = wait(prefill.as_agent(), 3, Duration::from_secs(20));
    assert!(matches!(sent, Event::Sent { .. }), "{sent:?}");
    check(&src, &dst, &slots, &slots, None);
    // Back to the role-agnostic agent, and not into the other role.
    let agent: Agent = prefill.into();
    assert!(DecodeAgent::try_from(agent).is_err());
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

#[test]
fn a_peer_without_the_secret_is_refused_by_name_and_moves_nothing() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let wrong = Secret::new(b"another secret, also 32 bytes!!!".to_vec()).unwrap();
    let decode = agent(Role::Decode, &dst, wrong, Transport::Tcp);
    prefill.send(whole(1, tables(&src, &[0]), 16)).unwrap();
    decode
        .expect(expecting(
            1,
            prefill.endpoint().unwrap(),
            tables(&dst, &[0]),
            16,
        ))
        .unwrap();
    match wait(&decode, 1, Duration::from_secs(10)) {
        Event::Failed { kind, detail, .. } => {
            assert_eq!(kind, FailureKind::Refused, "{detail}");
            assert!(detail.contains("shared secret"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[], &[], None);
}

#[test]
fn bad_requests_are_refused_before_anything_is_taken() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let slots = src.info.page_table.pools[0].num_slots as i64;
    let err = prefill
        .send(whole(1, tables(&src, &[slots]), 16))
        .unwrap_err();
    assert!(err.to_string().contains("outside pool"), "{err}");
    let err = prefill
        .send(SendChunk {
            request: 1,
            tables: tables(&src, &[0]),
            tokens: TokenRange { start: 0, end: 17 },
            prompt_len: 16,
            is_last: true,
            to: None,
            views: None,
        })
        .unwrap_err();
    assert!(err.to_string().contains("16-token prompt"), "{err}");
    assert_eq!(prefill.requests_held(), 0);
}

#[test]
fn an_unclaimed_send_fails_at_its_lease_and_a_cancel_ends_in_one_event() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let bound = bound();
    let mut config = AgentConfig::new("prefill", Role::Prefill, src.info.clone(), secret());
    config.listen = "127.0.0.1:0".into();
    config.lease = Duration::from_millis(200);
    // SAFETY: `src` outlives the agent.
    let prefill = unsafe { Agent::start(config, bound) }.unwrap();
    let send = |request| whole(request, tables(&src, &[0]), 16);
    prefill.send(send(1)).unwrap();
    prefill.send(send(2)).unwrap();
    prefill.cancel(2).unwrap();
    assert_eq!(
        wait(&prefill, 2, Duration::from_secs(5)),
        Event::Cancelled { request: 2 }
    );
    assert!(prefill.cancel(2).is_err(), "an ended request is unknown");
    match wait(&prefill, 1, Duration::from_secs(5)) {
        Event::Failed { kind, .. } => assert_eq!(kind, FailureKind::Lease),
        other => panic!("{other:?}"),
    }
    assert_eq!(prefill.requests_held(), 0);
}

#[test]
fn a_send_its_receiver_cancelled_first_ends_at_once_not_at_its_lease() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let mut dst = Engine::new("decode", &model, |_, _| CANARY);
    let lease = Duration::from_secs(30);
    let prefill = start(Role::Prefill, &src, secret(), bound(), |c| c.lease = lease);
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();
    let soon = Duration::from_secs(5);

    // Expected, then cancelled at once: the cancel may overtake the expect's linking (no
    // claim was ever sent) or follow its claim (stashed here, no send yet). Either way the
    // decode side ends once the prefill rank answered, and the send that comes later ends
    // at once, as cancelled by that peer.
    for id in [1, 2, 3] {
        decode
            .expect(expecting(id, &endpoint, tables(&dst, &[0]), 16))
            .unwrap();
        if id > 1 {
            std::thread::sleep(Duration::from_millis(200));
        }
        decode.cancel(id).unwrap();
        assert_eq!(wait(&decode, id, soon), Event::Cancelled { request: id });
        // Waiting at most 5 s of the 30 s lease: ending at the lease fails the wait.
        prefill.send(whole(id, tables(&src, &[0]), 16)).unwrap();
        match wait(&prefill, id, soon) {
            Event::Failed {
                kind, peer, detail, ..
            } => {
                assert_eq!(kind, FailureKind::CancelledByPeer, "{detail}");
                assert!(peer.is_some_and(|p| p.contains("decode")), "{detail}");
            }
            other => panic!("request {id}: {other:?}"),
        }
    }

    // Sent first, then expected and cancelled before this rank wrote it: the send ends
    // with the cancel.
    prefill.send(whole(4, tables(&src, &[0]), 16)).unwrap();
    decode
        .expect(expecting(4, &endpoint, tables(&dst, &[0]), 16))
        .unwrap();
    // Under load the whole transfer may finish before the cancel: then the cancel finds
    // nothing to end and both sides report it done.
    let _ = decode.cancel(4);
    match wait(&decode, 4, soon) {
        Event::Cancelled { .. } | Event::Received { .. } => {}
        other => panic!("{other:?}"),
    }
    match wait(&prefill, 4, soon) {
        Event::Failed { kind, .. } => assert_eq!(kind, FailureKind::CancelledByPeer),
        Event::Sent { .. } => {} // it was written before the cancel reached the prefill rank
        other => panic!("{other:?}"),
    }
    // Both sides ended it, so its slot is the engine's again, written or not: reused here,
    // and nothing of request 4 may land in it after this (the final check).
    for p in 0..dst.buffers.len() {
        let stride = dst.info.page_table.pools[p].slot_stride as usize;
        dst.bytes_mut(p)[..stride].fill(CANARY);
    }

    // An id cancelled and then asked for again: the new claim supersedes the cancel, and
    // the request moves every byte.
    decode
        .expect(expecting(5, &endpoint, tables(&dst, &[1]), 16))
        .unwrap();
    decode.cancel(5).unwrap();
    assert_eq!(wait(&decode, 5, soon), Event::Cancelled { request: 5 });
    decode
        .expect(expecting(5, &endpoint, tables(&dst, &[1]), 16))
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    prefill.send(whole(5, tables(&src, &[2]), 16)).unwrap();
    assert!(matches!(wait(&prefill, 5, soon), Event::Sent { .. }));
    assert!(matches!(wait(&decode, 5, soon), Event::Received { .. }));
    drop((prefill, decode));
    check(&src, &dst, &[2], &[1], None);
}

#[test]
fn a_cancel_from_another_decode_instance_does_not_end_a_send_bound_to_its_receiver() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let other = Engine::new("intruder", &model, |_, _| CANARY);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    // Another instance that holds the secret, expecting and cancelling the victim's id first.
    let intruder = start(Role::Decode, &other, secret(), bound(), |c| {
        c.instance = "intruder".into()
    });
    let endpoint = prefill.endpoint().unwrap().to_string();
    let soon = Duration::from_secs(5);
    intruder
        .expect(expecting(8, &endpoint, tables(&other, &[0]), 16))
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    intruder.cancel(8).unwrap();
    assert_eq!(wait(&intruder, 8, soon), Event::Cancelled { request: 8 });
    // The send names its receiver: the intruder's cancel is not its to give.
    prefill
        .send(SendChunk {
            to: Some("decode".into()),
            ..whole(8, tables(&src, &[3]), 16)
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        prefill.poll().is_empty(),
        "the intruder's cancel ended the send"
    );
    decode
        .expect(expecting(8, &endpoint, tables(&dst, &[6]), 16))
        .unwrap();
    assert!(matches!(wait(&prefill, 8, soon), Event::Sent { .. }));
    assert!(matches!(wait(&decode, 8, soon), Event::Received { .. }));
    drop((prefill, decode, intruder));
    check(&src, &dst, &[3], &[6], None);
}

#[test]
fn a_cancel_with_puts_in_flight_ends_only_after_the_last_write() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let mut dst = Engine::new("decode", &model, |_, _| CANARY);
    let (gate, flushing) = FlushGate::new(Duration::from_millis(400));
    let hook: Arc<dyn WriteHook> = gate;
    let prefill = agent_with(Role::Prefill, &src, secret(), Transport::Tcp, Some(hook));
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    cancel_mid_write(prefill, decode, &src, &mut dst, flushing);
}

mod hostile {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    use kvferry_protocol::{
        AgentEvent, AgentMessage, AgentSession, CompletionStatus, RequestData, encode, read_frame,
        write_frame,
    };

    fn connect(endpoint: &str) -> TcpStream {
        let s = TcpStream::connect(endpoint).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    }

    /// Whether the server closed the connection answering nothing but, at most, the
    /// handshake's refusal (an empty reply, `[0, 0]`).
    fn closed_silently(mut s: TcpStream) -> bool {
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest.is_empty() || rest == [0, 0]
    }

    fn claim(request: u64, tables: Vec<SlotTable>, end: u64, prompt: u64) -> AgentMessage {
        AgentMessage::RequestData(RequestData {
            request,
            receiver_instance: "decode".into(),
            receiver_rank: 0,
            sender_rank: 0,
            slot_tables: tables,
            token_range: TokenRange { start: 0, end },
            prompt_len: prompt,
            dst_start_token: None,
            excluded_views: Vec::new(),
            bounce: None,
            integrity: None,
        })
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

    /// A prefill rank that answers every claim with a successful last piece of `bytes`
    /// bytes, writing nothing, under the description of a real one.
    fn lying_about_bytes(real: &Agent, bytes: u64) -> String {
        lying_context(real, move |d| made_up_completion(d, bytes, None))
    }

    #[test]
    fn a_writer_that_reports_bytes_it_did_not_write_fails_the_request() {
        let model = model();
        let src = Engine::new("prefill", &model, pattern);
        let dst = Engine::new("decode", &model, |_, _| CANARY);
        let real = agent(Role::Prefill, &src, secret(), Transport::Tcp);
        let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
        let endpoint = lying_about_bytes(&real, 4096);
        decode
            .expect(expecting(9, &endpoint, tables(&dst, &[0, 1]), 32))
            .unwrap();
        match wait(&decode, 9, Duration::from_secs(10)) {
            Event::Failed { kind, detail, .. } => {
                assert_eq!(kind, FailureKind::Protocol, "{detail}");
                assert!(detail.contains("reported 4096 bytes"), "{detail}");
            }
            other => panic!("a made-up byte count was believed: {other:?}"),
        }
    }

    #[test]
    fn hostile_frames_are_refused_by_name_and_an_honest_transfer_works_after() {
        let model = model();
        let src = Engine::new("prefill", &model, pattern);
        let dst = Engine::new("decode", &model, |_, _| CANARY);
        let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
        let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
        let endpoint = prefill.endpoint().unwrap().to_string();
        let send = |request| SendChunk {
            request,
            tables: tables(&src, &[0, 1]),
            tokens: TokenRange { start: 0, end: 32 },
            prompt_len: 32,
            is_last: true,
            to: Some("decode".into()),
            views: None,
        };
        prefill.send(send(1)).unwrap();

        // Unauthenticated: a request in the clear, a shutdown-like error frame, garbage,
        // a frame of another family: each connection is closed and told nothing.
        let mut s = connect(&endpoint);
        write_frame(&mut s, &claim(1, tables(&dst, &[0, 1]), 32, 32)).unwrap();
        assert!(closed_silently(s));
        let mut s = connect(&endpoint);
        let error = AgentMessage::Error {
            message: "shut down".into(),
        };
        write_frame(&mut s, &error).unwrap();
        assert!(closed_silently(s));
        let mut s = connect(&endpoint);
        s.write_all(&[0xff; 4096]).unwrap();
        assert!(closed_silently(s));
        let mut s = connect(&endpoint);
        // A well-formed frame of another family (the CLI's control family, `KVFC`).
        let mut other = encode(&AgentMessage::Ping).unwrap();
        other[..4].copy_from_slice(b"KVFC");
        s.write_all(&other).unwrap();
        assert!(closed_silently(s));
        // Another secret: the handshake is refused, nothing more is said.
        let other = Secret::new(b"not this deployment's secret".to_vec()).unwrap();
        let e = SecurePeer::dial(&endpoint, &other).err();
        assert!(
            matches!(e, Some(kvferry_protocol::secure::HandshakeError::Refused)),
            "{e:?}"
        );

        // Authenticated but hostile: slots outside the pool, tokens outside the prompt,
        // another instance's claim — each refused by name, no byte written.
        let (mut s, mut session, _hand) = authenticated(&endpoint, &decode);
        let slots = dst.info.page_table.pools[0].num_slots as i64;
        write_frame(&mut s, &claim(1, tables(&dst, &[0, slots]), 32, 32)).unwrap();
        let reason = refusal(&mut s, &mut session);
        assert!(reason.contains("outside pool"), "{reason}");
        write_frame(&mut s, &claim(1, tables(&dst, &[0, 1]), 33, 32)).unwrap();
        let reason = refusal(&mut s, &mut session);
        assert!(reason.contains("32-token prompt"), "{reason}");
        // A table one block short of the tokens it claims: the prefill would write a partial
        // request and the claimant's own plan would vouch for it.
        write_frame(&mut s, &claim(1, tables(&dst, &[0]), 32, 32)).unwrap();
        let reason = refusal(&mut s, &mut session);
        assert!(reason.contains("takes 2 entries"), "{reason}");
        let mut other = claim(1, tables(&dst, &[0, 1]), 32, 32);
        if let AgentMessage::RequestData(d) = &mut other {
            d.receiver_instance = "victim".into();
        }
        write_frame(&mut s, &other).unwrap();
        let reason = refusal(&mut s, &mut session);
        assert!(reason.contains("cannot claim"), "{reason}");
        drop(s);
        check(&src, &dst, &[], &[], None);

        // The honest peer is served afterwards.
        decode
            .expect(expecting(1, &endpoint, tables(&dst, &[3, 4]), 32))
            .unwrap();
        let got = wait(&decode, 1, Duration::from_secs(10));
        assert!(matches!(got, Event::Received { .. }), "{got:?}");
        assert!(matches!(
            wait(&prefill, 1, Duration::from_secs(10)),
            Event::Sent { .. }
        ));
        drop(decode);
        drop(prefill);
        check(&src, &dst, &[0, 1], &[3, 4], None);
    }
}

#[test]
fn a_dropped_agent_closes_its_side_channel() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();
    assert!(std::net::TcpStream::connect(&endpoint).is_ok());
    drop(prefill);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(&endpoint).is_ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "{endpoint} still accepts"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn requests_expected_together_share_one_link_to_their_prefill_rank() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();
    // Four requests at once, before any link exists; each in its own two slots.
    for request in 0..4u64 {
        let slots = [request as i64 * 2, request as i64 * 2 + 1];
        decode
            .expect(expecting(request, &endpoint, tables(&dst, &slots), 32))
            .unwrap();
    }
    for request in 0..4u64 {
        let slots = [request as i64, 7 - request as i64];
        prefill
            .send(whole(request, tables(&src, &slots), 32))
            .unwrap();
    }
    let ids = [0u64, 1, 2, 3];
    for (_, got) in wait_all(&decode, &ids, Duration::from_secs(10)) {
        assert!(matches!(got, Event::Received { .. }), "{got:?}");
    }
    for (_, got) in wait_all(&prefill, &ids, Duration::from_secs(10)) {
        assert!(matches!(got, Event::Sent { .. }), "{got:?}");
    }
    assert_eq!(decode.connections(), 1);
    assert_eq!(prefill.connections(), 1);
    drop(decode);
    drop(prefill);
    check(
        &src,
        &dst,
        &[0, 7, 1, 6, 2, 5, 3, 4],
        &[0, 1, 2, 3, 4, 5, 6, 7],
        None,
    );
}

#[test]
fn a_full_side_channel_closes_its_oldest_stranger_for_a_newcomer_and_serves_honest_peers() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = start(Role::Prefill, &src, secret(), bound(), |c| {
        c.max_connections = 2
    });
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();
    // Two strangers hold both places (they never say a word).
    let mut strangers: Vec<_> = (0..2)
        .map(|_| std::net::TcpStream::connect(&endpoint).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    // A third takes the place of the oldest, which is closed at once (not at its handshake
    // deadline): a full listener turns nobody away while a connection of it is unproven.
    let third = std::net::TcpStream::connect(&endpoint).unwrap();
    strangers[0]
        .set_read_timeout(Some(Duration::from_secs(4)))
        .unwrap();
    let mut buf = [0u8; 8];
    let closed = std::io::Read::read(&mut strangers[0], &mut buf);
    assert!(
        match &closed {
            Ok(n) => *n == 0,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        },
        "the oldest stranger is still open: {closed:?}"
    );
    drop(third);
    drop(strangers);
    std::thread::sleep(Duration::from_millis(100));
    prefill.send(whole(1, tables(&src, &[0]), 16)).unwrap();
    decode
        .expect(expecting(1, &endpoint, tables(&dst, &[3]), 16))
        .unwrap();
    let got = wait(&decode, 1, Duration::from_secs(10));
    assert!(matches!(got, Event::Received { .. }), "{got:?}");
}
