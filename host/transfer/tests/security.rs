//! The side channel against attackers on the same host or network: a relay between an
//! honest decode rank and an honest prefill rank, connections that stall or dribble
//! before authentication, oversized handshakes. Each case is followed by an honest transfer
//! checked byte for byte.

use crate::support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use kvferry_transfer::Role;
use kvferry_transfer::Transport;
use kvferry_transfer::agent::{Event, FailureKind};

use support::*;

/// What a relay kept of one direction.
type Seen = Arc<Mutex<Vec<u8>>>;

/// A TCP relay on a new loopback port that forwards every byte both ways between whoever
/// dials it and `target`, keeping a copy of what passes in each direction (dialer → target,
/// target → dialer). Returns its address and the two copies.
fn relay(target: String) -> (String, Seen, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (up, down): (Seen, Seen) = (Arc::default(), Arc::default());
    let (up2, down2) = (Arc::clone(&up), Arc::clone(&down));
    thread::spawn(move || {
        for dialer in listener.incoming() {
            let Ok(dialer) = dialer else { return };
            let Ok(target) = TcpStream::connect(&target) else {
                return;
            };
            let pipe = |mut from: TcpStream, mut to: TcpStream, copy: Seen| {
                thread::spawn(move || {
                    let mut buf = [0u8; 16 << 10];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 || to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        copy.lock().unwrap().extend_from_slice(&buf[..n]);
                    }
                    let _ = to.shutdown(Shutdown::Write);
                })
            };
            pipe(
                dialer.try_clone().unwrap(),
                target.try_clone().unwrap(),
                Arc::clone(&up2),
            );
            pipe(target, dialer, Arc::clone(&down2));
        }
    });
    (addr, up, down)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A relay that forwards a real handshake between a decode rank and a prefill rank
/// (the decode rank was sent to the relay's address) gets no session: the prefill rank
/// refuses a dialer that meant to reach another endpoint, nothing is written, and nothing
/// either side said — instance names, worker addresses, the refusal — passed in the clear.
/// The same ranks then transfer directly.
#[test]
fn a_relay_that_forwards_a_real_handshake_gets_nothing() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();
    let (relay_addr, up, down) = relay(endpoint.clone());

    decode
        .expect(expecting(1, &relay_addr, tables(&dst, &[0, 1]), 32))
        .unwrap();
    prefill.send(whole(1, tables(&src, &[0, 1]), 32)).unwrap();
    match wait(&decode, 1, Duration::from_secs(20)) {
        Event::Failed { kind, detail, .. } => {
            assert_eq!(kind, FailureKind::Refused, "{detail}");
            assert!(detail.contains("meant to reach"), "{detail}");
        }
        other => panic!("a relayed handshake was served: {other:?}"),
    }
    let (up, down) = (up.lock().unwrap().clone(), down.lock().unwrap().clone());
    assert!(
        !up.is_empty() && !down.is_empty(),
        "the relay saw no traffic"
    );
    let gen_meta = decode.local_metadata().unwrap();
    let gen_worker = &gen_meta[gen_meta.len() - 64..];
    for (what, needle) in [
        ("the decode instance's name", &b"decode"[..]),
        ("the prefill instance's name", b"prefill"),
        ("the refusal", b"meant to reach"),
        ("the decode rank's metadata", gen_worker),
    ] {
        assert!(
            !contains(&up, needle) && !contains(&down, needle),
            "{what} crossed the relay in the clear"
        );
    }
    // Nothing was written into the decode rank's slots; the prefill side still holds the
    // send, which the direct transfer now claims.
    check(&src, &dst, &[], &[], None);
    decode
        .expect(expecting(2, &endpoint, tables(&dst, &[0, 1]), 32))
        .unwrap();
    prefill.send(whole(2, tables(&src, &[0, 1]), 32)).unwrap();
    let got = wait(&decode, 2, Duration::from_secs(20));
    assert!(matches!(got, Event::Received { .. }), "{got:?}");
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[0, 1], &[0, 1], None);
}

/// A relay that completes the handshake by forwarding it, then speaks for itself — a
/// metadata frame of its own in the clear, or the dialer's records altered — gets the
/// connection closed: its bytes open as no record.
#[test]
fn a_relay_that_injects_after_the_handshake_is_cut_off() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();
    for inject in [true, false] {
        // Handshake bytes come from a real dialer's first message, through a hand relay.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let hand = listener.local_addr().unwrap().to_string();
        let target = endpoint.clone();
        let relay = thread::spawn(move || {
            let (mut dialer, _) = listener.accept().unwrap();
            let mut ctx = TcpStream::connect(&target).unwrap();
            ctx.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut pre = [0u8; 8];
            dialer.read_exact(&mut pre).unwrap();
            let mut first = vec![0u8; usize::from(u16::from_le_bytes([pre[6], pre[7]]))];
            dialer.read_exact(&mut first).unwrap();
            ctx.write_all(&pre).unwrap();
            ctx.write_all(&first).unwrap();
            let mut l = [0u8; 2];
            ctx.read_exact(&mut l).unwrap();
            let mut reply = vec![0u8; usize::from(u16::from_le_bytes(l))];
            ctx.read_exact(&mut reply).unwrap();
            dialer.write_all(&l).unwrap();
            dialer.write_all(&reply).unwrap();
            // The dialer's metadata record, altered or replaced.
            let mut buf = vec![0u8; 64 << 10];
            let n = dialer.read(&mut buf).unwrap();
            if inject {
                let forged =
                    kvferry_protocol::encode(&kvferry_protocol::AgentMessage::Ping).unwrap();
                ctx.write_all(&forged).unwrap();
            } else {
                buf[n / 2] ^= 1;
                ctx.write_all(&buf[..n]).unwrap();
            }
            let mut rest = Vec::new();
            let _ = ctx.read_to_end(&mut rest);
            rest
        });
        decode
            .expect(expecting(1, &hand, tables(&dst, &[0, 1]), 32))
            .unwrap();
        let got = wait(&decode, 1, Duration::from_secs(20));
        assert!(matches!(got, Event::Failed { .. }), "{got:?}");
        let answered = relay.join().unwrap();
        assert!(
            answered.is_empty(),
            "the prefill rank answered an injected record: {answered:?}"
        );
    }
    check(&src, &dst, &[], &[], None);
}

/// Connections that say nothing or dribble bytes of a handshake — more than the connection
/// cap — cannot keep an honest decode rank out: the oldest unproven ones are closed for
/// newer ones, and each ends at the handshake's deadline. A first message that claims more
/// than a handshake may hold is closed unread.
#[test]
fn stalled_and_dribbling_connections_cannot_keep_an_honest_peer_out() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();

    let mut oversized = b"KVFA".to_vec();
    oversized.extend_from_slice(&kvferry_protocol::PROTOCOL_VERSION.to_le_bytes());
    oversized.extend_from_slice(&u16::MAX.to_le_bytes());
    let mut s = TcpStream::connect(&endpoint).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&oversized).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty(), "{rest:?}");

    // More stalled connections than the side channel serves (256), each holding a byte of
    // a preamble.
    let stalled: Vec<TcpStream> = (0..300)
        .filter_map(|_| {
            let mut s = TcpStream::connect(&endpoint).ok()?;
            s.write_all(b"K").ok()?;
            Some(s)
        })
        .collect();
    assert!(stalled.len() >= 256, "{} connections", stalled.len());
    decode
        .expect(expecting(1, &endpoint, tables(&dst, &[0, 1]), 32))
        .unwrap();
    prefill.send(whole(1, tables(&src, &[0, 1]), 32)).unwrap();
    let got = wait(&decode, 1, Duration::from_secs(20));
    assert!(matches!(got, Event::Received { .. }), "{got:?}");
    drop(stalled);
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[0, 1], &[0, 1], None);
}

/// A TCP connection to `to` from the local IPv4 address `from` (the port the kernel's
/// choice): `std` cannot bind a socket before it connects, and this crate's tests link no
/// socket library, so the three calls are declared here (Linux's `sockaddr_in`).
fn connect_from(from: std::net::Ipv4Addr, to: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    use std::ffi::c_int;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    #[repr(C)]
    struct SockaddrIn {
        family: u16,
        port: [u8; 2],
        addr: [u8; 4],
        zero: [u8; 8],
    }
    unsafe extern "C" {
        fn socket(domain: c_int, kind: c_int, protocol: c_int) -> c_int;
        fn bind(fd: c_int, addr: *const SockaddrIn, len: u32) -> c_int;
        fn connect(fd: c_int, addr: *const SockaddrIn, len: u32) -> c_int;
    }
    const AF_INET: c_int = 2;
    const SOCK_STREAM: c_int = 1;
    const SOCK_CLOEXEC: c_int = 0o2_000_000;
    let std::net::SocketAddr::V4(to) = to else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{to} is not an IPv4 address"),
        ));
    };
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| SockaddrIn {
        family: AF_INET as u16,
        port: port.to_be_bytes(),
        addr: ip.octets(),
        zero: [0; 8],
    };
    let len = std::mem::size_of::<SockaddrIn>() as u32;
    // SAFETY: socket(2) takes no pointers; a negative result is an error, checked below.
    let fd = unsafe { socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is the socket just opened, owned by nothing else: it is closed once, by
    // the `OwnedFd` (or the stream made of it).
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let local = sockaddr(from, 0);
    // SAFETY: `local` is a `sockaddr_in` of `len` bytes, alive for the call, which only reads
    // it; `fd` is an open socket.
    if unsafe { bind(fd.as_raw_fd(), &local, len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let remote = sockaddr(*to.ip(), to.port());
    // SAFETY: as for `bind`: `remote` is a `sockaddr_in` of `len` bytes, only read.
    if unsafe { connect(fd.as_raw_fd(), &remote, len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(TcpStream::from(fd))
}

/// Any local user can bind every loopback address: 64 stalled handshakes, 16 from each of
/// 127.0.0.2 to 127.0.0.5 (as many as a listener keeps unproven, and here as many as the side
/// channel serves), held open, cannot keep an honest peer out: loopback counts as one source,
/// and a full side channel closes the oldest unproven connection for a newer one.
#[test]
fn stalled_connections_from_many_loopback_addresses_cannot_keep_an_honest_peer_out() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = start(Role::Prefill, &src, secret(), bound(), |c| {
        c.transport = Transport::Tcp.into();
        c.max_connections = 64;
        // No stalled connection ends at its deadline while the honest peer dials.
        c.handshake_timeout = Duration::from_secs(60);
    });
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();
    let to: std::net::SocketAddr = endpoint.parse().unwrap();

    let mut stalled = Vec::new();
    for host in 2..=5u8 {
        let from = std::net::Ipv4Addr::new(127, 0, 0, host);
        for _ in 0..16 {
            let mut s = connect_from(from, to)
                .unwrap_or_else(|e| panic!("connect from {from} to {to}: {e}"));
            // A byte of a preamble, then nothing. (A connection the listener already
            // closed may refuse it.)
            let _ = s.write_all(b"K");
            stalled.push(s);
        }
    }
    for s in &stalled {
        let from = s.local_addr().unwrap().ip();
        assert!(from != to.ip() && from.is_loopback(), "{from}");
    }
    decode
        .expect(expecting(1, &endpoint, tables(&dst, &[0, 1]), 32))
        .unwrap();
    prefill.send(whole(1, tables(&src, &[0, 1]), 32)).unwrap();
    let got = wait(&decode, 1, Duration::from_secs(20));
    assert!(matches!(got, Event::Received { .. }), "{got:?}");
    drop(stalled);
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[0, 1], &[0, 1], None);
}

/// A cancel on the prefill side reaches the decode side at once, as a cancel by that peer
/// (not as a failed write, nor at a lease or timeout).
#[test]
fn a_prefill_side_cancel_reaches_the_decode_side_at_once() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = agent(Role::Prefill, &src, secret(), Transport::Tcp);
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();
    decode
        .expect(expecting(3, &endpoint, tables(&dst, &[0, 1]), 32))
        .unwrap();
    // The first of two chunks: the request stays open on the prefill side.
    prefill
        .send(kvferry_transfer::agent::SendChunk {
            request: 3,
            tables: tables(&src, &[0]),
            tokens: kvferry_planner_abi::TokenRange { start: 0, end: 16 },
            prompt_len: 32,
            is_last: false,
            to: Some("decode".into()),
            views: None,
        })
        .unwrap();
    thread::sleep(Duration::from_millis(200));
    prefill.cancel(3).unwrap();
    assert_eq!(
        wait(&prefill, 3, Duration::from_secs(5)),
        Event::Cancelled { request: 3 }
    );
    // The decode side's own timeout is 30 s: five is "at once" here.
    match wait(&decode, 3, Duration::from_secs(5)) {
        Event::Failed { kind, detail, .. } => {
            assert_eq!(kind, FailureKind::CancelledByPeer, "{detail}");
            assert!(detail.contains("cancelled request 3"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
}

/// A peer holding the secret that declares another process's worker address and keys (here
/// the real decode rank's) cannot answer the challenge the prefill rank sends that worker for
/// its session: it is refused before anything is written, over tcp and shm; the send bound to
/// that instance ends at once as refused, and the real rank is served afterwards.
#[test]
fn a_peer_declaring_another_process_worker_is_refused_and_nothing_lands_there() {
    use kvferry_protocol::{AgentEvent, AgentMessage, AgentMetadata, AgentSession};
    use kvferry_protocol::{read_frame, write_frame};
    for transport in [Transport::Tcp, Transport::Shm] {
        let model = model();
        let src = Engine::new("prefill", &model, pattern);
        let dst = Engine::new("decode", &model, |_, _| CANARY);
        let prefill = agent(Role::Prefill, &src, secret(), transport);
        let victim = agent(Role::Decode, &dst, secret(), transport);
        let endpoint = prefill.endpoint().unwrap().to_string();
        let to_decode = kvferry_transfer::agent::SendChunk {
            to: Some("decode".into()),
            ..whole(1, tables(&src, &[0, 1]), 32)
        };
        prefill.send(to_decode).unwrap();
        let mut s = SecurePeer::dial(&endpoint, &secret()).unwrap();
        let theirs = AgentMetadata::from_bytes(&victim.local_metadata().unwrap()).unwrap();
        let (mut session, own) = AgentSession::dial(theirs);
        write_frame(&mut s, &own).unwrap();
        let refusal = loop {
            let m: AgentMessage = read_frame(&mut s).unwrap();
            match session.receive(m) {
                Ok(AgentEvent::ProveWorker) => {
                    // It does not own the worker: it never saw the challenge.
                    let guess = AgentMessage::WorkerProof {
                        challenge: vec![0; 32],
                    };
                    write_frame(&mut s, &guess).unwrap();
                }
                Ok(other) => panic!("{transport}: a forged worker was accepted: {other:?}"),
                Err(e) => break e.to_string(),
            }
        };
        assert!(refusal.contains("does not own that worker"), "{refusal}");
        drop(s);
        // The send bound to the refused rank's instance ends at once (its lease is 60 s).
        match wait(&prefill, 1, Duration::from_secs(5)) {
            Event::Failed { kind, detail, .. } => {
                assert_eq!(kind, FailureKind::Refused, "{detail}");
                assert!(detail.contains("was refused"), "{detail}");
            }
            other => panic!("{transport}: {other:?}"),
        }
        check(&src, &dst, &[], &[], None);
        // The real owner proves it and is served.
        prefill.send(whole(2, tables(&src, &[0, 1]), 32)).unwrap();
        victim
            .expect(expecting(2, &endpoint, tables(&dst, &[0, 1]), 32))
            .unwrap();
        let got = wait(&victim, 2, Duration::from_secs(20));
        assert!(
            matches!(got, Event::Received { .. }),
            "{transport}: {got:?}"
        );
        drop(victim);
        drop(prefill);
        check(&src, &dst, &[0, 1], &[0, 1], None);
    }
}

/// A claim for a request that already ended on the prefill side (here at its lease) is
/// refused at once, naming how it ended, instead of waiting out the claimer's timeout.
#[test]
fn a_claim_for_an_ended_request_is_refused_at_once() {
    let model = model();
    let src = Engine::new("prefill", &model, pattern);
    let dst = Engine::new("decode", &model, |_, _| CANARY);
    let prefill = start(Role::Prefill, &src, secret(), bound(), |config| {
        config.lease = Duration::from_millis(200);
    });
    let decode = agent(Role::Decode, &dst, secret(), Transport::Tcp);
    let endpoint = prefill.endpoint().unwrap().to_string();
    prefill.send(whole(4, tables(&src, &[0, 1]), 32)).unwrap();
    match wait(&prefill, 4, Duration::from_secs(5)) {
        Event::Failed { kind, .. } => assert_eq!(kind, FailureKind::Lease),
        other => panic!("{other:?}"),
    }
    decode
        .expect(expecting(4, &endpoint, tables(&dst, &[0, 1]), 32))
        .unwrap();
    // The decode side's own timeout is 30 s.
    match wait(&decode, 4, Duration::from_secs(5)) {
        Event::Failed { detail, .. } => {
            assert!(detail.contains("already ended here"), "{detail}");
            assert!(detail.contains("lease"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    drop(decode);
    drop(prefill);
    check(&src, &dst, &[], &[], None);
}
