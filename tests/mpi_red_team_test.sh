#!/usr/bin/env bash
# mpi_red_team_test.sh MHA MPIEXEC -- issue 38's red-team findings across
# the ranks of `mpirun ... mha`: ranks that were given different things
# must all fail, each within seconds, with one clear message and no
# output file; never exit 0 with an output that matches no model, never
# hang.  Ranks get different arguments by mpirun's MPMD form
# (`-np 1 cmd A : -np 1 cmd B`).  Every run is under `timeout 30`: a hang
# is a failure (exit 124), not a stuck suite.
set -u
mha=$1 mpiexec=$2
run() { timeout 30 "$mpiexec" --allow-run-as-root --oversubscribe "$@"; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
# w.st and w2.st: the same configuration, other weights (a stale file);
# wr.st: w.st's weights with RoPE.
"$mha" init --embed-dim 8 --heads 2 --seed 1 --out w.st &&
  "$mha" init --embed-dim 8 --heads 2 --seed 2 --out w2.st &&
  "$mha" init --embed-dim 8 --heads 2 --seed 1 --rope neox --out wr.st ||
  fail "mha init"
/usr/bin/python3 - <<'PY' || fail "numpy inputs"
import numpy as np
rng = np.random.default_rng(0)
np.save("q.npy", rng.standard_normal((6, 8)).astype(np.float32))
np.save("dy.npy", rng.standard_normal((6, 8)).astype(np.float32))
PY

# refused A_ARGS -- B_ARGS -- WORD: rank 0 runs `mha A_ARGS`, rank 1
# `mha B_ARGS`; the job must fail, leave no out.npy / g.st, and say WORD.
refused() {
  local a=() b=() word
  while [ "$1" != "--" ]; do a+=("$1"); shift; done; shift
  while [ "$1" != "--" ]; do b+=("$1"); shift; done; shift
  word=$1
  rm -f out.npy g.st
  msg=$(run -np 1 "$mha" "${a[@]}" : -np 1 "$mha" "${b[@]}" 2>&1)
  rc=$?
  [ $rc -eq 124 ] && fail "hang: ${a[*]} beside ${b[*]}"
  [ $rc -eq 0 ] && fail "exit 0: ${a[*]} beside ${b[*]}"
  echo "$msg" | grep -q -- "$word" ||
    fail "${a[*]} beside ${b[*]}: message does not say '$word': $msg"
  [ -e out.npy ] || [ -e g.st ] && fail "${a[*]}: an output was written"
  echo "ok: refused: ${a[*]} beside ${b[*]}"
}

fwd="forward --ring --query q.npy --out out.npy"
bwd="backward --ring --query q.npy --grad-output dy.npy --out g.st"
# Finding 2: a stale weights file, or one with RoPE, on one rank.
for mode in "" "--ulysses"; do
  refused $fwd $mode --weights w.st -- $fwd $mode --weights w2.st -- \
    "parameters"
  refused $fwd $mode --weights w.st -- $fwd $mode --weights wr.st -- \
    "configuration"
done
refused $bwd --weights w.st -- $bwd --weights w2.st -- "parameters"
# Finding 5: ranks that run different commands, or whose options one
# rank refuses (or asks for --help alone), agree to stop before any
# collective of the command: no hang, every rank non-zero.
refused $fwd --weights w.st -- $bwd --weights w.st -- "same command"
refused $bwd --weights w.st -- $fwd --weights w.st -- "same command"
refused $fwd --weights w.st -- bench --ring --seq 8 --embed-dim 8 --heads 2 \
  -- "same command"
refused $fwd --weights w.st -- $fwd --weights w.st --bogus -- "--bogus"
refused $fwd --weights w.st --bogus -- $fwd --weights w.st -- "--bogus"
refused $bwd --weights w.st -- $bwd --weights w.st --help -- "--help"
refused $fwd --weights w.st --help -- $fwd --weights w.st -- "--help"
# Finding 10: a failure every rank meets (a missing file, a bad option)
# is printed once, by rank 0, not once per rank, interleaved.
once() {  # once WORD ARGS...: 2 ranks fail, WORD on exactly one line
  local word=$1; shift
  rm -f out.npy
  msg=$(run -np 2 "$mha" "$@" 2>&1)
  rc=$?
  [ $rc -eq 0 ] || [ $rc -eq 124 ] && fail "$*: exit $rc"
  n=$(echo "$msg" | grep -c -- "$word")
  [ "$n" -eq 1 ] || fail "$*: '$word' printed $n times: $msg"
  echo "ok: once: $*"
}
once "missing.npy" forward --ring --weights w.st --query missing.npy \
  --out out.npy
once "missing.st" $bwd --weights missing.st
once "given twice" $fwd --weights w.st --query q.npy
once "unknown option" $fwd --weights w.st --bogus
once "must be" forward --ring --weights w.st --query q.npy --split diagonal \
  --out out.npy
# Finding 11: --ulysses alone implies the sequence split across the ranks
# (it once said "unknown option"): the same bits as --ring --ulysses.
for c in "forward" "backward --grad-output dy.npy"; do
  out=u.npy; [ "$c" = forward ] || out=u.st
  rm -f u.npy u.st r.npy r.st
  run -np 2 "$mha" $c --ulysses --weights w.st --query q.npy --out $out \
    >/dev/null 2>&1 || fail "$c --ulysses alone failed"
  run -np 2 "$mha" $c --ring --ulysses --weights w.st --query q.npy \
    --out r${out#u} >/dev/null 2>&1 || fail "$c --ring --ulysses failed"
  cmp -s $out r${out#u} || fail "$c --ulysses differs from --ring --ulysses"
  echo "ok: $c --ulysses alone"
done
out=$(run -np 2 "$mha" bench --ulysses --seq 16 --embed-dim 8 --heads 2 \
  --repeat 1 --warmup 0 2>&1) || fail "bench --ulysses alone: $out"
echo "ok: bench --ulysses alone"
echo "all ok"
