#!/usr/bin/env bash
# mpi_cli_test.sh MHA MPIEXEC -- `mpirun -np P mha forward --ring`: for
# P = 1..4, both splits, the ring and Ulysses (where the heads split), the
# output rank 0 writes equals the single-process `mha forward` within
# 1e-5 (1 + max |ref|) (the library's bounds are checked by test_mpi_ring;
# here a shard gathered to the wrong rows would be off by O(1)).  Refusals
# exit non-zero and leave no output file.  `mha backward --ring` writes
# the file one process writes.  `mha bench --ring` reports what it sent.
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
# mpirun -np P mha backward --ring: the file `mha backward` writes (every
# tensor by name and shape, within 1e-4 (1 + max |ref|), the suite's
# gradient bound), self-attention and a key of its own (the value too).
/usr/bin/python3 - <<'PY' || fail "numpy inputs"
import numpy as np
rng = np.random.default_rng(1)
np.save("k.npy", rng.standard_normal((2, 29, 24)).astype(np.float32))
np.save("dy.npy", rng.standard_normal((2, 29, 24)).astype(np.float32))
PY
for key in "" "--key k.npy"; do
  "$mha" backward --weights w.safetensors --query q.npy $key \
    --causal-top-left --key-lengths kl.npy --grad-output dy.npy \
    --out gref.safetensors || fail "single-process backward"
  for np in 1 3 4; do
    for mode in "--split zigzag" "--split contiguous" "--ulysses"; do
      [ "$mode" = "--ulysses" ] && [ $((4 % np)) -ne 0 -o $((2 % np)) -ne 0 ] &&
        continue
      rm -f g.safetensors
      run -np $np "$mha" backward --ring $mode --weights w.safetensors \
        --query q.npy $key --causal-top-left --key-lengths kl.npy \
        --grad-output dy.npy --out g.safetensors >/dev/null 2>&1 ||
        fail "backward np=$np $mode $key exited non-zero"
      /usr/bin/python3 - "backward np=$np $mode $key" <<'PY' || exit 1
import json, struct, sys
import numpy as np
def load(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    head.pop("__metadata__", None)
    out = {}
    for name, t in head.items():
        a, b = t["data_offsets"]
        assert t["dtype"] == "F32", t
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b],
                                  np.float32).reshape(t["shape"])
    return out
got, ref = load("g.safetensors"), load("gref.safetensors")
if sorted(got) != sorted(ref):
    print("FAIL: %s: tensors %s, expected %s" % (sys.argv[1], sorted(got),
                                                  sorted(ref)))
    sys.exit(1)
for name in ref:
    a, b = got[name], ref[name]
    err = float(np.abs(a - b).max()) if a.shape == b.shape else np.inf
    if not err <= 1e-4 * (1 + float(np.abs(b).max())):
        print("FAIL: %s: %s shape %s, error %g" % (sys.argv[1], name,
                                                   a.shape, err))
        sys.exit(1)
print("ok: %s: %d tensors" % (sys.argv[1], len(ref)))
PY
    done
  done
done
rm -f g.safetensors
/usr/bin/python3 -c 'import numpy as np; np.save("dy_bad.npy", np.zeros((2, 28, 24), np.float32))'
msg=$(run -np 2 "$mha" backward --ring --weights w.safetensors --query q.npy \
  --grad-output dy_bad.npy --out g.safetensors 2>&1) &&
  fail "a --grad-output of the wrong shape succeeded"
echo "$msg" | grep -q "must have the forward output's shape" ||
  fail "wrong --grad-output message: $msg"
[ -e g.safetensors ] && fail "a failed backward left g.safetensors"
# Each rank reads only its rows of the files (mha_npy_load_rows, tested
# in test_npy): a float64 and a Fortran-order copy of the query give the
# same output bits as the float32 C-order file.
/usr/bin/python3 - <<'PY' || fail "numpy inputs"
import numpy as np
q = np.load("q.npy")
np.save("q64.npy", q.astype(np.float64))
np.save("qf.npy", np.asfortranarray(q))
PY
run -np 3 "$mha" forward --ring --weights w.safetensors --query q.npy \
  --out o32.npy >/dev/null 2>&1 || fail "forward --ring, float32"
for qq in q64.npy qf.npy; do
  run -np 3 "$mha" forward --ring --weights w.safetensors --query $qq \
    --out o2.npy >/dev/null 2>&1 || fail "forward --ring, $qq"
  cmp -s o32.npy o2.npy || fail "forward --ring from $qq differs"
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
