//! The agents' numbers ([`AgentStats`]) in the Prometheus text format (version 0.0.4), for a
//! `/metrics` endpoint: what `kvferry serve --metrics-listen` serves, and what the C API
//! (`kvferry_agent_metrics`) and Python (`Agent.metrics_text()`) hand an engine to fold into
//! its own.
//!
//! Every series but `kvferry_build_info` carries the agent's `kvferry_instance` (its instance's
//! name; not `instance`, which Prometheus sets to the scraped target and would rename ours to
//! `exported_instance`), `rank` and `role` (`prefill` or `decode`). Names and units follow
//! Prometheus' conventions:
//!
//! | series | type | what |
//! |---|---|---|
//! | `kvferry_build_info{version,ucx,planner}` | gauge | always 1: kvferry's version, the loaded UCX library's, the planner the agents bound (a line per planner; no `planner` label without agents) |
//! | `kvferry_requests_total{outcome}` | counter | requests ended: `sent`, `received`, `cancelled`, `failed` |
//! | `kvferry_request_failures_total{kind}` | counter | failed requests by kind (`peer`, `timeout`, `lease`, ...) |
//! | `kvferry_transfer_bytes_total` | counter | bytes of the requests that ended well |
//! | `kvferry_fragments_total` | counter | fragments written into a decode rank |
//! | `kvferry_pieces_total` | counter | pieces (chunks, layer-wise parts) landed in a decode rank |
//! | `kvferry_puts_total` | counter | puts a prefill rank issued |
//! | `kvferry_write_seconds_total` | counter | a prefill rank's time in puts and flushes |
//! | `kvferry_transfer_duration_seconds` | histogram | per request: decode `expect` → received; prefill claim → sent |
//! | `kvferry_planning_duration_seconds` | histogram | per request: planning and validating |
//! | `kvferry_queue_duration_seconds` | histogram | per request: waiting for a planner worker or the rank thread |
//! | `kvferry_requests_in_flight` | gauge | requests held now |
//! | `kvferry_peers` | gauge | vetted peer connections now |
//!
//! The histograms' buckets are powers of two of microseconds (`le` = 2^k µs, a request's time
//! truncated to whole microseconds counted under the first bound above it), from 1 µs to
//! about 67 s, then `+Inf`.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeMetric as _, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use crate::Role;
use crate::agent::{Agent, AgentStats, FAILURE_KINDS, LATENCY_BUCKETS};

/// The `Content-Type` of [`encode`]'s text.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The label naming an agent's instance on every series (Prometheus keeps `instance` for the
/// scraped target).
pub const INSTANCE_LABEL: &str = "kvferry_instance";

/// The version `kvferry_build_info` reports: this crate's, which every kvferry crate shares.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// One agent's numbers and who it is.
#[derive(Clone, Debug)]
pub struct Sample {
    /// The agent's instance.
    pub instance: String,
    /// Its rank in the instance.
    pub rank: u32,
    /// Its role.
    pub role: Role,
    /// The id of the planner it bound.
    pub planner: String,
    /// What it did so far.
    pub stats: AgentStats,
}

impl Sample {
    /// The agent's numbers now.
    pub fn of(agent: &Agent) -> Sample {
        let me = agent.identity();
        Sample {
            instance: me.instance,
            rank: me.rank,
            role: agent.role(),
            planner: agent.rank_info().planner_id.to_string(),
            stats: agent.stats(),
        }
    }

    fn labels(&self) -> Vec<(&'static str, String)> {
        vec![
            (INSTANCE_LABEL, self.instance.clone()),
            ("rank", self.rank.to_string()),
            ("role", self.role.to_string()),
        ]
    }
}

/// The samples in the Prometheus text format (every series described once, one line per
/// agent and label set).
pub fn encode(samples: &[Sample]) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Samples(samples.to_vec())));
    let mut text = String::new();
    // Writing into a String cannot fail, and every name and label here is valid.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut text, &registry);
    text
}

/// The samples of one scrape.
#[derive(Debug)]
struct Samples(Vec<Sample>);

const OUTCOMES: [&str; 4] = ["sent", "received", "cancelled", "failed"];

impl Samples {
    /// One counter, one line per agent.
    fn counter<N: EncodeCounterValue>(
        &self,
        encoder: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        unit: Option<&Unit>,
        value: impl Fn(&AgentStats) -> N,
    ) -> Result<(), std::fmt::Error> {
        let mut metric = encoder.encode_descriptor(name, help, unit, MetricType::Counter)?;
        for s in &self.0 {
            let labels = s.labels();
            ConstCounter::new(value(&s.stats)).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }

    fn gauge(
        &self,
        encoder: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        value: impl Fn(&AgentStats) -> u64,
    ) -> Result<(), std::fmt::Error> {
        let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for s in &self.0 {
            let labels = s.labels();
            let v = i64::try_from(value(&s.stats)).unwrap_or(i64::MAX);
            ConstGauge::new(v).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// One histogram over log2 microsecond buckets, one set of lines per agent.
    fn histogram(
        &self,
        encoder: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        value: impl Fn(&AgentStats) -> (&[u64; LATENCY_BUCKETS], f64),
    ) -> Result<(), std::fmt::Error> {
        let mut metric =
            encoder.encode_descriptor(name, help, Some(&Unit::Seconds), MetricType::Histogram)?;
        for s in &self.0 {
            let labels = s.labels();
            let (counts, sum_s) = value(&s.stats);
            let buckets: Vec<(f64, u64)> = counts
                .iter()
                .enumerate()
                .map(|(k, &n)| {
                    let le = if k + 1 == LATENCY_BUCKETS {
                        f64::INFINITY
                    } else {
                        (1u64 << k) as f64 * 1e-6
                    };
                    (le, n)
                })
                .collect();
            let count = counts.iter().sum();
            metric
                .encode_family(&labels)?
                .encode_histogram::<NoLabelSet>(sum_s, count, &buckets, None)?;
        }
        Ok(())
    }
}

impl Collector for Samples {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let e = &mut encoder;
        {
            let mut metric = e.encode_descriptor(
                "kvferry_build_info",
                "Always 1: kvferry's version, the loaded UCX library's, and the planner the \
                 agents bound.",
                None,
                MetricType::Gauge,
            )?;
            let build = [
                ("version", VERSION.to_string()),
                ("ucx", kvferry_ucx::version().to_string()),
            ];
            let mut planners: Vec<&str> = self.0.iter().map(|s| s.planner.as_str()).collect();
            planners.sort_unstable();
            planners.dedup();
            if planners.is_empty() {
                ConstGauge::new(1i64).encode(metric.encode_family(&build.to_vec())?)?;
            }
            for planner in planners {
                let mut labels = build.to_vec();
                labels.push(("planner", planner.to_string()));
                ConstGauge::new(1i64).encode(metric.encode_family(&labels)?)?;
            }
        }
        {
            let mut metric = e.encode_descriptor(
                "kvferry_requests",
                "Requests ended, by outcome.",
                None,
                MetricType::Counter,
            )?;
            for s in &self.0 {
                let st = &s.stats;
                let counts = [st.sent, st.received, st.cancelled, st.failed_total()];
                for (outcome, n) in OUTCOMES.iter().zip(counts) {
                    let mut labels = s.labels();
                    labels.push(("outcome", (*outcome).to_string()));
                    ConstCounter::new(n).encode(metric.encode_family(&labels)?)?;
                }
            }
        }
        {
            let mut metric = e.encode_descriptor(
                "kvferry_request_failures",
                "Failed requests, by kind.",
                None,
                MetricType::Counter,
            )?;
            for s in &self.0 {
                for (kind, n) in FAILURE_KINDS.iter().zip(s.stats.failed) {
                    let mut labels = s.labels();
                    labels.push(("kind", kind.to_string()));
                    ConstCounter::new(n).encode(metric.encode_family(&labels)?)?;
                }
            }
        }
        self.counter(
            e,
            "kvferry_transfer",
            "Bytes of the requests that ended well (written by a prefill rank, or into a \
             decode rank).",
            Some(&Unit::Bytes),
            |s| s.bytes,
        )?;
        self.counter(
            e,
            "kvferry_fragments",
            "Fragments written into a decode rank.",
            None,
            |s| s.fragments,
        )?;
        self.counter(
            e,
            "kvferry_pieces",
            "Pieces (chunks, layer-wise parts) landed in a decode rank.",
            None,
            |s| s.pieces,
        )?;
        self.counter(
            e,
            "kvferry_puts",
            "Puts a prefill rank issued.",
            None,
            |s| s.puts,
        )?;
        self.counter(
            e,
            "kvferry_write",
            "A prefill rank's time in puts and flushes.",
            Some(&Unit::Seconds),
            |s| s.write_ns as f64 * 1e-9,
        )?;
        self.histogram(
            e,
            "kvferry_transfer_duration",
            "Requests that ended well by their time: a decode rank's expect to received, \
             a prefill rank's claim to sent.",
            |s| (&s.latency_us, s.latency_sum_us as f64 * 1e-6),
        )?;
        self.histogram(
            e,
            "kvferry_planning_duration",
            "Requests that ended well by their planning and validation time.",
            |s| (&s.plan_us, s.plan_ns as f64 * 1e-9),
        )?;
        self.histogram(
            e,
            "kvferry_queue_duration",
            "Requests that ended well by their time waiting for a planner worker or the rank \
             thread.",
            |s| (&s.queue_us, s.queue_ns as f64 * 1e-9),
        )?;
        self.gauge(e, "kvferry_requests_in_flight", "Requests held now.", |s| {
            s.in_flight
        })?;
        self.gauge(e, "kvferry_peers", "Vetted peer connections now.", |s| {
            s.peers
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::FailureKind;

    fn sample(rank: u32, role: Role, stats: AgentStats) -> Sample {
        Sample {
            instance: "ctx-\"a\"".into(),
            rank,
            role,
            planner: "default".into(),
            stats,
        }
    }

    #[test]
    fn the_instance_label_is_kvferry_instance_never_prometheus_instance() {
        let text = encode(&[
            sample(0, Role::Prefill, AgentStats::default()),
            sample(1, Role::Decode, AgentStats::default()),
        ]);
        let samples: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .collect();
        assert!(samples.len() > 20, "{text}");
        for line in samples {
            // Prometheus sets `instance` to the scraped target: ours would be renamed. (The
            // values here hold no `{`, `,` or `=` but the instance's quotes, so a label name
            // follows each `{` and `,` outside them; the CLI's test parses lines properly.)
            assert!(
                !line.contains("{instance=") && !line.contains(",instance="),
                "`{line}`"
            );
            if !line.starts_with("kvferry_build_info") {
                let labels = line.split_once('{').map_or("", |(_, rest)| rest);
                assert!(
                    labels.starts_with(r#"kvferry_instance="ctx-\"a\"",rank=""#)
                        && labels.contains(",role=\""),
                    "`{line}`"
                );
            }
        }
        assert!(
            text.contains(
                r#"kvferry_peers{kvferry_instance="ctx-\"a\"",rank="1",role="decode"} 0"#
            ),
            "{text}"
        );
    }

    #[test]
    fn build_info_says_which_kvferry_ucx_and_planner_once_per_text() {
        let text = encode(&[
            sample(0, Role::Prefill, AgentStats::default()),
            sample(1, Role::Prefill, AgentStats::default()),
        ]);
        assert_eq!(
            text.matches("# TYPE kvferry_build_info gauge").count(),
            1,
            "{text}"
        );
        assert_eq!(
            text.matches("# HELP kvferry_build_info ").count(),
            1,
            "{text}"
        );
        let ucx = kvferry_ucx::version();
        assert!(!ucx.is_empty() && ucx != "unknown", "{ucx}");
        let line =
            format!(r#"kvferry_build_info{{version="{VERSION}",ucx="{ucx}",planner="default"}} 1"#);
        // Two agents of one planner: one line.
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("kvferry_build_info"))
            .collect();
        assert_eq!(lines, [line.as_str()], "{text}");
        assert_eq!(VERSION, env!("CARGO_PKG_VERSION"));
        assert!(!VERSION.is_empty());
        // Without agents (nothing to name a planner): kvferry and UCX still.
        let none = encode(&[]);
        let line = format!(r#"kvferry_build_info{{version="{VERSION}",ucx="{ucx}"}} 1"#);
        assert!(none.lines().any(|l| l == line), "{none}");
    }

    #[test]
    fn every_series_is_described_once_and_labelled_per_agent() {
        let mut a = AgentStats {
            sent: 3,
            bytes: 3 << 20,
            puts: 12,
            write_ns: 1_500_000_000,
            latency_sum_us: 3_000,
            plan_ns: 30_000,
            queue_ns: 0,
            in_flight: 2,
            peers: 1,
            ..AgentStats::default()
        };
        // Two requests of 1000 µs (under 1024), one of exactly 1024 (under 2048).
        a.latency_us[10] = 2;
        a.latency_us[11] = 1;
        a.plan_us[4] = 3;
        a.queue_us[0] = 3;
        a.failed[FAILURE_KINDS
            .iter()
            .position(|k| *k == FailureKind::Lease)
            .unwrap()] = 1;
        let b = AgentStats {
            received: 5,
            ..AgentStats::default()
        };
        let text = encode(&[sample(0, Role::Prefill, a), sample(1, Role::Decode, b)]);
        let has = |line: &str| assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
        let ctx = r#"kvferry_instance="ctx-\"a\"",rank="0",role="prefill""#;
        let generation = r#"kvferry_instance="ctx-\"a\"",rank="1",role="decode""#;
        has("# TYPE kvferry_requests_total counter");
        has(&format!(
            r#"kvferry_requests_total{{{ctx},outcome="sent"}} 3"#
        ));
        has(&format!(
            r#"kvferry_requests_total{{{ctx},outcome="failed"}} 1"#
        ));
        has(&format!(
            r#"kvferry_requests_total{{{generation},outcome="received"}} 5"#
        ));
        has(&format!(
            r#"kvferry_request_failures_total{{{ctx},kind="lease"}} 1"#
        ));
        has(&format!("kvferry_transfer_bytes_total{{{ctx}}} 3145728"));
        has(&format!("kvferry_write_seconds_total{{{ctx}}} 1.5"));
        has("# TYPE kvferry_transfer_duration_seconds histogram");
        has(&format!(
            r#"kvferry_transfer_duration_seconds_bucket{{{ctx},le="0.000512"}} 0"#
        ));
        has(&format!(
            r#"kvferry_transfer_duration_seconds_bucket{{{ctx},le="0.001024"}} 2"#
        ));
        has(&format!(
            r#"kvferry_transfer_duration_seconds_bucket{{{ctx},le="0.002048"}} 3"#
        ));
        has(&format!(
            r#"kvferry_transfer_duration_seconds_bucket{{{ctx},le="+Inf"}} 3"#
        ));
        has(&format!(
            "kvferry_transfer_duration_seconds_sum{{{ctx}}} 0.003"
        ));
        has(&format!(
            "kvferry_transfer_duration_seconds_count{{{ctx}}} 3"
        ));
        has(&format!(
            "kvferry_planning_duration_seconds_sum{{{ctx}}} 0.00003"
        ));
        has(&format!("kvferry_requests_in_flight{{{ctx}}} 2"));
        has(&format!("kvferry_peers{{{generation}}} 0"));
        // One description per series, whatever the number of agents.
        assert_eq!(text.matches("# TYPE kvferry_peers gauge").count(), 1);
        assert_eq!(
            text.matches("# HELP kvferry_transfer_duration_seconds ")
                .count(),
            1
        );
    }
}
