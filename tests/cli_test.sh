#!/usr/bin/env bash
# Tests of the `mha` command: exit codes, messages, and `mha example`
# checked against NumPy (tests/check_example.py); `mha init`, `mha info`,
# `mha forward` and `mha backward`: each subcommand, each flag, each error
# path, and that a failing `mha forward` or `mha backward` leaves no output
# file (nor a temporary one) behind; `mha decode` (= forward --causal, for
# every chunking, plain and grouped-query); `mha init --kv-heads` and what
# `mha info` says of it; `mha bench`, with --backward and --decode
# (--attention-only, --ragged); `mha viz` (tests/check_viz.py, and its
# errors); --head-mask (its gradient against an exact difference) and
# `mha prune` (pruned == ablated); RoPE and the score modifiers' flags and
# their metadata round trip, and --rope against NumPy's float64 HF RoPE.
# Inputs are made by `mha init` and by NumPy (Debian's /usr/bin/python3).
set -u
mha="$1"; here="$(cd "$(dirname "$0")" && pwd)"
fails=0; passes=0
ok()   { passes=$((passes + 1)); }
bad()  { echo "FAIL: $*"; fails=$((fails + 1)); }

expect() {  # expect STATUS PATTERN -- command...
  local want="$1" pat="$2"; shift 3
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [ "$rc" -ne "$want" ]; then bad "$* exited $rc, expected $want: $out"; return; fi
  if ! grep -qE -- "$pat" <<<"$out"; then bad "$*: output lacks /$pat/: $out"; return; fi
  ok
}

expect 0 "^mha [0-9]+\.[0-9]+\.[0-9]+$" -- "$mha" --version
expect 0 "usage: mha" -- "$mha" --help
expect 0 "usage: mha example" -- "$mha" example --help
expect 2 "unknown command 'frobnicate'" -- "$mha" frobnicate
expect 2 "usage: mha" -- "$mha"
expect 1 "unexpected argument 'extra'" -- "$mha" example extra

if /usr/bin/python3 -c "import numpy" 2>/dev/null; then
  if /usr/bin/python3 "$here/check_example.py" "$mha"; then ok
  else bad "mha example disagrees with NumPy"; fi
else
  bad "python3-numpy is missing (scripts/install-deps.sh installs it)"
fi

# ---- mha init, mha info, mha forward ----------------------------------------
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
py=/usr/bin/python3

same()   { if cmp -s "$1" "$2"; then ok; else bad "$3: $1 and $2 differ"; fi; }
differ() { if cmp -s "$1" "$2"; then bad "$3: $1 and $2 are identical"; else ok; fi; }
absent() {  # absent WHAT PATH...: none of the paths exists
  local what="$1" p; shift
  for p in "$@"; do
    if [ -e "$p" ]; then bad "$what: $p exists"; return; fi
  done
  ok
}

# --help, and the usage line of each subcommand
for c in forward backward init info; do
  expect 0 "^usage: mha $c" -- "$mha" "$c" --help
  expect 0 "^usage: mha $c" -- "$mha" "$c" -h
done
expect 0 "^  --kv-heads Hkv +grouped-query attention" -- "$mha" init --help
expect 0 "forward .*init .*info|forward" -- "$mha" --help

# mha init: what it writes, and what info says of it
W="$tmp/w.safetensors"
expect 0 "" -- "$mha" init --embed-dim 8 --heads 2 --seed 1 --out "$W"
expect 0 "^module: embed_dim=8 num_heads=2 num_kv_heads=2 head_dim=4 v_head_dim=4 kdim=8 vdim=8 bias=true add_bias_kv=false add_zero_attn=false dropout=0 scale=0\.5$" \
  -- "$mha" info "$W"
expect 0 "^$W: 4 tensors$" -- "$mha" info "$W"
expect 0 "^  in_proj_weight +F32 +\(24, 8\)$" -- "$mha" info "$W"
expect 0 "^  out_proj\.bias +F32 +\(8\)$" -- "$mha" info "$W"
expect 0 "^  num_heads = 2$" -- "$mha" info "$W"
# --heads that the file's num_heads contradicts is refused, not preferred
expect 1 "num_heads 4 was given but __metadata__ says num_heads 2" -- "$mha" info --heads 4 "$W"
expect 0 "num_heads=2 num_kv_heads=2 head_dim=4" -- "$mha" info --heads 2 "$W"
Wkv="$tmp/wkv.safetensors"
expect 0 "" -- "$mha" init --embed-dim=8 --heads 2 --kdim 5 --vdim 7 --no-bias \
  --add-bias-kv --add-zero-attn --dropout 0.25 --scale 0.3 --seed 2 --out "$Wkv"
expect 0 "^module: embed_dim=8 num_heads=2 num_kv_heads=2 head_dim=4 v_head_dim=4 kdim=5 vdim=7 bias=false add_bias_kv=true add_zero_attn=true dropout=0\.25 scale=0\.3$" \
  -- "$mha" info "$Wkv"
expect 0 "^  k_proj_weight +F32 +\(8, 5\)$" -- "$mha" info "$Wkv"
expect 0 "^  v_proj_weight +F32 +\(8, 7\)$" -- "$mha" info "$Wkv"
expect 0 "^  bias_k +F32 +\(1, 1, 8\)$" -- "$mha" info "$Wkv"
if "$mha" info "$Wkv" | grep -qE "in_proj_bias|out_proj\.bias|in_proj_weight"; then
  bad "init --no-bias --kdim: info lists in_proj_* or out_proj.bias"
else ok; fi
Wbkv="$tmp/wbkv.safetensors"
expect 0 "" -- "$mha" init --embed-dim 8 --heads 2 --add-bias-kv --add-zero-attn \
  --seed 3 --out "$Wbkv"
expect 0 "" -- "$mha" init --embed-dim 8 --heads 2 --seed 1 --out "$tmp/w_again.safetensors"
same "$W" "$tmp/w_again.safetensors" "init with the same seed"
expect 0 "" -- "$mha" init --embed-dim 8 --heads 2 --seed 9 --out "$tmp/w9.safetensors"
differ "$W" "$tmp/w9.safetensors" "init with another seed"
expect 0 "" -- "$mha" init --embed-dim 8 --heads 2 --seed 18446744073709551615 --out "$tmp/wmax.safetensors"
expect 0 "" -- "$mha" init --embed-dim 8 --heads 2 --seed 9223372036854775807 --out "$tmp/wmax63.safetensors"
differ "$tmp/wmax.safetensors" "$tmp/wmax63.safetensors" "init --seed 2^64-1 vs 2^63-1"
# mha init --kv-heads: a grouped-query module (H = 4 query heads of d_h = 4
# sharing 2 K/V heads): W_k and W_v have 2 * 4 rows, apart from W_q, and
# num_kv_heads is in the metadata; info reports the resolved H_kv of every
# module (above: 2 = H for W and Wkv).
Wg="$tmp/wg.safetensors"
expect 0 "" -- "$mha" init --embed-dim 16 --heads 4 --kv-heads 2 --seed 5 --out "$Wg"
expect 0 "^module: embed_dim=16 num_heads=4 num_kv_heads=2 head_dim=4 v_head_dim=4 kdim=16 vdim=16 bias=true " \
  -- "$mha" info "$Wg"
expect 0 "^  num_kv_heads = 2$" -- "$mha" info "$Wg"
expect 0 "^  q_proj_weight +F32 +\(16, 16\)$" -- "$mha" info "$Wg"
expect 0 "^  k_proj_weight +F32 +\(8, 16\)$" -- "$mha" info "$Wg"
expect 0 "^  v_proj_weight +F32 +\(8, 16\)$" -- "$mha" info "$Wg"
expect 0 "^  in_proj_bias +F32 +\(32\)$" -- "$mha" info "$Wg"
expect 0 "" -- "$mha" init --embed-dim 16 --heads 4 --kv-heads 1 --add-bias-kv --seed 5 \
  --out "$tmp/wmq.safetensors"
expect 0 "^module: embed_dim=16 num_heads=4 num_kv_heads=1 head_dim=4 .*add_bias_kv=true" \
  -- "$mha" info "$tmp/wmq.safetensors"
expect 0 "^  bias_k +F32 +\(1, 1, 4\)$" -- "$mha" info "$tmp/wmq.safetensors"
# --kv-heads H is ordinary multi-head attention: the same file as without it.
expect 0 "" -- "$mha" init --embed-dim 8 --heads 2 --kv-heads 2 --seed 1 --out "$tmp/w_kv2.safetensors"
same "$W" "$tmp/w_kv2.safetensors" "init --kv-heads H"
if "$mha" info "$W" | grep -q "^  num_kv_heads = "; then
  bad "init without --kv-heads: num_kv_heads in the metadata"
else ok; fi

# mha init: errors (and nothing written)
I="$tmp/init_fail.safetensors"
init_fail() {  # init_fail PATTERN ARGS...
  local pat="$1"; shift
  expect 1 "$pat" -- "$mha" init "$@"
  absent "init $*" "$I"
}
init_fail "^mha init: --embed-dim is required" --heads 2 --seed 1 --out "$I"
init_fail "^mha init: --heads is required" --embed-dim 8 --seed 1 --out "$I"
init_fail "^mha init: --seed is required" --embed-dim 8 --heads 2 --out "$I"
expect 1 "^mha init: --out is required" -- "$mha" init --embed-dim 8 --heads 2 --seed 1
init_fail "^mha init: unknown option '--bogus'" --embed-dim 8 --heads 2 --seed 1 --bogus --out "$I"
init_fail "^mha init: option --heads given twice" --embed-dim 8 --heads 2 --heads 2 --seed 1 --out "$I"
init_fail "^mha init: --heads must be an integer .*got 'abc'" --embed-dim 8 --heads abc --seed 1 --out "$I"
init_fail "^mha init: --heads must be an integer .*got '0'" --embed-dim 8 --heads 0 --seed 1 --out "$I"
init_fail "^mha init: --scale 1e-46 rounds to 0 in float32" --embed-dim 8 --heads 2 --seed 1 --scale 1e-46 --out "$I"
init_fail "^mha init: --scale must be nonzero" --embed-dim 8 --heads 2 --seed 1 --scale 0 --out "$I"
init_fail "^mha init: --embed-dim must be an integer .*got '8x'" --embed-dim 8x --heads 2 --seed 1 --out "$I"
init_fail "^mha init: --kdim must be an integer .*got '-5'" --embed-dim 8 --heads 2 --kdim -5 --seed 1 --out "$I"
init_fail "^mha init: --seed must be an integer in \[0, .*got '-1'" --embed-dim 8 --heads 2 --seed -1 --out "$I"
init_fail "^mha init: --dropout must be a finite number, got 'nan'" --embed-dim 8 --heads 2 --dropout nan --seed 1 --out "$I"
init_fail "^mha init: --scale must be a finite number, got 'inf'" --embed-dim 8 --heads 2 --scale inf --seed 1 --out "$I"
init_fail "^mha init: dropout must be in \[0, 1\], got 1\.5" --embed-dim 8 --heads 2 --dropout 1.5 --seed 1 --out "$I"
init_fail "^mha init: embed_dim 10 is not divisible by num_heads 3" --embed-dim 10 --heads 3 --seed 1 --out "$I"
init_fail "^mha init: --kv-heads 3 must divide --heads 4 \(each K/V head serves the same number of query heads\)$" \
  --embed-dim 16 --heads 4 --kv-heads 3 --seed 1 --out "$I"
init_fail "^mha init: --kv-heads 8 must divide --heads 4 " --embed-dim 16 --heads 4 --kv-heads 8 --seed 1 --out "$I"
init_fail "^mha init: --kv-heads must be an integer in \[1, 2147483647\], got '0'$" --embed-dim 16 --heads 4 --kv-heads 0 --seed 1 --out "$I"
init_fail "^mha init: --kv-heads must be an integer in \[1, 2147483647\], got '-2'$" --embed-dim 16 --heads 4 --kv-heads -2 --seed 1 --out "$I"
init_fail "^mha init: --kv-heads must be an integer .*got '2.5'$" --embed-dim 16 --heads 4 --kv-heads 2.5 --seed 1 --out "$I"
init_fail "^mha init: option --no-bias takes no value" --embed-dim 8 --heads 2 --no-bias=1 --seed 1 --out "$I"
init_fail "^mha init: unexpected argument 'extra'" --embed-dim 8 --heads 2 --seed 1 --out "$I" extra
expect 1 "^mha init: option --out needs a value" -- "$mha" init --embed-dim 8 --heads 2 --seed 1 --out
expect 1 "^mha init: --out: .*nodir" -- "$mha" init --embed-dim 8 --heads 2 --seed 1 --out "$tmp/nodir/w.safetensors"
absent "init into a missing directory" "$tmp/nodir"

# mha info: errors
echo "not a safetensors file" > "$tmp/text.safetensors"
expect 1 "^mha info: expected one safetensors file" -- "$mha" info
expect 1 "^mha info: unexpected argument" -- "$mha" info "$W" "$W"
expect 1 "^mha info: .*cannot open .*missing\.safetensors" -- "$mha" info "$tmp/missing.safetensors"
expect 1 "^mha info: .*safetensors" -- "$mha" info "$tmp/text.safetensors"
expect 1 "^mha info: --heads must be an integer .*got 'abc'" -- "$mha" info --heads abc "$W"
expect 1 "^mha info: --heads must be an integer .*got '0'" -- "$mha" info --heads 0 "$W"
expect 1 "^mha info: unknown option '--embed-dim'" -- "$mha" info --embed-dim 8 "$W"

if ! "$py" -c "import numpy" 2>/dev/null; then
  bad "python3-numpy is missing: the mha forward tests need it (scripts/install-deps.sh installs it)"
  echo "$passes passed, $fails failed"
  exit 1
fi

# npy FILE EXPR: saves the NumPy expression (np.random seeded with 0)
npy() {
  "$py" -c "import sys, numpy as np; np.random.seed(0); np.save(sys.argv[1], eval(sys.argv[2]))" "$1" "$2" ||
    bad "could not write $1"
}
# check WHAT EXPR FILE...: EXPR is true of a = np.load(FILE1), b = ..., c = ...
check() {
  local what="$1" expr="$2"; shift 2
  if "$py" -c "
import sys, numpy as np
a, b, c = ([np.load(f) for f in sys.argv[2:]] + [None, None, None])[:3]
sys.exit(0 if ($expr) else 1)" "$expr" "$@" 2>/dev/null; then ok
  else bad "$what: not ($expr) for $*"; fi
}
# shape FILE 'float32 (2, 3, 8)'
shape() { check "$1 is $2" "'%s %s' % (a.dtype, a.shape) == '$2'" "$1"; }

# A state_dict without __metadata__, as PyTorch users save it.
"$py" -c "
import sys; sys.path.insert(0, sys.argv[1]); import st
t, meta = st.load(sys.argv[2]); st.save(sys.argv[3], t)
st.save(sys.argv[4], {'foo': t['out_proj.bias']}, {'num_heads': '2'})" \
  "$here/torch_live" "$W" "$tmp/nometa.safetensors" "$tmp/foo.safetensors" ||
  bad "could not write nometa.safetensors"
expect 1 "^mha info: not a loadable nn.MultiheadAttention: .*num_heads" -- "$mha" info "$tmp/nometa.safetensors"
expect 0 "^module: embed_dim=8 num_heads=2 " -- "$mha" info --heads 2 "$tmp/nometa.safetensors"
expect 1 "^mha info: not a loadable nn.MultiheadAttention: .*divisible" -- "$mha" info --heads 3 "$tmp/nometa.safetensors"
expect 1 "^mha info: not a loadable nn.MultiheadAttention: .*foo" -- "$mha" info "$tmp/foo.safetensors"
head -c 100 "$W" > "$tmp/truncated.safetensors"
expect 1 "^mha info: .*safetensors" -- "$mha" info "$tmp/truncated.safetensors"

d="$tmp"
npy "$d/q.npy"     "np.random.randn(2, 3, 8).astype(np.float32)"
npy "$d/q64.npy"   "np.random.randn(2, 3, 8).astype(np.float32).astype(np.float64)"
npy "$d/q1.npy"    "np.random.randn(3, 8).astype(np.float32)"
npy "$d/q5.npy"    "np.random.randn(2, 3, 5).astype(np.float32)"
npy "$d/qint.npy"  "np.ones((2, 3, 8), np.int64)"
npy "$d/q4d.npy"   "np.ones((1, 2, 3, 8), np.float32)"
npy "$d/q0.npy"    "np.ones((2, 0, 8), np.float32)"
npy "$d/k.npy"     "np.random.randn(2, 4, 8).astype(np.float32)"
npy "$d/v.npy"     "np.random.randn(2, 4, 8).astype(np.float32) + 1"
npy "$d/k3b.npy"   "np.random.randn(3, 4, 8).astype(np.float32)"
npy "$d/k2d.npy"   "np.random.randn(4, 8).astype(np.float32)"
npy "$d/v5.npy"    "np.random.randn(2, 5, 8).astype(np.float32)"
npy "$d/k5.npy"    "np.random.randn(2, 4, 5).astype(np.float32)"
npy "$d/v7.npy"    "np.random.randn(2, 4, 7).astype(np.float32)"
npy "$d/m_int.npy" "np.ones((3, 3), np.int64)"
npy "$d/m_bad.npy" "np.ones((3, 5), bool)"
npy "$d/m_tril.npy" "np.tril(np.ones((3, 3), bool))"
npy "$d/m_triu1.npy" "np.triu(np.ones((3, 3), bool), 1)"
npy "$d/m_br.npy"  "np.arange(4)[None, :] <= np.arange(3)[:, None] + 1"
npy "$d/m_tl.npy"  "np.arange(4)[None, :] <= np.arange(3)[:, None]"
npy "$d/m_add.npy" "np.where(np.tril(np.ones((3, 3), bool)), 0, -np.inf).astype(np.float32)"
npy "$d/km.npy"    "np.arange(3)[None, :] < np.array([2, 3])[:, None]"
npy "$d/km_f.npy"  "np.ones((2, 3), np.float32)"
npy "$d/kl.npy"    "np.array([2, 3], np.int64)"
npy "$d/kl32.npy"  "np.array([2, 3], np.int32)"
npy "$d/kl0.npy"   "np.array([0, 3], np.int64)"
npy "$d/kl1.npy"   "np.array([2], np.int64)"
npy "$d/kl_oob.npy" "np.array([1, 9], np.int64)"
npy "$d/kl_f.npy"  "np.array([1.0, 2.0])"

# mha forward: errors.  Every failing run gets --out (and most get
# --attn-weights) in an empty directory that must stay empty.
mkdir "$d/out"
O="$d/out/o.npy"; A="$d/out/a.npy"
fail_in() {  # fail_in SUBCOMMAND PATTERN ARGS...: fails, $d/out stays empty
  local cmd="$1" pat="$2"; shift 2
  expect 1 "$pat" -- "$mha" "$cmd" "$@"
  if [ -n "$(ls -A "$d/out")" ]; then
    bad "$cmd $* left files behind: $(ls -A "$d/out")"
    rm -f "$d/out/"* "$d/out/".[!.]*
  else ok; fi
}
fail_fwd() { fail_in forward "$@"; }  # fail_fwd PATTERN ARGS...
base=(--weights "$W" --query "$d/q.npy" --out "$O" --attn-weights "$A")
fail_fwd "^mha forward: --weights is required" --query "$d/q.npy" --out "$O"
fail_fwd "^mha forward: --query is required" --weights "$W" --out "$O"
expect 1 "^mha forward: --out is required" -- "$mha" forward --weights "$W" --query "$d/q.npy"
fail_fwd "^mha forward: unknown option '--bogus'" "${base[@]}" --bogus
fail_fwd "^mha forward: unknown option '--q'" "${base[@]}" --q "$d/q.npy"
fail_fwd "^mha forward: option --query given twice" "${base[@]}" --query "$d/q.npy"
fail_fwd "^mha forward: option --causal takes no value" "${base[@]}" --causal=1
fail_fwd "^mha forward: unexpected argument" "${base[@]}" "$d/q.npy"
expect 1 "^mha forward: option --heads needs a value" -- "$mha" forward "${base[@]}" --heads
fail_fwd "^mha forward: --heads must be an integer .*got 'abc'" "${base[@]}" --heads abc
fail_fwd "^mha forward: --heads must be an integer .*got '0'" "${base[@]}" --heads 0
fail_fwd "^mha forward: --heads must be an integer .*got '-2'" "${base[@]}" --heads -2
# an unknown GEMM backend: refused before anything is written
expect 1 "MHA_GEMM=frob: expected cblas or onednn" -- env MHA_GEMM=frob "$mha" forward "${base[@]}"
if [ -n "$(ls -A "$d/out")" ]; then bad "MHA_GEMM=frob left files behind"; rm -f "$d/out/"*; else ok; fi
fail_fwd "^mha forward: --seed must be an integer in \[0, .*got '-1'" "${base[@]}" --train --seed -1
fail_fwd "^mha forward: --seed must be an integer .*got 'x'" "${base[@]}" --train --seed x
fail_fwd "^mha forward: --dropout must be a finite number, got 'nan'" "${base[@]}" --train --dropout nan
fail_fwd "^mha forward: --dropout must be a finite number, got ''" "${base[@]}" --train --dropout=
fail_fwd "dropout must be in \[0, 1\], got 1\.5" "${base[@]}" --train --dropout 1.5
fail_fwd "^mha forward: --scale must be nonzero" "${base[@]}" --scale 0
fail_fwd "^mha forward: --scale 1e-46 rounds to 0 in float32" "${base[@]}" --scale 1e-46
fail_fwd "^mha forward: --scale must be nonzero" "${base[@]}" --scale -0.0
fail_fwd "^mha forward: --scale must be a finite number, got 'abc'" "${base[@]}" --scale abc
fail_fwd "^mha forward: --scale must be a finite number, got 'inf'" "${base[@]}" --scale inf
fail_fwd "^mha forward: --weights: .*cannot open .*missing\.safetensors" \
  --weights "$d/missing.safetensors" --query "$d/q.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --weights: .*safetensors" \
  --weights "$d/text.safetensors" --query "$d/q.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --weights: .*safetensors" \
  --weights "$d/truncated.safetensors" --query "$d/q.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --weights: .*safetensors" \
  --weights "$d/q.npy" --query "$d/q.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --weights .*: .*num_heads" \
  --weights "$d/nometa.safetensors" --query "$d/q.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --weights .*: .*foo" \
  --weights "$d/foo.safetensors" --query "$d/q.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --weights .*: embed_dim 8 is not divisible by num_heads 3" \
  --weights "$d/nometa.safetensors" --query "$d/q.npy" --out "$O" --attn-weights "$A" --heads 3
fail_fwd "^mha forward: --weights .*: num_heads 3 was given but __metadata__ says num_heads 2" "${base[@]}" --heads 3
fail_fwd "^mha forward: --query: .*missing\.npy" \
  --weights "$W" --query "$d/missing.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --query: " \
  --weights "$W" --query "$d/text.safetensors" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --query has last dimension 5, expected E = 8" \
  --weights "$W" --query "$d/q5.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --query must hold floats, got I64" \
  --weights "$W" --query "$d/qint.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --query must be \(B, L, E\) or \(L, E\), got \(1, 2, 3, 8\)" \
  --weights "$W" --query "$d/q4d.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --query is empty" \
  --weights "$W" --query "$d/q0.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: --key must have the query's batch \(2\)" "${base[@]}" --key "$d/k3b.npy"
fail_fwd "^mha forward: --key must have the query's batch \(2\) and rank" "${base[@]}" --key "$d/k2d.npy"
fail_fwd "^mha forward: --key has last dimension 5, expected kdim = 8" "${base[@]}" --key "$d/k5.npy"
fail_fwd "^mha forward: --value must have the key's batch and length \(2, 4\)" \
  "${base[@]}" --key "$d/k.npy" --value "$d/v5.npy"
fail_fwd "^mha forward: --value needs --key" "${base[@]}" --value "$d/v.npy"
fail_fwd "^mha forward: --per-head needs --attn-weights" --weights "$W" --query "$d/q.npy" --out "$O" --per-head
fail_fwd "^mha forward: --dropout and --seed apply only with --train" "${base[@]}" --dropout 0.5
fail_fwd "^mha forward: --dropout and --seed apply only with --train" "${base[@]}" --seed 3
fail_fwd "^mha forward: --causal and --causal-top-left exclude each other" "${base[@]}" --causal --causal-top-left
fail_fwd "^mha forward: --out and --attn-weights name the same file" \
  --weights "$W" --query "$d/q.npy" --out "$O" --attn-weights "$O"
fail_fwd "^mha forward: --dropout must be in \[0, 1\], got 2" "${base[@]}" --train --dropout 2
fail_fwd "^mha forward: --scale must be a finite number, got '1e39'" "${base[@]}" --scale 1e39
fail_fwd "^mha forward: --attn-mask must be bool \(allow\) or float \(additive\), got I64" "${base[@]}" --attn-mask "$d/m_int.npy"
fail_fwd "^mha forward: attn_mask has last dimensions \(3, 5\), expected \(Lq=3, Lk=3\)" "${base[@]}" --attn-mask "$d/m_bad.npy"
fail_fwd "^mha forward: --attn-mask: .*missing\.npy" "${base[@]}" --attn-mask "$d/missing.npy"
fail_fwd "^mha forward: --key-mask must be bool \(true = real key\), got F32" "${base[@]}" --key-mask "$d/km_f.npy"
fail_fwd "^mha forward: --key-lengths must have shape \(B\) = \(2\), got \(1\)$" "${base[@]}" --key-lengths "$d/kl1.npy"
npy "$d/kl12.npy" "np.array([[3, 3]], np.int64)"
fail_fwd "^mha forward: --key-lengths must have shape \(B\) = \(2\), got \(1, 2\)$" "${base[@]}" --key-lengths "$d/kl12.npy"
fail_fwd "^mha forward: --key-lengths must hold integers, got F64" "${base[@]}" --key-lengths "$d/kl_f.npy"
npy "$d/kl_u8.npy" "np.array([2, 3], np.uint8)"
fail_fwd "^mha forward: --key-lengths must hold integers, got BOOL \(a bool or uint8 file\)$" "${base[@]}" --key-lengths "$d/kl_u8.npy"
fail_fwd "^mha forward: key_lengths\[1\] = 9 is outside \[0, Lk=3\]" "${base[@]}" --key-lengths "$d/kl_oob.npy"
fail_fwd "^mha forward: the module has kdim 5 != E 8: give --key" \
  --weights "$Wkv" --query "$d/q.npy" --out "$O" --attn-weights "$A"
fail_fwd "^mha forward: the module has vdim 7: give --value" \
  --weights "$Wkv" --query "$d/q.npy" --key "$d/k5.npy" --out "$O" --attn-weights "$A"
# the --out directory does not exist; then --attn-weights's does not: the
# output already written must be removed again
fail_fwd "^mha forward: --out: .*nodir" --weights "$W" --query "$d/q.npy" \
  --out "$d/nodir/o.npy" --attn-weights "$A"
absent "forward into a missing directory" "$d/nodir"
fail_fwd "^mha forward: --attn-weights: .*nodir" --weights "$W" --query "$d/q.npy" \
  --out "$O" --attn-weights "$d/nodir/a.npy"
absent "forward into a missing directory" "$d/nodir"

# mha forward: what it writes
o="$d/o"; mkdir "$o"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --out "$o/self.npy"
shape "$o/self.npy" "float32 (2, 3, 8)"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q1.npy" --out "$o/unb.npy" \
  --attn-weights "$o/unb_w.npy" --per-head
shape "$o/unb.npy" "float32 (3, 8)"
shape "$o/unb_w.npy" "float32 (2, 3, 3)"
check "unbatched = the first batch row of a batched run" \
  "np.allclose(a, b[0], rtol=0, atol=1e-6)" \
  "$o/unb.npy" "$o/self.npy"  # q1 holds the same first draws as q
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --out "$o/avg.npy" \
  --attn-weights "$o/avg_w.npy"
shape "$o/avg_w.npy" "float32 (2, 3, 3)"
same "$o/self.npy" "$o/avg.npy" "asking for weights changes the output"
check "weights rows sum to 1" "np.allclose(a.sum(-1), 1, atol=1e-6)" "$o/avg_w.npy"
expect 0 "" -- "$mha" forward --weights="$W" --query="$d/q.npy" --out="$o/ph.npy" \
  --attn-weights="$o/ph_w.npy" --per-head
shape "$o/ph_w.npy" "float32 (2, 2, 3, 3)"
check "the average of the per-head weights" "np.allclose(a.mean(1), b, atol=1e-6)" \
  "$o/ph_w.npy" "$o/avg_w.npy"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q64.npy" --out "$o/q64.npy"
shape "$o/q64.npy" "float32 (2, 3, 8)"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --key "$d/k.npy" \
  --out "$o/cross.npy" --attn-weights "$o/cross_w.npy"
shape "$o/cross.npy" "float32 (2, 3, 8)"
shape "$o/cross_w.npy" "float32 (2, 3, 4)"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --key "$d/k.npy" \
  --value "$d/v.npy" --out "$o/cross_v.npy"
differ "$o/cross.npy" "$o/cross_v.npy" "--value is ignored"
expect 0 "" -- "$mha" forward --weights "$Wkv" --query "$d/q.npy" --key "$d/k5.npy" \
  --value "$d/v7.npy" --out "$o/kv.npy" --attn-weights "$o/kv_w.npy" --per-head
shape "$o/kv.npy" "float32 (2, 3, 8)"
shape "$o/kv_w.npy" "float32 (2, 2, 3, 6)"   # Lk 4 + bias_k + zero key
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --key "$d/k.npy" \
  --add-zero-attn --out "$o/za.npy" --attn-weights "$o/za_w.npy"
shape "$o/za_w.npy" "float32 (2, 3, 5)"
check "--add-zero-attn: the zero key has weight > 0" "(a[..., -1] > 0).all()" "$o/za_w.npy"
expect 0 "" -- "$mha" forward --weights "$Wbkv" --query "$d/q.npy" --out "$o/bkv.npy" \
  --attn-weights "$o/bkv_w.npy"
shape "$o/bkv_w.npy" "float32 (2, 3, 5)"       # Lk 3 + bias_k + zero key
expect 0 "" -- "$mha" forward --weights "$d/nometa.safetensors" --heads 2 \
  --query "$d/q.npy" --out "$o/nometa.npy"
same "$o/self.npy" "$o/nometa.npy" "--heads 2 on the same weights without metadata"
expect 0 "" -- "$mha" forward --weights "$d/nometa.safetensors" --heads 4 --query "$d/q.npy" --out "$o/h4.npy"
differ "$o/self.npy" "$o/h4.npy" "--heads 4 on the same weights without metadata"

# --threads: bitwise the same at 1, 2 and 4 threads, on a shape where the
# attention engine really splits the work (it runs one thread below
# B*H*Lq*Lt*d_h = 2^20; here 2*4*256*256*16 = 2^23).  The BLAS's own
# threads are pinned to one: its thread count is a separate matter.
Wt="$tmp/wt.safetensors"
expect 0 "" -- "$mha" init --embed-dim 64 --heads 4 --seed 5 --out "$Wt"
npy "$d/qt.npy" "np.random.randn(2, 256, 64).astype(np.float32)"
npy "$d/dyt.npy" "np.random.randn(2, 256, 64).astype(np.float32)"
for c in "" --causal; do
  n="t${c:+_causal}"
  for t in 1 2 4; do
    expect 0 "" -- env OPENBLAS_NUM_THREADS=1 "$mha" forward --weights "$Wt" \
      --query "$d/qt.npy" $c --threads $t --out "$o/$n$t.npy" \
      --attn-weights "$o/$n${t}_w.npy" --per-head
  done
  for t in 2 4; do
    same "$o/${n}1.npy" "$o/$n$t.npy" "forward $c --threads 1 vs $t"
    same "$o/${n}1_w.npy" "$o/$n${t}_w.npy" "forward $c --threads 1 vs $t (weights)"
  done
done

# --scale
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --scale 0.5 --out "$o/s05.npy"
same "$o/self.npy" "$o/s05.npy" "--scale 0.5 = the default 1/sqrt(4)"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --scale 1 --out "$o/s1.npy"
differ "$o/self.npy" "$o/s1.npy" "--scale 1"

# dropout: --train --dropout P --seed S
tr=(--weights "$W" --query "$d/q.npy" --train --dropout 0.5)
expect 0 "" -- "$mha" forward "${tr[@]}" --seed 1 --out "$o/d1.npy" --attn-weights "$o/d1_w.npy" --per-head
expect 0 "" -- "$mha" forward "${tr[@]}" --seed 1 --out "$o/d1b.npy" --attn-weights "$o/d1b_w.npy" --per-head
expect 0 "" -- "$mha" forward "${tr[@]}" --seed 2 --out "$o/d2.npy"
same "$o/d1.npy" "$o/d1b.npy" "--train --dropout 0.5 --seed 1 twice"
same "$o/d1_w.npy" "$o/d1b_w.npy" "--train --dropout 0.5 --seed 1 twice (weights)"
differ "$o/d1.npy" "$o/d2.npy" "--seed 1 vs --seed 2"
# --seed takes the API's whole uint64 range (the top bit counts)
expect 0 "" -- "$mha" forward "${tr[@]}" --seed 18446744073709551615 --out "$o/dmax.npy"
expect 0 "" -- "$mha" forward "${tr[@]}" --seed 9223372036854775807 --out "$o/dmax63.npy"
differ "$o/dmax.npy" "$o/dmax63.npy" "--seed 2^64-1 vs 2^63-1"
fail_fwd "^mha forward: --seed must be an integer in \[0, 18446744073709551615\], got '18446744073709551616'" \
  "${base[@]}" --train --seed 18446744073709551616
fail_fwd "^mha forward: --seed must be an integer .*got ' 5'" "${base[@]}" --train --seed " 5"
differ "$o/d1.npy" "$o/self.npy" "--train --dropout 0.5 vs eval"
check "dropped weights are 0, kept ones scaled by 2" \
  "(a == 0).any() and np.allclose(a[a != 0], 2 * b[a != 0], atol=1e-6)" "$o/d1_w.npy" "$o/ph_w.npy"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --train --dropout 0 \
  --seed 5 --out "$o/d0.npy"
same "$o/self.npy" "$o/d0.npy" "--train --dropout 0 vs eval"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --train --out "$o/dfile.npy"
same "$o/self.npy" "$o/dfile.npy" "--train with the file's dropout 0"
expect 0 "" -- "$mha" forward --weights "$Wkv" --query "$d/q.npy" --key "$d/k5.npy" \
  --value "$d/v7.npy" --train --seed 4 --out "$o/kvd.npy"
differ "$o/kv.npy" "$o/kvd.npy" "--train with the file's dropout 0.25"
# --dropout 0 turns off the dropout that the file's config asks for
expect 0 "" -- "$mha" forward --weights "$Wkv" --query "$d/q.npy" --key "$d/k5.npy" \
  --value "$d/v7.npy" --train --dropout 0 --seed 4 --out "$o/kvd0.npy"
same "$o/kv.npy" "$o/kvd0.npy" "--train --dropout 0 over the file's dropout 0.25"

# masks: --causal = a lower-triangular allow mask; both alignments
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --causal \
  --out "$o/causal.npy" --attn-weights "$o/causal_w.npy"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --attn-mask "$d/m_tril.npy" \
  --out "$o/tril.npy" --attn-weights "$o/tril_w.npy"
check "--causal = the tril bool mask" "np.allclose(a, b, rtol=0, atol=1e-6)" "$o/causal.npy" "$o/tril.npy"
check "--causal = the tril bool mask (weights)" "np.allclose(a, b, rtol=0, atol=1e-7)" \
  "$o/causal_w.npy" "$o/tril_w.npy"
check "--causal weights are 0 above the diagonal" "(np.triu(a, 1) == 0).all()" "$o/causal_w.npy"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --causal-top-left --out "$o/ctl_self.npy"
check "--causal-top-left = --causal when Lq = Lk" "np.allclose(a, b, rtol=0, atol=1e-6)" \
  "$o/ctl_self.npy" "$o/causal.npy"
# --block-mask: PyTorch MHA's polarity (true = blocked), the tril's complement
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --block-mask "$d/m_triu1.npy" \
  --out "$o/blk.npy" --attn-weights "$o/blk_w.npy"
same "$o/blk.npy" "$o/tril.npy" "--block-mask triu(1) = --attn-mask tril"
same "$o/blk_w.npy" "$o/tril_w.npy" "--block-mask triu(1) = --attn-mask tril (weights)"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --block-mask "$d/m_tril.npy" \
  --out "$o/blk_tril.npy"
differ "$o/blk_tril.npy" "$o/tril.npy" "--block-mask tril is not --attn-mask tril"
fail_fwd "^mha forward: give --attn-mask \(true = may attend\) or --block-mask \(true = blocked\), not both" \
  "${base[@]}" --attn-mask "$d/m_tril.npy" --block-mask "$d/m_triu1.npy"
fail_fwd "^mha forward: --block-mask must be bool \(true = blocked\), got F32" \
  "${base[@]}" --block-mask "$d/m_add.npy"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --attn-mask "$d/m_add.npy" --out "$o/addm.npy"
check "a float -inf mask = the bool mask" "np.allclose(a, b, rtol=0, atol=1e-6)" "$o/addm.npy" "$o/tril.npy"
ck=(--weights "$W" --query "$d/q.npy" --key "$d/k.npy")
expect 0 "" -- "$mha" forward "${ck[@]}" --causal --out "$o/c_br.npy"
expect 0 "" -- "$mha" forward "${ck[@]}" --attn-mask "$d/m_br.npy" --out "$o/m_br.npy"
check "--causal with Lq=3, Lk=4 = bottom-right mask" "np.allclose(a, b, rtol=0, atol=1e-6)" \
  "$o/c_br.npy" "$o/m_br.npy"
expect 0 "" -- "$mha" forward "${ck[@]}" --causal-top-left --out "$o/c_tl.npy"
expect 0 "" -- "$mha" forward "${ck[@]}" --attn-mask "$d/m_tl.npy" --out "$o/m_tl.npy"
check "--causal-top-left with Lq=3, Lk=4 = tril mask" "np.allclose(a, b, rtol=0, atol=1e-6)" \
  "$o/c_tl.npy" "$o/m_tl.npy"
differ "$o/c_br.npy" "$o/c_tl.npy" "the two causal alignments with Lq != Lk"

# key masks: --key-lengths = --key-mask; a batch with no key left
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --key-lengths "$d/kl.npy" \
  --out "$o/kl.npy" --attn-weights "$o/kl_w.npy"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --key-lengths "$d/kl32.npy" \
  --out "$o/kl32.npy"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --key-mask "$d/km.npy" \
  --out "$o/km.npy"
check "--key-lengths = --key-mask" "np.allclose(a, b, rtol=0, atol=1e-6)" "$o/kl.npy" "$o/km.npy"
same "$o/kl.npy" "$o/kl32.npy" "--key-lengths int64 vs int32"
check "--key-lengths 2: weight 0 on key 2 of batch 0" "(a[0, :, 2] == 0).all()" "$o/kl_w.npy"
expect 0 "" -- "$mha" forward --weights "$W" --query "$d/q.npy" --key-lengths "$d/kl0.npy" \
  --out "$o/kl0.npy" --attn-weights "$o/kl0_w.npy" --per-head
check "no key left: output = out_proj.bias (0 after init), weights 0" \
  "(a[0] == 0).all() and (b[0] == 0).all() and np.isfinite(a).all()" "$o/kl0.npy" "$o/kl0_w.npy"
check "no key left in batch 0: batch 1 is as without a mask" \
  "np.allclose(a[1], b[1], rtol=0, atol=1e-6)" "$o/kl0.npy" "$o/self.npy"

# ---- files: never lost, never clobbered (the Reliability issue) ----------------
f="$d/files"; mkdir "$f"
fw=(forward --weights "$W" --query "$d/q.npy")
"$mha" "${fw[@]}" --out "$f/ref.npy" --attn-weights "$f/ref_w.npy" || bad "files: reference run"
# --out and --attn-weights compared as files, not as strings
fail_fwd "^mha forward: --out and --attn-weights name the same file" \
  --weights "$W" --query "$d/q.npy" --out "$O" --attn-weights "$d/out/../out/./o.npy"
ln -s "$f/ref.npy" "$f/ref_link.npy"
expect 1 "name the same file" -- "$mha" "${fw[@]}" --out "$f/ref.npy" --attn-weights "$f/ref_link.npy"
# both or neither: the weights' write fails, a file already at --out is kept
echo "precious" > "$f/old.npy"
expect 1 "^mha forward: --attn-weights: .*nodir" -- "$mha" "${fw[@]}" \
  --out "$f/old.npy" --attn-weights "$f/nodir/a.npy"
if [ "$(cat "$f/old.npy")" = precious ]; then ok; else bad "files: --out's old content lost"; fi
absent "files: no leftover" "$f/old.npy.keep."* "$f/old.npy.tmp."*
# a symbolic link is followed: its target is written, the link stays a link
echo "old" > "$f/target.npy"; ln -s target.npy "$f/link.npy"
"$mha" "${fw[@]}" --out "$f/link.npy" || bad "files: writing through a link"
if [ -L "$f/link.npy" ]; then ok; else bad "files: the link was replaced"; fi
same "$f/target.npy" "$f/ref.npy" "files: a link's target"
# a dangling link: the file it names is created
ln -s made.npy "$f/dangling.npy"
"$mha" "${fw[@]}" --out "$f/dangling.npy" || bad "files: a dangling link"
same "$f/made.npy" "$f/ref.npy" "files: a dangling link's target"
# the mode is kept (0600 stays 0600), and so are hard links
echo "old" > "$f/private.npy"; chmod 600 "$f/private.npy"
"$mha" "${fw[@]}" --out "$f/private.npy" || bad "files: overwriting a 0600 file"
if [ "$(stat -c %a "$f/private.npy")" = 600 ]; then ok
else bad "files: mode became $(stat -c %a "$f/private.npy")"; fi
echo "old" > "$f/hard1.npy"; ln "$f/hard1.npy" "$f/hard2.npy"
"$mha" "${fw[@]}" --out "$f/hard1.npy" || bad "files: overwriting a hard-linked file"
same "$f/hard2.npy" "$f/ref.npy" "files: the other hard link"
# a FIFO is written through (not replaced by a regular file) and read back
# by its reader; one with no reader is refused at once, not waited on
mkfifo "$f/fifo"
timeout 30 cat "$f/fifo" > "$f/from_fifo.npy" & reader=$!
timeout 20 "$mha" "${fw[@]}" --out "$f/fifo" || bad "files: writing into a FIFO"
wait "$reader"
if [ -p "$f/fifo" ]; then ok; else bad "files: the FIFO was replaced"; fi
same "$f/from_fifo.npy" "$f/ref.npy" "files: what the FIFO's reader got"
expect 1 "^mha forward: --out: cannot write .*fifo.*: a FIFO with no reader" -- \
  timeout 20 "$mha" "${fw[@]}" --out "$f/fifo"
# an input that is a FIFO with no writer is refused at once, not waited on
expect 1 "^mha forward: .*fifo.* is not a regular file" -- \
  timeout 20 "$mha" forward --weights "$W" --query "$f/fifo" --out "$f/x.npy"
expect 1 "fifo.* is not a regular file" -- \
  timeout 20 "$mha" forward --weights "$f/fifo" --query "$d/q.npy" --out "$f/x.npy"
# standard output through a pipe: the bytes reach the pipe.  (/dev/fd/1,
# not /dev/stdout: a regression would then fail to create its temporary
# file in /proc, where the old code, as root, replaced /dev/stdout itself.)
"$mha" "${fw[@]}" --out /dev/fd/1 | cat > "$f/piped.npy"
same "$f/piped.npy" "$f/ref.npy" "files: --out /dev/fd/1 into a pipe"
# a device node stays the device it is: a private null device (as root),
# so that a regression replaces this one, not the system's /dev/null
if mknod "$f/null" c 1 3 2>/dev/null; then
  "$mha" "${fw[@]}" --out "$f/null" || bad "files: --out a null device"
  if [ -c "$f/null" ]; then ok; else bad "files: the device node was replaced"; fi
fi
# a directory is refused by name
expect 1 "cannot write .*: it is a directory" -- "$mha" "${fw[@]}" --out "$f"
absent "files: no temporary file left" "$f/"*.tmp.*
# killed while saving (SIGTERM, at a few moments of a ~100 MB init): the
# command dies of the signal (or had finished), and no temporary file is
# left beside the name (mha_io_discard_temporaries in its handler)
for delay in 0.1 0.2 0.3 0.4; do
  "$mha" init --embed-dim 2560 --heads 8 --seed 1 --out "$f/killed.safetensors" &
  pid=$!
  sleep "$delay"
  kill -TERM "$pid" 2>/dev/null || true
  st=0; wait "$pid" || st=$?
  if [ "$st" -ne 143 ] && [ "$st" -ne 0 ]; then
    bad "files: SIGTERM during init: exit status $st, not 143 (or 0)"
  else ok; fi
  absent "files: SIGTERM after ${delay}s left no temporary file" \
    "$f/"killed.safetensors.tmp.*
done
rm -f "$f/killed.safetensors"

# ---- --seq-first: (L, B, E) files, nn.MultiheadAttention's default layout ----
s="$d/seqfirst"; mkdir "$s"
for x in q k v; do npy "$s/$x.npy" "np.load('$d/$x.npy').transpose(1, 0, 2)"; done
npy "$s/dy_bf.npy" "np.random.randn(2, 3, 8).astype(np.float32)"
npy "$s/dy.npy" "np.load('$s/dy_bf.npy').transpose(1, 0, 2)"
cross_bf=(--weights "$W" --query "$d/q.npy" --key "$d/k.npy" --value "$d/v.npy")
cross_sf=(--weights "$W" --query "$s/q.npy" --key "$s/k.npy" --value "$s/v.npy" --seq-first)
"$mha" forward "${cross_bf[@]}" --out "$s/bf.npy" --attn-weights "$s/bf_w.npy" || bad "seq-first: batch-first run"
"$mha" forward "${cross_sf[@]}" --out "$s/sf.npy" --attn-weights "$s/sf_w.npy" || bad "seq-first: run"
check "--seq-first: the output is the batch-first one, (Lq, B, E)" \
  "a.shape == (3, 2, 8) and np.array_equal(a, b.transpose(1, 0, 2))" "$s/sf.npy" "$s/bf.npy"
same "$s/sf_w.npy" "$s/bf_w.npy" "--seq-first: the weights stay (B, Lq, Lk)"
"$mha" backward "${cross_bf[@]}" --grad-output "$s/dy_bf.npy" --out "$s/g_bf.safetensors" || bad "seq-first: batch-first backward"
"$mha" backward "${cross_sf[@]}" --grad-output "$s/dy.npy" --out "$s/g_sf.safetensors" || bad "seq-first: backward"
if "$py" -c "
import sys; sys.path.insert(0, sys.argv[1]); import st, numpy as np
a, _ = st.load(sys.argv[2]); b, _ = st.load(sys.argv[3])
assert sorted(a) == sorted(b)
for n in a:
    want = b[n].transpose(1, 0, 2) if n in ('query', 'key', 'value') else b[n]
    assert np.array_equal(a[n], want), n" "$here/torch_live" "$s/g_sf.safetensors" "$s/g_bf.safetensors"
then ok; else bad "--seq-first: backward's gradients are not the batch-first ones transposed"; fi
expect 1 "^mha backward: --grad-output .* has shape \(2, 3, 8\), expected the forward output's shape \(3, 2, 8\) \(--seq-first\)" -- \
  "$mha" backward "${cross_sf[@]}" --grad-output "$s/dy_bf.npy" --out "$s/x.safetensors"
"$mha" decode --weights "$W" --query "$d/q.npy" --chunk 2 --out "$s/dec_bf.npy" || bad "seq-first: batch-first decode"
"$mha" decode --weights "$W" --query "$s/q.npy" --seq-first --chunk 2 --out "$s/dec_sf.npy" || bad "seq-first: decode"
check "--seq-first: decode's output is (L, B, E)" "np.array_equal(a, b.transpose(1, 0, 2))" "$s/dec_sf.npy" "$s/dec_bf.npy"
npy "$s/q7.npy" "np.zeros((3, 2, 7), np.float32)"
expect 1 "^mha forward: --query has last dimension 7, expected E = 8 \(shape \(3, 2, 7\), read as \(L, B, w\) with --seq-first\)" -- \
  "$mha" forward --weights "$W" --query "$s/q7.npy" --seq-first --out "$s/x.npy"
expect 1 "read as \(B, L, w\); --seq-first reads \(L, B, w\)" -- \
  "$mha" forward --weights "$W" --query "$s/q7.npy" --out "$s/x.npy"
absent "--seq-first: no output after a failure" "$s/x.npy" "$s/x.safetensors"

# ---- mha forward --dtype bf16 / f16 ------------------------------------------
# The module on 16-bit data (docs/semantics.md, "16-bit modules"): a float16
# .npy query ('<f2') read exactly, out written in the dtype (bf16 to
# safetensors only).  Against the float32 forward on the same query values:
# within 16 unit roundoffs of max |out| (the 16-bit path rounds q, k, v,
# the weights, the heads' context and out, u each; a lost row, a wrong
# layout or an unrounded-to-wrong-type output is off by far more).
h="$tmp/half"; mkdir "$h"
npy "$h/q.npy" "np.random.randn(2, 3, 8).astype(np.float16)"
"$py" -c "import sys, numpy as np; np.save(sys.argv[2], np.load(sys.argv[1]).astype(np.float32))" "$h/q.npy" "$h/q32.npy" ||
  bad "could not write q32.npy"
"$mha" forward --weights "$W" --query "$h/q32.npy" --out "$h/ref.npy" || bad "--dtype: the float32 forward"
"$mha" forward --weights "$W" --query "$h/q.npy" --out "$h/o16.npy" --dtype f16 && ok || bad "forward --dtype f16"
shape "$h/o16.npy" 'float16 (2, 3, 8)'
check "--dtype f16: within 16u of the float32 forward" \
  "np.abs(a.astype(np.float64) - b).max() <= 16 * 2.0**-11 * np.abs(b).max()" "$h/o16.npy" "$h/ref.npy"
"$mha" forward --weights "$W" --query "$h/q32.npy" --out "$h/o16b.npy" --dtype f16 && ok || bad "forward --dtype f16 (float32 file)"
check "--dtype f16: a float32 file holding f16 values gives the same bits" "np.array_equal(a.view(np.uint16), b.view(np.uint16))" \
  "$h/o16.npy" "$h/o16b.npy"
"$mha" forward --weights "$W" --query "$h/q32.npy" --out "$h/obf.safetensors" --dtype bf16 && ok || bad "forward --dtype bf16"
if "$py" -c "
import json, struct, sys, numpy as np
raw = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
head = json.loads(raw[8:8 + n])
e = head['out']
assert e['dtype'] == 'BF16' and e['shape'] == [2, 3, 8], e
u = np.frombuffer(raw[8 + n + e['data_offsets'][0]:8 + n + e['data_offsets'][1]], '<u2')
got = (u.astype(np.uint32) << 16).view(np.float32).reshape(2, 3, 8)
ref = np.load(sys.argv[2]).astype(np.float64)
assert np.abs(got - ref).max() <= 16 * 2.0**-8 * np.abs(ref).max()" "$h/obf.safetensors" "$h/ref.npy"
then ok; else bad "--dtype bf16: out.safetensors is not the bf16 out within 16u"; fi
"$py" -c "import sys, numpy as np; np.save(sys.argv[2], np.load(sys.argv[1]).transpose(1, 0, 2).copy())" "$h/q.npy" "$h/qsf.npy"
"$mha" forward --weights "$W" --query "$h/qsf.npy" --seq-first --out "$h/osf.npy" --dtype f16 && ok || bad "forward --dtype f16 --seq-first"
check "--dtype f16 --seq-first: the batch-first output transposed" "np.array_equal(a.view(np.uint16), b.transpose(1, 0, 2).view(np.uint16))" \
  "$h/osf.npy" "$h/o16.npy"
fail_fwd "^mha forward: --out: npy save: dtype BF16 has no .npy type .*safetensors" \
  --weights "$W" --query "$h/q32.npy" --out "$O" --dtype bf16
fail_fwd "^mha forward: --dtype must be f32, bf16 or f16, got 'f8'" \
  --weights "$W" --query "$h/q32.npy" --out "$O" --dtype f8
fail_fwd "^mha forward: a f16 forward does not take attention weights" \
  --weights "$W" --query "$h/q.npy" --out "$O" --attn-weights "$A" --dtype f16

# ---- mha backward ------------------------------------------------------------
# stcheck WHAT EXPR FILE...: EXPR is true of t, a, b = FILE1, FILE2, FILE3:
# a safetensors file as {name: array} (file order), an .npy as an array
stcheck() {
  local what="$1" expr="$2"; shift 2
  if "$py" -c "
import sys, numpy as np; sys.path.insert(0, sys.argv[1]); import st
t, a, b = ([st.load(f)[0] if f.endswith('.safetensors') else np.load(f)
            for f in sys.argv[3:]] + [None, None, None])[:3]
sys.exit(0 if ($expr) else 1)" "$here/torch_live" "$expr" "$@" 2>/dev/null; then ok
  else bad "$what: not ($expr) for $*"; fi
}
# layout FILE 'name (shape); ...': every tensor, in order, all float32
layout() {
  stcheck "$1 holds $2" "'; '.join('%s %s' % (n, v.shape) for n, v in t.items()) == '$2' and all(v.dtype == np.float32 for v in t.values())" "$1"
}
expect 0 "backward +the gradients of that forward pass" -- "$mha" --help
npy "$d/dy.npy"    "np.random.randn(2, 3, 8).astype(np.float32) * 2"
npy "$d/dy64.npy"  "np.random.randn(2, 3, 8)"
npy "$d/dy1.npy"   "np.random.randn(3, 8).astype(np.float32)"
npy "$d/dy5.npy"   "np.random.randn(2, 3, 5).astype(np.float32)"
npy "$d/dyint.npy" "np.ones((2, 3, 8), np.int64)"
npy "$d/km4.npy"   "np.arange(4)[None, :] < np.array([3, 4])[:, None]"

# what it writes: the inputs' gradients, then one per parameter
g="$d/g"; mkdir "$g"
P="in_proj_weight (24, 8); in_proj_bias (24,); out_proj.weight (8, 8); out_proj.bias (8,)"
bw=(--weights "$W" --query "$d/q.npy" --grad-output "$d/dy.npy")
expect 0 "" -- "$mha" backward "${bw[@]}" --out "$g/self.safetensors"
layout "$g/self.safetensors" "query (2, 3, 8); $P"
# mha info lists a gradients file and says what it is (exit 0)
expect 0 "^  query +F32 +\(2, 3, 8\)$" -- "$mha" info "$g/self.safetensors"
expect 0 "^gradients \(mha backward\): query; 4 parameters$" -- "$mha" info "$g/self.safetensors"
stcheck "d out_proj.bias = dy summed over (B, L)" \
  "np.allclose(t['out_proj.bias'], a.sum((0, 1)), rtol=1e-5, atol=1e-5)" "$g/self.safetensors" "$d/dy.npy"
stcheck "gradients are finite and not all zero" \
  "all(np.isfinite(v).all() and (v != 0).any() for v in t.values())" "$g/self.safetensors"
# --threads: bitwise the same, on the threaded shape of the forward's test
for t in 1 2 4; do
  expect 0 "" -- env OPENBLAS_NUM_THREADS=1 "$mha" backward --weights "$Wt" \
    --query "$d/qt.npy" --grad-output "$d/dyt.npy" --threads $t \
    --out "$g/t$t.safetensors"
done
same "$g/t1.safetensors" "$g/t2.safetensors" "backward --threads 1 vs 2"
same "$g/t1.safetensors" "$g/t4.safetensors" "backward --threads 1 vs 4"
expect 0 "" -- "$mha" backward --weights "$W" --query "$d/q.npy" --grad-output "$d/dy64.npy" \
  --out "$g/dy64.safetensors"
layout "$g/dy64.safetensors" "query (2, 3, 8); $P"
expect 0 "" -- "$mha" backward --weights "$W" --query "$d/q1.npy" --grad-output "$d/dy1.npy" \
  --out "$g/unb.safetensors"
layout "$g/unb.safetensors" "query (3, 8); $P"
expect 0 "" -- "$mha" backward "${bw[@]}" --key "$d/k.npy" --out "$g/k.safetensors"
layout "$g/k.safetensors" "query (2, 3, 8); key (2, 4, 8); $P"
expect 0 "" -- "$mha" backward "${bw[@]}" --key "$d/k.npy" --value "$d/k.npy" --out "$g/kk.safetensors"
layout "$g/kk.safetensors" "query (2, 3, 8); key (2, 4, 8); value (2, 4, 8); $P"
stcheck "--key K alone: key = d key + d value of --key K --value K" \
  "np.allclose(t['key'], a['key'] + a['value'], rtol=1e-5, atol=1e-6) and all(np.allclose(t[n], a[n], rtol=1e-5, atol=1e-6) for n in t if n != 'key')" \
  "$g/k.safetensors" "$g/kk.safetensors"
expect 0 "" -- "$mha" backward --weights "$Wkv" --query "$d/q.npy" --key "$d/k5.npy" \
  --value "$d/v7.npy" --grad-output "$d/dy.npy" --out "$g/kv.safetensors"
layout "$g/kv.safetensors" "query (2, 3, 8); key (2, 4, 5); value (2, 4, 7); q_proj_weight (8, 8); k_proj_weight (8, 5); v_proj_weight (8, 7); bias_k (1, 1, 8); bias_v (1, 1, 8); out_proj.weight (8, 8)"
expect 0 "^gradients \(mha backward\): query, key, value; 6 parameters$" -- "$mha" info "$g/kv.safetensors"
expect 0 "" -- "$mha" backward "${bw[@]}" --key "$d/k.npy" --causal --add-zero-attn \
  --attn-mask "$d/m_br.npy" --key-mask "$d/km4.npy" --out "$g/masks.safetensors"
layout "$g/masks.safetensors" "query (2, 3, 8); key (2, 4, 8); $P"
expect 0 "" -- "$mha" backward "${bw[@]}" --key-lengths "$d/kl0.npy" --out "$g/kl0.safetensors"
stcheck "no key left in batch 0: d query[0] = 0" \
  "(t['query'][0] == 0).all() and (t['query'][1] != 0).any()" "$g/kl0.safetensors"
# dropout: the same seed, the same mask as mha forward --train
expect 0 "" -- "$mha" backward "${bw[@]}" --train --dropout 0.5 --seed 1 --out "$g/d1.safetensors"
expect 0 "" -- "$mha" backward "${bw[@]}" --train --dropout 0.5 --seed 1 --out "$g/d1b.safetensors"
expect 0 "" -- "$mha" backward "${bw[@]}" --train --dropout 0.5 --seed 2 --out "$g/d2.safetensors"
same "$g/d1.safetensors" "$g/d1b.safetensors" "backward --train --seed 1 twice"
differ "$g/d1.safetensors" "$g/d2.safetensors" "backward --seed 1 vs --seed 2"
differ "$g/d1.safetensors" "$g/self.safetensors" "backward --train --dropout 0.5 vs eval"
expect 0 "" -- "$mha" backward "${bw[@]}" --train --dropout 0 --seed 1 --out "$g/d0.safetensors"
same "$g/d0.safetensors" "$g/self.safetensors" "backward --train --dropout 0 vs eval"

# errors: nothing left in the --out directory
G="$d/out/g.safetensors"; bwo=("${bw[@]}" --out "$G")
fail_bwd() { fail_in backward "$@"; }  # fail_bwd PATTERN ARGS...
# fail_qdy PATTERN Q DY: fails on --weights W --query Q --grad-output DY
fail_qdy() { fail_bwd "$1" --weights "$W" --query "$2" --grad-output "$3" --out "$G"; }
fail_bwd "^mha backward: --grad-output is required" --weights "$W" --query "$d/q.npy" --out "$G"
expect 1 "^mha backward: --out is required" -- "$mha" backward "${bw[@]}"
fail_bwd "^mha backward: --weights is required" --query "$d/q.npy" --grad-output "$d/dy.npy" --out "$G"
fail_bwd "^mha backward: --query is required" --weights "$W" --grad-output "$d/dy.npy" --out "$G"
fail_qdy "^mha backward: --grad-output $d/dy5.npy has shape \(2, 3, 5\), expected the forward output's shape \(2, 3, 8\)$" \
  "$d/q.npy" "$d/dy5.npy"
fail_qdy "^mha backward: --grad-output $d/dy1.npy has shape \(3, 8\), expected the forward output's shape \(2, 3, 8\)$" \
  "$d/q.npy" "$d/dy1.npy"
fail_qdy "^mha backward: --grad-output $d/dy.npy has shape \(2, 3, 8\), expected the forward output's shape \(3, 8\)$" \
  "$d/q1.npy" "$d/dy.npy"
fail_qdy "^mha backward: --grad-output must hold floats, got I64" "$d/q.npy" "$d/dyint.npy"
fail_qdy "^mha backward: --grad-output: .*missing\.npy" "$d/q.npy" "$d/missing.npy"
fail_qdy "^mha backward: --grad-output: " "$d/q.npy" "$d/text.safetensors"
fail_bwd "^mha backward: --weights: .*cannot open .*missing\.safetensors" \
  --weights "$d/missing.safetensors" --query "$d/q.npy" --grad-output "$d/dy.npy" --out "$G"
fail_qdy "^mha backward: --query: .*missing\.npy" "$d/missing.npy" "$d/dy.npy"
fail_qdy "^mha backward: --query has last dimension 5, expected E = 8" "$d/q5.npy" "$d/dy.npy"
fail_bwd "^mha backward: --dropout must be in \[0, 1\], got 1\.5" "${bwo[@]}" --train --dropout 1.5
fail_bwd "^mha backward: --dropout must be a finite number, got 'nan'" "${bwo[@]}" --train --dropout nan
fail_bwd "^mha backward: --dropout and --seed apply only with --train" "${bwo[@]}" --dropout 0.5
fail_bwd "^mha backward: --seed must be an integer in \[0, .*got '-1'" "${bwo[@]}" --train --seed -1
fail_bwd "^mha backward: --threads must be an integer in \[1, 4096\], got '0'" "${bwo[@]}" --threads 0
fail_bwd "^mha backward: --value needs --key" "${bwo[@]}" --value "$d/v.npy"
fail_bwd "^mha backward: --causal and --causal-top-left exclude each other" "${bwo[@]}" --causal --causal-top-left
fail_bwd "^mha backward: unknown option '--per-head'" "${bwo[@]}" --per-head
fail_bwd "^mha backward: key_lengths\[1\] = 9 is outside \[0, Lk=3\]" "${bwo[@]}" --key-lengths "$d/kl_oob.npy"
fail_bwd "^mha backward: the module has vdim 7: give --value" \
  --weights "$Wkv" --query "$d/q.npy" --key "$d/k5.npy" --grad-output "$d/dy.npy" --out "$G"
fail_bwd "^mha backward: --out: .*nodir" "${bw[@]}" --out "$d/nodir/g.safetensors"
absent "backward into a missing directory" "$d/nodir"

# ---- mha decode --------------------------------------------------------------
# The causal self-attention run through a KV cache, a chunk at a time,
# equals mha forward --causal on the same input: a plain and a grouped-query
# module, B = 2, L = 70 (past one 64-key tile), chunks of 1, 7 and L, and a
# prefill of 64 then chunks of 3.  Each comparison is first shown to tell
# causal from full attention, so a decode that attended wrongly would fail.
expect 0 "^usage: mha decode" -- "$mha" decode --help
expect 0 "^usage: mha decode" -- "$mha" decode -h
expect 0 "decode +causal self-attention through a KV cache" -- "$mha" --help
dc="$d/dc"; mkdir "$dc"
Wd="$tmp/wd.safetensors"
expect 0 "" -- "$mha" init --embed-dim 32 --heads 4 --seed 7 --out "$Wd"
# Grouped-query: H = 4 query heads, H_kv = 2 K/V heads of d_h = 8, nonzero
# biases; H_kv is inferred from k_proj_weight's 16 rows.
Wg="$tmp/wg.safetensors"
"$py" -c "
import sys, numpy as np; sys.path.insert(0, sys.argv[1]); import st
r = np.random.RandomState(3)
f = lambda *s: (r.randn(*s) * 0.3).astype(np.float32)
st.save(sys.argv[2], {'q_proj_weight': f(32, 32), 'k_proj_weight': f(16, 32),
                      'v_proj_weight': f(16, 32), 'in_proj_bias': f(64),
                      'out_proj.weight': f(32, 32), 'out_proj.bias': f(32)},
        {'num_heads': '4'})" "$here/torch_live" "$Wg" ||
  bad "could not write wg.safetensors"
expect 0 "^  k_proj_weight +F32 +\(16, 32\)$" -- "$mha" info "$Wg"
npy "$d/x70.npy"  "np.random.randn(2, 70, 32).astype(np.float32)"
npy "$d/x70u.npy" "np.random.randn(70, 32).astype(np.float32)"
# close WHAT A B: same shape, equal up to float rounding
close() {
  check "$1" "a.shape == b.shape and np.abs(a - b).max() <= 2e-5 * (1 + np.abs(b).max())" "$2" "$3"
}
# a module whose values are 12 wide beside keys of 8 (mha init --v-head-dim;
# the shapes say it, info reads it back), GQA 4:2
Wdv="$dc/wdv.safetensors"
expect 0 "" -- "$mha" init --embed-dim 32 --heads 4 --kv-heads 2 --v-head-dim 12 \
  --seed 4 --out "$Wdv"
expect 0 "^module: embed_dim=32 num_heads=4 num_kv_heads=2 head_dim=8 v_head_dim=12 kdim=32 " \
  -- "$mha" info "$Wdv"
expect 0 "^  v_proj_weight +F32 +\(24, 32\)$" -- "$mha" info "$Wdv"
expect 0 "^  out_proj.weight +F32 +\(32, 48\)$" -- "$mha" info "$Wdv"
expect 1 "^mha init: v_head_dim must be >= 0|^mha init: --v-head-dim" -- \
  "$mha" init --embed-dim 32 --heads 4 --v-head-dim 0 --seed 4 --out "$dc/x.safetensors"
absent "init --v-head-dim 0 writes nothing" "$dc/x.safetensors"
for w in "$Wd" "$Wg"; do
  n=$(basename "$w" .safetensors)
  expect 0 "" -- "$mha" forward --weights "$w" --query "$d/x70.npy" --causal --out "$dc/${n}_fwd.npy"
  expect 0 "" -- "$mha" forward --weights "$w" --query "$d/x70.npy" --out "$dc/${n}_full.npy"
  check "$n: causal and full attention differ far beyond the tolerance" \
    "np.abs(a - b).max() > 1e-2 * (1 + np.abs(b).max())" "$dc/${n}_fwd.npy" "$dc/${n}_full.npy"
  for c in 1 7 70; do
    expect 0 "" -- "$mha" decode --weights "$w" --query "$d/x70.npy" --chunk $c --out "$dc/${n}_c$c.npy"
    shape "$dc/${n}_c$c.npy" "float32 (2, 70, 32)"
    close "$n: decode --chunk $c = forward --causal" "$dc/${n}_c$c.npy" "$dc/${n}_fwd.npy"
  done
  expect 0 "" -- "$mha" decode --weights "$w" --query "$d/x70.npy" --prefill 64 --chunk 3 --out "$dc/${n}_p64.npy"
  close "$n: decode --prefill 64 --chunk 3 = forward --causal" "$dc/${n}_p64.npy" "$dc/${n}_fwd.npy"
  expect 0 "" -- "$mha" forward --weights "$w" --query "$d/x70u.npy" --causal --out "$dc/${n}_ufwd.npy"
  expect 0 "" -- "$mha" decode --weights "$w" --query "$d/x70u.npy" --chunk 5 --out "$dc/${n}_u.npy"
  shape "$dc/${n}_u.npy" "float32 (70, 32)"
  close "$n: unbatched decode = forward --causal" "$dc/${n}_u.npy" "$dc/${n}_ufwd.npy"
done
# the d_v module: decoding token by token and in chunks = forward --causal
expect 0 "" -- "$mha" forward --weights "$Wdv" --query "$d/x70.npy" --causal --out "$dc/wdv_fwd.npy"
for c in 1 7; do
  expect 0 "" -- "$mha" decode --weights "$Wdv" --query "$d/x70.npy" --chunk $c --out "$dc/wdv_c$c.npy"
  close "wdv: decode --chunk $c = forward --causal" "$dc/wdv_c$c.npy" "$dc/wdv_fwd.npy"
done
# ... and through a 16-bit cache and a window's ring, whose caches the
# command creates itself (it had left d_v out of them: "the cache's values
# are 8 wide, the call's 12"); K and V rounded to f16 once when cached.
expect 0 "" -- "$mha" decode --weights "$Wdv" --query "$d/x70.npy" --chunk 7 --kv-dtype f16 --out "$dc/wdv_f16.npy"
check "wdv: decode --kv-dtype f16 = forward --causal up to f16's rounding of K, V" \
  "a.shape == b.shape and np.abs(a - b).max() <= 2e-3 * (1 + np.abs(b).max())" "$dc/wdv_f16.npy" "$dc/wdv_fwd.npy"
expect 0 "" -- "$mha" decode --weights "$Wdv" --query "$d/x70.npy" --chunk 7 --window 70 --out "$dc/wdv_win.npy"
close "wdv: decode --window 70 (every key) = forward --causal" "$dc/wdv_win.npy" "$dc/wdv_fwd.npy"
expect 0 "" -- "$mha" decode --weights "$Wd" --query "$d/x70.npy" --chunk 7 --kv-dtype f32 --out "$dc/f32.npy"
same "$dc/f32.npy" "$dc/wd_c7.npy" "--kv-dtype f32 is the default"
expect 0 "" -- "$mha" decode --weights "$Wd" --query "$d/x70.npy" --chunk 100 --prefill 200 --out "$dc/big.npy"
same "$dc/big.npy" "$dc/wd_c70.npy" "--chunk and --prefill past L: one forward"
# --threads: bitwise the same at 1 and 2 threads, with steps that thread:
# a prefill of 1024 tokens, then single tokens on 1025..1030 cached keys
# (B*H*1*Lk*d_h = 2*8*1025*64 >= 2^20, the decoding split of 512-key
# chunks).  The BLAS is pinned to one thread, as above.
Wb="$tmp/wb.safetensors"
expect 0 "" -- "$mha" init --embed-dim 512 --heads 8 --seed 8 --out "$Wb"
npy "$d/x1030.npy" "np.random.randn(2, 1030, 512).astype(np.float32)"
for t in 1 2; do
  expect 0 "" -- env OPENBLAS_NUM_THREADS=1 "$mha" decode --weights "$Wb" --query "$d/x1030.npy" \
    --prefill 1024 --chunk 1 --threads $t --out "$dc/t$t.npy"
done
same "$dc/t1.npy" "$dc/t2.npy" "decode --threads 1 vs 2"
expect 0 "" -- env OPENBLAS_NUM_THREADS=1 "$mha" forward --weights "$Wb" --query "$d/x1030.npy" \
  --causal --threads 2 --out "$dc/t_fwd.npy"
close "decode with 1030 keys = forward --causal" "$dc/t1.npy" "$dc/t_fwd.npy"
# refusals: exit 1, one line, nothing written
fail_dec() { fail_in decode "$@"; }  # fail_dec PATTERN ARGS...
dq=(--weights "$Wd" --query "$d/x70.npy" --out "$O")
for c in 0 -1 abc 2x ""; do
  fail_dec "^mha decode: --chunk must be an integer in \[1, [0-9]+\], got '$c'$" "${dq[@]}" --chunk "$c"
done
fail_dec "^mha decode: --prefill must be an integer in \[1, [0-9]+\], got '0'$" "${dq[@]}" --prefill 0
# Compact caches: the same outputs up to the rounding of K and V to the
# dtype (unit roundoff u: f16 2^-11, bf16 2^-8, q8 half a step of amax/127
# per block of 32), and not the f32 ones.  Exactness is test_kv_cache's.
for tu in f16:4.9e-4 bf16:3.9e-3 q8:3.9e-3 q4:7.2e-2; do
  t=${tu%%:*} u=${tu#*:}
  expect 0 "" -- "$mha" decode --weights "$Wd" --query "$d/x70.npy" --chunk 7 --kv-dtype $t --out "$dc/$t.npy"
  shape "$dc/$t.npy" "float32 (2, 70, 32)"
  check "--kv-dtype $t: within 16 u of the f32 cache's" \
    "np.abs(a - b).max() <= 16 * $u * (1 + np.abs(b).max())" "$dc/$t.npy" "$dc/f32.npy"
  differ "$dc/$t.npy" "$dc/f32.npy" "--kv-dtype $t rounds K and V"
done
fail_dec "^mha decode: --kv-dtype must be f32, f16, bf16, q8 or q4, got 'f64'$" "${dq[@]}" --kv-dtype f64
# --kv-rotate: the cache turned (queries and outputs alike): f32 within
# float rounding of the plain cache; q4 rotated is not q4 plain
expect 0 "" -- "$mha" decode --weights "$Wd" --query "$d/x70.npy" --chunk 7 --kv-rotate --out "$dc/rot.npy"
check "--kv-rotate: within float rounding of the f32 cache's" \
  "np.abs(a - b).max() <= 1e-5 * (1 + np.abs(b).max())" "$dc/rot.npy" "$dc/f32.npy"
expect 0 "" -- "$mha" decode --weights "$Wd" --query "$d/x70.npy" --chunk 7 --kv-dtype q4 --kv-rotate --out "$dc/q4rot.npy"
differ "$dc/q4rot.npy" "$dc/q4.npy" "--kv-rotate changes what q4 rounds"
# --window W: a sliding-window cache, a ring of W - 1 + max(P, C) slots that
# wraps around many times over 70 tokens; each query sees itself and the
# W - 1 keys before it: `mha forward` with that band as its --attn-mask
# (allow: i - W < j <= i), up to float rounding (the ring sums its keys in
# slot order).  A window of L or more is no window: while nothing wraps
# the slots are in position order, so the bits of decode without one.
band() {  # band FILE L W
  npy "$1" "(lambda i, j: (j <= i) & (j > i - $3))(np.arange($2)[:, None], np.arange($2)[None, :])"
}
for win in 1 5 20 64; do band "$dc/band$win.npy" 70 $win; done
for w in "$Wd" "$Wg"; do
  n=$(basename "$w" .safetensors)
  for win in 1 5 20 64; do
    expect 0 "" -- "$mha" forward --weights "$w" --query "$d/x70.npy" --attn-mask "$dc/band$win.npy" \
      --out "$dc/${n}_band$win.npy"
    for pc in 1:1 9:7 64:3; do
      p=${pc%%:*} c=${pc#*:}
      expect 0 "" -- "$mha" decode --weights "$w" --query "$d/x70.npy" --window $win \
        --prefill $p --chunk $c --out "$dc/${n}_w${win}_${p}_$c.npy"
      close "$n: decode --window $win --prefill $p --chunk $c = forward with the band" \
        "$dc/${n}_w${win}_${p}_$c.npy" "$dc/${n}_band$win.npy"
    done
  done
  check "$n: a window of 5 differs from causal attention beyond the tolerance" \
    "np.abs(a - b).max() > 1e-2 * (1 + np.abs(b).max())" "$dc/${n}_w5_1_1.npy" "$dc/${n}_fwd.npy"
  for win in 70 1000; do
    expect 0 "" -- "$mha" decode --weights "$w" --query "$d/x70.npy" --window $win --chunk 7 \
      --out "$dc/${n}_wide$win.npy"
    same "$dc/${n}_wide$win.npy" "$dc/${n}_c7.npy" "$n: decode --window $win (>= L) = decode without one"
  done
done
expect 0 "" -- "$mha" decode --weights "$Wd" --query "$d/x70u.npy" --window 5 --chunk 3 --out "$dc/wu.npy"
shape "$dc/wu.npy" "float32 (70, 32)"
expect 0 "" -- "$mha" forward --weights "$Wd" --query "$d/x70u.npy" --attn-mask "$dc/band5.npy" --out "$dc/wu_fwd.npy"
close "unbatched decode --window 5 = forward with the band" "$dc/wu.npy" "$dc/wu_fwd.npy"
expect 0 "" -- "$mha" decode --weights "$Wd" --query "$d/x70.npy" --window 20 --chunk 7 --kv-dtype f16 \
  --out "$dc/w20_f16.npy"
check "--window 20 --kv-dtype f16: within 16 u of the f32 ring's" \
  "np.abs(a - b).max() <= 16 * 4.9e-4 * (1 + np.abs(b).max())" "$dc/w20_f16.npy" "$dc/wd_w20_9_7.npy"
# threads: bitwise the same at 1 and 2 threads on steps that thread (1027
# slots: the keys split in chunks of 512), the ring wrapping in the last
# three steps (W = 4: a ring of 3 + 1024)
band "$dc/band4_1030.npy" 1030 4
for t in 1 2; do
  expect 0 "" -- env OPENBLAS_NUM_THREADS=1 "$mha" decode --weights "$Wb" --query "$d/x1030.npy" \
    --window 4 --prefill 1024 --chunk 1 --threads $t --out "$dc/wt$t.npy"
done
same "$dc/wt1.npy" "$dc/wt2.npy" "decode --window 4 --threads 1 vs 2"
expect 0 "" -- env OPENBLAS_NUM_THREADS=1 "$mha" forward --weights "$Wb" --query "$d/x1030.npy" \
  --attn-mask "$dc/band4_1030.npy" --threads 2 --out "$dc/wt_fwd.npy"
close "decode --window 4 over 1030 tokens = forward with the band" "$dc/wt1.npy" "$dc/wt_fwd.npy"
fail_dec "^mha decode: --window must be an integer in \[1, " "${dq[@]}" --window 0
# the modifier's LEFT,RIGHT form: a causal decoder's window of LEFT + 1
expect 0 "" -- "$mha" decode --weights "$Wd" --query "$d/x70u.npy" --window 4,0 --chunk 3 --out "$dc/wu_lr.npy"
same "$dc/wu.npy" "$dc/wu_lr.npy" "decode --window 4,0 = --window 5"
expect 0 "" -- "$mha" decode --weights "$Wd" --query "$d/x70u.npy" --window 4,-1 --chunk 3 --out "$dc/wu_lr2.npy"
same "$dc/wu.npy" "$dc/wu_lr2.npy" "decode --window 4,-1 = --window 5"
fail_dec "^mha decode: --window must be W or LEFT,RIGHT" "${dq[@]}" --window 1,2,3
fail_dec "^mha decode: --window" "${dq[@]}" --window 3,-2
fail_dec "^mha decode: --query is required" --weights "$Wd" --out "$O"
fail_dec "^mha decode: --weights is required" --query "$d/x70.npy" --out "$O"
expect 1 "^mha decode: --out is required" -- "$mha" decode --weights "$Wd" --query "$d/x70.npy"
fail_dec "^mha decode: unknown option '--causal'" "${dq[@]}" --causal
fail_dec "^mha decode: unknown option '--key'" "${dq[@]}" --key "$d/x70.npy"
fail_dec "^mha decode: --threads must be an integer in \[1, 4096\], got '0'$" "${dq[@]}" --threads 0
fail_dec "^mha decode: --query has last dimension 8, expected E = 32" --weights "$Wd" --query "$d/q.npy" --out "$O"
fail_dec "^mha decode: --query: .*missing\.npy" --weights "$Wd" --query "$d/missing.npy" --out "$O"
fail_dec "^mha decode: --weights: .*cannot open" --weights "$d/missing.safetensors" --query "$d/x70.npy" --out "$O"
fail_dec "^mha decode: the module has kdim 5, vdim 7: mha decode runs self-attention, kdim = vdim = E = 8$" \
  --weights "$Wkv" --query "$d/q.npy" --out "$O"
fail_dec "^mha decode: --out: .*nodir" --weights "$Wd" --query "$d/x70.npy" --out "$d/nodir/o.npy"
absent "decode into a missing directory" "$d/nodir"

# ---- mha bench ---------------------------------------------------------------
# jcheck WHAT EXPR -- command...: the command prints one JSON object j with EXPR
jcheck() {
  local what="$1" expr="$2"; shift 3
  local out
  if ! out=$("$@" 2>"$tmp/jcheck.err"); then
    bad "$what: $* failed: $(cat "$tmp/jcheck.err")"; return
  fi
  if "$py" -c "
import json, sys
j = json.loads(sys.argv[1])
sys.exit(0 if ($expr) else 1)" "$out" 2>/dev/null; then ok
  else bad "$what: not ($expr): $out"; fi
}
expect 0 "^usage: mha bench" -- "$mha" bench --help
expect 0 "bench +time the forward pass" -- "$mha" --help
tiny=(--batch 1 --seq 8 --embed-dim 16 --heads 2 --repeat 2)
ncpu=$(getconf _NPROCESSORS_ONLN)
# The default thread count is the online CPUs, for the attention and the BLAS.
jcheck "bench --json" "j['median_ms'] > 0 and j['min_ms'] > 0 and j['min_ms'] <= j['median_ms'] and j['gflops'] > 0 and j['peak_gflops'] > 0 and (j['batch'], j['seq'], j['kv_seq'], j['embed_dim'], j['heads'], j['head_dim']) == (1, 8, 8, 16, 2, 8) and j['causal'] is False and j['attention_only'] is False and j['threads'] == min($ncpu, 4096) == j['online_cpus'] and j['threads_default'] is True and j['blas_threads'] == j['threads'] and j['tier'] in ('avx512', 'avx2', 'scalar', 'ref') and j['repeat'] == 2 and j['warmup'] == 2" \
  -- "$mha" bench "${tiny[@]}" --json
# --threads T reaches the library and the BLAS, whatever the caller's
# environment says (mha bench re-executes itself with OPENBLAS_NUM_THREADS=T).
jcheck "bench --threads 2" "j['threads'] == 2 and j['threads_default'] is False and j['blas_threads'] == 2" \
  -- env OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "$mha" bench "${tiny[@]}" --threads 2 --json
jcheck "bench --threads 1" "j['threads'] == 1 and j['blas_threads'] == 1" \
  -- env OPENBLAS_NUM_THREADS=3 "$mha" bench "${tiny[@]}" --threads 1 --json
expect 0 "^  kernels (avx512|avx2|scalar|ref) \(mha_kernel_tier\), 2 attention threads, GEMMs (cblas|onednn) \(mha_gemm_backend\), OPENBLAS_NUM_THREADS=2$" -- "$mha" bench "${tiny[@]}" --threads 2
expect 0 "^mha bench: .*, $ncpu threads? \(default: the online CPUs\)$" -- "$mha" bench "${tiny[@]}"
expect 0 "^  timed   mha_plan_forward" -- "$mha" bench "${tiny[@]}"
# The tier follows MHA_ISA; an unknown tier is refused.
jcheck "bench: MHA_ISA=scalar" "j['tier'] == 'scalar'" -- env MHA_ISA=scalar "$mha" bench "${tiny[@]}" --json
jcheck "bench: MHA_ISA=ref" "j['tier'] == 'ref'" -- env MHA_ISA=ref "$mha" bench "${tiny[@]}" --attention-only --json
expect 1 "no attention kernels: MHA_ISA" -- env MHA_ISA=frob "$mha" bench "${tiny[@]}"
# The GEMM backend follows MHA_GEMM; an unknown one is refused, by the
# bench and by every command that projects.
jcheck "bench: MHA_GEMM=cblas" "j['gemm'] == 'cblas'" -- env MHA_GEMM=cblas "$mha" bench "${tiny[@]}" --json
expect 1 "no GEMM backend: MHA_GEMM=frob: expected cblas or onednn" -- env MHA_GEMM=frob "$mha" bench "${tiny[@]}"
if env MHA_GEMM=onednn "$mha" bench "${tiny[@]}" --json > /dev/null 2>&1; then
  jcheck "bench: MHA_GEMM=onednn" "j['gemm'] == 'onednn'" -- env MHA_GEMM=onednn "$mha" bench "${tiny[@]}" --json
else
  expect 1 "MHA_GEMM=onednn, but this libmha was built without oneDNN" -- env MHA_GEMM=onednn "$mha" bench "${tiny[@]}"
fi
# avx512 runs where the CPU has AVX-512F (and its peak probe is then the
# AVX-512 one); elsewhere asking for it is refused by name.
if grep -qw avx512f /proc/cpuinfo; then
  jcheck "bench: MHA_ISA=avx512" "j['tier'] == 'avx512' and j['probe'] == 'AVX-512'" -- env MHA_ISA=avx512 "$mha" bench "${tiny[@]}" --json
  jcheck "bench: MHA_ISA=avx2 probes AVX2" "j['tier'] == 'avx2' and j['probe'] == 'AVX2+FMA'" -- env MHA_ISA=avx2 "$mha" bench "${tiny[@]}" --json
else
  expect 1 "MHA_ISA=avx512, but this CPU or OS lacks its instructions" -- env MHA_ISA=avx512 "$mha" bench "${tiny[@]}"
fi
# FLOP counts: projections 2*4*16*16 (Q) + 2*6*16*32 (K, V) + 2*4*16*16 (out)
# = 10240; causal bottom right with Lq=4, Lk=6 allows 3+4+5+6 = 18 pairs:
# attention 4*H*d_h*18 = 1152.
jcheck "bench --causal --kv-seq: exact FLOP counts" "j['causal'] is True and j['need_weights'] is True and j['kv_seq'] == 6 and abs(j['proj_gflop'] - 10240e-9) < 1e-15 and abs(j['attn_gflop'] - 1152e-9) < 1e-15 and abs(j['gflop'] - 11392e-9) < 1e-15" \
  -- "$mha" bench --batch 1 --seq 4 --kv-seq 6 --embed-dim 16 --heads 2 --causal --need-weights --repeat 1 --warmup 0 --threads 1 --json
jcheck "bench: self-attention attention FLOPs 4*B*H*L*L*d_h" "abs(j['attn_gflop'] - 4*3*2*5*5*8e-9) < 1e-15" \
  -- "$mha" bench --batch 3 --seq 5 --embed-dim 16 --heads 2 --repeat 1 --json
# --attention-only: mha_attention on projected heads, no projection FLOPs.
jcheck "bench --attention-only" "j['attention_only'] is True and j['proj_gflop'] == 0 and abs(j['attn_gflop'] - 4*3*2*5*5*8e-9) < 1e-15 and j['gflop'] == j['attn_gflop'] and j['gflops'] > 0 and j['threads'] == 2 and j['tier'] in ('avx512', 'avx2', 'scalar', 'ref')" \
  -- "$mha" bench --batch 3 --seq 5 --embed-dim 16 --heads 2 --repeat 1 --attention-only --threads 2 --json
jcheck "bench --attention-only --causal --kv-seq --need-weights: exact pairs" "j['attention_only'] is True and j['causal'] is True and j['need_weights'] is True and j['proj_gflop'] == 0 and abs(j['attn_gflop'] - 1152e-9) < 1e-15" \
  -- "$mha" bench --batch 1 --seq 4 --kv-seq 6 --embed-dim 16 --heads 2 --causal --need-weights --attention-only --repeat 1 --warmup 0 --json
# --backward: mha_plan_forward + mha_plan_backward per timed call; the
# backward adds 2x the projections' FLOPs and 2.5x the attention's.
jcheck "bench --backward --json" "j['backward'] is True and j['median_ms'] > 0 and j['min_ms'] <= j['median_ms'] and j['gflops'] > 0 and j['attention_only'] is False" \
  -- "$mha" bench "${tiny[@]}" --backward --json
jcheck "bench without --backward" "j['backward'] is False" -- "$mha" bench "${tiny[@]}" --json
jcheck "bench --backward --causal --kv-seq: FLOPs 3x projections, 3.5x attention" "j['backward'] is True and abs(j['proj_gflop'] - 3 * 10240e-9) < 1e-15 and abs(j['attn_gflop'] - 3.5 * 1152e-9) < 1e-15 and abs(j['gflop'] - (3 * 10240 + 3.5 * 1152) * 1e-9) < 1e-15" \
  -- "$mha" bench --batch 1 --seq 4 --kv-seq 6 --embed-dim 16 --heads 2 --causal --need-weights --backward --repeat 1 --warmup 0 --threads 1 --json
expect 0 "^  timed   mha_plan_forward \+ mha_plan_backward" -- "$mha" bench "${tiny[@]}" --backward
expect 0 "^  work    .* per forward \+ backward" -- "$mha" bench "${tiny[@]}" --backward --kv-seq 5
# --attention-only --backward: a planned mha_attention_plan_run then
# mha_attention_plan_backward; each half's median apart, the backward's
# GFLOP/s from its own 2.5x the attention's FLOPs (10*d_h per pair).
jcheck "bench --attention-only --backward --causal --kv-seq: 3.5x attention, the backward's half" "j['attention_only'] is True and j['backward'] is True and j['proj_gflop'] == 0 and abs(j['attn_gflop'] - 3.5 * 1152e-9) < 1e-15 and 0 < j['forward_ms'] <= j['median_ms'] and 0 < j['backward_ms'] <= j['median_ms'] and abs(j['backward_gflops'] / (2.5 * 1152e-9 / (j['backward_ms'] * 1e-3)) - 1) < 1e-4 and abs(j['backward_percent'] / (100 * j['backward_gflops'] / j['peak_gflops']) - 1) < 1e-3" \
  -- "$mha" bench --batch 1 --seq 4 --kv-seq 6 --embed-dim 16 --heads 2 --causal --attention-only --backward --repeat 3 --warmup 1 --threads 1 --json
jcheck "bench --backward: the backward's half counts 2x projections + 2.5x attention" "abs(j['backward_gflops'] / ((2 * 10240 + 2.5 * 1152) * 1e-9 / (j['backward_ms'] * 1e-3)) - 1) < 1e-4 and j['forward_ms'] <= j['median_ms']" \
  -- "$mha" bench --batch 1 --seq 4 --kv-seq 6 --embed-dim 16 --heads 2 --causal --backward --repeat 3 --warmup 1 --threads 1 --json
jcheck "bench without --backward: no backward half" "'backward_ms' not in j and j['forward_ms'] > 0" -- "$mha" bench "${tiny[@]}" --attention-only --json
expect 0 "^  timed   mha_attention_plan_run \+ mha_attention_plan_backward on projected q, k, v \(attention only, planned once\)$" -- "$mha" bench "${tiny[@]}" --backward --attention-only
expect 0 "^  halves  forward median [0-9.]+ ms; backward median [0-9.]+ ms, .* GFLOP/s = [0-9.]+% of peak$" -- "$mha" bench "${tiny[@]}" --backward --attention-only
expect 0 "^  speed   [0-9.]+ GFLOP/s at the median" -- "$mha" bench "${tiny[@]}" --attention-only
expect 0 "^  timed   mha_attention on projected q, k, v \(attention only\)$" -- "$mha" bench "${tiny[@]}" --attention-only
expect 0 "^  time +median [0-9.]+ ms, min [0-9.]+ ms over 2 runs" -- "$mha" bench "${tiny[@]}"
expect 0 "of peak" -- "$mha" bench "${tiny[@]}"
expect 1 "embed_dim 16 is not divisible by num_heads 3" -- "$mha" bench --batch 1 --seq 8 --embed-dim 16 --heads 3
expect 1 "embed_dim 16 is not divisible by num_heads 3" -- "$mha" bench --batch 1 --seq 8 --embed-dim 16 --heads 3 --attention-only
expect 1 "--repeat must be an integer in \[1, " -- "$mha" bench "${tiny[@]:0:8}" --repeat 0
expect 1 "--seq must be an integer in \[1, .*got 'abc'" -- "$mha" bench --batch 1 --seq abc --embed-dim 16 --heads 2
expect 1 "--warmup must be an integer in \[0, " -- "$mha" bench "${tiny[@]}" --warmup -1
expect 1 "--batch must be an integer" -- "$mha" bench --batch 0 --seq 8 --embed-dim 16 --heads 2
expect 1 "--heads is required" -- "$mha" bench --batch 1 --seq 8 --embed-dim 16
for t in 0 -1 abc 5000 2x ""; do
  expect 1 "--threads must be an integer in \[1, 4096\]" -- "$mha" bench "${tiny[@]}" --threads "$t"
done
expect 1 "unknown option '--frob'" -- "$mha" bench "${tiny[@]}" --frob
expect 1 "option --json takes no value" -- "$mha" bench "${tiny[@]}" --json=1

# --decode: one decoding step on a cache of Lk tokens.  kv_bytes is
# kv_keys*H_kv*d_h*2*4, kv_keys = B*Lk; kv_gbps, read_percent and
# weight_bytes follow from the other fields, the paired steps' roofline
# share lies within its range (weight_bytes: every parameter
# of the E=32, H=4, H_kv=2 module, 4*(32*32 + 2*16*32 + 64 + 32*32 + 32)).
# Each run takes warm-up + 2 x repeat = 7 steps (the paired ones too) on a
# cache of room Lk + Lq: a step that left its tokens in the cache would
# overflow it at the second.  --read-mib 64: a read probe of 64 MiB, not
# the default max(1 GiB, 4x L3), which one run below checks (a GiB's
# first touch and five passes cost ~5 s a run under ASan).
dec=(--decode --kv-seq 100 --embed-dim 32 --heads 4 --kv-heads 2 --repeat 3 --warmup 1 --read-mib 64)
jdec_any="j['decode'] is True and j['kv_dtype'] == 'f32' and j['tier'] in ('avx512', 'avx2', 'scalar', 'ref') and j['median_ms'] > 0 and 0 < j['min_ms'] <= j['median_ms'] and j['repeat'] == 3 and j['warmup'] == 1 and abs(j['kv_gbps'] - j['kv_bytes'] / (j['median_ms'] * 1e-3) * 1e-9) <= 1e-4 * j['kv_gbps'] and j['read_gbps'] > 0 and j['read_bytes'] == 64 << 20 and abs(j['read_percent'] - 100 * j['kv_gbps'] / j['read_gbps']) <= 1e-4 * j['read_percent'] and j['kv_bytes'] == j['kv_keys'] * 2 * 8 * 2 * 4 and abs(j['memory_ms'] - (j['kv_bytes'] + j['weight_bytes']) / (j['read_gbps'] * 1e9) * 1e3) <= 1e-4 * j['memory_ms'] and j['paired_median_ms'] > 0 and j['paired_read_gbps'] > 0 and j['paired_read_percent'] > 0 and 0 < j['paired_roofline_lo'] <= j['paired_roofline_percent'] <= j['paired_roofline_hi'] and 0 < j['paired_pass_bytes'] <= j['read_bytes'] and j['paired_pass_bytes'] % 65536 == 0"
jdec="$jdec_any and j['attention_only'] is False and j['weight_bytes'] == 4 * 3168"
jdec_attn="$jdec_any and j['attention_only'] is True and j['weight_bytes'] == 0"
jcheck "bench --decode --json" "$jdec and j['ragged'] is False and (j['batch'], j['seq'], j['kv_seq'], j['embed_dim'], j['heads'], j['kv_heads'], j['head_dim']) == (1, 1, 100, 32, 4, 2, 8) and j['kv_keys'] == 100 and j['kv_bytes'] == 1 * 100 * 2 * 8 * 2 * 4 and j['threads'] == 1 == j['blas_threads']" \
  -- "$mha" bench "${dec[@]}" --threads 1 --json
jcheck "bench --decode --batch 3 --seq 2 --json" "$jdec and (j['batch'], j['seq'], j['kv_seq']) == (3, 2, 100) and j['kv_keys'] == 300 and j['kv_bytes'] == 3 * 100 * 2 * 8 * 2 * 4 and j['threads'] == 2 == j['blas_threads']" \
  -- "$mha" bench "${dec[@]}" --batch 3 --seq 2 --threads 2 --json
expect 0 "^  memory  [0-9.]+ GB/s streaming read \(64 MiB, 1 thread, best of 5\): the step reaches [0-9.]+%$" -- "$mha" bench "${dec[@]}" --threads 1
# Without --read-mib the probe reads at least a GiB (and 4x the L3).
jcheck "bench --decode: the read probe's default buffer" "j['read_gbps'] > 0 and j['read_bytes'] >= 2**30 and j['paired_read_gbps'] > 0" \
  -- "$mha" bench "${dec[@]:0:13}" --threads 1 --json
expect 1 "^mha bench: --read-mib must be an integer in \[1, 1048576\]" -- "$mha" bench "${dec[@]:0:13}" --read-mib 0
expect 1 "^mha bench: --read-mib needs --decode$" -- "$mha" bench "${tiny[@]}" --read-mib 64
expect 1 "^mha bench: --read-mib 1048576 is more than half this machine's [0-9]+ MiB of memory$" -- "$mha" bench "${dec[@]:0:13}" --read-mib 1048576
expect 0 "^          pass around each [0-9.]+ GB/s: read [0-9.]+%, roofline [0-9.]+% \([0-9.]+-[0-9.]+\)$" -- "$mha" bench "${dec[@]}" --threads 1
expect 0 "^  paired  3 more steps, each between two read passes of [0-9.]+ MiB \(its bytes, at$" -- "$mha" bench "${dec[@]}" --threads 1
# --attention-only: mha_attention on the cache, no module, no weights read.
jcheck "bench --decode --attention-only --json" "$jdec_attn and j['ragged'] is False and (j['batch'], j['seq'], j['kv_seq'], j['kv_heads'], j['head_dim']) == (2, 1, 100, 2, 8) and j['kv_keys'] == 200 and j['kv_bytes'] == 2 * 100 * 2 * 8 * 2 * 4" \
  -- "$mha" bench "${dec[@]}" --batch 2 --attention-only --threads 1 --json
expect 0 "^  timed   mha_attention_plan_decode: 1 new token per sequence on 100 cached$" -- "$mha" bench "${dec[@]}" --attention-only --threads 1
# --ragged: sequence b of B holds round(Lk*(b+1)/B) keys, halves up.  The
# sums, written here as floor((2*Lk*(b+1) + B) / (2B)): B = 3, Lk = 100:
# 33 + 67 + 100 = 200; B = 8: 13 + 25 + 38 + 50 + 63 + 75 + 88 + 100 = 452.
ragged_sum() { "$py" -c "import sys; Lk, B = map(int, sys.argv[1:]); print(sum((2 * Lk * (b + 1) + B) // (2 * B) for b in range(B)))" "$@"; }
r3=$(ragged_sum 100 3); r8=$(ragged_sum 100 8)
if [ "$r3" = 200 ] && [ "$r8" = 452 ]; then ok; else bad "ragged sums $r3, $r8: expected 200, 452"; fi
jcheck "bench --decode --ragged --batch 3 --seq 2" "$jdec and j['ragged'] is True and j['batch'] == 3 and j['kv_keys'] == $r3 and j['kv_bytes'] == $r3 * 2 * 8 * 2 * 4" \
  -- "$mha" bench "${dec[@]}" --ragged --batch 3 --seq 2 --threads 1 --json
jcheck "bench --decode --attention-only --ragged --batch 8 --seq 2" "$jdec_attn and j['ragged'] is True and (j['batch'], j['seq']) == (8, 2) and j['kv_keys'] == $r8 and j['kv_bytes'] == $r8 * 2 * 8 * 2 * 4" \
  -- "$mha" bench "${dec[@]}" --attention-only --ragged --batch 8 --seq 2 --threads 2 --json
expect 0 "^          ragged: 13 to 100 keys per sequence, 452 in all$" -- "$mha" bench "${dec[@]}" --attention-only --ragged --batch 8 --threads 1
# --paged: a pool of just the pages the sequences fill, the bytes held
# against the tokens' (f32, H_kv 2, d_h 8: 64 bytes a token's K or V):
# 3 sequences of 100 keys + 2 new take 2 pages of 64 each (6 pages of 64
# positions x 2 heads x 8 x 4 bytes x K and V = 49152 bytes held once
# filled with 300 tokens of 300 * 128 bytes).  --shared-prefix 64: the
# first 64 keys of each are sequence 0's, one page stored and counted once
# (kv_keys 300 - 2 * 64; 4 pages held), the step one ragged call; a
# prefix of 40, no whole page, is copied by each fork's first append.
jcheck "bench --decode --paged --batch 3" "$jdec_attn and j['page_size'] == 64 and j['shared_prefix'] == 0 and j['kv_keys'] == 300 and j['token_bytes'] == 300 * 2 * 2 * 8 * 4 and j['cache_bytes'] == 6 * 64 * 2 * 2 * 8 * 4" \
  -- "$mha" bench "${dec[@]}" --attention-only --paged --batch 3 --threads 2 --json
jcheck "bench --decode --paged --shared-prefix 64 --batch 3 --seq 2" "$jdec_attn and j['page_size'] == 64 and j['shared_prefix'] == 64 and j['kv_keys'] == 300 - 2 * 64 and j['token_bytes'] == 300 * 2 * 2 * 8 * 4 and j['cache_bytes'] == 4 * 64 * 2 * 2 * 8 * 4" \
  -- "$mha" bench "${dec[@]}" --attention-only --paged --shared-prefix 64 --batch 3 --seq 2 --threads 2 --json
jcheck "bench --decode --paged --page-size 128 --shared-prefix 40 --batch 3" "$jdec_attn and j['page_size'] == 128 and j['shared_prefix'] == 40 and j['kv_keys'] == 300 and j['cache_bytes'] == 3 * 128 * 2 * 2 * 8 * 4" \
  -- "$mha" bench "${dec[@]}" --attention-only --paged --page-size 128 --shared-prefix 40 --batch 3 --threads 1 --json
expect 0 "^  pages   6 of 64 positions: 0.0 MiB held for 0.0 MiB of tokens \(1.2800x\)$" -- "$mha" bench "${dec[@]}" --attention-only --paged --batch 3 --threads 1
# pages of 16: 3 x ceil(101 / 16) = 21 pages (the step's token included)
jcheck "bench --decode --paged --page-size 16 --batch 3" "$jdec_attn and j['page_size'] == 16 and j['kv_keys'] == 300 and j['cache_bytes'] == 21 * 16 * 2 * 2 * 8 * 4" \
  -- "$mha" bench "${dec[@]}" --attention-only --paged --page-size 16 --batch 3 --threads 2 --json
expect 1 "^mha bench: --page-size needs --paged$" -- "$mha" bench "${dec[@]}" --page-size 64
# --v-head-dim: values of another width (H_kv 1, d_h 24, d_v 16: a key's
# and a value's 24 + 16 floats a token); --kv-latent: the values the
# keys' first 16, stored once (24 f16 a token).  The arithmetic bound is
# the larger of the element probe's and the multiply-adds' (2 flops x 100
# keys x 4 rows x (24 + 16)) at the FMA probe's rate.
jvw="j['decode'] is True and j['attention_only'] is True and (j['heads'], j['kv_heads'], j['head_dim'], j['v_head_dim']) == (4, 1, 24, 16) and j['median_ms'] > 0 and j['fma_gflops'] > 0 and abs(j['fma_ms'] - 2 * 100 * 4 * 40 / (j['fma_gflops'] * 1e9) * 1e3) <= 1e-4 * j['fma_ms'] and j['arith_ms'] == max(j['elem_ms'], j['fma_ms'])"
jcheck "bench --decode --v-head-dim" "$jvw and j['kv_latent'] is False and j['kv_bytes'] == 100 * (24 + 16) * 4" \
  -- "$mha" bench --decode --attention-only --kv-seq 100 --embed-dim 96 --heads 4 --kv-heads 1 --v-head-dim 16 --repeat 3 --warmup 1 --read-mib 64 --threads 1 --json
jcheck "bench --decode --kv-latent" "$jvw and j['kv_latent'] is True and j['kv_dtype'] == 'f16' and j['kv_bytes'] == 100 * 24 * 2" \
  -- "$mha" bench --decode --attention-only --kv-seq 100 --embed-dim 96 --heads 4 --kv-heads 1 --v-head-dim 16 --kv-latent --kv-dtype f16 --repeat 3 --warmup 1 --read-mib 64 --threads 2 --json
# in pages of 64: two pages of 64 keys of 24 f16 held for the 100 tokens
jcheck "bench --decode --kv-latent --paged" "$jvw and j['kv_latent'] is True and j['page_size'] == 64 and j['token_bytes'] == 100 * 24 * 2 and j['cache_bytes'] == 2 * 64 * 24 * 2" \
  -- "$mha" bench --decode --attention-only --kv-seq 100 --embed-dim 96 --heads 4 --kv-heads 1 --v-head-dim 16 --kv-latent --kv-dtype f16 --paged --repeat 3 --warmup 1 --read-mib 64 --threads 2 --json
expect 0 "^  fma     [0-9.]+ GFLOP/s \(.* multiply-add probe, 1 thread\): the step's multiply-adds$" -- "$mha" bench --decode --attention-only --kv-seq 100 --embed-dim 96 --heads 4 --kv-heads 1 --v-head-dim 16 --kv-latent --repeat 1 --threads 1 --read-mib 64
expect 1 "^mha bench: --v-head-dim needs --attention-only" -- "$mha" bench "${dec[@]}" --v-head-dim 4
expect 1 "^mha bench: --kv-latent needs --attention-only" -- "$mha" bench "${dec[@]}" --kv-latent
expect 1 "^mha bench: --kv-latent needs --decode$" -- "$mha" bench "${tiny[@]}" --kv-latent
expect 1 "^mha bench: --v-head-dim needs --decode$" -- "$mha" bench "${tiny[@]}" --v-head-dim 4
expect 1 "^mha bench: --kv-latent with --kv-dtype q4: unsupported: a latent cache .*no rotation" -- "$mha" bench "${dec[@]}" --attention-only --kv-latent --kv-dtype q4 --kv-rotate
# q8 and q4 latent caches: 24 code bytes (q4: 12) and one block's scale
# (4 bytes) a token
jcheck "bench --decode --kv-latent --kv-dtype q8" "$jvw and j['kv_latent'] is True and j['kv_dtype'] == 'q8' and j['kv_bytes'] == 100 * (24 + 4)" \
  -- "$mha" bench --decode --attention-only --kv-seq 100 --embed-dim 96 --heads 4 --kv-heads 1 --v-head-dim 16 --kv-latent --kv-dtype q8 --repeat 3 --warmup 1 --read-mib 64 --threads 2 --json
jcheck "bench --decode --kv-latent --kv-dtype q4" "$jvw and j['kv_latent'] is True and j['kv_dtype'] == 'q4' and j['kv_bytes'] == 100 * (12 + 4)" \
  -- "$mha" bench --decode --attention-only --kv-seq 100 --embed-dim 96 --heads 4 --kv-heads 1 --v-head-dim 16 --kv-latent --kv-dtype q4 --repeat 3 --warmup 1 --read-mib 64 --threads 2 --json
expect 1 "^mha bench: --shared-prefix needs --paged and --attention-only$" -- "$mha" bench "${dec[@]}" --paged --shared-prefix 10
expect 1 "^mha bench: --shared-prefix 101 is longer than sequence 0's 100 keys$" -- "$mha" bench "${dec[@]}" --attention-only --paged --shared-prefix 101
expect 1 "^mha bench: KV cache: invalid argument: cache page_size 100: expected 0" -- "$mha" bench "${dec[@]}" --paged --page-size 100
expect 1 "^mha bench: --paged needs --decode$" -- "$mha" bench "${tiny[@]}" --paged
expect 1 "^mha bench: --decode excludes --backward$" -- "$mha" bench "${dec[@]}" --backward
expect 1 "^mha bench: --decode excludes --need-weights$" -- "$mha" bench "${dec[@]}" --need-weights
expect 1 "^mha bench: --kv-seq is required" -- "$mha" bench --decode --embed-dim 32 --heads 4
expect 1 "^mha bench: --kv-heads needs --decode$" -- "$mha" bench "${tiny[@]}" --kv-heads 1
expect 1 "^mha bench: --kv-dtype needs --decode$" -- "$mha" bench "${tiny[@]}" --kv-dtype f32
expect 1 "^mha bench: --ragged needs --decode$" -- "$mha" bench "${tiny[@]}" --ragged
expect 1 "^mha bench: option --ragged takes no value$" -- "$mha" bench "${dec[@]}" --ragged=1
expect 0 "f16 cache" -- "$mha" bench "${dec[@]}" --kv-dtype f16
expect 1 "^mha bench: --kv-dtype must be f32, f16, bf16, q8 or q4, got 'x'$" -- "$mha" bench "${dec[@]}" --kv-dtype x
expect 1 "^mha bench: num_kv_heads 3 must divide num_heads 4" -- "$mha" bench --decode --kv-seq 8 --embed-dim 32 --heads 4 --kv-heads 3
expect 1 "^mha bench: num_kv_heads 3 must divide num_heads 4" -- "$mha" bench --decode --kv-seq 8 --embed-dim 32 --heads 4 --kv-heads 3 --attention-only
expect 1 "^mha bench: --kv-seq must be an integer in \[1, " -- "$mha" bench --decode --kv-seq 0 --embed-dim 32 --heads 4

# ---- mha viz -----------------------------------------------------------------
# tests/check_viz.py: every --ascii cell's shade and every --png cell's colour
# against NumPy float64 (the seeds' worked example, a max-pooled 300-token
# causal map) and mha forward's weights (masks, batch items, extra keys,
# dropout); the PNG decoded by libpng (png_probe) to the expected size.
expect 0 "^usage: mha viz" -- "$mha" viz --help
expect 0 "MAX-POOLED" -- "$mha" viz --help
expect 0 "viz +every head's attention weights" -- "$mha" --help
probe="${2:-}"
if [ -z "$probe" ]; then
  bad "mha viz --png untested: libpng is missing (scripts/install-deps.sh installs libpng-dev)"
elif "$py" "$here/check_viz.py" "$mha" "$probe" "$tmp/viz"; then ok
else bad "mha viz disagrees with NumPy"; fi
printf 'a b\n' > "$d/tok2.txt"; printf 'a\nb\nc\n' > "$d/tok3.txt"
printf 'a\n\nc\n' > "$d/tok3b.txt"; printf 'w x y z\n' > "$d/tok4.txt"
npy "$d/m_b3.npy" "np.ones((3, 3, 3), bool)"
npy "$d/m_r1.npy" "np.ones((3,), bool)"
npy "$d/m_r5.npy" "np.ones((1, 1, 1, 3, 3), bool)"
npy "$d/m_lq2.npy" "np.ones((2, 3), bool)"
npy "$d/km_r3.npy" "np.ones((2, 1, 3), bool)"
fail_viz() { fail_in viz "$@"; }  # fail_viz PATTERN ARGS...: nothing written
P="$d/out/h.png"
vz=(--weights "$W" --query "$d/q.npy")
fail_viz "^mha viz: say where to draw: --png FILE and/or --ascii" "${vz[@]}"
fail_viz "^mha viz: --png needs a file name" "${vz[@]}" --png=
fail_viz "^mha viz: --weights is required" --query "$d/q.npy" --png "$P"
fail_viz "^mha viz: unknown option '--out'" "${vz[@]}" --out "$P"
fail_viz "^mha viz: option --ascii takes no value" "${vz[@]}" --ascii=1
fail_viz "^mha viz: --batch-index 2 is out of range: the query has batch 2 \(items 0\.\.1\)" \
  "${vz[@]}" --png "$P" --batch-index 2
fail_viz "^mha viz: --batch-index 1 is out of range: the query has batch 1" \
  --weights "$W" --query "$d/q1.npy" --png "$P" --batch-index 1
fail_viz "^mha viz: --batch-index must be an integer in \[0, .*got '-1'" "${vz[@]}" --png "$P" --batch-index -1
fail_viz "^mha viz: --tokens .*tok2\.txt has 2 tokens, but the query has 3 positions" \
  "${vz[@]}" --png "$P" --tokens "$d/tok2.txt"
fail_viz "^mha viz: --tokens: cannot open .*missing\.txt" "${vz[@]}" --png "$P" --tokens "$d/missing.txt"
# the tokens are checked before the forward pass (which would refuse the mask)
fail_viz "^mha viz: --tokens .*tok2\.txt has 2 tokens, but the query has 3 positions" \
  "${vz[@]}" --png "$P" --tokens "$d/tok2.txt" --attn-mask "$d/m_bad.npy"
fail_viz "^mha viz: --key-tokens needs --key" "${vz[@]}" --png "$P" --key-tokens "$d/tok3.txt"
fail_viz "^mha viz: --key-tokens .*tok3\.txt has 3 tokens, but the key has 4 positions" \
  "${vz[@]}" --key "$d/k.npy" --png "$P" --key-tokens "$d/tok3.txt"
fail_viz "^mha viz: --query has last dimension 5, expected E = 8" --weights "$W" --query "$d/q5.npy" --png "$P"
fail_viz "^mha viz: --attn-mask has last dimensions \(3, 5\), expected \(Lq=3, Lk=3\)" \
  "${vz[@]}" --png "$P" --attn-mask "$d/m_bad.npy"
fail_viz "^mha viz: --attn-mask has batch 3, the query 2" "${vz[@]}" --png "$P" --attn-mask "$d/m_b3.npy"
fail_viz "^mha viz: --block-mask has batch 3, the query 2" "${vz[@]}" --png "$P" --block-mask "$d/m_b3.npy"
# Masks are sliced by their rows: their shapes are checked first (a rank-1
# mask once overran the slice's buffer; rank 5 read past shape[3]).
fail_viz "^mha viz: --attn-mask must have 2, 3 or 4 dimensions \(\(Lq,Lk\), \(B,Lq,Lk\) or \(B,H,Lq,Lk\)\), got 1$" "${vz[@]}" --png "$P" --attn-mask "$d/m_r1.npy"
fail_viz "^mha viz: --attn-mask must have 2, 3 or 4 dimensions .*got 5$" "${vz[@]}" --png "$P" --attn-mask "$d/m_r5.npy"
fail_viz "^mha viz: --block-mask has last dimensions \(2, 3\), expected \(Lq=3, Lk=3\)$" "${vz[@]}" --png "$P" --block-mask "$d/m_lq2.npy"
fail_viz "^mha viz: --key-mask must have 1 or 2 dimensions \(\(Lk\) or \(B,Lk\)\), got 3$" "${vz[@]}" --png "$P" --key-mask "$d/km_r3.npy"
fail_viz "^mha viz: key_lengths\[1\] = 9 is outside \[0, Lk=3\]" \
  "${vz[@]}" --png "$P" --key-lengths "$d/kl_oob.npy" --batch-index 1
fail_viz "^mha viz: --causal and --causal-top-left exclude each other" "${vz[@]}" --png "$P" --causal --causal-top-left
fail_viz "^mha viz: --png: cannot create .*nodir/h\.png" "${vz[@]}" --png "$d/nodir/h.png"
absent "viz into a missing directory" "$d/nodir"
# A failed rename (the name is a directory) leaves no temporary file.
mkdir -p "$d/vz/h.png"
expect 1 "^mha viz: --png: cannot write .*h\.png" -- "$mha" viz "${vz[@]}" --png "$d/vz/h.png"
if [ "$(ls -A "$d/vz")" = "h.png" ]; then ok; else bad "viz left $(ls -A "$d/vz")"; fi
# The image is saved by the library's rules (mha_file_save): a symbolic
# link is followed to its target, an existing file keeps its mode.
mkdir -p "$d/vzl" && ln -s target.png "$d/vzl/link.png"
expect 0 "^mha viz: wrote " -- "$mha" viz "${vz[@]}" --png "$d/vzl/link.png"
if [ -L "$d/vzl/link.png" ] && [ "$(head -c 4 "$d/vzl/target.png" | tail -c 3)" = "PNG" ]
then ok; else bad "viz replaced the symbolic link or missed its target"; fi
# Into a pipe: the image alone reaches it (the summary line goes to
# stderr), byte for byte the file's; with --ascii on stdout too, refused.
"$mha" viz "${vz[@]}" --png "$d/vzl/file.png" > /dev/null
"$mha" viz "${vz[@]}" --png /dev/fd/1 2> "$d/vzl/err.txt" | cat > "$d/vzl/piped.png"
same "$d/vzl/piped.png" "$d/vzl/file.png" "viz --png /dev/fd/1 into a pipe"
if grep -q "^mha viz: wrote /dev/fd/1: " "$d/vzl/err.txt"; then ok
else bad "viz into a pipe: no summary on stderr: $(cat "$d/vzl/err.txt")"; fi
out=$("$mha" viz "${vz[@]}" --png /dev/fd/1 --ascii 2>&1 | cat)
if grep -q "^mha viz: --png /dev/fd/1 is standard output, where --ascii writes its text" <<<"$out"
then ok; else bad "viz --png /dev/fd/1 --ascii not refused: $out"; fi
touch "$d/vzl/m.png" && chmod 600 "$d/vzl/m.png"
expect 0 "^mha viz: wrote " -- "$mha" viz "${vz[@]}" --png "$d/vzl/m.png"
if [ "$(stat -c %a "$d/vzl/m.png")" = 600 ]; then ok
else bad "viz changed the mode of m.png to $(stat -c %a "$d/vzl/m.png")"; fi
# Success: tokens with a blank line, the file replaced, no temporary left.
expect 0 "^mha viz: wrote .*/vz/a\.png: [0-9]+ x [0-9]+ px, 2 heads and their mean, 3 x 3 cells of 32 px, colour scale 0\.\." \
  -- "$mha" viz "${vz[@]}" --png "$d/vz/a.png" --tokens "$d/tok3b.txt"
expect 0 "^mha viz: wrote " -- "$mha" viz "${vz[@]}" --png "$d/vz/a.png" --batch-index 1 --causal
if [ "$(ls -A "$d/vz" | sort | tr '\n' ' ')" = "a.png h.png " ]; then ok
else bad "viz left $(ls -A "$d/vz")"; fi
expect 0 "^a \[ " -- "$mha" viz "${vz[@]}" --ascii --tokens "$d/tok3b.txt"
expect 0 "^_ \[ " -- "$mha" viz "${vz[@]}" --ascii --tokens "$d/tok3b.txt"
expect 0 "^    w x y z " -- "$mha" viz "${vz[@]}" --key "$d/k.npy" --ascii --key-tokens "$d/tok4.txt"
expect 0 "^batch item 1: 2 heads, 3 queries \(rows\) x 5 keys \(columns\)$" \
  -- "$mha" viz --weights "$W" --query "$d/q.npy" --key "$d/k.npy" --add-zero-attn --ascii --batch-index 1
# Panels side by side up to $COLUMNS: 3 at 80 columns, 1 at 20.
# Heads numbered from 0, as --head-mask and --keep count them.
expect 0 "^head 0 +head 1 +mean +$" -- "$mha" viz "${vz[@]}" --ascii
expect 0 "^largest w: head 0 [0-9.]+, head 1 [0-9.]+, mean [0-9.]+$" -- "$mha" viz "${vz[@]}" --ascii
expect 0 "^mean +$" -- env COLUMNS=20 "$mha" viz "${vz[@]}" --ascii

# ---- head masks and mha prune ------------------------------------------------
# W has 2 heads of 4 over E = 8; a 4-head module shows reordering.
W4="$tmp/w4.safetensors"
expect 0 "" -- "$mha" init --embed-dim 8 --heads 4 --seed 3 --out "$W4"
expect 0 "^kept 2 of 4 heads \(3,1\): heads' width 8 -> 4, 288 -> 148 parameters$" \
  -- "$mha" prune --weights "$W4" --keep 3,1 --out "$d/p31.safetensors"
expect 0 "^module: embed_dim=8 num_heads=2 num_kv_heads=2 head_dim=2 v_head_dim=2 kdim=8 vdim=8 " -- "$mha" info "$d/p31.safetensors"
expect 0 "^  out_proj\.weight +F32 +\(8, 4\)$" -- "$mha" info "$d/p31.safetensors"
expect 0 "" -- "$mha" forward --weights "$W4" --query "$d/q.npy" --head-mask 0,1,0,1 --out "$d/abl.npy"
expect 0 "" -- "$mha" forward --weights "$d/p31.safetensors" --query "$d/q.npy" --out "$d/pr.npy"
expect 0 "" -- "$mha" forward --weights "$W4" --query "$d/q.npy" --head-mask 1,1,1,1 --out "$d/ones.npy"
expect 0 "" -- "$mha" forward --weights "$W4" --query "$d/q.npy" --out "$d/plain.npy"
same "$d/ones.npy" "$d/plain.npy" "a head mask of ones"
# dL/d head_mask: the output is linear in each m_h, so a central difference
# of sum(dy * out) with any step is exact up to rounding.
npy "$d/dy.npy" "np.random.randn(2, 3, 8).astype(np.float32)"
expect 0 "" -- "$mha" backward --weights "$W4" --query "$d/q.npy" --head-mask 0.5,1,0,2 \
  --grad-output "$d/dy.npy" --out "$d/ghm.safetensors"
expect 0 "^  head_mask +F32 +\(4\)$" -- "$mha" info "$d/ghm.safetensors"
expect 0 "^gradients \(mha backward\): query; 4 parameters; head_mask$" -- "$mha" info "$d/ghm.safetensors"
for m in "1.5,1,0,2" "-0.5,1,0,2" "0.5,1,1,2" "0.5,1,-1,2"; do
  expect 0 "" -- "$mha" forward --weights "$W4" --query "$d/q.npy" --head-mask "$m" --out "$d/hm_$m.npy"
done
if "$py" - "$d" "$here" <<'PYEOF'
import sys, numpy as np
d = sys.argv[1]
sys.path.insert(0, sys.argv[2] + "/torch_live")
import st
g = st.load(d + "/ghm.safetensors")[0]["head_mask"]
dy = np.load(d + "/dy.npy").astype(np.float64)
L = lambda m: float((np.load(d + "/hm_" + m + ".npy") * dy).sum())
fd = [(L("1.5,1,0,2") - L("-0.5,1,0,2")) / 2, (L("0.5,1,1,2") - L("0.5,1,-1,2")) / 2]
assert np.allclose([g[0], g[2]], fd, rtol=1e-4, atol=1e-5), (g, fd)
pr, abl = np.load(d + "/pr.npy"), np.load(d + "/abl.npy")
assert np.abs(pr - abl).max() <= 1e-5 * (1 + np.abs(abl).max()), "pruned != ablated"
PYEOF
then ok; else bad "head mask gradient or pruned output"; fi
expect 1 "^mha forward: --head-mask has 3 values, expected 4 \(one per head\)$" \
  -- "$mha" forward --weights "$W4" --query "$d/q.npy" --head-mask 1,0,1 --out "$d/x.npy"
expect 1 "^mha forward: --head-mask must be a finite number, got 'nan'$" \
  -- "$mha" forward --weights "$W4" --query "$d/q.npy" --head-mask 1,nan,1,1 --out "$d/x.npy"
absent "a refused head mask" "$d/x.npy"
expect 1 "^mha prune: --keep 1,1: keep names head 1 twice$" \
  -- "$mha" prune --weights "$W4" --keep 1,1 --out "$d/x.safetensors"
expect 1 "^mha prune: --keep must be an integer in \[0, 3\], got '4'$" \
  -- "$mha" prune --weights "$W4" --keep 0,4 --out "$d/x.safetensors"
expect 1 "^mha prune: --keep is required" -- "$mha" prune --weights "$W4" --out "$d/x.safetensors"
expect 1 "^mha prune: --weights .*missing" -- "$mha" prune --weights "$d/missing" --keep 0 --out "$d/x.safetensors"
absent "a refused prune" "$d/x.safetensors"
expect 0 "^usage: mha prune" -- "$mha" prune --help

# ---- RoPE and the score modifiers ---------------------------------------------
# The flags of every command, their errors, the file's metadata round trip
# (mha init writes it, mha info shows it, the flags override it), and
# mha forward --rope against NumPy's float64 forward with Hugging Face's
# RoPE (rotate_half for neox, interleaved pairs for gptj), decode included.
r="$tmp/rope"; mkdir -p "$r"
npy "$r/x.npy" "np.random.randn(2, 6, 16).astype(np.float32)"
npy "$r/s2.npy" "np.array([0.5, 0.25], np.float32)"
npy "$r/s3.npy" "np.array([0.5, 0.25, 1], np.float32)"
npy "$r/s64.npy" "np.array([0.5, 0.25], np.float64)"
WR="$r/wr.safetensors"; WP="$r/wp.safetensors"; WA="$r/wa.safetensors"
WS="$r/ws.safetensors"
expect 0 "" -- "$mha" init --embed-dim 16 --heads 2 --seed 3 --rope gptj \
  --rope-theta 500 --rope-dim 6 --rope-scale 2 --out "$WR"
expect 0 "" -- "$mha" init --embed-dim 16 --heads 2 --seed 3 --out "$WP"
expect 0 "^  rope = gptj$" -- "$mha" info "$WR"
expect 0 "^  rope_dims = 6$" -- "$mha" info "$WR"
expect 0 "^  rope_theta = 500$" -- "$mha" info "$WR"
expect 0 "^  rope_scale = 2$" -- "$mha" info "$WR"
expect 0 "^modifiers: rope=gptj rope_dims=6 rope_theta=500 rope_scale=2$" -- "$mha" info "$WR"
if "$mha" info "$WP" | grep -qE "^  rope|^modifiers"; then bad "a plain module shows modifiers"; else ok; fi
expect 0 "" -- "$mha" init --embed-dim 16 --heads 2 --seed 3 --rope neox --out "$r/wn.safetensors"
expect 0 "^modifiers: rope=neox rope_dims=8 rope_theta=10000 rope_scale=1$" -- "$mha" info "$r/wn.safetensors"
expect 0 "" -- "$mha" init --embed-dim 16 --heads 2 --seed 3 --alibi --window 3,-1 --softcap 20 --out "$WA"
expect 0 "^  alibi = true$" -- "$mha" info "$WA"
expect 0 "^  window = 3,-1$" -- "$mha" info "$WA"
expect 0 "^  softcap = 20$" -- "$mha" info "$WA"
expect 0 "^modifiers: alibi=default window=3,-1 softcap=20$" -- "$mha" info "$WA"
# --attention-chunk: in the file's metadata, read back by every command;
# forward's chunked output is the chunked attention's: the first chunk's
# rows those of plain causal attention, later rows not
expect 0 "" -- "$mha" init --embed-dim 16 --heads 2 --seed 3 --attention-chunk 3 --out "$r/wc.safetensors"
expect 0 "^  attention_chunk = 3$" -- "$mha" info "$r/wc.safetensors"
expect 0 "^modifiers: attention_chunk=3$" -- "$mha" info "$r/wc.safetensors"
expect 1 "^mha init: --attention-chunk must be an integer in \[1, [0-9]+\], got '0'$" -- "$mha" init --embed-dim 16 --heads 2 --seed 3 --attention-chunk 0 --out "$r/wc0.safetensors"
expect 0 "" -- "$mha" init --embed-dim 16 --heads 2 --seed 3 --alibi-slopes "$r/s2.npy" --out "$WS"
expect 0 "^  alibi_slopes = 0.5,0.25$" -- "$mha" info "$WS"
expect 0 "^modifiers: alibi=custom alibi_slopes=0.5,0.25$" -- "$mha" info "$WS"
# --sinks: a `sinks` tensor of H zeros; forward reads it (a sink of 0 takes
# a share of every row, so the output differs from the module without)
expect 0 "" -- "$mha" init --embed-dim 16 --heads 2 --seed 3 --sinks --out "$r/wsk.safetensors"
expect 0 "^  sinks +F32 +\(2\)$" -- "$mha" info "$r/wsk.safetensors"
expect 0 "^modifiers: sinks$" -- "$mha" info "$r/wsk.safetensors"
for c in forward backward viz decode init bench; do
  expect 0 "--rope neox.gptj" -- "$mha" "$c" --help
  expect 0 "^  --softcap C " -- "$mha" "$c" --help
done
expect 0 "^  --window L,R " -- "$mha" forward --help
expect 0 "^  --window W " -- "$mha" decode --help

# The file's rope, and the same rope given as flags over a plain file: the
# same bits; another --rope over the file's: another output.
expect 0 "" -- "$mha" forward --weights "$WR" --query "$r/x.npy" --out "$r/o_file.npy"
expect 0 "" -- "$mha" forward --weights "$WP" --query "$r/x.npy" --rope gptj \
  --rope-theta 500 --rope-dim 6 --rope-scale 2 --out "$r/o_flags.npy"
same "$r/o_file.npy" "$r/o_flags.npy" "rope from the file vs from the flags"
expect 0 "" -- "$mha" forward --weights "$WR" --query "$r/x.npy" --rope neox --out "$r/o_neox.npy"
differ "$r/o_file.npy" "$r/o_neox.npy" "--rope neox over the file's gptj"
expect 0 "" -- "$mha" forward --weights "$WP" --query "$r/x.npy" --out "$r/o_plain.npy"
expect 0 "" -- "$mha" forward --weights "$r/wc.safetensors" --query "$r/x.npy" --causal --out "$r/o_chunk.npy"
expect 0 "" -- "$mha" forward --weights "$WP" --query "$r/x.npy" --causal --attention-chunk 3 --out "$r/o_chunk_flag.npy"
same "$r/o_chunk.npy" "$r/o_chunk_flag.npy" "attention_chunk from the file vs from the flag"
expect 0 "" -- "$mha" forward --weights "$WP" --query "$r/x.npy" --causal --out "$r/o_causal.npy"
check "chunks of 3: the first chunk's rows causal attention's, the second's not" \
  "np.array_equal(a[:, :3], b[:, :3]) and np.abs(a[:, 3:] - b[:, 3:]).max() > 1e-6" "$r/o_chunk.npy" "$r/o_causal.npy"
expect 0 "" -- "$mha" decode --weights "$r/wc.safetensors" --query "$r/x.npy" --chunk 2 --out "$r/d_chunk.npy"
check "a chunked module decodes as its causal forward" \
  "np.abs(a - b).max() <= 1e-5 * (1 + np.abs(b).max())" "$r/d_chunk.npy" "$r/o_chunk.npy"
differ "$r/o_file.npy" "$r/o_plain.npy" "rope vs no rope"
for st in neox gptj; do
  expect 0 "" -- "$mha" forward --weights "$WP" --query "$r/x.npy" --causal \
    --rope $st --rope-dim 6 --rope-theta 100 --out "$r/f_$st.npy"
  expect 0 "" -- "$mha" decode --weights "$WP" --query "$r/x.npy" --chunk 2 \
    --rope $st --rope-dim 6 --rope-theta 100 --out "$r/d_$st.npy"
  expect 0 "" -- "$mha" backward --weights "$WP" --query "$r/x.npy" --causal \
    --grad-output "$r/x.npy" --rope $st --rope-dim 6 --rope-theta 100 --out "$r/g_$st.safetensors"
done
if "$py" - "$r" "$WP" "$here" <<'PYEOF'
import sys, numpy as np
d, wp = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3] + "/torch_live")
import st
t = {k: v.astype(np.float64) for k, v in st.load(wp)[0].items()}
x = np.load(d + "/x.npy").astype(np.float64)
B, L, E = x.shape; H = 2; dh = E // H; dims = 6; theta = 100.0
W, b = t["in_proj_weight"], t["in_proj_bias"]
q, k, v = (x @ W[i*E:(i+1)*E].T + b[i*E:(i+1)*E] for i in range(3))
def rope(y, style):  # Hugging Face: cos/sin of pos * inv_freq
    y = y.reshape(B, L, H, dh).copy()
    inv = 1.0 / theta ** (np.arange(0, dims, 2) / dims)
    f = np.arange(L)[:, None] * inv[None, :]
    r = y[..., :dims]
    if style == "neox":
        emb = np.concatenate([f, f], -1)
        rot = np.concatenate([-r[..., dims//2:], r[..., :dims//2]], -1)
    else:
        emb = np.repeat(f, 2, -1)
        rot = np.stack([-r[..., 1::2], r[..., 0::2]], -1).reshape(r.shape)
    c, s = np.cos(emb)[None, :, None, :], np.sin(emb)[None, :, None, :]
    y[..., :dims] = r * c + rot * s
    return y.reshape(B, L, E)
for style in ("neox", "gptj"):
    qr, kr = rope(q, style), rope(k, style)
    ctx = np.zeros_like(q)
    for h in range(H):
        sl = slice(h*dh, (h+1)*dh)
        s = qr[..., sl] @ kr[..., sl].transpose(0, 2, 1) / np.sqrt(dh)
        s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
        ctx[..., sl] = p @ v[..., sl]
    ref = ctx @ t["out_proj.weight"].T + t["out_proj.bias"]
    for kind in ("f", "d"):
        got = np.load("%s/%s_%s.npy" % (d, kind, style))
        err = np.abs(got - ref).max()
        assert err <= 1e-5 * (1 + np.abs(ref).max()), (style, kind, err)
PYEOF
then ok; else bad "mha forward/decode --rope disagree with NumPy's float64 HF RoPE"; fi

# Errors, each naming the flag and the value
x="$r/x.npy"; o="$r/bad.npy"
expect 0 "" -- "$mha" init --embed-dim 16 --heads 2 --seed 3 --out "$r/wns.safetensors"
expect 0 "" -- "$mha" forward --weights "$r/wsk.safetensors" --query "$x" --out "$r/osk.npy"
expect 0 "" -- "$mha" forward --weights "$r/wns.safetensors" --query "$x" --out "$r/ons.npy"
differ "$r/osk.npy" "$r/ons.npy" "forward with sinks vs without"
expect 1 "^mha forward: --rope must be neox or gptj, got 'llama'$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --rope llama
expect 1 "^mha forward: --rope-theta needs --rope neox.gptj$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --rope-theta 5
expect 1 "^mha forward: --rope-theta must be > 1, got '1'$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --rope neox --rope-theta 1
expect 1 "^mha forward: --rope-theta must be a finite number, got 'inf'$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --rope neox --rope-theta inf
expect 1 "^mha forward: --rope-dim must be even \(dims rotate in pairs\), got '5'$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --rope neox --rope-dim 5
expect 1 "^mha forward: --rope-dim must be an integer in \[2, " -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --rope neox --rope-dim 0
expect 1 "^mha forward: --weights .*rope.dims must be even and in \[2, head_dim 8\] \(0: head_dim\), got 10$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --rope neox --rope-dim 10
expect 1 "^mha forward: --rope-scale must be > 0, got '-2'$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --rope gptj --rope-scale -2
expect 1 "^mha forward: --softcap must be > 0, got '0'$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --softcap 0
expect 1 "^mha forward: --softcap must be a finite number, got 'nan'$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --softcap nan
expect 1 "^mha forward: --window must be LEFT,RIGHT \(two integers >= -1, -1: no bound\), got '4'$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --window 4
expect 1 "^mha forward: --window must be an integer in \[-1, [0-9]+\], got '-2'$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --window 1,-2
expect 1 "^mha forward: --window must be LEFT,RIGHT" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --window 1,2,3
expect 1 "^mha forward: --alibi-slopes has 3 values, expected one per head, H = 2$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --alibi-slopes "$r/s3.npy"
expect 1 "^mha forward: --alibi-slopes must be a 1-D float32 array of H values, got F64 \(2\)$" -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --alibi-slopes "$r/s64.npy"
expect 1 "^mha forward: --alibi-slopes: " -- "$mha" forward --weights "$WP" --query "$x" --out "$o" --alibi-slopes "$r/missing.npy"
expect 1 "^mha backward: --rope must be neox or gptj" -- "$mha" backward --weights "$WP" --query "$x" --grad-output "$x" --out "$r/g.safetensors" --rope x
# decode's --window takes the modifier's LEFT,RIGHT too (causal: LEFT + 1)
expect 0 "" -- "$mha" decode --weights "$WP" --query "$x" --out "$r/dw31.npy" --window 3,1
expect 0 "" -- "$mha" decode --weights "$WP" --query "$x" --out "$r/dw4.npy" --window 4
same "$r/dw31.npy" "$r/dw4.npy" "rope decode --window 3,1 = --window 4"
expect 1 "^mha init: --rope-dim must be even" -- "$mha" init --embed-dim 16 --heads 2 --seed 1 --rope neox --rope-dim 3 --out "$r/bad.safetensors"
expect 1 "^mha init: rope.dims must be even and in \[2, head_dim 8\]" -- "$mha" init --embed-dim 16 --heads 2 --seed 1 --rope neox --rope-dim 12 --out "$r/bad.safetensors"
expect 1 "^mha init: --alibi-slopes has 3 values, expected one per head, H = 2$" -- "$mha" init --embed-dim 16 --heads 2 --seed 1 --alibi-slopes "$r/s3.npy" --out "$r/bad.safetensors"
expect 1 "^mha bench: --rope is not supported with --decode$" -- "$mha" bench --decode --kv-seq 64 --embed-dim 16 --heads 2 --rope neox
expect 1 "^mha bench: --softcap must be > 0" -- "$mha" bench --batch 1 --seq 8 --embed-dim 16 --heads 2 --softcap -1
absent "refused modifier flags" "$o" "$r/bad.safetensors" "$r/g.safetensors"
expect 0 "mha_plan_forward" -- "$mha" bench --batch 1 --seq 16 --embed-dim 16 --heads 2 --rope neox --repeat 1 --warmup 0 --threads 1
expect 0 "mha_attention" -- "$mha" bench --batch 1 --seq 16 --embed-dim 16 --heads 2 --rope gptj --attention-only --repeat 1 --warmup 0 --threads 1

echo "$passes passed, $fails failed"
[ "$fails" -eq 0 ]
