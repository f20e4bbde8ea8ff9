#!/usr/bin/env python3
"""Joins the `kvferry bench --json`, `nixl_bench.py --json` and `mooncake_bench.py --json`
reports of one `scripts/bench-peers` sitting into its table (text) or one JSON object
(`--json`).

Usage: table.py RUN_DIR [--json]

A `--per-request` sitting (meta.json says so) prints the per-request table instead: one
request at a time, by model, transport and prompt length, the median time of one request
for kvferry, its bare put loop, the memcpy ceiling and each peer, in microseconds.

A `--sweep` sitting prints nixlbench's grid: by transport, fragment size and batch, GB/s
(medians of the rounds) of kvferry, its put loop and each peer, and the average and p99 over
the rounds of one request's time, its preparation (kvferry: planning and validation; NIXL:
make_prepped_xfer; Mooncake has no per-round step) and its posting (kvferry: issuing the
puts or copies; NIXL: transfer(); Mooncake: batch_transfer_async_write).

RUN_DIR holds `runs.jsonl` (what ran, in order, one JSON object a line: workload,
transport, pass, the report files and any peer's error; a peer that did not run has
neither), the reports it names, and `meta.json` (versions, machine, settings).

One table row per workload and transport. With several passes, every cell is the median
over the passes with [min-max] beside it; a ratio is taken within each pass (kvferry and
the peers ran back to back on the same fragments) and then summarised the same way. "best
peer" is kvferry's rate over the faster of NIXL and Mooncake in that pass.
"""

import json
import os
import statistics
import sys

PEERS = (("nixl", "NIXL"), ("mooncake", "Mooncake"))


def load(path):
    with open(path) as f:
        return json.load(f)


def human(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}".replace(".00 ", " ")
    return f"{nbytes:.0f} B"


def ratio(a, b):
    return a / b if a is not None and b else None


def summary(xs):
    """Median, min and max of the values that exist; None if none does."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def cell(s, digits, passes):
    """A summary as text: the median, and [min-max] when it summarises several passes."""
    if s is None:
        return None
    text = f"{s['median']:.{digits}f}"
    if passes > 1:
        text += f" [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"
        if s["n"] < passes:
            text += f" ({s['n']}/{passes})"
    return text


def latency(seconds):
    """Average and p99 (nearest rank) of per-round seconds, in microseconds; None if none."""
    if not seconds:
        return None
    v = sorted(seconds)
    rank = max(1, -(-len(v) * 99 // 100))
    return {"avg_us": sum(v) / len(v) * 1e6, "p99_us": v[rank - 1] * 1e6}


def row_of(run_dir, r):
    """One run (a workload, transport and pass; a sweep's cell) as a flat dict."""
    k = load(os.path.join(run_dir, r["kvferry"]))
    grid_cell = None
    if "cell" in r:
        grid_cell = k["cells"][r["cell"]]
        k = grid_cell["report"]
    export = k.get("export") or {}
    fragments = export.get("fragments", k["fragments"])
    nbytes = export.get("bytes", k["bytes"])
    rounds_us = lambda seconds: statistics.median(seconds) * 1e6 / max(k["requests"], 1)  # noqa: E731
    row = {
        "workload": r["workload"],
        "model": k["model"],
        "prefill": k["prefill"],
        "decode": k["decode"],
        "kvferry_us": rounds_us(k["ours"]["rounds_seconds"]),
        "raw_us": rounds_us(k["raw"]["rounds_seconds"]),
        "memcpy_us": rounds_us(k["memcpy"]["rounds_seconds"]) if k["memcpy_gbps"] else None,
        "transport": r["transport"],
        "pass": r["pass"],
        "requests": k["requests"],
        "prompt_len": k["prompt_len"],
        "planner": k["planner"],
        "fragments": fragments,
        "bytes": nbytes,
        "fragment_bytes": nbytes / max(fragments, 1),
        "kvferry_gbps": k["ours_gbps"],
        "raw_gbps": k["raw_gbps"],
        "kvferry_raw_ratio": k["ratio"],
        "kvferry_verified": k["verified"],
        "kvferry_rounds": k["rounds"],
        "kvferry_report": r["kvferry"],
    }
    best = None
    for peer, _ in PEERS:
        report = load(os.path.join(run_dir, r[peer])) if r.get(peer) else None
        gbps = report["gbps"] if report else None
        row[f"{peer}_us"] = (
            statistics.median(report["rounds_seconds"]) * 1e6 if report else None
        )
        row[f"{peer}_ran"] = bool(report) or bool(r.get(f"{peer}_error"))
        row[f"{peer}_gbps"] = gbps
        row[f"{peer}_verified"] = report["verified"] if report else None
        row[f"{peer}_rounds"] = report["rounds"] if report else None
        row[f"kvferry_{peer}_ratio"] = ratio(k["ours_gbps"], gbps)
        row[f"{peer}_error"] = r.get(f"{peer}_error")
        row[f"{peer}_report"] = r.get(peer)
        if gbps and (best is None or gbps > best[1]):
            best = (peer, gbps)
        if peer == "nixl":
            row["nixl_gbps_with_make"] = report["gbps_with_make"] if report else None
        if peer == "mooncake":
            row["mooncake_transport"] = report["transport"] if report else None
        if grid_cell is not None:
            row[f"{peer}_time"] = latency(report["rounds_seconds"]) if report else None
            row[f"{peer}_post"] = latency(report.get("rounds_post_seconds")) if report else None
            row[f"{peer}_prepare"] = (
                latency(report.get("rounds_prepare_seconds")) if report else None
            )
    if grid_cell is not None:
        row["size"] = grid_cell["fragment_bytes"]
        row["batch"] = grid_cell["batch"]
        row["memcpy_gbps"] = grid_cell["memcpy_gbps"] or None
        row["agent_gbps"] = grid_cell["agent_gbps"]
        row["agent_best_peer_ratio"] = (
            ratio(grid_cell["agent_gbps"], best[1]) if best else None
        )
        for key in ("ours", "agent", "raw", "prepare", "post"):
            row[f"kvferry_{key}"] = grid_cell[key]
    row["best_peer"] = best[0] if best else None
    row["best_peer_gbps"] = best[1] if best else None
    row["kvferry_best_peer_ratio"] = ratio(k["ours_gbps"], best[1]) if best else None
    return row


def workloads_of(rows):
    """The rows grouped by workload and transport (in the order they first ran), each
    summarised over its passes."""
    groups = {}
    for r in rows:
        groups.setdefault((r["workload"], r["transport"]), []).append(r)
    out = []
    for (workload, transport), rs in groups.items():
        w = {
            "workload": workload,
            "transport": transport,
            "passes": len(rs),
            "fragments": rs[0]["fragments"],
            "bytes": rs[0]["bytes"],
            "fragment_bytes": rs[0]["fragment_bytes"],
            "verified": all(
                r["kvferry_verified"] and r["nixl_verified"] is not False
                and r["mooncake_verified"] is not False
                for r in rs
            ),
        }
        for key in ("kvferry_gbps", "raw_gbps", "nixl_gbps", "mooncake_gbps",
                    "kvferry_nixl_ratio", "kvferry_mooncake_ratio", "kvferry_best_peer_ratio"):
            w[key] = summary([r[key] for r in rs])
        for peer, _ in PEERS:
            w[f"{peer}_ran"] = any(r[f"{peer}_ran"] for r in rs)
            w[f"{peer}_failed"] = sum(1 for r in rs if r[f"{peer}_error"])
        w["best_peers"] = sorted({r["best_peer"] for r in rs if r["best_peer"]})
        out.append(w)
    return out


def per_request(meta, rows):
    """The per-request table (see the module docs): medians over passes of each pass's
    median, in microseconds per request."""
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["prefill"], r["decode"], r["transport"],
                           r["prompt_len"]), []).append(r)
    ran = [(p, label) for p, label in PEERS if any(r[f"{p}_ran"] for r in rows)]
    head = ["model", "transport", "tokens", "KV bytes", "kvferry us", "raw us", "memcpy us"]
    head += [f"{label} us" for _, label in ran]
    head += ["kvferry-raw us", "kvferry GB/s", "kvferry/raw", "kvferry/memcpy"]
    head += ["vs best peer"] if ran else []
    table = [head]
    out = []
    for (model, prefill, decode, transport, tokens), rs in groups.items():
        med = lambda key: summary([r[key] for r in rs])  # noqa: E731
        m = {key: med(key) for key in ("kvferry_us", "raw_us", "memcpy_us", "nixl_us",
                                       "mooncake_us", "kvferry_gbps")}
        m["over_raw_us"] = summary([r["kvferry_us"] - r["raw_us"] for r in rs])
        m["vs_best_peer"] = summary([
            min(r[f"{p}_us"] for p, _ in ran if r[f"{p}_us"]) / r["kvferry_us"]
            if any(r[f"{p}_us"] for p, _ in ran) else None
            for r in rs
        ])
        get = lambda key: m[key]["median"] if m[key] else None  # noqa: E731
        ratio_of = lambda a, b: f"{b / a:.2f}" if a and b else "-"  # noqa: E731
        out.append({"model": model, "prefill": prefill, "decode": decode,
                    "transport": transport, "tokens": tokens, "bytes": rs[0]["bytes"],
                    "passes": len(rs), **m})
        line = [f"{model} {prefill}->{decode}", transport, f"{tokens:,}", human(rs[0]["bytes"])]
        line += [f"{get(k):,.0f}" if get(k) else "-" for k in ("kvferry_us", "raw_us", "memcpy_us")]
        line += [f"{get(f'{p}_us'):,.0f}" if get(f"{p}_us") else "-" for p, _ in ran]
        line += [f"{get('over_raw_us'):,.0f}", f"{get('kvferry_gbps'):.2f}",
                 ratio_of(get("kvferry_us"), get("raw_us")),
                 ratio_of(get("kvferry_us"), get("memcpy_us"))]
        if ran:
            line.append(f"{get('vs_best_peer'):.2f}x" if get("vs_best_peer") else "-")
        table.append(line)
    return head, table, out


def sweep_table(rows):
    """The grid (see the module docs): one line per transport, fragment size and batch;
    GB/s medians over the passes, times the passes' median of each pass's avg and p99."""
    groups = {}
    for r in rows:
        groups.setdefault((r["transport"], r["size"], r["batch"]), []).append(r)
    ran = [(p, label) for p, label in PEERS if any(r[f"{p}_ran"] for r in rows)]
    head = ["transport", "fragment", "batch", "kvferry GB/s", "raw GB/s"]
    head += [f"{label} GB/s" for _, label in ran]
    head += ["kvferry us avg/p99", "agent us avg/p99"]
    head += [f"{label} us avg/p99" for _, label in ran]
    head += ["prepare us kvferry/NIXL" if any(p == "nixl" for p, _ in ran) else "prepare us"]
    head += ["post us " + "/".join(["kvferry"] + [label for _, label in ran])]
    head += ["vs best peer", "agent vs best"] if ran else []
    table = [head]
    out = []

    def mid(rs, key, field=None):
        xs = [(r[key] or {}).get(field) if field else r[key] for r in rs]
        s = summary(xs)
        return s["median"] if s else None

    def us(rs, key):
        a, p = mid(rs, key, "avg_us"), mid(rs, key, "p99_us")
        return f"{a:,.0f}/{p:,.0f}" if a is not None else "-"

    def avg(rs, key):
        a = mid(rs, key, "avg_us")
        return f"{a:,.0f}" if a is not None else "-"

    for (transport, size, batch), rs in sorted(groups.items()):
        m = {key: summary([r[key] for r in rs])
             for key in ("kvferry_gbps", "raw_gbps", "memcpy_gbps", "nixl_gbps", "mooncake_gbps",
                         "kvferry_best_peer_ratio", "agent_gbps", "agent_best_peer_ratio")}
        for key in ["kvferry_ours", "kvferry_agent", "kvferry_raw", "kvferry_prepare",
                    "kvferry_post"] + [f"{p}_{x}" for p, _ in PEERS
                                        for x in ("time", "post", "prepare")]:
            m[key] = {f: mid(rs, key, f) for f in ("avg_us", "p99_us")}
        out.append({"transport": transport, "fragment_bytes": size, "batch": batch,
                    "bytes": rs[0]["bytes"], "fragments": rs[0]["fragments"],
                    "passes": len(rs), **m})
        gb = lambda key: f"{m[key]['median']:.3f}" if m[key] else "-"  # noqa: E731
        line = [transport, human(size), str(batch), gb("kvferry_gbps"), gb("raw_gbps")]
        line += [gb(f"{p}_gbps") for p, _ in ran]
        line += [us(rs, "kvferry_ours"), us(rs, "kvferry_agent")]
        line += [us(rs, f"{p}_time") for p, _ in ran]
        prepare = [avg(rs, "kvferry_prepare")]
        if any(p == "nixl" for p, _ in ran):
            prepare.append(avg(rs, "nixl_prepare"))
        line.append("/".join(prepare))
        line.append("/".join([avg(rs, "kvferry_post")] + [avg(rs, f"{p}_post") for p, _ in ran]))
        if ran:
            for key in ("kvferry_best_peer_ratio", "agent_best_peer_ratio"):
                line.append(f"{m[key]['median']:.2f}x" if m[key] else "-")
        table.append(line)
    return table, out


def print_table(table):
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    for i, line in enumerate(table):
        cells = [c.ljust(widths[j]) if j < 2 else c.rjust(widths[j]) for j, c in enumerate(line)]
        print("  ".join(cells).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main():
    run_dir = sys.argv[1]
    as_json = "--json" in sys.argv[2:]
    meta = load(os.path.join(run_dir, "meta.json"))
    end = os.path.join(run_dir, "loadavg_end")
    if os.path.exists(end):
        with open(end) as f:
            meta["loadavg_end"] = f.read().strip()
    with open(os.path.join(run_dir, "runs.jsonl")) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    rows = [row_of(run_dir, r) for r in runs]
    if meta.get("sweep"):
        table, out = sweep_table(rows)
        if as_json:
            print(json.dumps({"meta": meta, "rows": rows, "sweep": out}, indent=2))
            return 0
        passes = max((c["passes"] for c in out), default=1)
        print(f"kvferry {meta['kvferry_commit']} (UCX {meta['kvferry_ucx']}), nixlbench's grid "
              f"(kvferry bench --sweep: one request of BATCH fragments at a time, tp1 -> tp1), "
              f"{meta['rounds']} counted rounds per cell; {meta['started']}, {meta['host']}, "
              f"load average {meta.get('loadavg_start', '?')} at the start, "
              f"{meta.get('loadavg_end', '?')} at the end")
        print_table(table)
        over = f" (medians over {passes} passes)" if passes > 1 else ""
        print("GB/s: medians of the rounds" + over + "; us: microseconds per request, average "
              "and p99 (nearest rank) over the rounds. kvferry: its full path timed by the "
              "controller (Submit to Done: the controller's round trip to the decode server, expect, "
              "claim, plan, puts, completion); agent: the same request as the decode agent "
              "times it, first claim to last completion (what an engine embedding it sees, "
              "without the harness's hop); "
              "NIXL: first transfer() to the last completion and notification; Mooncake: first "
              "submission to the last batch done. prepare: kvferry's planning and validation, "
              "NIXL's make_prepped_xfer (before its clock); post: issuing the puts or copies, "
              "transfer(), batch_transfer_async_write. vs best peer: kvferry's GB/s over the "
              "faster peer's; agent vs best: the same with kvferry's agent-timed GB/s. Mooncake "
              "runs over TCP in the shm rows too.")
        return 0
    if meta.get("per_request"):
        _, table, out = per_request(meta, rows)
        if as_json:
            print(json.dumps({"meta": meta, "rows": rows, "per_request": out}, indent=2))
            return 0
        print(f"kvferry {meta['kvferry_commit']} (UCX {meta['kvferry_ucx']}), one request at "
              f"a time; {meta['started']}, {meta['host']}, load average "
              f"{meta.get('loadavg_start', '?')} at the start, {meta.get('loadavg_end', '?')} "
              "at the end")
        print_table(table)
        print("us: microseconds per request, the median of the counted rounds (of the passes' "
              "medians); kvferry: its full path (expect, claim, plan, puts, completion), raw: "
              "its bare put loop over the same fragments, memcpy: the same fragments copied in "
              "one process (the ceiling); ratios are time over kvferry's time; vs best peer: the "
              "faster peer's time over kvferry's.")
        return 0
    workloads = workloads_of(rows)
    if as_json:
        print(json.dumps({"meta": meta, "rows": rows, "workloads": workloads}, indent=2))
        return 0

    ran = [(peer, label) for peer, label in PEERS if any(w[f"{peer}_ran"] for w in workloads)]
    names = {
        "nixl": f"{meta.get('nixl', 'NIXL')} (its own UCX {meta.get('nixl_ucx', '?')})",
        "mooncake": meta.get("mooncake", "Mooncake"),
    }
    against = " and ".join(names[peer] for peer, _ in ran) or "no peer"
    print(
        f"kvferry {meta['kvferry_commit']} (UCX {meta['kvferry_ucx']}) against {against}\n"
        f"{meta['started']}, {meta['host']}, load average {meta.get('loadavg_start', '?')} "
        f"at the start, {meta.get('loadavg_end', '?')} at the end"
    )
    passes = max((w["passes"] for w in workloads), default=1)
    head = ["workload", "transport", "frags/round", "frag size", "kvferry GB/s", "raw put GB/s"]
    for peer, label in ran:
        head += [f"{label} GB/s", f"kvferry/{label}"]
    if len(ran) > 1:
        head.append("kvferry/best peer")
    table = [head]
    for w in workloads:
        flags = "" if w["verified"] else " (NOT VERIFIED)"
        line = [
            w["workload"] + flags,
            w["transport"],
            f"{w['fragments']:,}",
            human(w["fragment_bytes"]),
            cell(w["kvferry_gbps"], 3, w["passes"]),
            cell(w["raw_gbps"], 3, w["passes"]),
        ]
        for peer, _ in ran:
            failed = "failed" if w[f"{peer}_failed"] else "-"
            line.append(cell(w[f"{peer}_gbps"], 3, w["passes"]) or failed)
            line.append(cell(w[f"kvferry_{peer}_ratio"], 2, w["passes"]) or "-")
        if len(ran) > 1:
            best = cell(w["kvferry_best_peer_ratio"], 2, w["passes"])
            if best and w["best_peers"]:
                best += " (" + "/".join(dict(PEERS)[p] for p in w["best_peers"]) + ")"
            line.append(best or "-")
        table.append(line)
    print_table(table)
    over = f"; the medians over {passes} passes [min-max]" if passes > 1 else ""
    notes = [
        "GB/s = 10^9 bytes/s, medians of the counted rounds" + over + "; kvferry: its full "
        "transfer path, raw put: a bare put loop over the same fragments (kvferry bench)"
    ]
    for peer, label in ran:
        mode = meta.get(f"{peer}_mode", "")
        source = meta.get("descriptors", "round 0's exported fragments")
        notes.append(f"{label}: {peer}_bench.py on {source}, {mode}")
    if len(ran) > 1:
        notes.append("best peer: kvferry over the faster peer of each pass (named)")
    print(".\n".join(notes) + ".")
    shm_over_tcp = {r["mooncake_transport"] for r in rows
                    if r["transport"] == "shm" and r["mooncake_transport"]}
    for t in sorted(shm_over_tcp):
        if not t.startswith("shm"):
            print(f"Mooncake's shm rows ran over {t}.")
    for r in rows:
        for peer, label in PEERS:
            if r[f"{peer}_error"]:
                print(f"{label} failed on {r['workload']} over {r['transport']} (pass "
                      f"{r['pass']}): {r[f'{peer}_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
