#!/usr/bin/env bash
# The library on aarch64: cross-compiled with Debian's gcc-aarch64-linux-gnu
# against Debian's arm64 packages (multiarch), and a named subset of the
# C tests run under qemu-user (CTest runs each through qemu-aarch64, see
# cmake/aarch64-linux-gnu.cmake).  There the neon tier is the default,
# beside the portable ones (scalar, ref); the x86 kernel files are not
# compiled.  Run as root: it
# adds the arm64 architecture to dpkg and installs what is missing.
# A stage of scripts/test.sh; docs/TESTING.md says what runs and why.
set -euo pipefail
cd "$(dirname "$0")/.."

# (libgomp1:arm64 named: the cross compiler's own libgomp lies in
# /usr/aarch64-linux-gnu/lib, where the arm64 loader under qemu does not
# look, and no other package here is sure to pull in the multiarch one.)
packages=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
          libopenblas-dev:arm64 libcjson-dev:arm64 libcmocka-dev:arm64
          libgomp1:arm64)
dpkg --print-foreign-architectures | grep -qx arm64 ||
  dpkg --add-architecture arm64
bash scripts/install-deps.sh "${packages[@]}"

# RelWithDebInfo (-O2): the release build's -O3 is where GCC 12's aarch64
# vectorizer has stopped with internal errors (tests/CMakeLists.txt).
cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_MPI=OFF >/dev/null
cmake --build build-arm64 -j"$(nproc)" >/dev/null

# The subset: the library's own tests, each under qemu (10-30x slower
# than native).  Every test that runs in each tier runs on the neon tier
# (the *_neon entries: the default tier there, named so that each checks
# it got it), a few on the scalar and reference tiers, and the rest of
# the C tests once.  Left out: the command-line and Python tests (torch
# has no arm64 build here), the install test, MPI, the thread-knob test
# (minutes of re-executions), the x86 tier entries (*_avx2, *_avx512, the
# AMX runs: not built), the GEMM-backend entries (oneDNN is an x86
# choice), and the other tiers' runs (minutes each under emulation:
# TESTING.md has a run of all the entries).
tier_tests='test_forward|test_edge|test_torch_fixtures|test_threads|'
tier_tests+='test_attention|test_kv_cache_window|test_rope|test_backward|'
tier_tests+='test_heads|test_attention_backward|test_attention_part|'
tier_tests+='test_alloc|test_kv_cache|test_kv_cache_compose|test_kv_dtype|'
tier_tests+='test_modifiers|test_red_team|test_value_width|test_microkernels|'
tier_tests+='test_kv_pages|test_decode_api|'
tier_tests+='fuzz_replay_tiers'
subset="^((${tier_tests})_neon|"
subset+='test_module|test_module16_(widened|bfdot)|test_half_(bfdot|widened|bad_env)|test_npy|test_safetensors|test_microkernels|'
subset+='test_dropout|test_hostile|example_train_step|example_generate|'
subset+='test_forward_ref|test_edge_scalar|test_attention_scalar|'
subset+='fuzz_replay_(npy|safetensors|module|cache|cli|tiers_scalar))$'
OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=2 \
  ctest --test-dir build-arm64 -j"$(nproc)" --output-on-failure -R "$subset" |
  tee build-arm64/ctest-subset.log
# Nothing here may skip: qemu's CPU has every feature the entries ask for
# (the *_bfdot ones: BF16).
if grep -q 'Skipped' build-arm64/ctest-subset.log; then
  echo "aarch64: tests were skipped that must run"; exit 1
fi
echo "aarch64: the tests ran as $(readelf -h build-arm64/tests/test_module |
  sed -n 's/^ *Machine: *//p') binaries under qemu-aarch64"
