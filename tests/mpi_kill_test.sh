#!/usr/bin/env bash
# mpi_kill_test.sh MPIEXEC TEST_MPI_RING -- a rank that dies must not hang
# the job: `test_mpi_ring kill` has rank 1 of 3 SIGKILL itself before the
# ring while ranks 0 and 2 call it.  Passes when mpirun ends non-zero
# within 60 seconds (timeout's 124 is a hang).
set -u
mpiexec=$1 prog=$2
export OMPI_MCA_btl_vader_single_copy_mechanism=none
start=$(date +%s)
timeout 60 "$mpiexec" --allow-run-as-root --oversubscribe -np 3 "$prog" kill \
  >/dev/null 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
if [ "$rc" -eq 124 ]; then
  echo "FAIL: the job hung (killed by timeout after ${elapsed}s)"
  exit 1
fi
if [ "$rc" -eq 0 ]; then
  echo "FAIL: mpirun exited 0 although a rank was killed"
  exit 1
fi
echo "ok: mpirun ended with status $rc after ${elapsed}s"
