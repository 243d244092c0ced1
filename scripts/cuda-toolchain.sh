#!/usr/bin/env bash
# Install the CUDA 13.0 compiler from PyPI wheels into a cache folder, so that
# `cargo check --features cuda` (and, with the link stub, `cargo build`) works on a machine
# with no GPU and no system CUDA. The CUDA 12 wheels carry no nvcc; the 13.0 ones do.
#
# Usage:   source scripts/cuda-toolchain.sh          # sets PATH, CUDA_HOME, CUDA_COMPUTE_CAP
#          bash scripts/cuda-toolchain.sh --link-stub # also make the library names needed to link
# Cache:   $SPEEDKIT_CUDA_CACHE (default ~/.cache/candle-speedkit/cuda13), ~1.2 GB.
set -euo pipefail

P="${SPEEDKIT_CUDA_CACHE:-$HOME/.cache/candle-speedkit/cuda13}"
CU="$P/nvidia/cu13"

if [ ! -x "$CU/bin/nvcc" ]; then
    echo "cuda-toolchain: installing CUDA 13.0 wheels into $P" >&2
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$P" \
        nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88 \
        "nvidia-cublas>=13.0,<13.1" nvidia-curand==10.4.0.35
    # Wheels do not keep the executable bit.
    chmod +x "$CU"/bin/* "$CU"/nvvm/bin/*
fi

export CUDA_HOME="$CU" CUDA_PATH="$CU" PATH="$CU/bin:$PATH"
# sm_90 (Hopper): the GPUs this project is measured on. Set it before sourcing to target others.
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"

if [ "${1:-}" = "--link-stub" ]; then
    # Linking needs unversioned .so names and a libcuda.so.1; no wheel ships the driver, so we
    # build a stub with every cu* symbol cudarc declares. The real driver replaces it at run time.
    cd "$CU/lib"
    for l in cublas cublasLt cudart nvrtc; do [ -e "lib$l.so" ] || ln -sf "lib$l.so.13" "lib$l.so"; done
    [ -e libcurand.so ] || ln -sf libcurand.so.10 libcurand.so
    if [ ! -e libcuda.so.1 ]; then
        sys=$(find "$HOME/.cargo/registry/src" -path '*cudarc-0.19*/src/driver/sys/mod.rs' | head -1)
        grep -oE 'pub fn cu[A-Za-z0-9_]+' "$sys" | sort -u | sed -E 's/pub fn (.*)/int \1(void){return 100;}/' > /tmp/cuda_stub.c
        gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 /tmp/cuda_stub.c
        ln -sf libcuda.so.1 libcuda.so
    fi
    export LIBRARY_PATH="$CU/lib:${LIBRARY_PATH:-}"
    cd - > /dev/null
fi
echo "cuda-toolchain: $(nvcc --version | tail -1) at $CU, CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP" >&2
