#!/usr/bin/env python3
"""Summarises bench/modifiers.sh's JSON lines (stdin or a file): for each
modifier and kind of run, the median over rounds of its median time, and
the median and range over rounds of its cost against plain attention
measured in the same round (time / plain time - 1)."""
import json
import statistics
import sys
from collections import defaultdict

rows = [json.loads(l) for l in (open(sys.argv[1]) if len(sys.argv) > 1
                                else sys.stdin) if l.strip()]
by = defaultdict(dict)    # (what, mods) -> round -> ms
for r in rows:
    by[(r["what"], r["mods"])][r["round"]] = r["r"]["median_ms"]
print("| run | modifier | median ms (range) | cost vs plain, same round: median (range) |")
print("|---|---|---|---|")
for (what, mods), rounds in sorted(by.items()):
    ms = sorted(rounds.values())
    base = by.get((what, ""), {})
    line = "| %s | %s | %.1f (%.1f–%.1f) |" % (
        what, mods or "plain", statistics.median(ms), ms[0], ms[-1])
    if mods and base:
        if what == "L32768":
            rel = sorted(base[k] / v for k, v in rounds.items() if k in base)
            line += " %.1f× faster (%.1f–%.1f) |" % (
                statistics.median(rel), rel[0], rel[-1])
        else:
            rel = sorted(100.0 * (v / base[k] - 1.0)
                         for k, v in rounds.items() if k in base)
            line += " %+.1f%% (%+.1f … %+.1f) |" % (
                statistics.median(rel), rel[0], rel[-1])
    else:
        line += " |"
    print(line)
