#!/usr/bin/env bash
# mpi_cli_test.sh MHA MPIEXEC -- `mpirun -np P mha forward --ring`: for
# P = 1..4, both splits, the ring and Ulysses (where the heads split), the
# output rank 0 writes equals the single-process `mha forward` within
# 1e-5 (1 + max |ref|) (the library's bounds are checked by test_mpi_ring;
# here a shard gathered to the wrong rows would be off by O(1)).  Refusals
# exit non-zero and leave no output file.
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
echo "all ok"
