#!/usr/bin/env python3
"""Plots a `kvbm-bench replay` results file: TTFT p50/p90 per setting (log scale) and, under it,
where the workers found the prompt tokens (computed, GPU, host, disk), stacked. With `--repeat`,
each setting's bars are its medians over the rounds, the p90 bar's whisker its lowest and highest
round, and the tiers the rounds' mean.

    scripts/plot-replay.py results.json out.png

Headless (matplotlib's Agg back end); needs matplotlib (pip install matplotlib).
"""

import json
import math
import statistics
import sys


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def by_label(runs):
    """Runs grouped by setting, in the order the settings first ran."""
    groups = {}
    for r in runs:
        groups.setdefault(r["label"], []).append(r)
    return list(groups.items())


def median_of(group, section, key):
    values = [(r.get(section) or {}).get(key) for r in group]
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(values) if values else None


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    src, dst = argv[1], argv[2]
    with open(src) as f:
        doc = json.load(f)
    runs = [r for r in doc.get("runs", []) if not r.get("failed")]
    if not runs:
        print(f"{src}: no completed run to plot", file=sys.stderr)
        return 1

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_label(runs)
    labels = [label for label, _ in groups]
    xs = range(len(groups))
    width = 0.38
    rounds = max(len(g) for _, g in groups)
    fig, (ax_t, ax_r) = plt.subplots(
        2, 1, figsize=(max(6.0, 1.1 * len(groups) + 2), 7.5), sharex=True,
        gridspec_kw={"height_ratios": [3, 2]},
    )

    for offset, key, color in ((-width / 2, "p50", "#4c72b0"), (width / 2, "p90", "#dd8452")):
        values = [median_of(g, "ttft_s", key) for _, g in groups]
        heights = [v if finite(v) else 0.0 for v in values]
        label = f"TTFT {key}" + (f" (median of {rounds})" if rounds > 1 else "")
        bars = ax_t.bar([x + offset for x in xs], heights, width, label=label, color=color)
        if key == "p90" and rounds > 1:
            for x, (_, g), v in zip(xs, groups, values):
                each = [(r.get("ttft_s") or {}).get("p90") for r in g]
                each = [e for e in each if finite(e)]
                if finite(v) and len(each) > 1:
                    ax_t.errorbar([x + offset], [v], yerr=[[v - min(each)], [max(each) - v]],
                                  fmt="none", ecolor="#333333", capsize=3, linewidth=1)
        for bar, v in zip(bars, values):
            if finite(v):
                ax_t.annotate(f"{v:.2g}", (bar.get_x() + bar.get_width() / 2, v),
                              ha="left" if key == "p90" and rounds > 1 else "center",
                              va="bottom", fontsize=7)
    if any(finite(median_of(g, "ttft_s", "p50")) for _, g in groups):
        ax_t.set_yscale("log")
    ax_t.set_ylabel("TTFT (simulated s)")
    trace = doc.get("trace", {})
    ax_t.set_title(
        f"{trace.get('requests', '?')} requests of {trace.get('path', '?').split('/')[-1]}, "
        f"{doc.get('workers', '?')} workers, load {doc.get('load', '?')}"
    )
    ax_t.legend(fontsize=8)
    ax_t.grid(axis="y", which="both", alpha=0.3)

    bottom = [0.0] * len(groups)
    for tier, color in (("gpu", "#55a868"), ("host", "#8172b2"), ("disk", "#937860"),
                        ("computed", "#c8c8c8")):
        heights = []
        for _, g in groups:
            values = [(r.get("reuse") or {}).get(tier) for r in g]
            values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
            heights.append(100.0 * statistics.fmean(values) if values else 0.0)
        ax_r.bar(list(xs), heights, 0.6, bottom=bottom, label=tier, color=color)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax_r.set_ylabel("prompt tokens (%)")
    ax_r.set_ylim(0, 100)
    ax_r.legend(fontsize=8, ncol=4, loc="lower right")
    ax_r.set_xticks(list(xs))
    ax_r.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)

    fig.tight_layout()
    fig.savefig(dst, dpi=120)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
