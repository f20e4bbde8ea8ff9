#!/usr/bin/env python3
"""Draws a `scripts/bench-peers --per-request` sitting: one panel per model and transport,
the time of one request (microseconds, log scale) against its prompt length (tokens, log
scale) for kvferry, its bare put loop, the memcpy ceiling, NIXL and Mooncake — the same
numbers table.py prints (medians over the passes).

A `--sweep` sitting: one panel per transport and fragment size, GB/s (log scale) against
the batch (fragments per request, log scale) for the same five.

Usage: plot.py RUN_DIR OUT.png

Needs matplotlib (scripts/bench-peers installs it into its virtual environment).
"""

import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import table  # noqa: E402

SERIES = (
    ("kvferry_us", "kvferry", "tab:blue", "o", "-"),
    ("raw_us", "raw put loop", "tab:blue", "", ":"),
    ("memcpy_us", "memcpy (ceiling)", "tab:gray", "", "--"),
    ("nixl_us", "NIXL", "tab:orange", "s", "-"),
    ("mooncake_us", "Mooncake", "tab:green", "^", "-"),
)


# The grid's panels plot the same five, by their GB/s.
GRID_SERIES = tuple((key.replace("_us", "_gbps"), *style) for key, *style in SERIES)


def draw_sweep(plt, meta, rows):
    from matplotlib import ticker

    _, cells = table.sweep_table(rows)
    transports = sorted({c["transport"] for c in cells})
    sizes = sorted({c["fragment_bytes"] for c in cells})
    fig, axes = plt.subplots(len(transports), len(sizes), squeeze=False, sharey=True,
                             figsize=(3.1 * len(sizes), 3.0 * len(transports)))
    for i, transport in enumerate(transports):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            here = sorted((c for c in cells if c["transport"] == transport
                           and c["fragment_bytes"] == size), key=lambda c: c["batch"])
            for key, label, color, marker, style in GRID_SERIES:
                xs = [c["batch"] for c in here if c[key]]
                ys = [c[key]["median"] for c in here if c[key]]
                if xs:
                    ax.plot(xs, ys, label=label, color=color, marker=marker, linestyle=style,
                            markersize=4)
            ax.set_xscale("log", base=4)
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
            ax.set_yscale("log")
            ax.set_title(f"{table.human(size)} fragments, {transport}", fontsize=9)
            ax.set_xlabel("batch (fragments per request)", fontsize=8)
            if j == 0:
                ax.set_ylabel("GB/s", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"kvferry {meta['kvferry_commit']}, {meta['started'][:10]}, {meta['host']}: "
                 "nixlbench's grid, one request at a time (tp1 -> tp1)", fontsize=10)
    fig.tight_layout()
    return fig


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: plot.py RUN_DIR OUT.png", file=sys.stderr)
        return 2
    run_dir, out = sys.argv[1:]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = table.load(os.path.join(run_dir, "meta.json"))
    with open(os.path.join(run_dir, "runs.jsonl")) as f:
        runs = [table.json.loads(line) for line in f if line.strip()]
    rows = [table.row_of(run_dir, r) for r in runs]
    if meta.get("sweep"):
        draw_sweep(plt, meta, rows).savefig(out, dpi=110)
        print(out)
        return 0
    _, _, points = table.per_request(meta, rows)
    panels = sorted({(p["model"], p["prefill"], p["decode"], p["transport"]) for p in points})
    models = sorted({p[:3] for p in panels})
    transports = sorted({p[3] for p in panels})
    fig, axes = plt.subplots(len(models), len(transports), squeeze=False,
                             figsize=(5.2 * len(transports), 3.8 * len(models)))
    for i, model in enumerate(models):
        for j, transport in enumerate(transports):
            ax = axes[i][j]
            here = sorted((p for p in points if p["model"] == model[0]
                           and p["prefill"] == model[1] and p["transport"] == transport),
                          key=lambda p: p["tokens"])
            for key, label, color, marker, style in SERIES:
                xs = [p["tokens"] for p in here if p[key]]
                ys = [p[key]["median"] for p in here if p[key]]
                if xs:
                    ax.plot(xs, ys, label=label, color=color, marker=marker, linestyle=style)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{model[0]} {model[1]} -> {model[2]}, {transport}", fontsize=10)
            ax.set_xlabel("prompt tokens (one request)")
            ax.set_ylabel("time per request (us)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"kvferry {meta['kvferry_commit']}, {meta['started'][:10]}, {meta['host']}: "
                 "one request at a time", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
