#!/usr/bin/env bash
# Install the CUDA 13.0 compiler from PyPI wheels into a cache folder, so that
# `cargo check --features cuda` (and, with the link stub, `cargo build`) works on a machine
# with no GPU and no system CUDA. The CUDA 12 wheels carry no nvcc; the 13.0 ones do.
#
# Usage:   source scripts/cuda-toolchain.sh             # sets PATH, CUDA_HOME, CUDA_COMPUTE_CAP
#          source scripts/cuda-toolchain.sh --link-stub # also LIBRARY_PATH and the library names
#                                                       # `cargo build --features cuda` links against
# Cache:   $SPEEDKIT_CUDA_CACHE (default ~/.cache/candle-speedkit/cuda13), ~1.2 GB.
#
# Meant to be sourced: it neither changes the caller's directory nor its shell options (no
# `set -e` left behind in an interactive shell), and returns non-zero instead of exiting.

speedkit_cuda_toolchain() (
    # A subshell: `set -euo pipefail` and any `cd` stay in here.
    set -euo pipefail
    local cu="$1" link_stub="$2"
    if [ ! -x "$cu/bin/nvcc" ]; then
        echo "cuda-toolchain: installing CUDA 13.0 wheels into ${cu%/nvidia/cu13}" >&2
        python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "${cu%/nvidia/cu13}" \
            nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
            nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88 \
            "nvidia-cublas>=13.0,<13.1" nvidia-curand==10.4.0.35
        # Wheels do not keep the executable bit.
        chmod +x "$cu"/bin/* "$cu"/nvvm/bin/*
    fi
    [ "$link_stub" = 1 ] || return 0
    # Linking needs unversioned .so names and a libcuda.so.1. No wheel ships the driver, so we
    # build a stub that defines every driver function cudarc declares; the real driver replaces
    # it at run time (the stub's soname is libcuda.so.1, the driver's).
    cd "$cu/lib"
    for l in cublas cublasLt cudart nvrtc; do [ -e "lib$l.so" ] || ln -sf "lib$l.so.13" "lib$l.so"; done
    [ -e libcurand.so ] || ln -sf libcurand.so.10 libcurand.so
    if [ ! -e libcuda.so.1 ]; then
        # cudarc 0.19.10 declares the driver API as indented `fn cuXxx(` lines inside
        # `extern "C"` blocks of src/driver/sys/mod.rs (not `pub fn`): 514 names.
        local sys
        sys=$(find "$HOME/.cargo/registry/src" -path '*/cudarc-0.19.*/src/driver/sys/mod.rs' 2>/dev/null | sort -V | tail -1)
        if [ -z "$sys" ]; then
            echo "cuda-toolchain: cudarc 0.19's source is not in ~/.cargo/registry. Fix: run \`cargo fetch\` in the workspace first." >&2
            return 1
        fi
        local tmp
        tmp=$(mktemp -d)
        grep -oE '^\s+fn cu[A-Za-z0-9_]+' "$sys" | sed -E 's/^\s+fn //' | sort -u \
            | sed -E 's/(.*)/int \1(void){return 100;}/' > "$tmp/cuda_stub.c"
        local n
        n=$(wc -l < "$tmp/cuda_stub.c")
        if [ "$n" -lt 100 ]; then
            echo "cuda-toolchain: found only $n driver functions in $sys; cudarc's layout changed. Fix: update the grep in scripts/cuda-toolchain.sh." >&2
            rm -rf "$tmp"
            return 1
        fi
        gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$tmp/libcuda.so.1" "$tmp/cuda_stub.c"
        # Renamed into place: another build sourcing this at the same time sees all or nothing.
        mv -f "$tmp/libcuda.so.1" libcuda.so.1
        rm -rf "$tmp"
        echo "cuda-toolchain: link stub libcuda.so.1 with $n driver functions (from $sys)" >&2
    fi
    [ -e libcuda.so ] || ln -sf libcuda.so.1 libcuda.so
)

speedkit_cuda_cu="${SPEEDKIT_CUDA_CACHE:-$HOME/.cache/candle-speedkit/cuda13}/nvidia/cu13"
speedkit_cuda_stub=0
[ "${1:-}" = "--link-stub" ] && speedkit_cuda_stub=1
if speedkit_cuda_toolchain "$speedkit_cuda_cu" "$speedkit_cuda_stub"; then
    export CUDA_HOME="$speedkit_cuda_cu" CUDA_PATH="$speedkit_cuda_cu" PATH="$speedkit_cuda_cu/bin:$PATH"
    # sm_90 (Hopper): the GPUs this project is measured on. Set it before sourcing to target
    # others. candle's own kernels are then built as sm_90a (cudaforge adds the `a` from 90 up):
    # arch-specific PTX that loads on H100/H200 only; see docs/gpu.md for a portable build.
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
    export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"
    if [ "$speedkit_cuda_stub" = 1 ]; then
        export LIBRARY_PATH="$speedkit_cuda_cu/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
    fi
    echo "cuda-toolchain: $(nvcc --version | tail -1) at $speedkit_cuda_cu, CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP" >&2
    unset speedkit_cuda_cu speedkit_cuda_stub
    unset -f speedkit_cuda_toolchain
else
    unset speedkit_cuda_cu speedkit_cuda_stub
    unset -f speedkit_cuda_toolchain
    echo "cuda-toolchain: failed (see above)" >&2
    # `return` when sourced, `exit` when run.
    # shellcheck disable=SC2317 # reached when the script is run, not sourced
    return 1 2>/dev/null || exit 1
fi
