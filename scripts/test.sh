#!/usr/bin/env bash
# The test suite.  Installs what is needed and builds first.
#   bash scripts/test.sh         the quick suite (minutes): every test
#                                (CTest) on a release build and the Python
#                                package's tests (pytest, scripts/test-python.sh)
#   bash scripts/test.sh --all   the whole matrix (CI, .ci/run): the quick
#                                suite, then every C test and the Python
#                                tests again under AddressSanitizer +
#                                UndefinedBehaviorSanitizer (one
#                                instrumented libmha), the threaded
#                                tests under ThreadSanitizer, a clang -Werror
#                                build, the fuzz targets (fixed seeds, a fixed
#                                number of runs), the C tests under valgrind,
#                                and an aarch64 cross-build run under qemu
#                                (scripts/test-aarch64.sh).
# Fails on any failure, skip that is not allowed, or sanitizer/valgrind
# report.  Nothing in it depends on the clock or on chance.
set -euo pipefail
cd "$(dirname "$0")/.."
all=0
case "${1:-}" in
  --all) all=1 ;;
  "") ;;
  *) echo "usage: bash scripts/test.sh [--all]" >&2; exit 2 ;;
esac
bash scripts/install-deps.sh
jobs=$(nproc)

# Every stage runs two tests at a time on a 2-core machine, each with
# OpenMP threads of its own.  OpenMP's default is to spin at a barrier
# before sleeping (libgomp ~300,000 iterations, LLVM's libomp 200 ms), so
# two tests' threads spin while the other's want the core: measured here,
# two test_modifiers side by side took 7.8 s each, 2.4 s each with
# passive waiting (alone: 2.0 s).  Passive waiting changes no result (the
# bits never depend on the threads); timings belong to the benchmarks.
export OMP_WAIT_POLICY=passive

# The time each stage took, for docs/TESTING.md's record of whole runs.
stage_start=$SECONDS
stage() {  # stage NAME: ends the one running, starts NAME
  local now=$SECONDS
  [ -z "${stage_name:-}" ] ||
    echo "-- $stage_name: $((now - stage_start)) s (at $((now / 60)) min)"
  stage_name=${1:-}
  stage_start=$now
  [ -z "$stage_name" ] || echo "== $stage_name"
}

stage "release build and tests"
# MHA_MPI=ON: libmha_mpi and its tests (mpirun) must build here; a machine
# without Open MPI fails at configure rather than skipping them silently.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMHA_MPI=ON >/dev/null
cmake --build build -j"$jobs" >/dev/null
# (python_nn_source and python_transformers_source, the Python tests on
# this tree's Python files, need the package installed in .venv: they run
# after the Python stage, below.)
ctest --test-dir build -j"$jobs" --output-on-failure \
  --output-junit "$PWD/build/ctest-release.xml" \
  -E '^python_(nn|transformers)_source$'

# No silent skips: every test that did not run is listed by name, and the
# only ones allowed are the *_avx512 tier runs on a CPU without AVX-512F,
# the *_amx ones on a CPU without AMX-BF16, the *_avx512bf16 ones on a CPU
# without AVX512-BF16, and the *_neon and *_bfdot ones on x86
# (they run in the aarch64 stage, under qemu).
skipped=$(/usr/bin/python3 - "$PWD/build/ctest-release.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
for t in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    if t.get("status") != "run" or t.find("skipped") is not None:
        print(t.get("name"))
PY
)
have_avx512=0 have_amx=0 have_bf16=0
grep -qw avx512f /proc/cpuinfo && have_avx512=1
grep -qw amx_bf16 /proc/cpuinfo && have_amx=1
grep -qw avx512_bf16 /proc/cpuinfo && have_bf16=1
bad=0
for t in $skipped; do
  if [[ $t == *_avx512 && $have_avx512 == 0 ]]; then
    echo "skipped: $t (this CPU has no AVX-512F)"
  elif [[ $t == *_amx && $have_amx == 0 ]]; then
    echo "skipped: $t (this CPU has no AMX-BF16)"
  elif [[ $t == *_avx512bf16 && $have_bf16 == 0 ]]; then
    echo "skipped: $t (this CPU has no AVX512-BF16)"
  elif [[ $t == *_neon || $t == *_bfdot ]]; then
    echo "skipped: $t (an x86 CPU; the aarch64 stage runs it)"
  else
    echo "skipped: $t -- not allowed"
    bad=1
  fi
done
[ -n "$skipped" ] || echo "skipped: none"
[ "$bad" = 0 ] || { echo "tests were skipped that must run"; exit 1; }

# The Python package (pip install . into .venv, pytest; with --all the
# ASan stage runs its tests again, instrumented).  Then CTest's python_nn_source
# and python_transformers_source over the installed extension: they must
# run, not be skipped.
nn_source() {
  ctest --test-dir build -R '^python_(nn|transformers)_source$' \
    --output-on-failure > build/ctest-nn-source.log 2>&1 ||
    { cat build/ctest-nn-source.log; exit 1; }
  if grep -q "did not run" build/ctest-nn-source.log; then
    cat build/ctest-nn-source.log; echo "a *_source test did not run"; exit 1
  fi
  echo "python_nn_source, python_transformers_source: passed"
}
stage "Python package (pytest)"
bash scripts/test-python.sh
nn_source
if [ "$all" = 0 ]; then
  stage
  echo "quick suite passed in $((SECONDS / 60)) min $((SECONDS % 60)) s" \
       "(the whole matrix: bash scripts/test.sh --all)"
  exit 0
fi

stage "ASan + UBSan build and tests (C, then Python)"
# -O1, as the sanitizers' documentation advises: the checks are the same
# instrumentation at any level, and the tests take half the time of -O0's.
# The Python extension is built here too, on the same instrumented libmha,
# so the Python tests below need no sanitizer build of their own.
# On a CPU without AVX-512F the avx512 tier never runs (its tests skip by
# name): its file is compiled without the instrumentation, which took GCC
# minutes for that one file; on an AVX-512 CPU it is instrumented too.
san_exclude=""
[ "$have_avx512" = 1 ] || san_exclude="src/kernels/avx512.c"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-g -O1" \
  -DMHA_MPI=ON -DMHA_SANITIZE=address,undefined \
  -DMHA_SANITIZE_EXCLUDE="$san_exclude" \
  -DMHA_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PWD/.venv/bin/python" >/dev/null
cmake --build build-asan -j"$jobs" >/dev/null
# Two tests at a time (each is mostly one thread); the thread-knob test
# under each forced GEMM backend is left to the release stage (the same
# code as test_thread_knobs here, 2 minutes each under ASan), and so are
# python_nn_source and python_transformers_source (they run .venv's
# release extension, nothing of this build: 37 s here for nothing).
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan -j"$jobs" --output-on-failure \
  -E "install_and_build_example|test_thread_knobs_gemm_|^python_(nn|transformers)_source$"
echo "== the Python package's tests under ASan + UBSan"
bash scripts/test-python-asan.sh build-asan

stage "ThreadSanitizer build (clang, LLVM OpenMP) and the threaded tests"
# libgomp is not instrumented for TSan; LLVM's libomp is, and the runtime
# asks for ignore_noninstrumented_modules to skip its own internals.
CC=clang cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_FLAGS_DEBUG="-g -O1" -DMHA_SANITIZE=thread -DMHA_BUILD_TOOLS=OFF \
  -DMHA_SANITIZE_EXCLUDE="$san_exclude" \
  >/dev/null
cmake --build build-tsan -j"$jobs" >/dev/null
# (Not the forced-GEMM-backend runs: the same threads as their plain
# tests; nor the KV cache tests, contiguous and paged, on the reference
# tier, whose float64 row loop takes minutes under TSan and shares its
# threading with the attention tests' ref entries, which run.)
TSAN_OPTIONS=ignore_noninstrumented_modules=1:halt_on_error=1 OMP_NUM_THREADS=4 \
  ctest --test-dir build-tsan -j"$jobs" --output-on-failure \
  -R "^test_(threads|thread_knobs|forward|edge|backward|attention_backward|kv_cache|kv_pages|half|module16|value_width)" \
  -E "_gemm_|^test_kv_(cache|pages).*_ref$"

stage "clang -Werror build (library, libmha_mpi, tools, tests, examples)"
# The project's warnings (-Wall -Wextra -Wshadow -Wstrict-prototypes -Wvla)
# as errors under the other compiler; GCC builds every stage above.
CC=clang cmake -S . -B build-clang -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS=-Werror >/dev/null
cmake --build build-clang -j"$jobs" >/dev/null

stage "the fuzz targets: seeded mutants of their corpora, under ASan + UBSan"
# (the long, coverage-guided campaigns are scripts/fuzz.sh's, which builds
# the libFuzzer targets.)  Each target's replay (its LLVMFuzzerTestOneInput
# behind fuzz/replay_main.c), from the ASan + UBSan build above, runs over
# its committed corpus changed in fixed, seeded ways.  A coverage-guided
# run picks its next input by the code the last one reached, and that code
# depends on the CPU the library dispatched for: even with a fixed seed
# and count it explored other inputs on another machine (and once failed
# there only).  fuzz/mutants.py writes the inputs from the corpus and a
# seed alone: the same bytes on every machine, so the stage cannot pass
# or fail by chance.  The readers, the cache's operation sequences, the
# command's option parsing, and the differential fuzzer of the tiers
# (fuzz_tiers: random modules and calls, every tier against the float64
# reference, forward and backward) on each tier this CPU has.  The inputs
# go to memory where /dev/shm has room (tens of thousands of small files,
# up to ~200 MB for one target: ~12 s a target on this disk, ~1 s in
# /dev/shm), else under build-asan/; each target's are removed after it.
mroot=build-asan
shm_kb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 { print $4 }') || shm_kb=0
if [ "${shm_kb:-0}" -gt 1048576 ] 2>/dev/null; then mroot=/dev/shm; fi
mutants=$(mktemp -d -p "$mroot")
fuzz_run() {  # fuzz_run TARGET COUNT MAX_LEN [ENV=VALUE...]
  local t=$1 count=$2 len=$3 log="$PWD/build-asan/ci-fuzz-$1${4:+-${4#*=}}.log"
  shift 3
  python3 fuzz/mutants.py "fuzz/corpus/$t" "$mutants/$t" "$count" "$len"
  local start=$SECONDS
  env ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
      UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 MHA_REPLAY_NAMES=1 "$@" \
    build-asan/tests/"fuzz_${t}_replay" "$mutants/$t" >"$log" 2>&1 ||
    { echo "fuzz_$t $* failed (python3 fuzz/mutants.py fuzz/corpus/$t DIR $count $len" \
           "makes its inputs again):"; tail -40 "$log"; rm -rf "$mutants"; exit 1; }
  echo "fuzz_$t $*: $count inputs in $((SECONDS - start)) s"
  rm -rf "${mutants:?}/$t"
}
fuzz_run npy 100000 4096
fuzz_run safetensors 50000 4096
fuzz_run module 60000 4096
fuzz_run cache 15000 4096
fuzz_run cli 60000 4096
tiers="ref scalar"
grep -qw avx2 /proc/cpuinfo && tiers="$tiers avx2"
grep -qw avx512f /proc/cpuinfo && tiers="$tiers avx512"
for isa in $tiers; do
  fuzz_run tiers 50000 64 MHA_ISA="$isa"   # (it reads ~40 bytes)
done
rm -rf "$mutants"

stage "valgrind (memcheck) on the C tests, two at a time"
# Each test under memcheck runs on about one core (valgrind serialises its
# threads), so two run side by side; each one's report goes to its own log,
# printed when it fails.
vglogs=build/valgrind-logs
rm -rf "$vglogs" && mkdir -p "$vglogs"
vg_one() {  # vg_one PROGRAM [ARGS...]: memcheck, exit 99 on any error
  local log="$vglogs/$(basename "$1").log" start=$SECONDS
  if OPENBLAS_NUM_THREADS=1 MHA_FIXTURES="$PWD/tests/fixtures" \
     valgrind --quiet --error-exitcode=99 --leak-check=full \
       --errors-for-leak-kinds=definite,indirect "$@" >/dev/null 2>"$log"; then
    echo "valgrind clean: $* ($((SECONDS - start)) s)"
  else
    echo "valgrind: $* failed"; cat "$log"; return 1
  fi
}
export -f vg_one
export vglogs
# The longest under memcheck first (minutes each, measured on the 2-core
# VM), so that none is left running alone at the end; then the rest.
vg_tests=()
for t in test_module16 test_modifiers test_kv_pages test_threads \
         test_kv_cache_window test_kv_cache test_kv_cache_compose \
         test_attention_backward test_half; do
  [ -x "build/tests/$t" ] && vg_tests+=("build/tests/$t")
done
for t in build/tests/test_*; do
  [[ " ${vg_tests[*]} " == *" $t "* ]] && continue
  [ -x "$t" ] || continue
  # test_mpi_ring runs under mpirun (release and ASan stages); Open MPI's
  # own start-up (shared memory, hwloc, its progress thread) is not
  # valgrind-clean, so memcheck would report MPI, not libmha_mpi.
  if [[ $t == */test_mpi_* ]]; then
    echo "valgrind: $t skipped (Open MPI under memcheck; see docs/TESTING.md)"
    continue
  fi
  vg_tests+=("$t")
done
# xargs exits non-zero (123) when any run failed
printf '%s\n' "${vg_tests[@]}" ./build/mha |
  xargs -P 2 -I{} bash -c 'if [ "$1" = ./build/mha ]; then vg_one "$1" example; else vg_one "$1"; fi' _ {}
stage "aarch64: cross-compiled, a named subset under qemu-user"
bash scripts/test-aarch64.sh
stage   # (the last one ends)
echo "all tests passed in $((SECONDS / 60)) min $((SECONDS % 60)) s"
