//! `kvferry bench` smoke tests: tiny transfers over both transports, both paths measured, the
//! JSON fields present. Timings are never asserted on (only that they are positive).

use crate::support;

use std::io::Cursor;
use std::process::Command;

use kvferry_harness::control::ControlMessage as Message;
use kvferry_protocol::{encode, read_frame};
use kvferry_transfer::harness::{BenchStats, PairFragments, PoolFragment};
use kvferry_transfer::{RequestStats, Stages};
use serde_json::Value;
use support::Kvferry;
use support::transfer::{REPLY, Server, prefill, release, submit};

const MLA: &str = "kvferry.deepseek_mla_latent";

/// The two exports' cases: an MLA pair over shm, a GQA pair over tcp (model, ctx, gen,
/// planner, transport).
const EXPORT_CASES: [(&str, &str, &str, &str, &str); 2] = [
    ("deepseek-v3", "dep2", "dep2", MLA, "shm"),
    ("llama-3-70b", "tp2", "tp4", "kvferry.default", "tcp"),
];

/// A tiny bench of one export case: two 96-token requests, one counted round.
fn export_args<'a>(
    model: &'a str,
    ctx: &'a str,
    decode: &'a str,
    planner: &'a str,
    transport: &'a str,
) -> Vec<&'a str> {
    vec![
        "--model",
        model,
        "--ctx",
        ctx,
        "--gen",
        decode,
        "--prompt-len",
        "96",
        "--requests",
        "2",
        "--rounds",
        "1",
        "--transport",
        transport,
        "--planner",
        planner,
    ]
}

/// `--export-fragments` writes round 0's set: every fragment inside its pair's pools, and the
/// totals those of the bench (the bench itself fails the run when they differ from the raw
/// replay of the same set).
#[test]
fn bench_exports_the_fragments_it_moves() {
    let dir = tempfile::tempdir().unwrap();
    for (model, ctx, decode, planner, transport) in EXPORT_CASES {
        let file = dir.path().join(format!("{model}-{transport}.json"));
        let v = bench(
            &[
                export_args(model, ctx, decode, planner, transport).as_slice(),
                &["--export-fragments", file.to_str().unwrap()],
            ]
            .concat(),
        );
        check_common(&v, transport, planner);
        let export = &v["export"];
        assert_eq!(export["path"], file.to_str().unwrap(), "{v}");
        assert_eq!(export["round"], 0, "{v}");

        let f: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        assert_eq!(f["format"], kvferry_harness::bench::FRAGMENTS_FORMAT);
        assert_eq!(f["transport"], transport);
        assert_eq!(f["planner"], planner);
        assert_eq!(f["prefill"], ctx);
        assert_eq!(f["decode"], decode);
        // The product's transport list (shm leaves cma out: UCX 1.22 would make every put
        // over 4 KiB a system call).
        let tls = if transport == "shm" {
            "posix,sysv,self"
        } else {
            "tcp"
        };
        assert_eq!(f["ucx_env"]["UCX_TLS"], tls);
        let pairs: Vec<PairFragments> = serde_json::from_value(f["pairs"].clone()).unwrap();
        assert_eq!(pairs.len() as u64, export["pairs"].as_u64().unwrap());
        let (mut fragments, mut bytes) = (0u64, 0u64);
        for p in &pairs {
            assert_eq!(
                p.plans.iter().sum::<u64>(),
                p.fragments.len() as u64,
                "{p:?}"
            );
            let moved: u64 = p.fragments.iter().map(PoolFragment::len).sum();
            assert_eq!(moved, p.bytes);
            for &PoolFragment(sp, so, dp, d, len) in &p.fragments {
                assert!(len > 0);
                assert!(so + len <= p.src_pools[sp as usize], "{p:?}");
                assert!(d + len <= p.dst_pools[dp as usize], "{p:?}");
            }
            fragments += p.fragments.len() as u64;
            bytes += moved;
        }
        assert_eq!(fragments, f["fragments"].as_u64().unwrap());
        assert_eq!(fragments, export["fragments"].as_u64().unwrap());
        assert_eq!(bytes, f["bytes"].as_u64().unwrap());
        assert_eq!(bytes, export["bytes"].as_u64().unwrap());
        // What the raw loop put for that set, and what the bench reports per round.
        assert_eq!(
            fragments,
            export["replay_fragments"].as_u64().unwrap(),
            "{v}"
        );
        assert_eq!(bytes, export["replay_bytes"].as_u64().unwrap(), "{v}");
        // Every round moves the same bytes; with one counted round its fragments are the
        // report's only if placement coalesces alike, so only bytes are compared here.
        assert_eq!(bytes, v["bytes"].as_u64().unwrap(), "{v}");
        assert_eq!(
            f["requests"].as_array().unwrap().len() as u64,
            v["requests"].as_u64().unwrap()
        );
    }
}

/// `--export-workload` writes round 0's set as an engine holds it, and kvferry's plan-only API
/// (`kvferry::planning::PairPlanner`, what `scripts/bench-peers`' runners call through Python)
/// plans it into exactly the fragments the prefill server recorded and moved: the same pairs,
/// and per pair the same `(pool, offset)` fragments in the same order.
#[test]
fn workload_export_plans_to_the_fragments_it_moved() {
    use kvferry::planning::{PairPlanner, Piece};
    use kvferry_planner_abi::{SlotTable, TokenRange};
    use std::collections::BTreeMap;

    let dir = tempfile::tempdir().unwrap();
    let plugins = support::build_dir();
    for (model, ctx, decode, planner, transport) in EXPORT_CASES {
        let fragments_file = dir.path().join(format!("{model}-fragments.json"));
        let workload_file = dir.path().join(format!("{model}-workload.json"));
        let v = bench(
            &[
                export_args(model, ctx, decode, planner, transport).as_slice(),
                &[
                    "--export-fragments",
                    fragments_file.to_str().unwrap(),
                    "--export-workload",
                    workload_file.to_str().unwrap(),
                ],
            ]
            .concat(),
        );
        check_common(&v, transport, planner);
        let read = |path: &std::path::Path| -> Value {
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
        };
        let moved: Vec<PairFragments> =
            serde_json::from_value(read(&fragments_file)["pairs"].clone()).unwrap();
        let w = read(&workload_file);
        assert_eq!(w["format"], kvferry_harness::bench::WORKLOAD_FORMAT);
        assert_eq!(w["planner"], planner);
        // Each rank's configuration, as an agent reads it, with the in-tree planners.
        let config = |side: &str, rank: &str| -> String {
            let mut c = w[side][rank].clone();
            c["plugin_dir"] = Value::from(plugins.to_str().unwrap());
            c.to_string()
        };
        let tables = |v: &Value| -> Vec<SlotTable> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|t| SlotTable {
                    slots: t
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|s| s.as_i64().unwrap())
                        .collect(),
                })
                .collect()
        };
        // Pool of an address, from the rank's page table.
        let locate = |side: &str, rank: &str, address: u64, len: u64| -> (u32, u64) {
            let pools = w[side][rank]["rank"]["page_table"]["pools"]
                .as_array()
                .unwrap();
            pools
                .iter()
                .enumerate()
                .find_map(|(i, p)| {
                    let base = p["base"].as_u64().unwrap();
                    let size = (p["num_slots"].as_u64().unwrap() - 1)
                        * p["slot_stride"].as_u64().unwrap()
                        + p["slot_bytes"].as_u64().unwrap();
                    (address >= base && address + len <= base + size)
                        .then(|| (i as u32, address - base))
                })
                .unwrap_or_else(|| panic!("{side} {rank}: {address:#x} in no pool"))
        };
        let mut planned: BTreeMap<(u32, u32), Vec<PoolFragment>> = BTreeMap::new();
        for request in w["requests"].as_array().unwrap() {
            let prompt = request["prompt_len"].as_u64().unwrap();
            for (p, p_tables) in request["prefill"].as_object().unwrap() {
                for (d, d_tables) in request["decode"].as_object().unwrap() {
                    let pair =
                        PairPlanner::new(&config("prefill_ranks", p), &config("decode_ranks", d))
                            .unwrap();
                    assert_eq!(pair.planner_id(), planner);
                    if !pair.writes() {
                        continue;
                    }
                    let plan = pair
                        .plan(&Piece {
                            prefill_tables: tables(p_tables),
                            decode_tables: tables(d_tables),
                            tokens: TokenRange {
                                start: 0,
                                end: prompt,
                            },
                            prompt_len: prompt,
                            dst_start_token: None,
                            views: None,
                        })
                        .unwrap();
                    let out = planned
                        .entry((p.parse().unwrap(), d.parse().unwrap()))
                        .or_default();
                    for (src, dst, len) in plan.fragments() {
                        let (sp, so) = locate("prefill_ranks", p, src, len);
                        let (dp, d_off) = locate("decode_ranks", d, dst, len);
                        out.push(PoolFragment(sp, so, dp, d_off, len));
                    }
                }
            }
        }
        let moved: BTreeMap<(u32, u32), Vec<PoolFragment>> = moved
            .into_iter()
            .map(|p| ((p.ctx_rank, p.gen_rank), p.fragments))
            .collect();
        assert_eq!(
            planned.keys().collect::<Vec<_>>(),
            moved.keys().collect::<Vec<_>>()
        );
        for (pair, fragments) in &moved {
            assert!(
                !fragments.is_empty(),
                "{model}: pair {pair:?} moved nothing"
            );
            assert_eq!(&planned[pair], fragments, "{model}: pair {pair:?}");
        }
        let counted: u64 = w["pairs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["fragments"].as_u64().unwrap())
            .sum();
        assert_eq!(counted, w["fragments"].as_u64().unwrap());
        assert_eq!(counted, moved.values().map(|f| f.len() as u64).sum::<u64>());
    }
}

/// `Fragments` needs a recording prefill server, like `Bench`.
/// `kvferry bench ARGS --json` with no planner configuration from the environment.
fn bench(args: &[&str]) -> Value {
    let v = Kvferry::new()
        .quiet()
        .arg("bench")
        .args(args)
        .arg("--json")
        .json();
    eprintln!(
        "bench {args:?}: ours {} GB/s, raw {} GB/s, ratio {}, perftest {}",
        v["ours_gbps"], v["raw_gbps"], v["ratio"], v["perftest_gbps"]
    );
    v
}

fn positive(v: &Value, key: &str) -> f64 {
    let x = v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v}"));
    assert!(x > 0.0, "{key} = {x}");
    x
}

/// The stage fields of the report, in seconds.
const STAGES: [&str; 10] = [
    "plan_s",
    "validate_s",
    "gather_s",
    "puts_s",
    "flush_s",
    "scatter_s",
    "digest_s",
    "control_s",
    "queue_s",
    "copy_s",
];

/// A `stages` object: every field a non-negative number of seconds; returns them by name.
fn stages(v: &Value, at: &str) -> std::collections::BTreeMap<&'static str, f64> {
    let object = v
        .as_object()
        .unwrap_or_else(|| panic!("{at} is not an object: {v}"));
    assert_eq!(object.len(), STAGES.len(), "{at}: {v}");
    STAGES
        .iter()
        .map(|&k| {
            let x = v[k]
                .as_f64()
                .unwrap_or_else(|| panic!("{at}.{k} missing or not a number: {v}"));
            assert!(x >= 0.0, "{at}.{k} = {x}");
            (k, x)
        })
        .collect()
}

fn check_common(v: &Value, transport: &str, planner: &str) {
    check_paths(v, transport, planner, false);
}

/// [`check_common`] for a run that bounced (`bounced`) or did not.
fn check_paths(v: &Value, transport: &str, planner: &str, bounced: bool) {
    for key in [
        "ours_gbps",
        "raw_gbps",
        "memcpy_gbps",
        "ratio",
        "mean_fragment_bytes",
    ] {
        positive(v, key);
    }
    let per_round = &v["ratio_rounds"];
    assert!(
        per_round["min"].as_f64() > Some(0.0)
            && per_round["min"].as_f64() <= per_round["median"].as_f64()
            && per_round["median"].as_f64() <= per_round["max"].as_f64(),
        "{v}"
    );
    // Where the agent path's time went: the planner ran, puts were issued; a scatter only
    // when bouncing (the gather's wait may round to nothing), and no memcpy-baseline copies.
    let ours = stages(&v["stages"], "stages");
    assert_eq!(v["stages"], v["ours"]["stages"], "{v}");
    assert!(ours["plan_s"] > 0.0 && ours["puts_s"] > 0.0, "{v}");
    assert_eq!(ours["copy_s"], 0.0, "{v}");
    assert_eq!(ours["scatter_s"] > 0.0, bounced, "{v}");
    if !bounced {
        assert_eq!(ours["gather_s"], 0.0, "{v}");
    }
    let (ours_puts, pieces) = (
        v["ours_puts"].as_u64().expect("ours_puts"),
        v["pieces"].as_u64().expect("pieces"),
    );
    assert!(ours_puts > 0 && pieces > 0, "{v}");
    assert!(
        v["puts_per_piece"].as_f64().is_some_and(|p| p >= 1.0),
        "{v}"
    );
    if bounced {
        // Fewer, larger puts than the bare loop's one per fragment.
        assert!(ours_puts < v["puts"].as_u64().unwrap(), "{v}");
    } else if transport == "shm" {
        // One copy per fragment, straight into the receiver's shared mapping (sets differ
        // slightly in coalescing).
        let fragments = v["fragments"].as_u64().unwrap();
        assert!(ours_puts.abs_diff(fragments) <= fragments / 10, "{v}");
    } else {
        // One per fragment and MiB, as the bare loop (sets differ slightly in coalescing).
        let raw = v["puts"].as_u64().unwrap();
        assert!(ours_puts.abs_diff(raw) <= raw / 10, "{v}");
    }
    // The bare loop only puts and flushes; memcpy only copies.
    let raw = stages(&v["raw"]["stages"], "raw.stages");
    assert!(raw["puts_s"] > 0.0, "{v}");
    for k in ["plan_s", "validate_s", "control_s", "queue_s", "copy_s"] {
        assert_eq!(raw[k], 0.0, "raw.stages.{k}: {v}");
    }
    let copy = stages(&v["memcpy"]["stages"], "memcpy.stages");
    assert!(copy["copy_s"] > 0.0, "{v}");
    assert!(
        STAGES
            .iter()
            .filter(|&&k| k != "copy_s")
            .all(|k| copy[k] == 0.0),
        "{v}"
    );
    assert!(v["overhead_per_request_s"].as_f64().is_some(), "{v}");
    let fragments = v["fragments"].as_u64().expect("fragments");
    let bytes = v["bytes"].as_u64().expect("bytes");
    assert!(fragments > 0 && bytes > 0, "{v}");
    let mean = positive(v, "mean_fragment_bytes");
    assert!(
        (mean - bytes as f64 / fragments as f64).abs() <= mean * 0.01 + 1.0,
        "{v}"
    );
    assert_eq!(v["transport"], transport);
    assert_eq!(v["planner"], planner);
    assert!(
        v.get("perftest_gbps").is_some(),
        "perftest_gbps is always present: {v}"
    );
    assert_eq!(v["verified"], true, "{v}");
    assert!(v["errors"].as_array().is_some_and(Vec::is_empty), "{v}");
    for path in ["ours", "raw", "memcpy"] {
        let gbps = &v[path]["gbps"];
        assert!(gbps["min"].as_f64() <= gbps["median"].as_f64(), "{v}");
        assert!(gbps["median"].as_f64() <= gbps["max"].as_f64(), "{v}");
        let rounds = v[path]["rounds_gbps"].as_array().expect("rounds");
        assert_eq!(rounds.len() as u64, v["rounds"].as_u64().unwrap(), "{v}");
        assert!(rounds.iter().all(|r| r.as_f64().is_some_and(|x| x > 0.0)));
    }
}

#[test]
fn bench_deepseek_shm_reports_both_paths() {
    let v = bench(&[
        "--model",
        "deepseek-v3",
        "--ctx",
        "dep2",
        "--gen",
        "dep2",
        "--prompt-len",
        "96",
        "--requests",
        "2",
        "--rounds",
        "2",
        "--transport",
        "shm",
        "--planner",
        MLA,
    ]);
    check_common(&v, "shm", MLA);
    assert!(v["perftest_gbps"].is_null(), "{v}");
}

/// Llama-3-70B TP1 -> TP1 over shm, 64 tokens: one 20 MiB job per request, past the
/// streaming copies' 16 MiB job threshold (`kvferry_transfer`'s `streaming`), so its fragments
/// go into the peer's mapping with non-temporal stores, half of them by the rank's copy helper
/// on a machine with two cores or more (one job at a time); the oracle checks every byte.
#[test]
fn bench_llama_shm_streams_a_large_job_and_every_byte_lands() {
    let v = bench(&[
        "--model",
        "llama-3-70b",
        "--ctx",
        "tp1",
        "--gen",
        "tp1",
        "--prompt-len",
        "64",
        "--requests",
        "1",
        "--rounds",
        "1",
        "--transport",
        "shm",
        "--planner",
        "kvferry.default",
    ]);
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(v["bytes"], 64 * 80 * 2 * 8 * 128 * 2, "{v}");
}

/// DeepSeek-V3 dep1 -> dep1 over shm, 128 tokens: one 4.3 MiB job per request, under the
/// streaming threshold but past the one where a job shares its copies
/// (`SHARE_MIN_JOB_BYTES`, 2 MiB), so its fragments are copied with `memmove`, half of them
/// by the rank's copy helper on a machine with two cores or more; the oracle checks every
/// byte.
#[test]
fn bench_deepseek_shm_shares_a_cache_sized_job_and_every_byte_lands() {
    let v = bench(&[
        "--model",
        "deepseek-v3",
        "--ctx",
        "dep1",
        "--gen",
        "dep1",
        "--prompt-len",
        "128",
        "--requests",
        "1",
        "--rounds",
        "1",
        "--transport",
        "shm",
        "--planner",
        MLA,
    ]);
    assert_eq!(v["verified"], true, "{v}");
    let bytes = v["bytes"].as_u64().expect("bytes");
    assert!(
        (2 << 20..16 << 20).contains(&bytes),
        "{bytes} bytes: not one job between the two thresholds"
    );
}

/// Llama-3-70B TP2 -> TP4 over tcp with `--bounce on`: each piece is gathered and put in a
/// few large puts, scattered on the receiver, and every byte still verified.
#[test]
fn bench_llama_tcp_bounce_on_puts_fewer_and_scatters() {
    let v = bench(&[
        "--model",
        "llama-3-70b",
        "--ctx",
        "tp2",
        "--gen",
        "tp4",
        "--prompt-len",
        "256",
        "--requests",
        "2",
        "--rounds",
        "2",
        "--transport",
        "tcp",
        "--bounce",
        "on",
        "--bounce-arena-mb",
        "64",
    ]);
    check_paths(&v, "tcp", "kvferry.default", true);
    assert_eq!(v["bounce"], "on", "{v}");
}

/// `--sweep` runs nixlbench's grid: one cell per fragment size and batch within the byte
/// limit, each one request of BATCH fragments of that size at a time, verified by the oracle,
/// with latencies per round and the cell's workload exported for the peers' runners.
#[test]
fn bench_sweep_runs_the_grid_one_request_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("grid");
    let v = Kvferry::new()
        .quiet()
        .args([
            "bench",
            "--sweep",
            "--ctx",
            "tp1",
            "--gen",
            "tp1",
            "--fragment-sizes",
            "4k,64k",
            "--batches",
            "1,16",
            "--max-request-bytes",
            "512k",
            "--rounds",
            "3",
            "--transport",
            "shm",
            "--export-workload",
        ])
        .arg(&out)
        .arg("--json")
        .json();
    // 64 KiB x 16 is 1 MiB, over the limit.
    assert_eq!(v["skipped"], serde_json::json!([[65536, 16]]), "{v}");
    let cells = v["cells"]
        .as_array()
        .unwrap_or_else(|| panic!("no cells: {v}"));
    let shapes: Vec<(u64, u64)> = cells
        .iter()
        .map(|c| {
            (
                c["fragment_bytes"].as_u64().unwrap(),
                c["batch"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(shapes, [(4096, 1), (4096, 16), (65536, 1)], "{v}");
    for c in cells {
        let (size, batch) = (
            c["fragment_bytes"].as_u64().unwrap(),
            c["batch"].as_u64().unwrap(),
        );
        assert_eq!(c["verified"], true, "{c}");
        assert_eq!(c["bytes"].as_u64().unwrap(), size * batch, "{c}");
        assert_eq!(c["tokens_per_block"].as_u64().unwrap(), size / 512, "{c}");
        // One fragment per block, fewer only where two ordinals landed on adjacent slots on
        // both sides and coalesced.
        let fragments = c["fragments"].as_u64().unwrap();
        assert!((1..=batch).contains(&fragments), "{c}");
        assert_eq!(c["report"]["requests"], 1, "{c}");
        assert_eq!(
            c["report"]["ours"]["rounds_stages"]
                .as_array()
                .unwrap()
                .len(),
            3,
            "{c}"
        );
        for key in ["ours", "agent", "raw", "prepare", "post"] {
            let avg = c[key]["avg_us"].as_f64().unwrap();
            let p99 = c[key]["p99_us"].as_f64().unwrap();
            // Posting one 4 KiB copy may read as 0 ns.
            assert!(avg >= 0.0 && p99 >= avg, "{key}: {c}");
            assert!(key == "post" || avg > 0.0, "{key}: {c}");
        }
        positive(c, "ours_gbps");
        positive(c, "raw_gbps");
        let workload = out.join(format!("{size}-{batch}.json"));
        assert_eq!(c["workload"], workload.display().to_string(), "{c}");
        let w: Value = serde_json::from_slice(&std::fs::read(&workload).unwrap()).unwrap();
        assert_eq!(w["format"], "kvferry-workload/1");
        assert_eq!(w["prompt_len"].as_u64().unwrap(), batch * (size / 512));
    }
    assert!(out.join("model").join("config.json").is_file());
}

/// `--requests 1,2` runs the bench once per value: an array of two full reports, in order.
#[test]
fn bench_requests_sweep_reports_one_result_per_value() {
    let v = Kvferry::new()
        .quiet()
        .args([
            "bench",
            "--model",
            "deepseek-v3",
            "--ctx",
            "dep2",
            "--gen",
            "dep2",
            "--prompt-len",
            "64",
            "--requests",
            "1,2",
            "--rounds",
            "1",
            "--transport",
            "shm",
            "--planner",
            MLA,
            "--json",
        ])
        .json();
    let runs = v.as_array().unwrap_or_else(|| panic!("not an array: {v}"));
    assert_eq!(runs.len(), 2, "{v}");
    for (run, n) in runs.iter().zip([1u64, 2]) {
        assert_eq!(run["requests"], n, "{run}");
        check_common(run, "shm", MLA);
    }
    // Twice the requests of one shape: twice the bytes.
    assert_eq!(
        runs[1]["bytes"].as_u64().unwrap(),
        2 * runs[0]["bytes"].as_u64().unwrap()
    );
}

#[test]
fn bench_llama_tcp_reports_both_paths() {
    let v = bench(&[
        "--model",
        "llama-3-70b",
        "--ctx",
        "tp2",
        "--gen",
        "tp4",
        "--prompt-len",
        "64",
        "--requests",
        "1",
        "--rounds",
        "1",
        "--transport",
        "tcp",
    ]);
    check_common(&v, "tcp", "kvferry.default");
}

/// With `--perftest` the same sitting runs `ucx_perftest` (skipped where ucx-utils is not
/// installed).
#[test]
fn bench_with_perftest_reports_its_bandwidth() {
    if Command::new(kvferry_harness::bench::PERFTEST)
        .arg("-h")
        .output()
        .is_err()
    {
        eprintln!(
            "{} not installed; skipping",
            kvferry_harness::bench::PERFTEST
        );
        return;
    }
    let v = bench(&[
        "--model",
        "deepseek-v3",
        "--ctx",
        "dep2",
        "--gen",
        "dep2",
        "--prompt-len",
        "64",
        "--requests",
        "1",
        "--rounds",
        "1",
        "--transport",
        "shm",
        "--planner",
        MLA,
        "--perftest",
    ]);
    check_common(&v, "shm", MLA);
    positive(&v, "perftest_gbps");
    let size = v["perftest"]["size"].as_f64().expect("perftest.size");
    let mean = positive(&v, "mean_fragment_bytes");
    assert!(
        (size - mean).abs() <= 0.5,
        "perftest size {size} vs mean {mean}"
    );
}

/// `Bench`, `Fragments` and `Memcpy` are refused by a prefill server that does not record plans,
/// naming the flag, and by one that does for a request it does not hold, naming it.
#[test]
fn bench_and_fragments_need_a_recording_context_server() {
    let ctx = Server::start("context", "deepseek-v3", "dep2", "shm", &["--planner", MLA]);
    let c = ctx.client();
    let s = submit(1, 64);
    let _ = prefill(&c, &s);
    let refusal = |c: &kvferry_harness::Client, requests: Vec<u64>| -> [String; 3] {
        let bench = match c.call(
            Message::Bench {
                requests: requests.clone(),
            },
            REPLY,
        ) {
            Ok(Message::BenchDone { result: Err(e) }) => e,
            other => panic!("{other:?}"),
        };
        let fragments = match c.call(
            Message::Fragments {
                requests: requests.clone(),
            },
            REPLY,
        ) {
            Ok(Message::FragmentsDone { result: Err(e) }) => e,
            other => panic!("{other:?}"),
        };
        let memcpy = match c.call(Message::Memcpy { requests }, REPLY) {
            Ok(Message::MemcpyDone { result: Err(e) }) => e,
            other => panic!("{other:?}"),
        };
        [bench, fragments, memcpy]
    };
    for e in refusal(&c, vec![1]) {
        assert!(e.contains("--record-plans"), "{e}");
    }
    release(&c, 1);

    let recording = Server::start(
        "context",
        "deepseek-v3",
        "dep2",
        "shm",
        &["--planner", MLA, "--record-plans"],
    );
    for e in refusal(&recording.client(), vec![9]) {
        assert!(e.contains("request 9"), "{e}");
    }
}

#[test]
fn bench_messages_round_trip() {
    for message in [
        Message::Bench {
            requests: vec![1, 2, u64::MAX],
        },
        Message::BenchDone {
            result: Ok(BenchStats {
                elapsed_ns: 12_345,
                bytes: 1 << 40,
                fragments: 7,
                puts: 9,
                plans: 2,
                ranks: 2,
                stages: Stages {
                    puts_ns: 5,
                    flush_ns: u64::MAX,
                    ..Stages::default()
                },
            }),
        },
        Message::Memcpy {
            requests: vec![0, u64::MAX],
        },
        Message::MemcpyDone {
            result: Ok(BenchStats {
                elapsed_ns: 1,
                bytes: 2,
                fragments: 3,
                puts: 3,
                plans: 1,
                ranks: 1,
                stages: Stages {
                    copy_ns: 9,
                    ..Stages::default()
                },
            }),
        },
        Message::MemcpyDone {
            result: Err("fragment 3 outside".into()),
        },
        Message::Stats { requests: vec![4] },
        Message::StatsDone {
            result: Ok(vec![RequestStats {
                bytes: 10,
                fragments: 2,
                writers: 1,
                pieces: 1,
                latency_us: 7,
                puts: 3,
                stages: Stages {
                    plan_ns: 1,
                    validate_ns: 2,
                    gather_ns: 3,
                    puts_ns: 4,
                    flush_ns: 5,
                    scatter_ns: 6,
                    control_ns: 7,
                    queue_ns: 8,
                    copy_ns: 9,
                    digest_ns: 10,
                },
            }]),
        },
        Message::StatsDone {
            result: Err("request 4 has not ended".into()),
        },
        Message::BenchDone {
            result: Err("not recording".into()),
        },
        Message::Fragments {
            requests: vec![3, u64::MAX],
        },
        Message::FragmentsDone {
            result: Ok(vec![PairFragments {
                ctx_rank: 1,
                gen_rank: 7,
                src_pools: vec![1 << 30, 4096],
                dst_pools: vec![1 << 29],
                plans: vec![1, 1],
                bytes: 8192 + 1,
                fragments: vec![
                    PoolFragment(0, 0, 0, u64::MAX - 8192, 8192),
                    PoolFragment(1, 4095, 0, 0, 1),
                ],
            }]),
        },
        Message::FragmentsDone {
            result: Err("not recording".into()),
        },
    ] {
        let frame = encode(&message).unwrap();
        assert_eq!(
            read_frame::<Message>(&mut Cursor::new(&frame)).unwrap(),
            message
        );
    }
}

/// `--layer-compute-us`: both modes measured in one process over per-layer pools, TP 2 ->
/// TP 1 (each decode rank written by both prefill ranks), every send and every
/// reception accounted for; the tails are times, never asserted on.
#[test]
fn bench_measures_the_layer_wise_tail() {
    let v = Kvferry::new()
        .quiet()
        .args([
            "bench",
            "--model",
            "gpt-oss-120b",
            "--ctx",
            "tp2",
            "--gen",
            "tp1",
            "--transport",
            "shm",
            "--prompt-len",
            "64",
            "--requests",
            "2",
            "--rounds",
            "2",
            "--layer-compute-us",
            "200",
            "--json",
        ])
        .json();
    assert_eq!(v["layers"], 36, "{v}");
    // Two prefill ranks, each sending 36 layers of 2 requests.
    assert_eq!(v["sends_per_round"], 2 * 36 * 2, "{v}");
    // 64 tokens x 36 layers x 8 KV heads x 64 x 2 bytes, K and V, 2 requests.
    assert_eq!(v["bytes_per_round"], 64 * 36 * 8 * 64 * 2 * 2 * 2, "{v}");
    assert_eq!(v["compute_ms"], 7.2, "{v}");
    for mode in ["whole", "layer_wise"] {
        assert_eq!(v[mode]["rounds_ms"].as_array().unwrap().len(), 2, "{v}");
    }
    assert!(v["ratio"].as_f64().unwrap() > 0.0, "{v}");
}
