//! Two real processes on loopback, over shared memory and over TCP: every preset moves its
//! cache through `kvferry serve` pairs driven by the bound planner, and the oracle checks
//! every destination byte (each request's slots, then the idle pools).

use crate::support;

use support::transfer::{Server, chunked, demo, exchange, submit};

fn demo_ok(args: &[&str], requests: u64) -> serde_json::Value {
    let v = demo(args);
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(v["requests"], requests, "{v}");
    assert_eq!(v["failed"], 0, "{v}");
    assert!(v["bytes"].as_u64().unwrap() > 0, "{v}");
    assert!(v["fragments"].as_u64().unwrap() > 0, "{v}");
    for p in ["p50", "p90", "p99"] {
        assert!(v["latency_ms"][p].as_f64().unwrap() > 0.0, "{v}");
    }
    v
}

/// DeepSeek-V3 dep2 -> dep4 through the demo with the MLA planner: 8 requests of 300 tokens,
/// 4 in flight, plus `extra` flags.
fn deepseek_dep2_to_dep4(transport: &str, extra: &[&str]) {
    let args = [
        &[
            "--model",
            "deepseek-v3",
            "--ctx",
            "dep2",
            "--gen",
            "dep4",
            "--planner",
            "kvferry.deepseek_mla_latent",
            "--requests",
            "8",
            "--prompt-len",
            "300",
            "--in-flight",
            "4",
            "--transport",
            transport,
            "--seed",
            "3",
        ][..],
        extra,
    ]
    .concat();
    let v = demo_ok(&args, 8);
    assert_eq!(v["planner"], "kvferry.deepseek_mla_latent");
    assert_eq!(v["transport"], transport);
}

#[test]
fn deepseek_v3_dep2_to_dep4_mla_planner_shm() {
    deepseek_dep2_to_dep4("shm", &[]);
}

#[test]
fn deepseek_v3_dep2_to_dep4_mla_planner_tcp() {
    deepseek_dep2_to_dep4("tcp", &[]);
}

fn llama(ctx: &str, decode: &str, transport: &str) {
    let _ = demo_ok(
        &[
            "--model",
            "llama-3-70b",
            "--ctx",
            ctx,
            "--gen",
            decode,
            "--planner",
            "kvferry.default",
            "--requests",
            "4",
            "--prompt-len",
            "100",
            "--in-flight",
            "2",
            "--transport",
            transport,
        ],
        4,
    );
}

#[test]
fn llama_3_70b_tp2_to_tp4_default_planner_shm() {
    llama("tp2", "tp4", "shm");
}

#[test]
fn llama_3_70b_tp2_to_tp4_default_planner_tcp() {
    llama("tp2", "tp4", "tcp");
}

/// `--transport auto` leaves the transports to UCX (shared memory and tcp here); a UCX_TLS
/// list and `--net-devices` reach both servers.
#[test]
fn llama_3_70b_over_auto_and_a_ucx_list_with_devices() {
    llama("tp1", "tp2", "auto");
    let _ = demo_ok(
        &[
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp1",
            "--gen",
            "tp1",
            "--planner",
            "kvferry.default",
            "--requests",
            "2",
            "--prompt-len",
            "64",
            "--transport",
            "tcp,self",
            "--net-devices",
            "lo",
        ],
        2,
    );
}

#[test]
fn llama_3_70b_tp4_to_tp2_default_planner_shm() {
    llama("tp4", "tp2", "shm");
}

#[test]
fn llama_3_70b_tp4_to_tp2_default_planner_tcp() {
    llama("tp4", "tp2", "tcp");
}

/// The hybrid preset: paged attention plus recurrent state (conv sections, ssm heads), with
/// whole, chunked and cached-prefix requests in flight together.
fn hybrid(transport: &str) {
    let _ = hybrid_with(transport, &[]);
}

fn hybrid_with(transport: &str, extra: &[&str]) -> Vec<kvferry_transfer::RequestStats> {
    hybrid_in_parts(transport, extra, 1)
}

/// The hybrid requests, each chunk sent in `parts` layer-wise sends (the prefill ranks have
/// three views: attention, conv, ssm).
fn hybrid_in_parts(
    transport: &str,
    extra: &[&str],
    parts: u32,
) -> Vec<kvferry_transfer::RequestStats> {
    let model = "qwen3-next-80b-a3b";
    let ctx = Server::start("context", model, "tp2", transport, extra);
    let decode = Server::start("generation", model, "tp4", transport, extra);
    let whole = submit(1, 100);
    let pieces = chunked(submit(2, 150), 64);
    let mut cached = submit(3, 130);
    cached.cached = 70;
    let mut both = chunked(submit(4, 200), 32);
    both.cached = 64;
    let mut submits = [whole, pieces, cached, both];
    for s in &mut submits {
        s.layer_parts = parts;
    }
    let stats = exchange(&ctx, &decode, &submits);
    // tp2 -> tp4: every receiver rank has one writer.
    assert!(stats.iter().all(|s| s.writers == 4), "{stats:?}");
    // Chunked requests report one completion per send per writer.
    assert_eq!(stats[1].pieces, 4 * 3 * parts, "{:?}", stats[1]);
    assert_eq!(stats[3].pieces, 4 * 7 * parts, "{:?}", stats[3]);
    // A cached prefix is not sent again.
    assert!(stats[2].bytes < stats[0].bytes * 130 / 100, "{stats:?}");
    stats
}

#[test]
fn qwen3_next_hybrid_state_chunked_and_cached_shm() {
    hybrid("shm");
}

#[test]
fn qwen3_next_hybrid_state_chunked_and_cached_tcp() {
    hybrid("tcp");
}

/// `--bounce on`: every piece gathered into the sender's staging buffer, put into the
/// receiver's arena and scattered there by its own plan — Llama-3-70B TP2 -> TP4 chunked
/// with a cached prefix through the demo, and the hybrid preset's paged blocks plus
/// recurrent state — over tcp and shm, every byte verified (the bench test shows the puts
/// and the scatter).
#[test]
fn bounce_on_moves_every_byte_over_tcp_and_shm() {
    for transport in ["tcp", "shm"] {
        let _ = demo_ok(
            &[
                "--model",
                "llama-3-70b",
                "--ctx",
                "tp2",
                "--gen",
                "tp4",
                "--requests",
                "4",
                "--prompt-len",
                "200",
                "--chunk",
                "64",
                "--cached",
                "32",
                "--in-flight",
                "2",
                "--transport",
                transport,
                "--bounce",
                "on",
                "--bounce-arena-mb",
                "16",
            ],
            4,
        );
        hybrid_with(transport, &["--bounce", "on", "--bounce-arena-mb", "16"]);
    }
}

/// The demo's own chunk and cache options, end to end.
#[test]
fn deepseek_demo_chunked_with_cached_prefix_shm() {
    let _ = demo_ok(
        &[
            "--model",
            "deepseek-v3",
            "--ctx",
            "dep2",
            "--gen",
            "dep4",
            "--planner",
            "kvferry.deepseek_mla_latent",
            "--requests",
            "6",
            "--prompt-len",
            "256",
            "--chunk",
            "64",
            "--cached",
            "32",
            "--in-flight",
            "3",
            "--transport",
            "shm",
        ],
        6,
    );
}

/// One `kvferry serve --rank N` process per rank, as engines run them (the processes of an
/// instance share its `--name`), driven by `kvferry demo --ctx-at/--gen-at` as servers
/// already running elsewhere would be: Llama-3-70B TP2 (two processes) to TP4 (four), over
/// tcp, chunked, with a cached prefix; every byte verified, and the servers keep running
/// after the demo (it stops only what it started).
#[test]
fn one_process_per_rank_driven_by_demo_ctx_at_gen_at_tcp() {
    let per_rank = |role: &'static str, spec: &str, ranks: u32, name: &str| -> Vec<Server> {
        (0..ranks)
            .map(|r| {
                Server::start(
                    role,
                    "llama-3-70b",
                    spec,
                    "tcp",
                    &["--rank", &r.to_string(), "--name", name],
                )
            })
            .collect()
    };
    let ctx = per_rank("context", "tp2", 2, "prefill");
    let decode = per_rank("generation", "tp4", 4, "decode");
    let controls = |servers: &[Server]| {
        servers
            .iter()
            .map(|s| s.control.clone())
            .collect::<Vec<_>>()
            .join(",")
    };
    let (ctx_at, gen_at) = (controls(&ctx), controls(&decode));
    for _ in 0..2 {
        let v = demo_ok(
            &[
                "--model",
                "llama-3-70b",
                "--ctx",
                "tp2",
                "--gen",
                "tp4",
                "--ctx-at",
                &ctx_at,
                "--gen-at",
                &gen_at,
                "--requests",
                "4",
                "--prompt-len",
                "200",
                "--chunk",
                "64",
                "--cached",
                "32",
                "--in-flight",
                "2",
            ],
            4,
        );
        assert_eq!(v["planner"], "kvferry.default");
    }
    // Every rank is its own process, each with its own agent.
    for s in ctx.iter().chain(&decode) {
        assert_eq!(s.info().ranks.len(), 1);
    }
}

/// `--ctx-at` servers that are not one instance, or miss a rank, are refused by name.
#[test]
fn demo_refuses_servers_that_are_not_one_whole_instance() {
    let a = Server::start("context", "llama-3-70b", "tp2", "tcp", &["--rank", "0"]);
    let b = Server::start("context", "llama-3-70b", "tp2", "tcp", &["--rank", "1"]);
    let g = Server::start("generation", "llama-3-70b", "tp1", "tcp", &[]);
    let run = |ctx_at: String| {
        support::Kvferry::new()
            .quiet()
            .args([
                "demo",
                "--model",
                "llama-3-70b",
                "--ctx",
                "tp2",
                "--gen",
                "tp1",
                "--ctx-at",
            ])
            .arg(ctx_at)
            .args(["--gen-at", &g.control, "--requests", "1"])
            .output()
    };
    // Two processes of two differently named instances.
    let out = run(format!("{},{}", a.control, b.control));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("must run one instance"), "{stderr}");
    // Rank 1 missing.
    let out = run(a.control.clone());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("rank 1 of prefill instance"), "{stderr}");
}

/// Servers holding a secret from `--secret-file` (not the environment's) are driven by
/// `demo --ctx-at/--gen-at --secret-file` with the same file, and refused without it, the
/// refusal naming where a secret comes from.
#[test]
fn demo_ctx_at_gen_at_proves_the_secret_of_its_secret_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("deployment.secret");
    std::fs::write(
        &file,
        "a deployment secret only this file holds, 56 bytes long.\n",
    )
    .unwrap();
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let file = file.to_str().unwrap();
    let flags = ["--secret-file", file];
    let ctx = Server::start("context", "llama-3-70b", "tp1", "tcp", &flags);
    let gen_ = Server::start("generation", "llama-3-70b", "tp1", "tcp", &flags);
    let args = |with_file: bool| {
        let mut args = vec![
            "demo",
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp1",
            "--gen",
            "tp1",
            "--ctx-at",
            &ctx.control,
            "--gen-at",
            &gen_.control,
            "--requests",
            "2",
            "--prompt-len",
            "64",
        ];
        if with_file {
            args.extend(flags);
        }
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    // The environment holds the tests' other secret.
    let out = support::Kvferry::new().quiet().args(args(false)).output();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("KVFERRY_SECRET") && stderr.contains("--secret-file"),
        "{stderr}"
    );
    let v = demo_ok(
        &args(true)[1..]
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        2,
    );
    assert_eq!(v["planner"], "kvferry.default");
}

/// Differing block sizes between the two sides (semantics §3.2 rule 4), end to end: the
/// prefill side's 16-token blocks re-blocked into the decode side's 32-token ones,
/// chunked with a cached prefix, every byte verified; and the other way round over tcp.
#[test]
fn llama_3_70b_differing_tokens_per_block_both_ways() {
    let run = |ctx_tpb: &str, gen_tpb: &str, transport: &str| {
        let v = demo_ok(
            &[
                "--model",
                "llama-3-70b",
                "--ctx",
                "tp2",
                "--gen",
                "tp4",
                "--ctx-tokens-per-block",
                ctx_tpb,
                "--gen-tokens-per-block",
                gen_tpb,
                "--requests",
                "3",
                "--prompt-len",
                "300",
                "--chunk",
                "64",
                "--cached",
                "32",
                "--in-flight",
                "3",
                "--transport",
                transport,
            ],
            3,
        );
        let model = v["model"].as_str().unwrap().to_string();
        assert!(
            model.contains(&format!("tpb{ctx_tpb}"))
                && model.contains(&format!("decode tpb{gen_tpb}")),
            "{model}"
        );
    };
    run("16", "32", "shm");
    run("64", "32", "tcp");
}

/// `--integrity`: the decode server checks every piece against its writer's digest —
/// the hybrid preset's paged blocks and recurrent state, chunked and with cached prefixes,
/// over tcp with XXH3, and DeepSeek-V3's latent cache through the demo over shm with CRC-32C
/// — every byte verified by the oracle as well.
#[test]
fn integrity_digests_check_every_piece_over_tcp_and_shm() {
    let stats = hybrid_with("tcp", &["--integrity", "xxh3"]);
    // Nothing bounces at these sizes: the receiver's time after the puts is the checks'.
    assert!(stats.iter().all(|s| s.stages.scatter_ns > 0), "{stats:?}");
    deepseek_dep2_to_dep4("shm", &["--integrity", "crc32c"]);
}

/// Layer-wise sends through two servers, every byte verified by the oracle: the hybrid
/// preset's chunks each in three sends (attention blocks, conv state, ssm state: the state
/// rides on the last chunk's parts), chunked and with cached prefixes, over shm, then over
/// tcp with XXH3 digests and bounce transfers (the receiver plans each part over the views
/// it names); and GPT-OSS-120B's sliding and full attention groups in two parts through the
/// demo, chunked with a cached prefix.
#[test]
fn layer_wise_sends_move_every_byte() {
    let stats = hybrid_in_parts("shm", &[], 3);
    assert!(stats.iter().all(|s| s.bytes > 0), "{stats:?}");
    let _ = hybrid_in_parts(
        "tcp",
        &[
            "--integrity",
            "xxh3",
            "--bounce",
            "on",
            "--bounce-arena-mb",
            "16",
        ],
        3,
    );
    let _ = demo_ok(
        &[
            "--model",
            "gpt-oss-120b",
            "--ctx",
            "tp2",
            "--gen",
            "tp1",
            "--requests",
            "6",
            "--prompt-len",
            "300",
            "--chunk",
            "64",
            "--cached",
            "64",
            "--layer-wise",
            "2",
            "--in-flight",
            "3",
            "--transport",
            "tcp",
        ],
        6,
    );
}
