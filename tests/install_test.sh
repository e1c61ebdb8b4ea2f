#!/usr/bin/env bash
# install_test.sh BUILD_DIR SOURCE_DIR
#
# Installs libmha from BUILD_DIR into a temporary prefix and builds
# examples/readme_example.c against the installed copy only, as a user would:
#   1. cc + pkg-config (shared library, run with LD_LIBRARY_PATH);
#   2. cc + pkg-config --static (libmha.a, its BLAS and libm from mha.pc);
#   3. a CMake project with find_package(mha 0.6 REQUIRED), linking
#      mha::mha (shared) and mha::mha_static (static), both run.
# Every program must build without warnings and exit 0.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 BUILD_DIR SOURCE_DIR" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
example="$src/examples/readme_example.c"
cc=${CC:-cc}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/mha-install-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix="$tmp/prefix"

step() { echo "== $*"; }

step "cmake --install into $prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" ||
  { cat "$tmp/install.log"; exit 1; }
test -f "$prefix/include/mha.h"
pcdir=$(dirname "$(find "$prefix" -path '*/pkgconfig/mha.pc' -print -quit)")
[ -f "$pcdir/mha.pc" ] || { echo "mha.pc not installed" >&2; exit 1; }
libdir=$(dirname "$pcdir")
test -e "$libdir/libmha.so"
test -f "$libdir/libmha.a"
test -f "$libdir/cmake/mha/mhaConfig.cmake"

# Only the installed copy may be found: no build tree, no source tree.
export PKG_CONFIG_PATH="$pcdir"
unset PKG_CONFIG_LIBDIR CPATH C_INCLUDE_PATH LIBRARY_PATH || true
cflags=(-std=c11 -Wall -Wextra -Werror)

check_flags() {   # the flags must point into the temporary prefix
  case " $1 " in
    *"$src"*|*"$build"*) echo "flags name the source or build tree: $1" >&2
                         exit 1 ;;
  esac
  case " $1 " in
    *"-I$prefix"*|*"-I$tmp"*) ;;
    *) echo "flags do not point into the prefix: $1" >&2; exit 1 ;;
  esac
}

# ldd's output is captured first: `ldd | grep -q` under pipefail fails
# whenever grep exits before ldd has written everything.
loads_from_prefix() {   # PROGRAM [LD_LIBRARY_PATH]: libmha.so from the prefix
  command -v ldd >/dev/null || return 0
  local deps
  deps=$(LD_LIBRARY_PATH="${2:-}" ldd "$1")
  case "$deps" in
    *"$libdir/libmha.so"*) ;;
    *) echo "$1 does not load the installed libmha.so:" >&2
       echo "$deps" >&2; exit 1 ;;
  esac
}
loads_no_libmha() {     # a static link: no libmha.so at all
  command -v ldd >/dev/null || return 0
  local deps
  deps=$(ldd "$1")
  case "$deps" in
    *libmha*) echo "$1 loads libmha dynamically:" >&2
              echo "$deps" >&2; exit 1 ;;
  esac
}

step "pkg-config, shared"
test "$(pkg-config --modversion mha)" = "$(sed -n 's/^Version: //p' "$pcdir/mha.pc")"
flags=$(pkg-config --cflags --libs mha)
echo "pkg-config --cflags --libs mha: $flags"
check_flags "$flags"
# shellcheck disable=SC2086
"$cc" "${cflags[@]}" "$example" -o "$tmp/ex_pc_shared" $flags
LD_LIBRARY_PATH="$libdir" "$tmp/ex_pc_shared"
loads_from_prefix "$tmp/ex_pc_shared" "$libdir"

# The README's way for a prefix the loader does not search: an rpath to
# pkg-config's libdir, and the program runs with no LD_LIBRARY_PATH.
# shellcheck disable=SC2086
"$cc" "${cflags[@]}" "$example" -o "$tmp/ex_pc_rpath" $flags \
  -Wl,-rpath,"$(pkg-config --variable=libdir mha)"
env -u LD_LIBRARY_PATH "$tmp/ex_pc_rpath"
if command -v ldd >/dev/null; then   # (pkg-config spells libdir
  got=$(env -u LD_LIBRARY_PATH ldd "$tmp/ex_pc_rpath" |  # relatively)
        sed -n 's/^.*libmha\.so[^ ]* => \([^ ]*\) .*$/\1/p')
  [ -n "$got" ] && [ "$(cd "$(dirname "$got")" && pwd -P)" = "$(cd "$libdir" && pwd -P)" ] ||
    { echo "ex_pc_rpath does not load the installed libmha.so: $got" >&2; exit 1; }
fi

# Only mha's own header directory: mha.h and mha_io.h include neither
# CBLAS nor cJSON, so their -I would only leak into the user's flags.
cf=$(pkg-config --cflags mha)
# shellcheck disable=SC2086
set -- $cf
[ $# -eq 1 ] && [ "$(cd "${1#-I}" && pwd)" = "$(cd "$prefix/include" && pwd)" ] ||
  { echo "pkg-config --cflags mha is not just the prefix's include: $cf" >&2
    exit 1; }

step "the installed mha runs from the prefix (its RUNPATH finds libmha)"
if [ -x "$prefix/bin/mha" ]; then
  env -u LD_LIBRARY_PATH "$prefix/bin/mha" --version
  if command -v ldd >/dev/null; then
    # (its RUNPATH is $ORIGIN/../lib: compare directories, not spellings)
    got=$(env -u LD_LIBRARY_PATH ldd "$prefix/bin/mha" |
          sed -n 's/^[[:space:]]*libmha\.so[^ ]* => \([^ ]*\).*/\1/p')
    [ -n "$got" ] &&
      [ "$(cd "$(dirname "$got")" && pwd -P)" = "$(cd "$libdir" && pwd -P)" ] ||
      { echo "the installed mha loads libmha from '$got', not $libdir" >&2
        exit 1; }
  fi
fi

step "ABI: the soname is the ABI version, and another is refused"
# mha.h's ABI rule: structs are passed with their size, so a binary needs
# the ABI version it was built against, whatever the minor version.
hdr="$prefix/include/mha.h"
abiv=$(sed -n 's/^#define MHA_ABI_VERSION \([0-9]*\)$/\1/p' "$hdr")
soname="libmha.so.$abiv"
test -e "$libdir/$soname" || { echo "no $soname in $libdir" >&2; exit 1; }
if command -v readelf >/dev/null; then
  readelf -d "$libdir/libmha.so" | grep -q "Library soname: \[$soname\]" ||
    { echo "libmha.so's SONAME is not $soname:" >&2
      readelf -d "$libdir/libmha.so" | grep -i soname >&2; exit 1; }
  readelf -d "$tmp/ex_pc_shared" | grep -q "Shared library: \[$soname\]" ||
    { echo "the example does not NEED $soname" >&2; exit 1; }
fi
# libmha_mpi (built when MPI was found) under the same rule: its soname is
# MHA_MPI_ABI_VERSION of mha_mpi.h.
if [ -f "$prefix/include/mha_mpi.h" ]; then
  mabiv=$(sed -n 's/^#define MHA_MPI_ABI_VERSION \([0-9]*\)$/\1/p' \
          "$prefix/include/mha_mpi.h")
  msoname="libmha_mpi.so.$mabiv"
  test -n "$mabiv" && test -e "$libdir/$msoname" ||
    { echo "no $msoname in $libdir" >&2; exit 1; }
  if command -v readelf >/dev/null; then
    readelf -d "$libdir/libmha_mpi.so" |
      grep -q "Library soname: \[$msoname\]" ||
      { echo "libmha_mpi.so's SONAME is not $msoname:" >&2
        readelf -d "$libdir/libmha_mpi.so" | grep -i soname >&2; exit 1; }
  fi
fi
# A library of the next ABI version only: the loader refuses to start the
# program (it never runs against a library that broke its ABI).
abi="$tmp/abi"
mkdir -p "$abi"
cp "$libdir/$soname" "$abi/libmha.so.$((abiv + 1))"
if LD_LIBRARY_PATH="$abi" env -u LD_RUN_PATH "$tmp/ex_pc_shared" \
     >"$tmp/abi.out" 2>&1; then
  echo "the example ran against libmha.so.$((abiv + 1))" >&2; exit 1
fi
grep -q "$soname" "$tmp/abi.out" ||
  { echo "the loader's refusal does not name $soname:" >&2
    cat "$tmp/abi.out" >&2; exit 1; }

step "pkg-config, static"
sflags=$(pkg-config --static --cflags --libs mha)
echo "pkg-config --static --cflags --libs mha: $sflags"
check_flags "$sflags"
# Link libmha.a by path: -lmha alone would pick libmha.so.
# shellcheck disable=SC2086
"$cc" "${cflags[@]}" "$example" -o "$tmp/ex_pc_static" \
  $(pkg-config --cflags mha) "$libdir/libmha.a" \
  $(pkg-config --static --libs mha | sed 's/\(^\| \)-lmha\( \|$\)/ /')
"$tmp/ex_pc_static"   # no LD_LIBRARY_PATH: libmha must not be needed
loads_no_libmha "$tmp/ex_pc_static"
# The static link takes the BLAS libmha.so was built with (the OpenMP
# OpenBLAS by default, not the pthread build openblas.pc names).
if command -v ldd >/dev/null; then
  blas_of() { ldd "$1" | sed -n 's/^[[:space:]]*\(libopenblas[^ ]*\) => \([^ ]*\).*/\2/p'; }
  want_blas=$(blas_of "$libdir/libmha.so")
  got_blas=$(blas_of "$tmp/ex_pc_static")
  [ "$want_blas" = "$got_blas" ] ||
    { echo "the static link loads '$got_blas', libmha.so '$want_blas'" >&2
      exit 1; }
fi

step "CMake find_package(mha 0.6 REQUIRED)"
proj="$tmp/consumer"
mkdir -p "$proj"
cp "$example" "$proj/readme_example.c"
cat >"$proj/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.16)
project(mha_consumer LANGUAGES C)
set(CMAKE_C_STANDARD 11)
find_package(mha 0.6 REQUIRED)
get_filename_component(found "${mha_DIR}" REALPATH)
get_filename_component(want "${EXPECTED_PREFIX}" REALPATH)
string(FIND "${found}/" "${want}/" at)
if(NOT at EQUAL 0)
  message(FATAL_ERROR "found mha in ${mha_DIR}, not under ${EXPECTED_PREFIX}")
endif()
if(NOT mha_VERSION VERSION_GREATER_EQUAL 0.6)
  message(FATAL_ERROR "mha_VERSION is '${mha_VERSION}'")
endif()
foreach(t mha::mha mha::mha_static)
  if(NOT TARGET ${t})
    message(FATAL_ERROR "${t} is not defined by mhaConfig.cmake")
  endif()
endforeach()
add_compile_options(-Wall -Wextra -Werror)
add_executable(ex_shared readme_example.c)
target_link_libraries(ex_shared PRIVATE mha::mha)
add_executable(ex_static readme_example.c)
target_link_libraries(ex_static PRIVATE mha::mha_static)
EOF
cmake -S "$proj" -B "$proj/build" -DCMAKE_PREFIX_PATH="$prefix" \
  -DEXPECTED_PREFIX="$prefix" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON \
  >"$tmp/consumer-configure.log" || { cat "$tmp/consumer-configure.log"; exit 1; }
cmake --build "$proj/build" -j1 >"$tmp/consumer-build.log" ||
  { cat "$tmp/consumer-build.log"; exit 1; }
# The shared one runs from its build RPATH (no LD_LIBRARY_PATH), which must
# point into the prefix.
env -u LD_LIBRARY_PATH "$proj/build/ex_shared"
loads_from_prefix "$proj/build/ex_shared"
"$proj/build/ex_static"
loads_no_libmha "$proj/build/ex_static"

echo "install test passed"
