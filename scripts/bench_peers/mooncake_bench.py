#!/usr/bin/env python3
"""Moves kvferry's plans of a `kvferry bench --export-workload` set with Mooncake's
Transfer Engine, and times it.

The descriptors come from kvferry's plan-only API, as for nixl_bench.py (plans.py: every
request planned with `kvferry.PairPlanner` in a child process, checked against kvferry's
own plans); a `--export-fragments` file is read as it is.

Two processes on this machine, DRAM to DRAM, the way vLLM's MooncakeConnector (and
SGLang's Mooncake backend) use the Transfer Engine: one engine per rank — there, every
rank is its own worker process with its own engine; here the initiator holds one engine per
prefill rank and the target one per decode rank, so every (prefill rank, decode rank) pair
is its own pair of engines with its own connections, as it would be between workers:

- every engine is set up with `initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")`: no
  metadata server (etcd, http); each engine serves its segment description itself on its
  RPC port, and the initiator's engines fetch it on their first transfer to a segment
  (`"127.0.0.1:<get_rpc_port()>"`, as the connectors name peers);
- every engine registers the extent of each pool of its rank that the fragments touch (from
  offset 0 to the last byte a fragment reads or writes) with `batch_register_memory`, on
  both sides, as the connectors register their KV caches;
- the target sends its segment names and region addresses over a loopback socket;
- one transfer unit per recorded plan (per request and pair) or per pair (`--unit`), each
  one Mooncake batch with one entry per fragment (source address, destination address,
  length); vLLM's connector makes one batch per remote rank of the requests it is asked to
  send together;
- `--api async` (default): a round submits every unit of every pair at once with
  `batch_transfer_async_write` (it returns a batch id as soon as the batch is handed to the
  transport), then waits for them with `get_batch_transfer_status(ids)`, which spins until
  every batch has completed — one posting and waiting thread per prefill rank (`--threads
  rank`, like kvferry's rank threads; the bindings release the GIL) or a single thread
  that submits everything and then waits engine by engine (`--threads one`; the wait spins
  without pause, so this leaves one spinning thread instead of one per rank). `--api sync`
  calls `batch_transfer_sync_write` per unit instead — what vLLM's connector does, one
  batch at a time per sending thread — so a thread's units run one after another.
- A round is timed from the first submission to the last completion (CLOCK_MONOTONIC).
  Mooncake's TCP transport completes a WRITE when the target has acknowledged that the
  payload is in destination memory (its protocol v2), so no notification round trip is
  needed — and the async batch API has none; the connectors send their "done" message
  outside Mooncake. Building the argument lists is done once, before the rounds (reported
  as `prep_s`); Mooncake has no per-round request-creation step outside the submit call.

Transport: this build (`mooncake-transfer-engine-non-cuda`) has TCP and RDMA (and RDMA
two-sided) transports only; its shared-memory transport belongs to the new engine (TENT),
which the wheel is not built with. So the `shm` workloads also run over Mooncake's TCP
transport (on 127.0.0.1), and the report says so. `MC_FORCE_TCP=1` is set so that the
engine installs the TCP transport even where RDMA devices exist (the `protocol` argument of
`initialize` does not choose the transport in this build; topology discovery does).

TCP connection reuse: by default Mooncake's TCP transport opens a fresh connection per
batch entry (per fragment). `--tcp-pool on` (default here) sets
`MC_TCP_ENABLE_CONNECTION_POOL=1`, Mooncake's documented fix for that: a fixed set of
long-lived connections ("lanes", `MC_TCP_LANES_PER_PEER`, default 4) per peer. The pool
admits at most `MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER` (default 1,024) entries plus as
many waiting ones (for at most a second) per peer and fails the rest, so the runner raises
the queue bound to fit the largest pair (up to Mooncake's maximum, 65,535). Without the
pool the 81,920 8 KiB Llama fragments took over a minute a round here (about 0.01 GB/s).

The source pools are filled with the deterministic pattern of nixl_bench.py (64-bit words
that encode rank, pool and offset), the destination with its sentinel; after the first
warm-up round the target checks every destination byte of every fragment against the
pattern, outside timing (the same functions, imported from nixl_bench.py).

Usage: mooncake_bench.py WORKLOAD.json [--warmup N] [--rounds N] [--unit plan|pair]
       [--api async|sync] [--threads rank|one] [--tcp-pool on|off] [--tcp-lanes N]
       [--no-verify] [--json]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import threading
import time

import numpy as np

# The pattern, its check and the socket plumbing are nixl_bench.py's (it imports only numpy
# and the standard library at module level; NIXL itself is imported inside its functions).
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nixl_bench import (  # noqa: E402
    SENTINEL,
    check_totals,
    extents,
    fill_pattern,
    load_fragments,
    now_ns,
    runner_arguments,
    recv_msg,
    send_msg,
    unit_spans,
    verify,
    with_target,
)

HOST = "127.0.0.1"
WHEEL = "mooncake-transfer-engine-non-cuda"
TRANSFER_TIMEOUT_S = 300
QUEUE_MAX = 65535  # Mooncake's bound on MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER


def log(*args) -> None:
    print("mooncake_bench:", *args, file=sys.stderr, flush=True)


def mooncake_version() -> str:
    from importlib.metadata import version

    return f"{WHEEL} {version(WHEEL)}"


def transport_used(workload_transport: str) -> str:
    """What Mooncake moves this workload's bytes with (see the module docstring)."""
    if workload_transport == "shm":
        return "tcp (no shm transport in this build)"
    return "tcp"


def make_engine():
    """An engine with Mooncake's TCP transport and P2P-handshake metadata; returns it and
    the segment name peers address it by."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("Mooncake TransferEngine.initialize failed")
    return engine, f"{HOST}:{engine.get_rpc_port()}"


def register(engine, bufs: list[np.ndarray]) -> list[int]:
    """Registers `bufs` with the engine in one call; returns their addresses."""
    addrs = [b.ctypes.data for b in bufs]
    if engine.batch_register_memory(addrs, [len(b) for b in bufs]) != 0:
        raise SystemExit("Mooncake batch_register_memory failed")
    return addrs


def pools_by_rank(sizes: dict[tuple[int, int], int]) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = {}
    for (rank, pool), size in sorted(sizes.items()):
        out.setdefault(rank, []).append((pool, size))
    return out


# ---------------------------------------------------------------- target


def run_target(doc: dict, port: int) -> None:
    pairs = doc["pairs"]
    sock = socket.create_connection(("127.0.0.1", port))
    engines = {}
    segments = {}
    bufs: dict[tuple[int, int], np.ndarray] = {}
    addrs: dict[tuple[int, int], int] = {}
    for g, pools in pools_by_rank(extents(pairs, "dst")).items():
        engines[g], segments[g] = make_engine()
        mine = []
        for pool, size in pools:
            buf = np.empty(size, dtype=np.uint8)
            buf.fill(SENTINEL)
            bufs[(g, pool)] = buf
            mine.append(buf)
        for (pool, _), addr in zip(pools, register(engines[g], mine)):
            addrs[(g, pool)] = addr
    send_msg(sock, {"segments": segments, "regions": addrs})
    # Mooncake's TCP transport writes into the registered regions from the engines' own
    # threads; this one only answers the initiator.
    while True:
        kind = recv_msg(sock)[0]
        if kind == "verify":
            send_msg(sock, ("verified", verify(pairs, bufs)))
        elif kind == "quit":
            send_msg(sock, ("bye",))
            sock.close()
            # Nothing is left to do; skip the engines' teardown (their threads and sockets).
            os._exit(0)


# ---------------------------------------------------------------- initiator


class Unit:
    """One Mooncake batch: some fragments of one pair, as the argument lists of a batch
    write (built once)."""

    def __init__(self, c: int, g: int, segment: str, src: np.ndarray, dst: np.ndarray,
                 lengths: np.ndarray):
        self.c, self.g, self.segment = c, g, segment
        self.src, self.dst, self.lengths = src.tolist(), dst.tolist(), lengths.tolist()
        self.fragments = len(self.src)
        self.nbytes = int(lengths.sum())


def post_and_wait(engines, group: list[Unit], api: str, gate, results, k) -> None:
    """Submits every unit of `group` (after all posting threads are ready) and waits for
    them; leaves (first submission, last submission returned, last completion) in
    `results[k]`, or an error text (with `--api sync` a submission returns when its batch
    is done)."""
    try:
        gate.wait()
        started = now_ns()
        if api == "sync":
            for u in group:
                rc = engines[u.c].batch_transfer_sync_write(u.segment, u.src, u.dst, u.lengths)
                if rc != 0:
                    results[k] = f"batch_transfer_sync_write ctx{u.c} -> gen{u.g} returned {rc}"
                    return
        else:
            ids: dict[int, list[int]] = {}
            for u in group:
                bid = engines[u.c].batch_transfer_async_write(
                    u.segment, u.src, u.dst, u.lengths
                )
                if bid == 0:
                    results[k] = f"batch_transfer_async_write ctx{u.c} -> gen{u.g} failed"
                    return
                ids.setdefault(u.c, []).append(bid)
            posted = now_ns()
            # Waits (spinning, GIL released) until every batch of the engine has completed.
            for c, batch_ids in ids.items():
                if engines[c].get_batch_transfer_status(batch_ids) != 0:
                    results[k] = f"a batch of ctx{c} failed or timed out"
                    return
            results[k] = (started, posted, now_ns())
            return
        done = now_ns()
        results[k] = (started, done, done)
    except Exception as e:  # reported by the main thread
        results[k] = f"posting thread {k}: {e!r}"


def run_initiator(doc: dict, args) -> dict:
    child_args = ["--tcp-pool", args.tcp_pool]
    child_args += ["--tcp-lanes", str(args.tcp_lanes)] if args.tcp_lanes else []
    return with_target(os.path.abspath(__file__), args.fragments, child_args,
                       lambda sock: drive(doc, doc["pairs"], sock, args))


def drive(doc: dict, pairs: list[dict], sock: socket.socket, args) -> dict:
    setup_start = time.monotonic()
    engines = {}
    bufs = {}
    src_addrs: dict[tuple[int, int], int] = {}
    for c, pools in pools_by_rank(extents(pairs, "src")).items():
        engines[c], _ = make_engine()
        mine = []
        for pool, size in pools:
            buf = np.empty(size, dtype=np.uint8)
            fill_pattern(buf, c, pool)
            bufs[(c, pool)] = buf
            mine.append(buf)
        for (pool, _), addr in zip(pools, register(engines[c], mine)):
            src_addrs[(c, pool)] = addr

    hello = recv_msg(sock)
    dst_addrs = hello["regions"]
    segments = hello["segments"]

    # The argument lists of every unit, once.
    prep_start = time.monotonic()
    units: list[Unit] = []
    for p in pairs:
        c, g = p["ctx_rank"], p["gen_rank"]
        f = np.asarray(p["fragments"], dtype=np.uint64).reshape(-1, 5)
        n = len(f)
        src_base = np.array([src_addrs.get((c, sp), 0) for sp in range(len(p["src_pools"]))],
                            dtype=np.uint64)
        dst_base = np.array([dst_addrs.get((g, dp), 0) for dp in range(len(p["dst_pools"]))],
                            dtype=np.uint64)
        src = src_base[f[:, 0].astype(np.int64)] + f[:, 1]
        dst = dst_base[f[:, 2].astype(np.int64)] + f[:, 3]
        lengths = f[:, 4]
        for a, b in unit_spans(p, args.unit):
            units.append(Unit(c, g, segments[g], src[a:b], dst[a:b], lengths[a:b]))
    prep_s = time.monotonic() - prep_start
    setup_s = time.monotonic() - setup_start
    total_bytes = sum(u.nbytes for u in units)
    total_fragments = sum(u.fragments for u in units)
    check_totals(doc, total_fragments, total_bytes)

    if args.threads == "rank":
        groups = [[u for u in units if u.c == c] for c in sorted(engines)]
    else:
        groups = [units]
    samples, posts = [], []
    verified = None
    for rnd in range(args.warmup + args.rounds):
        results: list = [None] * len(groups)
        gate = threading.Barrier(len(groups))
        workers = [
            threading.Thread(target=post_and_wait,
                             args=(engines, group, args.api, gate, results, k))
            for k, group in enumerate(groups)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        for r in results:
            if isinstance(r, str):
                raise SystemExit(f"round {rnd}: {r}")
        started = min(r[0] for r in results)
        posted = max(r[1] for r in results)
        finished = max(r[2] for r in results)
        seconds = (finished - started) / 1e9
        log(
            f"round {rnd}{' (warm-up)' if rnd < args.warmup else ''}: "
            f"{total_bytes / seconds / 1e9:.3f} GB/s, {seconds * 1e3:.1f} ms"
        )
        if rnd >= args.warmup:
            samples.append(seconds)
            posts.append((posted - started) / 1e9)
        if rnd == 0 and not args.no_verify:
            send_msg(sock, ("verify",))
            verified = recv_msg(sock)[1]

    def spread(xs):
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}

    gbps = [total_bytes / s / 1e9 for s in samples]
    return {
        "mooncake": mooncake_version(),
        "transport": transport_used(doc["transport"]),
        "workload_transport": doc["transport"],
        "descriptors": doc["planned_by"],
        "metadata": "P2PHANDSHAKE",
        "mc_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MC_")},
        "api": args.api,
        "unit": args.unit,
        "threads": args.threads,
        "tcp_pool": args.tcp_pool,
        "model": doc["model"],
        "prefill": doc["prefill"],
        "decode": doc["decode"],
        "pairs": len(pairs),
        "units": len(units),
        "engines": {"initiator": len(engines), "target": len(segments)},
        "fragments": total_fragments,
        "bytes": total_bytes,
        "mean_fragment_bytes": total_bytes / max(total_fragments, 1),
        "warmup": args.warmup,
        "rounds": args.rounds,
        "gbps": statistics.median(gbps),
        "gbps_spread": spread(gbps),
        "fragments_per_s": statistics.median([total_fragments / s for s in samples]),
        "rounds_gbps": gbps,
        "rounds_seconds": samples,
        # Per counted round: from the first submission to the last one returned (inside
        # rounds_seconds). Mooncake has no per-round preparation step (prep_s: once).
        "rounds_post_seconds": posts,
        "prep_s": prep_s,
        "setup_s": setup_s,
        "verified": (verified is not None and verified["mismatched_bytes"] == 0
                     and verified["bytes_checked"] == total_bytes),
        "verify": verified,
    }


def set_env(doc: dict, tcp_pool: str, tcp_lanes: int | None) -> None:
    """Mooncake's settings, before any engine exists (it reads them at initialisation)."""
    os.environ["MC_FORCE_TCP"] = "1"
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # INFO logs every completed batch
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(TRANSFER_TIMEOUT_S))
    if tcp_pool == "on":
        os.environ["MC_TCP_ENABLE_CONNECTION_POOL"] = "1"
        largest = max((len(p["fragments"]) for p in doc["pairs"]), default=1)
        os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] = str(
            min(QUEUE_MAX, max(1024, largest))
        )
        if tcp_lanes:
            os.environ["MC_TCP_LANES_PER_PEER"] = str(tcp_lanes)
    else:
        os.environ["MC_TCP_ENABLE_CONNECTION_POOL"] = "0"
        for k in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_LANES_PER_PEER"):
            os.environ.pop(k, None)


def main() -> int:
    ap = runner_arguments(__doc__, "Mooncake batch", "waiting")
    ap.add_argument("--api", choices=["async", "sync"], default="async",
                    help="async: batch_transfer_async_write for every unit, then "
                         "get_batch_transfer_status (default); sync: "
                         "batch_transfer_sync_write per unit, as vLLM's connector does")
    ap.add_argument("--tcp-pool", choices=["on", "off"], default="on",
                    help="on: Mooncake's TCP connection pool (long-lived connections per "
                         "peer; default); off: Mooncake's default, a connection per entry")
    ap.add_argument("--tcp-lanes", type=int, metavar="N",
                    help="connections per peer with the pool (MC_TCP_LANES_PER_PEER; "
                         "Mooncake's default 4)")
    args = ap.parse_args()
    if args.warmup < 1 or args.rounds < 1:
        ap.error("--warmup and --rounds must be at least 1")
    if args.tcp_lanes is not None and args.tcp_lanes < 1:
        ap.error("--tcp-lanes must be at least 1")

    doc = load_fragments(args.fragments)
    if doc.get("memory", "host") != "host":
        ap.error("only host-memory exports are supported (DRAM to DRAM)")
    set_env(doc, args.tcp_pool, args.tcp_lanes)

    if args.target is not None:
        run_target(doc, args.target)
        return 0
    report = run_initiator(doc, args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"Mooncake ({report['mooncake']}, {report['transport']}, {report['api']} batch "
            f"API, posting threads: {report['threads']}, one batch per {report['unit']}, "
            f"TCP connection pool {report['tcp_pool']}): {report['model']} "
            f"{report['prefill']} -> {report['decode']}, kvferry's "
            f"{report['workload_transport']} workload\n"
            f"  {report['fragments']} fragments, {report['bytes']} bytes per round in "
            f"{report['units']} batches over {report['pairs']} pairs\n"
            f"  {report['gbps']:.3f} GB/s median (min {report['gbps_spread']['min']:.3f}, max "
            f"{report['gbps_spread']['max']:.3f}); {report['fragments_per_s']:.0f} "
            f"fragments/s\n"
            f"  verified {'yes' if report['verified'] else 'NO'}: {report['verify']}"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    # The engines' teardown (transport threads, open connections) is not needed; everything
    # is reported, so leave without it, as nixl_bench.py does.
    os._exit(0 if report["verified"] or args.no_verify else 1)


if __name__ == "__main__":
    sys.exit(main())
