# Cross-compiling for aarch64 with Debian's cross toolchain and its arm64
# (multiarch) packages, the tests run under qemu-user:
#
#   dpkg --add-architecture arm64 && apt-get update
#   apt-get install gcc-aarch64-linux-gnu qemu-user libopenblas-dev:arm64 \
#       libcjson-dev:arm64 libcmocka-dev:arm64
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
#
# (scripts/test-aarch64.sh does all of it.)  Only the portable tiers build
# there: the AVX2/AVX-512 kernel files are x86's (CMakeLists.txt).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# Debian's multiarch layout: arm64 libraries beside the host's, headers
# shared; pkg-config reads the arm64 .pc files only.
set(ENV{PKG_CONFIG_LIBDIR}
    "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
# CTest runs every test program through the emulator.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64)
