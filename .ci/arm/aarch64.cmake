# CMake toolchain for edgelin's aarch64 wheel, cross-built on x86-64 with Debian's gcc-aarch64-linux-gnu
# (.ci/arm/run; docs/arm.md, "Building for ARM").
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
