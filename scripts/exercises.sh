#!/usr/bin/env bash
# Runs every exercise in docs/stages.md at --preset tiny with the built release binaries, so a
# command the docs teach cannot rot. An exercise is a line starting with "**Try it.**" whose first
# code span is `cargo run --release -p CRATE -- ARGS`; it runs as BIN_DIR/CRATE ARGS --preset tiny
# (ARGS that set a dimension, such as --seq 2048, still win over the preset).
#
#   scripts/exercises.sh [BIN_DIR]    # BIN_DIR: the release binaries [the repository's target/release]
set -euo pipefail
# A relative BIN_DIR is the caller's, so it is made absolute before the cd into the repository.
bin=${1:-}
if [ -n "$bin" ] && [ "${bin#/}" = "$bin" ]; then
    bin="$PWD/$bin"
fi
cd "$(dirname "$0")/.."
bin=${bin:-target/release}
doc=docs/stages.md
stages=5
if [ ! -d "$bin" ]; then
    echo "exercises.sh: $bin is not a folder. Fix: cargo build --release --workspace first, or pass the folder holding the binaries." >&2
    exit 2
fi
tick='`'
mapfile -t cmds < <(grep '^\*\*Try it\.\*\*' "$doc" | grep -o "${tick}cargo run --release -p [^${tick}]*${tick}" | tr -d "$tick")
if [ "${#cmds[@]}" -ne "$stages" ]; then
    echo "exercises.sh: $doc has ${#cmds[@]} exercises in the form \"**Try it.** \`cargo run --release -p CRATE -- ARGS\`\", one per stage expected ($stages)." >&2
    exit 1
fi
start=$(date +%s)
for cmd in "${cmds[@]}"; do
    read -r -a w <<< "$cmd"
    crate=${w[4]}
    args=()
    if [ "${#w[@]}" -gt 5 ]; then
        if [ "${w[5]}" != "--" ]; then
            echo "exercises.sh: \"$cmd\": the arguments must follow \" -- \"." >&2
            exit 1
        fi
        args=("${w[@]:6}")
    fi
    exe="$bin/$crate"
    if [ ! -x "$exe" ]; then
        echo "exercises.sh: \"$cmd\" needs $exe, which is not built. Fix: cargo build --release -p $crate." >&2
        exit 2
    fi
    echo "=== exercise: $cmd  (here at --preset tiny)"
    "$exe" "${args[@]}" --preset tiny --warmup 1 --iters 2
done
echo "all $stages exercises ran in $(( $(date +%s) - start ))s"
