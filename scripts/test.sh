#!/usr/bin/env bash
# The whole test suite: installs what is needed, builds, runs every test
# (CTest), then builds again with AddressSanitizer + UndefinedBehavior-
# Sanitizer and runs every test again, then with ThreadSanitizer for the
# threaded tests, then runs the C tests under valgrind.  Fails on any
# failure or sanitizer/valgrind report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
jobs=$(nproc)

echo "== release build and tests"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs" >/dev/null
ctest --test-dir build --output-on-failure

echo "== ASan + UBSan build and tests"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug \
  -DMHA_SANITIZE=address,undefined >/dev/null
cmake --build build-asan -j"$jobs" >/dev/null
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -E install_and_build_example

echo "== ThreadSanitizer build (clang, LLVM OpenMP) and the threaded tests"
# libgomp is not instrumented for TSan; LLVM's libomp is, and the runtime
# asks for ignore_noninstrumented_modules to skip its own internals.
CC=clang cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug \
  -DMHA_SANITIZE=thread -DMHA_BUILD_TOOLS=OFF >/dev/null
cmake --build build-tsan -j"$jobs" >/dev/null
TSAN_OPTIONS=ignore_noninstrumented_modules=1:halt_on_error=1 OMP_NUM_THREADS=4 \
  ctest --test-dir build-tsan --output-on-failure \
  -R "^test_(threads|thread_knobs|forward|edge|backward|attention_backward)"

echo "== valgrind (memcheck) on the C tests"
for t in build/tests/test_*; do
  [ -x "$t" ] || continue
  OPENBLAS_NUM_THREADS=1 MHA_FIXTURES="$PWD/tests/fixtures" \
    valgrind --quiet --error-exitcode=99 --leak-check=full \
    --errors-for-leak-kinds=definite,indirect "$t" >/dev/null ||
    { echo "valgrind: $t failed"; exit 1; }
  echo "valgrind clean: $t"
done
valgrind --quiet --error-exitcode=99 --leak-check=full \
  --errors-for-leak-kinds=definite,indirect ./build/mha example >/dev/null ||
  { echo "valgrind: mha example failed"; exit 1; }
echo "valgrind clean: mha example"
echo "all tests passed"
