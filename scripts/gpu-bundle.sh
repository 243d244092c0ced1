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
#     candle-speedkit-gpu-<commit>/torch-reference.py, sdpa-bench.py   (PyTorch's rows, on the GPU)
#     candle-speedkit-gpu-<commit>/ncu-sum.py   (a profiled process's kernels summed by name)
#     candle-speedkit-gpu-<commit>/BUILD.txt    (commit, toolchain, arch, libraries it needs)
#
# On the GPU machine: tar xzf the archive, cd into it, ./gpu-check.sh --part 1, then --part 2
# (needs the NVIDIA driver 580+ and the CUDA 13 libraries: cuBLAS, cuBLASLt, cudart, NVRTC, cuRAND; no
# Rust, no network; PyTorch for the reference steps). docs/gpu.md gives the two commands.
#
# Usage: scripts/gpu-bundle.sh [--help]   (no other arguments; the rest is set by the env)
# Env: CARGO_TARGET_DIR (default target/cuda-link: kept apart from the CPU build's target/),
#      CUDA_COMPUTE_CAP (default 90; one capability such as 80, 89, 90 or 90a, 80 or above;
#      read docs/gpu.md on sm_90a before changing it).
set -euo pipefail

# Everything below downloads ~1.2 GB once and builds for minutes: check the request first.
die() { echo "gpu-bundle: $*" >&2; exit 2; }
for arg in "$@"; do
    case "$arg" in
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) die "unknown argument '$arg': this script takes none (only --help). Fix: set CUDA_COMPUTE_CAP or CARGO_TARGET_DIR in the environment instead, e.g. CUDA_COMPUTE_CAP=80 scripts/gpu-bundle.sh." ;;
    esac
done
# One capability: candle's kernels go through cudaforge, which reads "90" or "90a" (a list is not
# a capability to it), and our attention kernel's build.rs keeps the digits ("80,90" -> sm_8090).
if [ -n "${CUDA_COMPUTE_CAP:-}" ]; then
    [[ "$CUDA_COMPUTE_CAP" =~ ^([0-9]{2,3})a?$ ]] || die "CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP is not one compute capability. It must be the GPU's SM as digits, such as 80 (A100), 89 (L40S), 90 (H100, H200), optionally with the arch-specific suffix a (90a); lists and dotted forms (8.0) are not read by candle's build. Fix: set one, e.g. CUDA_COMPUTE_CAP=90, or unset it for the default 90."
    [ "${BASH_REMATCH[1]}" -ge 80 ] || die "CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP is below 80: the bf16 tensor-core attention kernel and candle's bf16 and FP8 casts need SM 8.0 or newer, so this bundle could not run its stages there. Fix: set 80 or above (80 gives PTX that every GPU from SM 8.0 up loads)."
fi

cd "$(dirname "$0")/.."
root=$(pwd)

# Every crate the CUDA build reads, cudarc's source for the link stub included, before the
# 1.2 GB toolchain install: a machine that cannot reach crates.io fails here, in seconds.
cargo fetch --locked || die "cargo fetch --locked failed (its message is above): the CUDA build and the link stub read crates a CPU build never downloads. Fix: make crates.io reachable, then run this again."

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
cp scripts/gpu-check.sh scripts/torch-reference.py scripts/sdpa-bench.py scripts/ncu-sum.py "$stage/"
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
    echo "run               ./gpu-check.sh --part 1, then --part 2   (see its --help and docs/gpu.md)"
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
