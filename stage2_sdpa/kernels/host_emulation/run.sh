#!/usr/bin/env bash
# Compile the hand-written CUDA kernels for the CPU with the emulation in this folder and check
# them against f64 references: kernels/flash_attn.cu (check.cpp) and
# stage3_fused/kernels/add_layer_norm.cu (ln_check.cpp). Needs a C++20 compiler ($CXX, default
# c++); no GPU. Prints one line per kernel call; exit 1 if any is out of tolerance.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/speedkit-host-check.$$"
trap 'rm -f "$out".*' EXIT
status=0
for check in check ln_check; do
    "${CXX:-c++}" -std=c++20 -O2 -pthread -I"$here" -x c++ "$here/$check.cpp" -o "$out.$check"
    "$out.$check" || status=1
done
exit $status
