//! The wire framing of both message families (agent and control: round trips, limits, corrupt
//! input), and servers facing bad input on their control ports and agent side channels: each
//! bad control connection is refused with an error naming what is wrong, a side channel says
//! nothing to a peer that has not proven the secret, and the server keeps serving.

use crate::support;

use std::io::{Cursor, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvferry_harness::control::{
    ControlMessage, PeerRef, RankTables, ServedRank, ServerInfo, Submit, VerifySummary,
};
use kvferry_planner_abi::{Mapping, SlotTable, TokenRange, ViewId};
use kvferry_protocol::Secret;
use kvferry_protocol::{
    AgentMessage, Completion, CompletionStatus, Frame, HEADER_LEN, MAX_FRAME_BYTES,
    PROTOCOL_VERSION, PoolKey, RankDescriptor, RequestData, Role, WireError, decode_body, encode,
    header, parse_header, read_frame, write_frame,
};
use kvferry_testkit::layout::{ModelSpec, PoolOptions, Preset, build_instance};
use kvferry_transfer::RequestStats;
use kvferry_transfer::harness::conn::{Secured, secure_dial};
use support::transfer::{REPLY, Server, exchange, submit};

/// Both ranks of a Qwen3-Next dep2 prefill instance, as its agents describe them.
fn ranks() -> Vec<RankDescriptor> {
    let mapping = Mapping {
        tp: 2,
        pp: 1,
        cp: 1,
        moe_tp: 1,
        moe_ep: 1,
        attention_dp: true,
    };
    let mut next = 0x1000u64;
    let ranks = build_instance(
        &ModelSpec::new(Preset::Qwen3Next80bA3b),
        &mapping,
        "ctx-1",
        "kvferry.default",
        &PoolOptions::default(),
        &mut |_, _, bytes| {
            next += bytes + 4096;
            next
        },
    )
    .unwrap();
    ranks
        .into_iter()
        .map(|info| RankDescriptor {
            pools: info
                .page_table
                .pools
                .iter()
                .map(|p| PoolKey {
                    base: p.base,
                    len: p.footprint(),
                    rkey: vec![1, 2, 3, 4],
                })
                .collect(),
            info,
            worker_address: vec![9; 145],
            bounce: None,
        })
        .collect()
}

fn every_agent_message() -> Vec<AgentMessage> {
    let tables = vec![SlotTable::new([3, -1, 7]), SlotTable::new([1])];
    vec![
        AgentMessage::Ping,
        AgentMessage::Hold { request: 7 },
        AgentMessage::Refused {
            reason: "tokens_per_block: ours 32, theirs 64".into(),
        },
        AgentMessage::RequestData(RequestData {
            request: 7,
            receiver_instance: "gen-1".into(),
            receiver_rank: 3,
            sender_rank: 1,
            slot_tables: tables.clone(),
            token_range: TokenRange { start: 0, end: 90 },
            prompt_len: 90,
            dst_start_token: Some(64),
            excluded_views: vec![ViewId { group: 1, view: 0 }],
            bounce: None,
            integrity: None,
        }),
        AgentMessage::Completion(Completion {
            request: 7,
            sender_rank: 1,
            receiver_rank: 3,
            piece: 2,
            is_last: true,
            bytes: 1 << 40,
            fragments: 12,
            status: CompletionStatus::Failed("flush failed".into()),
            bounce: None,
            digest: None,
            views: None,
        }),
        AgentMessage::Completion(Completion {
            request: 8,
            sender_rank: 0,
            receiver_rank: 0,
            piece: 0,
            is_last: true,
            bytes: 0,
            fragments: 0,
            status: CompletionStatus::Cancelled("prefill-0 cancelled request 8".into()),
            bounce: None,
            digest: None,
            views: None,
        }),
        AgentMessage::Cancel {
            request: 7,
            reason: "timed out".into(),
        },
        AgentMessage::ProveWorker,
        AgentMessage::WorkerProof {
            challenge: vec![5; 32],
        },
        AgentMessage::Error {
            message: "bad magic".into(),
        },
    ]
}

/// What a prefill server holding both [`ranks`] answers to `InfoRequest`.
fn server_info() -> ServerInfo {
    let ranks = ranks();
    ServerInfo {
        instance: "ctx-1".into(),
        role: Role::Prefill,
        planner_id: "kvferry.default".into(),
        planner_version: "0.1.0".into(),
        label: "qwen3-next-80b-a3b bf16 tpb32 dep2".into(),
        world: ranks.len() as u32,
        ranks: ranks
            .into_iter()
            .enumerate()
            .map(|(r, d)| ServedRank {
                info: d.info,
                endpoint: Some(format!("127.0.0.1:{}", 4000 + r)),
            })
            .collect(),
    }
}

fn every_control_message() -> Vec<ControlMessage> {
    let tables = vec![SlotTable::new([3, -1, 7]), SlotTable::new([1])];
    vec![
        ControlMessage::InfoRequest,
        ControlMessage::Info(server_info()),
        ControlMessage::Submit(Submit {
            request: 7,
            prompt_len: 90,
            ctx_dp_rank: 1,
            gen_dp_rank: 0,
            chunks: Some(vec![TokenRange { start: 0, end: 64 }]),
            layer_parts: 2,
            cached: 40,
            peer: Some(PeerRef {
                instance: "ctx".into(),
                endpoints: vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()],
            }),
        }),
        ControlMessage::Submitted {
            request: 7,
            result: Ok(vec![RankTables {
                rank: 1,
                info: ranks()[1].info.clone(),
                tables,
            }]),
        },
        ControlMessage::Done {
            request: 7,
            result: Ok(RequestStats {
                bytes: 5,
                fragments: 1,
                writers: 1,
                pieces: 1,
                latency_us: 3,
                puts: 2,
                stages: kvferry_transfer::Stages {
                    plan_ns: 11,
                    control_ns: u64::MAX,
                    ..Default::default()
                },
            }),
        },
        ControlMessage::Done {
            request: 8,
            result: Err("peer gone".into()),
        },
        ControlMessage::Verify {
            request: 7,
            context: vec![],
        },
        ControlMessage::Verified {
            request: 7,
            result: Ok(VerifySummary {
                ok: true,
                ..VerifySummary::default()
            }),
        },
        ControlMessage::Release { request: 7 },
        ControlMessage::Released { request: 7 },
        ControlMessage::Refused {
            request: 7,
            message: "request 7 belongs to another controller".into(),
        },
        ControlMessage::VerifyIdle,
        ControlMessage::IdleVerified {
            result: Err("busy".into()),
        },
        ControlMessage::Cancel {
            request: 7,
            reason: "client went away".into(),
        },
        ControlMessage::Shutdown,
        ControlMessage::Error {
            message: "bad magic".into(),
        },
    ]
}

fn round_trips<M: Frame + PartialEq + std::fmt::Debug>(messages: impl Fn() -> Vec<M>) {
    for message in messages() {
        let frame = encode(&message).unwrap();
        assert_eq!(&frame[..4], &M::MAGIC);
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&frame[..HEADER_LEN]);
        assert_eq!(parse_header::<M>(&h).unwrap(), frame.len() - HEADER_LEN);
        let back: M = read_frame(&mut Cursor::new(&frame)).unwrap();
        assert_eq!(back, message, "{}", message.kind());
    }
    // Several frames back to back, then a clean end.
    let mut stream = Vec::new();
    for m in messages() {
        write_frame(&mut stream, &m).unwrap();
    }
    let mut cursor = Cursor::new(stream);
    for m in messages() {
        assert_eq!(read_frame::<M>(&mut cursor).unwrap(), m);
    }
    assert!(matches!(
        read_frame::<M>(&mut cursor),
        Err(WireError::Closed)
    ));
}

#[test]
fn every_message_round_trips_through_a_frame() {
    round_trips(every_agent_message);
    round_trips(every_control_message);
}

#[test]
fn a_frame_of_one_family_is_refused_by_the_other_naming_both() {
    let frame = encode(&ControlMessage::Shutdown).unwrap();
    let e = read_frame::<AgentMessage>(&mut Cursor::new(&frame)).unwrap_err();
    assert!(matches!(e, WireError::BadMagic { .. }), "{e}");
    assert!(e.to_string().contains("not a kvferry agent frame"), "{e}");
    let frame = encode(&AgentMessage::Ping).unwrap();
    let e = read_frame::<ControlMessage>(&mut Cursor::new(&frame)).unwrap_err();
    assert!(e.to_string().contains("not a kvferry control frame"), "{e}");
}

#[test]
fn headers_are_checked_before_the_body_is_read() {
    let good = header::<AgentMessage>(10).unwrap();
    let mut bad = good;
    bad[0] = b'X';
    let e = parse_header::<AgentMessage>(&bad).unwrap_err();
    assert!(matches!(e, WireError::BadMagic { .. }));
    assert!(e.to_string().contains("bad magic"), "{e}");

    let mut version = good;
    version[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    let e = parse_header::<AgentMessage>(&version).unwrap_err();
    assert!(
        matches!(e, WireError::Version { found } if found == PROTOCOL_VERSION + 1),
        "{e}"
    );

    let mut big = good;
    big[6..].copy_from_slice(&(MAX_FRAME_BYTES as u32 + 1).to_le_bytes());
    let e = parse_header::<AgentMessage>(&big).unwrap_err();
    assert!(matches!(e, WireError::Oversized { .. }), "{e}");
    // An oversized frame is refused from its header alone: no body follows.
    assert!(matches!(
        read_frame::<AgentMessage>(&mut Cursor::new(big.to_vec())),
        Err(WireError::Oversized { .. })
    ));
    assert!(header::<AgentMessage>(MAX_FRAME_BYTES).is_ok());
    assert!(matches!(
        header::<AgentMessage>(MAX_FRAME_BYTES + 1),
        Err(WireError::Oversized { .. })
    ));
}

#[test]
fn corrupt_bodies_are_refused_without_panicking() {
    // Cut short: in the header, in the body.
    let frame = encode(&AgentMessage::Cancel {
        request: 1,
        reason: "x".into(),
    })
    .unwrap();
    for cut in [3, HEADER_LEN + 1] {
        let e = read_frame::<AgentMessage>(&mut Cursor::new(frame[..cut].to_vec())).unwrap_err();
        assert!(matches!(e, WireError::Io(_)), "cut at {cut}: {e}");
        assert!(e.is_disconnect());
    }
    // An unknown variant.
    let e = decode_body::<AgentMessage>(&[200]).unwrap_err();
    assert!(matches!(e, WireError::Decode { .. }), "{e}");
    // Trailing bytes.
    let mut body = frame[HEADER_LEN..].to_vec();
    body.push(0);
    assert!(matches!(
        decode_body::<AgentMessage>(&body),
        Err(WireError::Trailing { extra: 1 })
    ));
    // A vector claiming 2^40 elements inside a tiny body: bounded by the decode limit, no
    // huge allocation.
    let mut claim = vec![4u8]; // Refused { reason: String }
    claim.push(253); // varint u64 marker
    claim.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let e = decode_body::<AgentMessage>(&claim).unwrap_err();
    assert!(matches!(e, WireError::Decode { .. }), "{e}");
    // Every prefix of every message, and random noise, decodes to an error or a message.
    let mut seed = 0x1234_5678_u64;
    for m in every_agent_message() {
        let frame = encode(&m).unwrap();
        let body = &frame[HEADER_LEN..];
        for cut in 0..body.len().min(300) {
            let _ = decode_body::<AgentMessage>(&body[..cut]);
            let _ = decode_body::<ControlMessage>(&body[..cut]);
        }
        let mut noisy = body.to_vec();
        for b in noisy.iter_mut().take(64) {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            *b ^= (seed >> 56) as u8;
        }
        let _ = decode_body::<AgentMessage>(&noisy);
    }
}

/// Sends raw bytes inside an authenticated control connection (a controller holding the
/// secret) and returns the server's error message, read as a frame of family `M`.
fn refused<M: Frame + std::fmt::Debug>(addr: &str, bytes: &[u8]) -> String {
    let stream = TcpStream::connect(addr).unwrap();
    let secret = Secret::new(support::SECRET).unwrap();
    let Secured {
        mut reader,
        mut writer,
        ..
    } = secure_dial::<M>(stream, &secret, addr, Instant::now() + REPLY).unwrap();
    reader.get_mut().get_mut().settle(Some(REPLY)).unwrap();
    writer.write_all(bytes).unwrap();
    writer.flush().unwrap();
    let reply = read_frame::<M>(&mut reader);
    let Some(message) = reply.as_ref().ok().and_then(|m| m.error_text()) else {
        panic!("expected an Error frame, got {reply:?}");
    };
    let message = message.to_string();
    // Then the server closes the connection.
    let mut rest = Vec::new();
    let _ = reader.read_to_end(&mut rest);
    assert!(rest.is_empty());
    message
}

/// Whether the server closed `s` (within `REPLY`) saying nothing but, at most, the
/// handshake's refusal (an empty reply, `[0, 0]`).
fn closed_silently(mut s: TcpStream) -> bool {
    s.set_read_timeout(Some(REPLY)).unwrap();
    let mut rest = Vec::new();
    // A reset (unread bytes at the close) is a close too.
    let _ = s.read_to_end(&mut rest);
    rest.is_empty() || rest == [0, 0]
}

/// The first agent endpoint of a prefill server.
fn endpoint(server: &Server) -> String {
    server.addr.split(',').next().unwrap().to_string()
}

#[test]
fn bad_control_input_closes_only_that_connection() {
    let ctx = Server::start(
        "context",
        "deepseek-v3",
        "dep2",
        "tcp",
        &["--planner", "kvferry.deepseek_mla_latent"],
    );
    let decode = Server::start(
        "generation",
        "deepseek-v3",
        "dep4",
        "tcp",
        &["--planner", "kvferry.deepseek_mla_latent"],
    );
    // An idle, healthy connection opened first must survive the bad ones.
    let healthy = ctx.client();

    let garbage: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    let m = refused::<ControlMessage>(&decode.control, &garbage);
    assert!(m.contains("bad magic"), "{m}");
    let mut wrong_version = header::<ControlMessage>(1).unwrap();
    wrong_version[4..6].copy_from_slice(&7u16.to_le_bytes());
    let m = refused::<ControlMessage>(&decode.control, &wrong_version);
    assert!(m.contains("protocol version 7"), "{m}");
    let mut oversized = header::<ControlMessage>(0).unwrap();
    oversized[6..].copy_from_slice(&u32::MAX.to_le_bytes());
    let m = refused::<ControlMessage>(&ctx.control, &oversized);
    assert!(m.contains("exceeds") && m.contains("limit"), "{m}");
    let mut undecodable = header::<ControlMessage>(3).unwrap().to_vec();
    undecodable.extend_from_slice(&[250, 1, 2]);
    let m = refused::<ControlMessage>(&ctx.control, &undecodable);
    assert!(m.contains("undecodable"), "{m}");
    // Well-formed, but not for this server.
    let m = refused::<ControlMessage>(&ctx.control, &encode(&ControlMessage::VerifyIdle).unwrap());
    assert!(
        m.contains("VerifyIdle is not a message a prefill server accepts"),
        "{m}"
    );

    // The agents' side channels and the control listeners say nothing to a peer that has
    // not proven the secret: garbage, a control frame, an agent frame, a `Shutdown` in the
    // clear — each connection is closed unanswered, and both servers go on.
    let ep = endpoint(&ctx);
    for addr in [&ep, &ctx.control, &decode.control] {
        for bytes in [
            garbage.clone(),
            encode(&ControlMessage::VerifyIdle).unwrap(),
            encode(&ControlMessage::Shutdown).unwrap(),
            encode(&AgentMessage::Ping).unwrap(),
        ] {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&bytes).unwrap();
            assert!(closed_silently(s), "{addr} answered a stranger");
        }
    }

    // Both servers still serve: the old connection, new ones, and a whole transfer.
    assert!(matches!(
        healthy.call(ControlMessage::InfoRequest, REPLY).unwrap(),
        ControlMessage::Info(_)
    ));
    std::thread::sleep(Duration::from_millis(50));
    exchange(&ctx, &decode, &[submit(1, 64), submit(2, 200)]);
}

/// A prefill rank serves `--max-peer-connections` side-channel connections at once; one more
/// closes the oldest that has not proven the secret (strangers cannot hold the places), and
/// is itself kept open, waiting for its handshake.
#[test]
fn a_peer_connection_past_the_cap_closes_the_oldest_unproven_one() {
    let ctx = Server::start(
        "context",
        "deepseek-v3",
        "dep2",
        "tcp",
        &[
            "--planner",
            "kvferry.deepseek_mla_latent",
            "--max-peer-connections",
            "2",
        ],
    );
    let ep = endpoint(&ctx);
    // Two connections that say nothing take both places (until the handshake deadline).
    let first = TcpStream::connect(&ep).unwrap();
    let second = TcpStream::connect(&ep).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let third = TcpStream::connect(&ep).unwrap();
    assert!(waiting(&third), "the third connection was closed");
    assert!(waiting(&second), "the second connection was closed");
    assert!(closed_silently(first), "the oldest connection was answered");
}

/// Whether `s` is still open, its peer silent (waiting for the handshake).
fn waiting(mut s: &TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut byte = [0u8; 1];
    matches!(
        s.read(&mut byte),
        Err(e) if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        )
    )
}

/// A TCP connection to `to` from the local IPv4 address `from` (`std` cannot bind a socket
/// before it connects).
fn connect_from(from: std::net::Ipv4Addr, to: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let std::net::SocketAddr::V4(to) = to else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{to} is not an IPv4 address"),
        ));
    };
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(ip.octets()),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: socket(2) takes no pointers; a negative result is an error, checked below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is the socket just opened, owned by nothing else: it is closed once, by
    // the `OwnedFd` (or the stream made of it).
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let local = sockaddr(from, 0);
    // SAFETY: `local` is a `sockaddr_in` of `len` bytes, alive for the call, which only reads
    // it; `fd` is an open socket.
    let bound = unsafe { libc::bind(fd.as_raw_fd(), (&raw const local).cast(), len) };
    if bound != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let remote = sockaddr(*to.ip(), to.port());
    // SAFETY: as for `bind`: `remote` is a `sockaddr_in` of `len` bytes, only read.
    let connected = unsafe { libc::connect(fd.as_raw_fd(), (&raw const remote).cast(), len) };
    if connected != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(TcpStream::from(fd))
}

/// `per_host` connections to `addr` from each of 127.0.0.`hosts`, each holding the first
/// byte of a preamble and nothing more.
fn stalled_from(
    addr: &str,
    hosts: std::ops::RangeInclusive<u8>,
    per_host: usize,
) -> Vec<TcpStream> {
    let to: std::net::SocketAddr = addr.parse().unwrap();
    let mut stalled = Vec::new();
    for host in hosts {
        let from = std::net::Ipv4Addr::new(127, 0, 0, host);
        for _ in 0..per_host {
            let mut s = connect_from(from, to)
                .unwrap_or_else(|e| panic!("connect from {from} to {to}: {e}"));
            // A connection the listener already closed may refuse it.
            let _ = s.write_all(b"K");
            stalled.push(s);
        }
    }
    stalled
}

/// A controller's question, answered.
fn answers(client: &kvferry_harness::Client) -> bool {
    matches!(
        client.call(ControlMessage::InfoRequest, REPLY),
        Ok(ControlMessage::Info(_))
    )
}

/// Any local user can bind every loopback address: 64 stalled handshakes on a server's
/// control listener, 16 from each of 127.0.0.2 to 127.0.0.5 (as many as it serves), held
/// open, do not keep an honest controller out.
#[test]
fn stalled_control_connections_from_many_loopback_addresses_cannot_keep_a_controller_out() {
    let ctx = Server::start(
        "context",
        "deepseek-v3",
        "dep2",
        "tcp",
        &["--planner", "kvferry.deepseek_mla_latent"],
    );
    let stalled = stalled_from(&ctx.control, 2..=5, 16);
    let secret = Secret::new(support::SECRET).unwrap();
    let client = kvferry_harness::Client::connect(&ctx.control, &secret)
        .unwrap_or_else(|e| panic!("the controller was kept out: {e}"));
    assert!(answers(&client), "the controller got no answer");
    drop(stalled);
}

/// A full control listener (64 connections) closes the oldest unproven connection for a
/// newer one, and turns a newcomer away only when every connection it serves is a proven
/// controller.
#[test]
fn a_full_control_listener_closes_an_unproven_connection_and_refuses_only_proven_ones() {
    let ctx = Server::start(
        "context",
        "deepseek-v3",
        "dep2",
        "tcp",
        &["--planner", "kvferry.deepseek_mla_latent"],
    );
    let secret = Secret::new(support::SECRET).unwrap();
    let connect = || kvferry_harness::Client::connect(&ctx.control, &secret);
    // 48 proven controllers and 16 strangers from one address take every place.
    let mut controllers: Vec<_> = (0..48)
        .map(|k| {
            let c = connect().unwrap_or_else(|e| panic!("controller {k}: {e}"));
            assert!(answers(&c), "controller {k} got no answer");
            c
        })
        .collect();
    let mut strangers = stalled_from(&ctx.control, 1..=1, 16).into_iter();
    // Each new controller closes the oldest stranger, until only controllers are left.
    for k in 48..64 {
        let c = connect().unwrap_or_else(|e| panic!("controller {k} was kept out: {e}"));
        assert!(answers(&c), "controller {k} got no answer");
        controllers.push(c);
        let oldest = strangers.next().unwrap();
        assert!(closed_silently(oldest), "a stranger was answered");
    }
    // Every place is a proven controller's: a newcomer is turned away, unanswered.
    assert!(connect().is_err(), "a 65th controller was served");
    for (k, c) in controllers.iter().enumerate() {
        assert!(answers(c), "controller {k} lost its connection");
    }
}
