//! `kvferry serve --metrics-listen`: Prometheus scrapes the servers while `kvferry demo` drives
//! them, and the numbers they serve are the demo's own.

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
