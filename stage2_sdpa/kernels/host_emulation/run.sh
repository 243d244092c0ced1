#!/usr/bin/env bash
# Compile kernels/flash_attn.cu for the CPU with the emulation in this folder and check it
# against an f64 reference (see check.cpp). Needs a C++20 compiler ($CXX, default c++); no GPU.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/speedkit-flash-attn-host-check.$$"
trap 'rm -f "$out"' EXIT
"${CXX:-c++}" -std=c++20 -O2 -pthread -I"$here" -x c++ "$here/check.cpp" -o "$out"
"$out"
