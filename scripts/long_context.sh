#!/usr/bin/env bash
# Peak memory of a long causal self-attention through `mha forward`:
# a random (1, L, 512) float32 query (L = 32768 by default, 64 MiB), a
# module with E = 512, H = 8 from `mha init --seed 1`, --causal, timed by
# GNU time (/usr/bin/time -v).  Prints the peak resident set size in MiB
# and the wall time; fails if the peak is 1024 MiB or more, or if the
# output is not (1, L, 512) and finite.
#
#   scripts/long_context.sh [path/to/mha]       (default: build/mha)
#   LONG_CONTEXT_L=8192 scripts/long_context.sh build/mha
#   scripts/long_context.sh --backward [path/to/mha]
#
# --backward: `mha backward` instead (every gradient, from a random
# grad-output), L = 16384 by default, failing at 2048 MiB or more; the
# gradient of the query must be (1, L, 512) and finite.
#
# Installs nothing; needs a built mha, /usr/bin/time and python3-numpy.
# Threads are the defaults of `mha forward` (the OpenMP and OpenBLAS
# defaults: every online CPU) unless OMP_NUM_THREADS / OPENBLAS_NUM_THREADS
# say otherwise.  Scratch files go to a temporary directory under
# ${TMPDIR:-/tmp}, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
backward=0
if [ "${1:-}" = "--backward" ]; then backward=1; shift; fi
mha="${1:-build/mha}"
if [ $backward = 1 ]; then
  L="${LONG_CONTEXT_L:-16384}"; limit_mib=2048
else
  L="${LONG_CONTEXT_L:-32768}"; limit_mib=1024
fi
py=/usr/bin/python3

[ -x "$mha" ] || { echo "long_context: no executable '$mha'; build first" \
  "(cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build)" >&2
  exit 2; }
[ -x /usr/bin/time ] || { echo "long_context: /usr/bin/time (GNU time) is" \
  "missing" >&2; exit 2; }
"$py" -c "import numpy" 2>/dev/null || { echo "long_context: $py has no" \
  "numpy" >&2; exit 2; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/mha-long.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

"$mha" init --embed-dim 512 --heads 8 --seed 1 --out "$tmp/w.safetensors"
"$py" - "$tmp/q.npy" "$L" <<'EOF'
import sys
import numpy as np
rng = np.random.default_rng(1)
L = int(sys.argv[2])
np.save(sys.argv[1], rng.uniform(-1, 1, (1, L, 512)).astype(np.float32))
np.save(sys.argv[1].replace("q.npy", "dy.npy"),
        rng.uniform(-1, 1, (1, L, 512)).astype(np.float32))
EOF

cmd=forward
run=(--out "$tmp/o.npy")
if [ $backward = 1 ]; then
  cmd=backward
  run=(--grad-output "$tmp/dy.npy" --out "$tmp/g.safetensors")
fi
echo "mha $cmd: causal self-attention, B=1 L=$L E=512 H=8 ($(du -m "$tmp/q.npy" | cut -f1) MiB query)"
if ! /usr/bin/time -v -o "$tmp/time.txt" "$mha" $cmd \
    --weights "$tmp/w.safetensors" --heads 8 --query "$tmp/q.npy" --causal \
    "${run[@]}"; then
  echo "long_context: mha $cmd failed" >&2
  cat "$tmp/time.txt" >&2
  exit 1
fi

rss_kb=$(sed -n 's/^[[:space:]]*Maximum resident set size (kbytes): //p' "$tmp/time.txt")
wall=$(sed -n 's/^[[:space:]]*Elapsed (wall clock) time (h:mm:ss or m:ss): //p' "$tmp/time.txt")
user=$(sed -n 's/^[[:space:]]*User time (seconds): //p' "$tmp/time.txt")
[ -n "$rss_kb" ] || { echo "long_context: no peak RSS in GNU time's report" >&2; exit 1; }

"$py" - "$tmp" "$L" $backward <<'EOF'
import sys
import numpy as np
if sys.argv[3] == "1":
    sys.path.insert(0, "tests/torch_live")
    import st   # the spec-written safetensors reader of the live tests
    o = st.load(sys.argv[1] + "/g.safetensors")[0]["query"]
else:
    o = np.load(sys.argv[1] + "/o.npy")
want = (1, int(sys.argv[2]), 512)
if o.shape != want or o.dtype != np.float32 or not np.isfinite(o).all():
    sys.exit(f"long_context: output is {o.shape} {o.dtype}, finite: "
             f"{bool(np.isfinite(o).all())}; expected {want} float32, finite")
EOF

rss_mib=$(awk -v k="$rss_kb" 'BEGIN { printf "%.1f", k / 1024 }')
echo "peak RSS: $rss_mib MiB (limit < $limit_mib MiB)"
echo "wall time: $wall (user $user s)"
if [ "$rss_kb" -ge $((limit_mib * 1024)) ]; then
  echo "long_context: FAIL: peak RSS $rss_mib MiB >= $limit_mib MiB" >&2
  exit 1
fi
echo "long_context: OK"
