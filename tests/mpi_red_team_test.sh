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
echo "all ok"
