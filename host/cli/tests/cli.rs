//! The `kvferry` command line as a user runs it: planners found next to the binary, selection
//! by environment, refusals with reasons, and the dry-run plan with its oracle.

use crate::support;

use std::process::Output;

use serde_json::Value;
use support::{Kvferry, build_dir, hf_config, text};

fn listed_ids(out: &Output) -> Vec<String> {
    let v: Value = serde_json::from_slice(&out.stdout).expect("planners --json prints JSON");
    v["planners"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn both_planners_are_found_next_to_the_binary_with_no_configuration() {
    let out = Kvferry::new().args(["planners", "--json"]).output();
    assert!(out.status.success(), "{:?}", text(&out));
    let ids = listed_ids(&out);
    assert!(ids.contains(&"kvferry.default".to_string()), "{ids:?}");
    assert!(
        ids.contains(&"kvferry.deepseek_mla_latent".to_string()),
        "{ids:?}"
    );
    let out = Kvferry::new().args(["planners"]).output();
    let (stdout, _) = text(&out);
    assert!(stdout.contains("kvferry.default_describer"), "{stdout}");
}

#[test]
fn a_plugin_dir_with_one_planner_lists_only_that_one() {
    let dir = tempfile::tempdir().unwrap();
    let so = "libkvferry_planner_deepseek_mla_latent.so";
    std::fs::copy(build_dir().join(so), dir.path().join(so)).unwrap();
    let out = Kvferry::new()
        .plugin_dir(dir.path())
        .args(["planners", "--json"])
        .output();
    assert!(out.status.success(), "{:?}", text(&out));
    assert_eq!(listed_ids(&out), vec!["kvferry.deepseek_mla_latent"]);
}

#[test]
fn planners_all_shows_skipped_files_with_their_reason() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("libgarbage.so"), b"not an elf file at all").unwrap();
    let out = Kvferry::new()
        .plugin_dir(dir.path())
        .args(["planners", "--all"])
        .output();
    // Nothing to bind from that path: a failure, with every file's reason.
    assert!(!out.status.success(), "{:?}", text(&out));
    let (stdout, _) = text(&out);
    assert!(stdout.contains("no planners found"), "{stdout}");
    assert!(stdout.contains("libgarbage.so"), "{stdout}");
    assert!(
        stdout.contains("not a loadable ELF shared object"),
        "{stdout}"
    );
}

#[test]
fn an_unknown_planner_fails_listing_the_known_ids() {
    let out = Kvferry::new()
        .planner("nope")
        .args(["check", "--model", "deepseek-v3", "--deployment", "dep4"])
        .output();
    assert!(!out.status.success());
    let (_, stderr) = text(&out);
    assert!(stderr.contains("nope"), "{stderr}");
    assert!(stderr.contains("kvferry.default"), "{stderr}");
    assert!(stderr.contains("kvferry.deepseek_mla_latent"), "{stderr}");
}

#[test]
fn an_unsupported_deployment_fails_with_the_planners_reason() {
    let out = Kvferry::new()
        .planner("kvferry.deepseek_mla_latent")
        .args(["check", "--model", "llama-3-70b", "--deployment", "tp4"])
        .output();
    assert!(!out.status.success());
    let (_, stderr) = text(&out);
    assert!(
        stderr.contains("architecture = LlamaForCausalLM (supports DeepseekV3ForCausalLM)"),
        "{stderr}"
    );
}

#[test]
fn check_binds_and_builds_every_rank() {
    let out = Kvferry::new()
        .args([
            "check",
            "--model",
            "deepseek-v3",
            "--deployment",
            "dep8",
            "--planner",
            "kvferry.deepseek_mla_latent",
        ])
        .output();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("kvferry.deepseek_mla_latent"), "{stdout}");
    assert!(stdout.contains("dep8 (8 ranks"), "{stdout}");
    assert!(stderr.contains("bound planner"), "{stderr}");
}

#[test]
fn kvferry_log_chooses_over_rust_log_and_a_bad_filter_is_named() {
    let check = |kvferry_log: Option<&str>| {
        let mut run = Kvferry::new().log("kvferry=info").args([
            "check",
            "--model",
            "llama-3-70b",
            "--deployment",
            "tp2",
        ]);
        if let Some(filter) = kvferry_log {
            run = run.env("KVFERRY_LOG", filter);
        }
        let out = run.output();
        let (_, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        // Into a pipe: no colour codes.
        assert!(!stderr.contains('\x1b'), "{stderr:?}");
        stderr
    };
    assert!(check(None).contains("bound planner"));
    // KVFERRY_LOG wins over RUST_LOG.
    assert!(!check(Some("warn")).contains("bound planner"));
    let stderr = check(Some("kvferry=loud"));
    assert!(
        stderr.contains(r#"KVFERRY_LOG="kvferry=loud" is not a log filter"#),
        "{stderr}"
    );
    // The CLI's default applies in its place.
    assert!(stderr.contains("bound planner"), "{stderr}");
}

#[test]
fn check_refuses_a_mapping_the_model_cannot_take_before_listing_planners() {
    let out = Kvferry::new()
        .quiet()
        .args(["check", "--model", "llama-3-70b", "--deployment", "tp3"])
        .output();
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    // No planner is listed as accepting a deployment the model cannot have.
    assert!(!stdout.contains("accepts"), "{stdout}");
    assert!(
        stderr.contains(
            "kvferry: --deployment tp3: llama-3-70b: kv heads (8) cannot be split over 3 ranks"
        ),
        "{stderr}"
    );
}

#[test]
fn a_cached_prefix_that_ends_inside_a_block_is_refused() {
    let common = [
        "--model",
        "llama-3-70b",
        "--prompt-len",
        "64",
        "--cached",
        "10",
    ];
    for command in [
        &["plan", "--ctx", "tp1", "--gen", "tp1"][..],
        &["demo", "--ctx", "tp1", "--gen", "tp1", "--requests", "1"][..],
    ] {
        let stderr = Kvferry::new()
            .quiet()
            .args(command)
            .args(common)
            .stderr_of_failure();
        assert!(
            stderr.contains(
                "--cached 10 must be a multiple of the receiver's block size 32 (it caches whole \
                 blocks)"
            ),
            "{command:?}: {stderr}"
        );
    }
}

#[test]
fn a_transport_list_ucx_does_not_have_is_named_once() {
    let stderr = Kvferry::new()
        .quiet()
        .args([
            "demo",
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp1",
            "--gen",
            "tp1",
            "--requests",
            "1",
            "--prompt-len",
            "64",
            "--transport",
            "bogus",
        ])
        .stderr_of_failure();
    let hint = "UCX has none of the transports `bogus`";
    assert_eq!(stderr.matches(hint).count(), 1, "{stderr}");
    assert!(
        stderr.contains("`ucx_info -d` lists what it has"),
        "{stderr}"
    );
}

#[test]
fn conform_prints_a_summary_by_model_unless_asked_for_every_case() {
    let run = |verbose: bool| {
        let mut k = Kvferry::new().quiet().args([
            "conform",
            "--planner",
            "kvferry.default",
            "--case",
            "llama-3-70b tp1->tp2",
        ]);
        if verbose {
            k = k.arg("--verbose");
        }
        k.stdout()
    };
    let summary = run(false);
    assert!(
        summary.contains("model                     passed  failed  refused"),
        "{summary}"
    );
    assert!(
        summary
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["llama-3-70b", "3", "0", "0"]),
        "{summary}"
    );
    assert!(
        !summary.lines().any(|l| l.starts_with("pass ")),
        "{summary}"
    );
    assert!(
        summary.contains("3 cases ran, 3 passed, 0 failed"),
        "{summary}"
    );
    let every = run(true);
    assert_eq!(
        every.lines().filter(|l| l.starts_with("pass ")).count(),
        3,
        "{every}"
    );
}

#[test]
fn check_reads_a_models_hugging_face_config() {
    for (file, deployment, bound) in [
        ("llama-3-70b.json", "tp4", "kvferry.default"),
        // The MLA planner binds the DeepSeek config, as it does the preset.
        ("deepseek-v3.json", "dep4", "kvferry.deepseek_mla_latent"),
        ("qwen3-next-80b-a3b.json", "tp4", "kvferry.default"),
    ] {
        let v = Kvferry::new()
            .args([
                "check",
                "--model",
                &hf_config(file),
                "--deployment",
                deployment,
                "--planner",
                "auto",
                "--json",
            ])
            .json();
        assert_eq!(v["bound"], bound, "{file}: {v}");
    }
}

#[test]
fn check_refuses_a_config_of_an_unknown_model_type_by_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "num_hidden_layers": 64}"#,
    )
    .unwrap();
    let stderr = Kvferry::new()
        .args([
            "check",
            "--model",
            &dir.path().display().to_string(),
            "--deployment",
            "tp4",
        ])
        .stderr_of_failure();
    assert!(
        stderr.contains("model_type `mamba2` is not one kvferry knows")
            && stderr.contains("qwen3_next"),
        "{stderr}"
    );
    // Neither a preset nor a file.
    let stderr = Kvferry::new()
        .args(["check", "--model", "llama-4", "--deployment", "tp4"])
        .stderr_of_failure();
    assert!(
        stderr.contains("`llama-4` is neither a model preset (deepseek-v3, llama-3-70b"),
        "{stderr}"
    );
}

#[test]
fn a_missing_plugin_directory_fails_naming_it() {
    let stderr = Kvferry::new()
        .plugin_dir(std::path::Path::new("/nonexistent/kvferry-plugins"))
        .args(["planners"])
        .stderr_of_failure();
    assert!(
        stderr.contains("plugin directory /nonexistent/kvferry-plugins does not exist"),
        "{stderr}"
    );
}

#[test]
fn zero_timeouts_and_no_requests_in_flight_are_refused() {
    for flag in ["--timeout-ms", "--in-flight"] {
        let stderr = Kvferry::new()
            .args([
                "demo",
                "--model",
                "llama-3-70b",
                "--ctx",
                "tp1",
                "--gen",
                "tp1",
                flag,
                "0",
            ])
            .stderr_of_failure();
        assert!(
            stderr.contains(&format!("invalid value '0' for '{flag}")) && stderr.contains("1.."),
            "{flag}: {stderr}"
        );
    }
}

#[test]
fn a_bad_deployment_spec_names_the_problem() {
    let out = Kvferry::new()
        .args(["check", "--model", "deepseek-v3", "--deployment", "tp4xx2"])
        .output();
    assert!(!out.status.success());
    let (_, stderr) = text(&out);
    assert!(stderr.contains("unknown axis \"xx\""), "{stderr}");
}

#[test]
fn deepseek_dep4_to_dep8_moves_and_verifies_every_byte() {
    let v = plan_json(
        "deepseek-v3",
        "dep4",
        "dep8",
        "8192",
        &["--dtype", "fp8", "--planner", "kvferry.deepseek_mla_latent"],
    );
    assert_eq!(v["planner"], "kvferry.deepseek_mla_latent");
    assert_eq!(v["total_bytes"], 287_834_112_u64);
    assert_eq!(v["verified"], true);
    let pairs = v["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 1);
    assert_eq!(pairs[0]["src_rank"], 0);
    assert_eq!(pairs[0]["dst_rank"], 0);
    assert_eq!(pairs[0]["bytes"], 287_834_112_u64);
    // One writer, 256 blocks of 61 × 576 × 32 fp8 bytes, no state: the whole request can be
    // bounced into one region (semantics §9.2).
    let receiver = &v["receivers"][0];
    assert_eq!(receiver["payload_bytes"], 0);
    assert_eq!(receiver["bounce_bytes"], 287_834_112_u64);
    assert_eq!(receiver["bounce_skip"], Value::Null);
}

/// The hybrid preset's receiver reports its recurrent-state payload and a bounce region of
/// blocks plus state: Qwen3-Next at tp2 holds half of 36 Gated-DeltaNet layers' conv
/// (49,152 B) and SSM (2,097,152 B) state, and 125 blocks of 12 attention layers × 1 KV head
/// × 256 × 32 tokens × 2 B × K and V.
#[test]
fn a_hybrid_receiver_reports_its_state_payload_and_bounce_region() {
    let v = plan_json("qwen3-next-80b-a3b", "tp2", "tp2", "4000", &[]);
    assert_eq!(v["verified"], true, "{v}");
    let state = 36 * (49_152 + 2_097_152) / 2;
    let blocks = 125 * 12 * 256 * 32 * 2 * 2;
    for r in v["receivers"].as_array().unwrap() {
        assert_eq!(r["payload_bytes"], state, "{r}");
        assert_eq!(r["bounce_bytes"], state + blocks, "{r}");
    }
}

#[test]
fn a_config_file_names_the_planner_and_the_flag_wins() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("kvferry.toml");
    std::fs::write(&config, "planner = \"kvferry.deepseek_mla_latent\"\n").unwrap();
    let args = ["check", "--model", "deepseek-v3", "--deployment", "dep2"];
    let out = Kvferry::new().config(&config).args(args).output();
    assert!(out.status.success(), "{:?}", text(&out));
    // The line that names the bound planner (after the candidates and the auto verdict,
    // before the cache it plans).
    let bound_line = |out: &Output| {
        let stdout = text(out).0;
        let line = stdout.lines().find(|l| l.contains(" plans "));
        line.unwrap_or_default().to_string()
    };
    assert!(
        bound_line(&out).starts_with("kvferry.deepseek_mla_latent "),
        "{:?}",
        text(&out)
    );
    let mut with_flag = args.to_vec();
    with_flag.extend(["--planner", "kvferry.default"]);
    let out = Kvferry::new().config(&config).args(&with_flag).output();
    assert!(
        bound_line(&out).starts_with("kvferry.default "),
        "{:?}",
        text(&out)
    );
    std::fs::write(&config, "planer = \"typo\"\n").unwrap();
    let out = Kvferry::new().config(&config).args(args).output();
    assert!(!out.status.success());
    assert!(
        text(&out).1.contains("unknown field `planer`"),
        "{:?}",
        text(&out)
    );
}

/// An agent's whole configuration given to `serve --config` is refused by its keys, not run
/// with its transport, name and secret silently ignored (a file saying `transport = "tcp"` ran
/// over shm under another name); `check` takes its planner from the same file.
#[test]
fn serve_refuses_an_agents_whole_configuration_naming_what_it_would_ignore() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        r#"version = 1
instance = "mine"
role = "context"
architecture = "llama"
transport = "tcp"
planner = "kvferry.default"
secret = "0123456789abcdef"

[rank]
mapping = "tp1"
instance_rank = 0
layers_per_pp = [1]

[rank.page_table]
tokens_per_block = 16
pools = [{ base = 4096, slot_bytes = 1024, num_slots = 4 }]

[[rank.page_table.groups]]
layers = [{ local = 0, global = 0 }]
views = [{ pool = 0, roles = ["key"], entries = [{ local_layer = 0, offset = 0, size = 1024 }], layout = { kind = "hnd", dtype = "bf16", elem_bits = 16 } }]
"#,
    )
    .unwrap();
    // Run with the keys ignored, serve would serve until stopped: bounded, it fails instead.
    let serve = Kvferry::new()
        .config(&config)
        .args([
            "serve",
            "--role",
            "prefill",
            "--model",
            "llama-3-70b",
            "--deployment",
            "tp1",
        ])
        .command();
    let out = output_unless_hung(serve, std::time::Duration::from_secs(30));
    let why = text(&out).1;
    assert!(!out.status.success(), "{why}");
    assert!(
        why.contains("serve takes only `planner` and `plugin_dir` from --config")
            && why.contains("`transport`")
            && why.contains("`instance`")
            && why.contains("`secret`"),
        "{why}"
    );
    let out = Kvferry::new()
        .config(&config)
        .args(["check", "--model", "llama-3-70b", "--deployment", "tp1"])
        .output();
    assert!(out.status.success(), "{:?}", text(&out));
}

/// Runs `kvferry plan --json` for Llama-3-70B and returns the parsed report.
fn llama_plan(ctx: &str, decode: &str, prompt: &str) -> Value {
    llama_plan_with(ctx, decode, prompt, &[])
}

fn llama_plan_with(ctx: &str, decode: &str, prompt: &str, extra: &[&str]) -> Value {
    plan_json("llama-3-70b", ctx, decode, prompt, extra)
}

/// Runs `kvferry plan --verify --json` (plus `extra`): every byte moved and checked by the
/// oracle; checks it succeeded and returns the report.
fn plan_json(model: &str, ctx: &str, decode: &str, prompt: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "plan",
        "--model",
        model,
        "--ctx",
        ctx,
        "--gen",
        decode,
        "--prompt-len",
        prompt,
        "--verify",
        "--json",
    ];
    args.extend_from_slice(extra);
    Kvferry::new().args(args).json()
}

/// Semantics §12.2 at 512 tokens (16 blocks of 32): ctx tp4 -> gen tp8, decode rank g is
/// written by prefill rank g / 2 alone, one 8,192-byte head of every K and V buffer: 160
/// fragments per block.
#[test]
fn llama_tp4_to_tp8_follows_the_head_split() {
    let v = llama_plan("tp4", "tp8", "512");
    assert_eq!(v["planner"], "kvferry.default");
    assert_eq!(v["verified"], true, "{v}");
    let pairs = v["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 8);
    for p in pairs {
        let g = p["dst_rank"].as_u64().unwrap();
        assert_eq!(p["src_rank"].as_u64().unwrap(), g / 2, "{p}");
        assert_eq!(p["fragments"], 16 * 160);
        assert_eq!(p["bytes"], 16 * 160 * 8192);
    }
    for r in v["receivers"].as_array().unwrap() {
        assert_eq!(r["expected_transfers"], 1);
    }
}

/// The reverse: decode rank g is written by prefill ranks 2g and 2g + 1, each placing
/// its head in every K and V buffer.
#[test]
fn llama_tp8_to_tp4_has_two_writers_per_receiver() {
    let v = llama_plan("tp8", "tp4", "512");
    assert_eq!(v["verified"], true, "{v}");
    let pairs = v["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 8);
    for p in pairs {
        let t = p["src_rank"].as_u64().unwrap();
        assert_eq!(p["dst_rank"].as_u64().unwrap(), t / 2, "{p}");
        assert_eq!(p["fragments"], 16 * 160);
        assert_eq!(p["bytes"], 16 * 160 * 8192);
    }
    for r in v["receivers"].as_array().unwrap() {
        assert_eq!(r["expected_transfers"], 2);
        // Uniform fan-in, but multi-writer bounce is off by default.
        assert_eq!(r["uniform"], true);
        assert_eq!(r["bounce_bytes"], Value::Null);
        let skip = r["bounce_skip"].as_str().unwrap();
        assert!(skip.contains("multi-writer bounce is off"), "{skip}");
    }
}

/// More TP ranks than KV heads: tp16 duplicates every head on two ranks; one of each pair
/// writes, the other sends an empty plan that still counts.
#[test]
fn llama_tp16_to_tp8_elects_one_writer_per_duplicated_head() {
    let v = llama_plan("tp16", "tp8", "100");
    assert_eq!(v["verified"], true, "{v}");
    let pairs = v["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 16);
    let empty = pairs.iter().filter(|p| p["bytes"] == 0).count();
    assert_eq!(empty, 8, "{v}");
    for r in v["receivers"].as_array().unwrap() {
        assert_eq!(r["expected_transfers"], 2);
    }
}

/// The bounce limits on the command line: two uniform writers share a region only with
/// `--bounce-fan-in`; 16 blocks pass a 16-block threshold; the region (16 blocks of 80 layers
/// × K and V × 2 heads × 32 tokens × 128 × 2 B = 41,943,040 bytes) does not fit a 32 MiB
/// arena and fits a 40 MiB one.
#[test]
fn plan_checks_bounce_regions_against_the_given_limits() {
    let region = 16 * 80 * 2 * 2 * 32 * 128 * 2;
    let skip = |v: &Value| {
        v["receivers"][0]["bounce_skip"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let v = llama_plan_with("tp8", "tp4", "512", &["--bounce-fan-in"]);
    assert!(
        skip(&v).contains("16 blocks is below the 96 block threshold"),
        "{v}"
    );
    let fan_in = ["--bounce-fan-in", "--bounce-min-blocks", "16"];
    let v = llama_plan_with("tp8", "tp4", "512", &fan_in);
    for r in v["receivers"].as_array().unwrap() {
        assert_eq!(r["bounce_bytes"], region, "{r}");
    }
    let v = llama_plan_with(
        "tp8",
        "tp4",
        "512",
        &[&fan_in[..], &["--bounce-arena-mb", "32"]].concat(),
    );
    assert!(skip(&v).contains("exceed the 33554432 byte arena"), "{v}");
    let v = llama_plan_with(
        "tp8",
        "tp4",
        "512",
        &[&fan_in[..], &["--bounce-arena-mb", "40"]].concat(),
    );
    assert_eq!(v["receivers"][0]["bounce_bytes"], region, "{v}");
}

fn check_json(model: &str, deployment: &str, planner_env: &str) -> (Output, Value) {
    let out = Kvferry::new()
        .planner(planner_env)
        .args([
            "check",
            "--model",
            model,
            "--deployment",
            deployment,
            "--json",
        ])
        .output();
    let v = serde_json::from_slice(&out.stdout).expect("check --json prints JSON");
    (out, v)
}

fn candidate<'a>(v: &'a Value, id: &str) -> &'a Value {
    v["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no candidate {id}: {v}"))
}

#[test]
fn auto_binds_the_mla_planner_for_deepseek_under_attention_dp() {
    let (out, v) = check_json("deepseek-v3", "dep8", "auto");
    assert!(out.status.success(), "{v}");
    assert_eq!(v["selected"], "auto");
    assert_eq!(v["bound"], "kvferry.deepseek_mla_latent");
    assert_eq!(v["auto"], "kvferry.deepseek_mla_latent");
    let mla = candidate(&v, "kvferry.deepseek_mla_latent");
    assert_eq!(mla["accepted"], true);
    assert_eq!(mla["specificity"], 200);
    let default = candidate(&v, "kvferry.default");
    assert_eq!(default["accepted"], true);
    assert_eq!(default["specificity"], 0);
}

#[test]
fn auto_binds_the_default_planner_for_llama_and_says_why_not_the_mla_one() {
    let (out, v) = check_json("llama-3-70b", "tp4", "auto");
    assert!(out.status.success(), "{v}");
    assert_eq!(v["bound"], "kvferry.default");
    let mla = candidate(&v, "kvferry.deepseek_mla_latent");
    assert_eq!(mla["accepted"], false);
    assert_eq!(mla["refusal"]["field"], "architecture");
    assert_eq!(mla["refusal"]["found"], "LlamaForCausalLM");
    assert_eq!(mla["refusal"]["supported"], "DeepseekV3ForCausalLM");

    // The same, as text: every candidate with its verdict, and what auto binds.
    let out = Kvferry::new()
        .args([
            "check",
            "--model",
            "llama-3-70b",
            "--deployment",
            "tp4",
            "--planner",
            "auto",
        ])
        .output();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("auto binds kvferry.default"), "{stdout}");
    let mla_line = stdout
        .lines()
        .find(|l| l.contains("kvferry.deepseek_mla_latent"))
        .unwrap_or_else(|| panic!("no MLA line: {stdout}"));
    assert!(
        mla_line.contains("refuses: architecture = LlamaForCausalLM"),
        "{mla_line}"
    );
}

#[test]
fn a_named_planner_that_refuses_still_lists_the_candidates_in_json() {
    let (out, v) = check_json("llama-3-70b", "tp4", "kvferry.deepseek_mla_latent");
    assert!(!out.status.success());
    assert_eq!(v["bound"], Value::Null);
    assert_eq!(v["auto"], "kvferry.default");
    let error = v["error"].as_str().unwrap();
    assert!(
        error.contains("does not support LlamaForCausalLM tp4"),
        "{error}"
    );
}

#[test]
fn sides_that_auto_select_different_planners_are_refused_naming_both() {
    // dep4 binds the MLA planner, tp4 (no attention DP) only the default one.
    let out = Kvferry::new()
        .args([
            "plan",
            "--model",
            "deepseek-v3",
            "--ctx",
            "dep4",
            "--gen",
            "tp4",
            "--prompt-len",
            "64",
            "--planner",
            "auto",
        ])
        .output();
    assert!(!out.status.success());
    let (_, stderr) = text(&out);
    assert!(
        stderr.contains(
            "binds kvferry.deepseek_mla_latent and the decode instance binds kvferry.default"
        ),
        "{stderr}"
    );
}

/// `plan --ctx-tokens-per-block` / `--gen-tokens-per-block`: the sides re-block (HND, one
/// size a multiple of the other) and the oracle checks every byte; sizes that do not divide
/// are refused naming both.
#[test]
fn plan_takes_a_block_size_per_side() {
    let v = llama_plan_with(
        "tp2",
        "tp4",
        "300",
        &[
            "--ctx-tokens-per-block",
            "16",
            "--gen-tokens-per-block",
            "64",
        ],
    );
    assert_eq!(v["tokens_per_block"], 16, "{v}");
    assert_eq!(v["gen_tokens_per_block"], 64, "{v}");
    assert_eq!(v["verified"], true, "{v}");
    let out = Kvferry::new()
        .args([
            "plan",
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp2",
            "--gen",
            "tp4",
        ])
        .args(["--prompt-len", "300", "--gen-tokens-per-block", "48"])
        .output();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("48 is not a multiple of 32"), "{stderr}");
}

/// Address space a run that refuses a size may take: far more than the binary needs to start,
/// load the planners and lay out a few ranks, far less than any of the refused sizes. An
/// allocation the refusal failed to prevent aborts (exit 134) instead of taking the machine.
const REFUSAL_ADDRESS_SPACE: libc::rlim_t = 1 << 30;

/// Limits this process's address space to [`REFUSAL_ADDRESS_SPACE`]; what a child runs
/// between fork and exec, so it only makes async-signal-safe calls and allocates nothing.
fn limit_address_space() -> std::io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: REFUSAL_ADDRESS_SPACE,
        rlim_max: REFUSAL_ADDRESS_SPACE,
    };
    // SAFETY: `limit` is a valid rlimit that outlives the call, which only reads it.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `kvferry ARGS` under [`REFUSAL_ADDRESS_SPACE`] (`RLIMIT_AS`): asserts that it exits 1
/// with every one of `says` in its error, and returns the error.
fn refused_within_a_gib(args: &[&str], says: &[&str]) -> String {
    use std::os::unix::process::CommandExt;
    let mut cmd = Kvferry::new().quiet().args(args).command();
    // SAFETY: pre_exec runs `limit_address_space` in the forked child before exec, where only
    // async-signal-safe calls are allowed: it calls setrlimit (async-signal-safe) and reads
    // errno, touching no lock or heap memory of the parent's.
    unsafe {
        cmd.pre_exec(limit_address_space);
    }
    let out = cmd.output().expect("run kvferry");
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "kvferry {args:?} ({}):\n{stdout}\n{stderr}",
        out.status
    );
    for s in says {
        assert!(stderr.contains(s), "{s:?} not in:\n{stderr}");
    }
    stderr
}

#[test]
fn plan_refuses_a_prompt_whose_pools_exceed_the_host_with_the_numbers() {
    // 100M tokens of Llama-3-70B at tp1: 34.8 TB of receiver pools, past any host's memory
    // but under what one rank may hold, so the host budget is what refuses it (a million
    // tokens, 348 GB, would fit a large host).
    let stderr = refused_within_a_gib(
        &[
            "plan",
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp1",
            "--gen",
            "tp1",
            "--prompt-len",
            "100000000",
            "--verify",
        ],
        &[
            "kvferry: --prompt-len 100000000 with --tokens-per-block 32 cannot fit: backing the \
             pools of 1 receiving decode rank needs 34816015728640 bytes (31.7 TiB); ",
            " available (",
            "; drop --verify to plan it from the page tables alone, with no pools",
        ],
    );
    println!("seen: {}", stderr.trim());
    // The budget beside it in the same binary units: no decimal GB anywhere.
    assert_sizes_in_binary_units(&stderr);
}

/// Every size in `text` is written in binary units (`KiB`, `MiB`, `GiB`, `TiB`), none in
/// decimal ones (`kB`, `MB`, `GB`, `TB`); throughput (`GB/s`) is not a size.
fn assert_sizes_in_binary_units(text: &str) {
    let words: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')' || c == ';' || c == ',')
        .collect();
    for unit in ["kB", "KB", "MB", "GB", "TB"] {
        assert!(!words.contains(&unit), "a size in {unit}: {text}");
    }
}

#[test]
fn plan_refuses_a_block_size_whose_pools_no_rank_can_hold() {
    let stderr = refused_within_a_gib(
        &[
            "plan",
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp1",
            "--gen",
            "tp1",
            "--prompt-len",
            "1000",
            "--tokens-per-block",
            "4000000000",
        ],
        &[
            "kvferry: --prompt-len 1000 with --tokens-per-block 4000000000 cannot fit: prefill rank \
             0 (tp1): its pools would take 3932160000000000 bytes (3.49 PiB)",
            "one rank may hold at most 64 TiB (70368744177664 bytes)",
        ],
    );
    println!("seen: {}", stderr.trim());
}

#[test]
fn check_refuses_a_deployment_wider_than_the_largest_instance() {
    let stderr = refused_within_a_gib(
        &[
            "check",
            "--model",
            "llama-3-70b",
            "--deployment",
            "tp4000000000",
        ],
        &[
            "kvferry: --deployment tp4000000000: deployment tp4000000000 has 4000000000 ranks \
             (tp 4000000000 × pp 1 × cp 1): the largest instance supported has 65536",
        ],
    );
    println!("seen: {}", stderr.trim());
    // The rank count overflowing the ABI's u32 is refused the same way.
    refused_within_a_gib(
        &[
            "check",
            "--model",
            "llama-3-70b",
            "--deployment",
            "tp65536pp65536",
        ],
        &["has 4294967296 ranks (tp 65536 × pp 65536 × cp 1)"],
    );
}

#[test]
fn every_command_refuses_a_deployment_wider_than_the_largest_instance() {
    let pair = [
        "--model",
        "llama-3-70b",
        "--ctx",
        "tp1",
        "--gen",
        "dep100000",
    ];
    for command in ["plan", "demo", "bench"] {
        let mut args = vec![command, "--prompt-len", "64"];
        args.extend_from_slice(&pair);
        let stderr = refused_within_a_gib(
            &args,
            &["kvferry: --gen dep100000: deployment dep100000 has 100000 ranks"],
        );
        // Refused by the controller itself: no server child was started.
        assert!(!stderr.contains("server:"), "{command}: {stderr}");
    }
    refused_within_a_gib(
        &[
            "serve",
            "--role",
            "generation",
            "--model",
            "llama-3-70b",
            "--deployment",
            "tp4000000000",
        ],
        &["--deployment tp4000000000: deployment tp4000000000 has 4000000000 ranks"],
    );
}

#[test]
fn demo_and_bench_refuse_pools_the_two_servers_cannot_hold_before_starting_them() {
    // 10M tokens: about 26 TB (demo, 8 in flight) and 52 TB (bench, two sets of 8) of pools
    // per server, each under what one rank may hold, both past any host's memory.
    for (command, sized_by) in [
        ("demo", "--prompt-len 10000000 with --in-flight 8"),
        ("bench", "--prompt-len 10000000 with --requests 8"),
    ] {
        let stderr = refused_within_a_gib(
            &[
                command,
                "--model",
                "llama-3-70b",
                "--ctx",
                "tp1",
                "--gen",
                "tp1",
                "--prompt-len",
                "10000000",
            ],
            &[
                &format!("kvferry: {sized_by} and --tokens-per-block 32: "),
                "the two servers' host pools would not fit: ",
                " available (",
            ],
        );
        assert!(!stderr.contains("server:"), "{command}: {stderr}");
    }
}

/// `bench --sweep` brings its own model and moves one request at a time; its grid options
/// belong to it; a grid size that is not whole tokens of its model is named; and `demo`,
/// whose model is no longer a clap-required option, still asks for one.
#[test]
fn bench_sweep_arguments_are_checked_before_anything_starts() {
    let pair = ["--ctx", "tp1", "--gen", "tp1"];
    for (args, wanted) in [
        (
            &["bench", "--sweep", "--model", "llama-3-70b"][..],
            "--sweep brings its own one-layer model; leave out --model",
        ),
        (
            &["bench", "--sweep", "--prompt-len", "64"][..],
            "cannot be used with",
        ),
        (
            &["bench", "--sweep", "--requests", "2"][..],
            "cannot be used with",
        ),
        (
            &[
                "bench",
                "--model",
                "llama-3-70b",
                "--prompt-len",
                "64",
                "--batches",
                "4",
            ][..],
            "--fragment-sizes, --batches and --max-request-bytes shape the grid of --sweep",
        ),
        (
            &["bench", "--sweep", "--fragment-sizes", "1000"][..],
            "fragment size 1000: the grid's blocks are whole tokens of 512 bytes",
        ),
        (
            &["bench", "--sweep", "--fragment-sizes", "4x"][..],
            "`4x` is not a byte count",
        ),
        (
            &["bench", "--sweep", "--max-request-bytes", "2k"][..],
            "every cell is over the limit of 2048 bytes per request (the smallest moves 4096 x 1)",
        ),
        (
            &["bench", "--model", "llama-3-70b"][..],
            "--prompt-len is required (except with --sweep)",
        ),
        (
            &["demo", "--requests", "1"][..],
            "--model is required (a preset or a config.json)",
        ),
    ] {
        let stderr = Kvferry::new()
            .quiet()
            .args(args)
            .args(pair)
            .stderr_of_failure();
        assert!(stderr.contains(wanted), "{args:?}: {stderr}");
    }
}

/// The longest a `kvferry plan` of these tests may run before it counts as hung: far past what
/// any of them takes, on the slowest CI machine.
const PLAN_HANG_LIMIT: std::time::Duration = std::time::Duration::from_secs(600);

/// Runs `run` to its end, or kills it and fails the test once it has run past `limit`; both
/// streams are read as it runs.
fn output_unless_hung(mut run: std::process::Command, limit: std::time::Duration) -> Output {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = run
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kvferry");
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for kvferry") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvferry ran past {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

/// `kvferry plan ARGS`, which must succeed (unless hung), its standard output.
fn plan_stdout(args: &[&str]) -> String {
    let out = output_unless_hung(
        Kvferry::new().quiet().arg("plan").args(args).command(),
        PLAN_HANG_LIMIT,
    );
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "kvferry plan {args:?} ({}):\n{stdout}\n{stderr}",
        out.status
    );
    stdout
}

/// `kvferry plan ARGS --json`, which must succeed, parsed.
fn plan_report(args: &[&str]) -> Value {
    let stdout = plan_stdout(&[args, &["--json"]].concat());
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("no JSON ({e}):\n{stdout}"))
}

/// Each pair's traffic as `--verify` reports it: (sender, receiver, fragments, planned
/// fragments, bytes, bounced pieces).
fn pair_counts(v: &Value) -> Vec<[u64; 6]> {
    v["pairs"]
        .as_array()
        .unwrap_or_else(|| panic!("no pairs: {v}"))
        .iter()
        .map(|p| {
            [
                "src_rank",
                "dst_rank",
                "fragments",
                "planned_fragments",
                "bytes",
                "bounced_pieces",
            ]
            .map(|k| p[k].as_u64().unwrap_or_else(|| panic!("{k} in {p}")))
        })
        .collect()
}

const DRY_RUN: &str =
    "dry run: plans validated, bytes not moved; --verify to move and check every byte";

/// Issue 46 (3): 131,072 tokens of Llama-3-70B, tp4 -> tp8, whose receivers' pools alone
/// (42.9 GB) are past what the oracle may back on most hosts, plan from the page tables
/// alone, inside a GiB of address space; each pair moves 256 times what `--verify` moves and
/// checks at 512 tokens (4,096 blocks against 16: bytes and planned fragments scale with
/// blocks), 5 GiB per pair, one 8,192-byte head of every K and V buffer of every block.
#[test]
fn plan_dry_runs_128k_llama_tokens_from_the_page_tables_in_a_gib() {
    let big = [
        "plan",
        "--model",
        "llama-3-70b",
        "--ctx",
        "tp4",
        "--gen",
        "tp8",
        "--prompt-len",
        "131072",
        "--json",
    ];
    use std::os::unix::process::CommandExt;
    let mut cmd = Kvferry::new().quiet().args(big).command();
    // SAFETY: as in `refused_within_a_gib`: setrlimit only, in the forked child.
    unsafe {
        cmd.pre_exec(limit_address_space);
    }
    let out = output_unless_hung(cmd, PLAN_HANG_LIMIT);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{big:?}:\n{stdout}\n{stderr}");
    let v: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["dry_run"], true, "{v}");
    assert_eq!(v["verified"], false, "{v}");
    assert_eq!(v["verify"], DRY_RUN, "{v}");
    assert_eq!(v["overlapping_writes"], 0, "{v}");

    let small = plan_report(&[
        "--model",
        "llama-3-70b",
        "--ctx",
        "tp4",
        "--gen",
        "tp8",
        "--prompt-len",
        "512",
        "--verify",
    ]);
    assert_eq!(small["verified"], true, "{small}");
    let (big_pairs, small_pairs) = (pair_counts(&v), pair_counts(&small));
    assert_eq!(big_pairs.len(), 8, "{v}");
    assert_eq!(big_pairs.len(), small_pairs.len());
    for (b, s) in big_pairs.iter().zip(&small_pairs) {
        assert_eq!((b[0], b[1]), (s[0], s[1]), "same pairs");
        assert_eq!(
            b[0],
            b[1] / 2,
            "decode rank g is written by prefill rank g / 2"
        );
        assert_eq!(b[4], 256 * s[4], "bytes scale with blocks: {b:?} vs {s:?}");
        assert_eq!(b[3], 256 * s[3], "planned fragments scale: {b:?} vs {s:?}");
        assert_eq!(b[4], 4096 * 160 * 8192);
    }
    let total: u64 = big_pairs.iter().map(|p| p[4]).sum();
    assert_eq!(v["total_bytes"], total, "{v}");
    for p in v["pairs"].as_array().unwrap() {
        // The default planner answers with compressed plans; the mean fragment is one head.
        assert!(p["patterns"].as_u64().is_some_and(|n| n > 0), "{p}");
        let fragments = p["fragments"].as_u64().unwrap();
        let mean = p["mean_fragment_bytes"].as_u64().unwrap();
        assert_eq!(mean, p["bytes"].as_u64().unwrap() / fragments, "{p}");
    }
}

/// Without `--verify` the counts are the ones `--verify` moves and checks, field by field,
/// across the planners' shapes: one writer and two, re-blocking, duplicated heads, chunks
/// over a cached prefix with recurrent state, bounced pieces, MLA under attention DP.
#[test]
fn plan_dry_run_counts_what_verify_moves() {
    for args in [
        &[
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp8",
            "--gen",
            "tp4",
            "--prompt-len",
            "1000",
        ][..],
        &[
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp16",
            "--gen",
            "tp8",
            "--prompt-len",
            "100",
        ],
        &[
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp2",
            "--gen",
            "tp4",
            "--prompt-len",
            "300",
            "--ctx-tokens-per-block",
            "16",
            "--gen-tokens-per-block",
            "64",
        ],
        &[
            "--model",
            "qwen3-next-80b-a3b",
            "--ctx",
            "tp2",
            "--gen",
            "tp4",
            "--prompt-len",
            "4000",
            "--chunk",
            "1024",
            "--cached",
            "512",
        ],
        &[
            "--model",
            "gpt-oss-120b",
            "--ctx",
            "tp2",
            "--gen",
            "tp1",
            "--prompt-len",
            "5000",
            "--chunk",
            "640",
            "--bounce",
            "on",
        ],
        &[
            "--model",
            "deepseek-v3",
            "--ctx",
            "dep2",
            "--gen",
            "dep4",
            "--prompt-len",
            "3000",
            "--gen-dp-rank",
            "3",
            "--planner",
            "kvferry.deepseek_mla_latent",
        ],
    ] {
        let dry = plan_report(args);
        let verified = plan_report(&[args, &["--verify"]].concat());
        assert_eq!(verified["verified"], true, "{args:?}: {verified}");
        assert_eq!(verified["dry_run"], false, "{args:?}: {verified}");
        assert_eq!(dry["dry_run"], true, "{args:?}: {dry}");
        assert_eq!(dry["verify"], DRY_RUN, "{args:?}: {dry}");
        assert_eq!(pair_counts(&dry), pair_counts(&verified), "{args:?}");
        assert_eq!(dry["receivers"], verified["receivers"], "{args:?}");
        for total in ["total_fragments", "total_planned_fragments", "total_bytes"] {
            assert_eq!(dry[total], verified[total], "{args:?}: {total}");
        }
    }
}

/// In text: the dry run says that no byte moved and never claims a verdict; `--verify` still
/// moves every byte and checks each one.
#[test]
fn plan_says_whether_the_bytes_were_moved_and_checked() {
    let args = [
        "--model",
        "llama-3-70b",
        "--ctx",
        "tp4",
        "--gen",
        "tp8",
        "--prompt-len",
        "512",
    ];
    let dry = plan_stdout(&args);
    assert!(dry.trim_end().ends_with(DRY_RUN), "{dry}");
    assert!(!dry.contains("verified"), "{dry}");
    assert!(
        dry.contains(
            "ctx 0 -> gen 1: 1 pieces, 2560 fragments (2560 planned, 1 patterns), 20971520 \
             bytes (20 MiB), mean fragment 8192 bytes (8 KiB)"
        ),
        "{dry}"
    );
    let verified = plan_stdout(&[&args[..], &["--verify"]].concat());
    assert!(
        verified.contains(
            "verify: 199229440 destination bytes checked (160 MiB covered), 199229440 source \
             bytes checked: all match"
        ),
        "{verified}"
    );
    assert!(
        verified.trim_end().ends_with("verified: true"),
        "{verified}"
    );
    assert!(!verified.contains("bytes not moved"), "{verified}");
}

/// A dry run sizes what it will hold (slot tables, the rows the planner reads) and refuses,
/// inside a GiB, a request past the host's memory: a billion one-token blocks on 1,024 ranks
/// a side, 16.5 TB of tables.
#[test]
fn plan_dry_run_refuses_a_request_whose_tables_exceed_the_host() {
    let stderr = refused_within_a_gib(
        &[
            "plan",
            "--model",
            "llama-3-70b",
            "--ctx",
            "tp1024",
            "--gen",
            "tp1024",
            "--prompt-len",
            "1000000000",
            "--tokens-per-block",
            "1",
        ],
        &[
            "kvferry: --prompt-len 1000000000 with --tokens-per-block 1 cannot be planned here: \
             its slot tables and the rows the planner reads would take about ",
            " available (",
        ],
    );
    assert!(!stderr.contains("backing the pools"), "{stderr}");
    assert_sizes_in_binary_units(&stderr);
}

/// How many lines of `stderr` log a bound planner.
fn bound_logs(stderr: &str) -> usize {
    stderr
        .lines()
        .filter(|l| l.contains("bound planner"))
        .count()
}

/// `check` binds (and logs) the planner once, whether it was named or `auto`; what `auto`
/// would bind beside a named planner is a hint, not a second binding.
#[test]
fn check_logs_the_bound_planner_once() {
    for (planner, auto_line) in [
        (
            "kvferry.deepseek_mla_latent",
            "auto would bind kvferry.deepseek_mla_latent",
        ),
        ("auto", "auto binds kvferry.deepseek_mla_latent"),
    ] {
        let out = Kvferry::new()
            .log("kvferry=info")
            .args(["check", "--model", "deepseek-v3", "--deployment", "dep8"])
            .args(["--planner", planner])
            .output();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        assert_eq!(bound_logs(&stderr), 1, "--planner {planner}:\n{stderr}");
        assert!(stdout.contains(auto_line), "--planner {planner}:\n{stdout}");
    }
}

/// A named planner that is not on the plugin path is named as not found, with the planners
/// that were found; nothing says what `auto` binds, which was not asked.
#[test]
fn check_says_a_named_planner_is_not_found_naming_the_planners_found() {
    let out = Kvferry::new()
        .log("kvferry=info")
        .args(["check", "--model", "llama-3-70b", "--deployment", "tp4"])
        .args(["--planner", "kvferry.nope"])
        .output();
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(!stdout.contains("auto "), "{stdout}");
    let error = stderr
        .lines()
        .find(|l| l.starts_with("kvferry: "))
        .unwrap_or_else(|| panic!("no error line: {stderr}"));
    assert!(
        error.starts_with("kvferry: planner `kvferry.nope` not found: the planners found are "),
        "{error}"
    );
    for id in ["kvferry.default", "kvferry.deepseek_mla_latent"] {
        assert!(error.contains(id), "{error}");
    }
    assert_eq!(bound_logs(&stderr), 0, "{stderr}");
}

/// A block size of 0 is refused by the flag that gave it, before anything else reads it.
#[test]
fn a_block_size_of_zero_is_refused_naming_its_flag() {
    let check = ["check", "--model", "llama-3-70b", "--deployment", "tp4"];
    let plan = [
        "plan",
        "--model",
        "llama-3-70b",
        "--ctx",
        "tp4",
        "--gen",
        "tp4",
        "--prompt-len",
        "100",
    ];
    for (command, flag) in [
        (&check[..], "--tokens-per-block"),
        (&plan[..], "--tokens-per-block"),
        (&plan[..], "--ctx-tokens-per-block"),
        (&plan[..], "--gen-tokens-per-block"),
    ] {
        let stderr = Kvferry::new()
            .quiet()
            .args(command)
            .args([flag, "0"])
            .stderr_of_failure();
        assert!(
            stderr.contains(&format!("invalid value '0' for '{flag} <N>'")),
            "{flag}: {stderr}"
        );
        assert!(!stderr.contains("--deployment"), "{flag}: {stderr}");
    }
}

/// `conform`'s most frequent refusals are shown as the planner wrote them: architecture
/// names and sizes keep their digits.
#[test]
fn conform_shows_the_most_frequent_refusals_in_the_planners_words() {
    let summary = |planner: &str, case: &str| {
        Kvferry::new()
            .quiet()
            .args(["conform", "--planner", planner, "--case", case])
            .output()
    };
    // The MLA planner refuses Llama by architecture (no case runs, so the run fails).
    let out = summary("kvferry.deepseek_mla_latent", "llama-3-70b tp1->tp1");
    let (stdout, _) = text(&out);
    assert!(
        stdout.contains("(supports DeepseekV3ForCausalLM)"),
        "{stdout}"
    );
    assert!(!stdout.contains("DeepseekVN"), "{stdout}");
    // Block sizes that do not divide: the numbers of the refusal, not `N`.
    let out = summary("kvferry.default", "refused llama-3-70b tp1->tp1 tpb 16->24");
    let (stdout, _) = text(&out);
    assert!(
        stdout.contains("x decode rank 0: check_peer of prefill rank 0 failed"),
        "{stdout}"
    );
    assert!(stdout.contains("(24 is not a multiple of 16)"), "{stdout}");
    assert!(!stdout.contains("N is not a multiple of N"), "{stdout}");
}

/// The path of this process's C library, an ELF shared object that is no planner.
fn libc_path() -> std::path::PathBuf {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            std::path::Path::new(p)
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libc.so") || n.starts_with("libc-"))
        })
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| panic!("no libc mapped:\n{maps}"))
}

/// `planners --all` names the root module a library lacks by its readable name, as text and
/// as JSON, not by the mangled symbol of the ELF file.
#[test]
fn planners_all_names_a_missing_root_module_readably() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(libc_path(), dir.path().join("libnotaplanner.so")).unwrap();
    let out = Kvferry::new()
        .plugin_dir(dir.path())
        .args(["planners", "--all"])
        .output();
    let (stdout, _) = text(&out);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("skipped ") && l.contains("libnotaplanner.so"))
        .unwrap_or_else(|| panic!("no skipped line: {stdout}"));
    assert!(
        line.ends_with(
            "libnotaplanner.so: not a planner: it exports no abi_stable root module (symbol \
             `_as.lib_header.root module loader`)"
        ),
        "{line}"
    );
    let out = Kvferry::new()
        .plugin_dir(dir.path())
        .args(["planners", "--all", "--json"])
        .output();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let message = v["skipped"][0]["message"].as_str().unwrap();
    assert!(
        message.ends_with(
            "libnotaplanner.so: not a planner: it exports no abi_stable root module (symbol \
             `_as.lib_header.root module loader`)"
        ),
        "{message}"
    );
    assert!(!message.contains("_1as_0"), "{message}");
}

/// `doctor`'s summary agrees with its rows: a row that says `error:` comes with a problem,
/// and on a host without a GPU the CUDA rows are notes, not errors.
#[test]
fn doctor_reports_no_error_beside_no_problems() {
    let out = Kvferry::new().quiet().arg("doctor").output();
    let (stdout, stderr) = text(&out);
    let errors: Vec<&str> = stdout.lines().filter(|l| l.contains(": error: ")).collect();
    let problems = stdout
        .lines()
        .filter(|l| l.starts_with("problem  "))
        .count();
    assert!(
        errors.is_empty() || problems > 0,
        "errors beside no problem:\n{stdout}{stderr}"
    );
    assert_eq!(stdout.contains("problems none"), problems == 0, "{stdout}");
    let gpus = std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    if gpus == 0 {
        let cuda_rows: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with("shm cuda ") || l.starts_with("tcp cuda "))
            .collect();
        assert_eq!(cuda_rows.len(), 2, "{stdout}");
        for row in cuda_rows {
            assert!(
                row.contains(": note: no GPU on this host: ") || row.contains("registers: "),
                "{row}"
            );
        }
    }
}

/// Logs print an optional field's value, never a Rust `Some(...)`.
#[test]
fn logs_print_an_optional_value_not_a_rust_option() {
    let out = Kvferry::new()
        .log("kvferry=info")
        .args([
            "serve",
            "--role",
            "prefill",
            "--model",
            "llama-3-70b",
            "--deployment",
            "tp1",
            "--slots",
            "4",
            "--exit-with-stdin",
        ])
        .output();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let started = stderr
        .lines()
        .find(|l| l.contains("agent started"))
        .unwrap_or_else(|| panic!("no `agent started`: {stderr}"));
    assert!(started.contains(" endpoint=127.0.0.1:"), "{started}");
    assert!(!stderr.contains("Some("), "{stderr}");
}
