//! The control protocol's framing (round trips, limits, corrupt input), and a server facing
//! bad input on its control port: each bad connection is refused with an error naming what
//! is wrong, and the server keeps serving.

mod transfer_support;

use std::io::{Cursor, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvferry::transfer::wire::{
    Completion, CompletionStatus, HEADER_LEN, InstanceInfo, MAGIC, MAX_FRAME_BYTES, Message,
    PROTOCOL_VERSION, PoolKey, RankDescriptor, RankTables, RequestData, RequestStats, Role, Submit,
    VerifySummary, WireError, decode_body, encode, header, parse_header, read_frame, write_frame,
};
use kvferry_planner_abi::{Mapping, SlotTable, TokenRange, ViewId};
use kvferry_testkit::layout::{ModelSpec, PoolOptions, Preset, build_instance};
use transfer_support::{REPLY, Server, exchange, submit};

fn instance_info() -> InstanceInfo {
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
    InstanceInfo {
        instance_name: "ctx-1".into(),
        role: Role::Context,
        planner_id: "kvferry.default".into(),
        describer_id: "kvferry.default_describer".into(),
        planner_version: "0.1.0".into(),
        label: "qwen3-next-80b-a3b bf16 tpb32 dep2".into(),
        ranks: ranks
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
            })
            .collect(),
    }
}

fn every_message() -> Vec<Message> {
    let info = instance_info();
    let tables = vec![SlotTable::new([3, -1, 7]), SlotTable::new([1])];
    vec![
        Message::InstanceInfoRequest,
        Message::InstanceInfo(info.clone()),
        Message::Register(info),
        Message::Registered {
            instance: "ctx-1".into(),
        },
        Message::Refused {
            reason: "tokens_per_block: ours 32, theirs 64".into(),
        },
        Message::RequestData(RequestData {
            request: 7,
            receiver_instance: "gen-1".into(),
            receiver_rank: 3,
            sender_rank: 1,
            slot_tables: tables.clone(),
            token_range: TokenRange { start: 0, end: 90 },
            prompt_len: 90,
            dst_start_token: Some(64),
            excluded_views: vec![ViewId { group: 1, view: 0 }],
        }),
        Message::Completion(Completion {
            request: 7,
            sender_rank: 1,
            receiver_rank: 3,
            piece: 2,
            is_last: true,
            bytes: 1 << 40,
            fragments: 12,
            status: CompletionStatus::Failed("flush failed".into()),
        }),
        Message::Cancel {
            request: 7,
            reason: "timed out".into(),
        },
        Message::Submit(Submit {
            request: 7,
            prompt_len: 90,
            ctx_dp_rank: 1,
            gen_dp_rank: 0,
            chunks: Some(vec![TokenRange { start: 0, end: 64 }]),
            cached: 40,
            peer: Some("127.0.0.1:1".into()),
        }),
        Message::Submitted {
            request: 7,
            result: Ok(vec![RankTables { rank: 1, tables }]),
        },
        Message::Done {
            request: 7,
            result: Ok(RequestStats {
                bytes: 5,
                fragments: 1,
                writers: 1,
                pieces: 1,
                latency_us: 3,
            }),
        },
        Message::Done {
            request: 8,
            result: Err("peer gone".into()),
        },
        Message::Verify {
            request: 7,
            context: vec![],
        },
        Message::Verified {
            request: 7,
            result: Ok(VerifySummary {
                ok: true,
                ..VerifySummary::default()
            }),
        },
        Message::Release { request: 7 },
        Message::Released { request: 7 },
        Message::VerifyIdle,
        Message::IdleVerified {
            result: Err("busy".into()),
        },
        Message::Shutdown,
        Message::Error {
            message: "bad magic".into(),
        },
    ]
}

#[test]
fn every_message_round_trips_through_a_frame() {
    for message in every_message() {
        let frame = encode(&message).unwrap();
        assert_eq!(&frame[..4], &MAGIC);
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&frame[..HEADER_LEN]);
        assert_eq!(parse_header(&h).unwrap(), frame.len() - HEADER_LEN);
        let back = read_frame(&mut Cursor::new(&frame)).unwrap();
        assert_eq!(back, message, "{}", message.kind());
    }
    // Several frames back to back, then a clean end.
    let mut stream = Vec::new();
    for m in every_message() {
        write_frame(&mut stream, &m).unwrap();
    }
    let mut cursor = Cursor::new(stream);
    for m in every_message() {
        assert_eq!(read_frame(&mut cursor).unwrap(), m);
    }
    assert!(matches!(read_frame(&mut cursor), Err(WireError::Closed)));
}

#[test]
fn headers_are_checked_before_the_body_is_read() {
    let good = header(10).unwrap();
    let mut bad = good;
    bad[0] = b'X';
    let e = parse_header(&bad).unwrap_err();
    assert!(matches!(e, WireError::BadMagic { .. }));
    assert!(e.to_string().contains("bad magic"), "{e}");

    let mut version = good;
    version[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    let e = parse_header(&version).unwrap_err();
    assert!(
        matches!(e, WireError::Version { found } if found == PROTOCOL_VERSION + 1),
        "{e}"
    );

    let mut big = good;
    big[6..].copy_from_slice(&(MAX_FRAME_BYTES as u32 + 1).to_le_bytes());
    let e = parse_header(&big).unwrap_err();
    assert!(matches!(e, WireError::Oversized { .. }), "{e}");
    // An oversized frame is refused from its header alone: no body follows.
    assert!(matches!(
        read_frame(&mut Cursor::new(big.to_vec())),
        Err(WireError::Oversized { .. })
    ));
    assert!(header(MAX_FRAME_BYTES).is_ok());
    assert!(matches!(
        header(MAX_FRAME_BYTES + 1),
        Err(WireError::Oversized { .. })
    ));
}

#[test]
fn corrupt_bodies_are_refused_without_panicking() {
    // Cut short: in the header, in the body.
    let frame = encode(&Message::Release { request: 1 }).unwrap();
    for cut in [3, HEADER_LEN + 1] {
        let e = read_frame(&mut Cursor::new(frame[..cut].to_vec())).unwrap_err();
        assert!(matches!(e, WireError::Io(_)), "cut at {cut}: {e}");
        assert!(e.is_disconnect());
    }
    // An unknown variant.
    let e = decode_body(&[200]).unwrap_err();
    assert!(matches!(e, WireError::Decode { .. }), "{e}");
    // Trailing bytes.
    let mut body = frame[HEADER_LEN..].to_vec();
    body.push(0);
    assert!(matches!(
        decode_body(&body),
        Err(WireError::Trailing { extra: 1 })
    ));
    // A vector claiming 2^40 elements inside a tiny body: bounded by the decode limit, no
    // huge allocation.
    let mut claim = vec![5u8]; // Refused { reason: String }
    claim.push(253); // varint u64 marker
    claim.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let e = decode_body(&claim).unwrap_err();
    assert!(matches!(e, WireError::Decode { .. }), "{e}");
    // Every prefix of every message, and random noise, decodes to an error or a message.
    let mut seed = 0x1234_5678_u64;
    for m in every_message() {
        let frame = encode(&m).unwrap();
        let body = &frame[HEADER_LEN..];
        for cut in 0..body.len().min(300) {
            let _ = decode_body(&body[..cut]);
        }
        let mut noisy = body.to_vec();
        for b in noisy.iter_mut().take(64) {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            *b ^= (seed >> 56) as u8;
        }
        let _ = decode_body(&noisy);
    }
}

/// Sends raw bytes on a fresh connection and returns the server's error message.
fn refused(addr: &str, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(REPLY)).unwrap();
    s.write_all(bytes).unwrap();
    let reply = read_frame(&mut s);
    let Ok(Message::Error { message }) = reply else {
        panic!("expected an Error frame, got {reply:?}");
    };
    // Then the server closes the connection.
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty());
    message
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
    let r#gen = Server::start(
        "generation",
        "deepseek-v3",
        "dep4",
        "tcp",
        &["--planner", "kvferry.deepseek_mla_latent"],
    );
    // An idle, healthy connection opened first must survive the bad ones.
    let healthy = ctx.client();

    let garbage: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    let m = refused(&ctx.addr, &garbage);
    assert!(m.contains("bad magic"), "{m}");

    let mut wrong_version = header(1).unwrap();
    wrong_version[4..6].copy_from_slice(&7u16.to_le_bytes());
    let m = refused(&r#gen.addr, &wrong_version);
    assert!(m.contains("protocol version 7"), "{m}");

    let mut oversized = header(0).unwrap();
    oversized[6..].copy_from_slice(&u32::MAX.to_le_bytes());
    let m = refused(&ctx.addr, &oversized);
    assert!(m.contains("exceeds") && m.contains("limit"), "{m}");

    let mut undecodable = header(3).unwrap().to_vec();
    undecodable.extend_from_slice(&[250, 1, 2]);
    let m = refused(&ctx.addr, &undecodable);
    assert!(m.contains("undecodable"), "{m}");

    // Well-formed, but not for this server / not before registering.
    let m = refused(&ctx.addr, &encode(&Message::VerifyIdle).unwrap());
    assert!(
        m.contains("VerifyIdle is not a message a context server accepts"),
        "{m}"
    );
    let orphan = RequestData {
        request: 1,
        receiver_instance: "nobody".into(),
        receiver_rank: 0,
        sender_rank: 0,
        slot_tables: vec![],
        token_range: TokenRange { start: 0, end: 1 },
        prompt_len: 1,
        dst_start_token: None,
        excluded_views: vec![],
    };
    let m = refused(&ctx.addr, &encode(&Message::RequestData(orphan)).unwrap());
    assert!(m.contains("before Register"), "{m}");

    // Both servers still serve: the old connection, new ones, and a whole transfer.
    assert!(matches!(
        healthy.call(Message::InstanceInfoRequest, REPLY).unwrap(),
        Message::InstanceInfo(_)
    ));
    std::thread::sleep(Duration::from_millis(50));
    exchange(&ctx, &r#gen, &[submit(1, 64), submit(2, 200)]);
}
