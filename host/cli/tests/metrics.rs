//! `kvferry serve --metrics-listen`: Prometheus scrapes the servers while `kvferry demo` drives
//! them, and the numbers they serve are the demo's own; the listener's probes (`/healthz`,
//! `/readyz`) and what names the series (`kvferry_instance`, `kvferry_build_info`).

use crate::support;

use kvferry_harness::metrics_http::get;
use support::transfer::{Server, demo};

/// The sum of `name`'s samples whose labels include every one of `labels` (`key="value"`).
fn total(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            (metric == name && labels.iter().all(|want| rest.contains(want)))
                .then(|| value.parse::<f64>().expect("a sample value"))
        })
        .sum()
}

#[test]
fn metrics_during_a_demo_count_what_the_demo_reports() {
    let extra = ["--metrics-listen", "127.0.0.1:0"];
    let ctx = Server::start("context", "llama-3-70b", "tp1", "tcp", &extra);
    let decode = Server::start("generation", "llama-3-70b", "tp2", "tcp", &extra);
    let scrape = |s: &Server| {
        let addr = s
            .metrics
            .as_deref()
            .expect("serve printed its metrics address");
        let (status, body) = get(addr, "/metrics").expect("scrape");
        assert_eq!(status, 200, "{body}");
        body
    };
    // Before any request: every series is there, at zero.
    let before = scrape(&decode);
    assert_eq!(total(&before, "kvferry_requests_total", &[]), 0.0);
    assert_eq!(total(&before, "kvferry_peers", &[]), 0.0);

    let report = demo(&[
        "--model",
        "llama-3-70b",
        "--ctx",
        "tp1",
        "--gen",
        "tp2",
        "--ctx-at",
        &ctx.control,
        "--gen-at",
        &decode.control,
        "--requests",
        "6",
        "--prompt-len",
        "300",
    ]);
    assert_eq!(report["verified"], true, "{report}");
    let (ctx_text, gen_text) = (scrape(&ctx), scrape(&decode));
    let requests = report["requests"].as_u64().unwrap() as f64;
    let bytes = report["bytes"].as_u64().unwrap() as f64;

    // The one prefill rank sent each request once; each of the two decode ranks
    // received its half of each.
    let sent = total(&ctx_text, "kvferry_requests_total", &[r#"outcome="sent""#]);
    let received = total(
        &gen_text,
        "kvferry_requests_total",
        &[r#"outcome="received""#],
    );
    assert_eq!(sent, requests, "{ctx_text}");
    assert_eq!(received, 2.0 * requests, "{gen_text}");
    for text in [&ctx_text, &gen_text] {
        assert_eq!(
            total(text, "kvferry_requests_total", &[r#"outcome="failed""#]),
            report["failed"].as_u64().unwrap() as f64
        );
        assert_eq!(total(text, "kvferry_request_failures_total", &[]), 0.0);
        assert_eq!(total(text, "kvferry_requests_in_flight", &[]), 0.0);
        // What one side wrote is what the other received: the demo's byte count.
        assert_eq!(
            total(text, "kvferry_transfer_bytes_total", &[]),
            bytes,
            "{text}"
        );
    }
    assert_eq!(
        total(&gen_text, "kvferry_fragments_total", &[]),
        report["fragments"].as_u64().unwrap() as f64
    );
    // Every request that ended well is in the latency histograms, once per rank.
    assert_eq!(
        total(&ctx_text, "kvferry_transfer_duration_seconds_count", &[]),
        sent
    );
    assert_eq!(
        total(&gen_text, "kvferry_transfer_duration_seconds_count", &[]),
        received
    );
    assert_eq!(
        total(
            &gen_text,
            "kvferry_transfer_duration_seconds_bucket",
            &[r#"le="+Inf""#]
        ),
        received
    );
    assert!(total(&gen_text, "kvferry_transfer_duration_seconds_sum", &[]) > 0.0);
    // Each series per rank, labelled.
    assert!(gen_text.contains(r#"rank="1",role="decode""#), "{gen_text}");
    // The decode ranks are linked to the prefill rank.
    assert_eq!(total(&gen_text, "kvferry_peers", &[]), 2.0, "{gen_text}");

    let addr = decode.metrics.as_deref().unwrap();
    assert_eq!(get(addr, "/").unwrap().0, 404);
    assert_eq!(get(addr, "/metrics?x=1").unwrap().0, 200);
}

/// The label names of one sample line (`name{a="x",b="y"} v`), quoted values skipped.
fn label_names(line: &str) -> Vec<String> {
    let Some((_, rest)) = line.split_once('{') else {
        return Vec::new();
    };
    let mut names = Vec::new();
    let mut name = String::new();
    let (mut quoted, mut escaped) = (false, false);
    for c in rest.chars() {
        if quoted {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => quoted = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => quoted = true,
            '=' => names.push(std::mem::take(&mut name)),
            ',' => name.clear(),
            '}' => break,
            c => name.push(c),
        }
    }
    names
}

#[test]
fn a_running_server_answers_its_probes_and_names_itself_for_prometheus() {
    let extra = ["--metrics-listen", "127.0.0.1:0", "--name", "probed-ctx"];
    let ctx = Server::start("context", "llama-3-70b", "tp2", "tcp", &extra);
    let addr = ctx
        .metrics
        .as_deref()
        .expect("serve printed its metrics address");
    // Alive, and its agents (started before serve printed its addresses) take requests.
    assert_eq!(get(addr, "/healthz").unwrap(), (200, "ok\n".to_string()));
    assert_eq!(get(addr, "/readyz").unwrap(), (200, "ready\n".to_string()));
    assert_eq!(get(addr, "/nope").unwrap().0, 404);

    let (status, text) = get(addr, "/metrics").unwrap();
    assert_eq!(status, 200, "{text}");
    // Prometheus sets `instance` to the scraped target: ours is `kvferry_instance`.
    let samples: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .collect();
    assert!(!samples.is_empty(), "{text}");
    for line in &samples {
        let names = label_names(line);
        assert!(!names.iter().any(|n| n == "instance"), "`{line}`");
        if !line.starts_with("kvferry_build_info") {
            assert_eq!(names[..3], ["kvferry_instance", "rank", "role"], "`{line}`");
        }
    }
    for rank in 0..2 {
        let line = format!(
            r#"kvferry_peers{{kvferry_instance="probed-ctx",rank="{rank}",role="prefill"}} 0"#
        );
        assert!(samples.contains(&line.as_str()), "no `{line}` in\n{text}");
    }
    // Which kvferry, UCX and planner: one line for the two ranks of one planner.
    assert_eq!(
        text.matches("# TYPE kvferry_build_info gauge").count(),
        1,
        "{text}"
    );
    let build: Vec<&&str> = samples
        .iter()
        .filter(|l| l.starts_with("kvferry_build_info{"))
        .collect();
    assert_eq!(build.len(), 1, "{text}");
    let version = format!(r#"version="{}""#, env!("CARGO_PKG_VERSION"));
    assert!(build[0].contains(&version), "{text}");
    for label in ["ucx", "planner"] {
        let set = format!(r#"{label}=""#);
        assert!(build[0].contains(&set), "{text}");
        assert!(!build[0].contains(&format!("{set}\"")), "{text}");
    }
    assert!(!build[0].contains(r#"ucx="unknown""#), "{text}");
    assert!(build[0].ends_with("} 1"), "{text}");
}
