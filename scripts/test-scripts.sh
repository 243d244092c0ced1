#!/usr/bin/env bash
# The scripts' own tests: each script in scripts/ run with bad arguments or a broken setup must
# refuse with a non-zero exit and a message that names the cause, and write nothing outside its
# folder. Fake binaries stand in for ladder, cargo, pip and nvcc: no build, no download, no GPU,
# a few seconds. CI runs it right after shellcheck.
#
#   bash scripts/test-scripts.sh      # prints one line per check, exits 1 when any failed
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo=$(pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0
skipped=0

ok() { echo "ok    $1"; passed=$(( passed + 1 )); }
bad() {
    echo "FAIL  $1: $2"
    [ -f "$tmp/out" ] && sed 's/^/      | /' "$tmp/out" | head -n 20
    failed=$(( failed + 1 ))
}
skip() { echo "skip  $1 ($2)"; skipped=$(( skipped + 1 )); }

# A fresh, empty working folder for each check: what a script leaves there, it wrote outside
# the folders it was given.
n=0
fresh_cwd() { n=$(( n + 1 )); cwd="$tmp/cwd.$n"; mkdir -p "$cwd"; }
cwd_empty() { [ -z "$(ls -A "$cwd")" ]; }
# Whether archive $1 holds a path matching $2. The listing goes to a file first: `tar | grep -q`
# under pipefail fails whenever grep exits before tar has written its last line (SIGPIPE).
archive_has() { tar -tzf "$1" > "$tmp/listing" 2> /dev/null && grep -q -- "$2" "$tmp/listing"; }

# expect NAME CODE PHRASE COMMAND...: runs COMMAND in a fresh cwd; passes when it exits CODE,
# its output (stdout and stderr) holds PHRASE, shows no Python traceback and leaves cwd empty.
expect() {
    local name="$1" code="$2" phrase="$3" rc
    shift 3
    fresh_cwd
    (cd "$cwd" && "$@") > "$tmp/out" 2>&1
    rc=$?
    if [ "$rc" != "$code" ]; then
        bad "$name" "exit $rc, expected $code"
    elif ! grep -qF -- "$phrase" "$tmp/out"; then
        bad "$name" "the output does not say '$phrase'"
    elif grep -q '^Traceback' "$tmp/out"; then
        bad "$name" "a Python traceback instead of a message"
    elif ! cwd_empty; then
        bad "$name" "wrote into the caller's folder: $(find "$cwd" -mindepth 1 -maxdepth 1 -printf '%f ')"
    else
        ok "$name"
    fi
}

# Fakes. A tool that must not run leaves a mark when it does; the mark fails the check.
fakes="$tmp/fakes"
mkdir -p "$fakes"
for tool in cargo pip pip3 nvcc; do
    printf '#!/bin/sh\necho "%s $*" >> "%s/ran"\nexit 1\n' "$tool" "$tmp" > "$fakes/$tool"
done
printf '#!/bin/sh\ncase "$*" in *" -m pip"*|"-m pip"*) echo "python3 $*" >> "%s/ran"; exit 1 ;; esac\nexec "%s" "$@"\n' \
    "$tmp" "$(command -v python3)" > "$fakes/python3"
chmod +x "$fakes"/*
nothing_ran() {  # nothing_ran NAME: passes when no fake tool was called since the last check
    if [ -s "$tmp/ran" ]; then bad "$1" "ran $(tr '\n' ';' < "$tmp/ran")"; rm -f "$tmp/ran"; else ok "$1"; fi
}
export PATH="$fakes:$PATH"

# A ladder that fails every step, and one that passes and writes its --json file.
printf '#!/bin/sh\necho "fake ladder $*"; echo wrote > wrote-here.txt; exit 1\n' > "$tmp/ladder-fail"
# shellcheck disable=SC2016 # the fake's own $1, $2 and $#
printf '#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = --json ] && echo "{}" > "$2"; shift; done\n' > "$tmp/ladder-pass"
chmod +x "$tmp/ladder-fail" "$tmp/ladder-pass"
touch "$tmp/afile"

# ---- gpu-check.sh ----------------------------------------------------------------------------
gc=("$repo/scripts/gpu-check.sh" --device cpu)
expect "gpu-check --list: both parts, their timeouts, an estimate" 0 "estimate" "${gc[@]}" --list
if "${gc[@]}" --list | awk '$2 ~ /^[0-9]+$/ && $3 == "s" { n++; if ($2 > 300) big = 1 } END { exit !(n >= 12 && !big) }'; then
    ok "gpu-check --list: at least 12 steps, none with a timeout over 5 minutes"
else
    bad "gpu-check --list: at least 12 steps, none with a timeout over 5 minutes" "see the table"
fi
expect "gpu-check --help" 0 "--only" "${gc[@]}" --help
expect "gpu-check: no --part refused" 2 "no --part given" "${gc[@]}" --bin "$tmp/ladder-fail"
expect "gpu-check: --part 3 refused" 2 "is not a part" "${gc[@]}" --bin "$tmp/ladder-fail" --part 3
expect "gpu-check: --deadline over 590 s refused" 2 "from 30 to 590" "${gc[@]}" --bin "$tmp/ladder-fail" --part 1 --deadline 900
expect "gpu-check: --deadline not a number refused" 2 "from 30 to 590" "${gc[@]}" --bin "$tmp/ladder-fail" --part 1 --deadline 5m
expect "gpu-check: unknown argument refused" 2 "unknown argument" "${gc[@]}" --bin "$tmp/ladder-fail" --part 1 --bogus
expect "gpu-check: --out without a value refused" 2 "needs a value" "${gc[@]}" --bin "$tmp/ladder-fail" --part 1 --out
expect "gpu-check: a missing --bin refused" 2 "no executable ladder binary" "${gc[@]}" --part 1 --bin "$tmp/no-such-ladder" --out "$tmp/unused"
[ -e "$tmp/unused" ] && bad "gpu-check: a refused run creates no --out" "$tmp/unused exists"
expect "gpu-check: a missing --scripts refused" 2 "is not a folder" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --scripts "$tmp/no-such-dir" --out "$tmp/unused"
expect "gpu-check: --out that is a file refused" 2 "is a file" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --out "$tmp/afile"
expect "gpu-check: --archive-to that is a file refused" 2 "is a file" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --out "$tmp/unused2" --archive-to "$tmp/afile"
expect "gpu-check: --out under a file (cannot be created) refused" 2 "cannot be created" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --out "$tmp/afile/sub"
expect "gpu-check: --out in /proc (not writable, even by root) refused" 2 "cannot be created" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --out /proc/gpu-check-test
if [ "$(id -u)" = 0 ]; then
    skip "gpu-check: --out in a chmod 555 folder refused" "root writes into read-only folders; /proc above covers it"
else
    mkdir -p "$tmp/ro" && chmod 555 "$tmp/ro"
    expect "gpu-check: --out in a chmod 555 folder refused" 2 "cannot" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --out "$tmp/ro/sub"
    expect "gpu-check: --out that is a chmod 555 folder refused" 2 "cannot write" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --out "$tmp/ro"
fi
expect "gpu-check --only: an unknown name refused with the list" 2 "attention-kernels" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --only selftest,bogus
expect "gpu-check --only: a step of the other part refused" 2 "not a step of part 1" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --only ncu-attention-t4096
expect "gpu-check --only: names are exact, not patterns" 2 "not a step" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --only ladder
expect "gpu-check --only '': refused" 2 "names no step" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --only ''
expect "gpu-check: no step ran (only n/a steps selected) -> exit 1" 1 "no step ran" "${gc[@]}" --part 2 --bin "$tmp/ladder-fail" --only ncu-attention-t4096 --out "$tmp/out-na"

# Every ladder step fails (the torch and sdpa steps are n/a or fail without a GPU).
expect "gpu-check: failing steps -> exit 1" 1 "step(s) did not pass" "${gc[@]}" --part 1 --bin "$tmp/ladder-fail" --only probe,selftest,report,ladder-te --out "$tmp/out-fail"
run_dir=$(find "$tmp/out-fail" -mindepth 1 -maxdepth 1 -type d -name 'gpu-check-part1-*' | head -1)
one=$(find "$tmp/out-fail" -mindepth 1 -maxdepth 1 -name '*.tar.gz' | wc -l)
if [ "$one" = 1 ] && archive_has "$run_dir.tar.gz" "/selftest/wrote-here.txt$" && archive_has "$run_dir.tar.gz" "/ladder-te/ladder-te.log$" \
    && archive_has "$run_dir.tar.gz" "summary.tsv$" && ! archive_has "$run_dir.tar.gz" "/scratch"; then
    ok "gpu-check: one archive for the part, beside its folder, holding every step's files and the summary, not scratch/"
else
    bad "gpu-check: one archive for the part, beside its folder, holding every step's files and the summary, not scratch/" "$one archives in $tmp/out-fail"
fi
if [ -z "$(find "$tmp" -name wrote-here.txt -not -path "$tmp/out-fail/*")" ] && [ "$(find "$tmp/out-fail" -mindepth 1 -maxdepth 1 | wc -l)" = 2 ]; then
    ok "gpu-check: nothing written outside --out, one folder and its archive inside it"
else
    bad "gpu-check: nothing written outside --out, one folder and its archive inside it" "$(ls -A "$tmp/out-fail")"
fi

expect "gpu-check: passing steps -> exit 0, --out created when missing, --archive-to gets the archive alone" 0 "0 of 2 step(s) did not pass" \
    "${gc[@]}" --part 1 --bin "$tmp/ladder-pass" --only selftest,ladder-te --out "$tmp/new/deeper" --archive-to "$tmp/ret"
if [ "$(find "$tmp/ret" -mindepth 1 | wc -l)" = 1 ] && archive_has "$tmp/ret/"gpu-check-part1-*.tar.gz "/ladder-te/ladder-te.json$"; then
    ok "gpu-check: --archive-to holds one file, the archive, with the step's JSON"
else
    bad "gpu-check: --archive-to holds one file, the archive, with the step's JSON" "$(ls -A "$tmp/ret")"
fi

# A step killed at the deadline: the archive, re-packed after every step, keeps the ones that ended.
# 40 s: the first step starts with ~30 s left (10 are kept for packing, a step needs 20), so a
# loaded machine's second or two before it does not turn it into "not run".
printf '#!/bin/sh\ncase "$*" in *selftest*) echo "{}" > selftest.json ;; *) sleep 60 ;; esac\n' > "$tmp/ladder-slow"
chmod +x "$tmp/ladder-slow"
expect "gpu-check: a step cut by the deadline -> exit 1, the next one not run" 1 "not run (" \
    "${gc[@]}" --part 1 --bin "$tmp/ladder-slow" --only selftest,report,train-small-d128 --deadline 40 --out "$tmp/out-late"
late_dir=$(find "$tmp/out-late" -mindepth 1 -maxdepth 1 -type d -name 'gpu-check-part1-*' | head -1)
if archive_has "$late_dir.tar.gz" "/selftest/selftest.json$" && grep -q "timeout" "$late_dir/summary.tsv" && grep -q "not run: deadline" "$late_dir/summary.tsv"; then
    ok "gpu-check: the deadline cuts the step under way, skips the rest, and the archive keeps the finished step"
else
    bad "gpu-check: the deadline cuts the step under way, skips the rest, and the archive keeps the finished step" "$(cat "$late_dir/summary.tsv" 2> /dev/null)"
fi

# The profiler steps' commands, as a GPU machine would run them: fake ncu and compute-sanitizer
# record their arguments (a command split over lines must reach ncu whole, the ladder last).
mkdir -p "$tmp/gpu-tools"
for tool in ncu compute-sanitizer; do
    printf '#!/bin/sh\necho "$*" >> "%s/%s.args"\n' "$tmp" "$tool" > "$tmp/gpu-tools/$tool"
done
chmod +x "$tmp/gpu-tools"/*
PATH="$tmp/gpu-tools:$PATH" "$repo/scripts/gpu-check.sh" --part 2 --device cuda --bin "$tmp/ladder-pass" --only racecheck-attention-d128,ncu-attention-t4096 --out "$tmp/out-tools" > "$tmp/out" 2>&1
if grep -q -- "--section SourceCounters.*--export attention-t4096 $tmp/ladder-pass --device cuda" "$tmp/ncu.args" 2> /dev/null \
    && grep -q -- "--tool racecheck $tmp/ladder-pass --device cuda .*--train" "$tmp/compute-sanitizer.args" 2> /dev/null; then
    ok "gpu-check: ncu and compute-sanitizer get their whole command lines, the ladder and its flags last"
else
    bad "gpu-check: ncu and compute-sanitizer get their whole command lines, the ladder and its flags last" "ncu: $(cat "$tmp/ncu.args" 2> /dev/null)"
fi

# ---- ncu-times.py: the shape from each kernel's grid --------------------------------------------
nt=(python3 "$repo/scripts/ncu-times.py")
{
    echo 'noise from the program'
    echo '"ID","Kernel Name","Block Size","Grid Size","Metric Name","Metric Unit","Metric Value"'
    echo '"0","flash_attn_v2_fwd_bf16_d128","(128, 1, 1)","(32, 8, 16)","gpu__time_duration.sum","ns","1,000,000"'
    echo '"1","flash_attn_bwd_bf16_d128","(128, 1, 1)","(32, 32, 8)","gpu__time_duration.sum","msecond","2"'
    echo '"2","flash_attn_bwd_bf16_d128","(128, 1, 1)","(32, 32, 8)","gpu__time_duration.sum","msecond","4"'
} > "$tmp/ncu.csv"
if "${nt[@]}" --d-head 128 "$tmp/ncu.csv" --json "$tmp/kt.json" > /dev/null 2>&1 && python3 - "$tmp/kt.json" << 'PY'
import json, sys
rows = {r["kernel"]: r for r in json.load(open(sys.argv[1]))["rows"]}
v2, bwd = rows["flash_attn_v2_fwd_bf16_d128"], rows["flash_attn_bwd_bf16_d128"]
assert (v2["batch"], v2["n_head"], v2["seq"], v2["median_ms"]) == (8, 32, 2048, 1.0), v2
assert (bwd["batch"], bwd["n_head"], bwd["seq"], bwd["median_ms"], bwd["launches"]) == (8, 32, 2048, 3.0, 2), bwd
assert abs(bwd["tflops"] - 2.5 * 4 * 8 * 32 * 2048**2 * 128 / 2 / 3.0 / 1e9) < 1e-6
PY
then
    ok "ncu-times: B, n_head and T from each kernel's grid (v2's order differs), the median over launches, TFLOP/s"
else
    bad "ncu-times: B, n_head and T from each kernel's grid (v2's order differs), the median over launches, TFLOP/s" "$(cat "$tmp/kt.json" 2> /dev/null)"
fi
expect "ncu-times: a file with no ncu rows refused" 2 "no CSV rows" "${nt[@]}" --d-head 128 "$tmp/afile"

# ---- sdpa-bench.py: refusals before any work ---------------------------------------------------
sb=(python3 "$repo/scripts/sdpa-bench.py")
expect "sdpa-bench: a --seq that is not a list of integers refused" 2 "is not a list of integers" "${sb[@]}" --seq 512,x
expect "sdpa-bench: a --json in a missing folder refused" 2 "not writable" "${sb[@]}" --json "$tmp/no-such-dir/s.json"
expect "sdpa-bench: no CUDA GPU (or no torch) -> exit 2 naming the fix" 2 "Fix:" "${sb[@]}" --seq 64

# ---- exercises.sh: each exercise of docs/stages.md, with fake binaries -----------------------
ex=(bash "$repo/scripts/exercises.sh")
expect "exercises: a missing binaries folder refused" 2 "is not a folder" "${ex[@]}" "$tmp/no-such-bin"
mkdir -p "$tmp/ex-empty"
expect "exercises: a binary that is not built is named" 2 "which is not built" "${ex[@]}" "$tmp/ex-empty"
mkdir -p "$tmp/ex-bin"
for crate in ladder stage0_baseline stage4_fp8; do
    printf '#!/usr/bin/env bash\necho "%s $*" >> "%s"\n' "$crate" "$tmp/ex-calls" > "$tmp/ex-bin/$crate"
    chmod +x "$tmp/ex-bin/$crate"
done
expect "exercises: all five run" 0 "all 5 exercises ran" "${ex[@]}" "$tmp/ex-bin"
if [ "$(grep -c -- '--preset tiny' "$tmp/ex-calls" 2> /dev/null)" = 5 ] && grep -q -- '^ladder --stages 1,2 --seq 2048 --preset tiny' "$tmp/ex-calls"; then
    ok "exercises: each command ran as written, plus --preset tiny"
else
    bad "exercises: each command ran as written, plus --preset tiny" "$(cat "$tmp/ex-calls" 2> /dev/null)"
fi
# expect runs in $tmp/cwd.N: ../ex-bin is the caller's folder, not one under the repository.
expect "exercises: a relative BIN_DIR is the caller's folder" 0 "all 5 exercises ran" "${ex[@]}" ../ex-bin
printf '#!/usr/bin/env bash\nexit 3\n' > "$tmp/ex-bin/stage0_baseline"
expect "exercises: a failing exercise fails the script" 3 "exercise: cargo run --release -p stage0_baseline" "${ex[@]}" "$tmp/ex-bin"

# ---- gpu-bundle.sh: refused before anything is installed or built ----------------------------
rm -f "$tmp/ran"
gb=(env SPEEDKIT_CUDA_CACHE="$tmp/bundle-cache" bash "$repo/scripts/gpu-bundle.sh")
expect "gpu-bundle --help" 0 "Usage" "${gb[@]}" --help
expect "gpu-bundle --bogus refused" 2 "unknown argument" "${gb[@]}" --bogus
expect "gpu-bundle CUDA_COMPUTE_CAP=abc refused" 2 "not one compute capability" env CUDA_COMPUTE_CAP=abc "${gb[@]}"
expect "gpu-bundle CUDA_COMPUTE_CAP=80,90 (a list) refused" 2 "not one compute capability" env CUDA_COMPUTE_CAP=80,90 "${gb[@]}"
expect "gpu-bundle CUDA_COMPUTE_CAP=75 refused" 2 "below 80" env CUDA_COMPUTE_CAP=75 "${gb[@]}"
nothing_ran "gpu-bundle: no pip, cargo or nvcc ran for the refused requests"
if [ -e "$tmp/bundle-cache" ]; then bad "gpu-bundle: no cache folder made for the refused requests" "$tmp/bundle-cache exists"; else ok "gpu-bundle: no cache folder made for the refused requests"; fi

# ---- cuda-toolchain.sh: sourced as an `if` condition, where bash ignores set -e ---------------
# source-toolchain CACHE ARGS...: sources it the way .ci/run and scripts do, under set -e inside
# an `if`; prints what it exported; exits 0 when it returned 0, 3 when it returned non-zero.
cat > "$tmp/source-toolchain" << 'SCRIPT'
#!/usr/bin/env bash
set -euo pipefail
export SPEEDKIT_CUDA_CACHE="$1"
shift
if source "$TOOLCHAIN" "$@"; then
    echo "returned 0; CUDA_HOME=${CUDA_HOME-unset} CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP-unset} LIBRARY_PATH=${LIBRARY_PATH-unset} PATH=${PATH%%:*}"
    exit 0
else
    echo "returned non-zero; CUDA_HOME=${CUDA_HOME-unset}"
    exit 3
fi
SCRIPT
chmod +x "$tmp/source-toolchain"
st=(env TOOLCHAIN="$repo/scripts/cuda-toolchain.sh" "$tmp/source-toolchain")
# pip (the real one) with no index it can reach: the install fails; nothing after it may run.
no_index=(env -u PIP_EXTRA_INDEX_URL -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1
    PIP_INDEX_URL=http://127.0.0.1:9/ PIP_RETRIES=0 PATH="${PATH#"$fakes:"}")
expect "cuda-toolchain: a failed pip install returns non-zero inside 'if source'" 3 "pip could not install" \
    "${no_index[@]}" "${st[@]}" "$tmp/tc-empty" --link-stub
if [ -z "$(find "$tmp/tc-empty" -mindepth 1 2> /dev/null)" ]; then
    ok "cuda-toolchain: a failed install leaves its cache folder empty"
else
    bad "cuda-toolchain: a failed install leaves its cache folder empty" "$(find "$tmp/tc-empty" -mindepth 1 | head -3)"
fi
expect "cuda-toolchain: run, not sourced, a failure exits non-zero" 1 "pip could not install" \
    "${no_index[@]}" SPEEDKIT_CUDA_CACHE="$tmp/tc-empty2" bash "$repo/scripts/cuda-toolchain.sh"

# An unknown argument: refused before anything is installed (no pip, no cache folder).
expect "cuda-toolchain --bogus (run): refused with exit 2" 2 "unknown argument(s): --bogus" \
    env SPEEDKIT_CUDA_CACHE="$tmp/tc-bogus" bash "$repo/scripts/cuda-toolchain.sh" --bogus
expect "cuda-toolchain --link-stub --bogus (sourced): returns non-zero, exports nothing" 3 "CUDA_HOME=unset" \
    env -u CUDA_HOME "${st[@]}" "$tmp/tc-bogus" --link-stub --bogus
if [ -e "$tmp/tc-bogus" ] || grep -q "^pip" "$tmp/ran" 2> /dev/null; then
    bad "cuda-toolchain: an unknown argument installs nothing" "$(ls -d "$tmp/tc-bogus" 2>&1; cat "$tmp/ran" 2>&1)"
else
    ok "cuda-toolchain: an unknown argument installs nothing"
fi

# A cache with nvcc (a fake) but no lib/: the link stub's step refuses.
cu="$tmp/tc-half/nvidia/cu13"
mkdir -p "$cu/bin"
printf '#!/bin/sh\necho "Build cuda_13.0.r13.0/compiler.fake"\n' > "$cu/bin/nvcc"
chmod +x "$cu/bin/nvcc"
expect "cuda-toolchain --link-stub: an incomplete cache returns non-zero" 3 "cache is incomplete" "${st[@]}" "$tmp/tc-half" --link-stub
expect "cuda-toolchain: sourced, it exports CUDA_HOME, CUDA_COMPUTE_CAP and PATH" 0 \
    "CUDA_HOME=$cu CUDA_COMPUTE_CAP=90 LIBRARY_PATH=unset PATH=$cu/bin" env -u CUDA_COMPUTE_CAP -u LIBRARY_PATH "${st[@]}" "$tmp/tc-half"
# With the libraries (empty fakes) but no cudarc source in CARGO_HOME (a fresh machine): it runs
# `cargo fetch --locked` (here the fake cargo, which fails), then refuses.
mkdir -p "$cu/lib" "$tmp/home-empty"
for l in cublas.so.13 cublasLt.so.13 cudart.so.13 nvrtc.so.13 curand.so.10; do : > "$cu/lib/lib$l"; done
expect "cuda-toolchain --link-stub: no cudarc source and a failing cargo fetch return non-zero" 3 "cargo fetch --locked failed" \
    env -u CARGO_HOME HOME="$tmp/home-empty" "${st[@]}" "$tmp/tc-half" --link-stub
if grep -q "^cargo fetch --locked" "$tmp/ran" 2> /dev/null; then
    ok "cuda-toolchain --link-stub: no cudarc source: it fetches the lock file's crates"
else
    bad "cuda-toolchain --link-stub: no cudarc source: it fetches the lock file's crates" "cargo fetch was not run"
fi
rm -f "$tmp/ran"
# With a cudarc source of 120 driver functions: the stub is built into the cache, not the cwd.
if command -v gcc > /dev/null; then
    sys="$tmp/home/.cargo/registry/src/index/cudarc-0.19.10/src/driver/sys"
    mkdir -p "$sys"
    { echo 'extern "C" {'; for i in $(seq 120); do echo "    fn cuFake$i();"; done; echo '}'; } > "$sys/mod.rs"
    expect "cuda-toolchain --link-stub: builds the stub and exports LIBRARY_PATH" 0 "LIBRARY_PATH=$cu/lib" \
        env -u LIBRARY_PATH -u CARGO_HOME HOME="$tmp/home" "${st[@]}" "$tmp/tc-half" --link-stub
    if [ -e "$cu/lib/libcuda.so.1" ] && [ -L "$cu/lib/libcublas.so" ] && [ -z "$(find "$cu/lib" -name '.stub.*')" ]; then
        ok "cuda-toolchain --link-stub: libcuda.so.1 and the links are in the cache, no temporary folder left"
    else
        bad "cuda-toolchain --link-stub: libcuda.so.1 and the links are in the cache, no temporary folder left" "$(find "$cu/lib" -mindepth 1 -printf '%f ')"
    fi
else
    skip "cuda-toolchain --link-stub: builds the stub and exports LIBRARY_PATH" "no gcc"
fi

# ---- measure-cpu.sh: refused before cargo builds anything ------------------------------------
rm -f "$tmp/ran"
expect "measure-cpu: a missing baseline binary refused" 2 "no baseline ladder binary" bash "$repo/scripts/measure-cpu.sh" "$tmp/no-such-ladder"
expect "measure-cpu: ROUNDS=0 refused" 2 "ROUNDS=0" env ROUNDS=0 bash "$repo/scripts/measure-cpu.sh" "$tmp/ladder-pass"
expect "measure-cpu: a missing BREAKDOWN_BASE refused" 2 "BREAKDOWN_BASE" env BREAKDOWN_BASE="$tmp/no-such-ladder" bash "$repo/scripts/measure-cpu.sh" "$tmp/ladder-pass"
expect "measure-cpu: two arguments refused" 2 "at most one argument" bash "$repo/scripts/measure-cpu.sh" "$tmp/ladder-pass" extra
nothing_ran "measure-cpu: cargo did not run for the refused requests"
expect "measure-cpu-bf16: ROUNDS=0 refused" 2 "ROUNDS=0" env ROUNDS=0 bash "$repo/scripts/measure-cpu-bf16.sh" "$tmp/bf16-out"
expect "measure-cpu-bf16: two arguments refused" 2 "at most one argument" bash "$repo/scripts/measure-cpu-bf16.sh" "$tmp/bf16-out" extra
expect "measure-cpu-bf16: an output folder it cannot create is refused" 2 "cannot create or write the output folder" bash "$repo/scripts/measure-cpu-bf16.sh" /proc/speedkit-no-such/out
nothing_ran "measure-cpu-bf16: cargo did not run for the refused requests"
# A failing step names itself: the fake cargo exits 1 at the build.
expect "measure-cpu-bf16: a failed build names the step" 1 "failed at line" bash "$repo/scripts/measure-cpu-bf16.sh" "$tmp/bf16-fail"
rm -f "$tmp/ran"

# ---- train-pairs.sh: refused before cargo builds anything --------------------------------------
rm -f "$tmp/ran"
tp=(bash "$repo/scripts/train-pairs.sh")
expect "train-pairs: no argument refused" 2 "expected one argument" "${tp[@]}"
expect "train-pairs: PAIRS=0 refused" 2 "PAIRS=0" env PAIRS=0 "${tp[@]}" "$tmp/tp-out"
expect "train-pairs: ITERS=x refused" 2 "ITERS=x" env ITERS=x "${tp[@]}" "$tmp/tp-out"
expect "train-pairs: an output folder it cannot create is refused" 2 "cannot create or write the output folder" "${tp[@]}" /proc/speedkit-no-such/out
mkdir -p "$tmp/tp-full"
echo '{}' > "$tmp/tp-full/pair-1.json"
expect "train-pairs: a folder holding a sitting is refused, not overwritten" 2 "already holds a sitting" "${tp[@]}" "$tmp/tp-full"
[ "$(cat "$tmp/tp-full/pair-1.json")" = '{}' ] || bad "train-pairs: the earlier pair-1.json is kept" "it changed"
# A python3 without torch: the refusal names PyTorch before any build.
mkdir -p "$tmp/no-torch"
printf '#!/bin/sh\nexit 1\n' > "$tmp/no-torch/python3"
chmod +x "$tmp/no-torch/python3"
expect "train-pairs: no torch refused" 2 "cannot import torch" env PATH="$tmp/no-torch:$PATH" "${tp[@]}" "$tmp/tp-out"
nothing_ran "train-pairs: cargo did not run for the refused requests"

# ---- cpu-compare.py --------------------------------------------------------------------------
# run_json DIR NAME ROUND MEDIAN_MS SEQ: a ladder --json record with the fields the script reads.
run_json() {
    mkdir -p "$1"
    printf '{"shape": {"batch": 4, "seq": %s, "d_model": 768, "n_head": 12, "ff": 3072}, "records": [{"stage": "stage3_fused", "timing": {"median_ms": %s}}]}\n' "$5" "$4" > "$1/$2.$3.json"
}
cc=(python3 "$repo/scripts/cpu-compare.py")
run_json "$tmp/cc-good" old 1 20 512; run_json "$tmp/cc-good" new 1 10 512
expect "cpu-compare: two runs of one shape compared" 0 "old/new = 2.00x" "${cc[@]}" "$tmp/cc-good" old new
expect "cpu-compare: no arguments -> usage, exit 2" 2 "expected 3 arguments" "${cc[@]}"
mkdir -p "$tmp/cc-empty"
expect "cpu-compare: an empty folder -> exit 2" 2 "no runs named old" "${cc[@]}" "$tmp/cc-empty" old new
run_json "$tmp/cc-cut" old 1 20 512; run_json "$tmp/cc-cut" new 1 10 512
head -c 60 "$tmp/cc-cut/new.1.json" > "$tmp/cc-cut/new.2.json"
expect "cpu-compare: a truncated JSON is named" 1 "$tmp/cc-cut/new.2.json is not valid JSON" "${cc[@]}" "$tmp/cc-cut" old new
run_json "$tmp/cc-zero" old 1 20 512; run_json "$tmp/cc-zero" new 1 0 512
expect "cpu-compare: a median of 0 ms refused" 1 "median is 0.0 ms" "${cc[@]}" "$tmp/cc-zero" old new
run_json "$tmp/cc-shape" old 1 20 512; run_json "$tmp/cc-shape" new 1 10 1024
expect "cpu-compare: runs of different shapes refused" 1 "different shapes" "${cc[@]}" "$tmp/cc-shape" old new

# ---- torch-reference.py ----------------------------------------------------------------------
# Every refusal comes before PyTorch is imported, so these run without it (CI has no torch).
tr=(python3 "$repo/scripts/torch-reference.py")
touch "$tmp/w.safetensors" "$tmp/io.safetensors"
run_ok=("$repo/results/ladder-cpu.json")
expect "torch-reference: a missing flag -> usage, exit 2" 2 "--ladder-json" "${tr[@]}" --weights "$tmp/w.safetensors"
expect "torch-reference: a missing input file refused" 2 "is not a file" "${tr[@]}" --ladder-json "$tmp/none.json" --weights "$tmp/w.safetensors" --io "$tmp/io.safetensors" --out "$tmp/o.json"
expect "torch-reference: --out that is an input refused" 2 "never overwritten" "${tr[@]}" --ladder-json "${run_ok[0]}" --weights "$tmp/w.safetensors" --io "$tmp/io.safetensors" --out "$tmp/io.safetensors"
expect "torch-reference: --out in a missing folder refused" 2 "does not exist" "${tr[@]}" --ladder-json "${run_ok[0]}" --weights "$tmp/w.safetensors" --io "$tmp/io.safetensors" --out "$tmp/no/such/o.json"
expect "torch-reference: an unknown variant refused" 2 "the variants are" "${tr[@]}" --ladder-json "${run_ok[0]}" --weights "$tmp/w.safetensors" --io "$tmp/io.safetensors" --out "$tmp/o.json" --variants eager-f64
echo '{"schema": "candle-speedkit/sweep/v1", "axis": "seq", "values": [], "runs": []}' > "$tmp/sweep.json"
expect "torch-reference: an empty file refused" 2 "is not a ladder JSON" "${tr[@]}" --ladder-json "$tmp/w.safetensors" --weights "$tmp/w.safetensors" --io "$tmp/io.safetensors" --out "$tmp/o.json"
expect "torch-reference: a sweep JSON refused" 2 "has schema" "${tr[@]}" --ladder-json "$tmp/sweep.json" --weights "$tmp/w.safetensors" --io "$tmp/io.safetensors" --out "$tmp/o.json"
if python3 -c "import torch" 2> /dev/null; then
    skip "torch-reference: PyTorch missing -> exit 2 naming the fix" "torch is installed here"
else
    expect "torch-reference: PyTorch missing -> exit 2 naming the fix" 2 "pip install torch" "${tr[@]}" --ladder-json "${run_ok[0]}" --weights "$tmp/w.safetensors" --io "$tmp/io.safetensors" --out "$tmp/o.json"
fi
# Files checked against the run's shape before PyTorch is imported: a fresh tiny ladder run's when a
# ladder binary is built (LADDER, or the release build), else a tiny copy of the recorded run and
# safetensors files written here (the format is an 8-byte header length, a JSON header, the data).
cat > "$tmp/st.py" << 'EOF'
import json, struct, sys
def write(path, shapes):  # shapes: {name: [dims]}, f32 zeros
    head, off = {}, 0
    for name, dims in shapes.items():
        n = 4
        for d in dims:
            n *= d
        head[name] = {"dtype": "F32", "shape": dims, "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(head).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)) + h + bytes(off))
def gpt2(c, ff):
    return {"h.0.ln_1.weight": [c], "h.0.ln_1.bias": [c], "h.0.attn.c_attn.weight": [c, 3 * c], "h.0.attn.c_attn.bias": [3 * c],
            "h.0.attn.c_proj.weight": [c, c], "h.0.attn.c_proj.bias": [c], "h.0.ln_2.weight": [c], "h.0.ln_2.bias": [c],
            "h.0.mlp.c_fc.weight": [c, ff], "h.0.mlp.c_fc.bias": [ff], "h.0.mlp.c_proj.weight": [ff, c], "h.0.mlp.c_proj.bias": [c]}
kind, path = sys.argv[1], sys.argv[2]
if kind == "run":  # argv[3]: the recorded run to copy, with a tiny shape
    run = json.load(open(sys.argv[3]))
    run["shape"] = {"batch": 2, "seq": 4, "d_model": 8, "n_head": 2, "ff": 32}
    json.dump(run, open(path, "w"))
elif kind == "weights":  # argv[3], argv[4]: C and FF
    write(path, gpt2(int(sys.argv[3]), int(sys.argv[4])))
elif kind == "io":  # argv[3..5]: B, T, C; argv[6]: "no-y" leaves y out, "r-only" adds r but no gradients
    dims = [int(v) for v in sys.argv[3:6]]
    extra = {"r": dims} if sys.argv[6:] == ["r-only"] else {}
    write(path, {"x": dims} if sys.argv[6:] == ["no-y"] else {"x": dims, "y_stage0_baseline": dims, **extra})
elif kind == "train":  # argv[3]: a run to copy with every record a training step (what --train writes)
    run = json.load(open(sys.argv[3]))
    for r in run["records"]:
        r["mode"] = "train"
    json.dump(run, open(path, "w"))
EOF
ladder_bin=${LADDER:-${CARGO_TARGET_DIR:-$repo/target}/release/ladder}
tr_in="$tmp/tr"
mkdir -p "$tr_in"
if [ -x "$ladder_bin" ] && (cd "$tr_in" && "$ladder_bin" --device cpu --preset tiny --stages 0 --warmup 0 --iters 1 \
        --json run.json --save-weights w.safetensors --save-output io.safetensors) > "$tmp/out" 2>&1; then
    ok "torch-reference: a fresh tiny ladder run ($ladder_bin) wrote the files to check"
    python3 "$tmp/st.py" weights "$tr_in/w-wide.safetensors" 256 512  # C 256 where the run has 128
    python3 "$tmp/st.py" io "$tr_in/io-no-y.safetensors" 2 64 128 no-y
    python3 "$tmp/st.py" io "$tr_in/io-r-only.safetensors" 2 64 128 r-only
else
    skip "torch-reference: a fresh tiny ladder run" "no ladder binary at $ladder_bin; a tiny copy of the recorded run instead"
    python3 "$tmp/st.py" run "$tr_in/run.json" "${run_ok[0]}"
    python3 "$tmp/st.py" weights "$tr_in/w.safetensors" 8 32
    python3 "$tmp/st.py" io "$tr_in/io.safetensors" 2 4 8
    python3 "$tmp/st.py" weights "$tr_in/w-wide.safetensors" 16 32
    python3 "$tmp/st.py" io "$tr_in/io-no-y.safetensors" 2 4 8 no-y
    python3 "$tmp/st.py" io "$tr_in/io-r-only.safetensors" 2 4 8 r-only
fi
python3 "$tmp/st.py" train "$tr_in/run-train.json" "$tr_in/run.json"
tri=(--ladder-json "$tr_in/run.json" --out "$tmp/o.json")
expect "torch-reference: weights of another width refused, naming the file and the tensor" 2 \
    "--weights $tr_in/w-wide.safetensors: tensor h.0.ln_1.weight" "${tr[@]}" "${tri[@]}" --weights "$tr_in/w-wide.safetensors" --io "$tr_in/io.safetensors"
expect "torch-reference: --io without y_stage0_baseline refused" 2 "has no tensor y_stage0_baseline" \
    "${tr[@]}" "${tri[@]}" --weights "$tr_in/w.safetensors" --io "$tr_in/io-no-y.safetensors"
# A training run's PyTorch rows need the ladder's r and stage 0's gradients from --io.
expect "torch-reference: a training run's --io without r refused, naming the fix" 2 "Fix: re-record the run with this version" \
    "${tr[@]}" --ladder-json "$tr_in/run-train.json" --out "$tmp/o.json" --weights "$tr_in/w.safetensors" --io "$tr_in/io.safetensors"
expect "torch-reference: a training run's --io with r but no gradients refused" 2 "lacks grad_ln1_g" \
    "${tr[@]}" --ladder-json "$tr_in/run-train.json" --out "$tmp/o.json" --weights "$tr_in/w.safetensors" --io "$tr_in/io-r-only.safetensors"
head -c 200 "$tr_in/w.safetensors" > "$tr_in/w-cut.safetensors"
expect "torch-reference: truncated weights refused" 2 "w-cut.safetensors is not a safetensors file" \
    "${tr[@]}" "${tri[@]}" --weights "$tr_in/w-cut.safetensors" --io "$tr_in/io.safetensors"
expect "torch-reference: a JSON as --weights refused" 2 "is not a safetensors file" \
    "${tr[@]}" "${tri[@]}" --weights "$tr_in/run.json" --io "$tr_in/io.safetensors"
python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); del r["shape"]["ff"]; json.dump(r, open(sys.argv[2], "w"))' \
    "$tr_in/run.json" "$tr_in/run-no-ff.json"
expect "torch-reference: a run JSON without its shape's ff refused" 2 "lacks ff" \
    "${tr[@]}" --ladder-json "$tr_in/run-no-ff.json" --out "$tmp/o.json" --weights "$tr_in/w.safetensors" --io "$tr_in/io.safetensors"
cp "$tr_in/w.safetensors" "$tr_in/w-locked.safetensors"
chmod 000 "$tr_in/w-locked.safetensors"
as_user=()  # root reads files without read permission: as root, the check runs as nobody
if [ -r "$tr_in/w-locked.safetensors" ] && command -v runuser > /dev/null && [ -x /usr/bin/python3 ]; then
    chmod 711 "$tmp" "$tr_in" && chmod 644 "$tr_in/run.json" "$tr_in/io.safetensors"
    as_user=(runuser -u nobody -- /usr/bin/python3)
elif [ ! -r "$tr_in/w-locked.safetensors" ]; then
    as_user=(python3)
fi
if [ "${#as_user[@]}" = 0 ]; then
    skip "torch-reference: an unreadable input reported as such" "this user reads files without read permission, and runuser is missing"
else
    expect "torch-reference: an unreadable input reported as such" 2 "w-locked.safetensors cannot be read: Permission denied" \
        "${as_user[@]}" "$repo/scripts/torch-reference.py" "${tri[@]}" --weights "$tr_in/w-locked.safetensors" --io "$tr_in/io.safetensors"
fi
chmod 600 "$tr_in/w-locked.safetensors"
chmod 700 "$tmp"
[ -e "$tmp/o.json" ] && bad "torch-reference: a refused run writes no --out" "$tmp/o.json exists"

# ---- sass-loops.py ---------------------------------------------------------------------------
# A loop (0x10..0x50) with two HMMA and an `if` (the forward branch skips the FMUL).
printf '%s\n' '        /*0000*/                   MOV R1, c[0x0][0x28] ;' \
    '        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;' \
    '        /*0020*/              @P0 BRA 0x40 ;' \
    '        /*0030*/                   FMUL R2, R2, R3 ;' \
    '        /*0040*/                   HMMA.16816.F32.BF16 R4, R8, R14, R4 ;' \
    '        /*0050*/                   BRA 0x10 ;' \
    '        /*0060*/                   EXIT ;' > "$tmp/loop.sass"
sl="$repo/scripts/sass-loops.py"
expect "sass-loops: a loop's instructions, its skippable ones and its HMMA" 0 \
    "loop 0x0010..0x0050: 5 instructions (1 skippable), 2 HMMA, 256 per 128 HMMA without the skippable, 320 with" \
    python3 "$sl" "$tmp/loop.sass"
expect "sass-loops --json: opcodes by full mnemonic, without the skippable" 0 '"opcodes": {"HMMA.16816.F32.BF16": 2, "BRA": 2}' \
    python3 -c 'import json, subprocess, sys; print(json.dumps(json.loads(subprocess.run(sys.argv[1:], capture_output=True, text=True, check=True).stdout)))' \
    python3 "$sl" --json "$tmp/loop.sass"
expect "sass-loops --json: and with them" 0 '"opcodes_with_skippable": {"HMMA.16816.F32.BF16": 2, "BRA": 2, "FMUL": 1}' \
    python3 -c 'import json, subprocess, sys; print(json.dumps(json.loads(subprocess.run(sys.argv[1:], capture_output=True, text=True, check=True).stdout)))' \
    python3 "$sl" --json "$tmp/loop.sass"
expect "sass-loops: no SASS in the input -> exit 1" 1 "no SASS instructions" python3 "$sl" /dev/null
expect "sass-loops --help: usage, exit 0" 0 "usage: sass-loops.py" python3 "$sl" --help
expect "sass-loops: a missing file refused" 2 "$tmp/none.sass does not exist" python3 "$sl" "$tmp/none.sass"
expect "sass-loops: a folder refused" 2 "is a folder" python3 "$sl" "$tmp"
printf 'ELF\0\377\376binary' > "$tmp/k.cubin"
expect "sass-loops: binary input refused" 2 "is not text" python3 "$sl" "$tmp/k.cubin"
expect "sass-loops: two files refused" 2 "unexpected arguments" python3 "$sl" "$tmp/loop.sass" "$tmp/loop.sass"

# ---- mkl.sh: --help and bad arguments before any download ------------------------------------
rm -f "$tmp/ran"
mk=(env SPEEDKIT_MKL_PREFIX="$tmp/mkl" bash "$repo/scripts/mkl.sh")
expect "mkl --help: usage, exit 0" 0 "usage:" "${mk[@]}" --help
expect "mkl: an unknown argument -> exit 2" 2 "unknown arguments: --prefix" "${mk[@]}" --prefix /opt/mkl
nothing_ran "mkl: --help and a refusal download nothing"
[ -e "$tmp/mkl" ] && bad "mkl: --help and a refusal create no prefix" "$tmp/mkl exists"

echo
echo "test-scripts: $passed passed, $failed failed, $skipped skipped"
[ "$failed" = 0 ]
