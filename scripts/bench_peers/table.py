#!/usr/bin/env python3
"""Joins the `kvferry bench --json` and `nixl_bench.py --json` reports of one
`scripts/bench-peers` sitting into its table (text) or one JSON object (`--json`).

Usage: table.py RUN_DIR [--json]

RUN_DIR holds `runs.jsonl` (what ran, in order, one JSON object a line: workload,
transport, pass, the report files and any NIXL error), the reports it names, and
`meta.json` (versions, machine, settings).
"""

import json
import os
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def human(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}".replace(".00 ", " ")
    return f"{nbytes:.0f} B"


def main():
    run_dir = sys.argv[1]
    as_json = "--json" in sys.argv[2:]
    meta = load(os.path.join(run_dir, "meta.json"))
    end = os.path.join(run_dir, "loadavg_end")
    if os.path.exists(end):
        with open(end) as f:
            meta["loadavg_end"] = f.read().strip()
    rows = []
    with open(os.path.join(run_dir, "runs.jsonl")) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    for r in runs:
        k = load(os.path.join(run_dir, r["kvferry"]))
        n = load(os.path.join(run_dir, r["nixl"])) if r.get("nixl") else None
        export = k.get("export") or {}
        fragments = export.get("fragments", k["fragments"])
        nbytes = export.get("bytes", k["bytes"])
        row = {
            "workload": r["workload"],
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
            "nixl_gbps": n["gbps"] if n else None,
            "nixl_gbps_with_make": n["gbps_with_make"] if n else None,
            "nixl_verified": n["verified"] if n else None,
            "kvferry_nixl_ratio": (k["ours_gbps"] / n["gbps"]) if n and n["gbps"] > 0 else None,
            "kvferry_rounds": k["rounds"],
            "nixl_rounds": n["rounds"] if n else None,
            "nixl_error": r.get("nixl_error"),
            "kvferry_report": r["kvferry"],
            "nixl_report": r.get("nixl"),
        }
        rows.append(row)
    if as_json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
        return 0

    print(
        f"kvferry {meta['kvferry_commit']} (UCX {meta['kvferry_ucx']}) against "
        f"{meta.get('nixl', 'NIXL')} (its own UCX {meta.get('nixl_ucx', '?')})\n"
        f"{meta['started']}, {meta['host']}, load average {meta.get('loadavg_start', '?')} "
        f"at the start, {meta.get('loadavg_end', '?')} at the end"
    )
    head = (
        "workload", "transport", "frags/round", "frag size", "kvferry GB/s",
        "raw put GB/s", "NIXL GB/s", "kvferry/NIXL",
    )
    table = [head]
    for r in rows:
        name = r["workload"] + (f" #{r['pass']}" if len({x["pass"] for x in rows}) > 1 else "")
        nixl = "failed" if r["nixl_gbps"] is None else f"{r['nixl_gbps']:.3f}"
        ratio = "-" if r["kvferry_nixl_ratio"] is None else f"{r['kvferry_nixl_ratio']:.2f}"
        flags = ""
        if not r["kvferry_verified"] or r["nixl_verified"] is False:
            flags = " (NOT VERIFIED)"
        table.append((
            name + flags,
            r["transport"],
            f"{r['fragments']:,}",
            human(r["fragment_bytes"]),
            f"{r['kvferry_gbps']:.3f}",
            f"{r['raw_gbps']:.3f}",
            nixl,
            ratio,
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        cells = [c.ljust(widths[j]) if j < 2 else c.rjust(widths[j]) for j, c in enumerate(row)]
        print("  ".join(cells).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(
        "GB/s = 10^9 bytes/s, medians of the counted rounds; kvferry: its full transfer path, "
        "raw put: a bare put loop over the same fragments (kvferry bench); NIXL: "
        f"nixl_bench.py on round 0's exported fragments, {meta.get('nixl_mode', '')}."
    )
    for r in rows:
        if r["nixl_error"]:
            print(f"NIXL failed on {r['workload']} over {r['transport']}: {r['nixl_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
