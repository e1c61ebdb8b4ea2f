#!/usr/bin/env bash
# mpi_cli_test.sh MHA MPIEXEC -- `mpirun -np P mha forward --ring`: for
# P = 1..4, both splits, the ring and Ulysses (where the heads split), the
# output rank 0 writes equals the single-process `mha forward` within
# 1e-5 (1 + max |ref|) (the library's bounds are checked by test_mpi_ring;
# here a shard gathered to the wrong rows would be off by O(1)).  Refusals
# exit non-zero and leave no output file.  `mha bench --ring` reports
# what it sent.
set -u
mha=$1 mpiexec=$2
run() { "$mpiexec" --allow-run-as-root --oversubscribe "$@"; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
"$mha" init --embed-dim 24 --heads 4 --kv-heads 2 --seed 3 --out w.safetensors ||
  fail "mha init"
/usr/bin/python3 - <<'PY' || fail "numpy inputs"
import numpy as np
rng = np.random.default_rng(0)
np.save("q.npy", rng.standard_normal((2, 29, 24)).astype(np.float32))
np.save("kl.npy", np.array([29, 11], dtype=np.int64))
PY
for causal in "" "--causal-top-left"; do
  "$mha" forward --weights w.safetensors --query q.npy $causal \
    --key-lengths kl.npy --out ref.npy || fail "single-process forward"
  for np in 1 2 3 4; do
    for mode in "--split contiguous" "--split zigzag" "--ulysses"; do
      [ "$mode" = "--ulysses" ] && [ $((4 % np)) -ne 0 -o $((2 % np)) -ne 0 ] &&
        continue
      rm -f out.npy
      run -np $np "$mha" forward --ring $mode --weights w.safetensors \
        --query q.npy $causal --key-lengths kl.npy --out out.npy \
        >/dev/null 2>&1 || fail "np=$np $mode $causal exited non-zero"
      /usr/bin/python3 - "$np $mode $causal" <<'PY' || exit 1
import sys
import numpy as np
a, b = np.load("out.npy"), np.load("ref.npy")
err = float(np.abs(a - b).max())
if a.shape != b.shape or not err <= 1e-5 * (1 + float(np.abs(b).max())):
    print("FAIL: %s: shape %s, error %g" % (sys.argv[1], a.shape, err))
    sys.exit(1)
print("ok: %s: error %g" % (sys.argv[1], err))
PY
    done
  done
done
# Refusals: every rank fails, nothing is written.
rm -f out.npy
msg=$(run -np 3 "$mha" forward --ring --ulysses --weights w.safetensors \
  --query q.npy --out out.npy 2>&1) && fail "Ulysses with 4 heads on 3 ranks succeeded"
echo "$msg" | grep -q "multiples of the rank count 3" ||
  fail "Ulysses refusal message: $msg"
[ -e out.npy ] && fail "a refused run left out.npy"
msg=$(run -np 2 "$mha" forward --ring --weights w.safetensors \
  --query missing.npy --out out.npy 2>&1) && fail "a missing --query succeeded"
echo "$msg" | grep -q "missing.npy" || fail "missing query message: $msg"
[ -e out.npy ] && fail "a failed run left out.npy"
# mha bench --ring: its report, and the bytes it says each rank sent: one
# block of K and V of 128 tokens x 32 floats forward (P = 2, contiguous);
# with --backward also the block again and two dK/dV blocks.
out=$(run -np 2 "$mha" bench --ring --seq 256 --embed-dim 32 --heads 4 \
  --repeat 2 --warmup 0 2>&1) || fail "bench --ring: $out"
echo "$out" | grep -q "bytes sent per rank per call: 32768 .. 32768" ||
  fail "bench --ring bytes: $out"
echo "$out" | grep -q "share hidden" || fail "bench --ring report: $out"
out=$(run -np 2 "$mha" bench --ring --backward --seq 256 --embed-dim 32 \
  --heads 4 --repeat 2 --warmup 0 2>&1) || fail "bench --ring --backward: $out"
echo "$out" | grep -q "bytes sent per rank per call: 131072 .. 131072" ||
  fail "bench --ring --backward bytes: $out"
out=$(run -np 2 "$mha" bench --ring --ulysses --causal --seq 256 \
  --embed-dim 32 --heads 4 --repeat 2 --warmup 0 2>&1) ||
  fail "bench --ring --ulysses: $out"
echo "$out" | grep -q "^ulysses forward, P=2" || fail "bench --ulysses: $out"
# --check: sampled rows against a float64 attention of the regenerated
# inputs (zig-zag, GQA, batch 2, a length no rank count divides), with
# ring and Ulysses; a wrong output makes it say FAILED and exit non-zero
# (docs/TESTING.md, mutation testing).
for extra in "" "--ulysses" "--backward"; do
  out=$(run -np 3 "$mha" bench --ring $extra --causal --seq 301 \
    --embed-dim 48 --heads 6 --kv-heads 3 --batch 2 --check 9 --repeat 1 \
    --warmup 0 2>&1) || fail "bench --ring $extra --check: $out"
  echo "$out" | grep -q "check of 9 rows x 2 batch x 6 heads vs float64: .*: ok" ||
    fail "bench --ring $extra --check report: $out"
done
msg=$(run -np 2 "$mha" bench --ring --seq 64 --embed-dim 4096 --heads 2 \
  --check 2 2>&1) && fail "--check with head width 2048 succeeded"
echo "$msg" | grep -q "head width 2048 > 1024" || fail "--check refusal: $msg"
echo "all ok"
