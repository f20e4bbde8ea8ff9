//! Identity squatting: a holder of the secret that presents a live
//! prefill rank's identity — its instance, rank and epoch — when a decode rank dials it
//! (an `expect` named its endpoint) is refused, and the decode rank's live link to the real
//! rank, its directory entry and the requests on it go on as they were: the next honest
//! request is written byte for byte.

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use kvferry_protocol::{
    AgentEvent, AgentMessage, AgentMetadata, AgentSession, read_frame, write_frame,
};
use kvferry_transfer::Role;
use kvferry_transfer::Transport;
use kvferry_transfer::agent::{Agent, Event, FailureKind};

use support::*;

/// What a squatter heard from the decode rank after it presented its metadata.
#[derive(Debug, PartialEq, Eq)]
enum Heard {
    /// The decode rank refused it, in these words.
    Refused(String),
    /// The decode rank took it as the rank and claimed this request from it.
    Claimed(u64),
    /// The decode rank closed the connection without a word.
    Closed,
}

/// A side-channel listener holding the secret that presents another rank's identity.
struct Squatter {
    /// Its side channel.
    endpoint: String,
    /// What the decode rank said to it first.
    heard: Receiver<Heard>,
    /// Set: it closes its connection at the next message it reads (the decode rank's
    /// keep-alives come every second).
    leave: Arc<AtomicBool>,
}

/// A [`Squatter`] on a new loopback port that answers the first decode rank to dial it with
/// `claim` (a prefill rank's identity, its metadata as the caller made it), then tells what
/// the decode rank said first: a refusal, a claim, or nothing. Taken for the rank, it
/// answers each keep-alive with its own (so its link stays up) and nothing else, until the
/// decode rank closes the connection or it is told to leave.
fn squatter(claim: AgentMetadata) -> Squatter {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    let (tx, heard) = channel();
    let leave = Arc::new(AtomicBool::new(false));
    let leaving = Arc::clone(&leave);
    std::thread::spawn(move || {
        let Some(mut s) = SecurePeer::accept(&listener, &secret()) else {
            return;
        };
        let mut session = AgentSession::accept();
        let mut told = false;
        let mut tell = |what: Heard| {
            if !std::mem::replace(&mut told, true) {
                let _ = tx.send(what);
            }
        };
        loop {
            // Ends when the decode rank closes the connection, when told to leave, or after
            // 10 s without a message (`SecurePeer`'s read timeout).
            let Ok(m) = read_frame::<AgentMessage>(&mut s) else {
                tell(Heard::Closed);
                return;
            };
            if leaving.load(Ordering::Acquire) {
                return;
            }
            let reply = match session.receive(m) {
                Ok(AgentEvent::Metadata(_)) => session.admit(claim.clone()).unwrap(),
                Ok(AgentEvent::RequestData(d)) => {
                    tell(Heard::Claimed(d.request));
                    continue;
                }
                Ok(AgentEvent::Nothing) => AgentMessage::Ping,
                Ok(_) => continue,
                Err(kvferry_protocol::AgentError::PeerError { message }) => {
                    tell(Heard::Refused(message));
                    return;
                }
                Err(_) => return,
            };
            if write_frame(&mut s, &reply).is_err() {
                return;
            }
        }
    });
    Squatter {
        endpoint,
        heard,
        leave,
    }
}

/// The terminal events of `requests` on `agent` that come within `limit` (fewer when some
/// do not end by then: the caller says which it missed).
fn terminal_events(agent: &Agent, requests: &[u64], limit: Duration) -> BTreeMap<u64, Event> {
    let deadline = Instant::now() + limit;
    let mut got = BTreeMap::new();
    while got.len() < requests.len() && Instant::now() < deadline {
        for e in agent.poll() {
            assert!(requests.contains(&e.request()), "another request: {e:?}");
            assert!(got.insert(e.request(), e).is_none(), "two terminal events");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    got
}

/// A prefill and a decode agent over loopback tcp, linked by request 1 (slots 0 and 1 into
/// 0 and 1), which is checked `Received`.
fn linked(src: &Engine, dst: &Engine) -> (Agent, Agent) {
    let prefill = agent(Role::Prefill, src, secret(), Transport::Tcp);
    let decode = agent(Role::Decode, dst, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();
    decode
        .expect(expecting(1, &endpoint, tables(dst, &[0, 1]), 32))
        .unwrap();
    prefill.send(whole(1, tables(src, &[0, 1]), 32)).unwrap();
    let got = wait(&decode, 1, Duration::from_secs(20));
    assert!(matches!(got, Event::Received { .. }), "request 1: {got:?}");
    assert_eq!(decode.connections(), 1);
    (prefill, decode)
}

/// Request 3 through the real rank's endpoint (slots 2 and 3 into 4 and 5): `Received`,
/// and both sides' ends of the one link still open.
fn honest_request_after(prefill: &Agent, decode: &Agent, src: &Engine, dst: &Engine) {
    let endpoint = prefill.endpoint().unwrap().to_string();
    decode
        .expect(expecting(3, &endpoint, tables(dst, &[4, 5]), 32))
        .unwrap();
    prefill.send(whole(3, tables(src, &[2, 3]), 32)).unwrap();
    let got = wait(decode, 3, Duration::from_secs(20));
    assert!(
        matches!(got, Event::Received { .. }),
        "the honest request after the squatter: {got:?}"
    );
    let sent = wait(prefill, 3, Duration::from_secs(20));
    assert!(matches!(sent, Event::Sent { .. }), "{sent:?}");
    assert_eq!(decode.connections(), 1, "the decode rank's links");
    assert_eq!(prefill.connections(), 1, "the prefill rank's links");
}

/// A holder of the secret presents the live prefill rank's metadata, its own UCX worker in
/// place of the real one, when the decode rank dials it for request 2: the decode rank
/// refuses it, naming the identity and the live link's endpoint, and request 2 fails as
/// refused in those words. Request 3 to the real rank, expected as soon as the squatter
/// has had its answer (while request 2 may still be open), is written byte for byte over the
/// live link. (Before the fix, the squatter's link replaced the live one: request 3 went to
/// the squatter and did not end.)
#[test]
fn a_second_claimant_of_a_live_prefill_rank_is_refused_and_the_live_link_serves_on() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let (prefill, decode) = linked(&src, &dst);
    let real = AgentMetadata::from_bytes(&prefill.local_metadata().unwrap()).unwrap();
    let identity = real.identity().to_string();
    let endpoint = prefill.endpoint().unwrap().to_string();

    let hand = HandWorker::start();
    let mut claim = real.clone();
    claim.rank.worker_address = hand.address.clone();
    let squatting = squatter(claim);
    decode
        .expect(expecting(2, &squatting.endpoint, tables(&dst, &[6, 7]), 32))
        .unwrap();
    // Once the squatter has had its answer (before the fix: it was taken for the rank).
    let heard = squatting.heard.recv_timeout(Duration::from_secs(20));

    decode
        .expect(expecting(3, &endpoint, tables(&dst, &[4, 5]), 32))
        .unwrap();
    prefill.send(whole(3, tables(&src, &[2, 3]), 32)).unwrap();
    let mut got = terminal_events(&decode, &[2, 3], Duration::from_secs(20));
    let honest = got.remove(&3);
    assert!(
        matches!(honest, Some(Event::Received { .. })),
        "the honest request after the squatter (None: it did not end in 20 s): {honest:?}"
    );
    match got.remove(&2).unwrap() {
        Event::Failed { kind, detail, .. } => {
            assert_eq!(kind, FailureKind::Refused, "{detail}");
            for needle in [
                identity.as_str(),
                squatting.endpoint.as_str(),
                &format!("a live link to it exists at {endpoint}"),
                "UCX worker address",
            ] {
                assert!(detail.contains(needle), "`{needle}` not in: {detail}");
            }
        }
        other => panic!("the squatter's request: {other:?}"),
    }
    match heard {
        Ok(Heard::Refused(reason)) => {
            assert!(reason.contains(&identity), "{reason}");
            assert!(reason.contains("a live link to it exists"), "{reason}");
        }
        other => panic!("the squatter heard {other:?}"),
    }
    let sent = wait(&prefill, 3, Duration::from_secs(20));
    assert!(matches!(sent, Event::Sent { .. }), "{sent:?}");
    assert_eq!(decode.connections(), 1, "the decode rank's links");
    assert_eq!(prefill.connections(), 1, "the prefill rank's links");

    // And the one after that too.
    decode
        .expect(expecting(4, &endpoint, tables(&dst, &[3]), 16))
        .unwrap();
    prefill.send(whole(4, tables(&src, &[6]), 16)).unwrap();
    let got = wait(&decode, 4, Duration::from_secs(20));
    assert!(matches!(got, Event::Received { .. }), "request 4: {got:?}");
    drop(decode);
    drop(prefill);
    drop(hand);
    check(&src, &dst, &[0, 1, 2, 3, 6], &[0, 1, 4, 5, 3], None);
}

/// A claimant of the live prefill rank that is the real rank's metadata with another
/// advertised endpoint (its own) is refused as well, naming the difference, and the next
/// honest request is written over the live link.
#[test]
fn a_second_claimant_that_advertises_another_endpoint_is_refused() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let (prefill, decode) = linked(&src, &dst);
    let real = AgentMetadata::from_bytes(&prefill.local_metadata().unwrap()).unwrap();
    let identity = real.identity().to_string();

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let own = listener.local_addr().unwrap().to_string();
    drop(listener);
    let mut claim = real.clone();
    claim.endpoint = Some(own);
    let squatting = squatter(claim);
    decode
        .expect(expecting(2, &squatting.endpoint, tables(&dst, &[6, 7]), 32))
        .unwrap();
    match wait(&decode, 2, Duration::from_secs(20)) {
        Event::Failed { kind, detail, .. } => {
            assert_eq!(kind, FailureKind::Refused, "{detail}");
            assert!(detail.contains(&identity), "{detail}");
            assert!(detail.contains("advertised endpoint"), "{detail}");
        }
        other => panic!("the squatter's request: {other:?}"),
    }
    assert!(
        matches!(
            squatting.heard.recv_timeout(Duration::from_secs(20)),
            Ok(Heard::Refused(_))
        ),
        "the squatter was not refused"
    );
    honest_request_after(&prefill, &decode, &src, &dst);
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[0, 1, 2, 3], &[0, 1, 4, 5], None);
}

/// A claimant whose metadata is byte for byte the live rank's (the same rank reached at
/// another address, or a copy of its metadata) gets no link of its own: the decode rank
/// closes that connection without a word, claims the request that named it from the real
/// rank over the live link, and keeps that one link.
#[test]
fn a_claimant_identical_to_the_live_rank_is_served_by_the_live_link() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let (prefill, decode) = linked(&src, &dst);
    let real = AgentMetadata::from_bytes(&prefill.local_metadata().unwrap()).unwrap();

    let copy = squatter(real);
    decode
        .expect(expecting(2, &copy.endpoint, tables(&dst, &[6, 7]), 32))
        .unwrap();
    prefill.send(whole(2, tables(&src, &[4, 5]), 32)).unwrap();
    let got = wait(&decode, 2, Duration::from_secs(20));
    assert!(matches!(got, Event::Received { .. }), "request 2: {got:?}");
    assert_eq!(
        copy.heard.recv_timeout(Duration::from_secs(20)),
        Ok(Heard::Closed),
        "the copy's connection"
    );
    assert_eq!(decode.connections(), 1, "the decode rank's links");

    honest_request_after(&prefill, &decode, &src, &dst);
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[0, 1, 4, 5, 2, 3], &[0, 1, 6, 7, 4, 5], None);
}

/// Restarts are told apart by epoch, and epochs are random per start: a claimant with an
/// epoch this rank has not seen is a restart and replaces the live link — so a holder of the
/// secret can still displace a live rank this way (there are no per-rank keys). While the
/// newer start's link lives, the start it replaced is refused as older (here the real rank,
/// reached at its own endpoint); once that link ends, the real rank is linked again and
/// writes the next request byte for byte.
#[test]
fn a_newer_epoch_replaces_the_live_link_and_the_older_is_refused_while_it_lives() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let (prefill, decode) = linked(&src, &dst);
    let real = AgentMetadata::from_bytes(&prefill.local_metadata().unwrap()).unwrap();
    let endpoint = prefill.endpoint().unwrap().to_string();

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let own = listener.local_addr().unwrap().to_string();
    drop(listener);
    let mut newer = real.clone();
    newer.epoch = real.epoch ^ 0x5a5a_5a5a_5a5a_5a5a;
    newer.endpoint = Some(own);
    let restart = squatter(newer.clone());
    decode
        .expect(expecting(2, &restart.endpoint, tables(&dst, &[6, 7]), 32))
        .unwrap();
    assert_eq!(
        restart.heard.recv_timeout(Duration::from_secs(20)),
        Ok(Heard::Claimed(2)),
        "the newer start was not taken"
    );

    decode
        .expect(expecting(3, &endpoint, tables(&dst, &[4, 5]), 32))
        .unwrap();
    match wait(&decode, 3, Duration::from_secs(20)) {
        Event::Failed { kind, detail, .. } => {
            assert_eq!(kind, FailureKind::Refused, "{detail}");
            for needle in [
                real.identity().to_string(),
                "an older start".to_string(),
                format!("{:016x}", newer.epoch),
                restart.endpoint.clone(),
            ] {
                assert!(detail.contains(&needle), "`{needle}` not in: {detail}");
            }
        }
        other => panic!("the older start's request: {other:?}"),
    }

    // The newer start leaves: request 2, claimed from it, ends, and the real rank is linked.
    restart.leave.store(true, Ordering::Release);
    let ended = wait(&decode, 2, Duration::from_secs(20));
    assert!(
        matches!(ended, Event::Failed { .. }),
        "request 2: {ended:?}"
    );
    decode
        .expect(expecting(4, &endpoint, tables(&dst, &[4, 5]), 32))
        .unwrap();
    prefill.send(whole(4, tables(&src, &[2, 3]), 32)).unwrap();
    let got = wait(&decode, 4, Duration::from_secs(20));
    assert!(matches!(got, Event::Received { .. }), "request 4: {got:?}");
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[0, 1, 2, 3], &[0, 1, 4, 5], None);
}
