#!/usr/bin/env bash
# Host emulation of every hand-written CUDA kernel in the workspace: each check compiles a
# kernel's real source for the CPU with the stand-ins in this folder (threads, barriers, warp
# shuffles, tensor-core fragments, 16-bit types) and compares every entry point with an f64
# reference. attention_check.cpp runs stage2_sdpa/kernels/flash_attn.cu; attention_v2_check.cpp
# runs flash_attn_v2.cu through this folder's ptx_warp.h (mma.sync, ldmatrix, cp.async: the
# kernel's `#include <ptx_warp.h>` finds it, as only this folder is on the include path) and
# requires its wrong-layout mutations to fail; attention_bwd_check.cpp runs the backward,
# flash_attn_bwd.cu, the same way after the v2 forward (L, dQ, dK, dV against f64, and its own
# mutations); ln_check.cpp runs
# stage3_fused/kernels/add_layer_norm.cu; ln_fp8_check.cpp runs stage4_fp8/kernels/ln_fp8.cu (the
# LayerNorm writing E4M3 + amax, on add_layer_norm.cu's row and fp8.cu's cast); fp8_check.cpp runs stage4_fp8/kernels/fp8.cu (and its E4M3
# cast on every f32 bit pattern). -fno-strict-aliasing: the kernels pun 16-bit pairs and
# 16-byte chunks through integer types, as CUDA code does. Needs a C++20 compiler ($CXX, default
# c++); no GPU.
# Prints one line per kernel call; exit 1 if any is out of tolerance.
#
#   bash host_emulation/run.sh             every check
#   bash host_emulation/run.sh ln_check    only the named ones
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/speedkit-host-check.$$"
trap 'rm -f "$out".*' EXIT
checks=("$@")
if [ ${#checks[@]} -eq 0 ]; then
    checks=()
    for f in "$here"/*_check.cpp; do checks+=("$(basename "$f" .cpp)"); done
fi
# The checks are independent: each is compiled and run as its own job, as many at once as there
# are cores (each is one compiler, then mostly one thread); their output is printed in order.
one() {
    "${CXX:-c++}" -std=c++20 -O2 -fno-strict-aliasing -pthread -I"$here" -x c++ "$here/$1.cpp" -o "$out.$1" && "$out.$1"
}
jobs_max="$(nproc 2>/dev/null || echo 2)"
pids=()
for check in "${checks[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
    one "$check" > "$out.$check.log" 2>&1 &
    pids+=("$!")
done
status=0
for i in "${!checks[@]}"; do
    wait "${pids[$i]}" || status=1
    cat "$out.${checks[$i]}.log"
done
exit $status
