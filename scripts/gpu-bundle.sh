#!/usr/bin/env bash
# Build what a GPU machine needs for scripts/gpu-check.sh, on a machine WITHOUT a GPU: the CUDA
# build of `ladder` (it holds every stage, `selftest` and `report`, so it is the only binary the
# check runs), linked with the CUDA 13.0 toolchain from PyPI and a libcuda link stub
# (scripts/cuda-toolchain.sh --link-stub), stripped, and packed with gpu-check.sh into one
# archive under 40 MB:
#
#   target/gpu-bundle/candle-speedkit-gpu-<commit>.tar.gz
#     candle-speedkit-gpu-<commit>/bin/ladder   (CUDA_COMPUTE_CAP, default 90: H100/H200 only)
#     candle-speedkit-gpu-<commit>/gpu-check.sh
#     candle-speedkit-gpu-<commit>/BUILD.txt    (commit, toolchain, arch, libraries it needs)
#
# On the GPU machine: tar xzf the archive, cd into it, ./gpu-check.sh (needs the NVIDIA driver
# 580+ and the CUDA 13 libraries: cuBLAS, cuBLASLt, cudart, NVRTC, cuRAND; no Rust, no network).
#
# Env: CARGO_TARGET_DIR (default target/cuda-link: kept apart from the CPU build's target/),
#      CUDA_COMPUTE_CAP (default 90; read docs/gpu.md on sm_90a before changing it).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# shellcheck source=scripts/cuda-toolchain.sh
source scripts/cuda-toolchain.sh --link-stub
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target/cuda-link}"
t0=$(date +%s)
cargo build --release --locked --features cuda -p ladder
echo "gpu-bundle: cargo build took $(( $(date +%s) - t0 )) s" >&2

commit=$(git rev-parse --short=12 HEAD 2> /dev/null || echo unknown)
if [ "$commit" != unknown ] && ! git diff --quiet HEAD -- . ':(exclude)results' ':(exclude)*.md'; then
    commit="$commit-dirty"
fi
name="candle-speedkit-gpu-$commit"
stage="$root/target/gpu-bundle/$name"
rm -rf "$root/target/gpu-bundle" && mkdir -p "$stage/bin"   # one archive, this commit's
cp "$CARGO_TARGET_DIR/release/ladder" "$stage/bin/ladder"
strip "$stage/bin/ladder"
cp scripts/gpu-check.sh "$stage/"
{
    echo "candle-speedkit GPU bundle"
    echo "commit            $commit"
    echo "built             $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), no GPU"
    echo "cargo             $(cargo --version)"
    echo "rustc             $(rustc --version)"
    echo "nvcc              $(nvcc --version | tail -1)"
    echo "CUDA_COMPUTE_CAP  $CUDA_COMPUTE_CAP (90: candle's kernels are sm_90a PTX, which loads on SM 9.0 only; docs/gpu.md)"
    echo "features          cuda (our own attention kernel; no flash-attn: it cannot be built offline)"
    echo "needs at run time $(readelf -d "$stage/bin/ladder" | awk '/NEEDED/ {gsub(/[][]/, "", $5); printf "%s ", $5}')and libnvrtc-builtins.so.13.0 beside libnvrtc.so.13"
    echo "run               ./gpu-check.sh   (see its --help)"
} > "$stage/BUILD.txt"
archive="$root/target/gpu-bundle/$name.tar.gz"
tar -czf "$archive" -C "$root/target/gpu-bundle" "$name"
size=$(stat -c %s "$archive")
echo "gpu-bundle: $archive ($(( size / 1024 / 1024 )) MiB)"
limit=$(( 40 * 1024 * 1024 ))
if [ "$size" -ge "$limit" ]; then
    echo "gpu-bundle: the archive is $size bytes, over the 40 MB the bundle promises. Fix: see what grew (tar tzvf)." >&2
    exit 1
fi
