#!/usr/bin/env python3
"""kvferry's plans of a `kvferry bench --export-workload` file, made through the plan-only
API (`kvferry.PairPlanner`), as an engine that moves its KV cache with another transfer
layer would make them.

The workload holds what an engine holds: every rank's configuration (as its agent reads it:
page table, pools at the addresses the bench's servers allocated) and each request's slot
tables on both sides. For every request and every (prefill rank, decode rank) pair that the
planner says the prefill rank writes, this plans the whole prompt
(`PairPlanner.plan(prefill_tables, decode_tables, 0, prompt_len, prompt_len)`), which binds
and vets both sides' planners and validates the plan as the agent does, expands it to
`(src_address, dst_address, length)` descriptors and turns each address back into (pool,
offset) of its rank, so a runner can place the fragments in pools it allocated itself.

The result has the shape of a `kvferry-fragments/1` file (what the runners read): per pair
the pools' sizes, the fragments of each request's plan (`plans`) and every fragment as
`[src_pool, src_offset, dst_pool, dst_offset, length]`. Its fragment and byte counts per
pair are checked against the counts of kvferry's own plans of the same set, which the
workload carries (the bench recorded them as its servers executed them); a difference is an
error, not a warning.

Run it in its own process (`fetch` does): importing kvferry loads the UCX it links (the
libucx-cu12 wheel's), and NIXL's runner loads NIXL's own UCX; two UCX copies in one process
patch the same memory hooks. The process writes the result to its standard output (pickle)
and nothing to disk.

Usage: plans.py WORKLOAD.json [--summary]
"""

from __future__ import annotations

import bisect
import json
import pickle
import subprocess
import sys

WORKLOAD_FORMAT = "kvferry-workload/1"
FRAGMENTS_FORMAT = "kvferry-fragments/1"


class Pools:
    """One rank's pools from its configuration: address -> (pool, offset)."""

    def __init__(self, config: dict, what: str):
        pools = config["rank"]["page_table"]["pools"]
        self.what = what
        self.sizes = []
        spans = []
        for i, p in enumerate(pools):
            stride = p.get("slot_stride") or p["slot_bytes"]
            size = (p["num_slots"] - 1) * stride + p["slot_bytes"] if p["num_slots"] else 0
            self.sizes.append(size)
            spans.append((p["base"], size, i))
        spans.sort()
        self.bases = [b for b, _, _ in spans]
        self.spans = spans

    def locate(self, address: int, length: int) -> tuple[int, int]:
        k = bisect.bisect_right(self.bases, address) - 1
        if k >= 0:
            base, size, pool = self.spans[k]
            if address + length <= base + size:
                return pool, address - base
        raise ValueError(f"{self.what}: {length} bytes at {address:#x} lie in none of its pools")


def plan_workload(workload: dict) -> dict:
    """The workload's fragments, planned with kvferry's PairPlanner (see the module docs)."""
    import kvferry

    if workload.get("format") != WORKLOAD_FORMAT:
        raise ValueError(f"not a {WORKLOAD_FORMAT} file")
    prefill = {int(r): c for r, c in workload["prefill_ranks"].items()}
    decode = {int(r): c for r, c in workload["decode_ranks"].items()}
    src_pools = {r: Pools(c, f"prefill rank {r}") for r, c in prefill.items()}
    dst_pools = {r: Pools(c, f"decode rank {r}") for r, c in decode.items()}
    planners: dict[tuple[int, int], kvferry.PairPlanner] = {}
    pairs: dict[tuple[int, int], dict] = {}
    planner_id = None
    for request in workload["requests"]:
        prompt = request["prompt_len"]
        for p, p_tables in sorted(request["prefill"].items(), key=lambda kv: int(kv[0])):
            for d, d_tables in sorted(request["decode"].items(), key=lambda kv: int(kv[0])):
                key = (int(p), int(d))
                if key not in planners:
                    planners[key] = kvferry.PairPlanner(
                        json.dumps(prefill[key[0]]), json.dumps(decode[key[1]])
                    )
                planner = planners[key]
                planner_id = planner.planner_id
                if not planner.writes:
                    continue
                plan = planner.plan(p_tables, d_tables, 0, prompt, prompt)
                pair = pairs.setdefault(
                    key,
                    {
                        "ctx_rank": key[0],
                        "gen_rank": key[1],
                        "src_pools": src_pools[key[0]].sizes,
                        "dst_pools": dst_pools[key[1]].sizes,
                        "plans": [],
                        "bytes": 0,
                        "fragments": [],
                    },
                )
                frags = pair["fragments"]
                for src, dst, length in plan.expand():
                    sp, so = src_pools[key[0]].locate(src, length)
                    dp, do = dst_pools[key[1]].locate(dst, length)
                    frags.append([sp, so, dp, do, length])
                pair["plans"].append(len(plan))
                pair["bytes"] += plan.bytes
    if planner_id != workload["planner"]:
        raise ValueError(
            f"the plan-only API bound planner {planner_id}, the bench's servers "
            f"{workload['planner']}"
        )
    check(workload, pairs)
    out = {k: workload[k] for k in ("model", "planner", "planner_version", "prefill", "decode",
                                    "transport", "ucx_env", "memory", "prompt_len", "round")}
    out.update(
        format=FRAGMENTS_FORMAT,
        planned_by=f"kvferry.PairPlanner (kvferry {kvferry.__version__})",
        requests=[r["request"] for r in workload["requests"]],
        fragments=sum(len(p["fragments"]) for p in pairs.values()),
        bytes=sum(p["bytes"] for p in pairs.values()),
        pairs=[pairs[k] for k in sorted(pairs)],
    )
    return out


def check(workload: dict, pairs: dict[tuple[int, int], dict]) -> None:
    """These plans against kvferry's own plans of the same set: the same pairs, and per pair
    the same fragments and bytes (and the same fragments per plan, in any order)."""
    theirs = {(p["ctx_rank"], p["gen_rank"]): p for p in workload["pairs"]}
    if set(theirs) != set(pairs):
        raise ValueError(
            f"the plans cover pairs {sorted(pairs)}, kvferry's own {sorted(theirs)}"
        )
    for key, ours in sorted(pairs.items()):
        want = theirs[key]
        got = (len(ours["fragments"]), ours["bytes"], sorted(ours["plans"]))
        expected = (want["fragments"], want["bytes"], sorted(want["plans"]))
        if got != expected:
            raise ValueError(
                f"pair {key}: planned (fragments, bytes, per plan) {got[:2]}, kvferry's own "
                f"plans {expected[:2]} (per plan {got[2][:8]} against {expected[2][:8]})"
            )


def fetch(path: str, python: str | None = None) -> dict:
    """The workload at `path`, planned in a child process (see the module docs)."""
    done = subprocess.run(
        [python or sys.executable, __file__, path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(
            f"planning {path} with kvferry.PairPlanner failed:\n"
            + done.stderr.decode(errors="replace").strip()
        )
    return pickle.loads(done.stdout)


def main() -> int:
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with open(args[0]) as f:
        workload = json.load(f)
    try:
        planned = plan_workload(workload)
    except Exception as e:  # a bad workload, or kvferry.Error (its kind is in the text)
        print(f"plans.py: {args[0]}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if "--summary" in args[1:]:
        print(json.dumps({k: v for k, v in planned.items() if k != "pairs"}, indent=2))
        return 0
    sys.stdout.buffer.write(pickle.dumps(planned, protocol=pickle.HIGHEST_PROTOCOL))
    return 0


if __name__ == "__main__":
    sys.exit(main())
