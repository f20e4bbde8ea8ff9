#!/usr/bin/env python3
"""Moves kvferry's plans of a `kvferry bench --export-workload` set with NIXL, and times it.

The descriptors come from kvferry's plan-only API: plans.py plans every request of the
workload with `kvferry.PairPlanner` (in a child process: kvferry's UCX and NIXL's stay in
different processes) and checks the plans against kvferry's own; a `--export-fragments`
file (the recorded fragments themselves) is read as it is.

Two processes on this machine, DRAM to DRAM, NIXL's UCX backend, used the way vLLM's
NixlConnector uses it:

- the *initiator* (this process; the prefill side) holds one NIXL agent per prefill rank,
  the *target* (a child process; the decode side) one per decode rank;
- every agent registers one region per pool of its rank that the fragments touch (the
  extent from offset 0 to the last byte a fragment reads or writes);
- the target sends its agents' metadata over a loopback socket; each initiator agent loads
  the metadata of the decode agents it writes to;
- per (prefill rank, decode rank) pair, `prep_xfer_dlist` is called once on each side
  (one descriptor per fragment), then for every round `make_prepped_xfer("WRITE", ...)` with
  the fragment indices of each transfer unit (one per recorded plan, i.e. per request and
  pair, as vLLM makes one per request and remote rank; or one per pair), with a
  notification;
- a round posts every unit of every pair at once — one thread per prefill rank posts its
  units and polls them, like kvferry's rank threads (NIXL's bindings release the GIL) — and
  ends when the last one is done and the target has seen every notification: timed from the
  first post to whichever comes last (CLOCK_MONOTONIC, comparable across the two
  processes). `make_prepped_xfer` runs before the clock and is reported separately.
- by default no NIXL progress thread runs: the polling above (`check_xfer_state`) and the
  target's `get_new_notifs` progress the workers. NIXL's progress thread (`--progress
  thread`) polls without pause, one per agent, which on a 2-core machine starves the
  transfers. The target pauses `--target-sleep-us` between polls.

The source pools are filled with a deterministic pattern (64-bit words that encode rank,
pool and offset), the destination with a sentinel; after the first warm-up round the target
checks every destination byte of every fragment against the pattern, outside timing.

`UCX_TLS` (and `UCX_NET_DEVICES`) are taken from the file, as kvferry's transport sets them.
NIXL's UCX backend is created with `ucx_error_handling_mode=none`, like kvferry's endpoints
(UCX's shared-memory transports cannot serve endpoints that ask for peer failure handling).

Usage: nixl_bench.py WORKLOAD.json [--warmup N] [--rounds N] [--unit plan|pair]
       [--progress poll|thread] [--threads rank|one] [--target-sleep-us US] [--no-verify]
       [--json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pickle
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SENTINEL = 0xA5
PAGE = 4096
NOTIF_TIMEOUT_S = 300.0


# ---------------------------------------------------------------- pattern


def seed(rank: int, pool: int) -> np.uint64:
    """The pattern's per (prefill rank, pool) offset."""
    return np.uint64((rank + 1) * 0x100000001B3 + (pool + 1) * 0x1000193 & (2**64 - 1))


def pattern(rank: int, pool: int, offset: int, length: int) -> np.ndarray:
    """Bytes `[offset, offset + length)` of source pool `pool` of prefill rank `rank`:
    word `w` of the pool (bytes `8w .. 8w+7`, little endian) is `w * GOLDEN + seed`."""
    first = offset // 8
    last = (offset + length + 7) // 8
    with np.errstate(over="ignore"):
        words = np.arange(first, last, dtype=np.uint64) * GOLDEN + seed(rank, pool)
    raw = words.astype("<u8", copy=False).view(np.uint8)
    skip = offset - first * 8
    return raw[skip : skip + length]


def fill_pattern(buf: np.ndarray, rank: int, pool: int, chunk: int = 64 << 20) -> None:
    """Writes the pattern over all of `buf` (a pool's extent), a chunk at a time."""
    for start in range(0, len(buf), chunk):
        n = min(chunk, len(buf) - start)
        buf[start : start + n] = pattern(rank, pool, start, n)


# ---------------------------------------------------------------- plumbing


def send_msg(sock: socket.socket, obj) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("<Q", len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(min(n - len(out), 1 << 20))
        if not got:
            raise ConnectionError("peer closed the connection")
        out += got
    return bytes(out)


def recv_msg(sock: socket.socket):
    (n,) = struct.unpack("<Q", recv_exact(sock, 8))
    return pickle.loads(recv_exact(sock, n))


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def log(*args) -> None:
    print("nixl_bench:", *args, file=sys.stderr, flush=True)


def extents(pairs: list[dict], side: str) -> dict[tuple[int, int], int]:
    """(rank, pool) -> bytes from offset 0 to the last byte a fragment touches, rounded up
    to a page and capped at the pool's size."""
    rank_key, pool_i, off_i, sizes_key = (
        ("ctx_rank", 0, 1, "src_pools") if side == "src" else ("gen_rank", 2, 3, "dst_pools")
    )
    out: dict[tuple[int, int], int] = {}
    for p in pairs:
        r = p[rank_key]
        for f in p["fragments"]:
            key = (r, f[pool_i])
            end = f[off_i] + f[4]
            if end > out.get(key, 0):
                out[key] = end
        for key in [k for k in out if k[0] == r]:
            size = p[sizes_key][key[1]]
            out[key] = min(size, -(-out[key] // PAGE) * PAGE)
    return out


def ucx_version() -> str:
    """The version string of the UCX that NIXL's wheel bundles (its own libucp)."""
    import ctypes

    import nixl_cu12

    libs = os.path.join(os.path.dirname(os.path.dirname(nixl_cu12.__file__)), "nixl_cu12.libs")
    found = sorted(glob.glob(os.path.join(libs, "libucp-*.so*")))
    if not found:
        return "unknown (no bundled libucp found)"
    lib = ctypes.CDLL(found[0])
    lib.ucp_get_version_string.restype = ctypes.c_char_p
    return lib.ucp_get_version_string().decode()


def nixl_version() -> str:
    from importlib.metadata import version

    return f"nixl-cu12 {version('nixl-cu12')}"


def make_agent(name: str, progress: str):
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(
        enable_prog_thread=(progress == "thread"), backends=[]
    )
    agent = nixl_agent(name, config)
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


def register(agent, buf: np.ndarray):
    """Registers `buf` with the agent's UCX backend; returns its address."""
    addr = buf.ctypes.data
    agent.register_memory([(addr, len(buf), 0, "")], "DRAM", backends=["UCX"])
    return addr


# ---------------------------------------------------------------- target


def run_target(doc: dict, port: int, progress: str, sleep_s: float) -> None:
    pairs = doc["pairs"]
    sock = socket.create_connection(("127.0.0.1", port))
    agents = {}
    bufs: dict[tuple[int, int], np.ndarray] = {}
    addrs: dict[tuple[int, int], int] = {}
    for (g, pool), size in sorted(extents(pairs, "dst").items()):
        if g not in agents:
            agents[g] = make_agent(f"gen{g}", progress)
        buf = np.empty(size, dtype=np.uint8)
        buf.fill(SENTINEL)
        bufs[(g, pool)] = buf
        addrs[(g, pool)] = register(agents[g], buf)
    send_msg(
        sock,
        {
            "metadata": {g: a.get_agent_metadata() for g, a in agents.items()},
            "regions": addrs,
        },
    )
    while True:
        msg = recv_msg(sock)
        kind = msg[0]
        if kind == "round":
            _, expected = msg
            wanted: dict[int, dict[str, set[bytes]]] = {}
            for g, sender, note in expected:
                wanted.setdefault(g, {}).setdefault(sender, set()).add(note)
            left = len(expected)
            send_msg(sock, ("ready",))
            last = 0
            deadline = time.monotonic() + NOTIF_TIMEOUT_S
            while left:
                if sleep_s:
                    time.sleep(sleep_s)
                for g, want in wanted.items():
                    for sender, notes in agents[g].get_new_notifs().items():
                        for note in notes:
                            if note in want.get(sender, ()):
                                want[sender].discard(note)
                                left -= 1
                                last = now_ns()
                if time.monotonic() > deadline:
                    send_msg(sock, ("failed", f"{left} notifications missing"))
                    break
            else:
                send_msg(sock, ("notified", last))
        elif kind == "verify":
            send_msg(sock, ("verified", verify(pairs, bufs)))
        elif kind == "quit":
            send_msg(sock, ("bye",))
            sock.close()
            # NIXL's teardown at interpreter exit has crashed here; nothing is left to do.
            os._exit(0)


def verify(pairs: list[dict], bufs: dict[tuple[int, int], np.ndarray]) -> dict:
    checked = mismatched = 0
    first = None
    for p in pairs:
        c, g = p["ctx_rank"], p["gen_rank"]
        for k, (sp, so, dp, do, n) in enumerate(p["fragments"]):
            got = bufs[(g, dp)][do : do + n]
            want = pattern(c, sp, so, n)
            checked += n
            if not np.array_equal(got, want):
                bad = int(np.count_nonzero(got != want))
                mismatched += bad
                if first is None:
                    first = f"pair {c}->{g} fragment {k}: {bad} of {n} bytes differ"
    return {"bytes_checked": checked, "mismatched_bytes": mismatched, "first": first}


# ---------------------------------------------------------------- initiator


class Unit:
    """One transfer request: some fragments of one pair."""

    def __init__(self, c: int, g: int, indices: np.ndarray, nbytes: int):
        self.c, self.g, self.indices, self.nbytes = c, g, indices, nbytes
        self.handle = None


def post_and_poll(agents, group, gate, results, k) -> None:
    """Posts every unit of `group` (after all posting threads are ready), then polls them
    until done; leaves (first post, last post returned, last completion) in `results[k]`,
    or an error text.
    NIXL's bindings release the GIL while posting and checking, so one such thread per
    prefill rank posts and progresses like one rank thread each."""
    try:
        gate.wait()
        started = now_ns()
        for u in group:
            if agents[u.c].transfer(u.handle, u.note) == "ERR":
                results[k] = f"NIXL refused to post ctx{u.c} -> gen{u.g}"
                return
        posted = now_ns()
        pending = list(group)
        deadline = time.monotonic() + NOTIF_TIMEOUT_S
        while pending:
            still = []
            for u in pending:
                state = agents[u.c].check_xfer_state(u.handle)
                if state == "ERR":
                    results[k] = f"NIXL transfer ctx{u.c} -> gen{u.g} failed"
                    return
                if state != "DONE":
                    still.append(u)
            pending = still
            if time.monotonic() > deadline:
                results[k] = f"{len(pending)} NIXL transfers not done in {NOTIF_TIMEOUT_S} s"
                return
        results[k] = (started, posted, now_ns())
    except Exception as e:  # reported by the main thread
        results[k] = f"posting thread {k}: {e!r}"


def unit_spans(pair: dict, unit: str) -> list[tuple[int, int]]:
    """The fragment index ranges of a pair's transfer units: one per recorded plan (per
    request and pair, as vLLM's connectors make them) or, with `unit == "pair"`, one."""
    n = len(pair["fragments"])
    if unit == "pair":
        return [(0, n)] if n else []
    spans, start = [], 0
    for count in pair["plans"]:
        if count:
            spans.append((start, start + count))
        start += count
    return spans


def check_totals(doc: dict, fragments: int, nbytes: int) -> None:
    """The units cover exactly the document's fragments and bytes."""
    if nbytes != doc["bytes"] or fragments != doc["fragments"]:
        raise SystemExit(
            f"fragment file totals ({doc['fragments']} fragments, {doc['bytes']} bytes) do "
            f"not match its pairs ({fragments}, {nbytes})"
        )


def with_target(script: str, workload: str, child_args: list[str], body):
    """Starts `script WORKLOAD --target PORT CHILD_ARGS...` (the target process), waits for
    it to connect back, returns `body(socket)`, then tells the target to quit and waits for
    it (killing it after 30 s)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, script, workload, "--target", str(port)] + child_args
    )
    listener.settimeout(120)
    sock, _ = listener.accept()
    sock.settimeout(None)
    try:
        return body(sock)
    finally:
        try:
            send_msg(sock, ("quit",))
            recv_msg(sock)
        except (OSError, ConnectionError):
            pass
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()


def run_initiator(doc: dict, args) -> dict:
    child_args = ["--progress", args.progress, "--target-sleep-us", str(args.target_sleep_us)]
    return with_target(os.path.abspath(__file__), args.fragments, child_args,
                       lambda sock: drive(doc, doc["pairs"], sock, args))


def drive(doc: dict, pairs: list[dict], sock: socket.socket, args) -> dict:
    setup_start = time.monotonic()
    agents = {}
    bufs = {}
    src_addrs = {}
    for (c, pool), size in sorted(extents(pairs, "src").items()):
        if c not in agents:
            agents[c] = make_agent(f"ctx{c}", args.progress)
        buf = np.empty(size, dtype=np.uint8)
        fill_pattern(buf, c, pool)
        bufs[(c, pool)] = buf
        src_addrs[(c, pool)] = register(agents[c], buf)

    hello = recv_msg(sock)
    dst_addrs = hello["regions"]
    loaded = set()
    for p in pairs:
        c, g = p["ctx_rank"], p["gen_rank"]
        if (c, g) not in loaded:
            name = agents[c].add_remote_agent(hello["metadata"][g])
            name = name.decode() if isinstance(name, bytes) else name
            assert name == f"gen{g}", name
            loaded.add((c, g))

    # Descriptor lists, once per pair and side.
    prep_start = time.monotonic()
    units: list[Unit] = []
    for p in pairs:
        c, g = p["ctx_rank"], p["gen_rank"]
        f = np.asarray(p["fragments"], dtype=np.uint64).reshape(-1, 5)
        n = len(f)
        # Region addresses per pool index (0 for pools no fragment touches).
        src_base = np.array([src_addrs.get((c, sp), 0) for sp in range(len(p["src_pools"]))],
                            dtype=np.uint64)
        dst_base = np.array([dst_addrs.get((g, dp), 0) for dp in range(len(p["dst_pools"]))],
                            dtype=np.uint64)
        local = np.zeros((n, 3), dtype=np.uint64)
        local[:, 0] = src_base[f[:, 0].astype(np.int64)] + f[:, 1]
        local[:, 1] = f[:, 4]
        remote = np.zeros((n, 3), dtype=np.uint64)
        remote[:, 0] = dst_base[f[:, 2].astype(np.int64)] + f[:, 3]
        remote[:, 1] = f[:, 4]
        lh = agents[c].prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM", backends=["UCX"])
        rh = agents[c].prep_xfer_dlist(f"gen{g}", remote, "DRAM", backends=["UCX"])
        lengths = f[:, 4]
        for a, b in unit_spans(p, args.unit):
            u = Unit(c, g, np.arange(a, b, dtype=np.int32), int(lengths[a:b].sum()))
            u.dlists = (lh, rh)
            units.append(u)
    prep_s = time.monotonic() - prep_start
    setup_s = time.monotonic() - setup_start
    total_bytes = sum(u.nbytes for u in units)
    total_fragments = sum(len(u.indices) for u in units)
    check_totals(doc, total_fragments, total_bytes)

    samples, makes, posts = [], [], []
    verified = None
    for rnd in range(args.warmup + args.rounds):
        t = time.monotonic()
        expected = []
        for k, u in enumerate(units):
            note = f"r{rnd}u{k}".encode()
            lh, rh = u.dlists
            u.handle = agents[u.c].make_prepped_xfer(
                "WRITE", lh, u.indices, rh, u.indices, notif_msg=note, backends=["UCX"]
            )
            u.note = note
            expected.append((u.g, f"ctx{u.c}", note))
        make_s = time.monotonic() - t
        send_msg(sock, ("round", expected))
        reply = recv_msg(sock)
        assert reply == ("ready",), reply

        if args.threads == "rank":
            groups = [[u for u in units if u.c == c] for c in sorted(agents)]
        else:
            groups = [units]
        results: list = [None] * len(groups)
        gate = threading.Barrier(len(groups))
        workers = [
            threading.Thread(target=post_and_poll, args=(agents, group, gate, results, k))
            for k, group in enumerate(groups)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        for r in results:
            if isinstance(r, str):
                raise SystemExit(r)
        started = min(r[0] for r in results)
        posted = max(r[1] for r in results)
        done = max(r[2] for r in results)
        reply = recv_msg(sock)
        if reply[0] != "notified":
            raise SystemExit(f"target: {reply[1]}")
        finished = max(done, reply[1])
        for u in units:
            u.handle.release()
            u.handle = None
        seconds = (finished - started) / 1e9
        log(
            f"round {rnd}{' (warm-up)' if rnd < args.warmup else ''}: "
            f"{total_bytes / seconds / 1e9:.3f} GB/s, {seconds * 1e3:.1f} ms "
            f"(completions {(done - started) / 1e6:.1f} ms, notifications "
            f"{(reply[1] - started) / 1e6:.1f} ms), make_prepped_xfer {make_s * 1e3:.1f} ms"
        )
        if rnd >= args.warmup:
            samples.append(seconds)
            makes.append(make_s)
            posts.append((posted - started) / 1e9)
        if rnd == 0 and not args.no_verify:
            send_msg(sock, ("verify",))
            verified = recv_msg(sock)[1]

    def spread(xs):
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}

    gbps = [total_bytes / s / 1e9 for s in samples]
    with_make = [total_bytes / (s + m) / 1e9 for s, m in zip(samples, makes)]
    return {
        "nixl": nixl_version(),
        "ucx": ucx_version(),
        "ucx_env": {k: os.environ[k] for k in ("UCX_TLS", "UCX_NET_DEVICES") if k in os.environ},
        "progress": args.progress,
        "unit": args.unit,
        "threads": args.threads,
        "target_sleep_us": args.target_sleep_us,
        "model": doc["model"],
        "prefill": doc["prefill"],
        "decode": doc["decode"],
        "transport": doc["transport"],
        "descriptors": doc["planned_by"],
        "pairs": len(pairs),
        "units": len(units),
        "agents": {"initiator": len(agents), "target": len({p["gen_rank"] for p in pairs})},
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
        # Per counted round: make_prepped_xfer of every unit (before the clock), and the
        # time from the first transfer() to the last one returned (inside it).
        "rounds_prepare_seconds": makes,
        "rounds_post_seconds": posts,
        "gbps_with_make": statistics.median(with_make),
        "make_prepped_xfer_ms": statistics.median(makes) * 1e3,
        "prep_xfer_dlist_s": prep_s,
        "setup_s": setup_s,
        "verified": (verified is not None and verified["mismatched_bytes"] == 0
                     and verified["bytes_checked"] == total_bytes),
        "verify": verified,
    }


def load_fragments(path: str) -> dict:
    """The fragments to move: a `kvferry bench --export-workload` file, planned with kvferry's
    plan-only API in a child process (plans.py: no UCX of kvferry's in this process), or a
    `--export-fragments` file as it is."""
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") == "kvferry-workload/1":
        import plans

        return plans.fetch(path)
    if doc.get("format") != "kvferry-fragments/1":
        raise SystemExit(f"{path}: neither a kvferry-workload/1 nor a kvferry-fragments/1 file")
    doc.setdefault("planned_by", "kvferry bench --export-fragments")
    return doc


def runner_arguments(doc: str, unit: str, waits: str) -> argparse.ArgumentParser:
    """The options both runners take: the workload, rounds, the transfer unit (`unit`: what
    one is called), posting threads (`waits`: what they do besides posting), the check,
    JSON, and the hidden --target PORT of the target process."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("fragments", metavar="WORKLOAD",
                    help="a kvferry bench --export-workload file (planned with "
                         "kvferry.PairPlanner) or --export-fragments file")
    ap.add_argument("--warmup", type=int, default=2, help="uncounted rounds first (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="counted rounds (default 5)")
    ap.add_argument("--unit", choices=["plan", "pair"], default="plan",
                    help=f"one {unit} per recorded plan (per request and pair, as vLLM's "
                         "connectors make them; default) or per pair")
    ap.add_argument("--threads", choices=["rank", "one"], default="rank",
                    help=f"rank: one posting and {waits} thread per prefill rank, like "
                         "kvferry's rank threads (default); one: a single thread for all")
    ap.add_argument("--no-verify", action="store_true", help="skip the byte check")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--target", type=int, metavar="PORT", help=argparse.SUPPRESS)
    return ap


def main() -> int:
    ap = runner_arguments(__doc__, "transfer request", "polling")
    ap.add_argument("--progress", choices=["poll", "thread"], default="poll",
                    help="poll: no NIXL progress thread, the runner's polling progresses "
                         "(default); thread: one NIXL progress thread per agent")
    ap.add_argument("--target-sleep-us", type=float, default=100.0, metavar="US",
                    help="the target's pause between notification polls (default 100), so "
                         "that on a small machine it leaves the cores to the transfer")
    args = ap.parse_args()
    if args.warmup < 1 or args.rounds < 1:
        ap.error("--warmup and --rounds must be at least 1")

    doc = load_fragments(args.fragments)
    if doc.get("memory", "host") != "host":
        ap.error("only host-memory exports are supported (DRAM to DRAM)")
    # Before NIXL (and its UCX) load: the transport kvferry used for these fragments.
    for k in ("UCX_TLS", "UCX_NET_DEVICES"):
        os.environ.pop(k, None)
    os.environ.update(doc["ucx_env"])
    # kvferry's shm list leaves cma out (its pools are UCX-allocated and written through a
    # shared mapping; UCX 1.22 would make each put a process_vm_writev). NIXL registers
    # plain user memory, which UCX can write one-sidedly within a node only through cma:
    # without it NIXL ran at half its rate on 1.1 MB fragments here. Give NIXL its best.
    tls = os.environ.get("UCX_TLS", "")
    if doc.get("transport") == "shm" and "cma" not in tls.split(","):
        os.environ["UCX_TLS"] = tls + ",cma" if tls else "cma"
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

    if args.target is not None:
        run_target(doc, args.target, args.progress, args.target_sleep_us / 1e6)
        return 0
    report = run_initiator(doc, args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"NIXL ({report['nixl']}, UCX {report['ucx']}, {report['progress']} progress, "
            f"posting threads: {report['threads']}, one request per {report['unit']}): "
            f"{report['model']} {report['prefill']} -> "
            f"{report['decode']} over {report['transport']}\n"
            f"  {report['fragments']} fragments, {report['bytes']} bytes per round in "
            f"{report['units']} requests over {report['pairs']} pairs\n"
            f"  {report['gbps']:.3f} GB/s median (min {report['gbps_spread']['min']:.3f}, max "
            f"{report['gbps_spread']['max']:.3f}); {report['fragments_per_s']:.0f} fragments/s; "
            f"{report['gbps_with_make']:.3f} GB/s counting make_prepped_xfer "
            f"({report['make_prepped_xfer_ms']:.1f} ms)\n"
            f"  verified {'yes' if report['verified'] else 'NO'}: {report['verify']}"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    # NIXL's teardown at interpreter exit has crashed (SIGSEGV) after successful runs;
    # everything is reported, so leave without it.
    os._exit(0 if report["verified"] else 1)


if __name__ == "__main__":
    sys.exit(main())
