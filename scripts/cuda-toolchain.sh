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
    # A subshell, so nothing in here reaches the caller's shell. No `set -e`: callers write
    # `if source ...` or `source ... || ...`, and there bash ignores `set -e` in every function
    # called, this one included. So each command that can fail is checked, and every path is
    # absolute: the only folder written is the cache (pip's temporary files included).
    cache="$1" link_stub="$2" workspace="$3"  # workspace: the checkout whose Cargo.lock names cudarc
    cu="$cache/nvidia/cu13"
    fail() { echo "cuda-toolchain: $*" >&2; return 1; }
    if [ ! -x "$cu/bin/nvcc" ]; then
        mkdir -p "$cache" || fail "cannot create the cache folder $cache. Fix: set SPEEDKIT_CUDA_CACHE to a folder you can write (~1.2 GB)." || return 1
        # pip --target skips a folder that already exists (a half-done earlier install would
        # stay half-done), so the wheels go into a fresh folder, then are copied over the cache.
        staging=$(mktemp -d "$cache/.install.XXXXXX") || fail "cannot write into the cache folder $cache. Fix: set SPEEDKIT_CUDA_CACHE to a folder you can write (~1.2 GB)." || return 1
        echo "cuda-toolchain: installing CUDA 13.0 wheels into $cache" >&2
        if ! TMPDIR="$staging" python3 -m pip install --quiet --disable-pip-version-check --no-cache-dir --no-deps --target "$staging/target" \
            nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
            nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88 \
            "nvidia-cublas>=13.0,<13.1" nvidia-curand==10.4.0.35; then
            rm -rf "$staging"
            fail "pip could not install the CUDA 13.0 wheels (its message is above: no network, PyPI not reachable through PIP_INDEX_URL or a proxy, or no pip for python3). Fix: make PyPI (or a mirror with these wheels, PIP_INDEX_URL) reachable and source this again; nothing was installed." || return 1
        fi
        if [ ! -f "$staging/target/nvidia/cu13/bin/nvcc" ]; then
            rm -rf "$staging"
            fail "the wheels installed, but hold no nvidia/cu13/bin/nvcc: their layout changed. Fix: update the package list in scripts/cuda-toolchain.sh." || return 1
        fi
        if ! cp -a "$staging/target/." "$cache/"; then
            rm -rf "$staging"
            fail "could not copy the wheels into $cache (disk full?). Fix: free ~1.2 GB there, or set SPEEDKIT_CUDA_CACHE elsewhere, and source this again." || return 1
        fi
        rm -rf "$staging"
        # Wheels do not keep the executable bit.
        chmod +x "$cu"/bin/* "$cu"/nvvm/bin/* || fail "could not make the CUDA tools in $cu executable. Fix: check that folder's permissions." || return 1
    fi
    [ "$link_stub" = 1 ] || return 0
    # Linking needs unversioned .so names and a libcuda.so.1. No wheel ships the driver, so we
    # build a stub that defines every driver function cudarc declares; the real driver replaces
    # it at run time (the stub's soname is libcuda.so.1, the driver's).
    lib="$cu/lib"
    [ -d "$lib" ] || fail "$lib is missing although $cu/bin/nvcc is there: the cache is incomplete. Fix: delete $cache and source this again (it reinstalls)." || return 1
    for l in cublas.so.13 cublasLt.so.13 cudart.so.13 nvrtc.so.13 curand.so.10; do
        [ -e "$lib/lib$l" ] || fail "$lib/lib$l is missing: the cache is incomplete. Fix: delete $cache and source this again (it reinstalls)." || return 1
        [ -e "$lib/lib${l%.so.*}.so" ] || ln -sf "lib$l" "$lib/lib${l%.so.*}.so" || fail "cannot write the link lib${l%.so.*}.so in $lib." || return 1
    done
    if [ ! -e "$lib/libcuda.so.1" ]; then
        # cudarc 0.19.10 declares the driver API as indented `fn cuXxx(` lines inside
        # `extern "C"` blocks of src/driver/sys/mod.rs (not `pub fn`): 514 names.
        # A CPU build never downloads cudarc (the cuda feature's dependency): fetch the lock file's
        # crates first when its source is missing (a fresh machine, or a fresh CARGO_HOME).
        registry="${CARGO_HOME:-$HOME/.cargo}/registry/src"
        find_sys() { find "$registry" -path '*/cudarc-0.19.*/src/driver/sys/mod.rs' 2> /dev/null | sort -V | tail -1; }
        sys=$(find_sys) || true  # no registry yet: fetched next
        if [ -z "$sys" ] && [ -n "$workspace" ]; then
            echo "cuda-toolchain: cudarc's source is not in $registry yet: cargo fetch --locked" >&2
            (cd "$workspace" && cargo fetch --locked) >&2 || fail "cargo fetch --locked failed in $workspace (its message is above), and the link stub is built from cudarc's source. Fix: make crates.io reachable and source this again." || return 1
            sys=$(find_sys) || true
        fi
        [ -n "$sys" ] || fail "cudarc 0.19's source is not in $registry, and the link stub is built from it. Fix: run \`cargo fetch --locked\` in the workspace first." || return 1
        tmp=$(mktemp -d "$lib/.stub.XXXXXX") || fail "cannot write into $lib. Fix: check that folder's permissions." || return 1
        if ! grep -oE '^\s+fn cu[A-Za-z0-9_]+' "$sys" | sed -E 's/^\s+fn //' | sort -u \
            | sed -E 's/(.*)/int \1(void){return 100;}/' > "$tmp/cuda_stub.c"; then
            rm -rf "$tmp"
            fail "could not read the driver functions from $sys." || return 1
        fi
        n=$(wc -l < "$tmp/cuda_stub.c")
        if [ "$n" -lt 100 ]; then
            rm -rf "$tmp"
            fail "found only $n driver functions in $sys; cudarc's layout changed. Fix: update the grep in scripts/cuda-toolchain.sh." || return 1
        fi
        if ! gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$tmp/libcuda.so.1" "$tmp/cuda_stub.c"; then
            rm -rf "$tmp"
            fail "gcc could not build the link stub libcuda.so.1 (its message is above). Fix: install gcc (apt-get install gcc)." || return 1
        fi
        # Renamed into place: another build sourcing this at the same time sees all or nothing.
        mv -f "$tmp/libcuda.so.1" "$lib/libcuda.so.1" || { rm -rf "$tmp"; fail "cannot write $lib/libcuda.so.1."; return 1; }
        rm -rf "$tmp"
        echo "cuda-toolchain: link stub libcuda.so.1 with $n driver functions (from $sys)" >&2
    fi
    [ -e "$lib/libcuda.so" ] || ln -sf libcuda.so.1 "$lib/libcuda.so" || fail "cannot write the link libcuda.so in $lib." || return 1
)

# One optional argument, --link-stub; anything else is refused before any install (a typo such as
# --link_stub would otherwise set up no link stub without a word).
if [ $# -gt 1 ] || { [ $# = 1 ] && [ "$1" != "--link-stub" ]; }; then
    echo "cuda-toolchain: unknown argument(s): $*; it takes none, or --link-stub. Fix: source scripts/cuda-toolchain.sh [--link-stub] (a script that sources it with no arguments passes its own: give it none). Nothing was installed." >&2
    # `return` when sourced, `exit` when run.
    # shellcheck disable=SC2317 # reached when the script is run, not sourced
    return 2 2>/dev/null || exit 2
fi
speedkit_cuda_root="${SPEEDKIT_CUDA_CACHE:-$HOME/.cache/candle-speedkit/cuda13}"
speedkit_cuda_cu="$speedkit_cuda_root/nvidia/cu13"
speedkit_cuda_stub=0
[ "${1:-}" = "--link-stub" ] && speedkit_cuda_stub=1
speedkit_cuda_ws=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." 2> /dev/null && [ -f Cargo.lock ] && pwd) || speedkit_cuda_ws=""
if speedkit_cuda_toolchain "$speedkit_cuda_root" "$speedkit_cuda_stub" "$speedkit_cuda_ws"; then
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
    unset speedkit_cuda_root speedkit_cuda_cu speedkit_cuda_stub speedkit_cuda_ws
    unset -f speedkit_cuda_toolchain
else
    unset speedkit_cuda_root speedkit_cuda_cu speedkit_cuda_stub speedkit_cuda_ws
    unset -f speedkit_cuda_toolchain
    echo "cuda-toolchain: failed (see above)" >&2
    # `return` when sourced, `exit` when run.
    # shellcheck disable=SC2317 # reached when the script is run, not sourced
    return 1 2>/dev/null || exit 1
fi
