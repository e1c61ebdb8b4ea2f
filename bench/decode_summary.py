#!/usr/bin/env python3
"""Summarises bench/decode.sh's JSON lines (stdin or a file).

For each case and binary: the median over rounds of the step's median
time and its range, the median (range) of read %, the cache bytes read
per second against the read bandwidth that the same run measured, and of
paired roofline %, the share of the roofline that the run's paired steps
reached, each against the read passes just around it (`mha bench
--help`): on a machine whose bandwidth drifts, the figure to judge by.  With
several binaries, the median (range) over rounds of the first binary's
time over each other's, case by case in the same round (> 1: the other is
faster).  For the cases of BOUND=1, cached elements (K and V, each K/V
head once) per nanosecond in the L3 against from memory: near 1, the step
is bound by its arithmetic; near the ratio of the two bandwidths, by
memory.  Last, the read probe's median and range over all runs.
"""
import json
import statistics
import sys
from collections import defaultdict


def med_range(xs, fmt):
    xs = sorted(xs)
    return (fmt + " (" + fmt + "–" + fmt + ")") % (
        statistics.median(xs), xs[0], xs[-1])


rows = [json.loads(l) for l in (open(sys.argv[1]) if len(sys.argv) > 1
                                else sys.stdin) if l.strip()]
bins = list(dict.fromkeys(r["mha"] for r in rows))
cases = list(dict.fromkeys(r["case"] for r in rows))
by = defaultdict(dict)    # (case, mha) -> round -> run
for r in rows:
    by[(r["case"], r["mha"])][r["round"]] = r["r"]

ratio = len(bins) > 1
print("| case | mha | ms | read % | paired roofline % |" +
      (" %s's time / this one's |" % bins[0] if ratio else ""))
print("|---|---|---|---|---|" + ("---|" if ratio else ""))
for c in cases:
    for b in bins:
        runs = by[(c, b)]
        line = "| %s | %s | %s | %s | %s |" % (
            c, b, med_range([x["median_ms"] for x in runs.values()], "%.2f"),
            med_range([x["read_percent"] for x in runs.values()], "%.0f"),
            med_range([x["paired_roofline_percent"] for x in runs.values()],
                      "%.0f"))
        if ratio:
            first = by[(c, bins[0])]
            rel = [first[k]["median_ms"] / x["median_ms"]
                   for k, x in runs.items() if k in first]
            line += " %s |" % (med_range(rel, "%.3f")
                               if rel and b != bins[0] else "")
        print(line)


def elems_per_ns(run):
    n = run["kv_keys"] * run["kv_heads"] * run["head_dim"] * 2
    return n / (run["median_ms"] * 1e6)


pairs = [(c, c[3:]) for c in cases if c.startswith("L3 ") and c[3:] in cases]
if pairs:
    print()
    print("| step | mha | elements/ns in L3 | from memory | memory / L3 |")
    print("|---|---|---|---|---|")
    for l3, mem in pairs:
        for b in bins:
            a = [elems_per_ns(x) for x in by[(l3, b)].values()]
            m = [elems_per_ns(x) for x in by[(mem, b)].values()]
            print("| %s | %s | %s | %s | %.2f |" % (
                mem, b, med_range(a, "%.2f"), med_range(m, "%.2f"),
                statistics.median(m) / statistics.median(a)))

probes = [r["r"]["read_gbps"] for r in rows]
print()
print("read probe: %s GB/s over %d runs" % (med_range(probes, "%.1f"),
                                           len(probes)))
