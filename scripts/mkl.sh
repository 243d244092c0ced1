#!/usr/bin/env bash
# Install Intel MKL offline from PyPI into one prefix, for candle's `mkl` feature, and print the
# MKLROOT to build with. intel-mkl-src (candle-core's MKL binding) looks for MKL through
# MKLROOT before it tries any download, so with this prefix the build downloads nothing.
#
#   eval "$(scripts/mkl.sh)"                    # installs (once) and exports MKLROOT, LD_LIBRARY_PATH
#   cargo run --release --features mkl -p ladder
#
# Prefix: $SPEEDKIT_MKL_PREFIX, default ~/.cache/candle-speedkit/mkl. Needs python3 with pip
# and unzip-capable python (zipfile); nothing else. The wheels are Intel's own (mkl-static,
# mkl-include, intel-openmp); the static MKL is linked into the binary, libiomp5.so is loaded
# at run time from $MKLROOT/lib (hence LD_LIBRARY_PATH).
set -euo pipefail
usage="usage: eval \"\$(scripts/mkl.sh)\"   (installs MKL once into \$SPEEDKIT_MKL_PREFIX [~/.cache/candle-speedkit/mkl] and prints the exports to build with --features mkl); no arguments"
case "${1-}" in
    -h | --help)
        echo "$usage"
        exit 0
        ;;
    "") [ $# -eq 0 ] || { echo "mkl.sh: an empty argument. $usage" >&2; exit 2; } ;;
    *)
        echo "mkl.sh: unknown arguments: $*. Fix: run it with none. $usage" >&2
        exit 2
        ;;
esac
prefix="${SPEEDKIT_MKL_PREFIX:-$HOME/.cache/candle-speedkit/mkl}"
if [ ! -f "$prefix/lib/libmkl_core.a" ] || [ ! -f "$prefix/include/mkl.h" ] || [ ! -e "$prefix/lib/libiomp5.so" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    echo "mkl.sh: downloading mkl-static, mkl-include, intel-openmp from PyPI into $prefix" >&2
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$work" mkl-static mkl-include intel-openmp >&2
    mkdir -p "$prefix/lib" "$prefix/include"
    for whl in "$work"/*.whl; do
        python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$whl" "$work/x" >&2
    done
    # Each wheel keeps its files under <name>-<version>.data/data/{lib,include}.
    for d in "$work"/x/*.data/data; do
        [ -d "$d/lib" ] && cp -a "$d/lib/." "$prefix/lib/"
        [ -d "$d/include" ] && cp -a "$d/include/." "$prefix/include/"
    done
    # intel-mkl-src and the linker want unversioned names (libiomp5.so); the wheels may ship
    # only versioned ones.
    for f in "$prefix"/lib/*.so.*; do
        [ -e "$f" ] || continue
        base="${f%%.so.*}.so"
        [ -e "$base" ] || ln -s "$(basename "$f")" "$base"
    done
    if [ ! -f "$prefix/lib/libmkl_core.a" ] || [ ! -e "$prefix/lib/libiomp5.so" ]; then
        echo "mkl.sh: the wheels did not contain libmkl_core.a and libiomp5.so; the layout of the PyPI packages may have changed. Look in $work/x." >&2
        trap - EXIT
        exit 2
    fi
fi
echo "export MKLROOT=\"$prefix\""
# MKL's OpenMP threads spin for 200 ms after each GEMM by default, taking the cores that rayon
# (attention, element-wise passes) needs next; measured on 2 cores, stage 3 ran faster with 0.
echo "export KMP_BLOCKTIME=0"
echo "export LD_LIBRARY_PATH=\"$prefix/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
