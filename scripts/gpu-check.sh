#!/usr/bin/env bash
# The GPU check, in two parts that each fit one command on a lent GPU machine (15 minutes of
# device time in all, the machine's start included; one command at most 10 minutes): on a GPU
# machine with no Rust and no network, most valuable steps first.
#   part 1  library probe, `ladder selftest`, `report`, `--train` at small with d_head 128 and
#           T = 500 (not a multiple of the tile), the te ladder (all five stages), PyTorch's block
#           on the same weights (scripts/torch-reference.py), the te training step with
#           --breakdown at batch 8 and at batch 4 (where stage 0 fits) and PyTorch's, the
#           attention kernels alone (ours v1, v2 and the backward under Nsight Compute's timer,
#           PyTorch's SDPA FlashAttention-2 and cuDNN, T 512-4096), --ablate at te
#   part 2  CUDA graphs, FP8 without fast accumulation, racecheck and memcheck of the forward and
#           backward at d_head 128 over several tiles with padding, Nsight Compute (GPU clocks not
#           locked) on attention v2, v1 and the backward at T = 4096
# Each part has its own deadline (--deadline, default 340 s): a step gets what is left of it, one
# that would start with under 20 s left is "not run: deadline". After every step the part's whole
# folder is re-packed into ONE archive, so a command killed at its limit still returns every step
# that ended. Steps that need a GPU tool (compute-sanitizer, ncu, python3 with torch) are "n/a"
# where it is missing. One failing step never stops the others.
#
# Usage (from the unpacked bundle, scripts/gpu-bundle.sh):
#   ./gpu-check.sh --part 1              # bin/ladder beside this script, device cuda
#   ./gpu-check.sh --list                # both parts' steps, their timeouts and expected seconds
#   ./gpu-check.sh --part 1 --only selftest,ladder-te   # only these steps (exact names, see --list)
#   ./gpu-check.sh --part 2 --deadline 280  # the part's own deadline in seconds (30..590)
#   ./gpu-check.sh --bin PATH/ladder     # another binary
#   ./gpu-check.sh --scripts DIR         # where torch-reference.py and sdpa-bench.py are (default:
#                                        # beside this script)
#   ./gpu-check.sh --out DIR             # where the part's folder and archive go (default .;
#                                        # created if missing; nothing is written outside it)
#   ./gpu-check.sh --archive-to DIR      # the archive alone into DIR instead (a folder that must
#                                        # hold few files, such as a lent machine's $OUT)
#   ./gpu-check.sh --device cpu          # the same steps on the CPU at tiny shapes: checks this
#                                        # script (CI does), measures nothing worth keeping
# Writes DIR/gpu-check-part<N>-<host>-<time>/ (one folder per step: its JSON, charts, log; the
# summary table, this script's log, the libraries found, nvidia-smi) and beside it, re-packed
# after every step, gpu-check-part<N>-<host>-<time>.tar.gz: send back that archive. Large inputs
# a step writes for the next (the te weights for PyTorch) stay in scratch/, never in the archive.
# Exit code: 0 when every step that applies here ran and passed; 1 when a step failed, timed
# out, was interrupted or not run for the deadline, or none ran; 2 for a usage error (nothing
# run, nothing written).
set -uo pipefail

die() {  # a usage or setup error: one paragraph on stderr, before anything runs or is written
    echo "gpu-check: $*" >&2
    exit 2
}

# ---- the steps, in run order (most valuable first, profilers last) ---------------------------
# part, name, timeout in seconds, and the expected seconds on an H100: the latest H100 run that
# ran the step (results/h100-c64aaff; the attention steps, racecheck and the attention profile
# from results/h100-a4d06df, whose kernels are today's). Commands: step_cmd below.
step_table=(
    "1 probe                       30    7"
    "1 selftest                    120   22"
    "1 report                      30    1"
    "1 train-small-d128           120    3"
    "1 ladder-te                   150   45"
    "1 torch-te                    120   38"
    "1 train-te                    200   97"
    "1 torch-te-train              120   30"
    "1 attention-sdpa              90   13"
    "1 attention-kernels          120   64"
    "2 racecheck-attention-d128   150   65"
    "2 memcheck-train-d128         150    3"
    "2 ncu-attention-t4096        200   30"
    "2 ncu-train-kernels-te-b4     200   34"
    "2 ablate-te                   120   44"
    "2 ladder-gpt2-cuda-graph      120    2"
    "2 fp8-no-fast-accum-te        120   18"
)
step_names=()
for row in "${step_table[@]}"; do read -r _ n _ <<< "$row"; step_names+=("$n"); done

list_steps() {
    local row p n limit est part total worst
    for part in 1 2; do
        total=0; worst=0
        echo "part $part"
        printf '  %-28s %8s  %s\n' step timeout "expected on an H100"
        for row in "${step_table[@]}"; do
            read -r p n limit est <<< "$row"
            [ "$p" = "$part" ] || continue
            printf '  %-28s %6s s  ~%s s\n' "$n" "$limit" "$est"
            total=$(( total + est )); worst=$(( worst + limit ))
        done
        echo "  total: ~$total s expected; the part stops at its deadline (default 340 s) even if the steps' timeouts add to $worst s."
    done
    echo "Expected: measured on an H100 where a run finished the step, else estimated. The graph, FP8, sanitizer"
    echo "and ncu steps need a GPU (and compute-sanitizer / ncu on PATH); the torch and sdpa steps python3 with torch."
}

# ---- arguments -------------------------------------------------------------------------------
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin="$here/bin/ladder"
scripts="$here"
device=cuda
part=""
deadline=340
only=""
only_given=0
out_root=.
archive_to=""
value() {  # value OPTION "$#" "$2": the option's argument, or a usage error
    [ "$2" -ge 2 ] || die "$1 needs a value (none followed it). Fix: see ./gpu-check.sh --help."
    case "$3" in --*) die "$1 needs a value, got the option $3. Fix: see ./gpu-check.sh --help." ;; esac
}
while [ $# -gt 0 ]; do
    case "$1" in
        --part) value "$1" $# "${2-}"; part="$2"; shift 2 ;;
        --deadline) value "$1" $# "${2-}"; deadline="$2"; shift 2 ;;
        --bin) value "$1" $# "${2-}"; bin="$2"; shift 2 ;;
        --scripts) value "$1" $# "${2-}"; scripts="$2"; shift 2 ;;
        --device) value "$1" $# "${2-}"; device="$2"; shift 2 ;;
        --only) value "$1" $# "${2-}"; only="$2"; only_given=1; shift 2 ;;
        --out) value "$1" $# "${2-}"; out_root="$2"; shift 2 ;;
        --archive-to) value "$1" $# "${2-}"; archive_to="$2"; shift 2 ;;
        --list) list_steps; exit 0 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) die "unknown argument '$1'. Fix: the options are --part, --deadline, --bin, --scripts, --device, --only, --out, --archive-to, --list and --help (see --help)." ;;
    esac
done
case "$part" in
    1|2) ;;
    "") die "no --part given: the check runs in two parts, one command each. Fix: ./gpu-check.sh --part 1, then ./gpu-check.sh --part 2 (--list shows their steps)." ;;
    *) die "--part $part is not a part. Fix: --part 1 or --part 2 (--list shows their steps)." ;;
esac
if ! [[ "$deadline" =~ ^[0-9]+$ ]] || [ "$deadline" -lt 30 ] || [ "$deadline" -gt 590 ]; then
    die "--deadline $deadline is not a number of seconds from 30 to 590 (one command on a lent GPU machine runs at most 600 s). Fix: e.g. --deadline 300."
fi
case "$device" in
    cuda|cuda:[0-9]*|cpu) ;;
    *) die "--device $device is not a device this script knows. Fix: use cuda, cuda:N or cpu." ;;
esac

# --only: exact step names of this part, each one known; an empty or unknown name is refused.
part_names=()
for row in "${step_table[@]}"; do read -r p n _ <<< "$row"; [ "$p" = "$part" ] && part_names+=("$n"); done
selected=()
if [ "$only_given" = 1 ]; then
    IFS=, read -r -a wanted_names <<< "$only"
    [ "${#wanted_names[@]}" -gt 0 ] || die "--only '' names no step, so nothing would run. Fix: give step names of part $part separated by commas, from: ${part_names[*]}."
    for w in "${wanted_names[@]}"; do
        w="${w//[[:space:]]/}"
        known=0
        for n in "${part_names[@]}"; do [ "$n" = "$w" ] && known=1; done
        [ "$known" = 1 ] || die "--only names '$w', which is not a step of part $part (names are exact, not patterns). Fix: use names from this list, separated by commas: ${part_names[*]}. (--list shows both parts.)"
        selected+=("$w")
    done
fi
wanted() {
    [ "$only_given" = 0 ] && return 0
    local w
    for w in "${selected[@]}"; do [ "$w" = "$1" ] && return 0; done
    return 1
}

if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then
    die "no executable ladder binary at $bin. Fix: run from the unpacked bundle (scripts/gpu-bundle.sh builds it), or pass --bin PATH/ladder."
fi
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
[ -d "$scripts" ] || die "--scripts $scripts is not a folder. Fix: pass the folder that holds torch-reference.py and sdpa-bench.py (the repository's scripts/)."
scripts=$(cd "$scripts" && pwd)

# --out (and --archive-to): created when missing; a file, or a folder this user cannot write
# into, is refused before anything runs. Every file this script writes is inside them.
writable_dir() {  # writable_dir FLAG PATH: prints the absolute path, or refuses
    if [ -e "$2" ] && [ ! -d "$2" ]; then
        die "$1 $2 is a file, not a folder. Fix: pass a folder (it is created when missing), e.g. $1 gpu-results."
    fi
    if [ ! -d "$2" ] && ! mkdir -p -- "$2" 2> /dev/null; then
        die "$1 $2 does not exist and cannot be created (a parent is a file, read-only or missing permissions). Fix: pass a folder you can write to, e.g. $1 \$HOME/gpu-results."
    fi
    (cd -- "$2" 2> /dev/null && pwd) || die "$1 $2 cannot be entered (no permission). Fix: pass a folder you can write to."
}
out_root=$(writable_dir --out "$out_root") || exit 2
if [ -n "$archive_to" ]; then
    archive_to=$(writable_dir --archive-to "$archive_to") || exit 2
    if ! { : > "$archive_to/.gpu-check-probe"; } 2> /dev/null; then
        die "cannot write into --archive-to $archive_to (read-only, or this user lacks permission). Fix: pass a folder you can write to."
    fi
    rm -f "$archive_to/.gpu-check-probe"
else
    archive_to="$out_root"
fi
stamp=$(date -u +%Y%m%d-%H%M%S)
run_name="gpu-check-part$part-$(hostname -s 2> /dev/null || echo host)-$stamp"
run="$out_root/$run_name"
if ! mkdir -- "$run" 2> /dev/null || ! : 2> /dev/null > "$run/gpu-check.log"; then
    rmdir -- "$run" 2> /dev/null
    die "cannot write into --out $out_root (read-only, or this user lacks permission). Fix: pass a folder you can write to, e.g. --out \$HOME/gpu-results."
fi
mkdir -p "$run/machine" "$run/scratch"
summary="$run/summary.tsv"
printf 'step\tresult\tseconds\texpected\n' > "$summary"
start=$(date +%s)

say() { echo "gpu-check: $*" | tee -a "$run/gpu-check.log"; }

# ---- packing: the part's one archive, re-packed after every step ------------------------------
# It holds <run>/ without scratch/ (large inputs one step leaves for the next). Written beside as
# .part and renamed: a kill leaves the previous archive whole.
archive="$archive_to/$run_name.tar.gz"
archive_limit=$(( 16 * 1024 * 1024 ))
log_limit=$(( 4 * 1024 * 1024 ))  # text packs ~5x, so a few of these still fit the archive limit
pack() {
    local size
    if ! tar -czf "$archive.part" --exclude "$run_name/scratch" -C "$out_root" "$run_name" 2>> "$run/gpu-check.log" || ! mv -f "$archive.part" "$archive"; then
        say "could not pack $archive (see gpu-check.log)"
        return 1
    fi
    size=$(stat -c %s "$archive")
    if [ "$size" -gt "$archive_limit" ]; then
        say "$archive is $(( size / 1024 / 1024 )) MiB, over the 16 MiB a lent machine returns: look at what grew (tar tzvf)"
    fi
}
cap_logs() {  # a runaway log keeps its first and last 2 MiB, so the archive stays small
    local f
    for f in "$1"/*.log; do
        if [ ! -f "$f" ] || [ "$(stat -c %s "$f")" -le "$log_limit" ]; then continue; fi
        { head -c $(( log_limit / 2 )); echo; echo "[gpu-check: log over 4 MiB, cut here]"; } < "$f" > "$f.cut"
        tail -c $(( log_limit / 2 )) "$f" >> "$f.cut"
        mv -f "$f.cut" "$f"
    done
}

# ---- CUDA libraries, wherever this machine keeps them --------------------------------------
# The binary links libcuda.so.1 (the driver) and libcublas/libcublasLt/libcudart .so.13, and
# loads libnvrtc.so.13 (+ libnvrtc-builtins.so.13.0 beside it) and libcurand.so.10. They may be under the system CUDA folder, a Python environment's nvidia/
# packages, or conda.
find_lib_dir() {
    local lib="$1" roots=(/usr/local/cuda /usr/local /opt /usr/lib /usr/lib64 /usr/lib/x86_64-linux-gnu "$HOME/.local")
    [ -n "${CONDA_PREFIX:-}" ] && roots=("$CONDA_PREFIX" "${roots[@]}")
    [ -n "${CUDA_HOME:-}" ] && roots=("$CUDA_HOME" "${roots[@]}")
    for py in python3 python; do
        if command -v "$py" > /dev/null; then
            local site
            site=$("$py" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2> /dev/null) || true
            while IFS= read -r d; do [ -n "$d" ] && [ -d "$d/nvidia" ] && roots=("$d/nvidia" "${roots[@]}"); done <<< "$site"
        fi
    done
    local r f
    for r in "${roots[@]}"; do
        [ -d "$r" ] || continue
        f=$(find "$r" -maxdepth 7 -name "$lib" \( -type f -o -type l \) 2> /dev/null | head -1)
        if [ -n "$f" ]; then dirname "$f"; return 0; fi
    done
    return 1
}

if [ "$device" != cpu ]; then
    libs_found=()
    libs_missing=()
    for lib in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libnvrtc.so.13 libnvrtc-builtins.so.13.0 libcurand.so.10; do
        if ldconfig -p 2> /dev/null | grep -- "$lib " > /dev/null && [ "$lib" != libnvrtc-builtins.so.13.0 ]; then
            libs_found+=("$lib (ldconfig)")
        elif d=$(find_lib_dir "$lib"); then
            libs_found+=("$lib $d")
            case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
        else
            libs_missing+=("$lib")
        fi
    done
    {
        printf '%s\n' "${libs_found[@]+"${libs_found[@]}"}"
        [ "${#libs_missing[@]}" -gt 0 ] && printf 'MISSING %s\n' "${libs_missing[@]}"
    } > "$run/machine/libraries.txt"
    say "libraries: ${#libs_found[@]} found, ${#libs_missing[@]} missing${libs_missing[*]:+ (${libs_missing[*]})}"
fi
[ -f "$here/BUILD.txt" ] && cp "$here/BUILD.txt" "$run/machine/"
export RUST_BACKTRACE=0

# ---- each step's command ---------------------------------------------------------------------
# Every step runs `bash -c "$cmd"` in its own folder <run>/NAME/ (relative --json/--svg paths land
# there), with L (the ladder), D (the device flags), S (the scripts folder), X (scratch) and the
# shape flags below in its environment.
export L="$bin" S="$scripts" X="$run/scratch" D="--device $device"
if [ "$device" = cpu ]; then
    # The orchestration on the CPU: every step at tiny, two iterations.
    export TE="--preset tiny --warmup 1 --iters 2 --rounds 1" TE_B4="--preset tiny --batch 1 --warmup 1 --iters 2 --rounds 1"
    export D128="--preset tiny --d-model 256 --heads 2 --seq 100 --warmup 1 --iters 2 --rounds 1" SMALL128="--preset tiny --d-model 256 --heads 2 --seq 100 --iters 2 --rounds 1"
    export T4096="--preset tiny --seq 128" SDPA="--seq 64,128 --batch 1 --heads 2 --d-head 64 --iters 2 --warmup 1"
    export SWEEP="--sweep seq=32,64" GPT2="--preset tiny --warmup 1 --iters 2 --rounds 1"
else
    export TE="--preset te --iters 10 --rounds 1" TE_B4="--preset te --batch 4 --iters 5 --rounds 1"
    export D128="--preset tiny --d-model 256 --heads 2 --seq 200 --warmup 0 --iters 1 --rounds 1"
    # Batch 4: stage 2's training step at T = 4096 does not fit an 80 GB GPU at batch 8.
    export T4096="--preset te --batch 4 --seq 4096" SDPA="--seq 512,1024,2048,4096" SWEEP="--batch 4 --sweep seq=512,1024,2048,4096"
    export GPT2="--preset gpt2 --iters 20 --rounds 1"
    # d_head 768 / 6 = 128 and T = 500: the attention kernels' last tile is padded.
    export SMALL128="--preset small --heads 6 --seq 500 --iters 10 --rounds 1"
fi
cs="compute-sanitizer --print-limit 20 --error-exitcode 1"

# Whether python3 here has torch (the torch and sdpa steps need it; the sdpa step also a GPU).
have_torch() { python3 -c 'import torch, safetensors' > /dev/null 2>&1; }

# step_cmd NAME: sets cmd to the step's shell command, or na to why it does not apply here.
# shellcheck disable=SC2016 # each command is single-quoted: it expands in the step's own shell
step_cmd() {
    cmd=""
    na=""
    case "$1" in
        ladder-gpt2-cuda-graph|racecheck-*|memcheck-*|ncu-*|attention-*) [ "$device" = cpu ] && na="a CPU run" ;;
        torch-*) have_torch || na="python3 here has no torch and safetensors" ;;
    esac
    case "$1" in
        racecheck-*|memcheck-*) [ -z "$na" ] && ! command -v compute-sanitizer > /dev/null && na="compute-sanitizer not on PATH" ;;
        ncu-*|attention-kernels) [ -z "$na" ] && ! command -v ncu > /dev/null && na="ncu not on PATH" ;;
        attention-sdpa) [ -z "$na" ] && ! have_torch && na="python3 here has no torch" ;;
    esac
    [ -n "$na" ] && return 0
    case "$1" in
        probe) cmd='ldd "$L" > ldd.txt 2>&1; nvidia-smi > nvidia-smi.txt 2>&1; nvidia-smi -q -d CLOCK,POWER,MEMORY > nvidia-smi-q.txt 2>&1;
            { uname -a; nproc; command -v ncu compute-sanitizer nvcc python3; python3 -c "import torch; print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.is_available())"; } > tools.txt 2>&1;
            ! grep "not found" ldd.txt' ;;
        selftest) cmd='"$L" selftest $D --json selftest.json' ;;
        report) cmd='"$L" report $D' ;;
        train-small-d128) cmd='"$L" $D $SMALL128 --train --json train-small-d128.json' ;;
        # --save-weights / --save-output: PyTorch's rows (next step) run on the same weights and input.
        ladder-te) cmd='"$L" $D $TE --breakdown --json ladder-te.json --svg ladder-te.svg --save-weights "$X/te-weights.safetensors" --save-output "$X/te-io.safetensors"' ;;
        torch-te) cmd='python3 "$S/torch-reference.py" --ladder-json ../ladder-te/ladder-te.json --weights "$X/te-weights.safetensors" --io "$X/te-io.safetensors" --out ladder-te-torch.json' ;;
        # Batch 8, where the naive-attention stages (0, 1) cannot fit a training step and are
        # skipped rows; then batch 4, where every stage that trains here fits.
        train-te) cmd='"$L" $D $TE --train --breakdown --json train-te.json --svg train-te.svg; a=$?
            "$L" $D $TE_B4 --train --breakdown --json train-te-b4.json --svg train-te-b4.svg --save-weights "$X/train-weights.safetensors" --save-output "$X/train-io.safetensors" && exit $a' ;;
        # At batch 4: PyTorch's rows are checked against stage 0's output, which batch 8 has not.
        torch-te-train) cmd='python3 "$S/torch-reference.py" --variants eager-fp32,eager-bf16 --ladder-json ../train-te/train-te-b4.json --weights "$X/train-weights.safetensors" --io "$X/train-io.safetensors" --out train-te-torch.json' ;;
        attention-sdpa) cmd='python3 "$S/sdpa-bench.py" $SDPA --json sdpa.json' ;;
        # Our kernels alone: Nsight Compute's kernel timer on every launch of flash_attn* at the
        # GPU's own clocks, over the same T (--sweep): v2 and the backward (--train), then v1.
        attention-kernels) cmd='n=(ncu --clock-control none --kernel-name regex:flash_attn --metrics gpu__time_duration.sum --csv)
            "${n[@]}" "$L" $D --preset te --stages 2 --train --no-check --warmup 1 --iters 2 --rounds 1 $SWEEP > ncu-times-v2-bwd.csv; a=$?
            "${n[@]}" "$L" $D --preset te --stages 2 --attention-kernel v1 --no-check --warmup 1 --iters 2 --rounds 1 $SWEEP > ncu-times-v1.csv && exit $a' ;;
        # Every kernel of one process that builds stage 3's (then stage 4's) training block at
        # batch 4 and runs one step, summed by name: set beside train-te's step times, it tells
        # GPU-bound from host-bound and which kernels (ours, cuBLASLt's, candle's) take the time.
        ncu-train-kernels-te-b4) cmd='for s in 3 4; do c="--preset te --batch 4 --stages $s --train --no-check --warmup 0 --iters 1 --rounds 1"
                ncu --clock-control none --metrics gpu__time_duration.sum --csv "$L" $D $c > kernels-stage$s.csv || exit $?
                python3 "$S/ncu-sum.py" kernels-stage$s.csv --json kernel-sum-stage$s.json --what "every GPU kernel of one process that builds the training block of stage $s at te, batch 4, and runs one training step (no warm-up, no check), summed by kernel name" \
                    --command "ncu --clock-control none --metrics gpu__time_duration.sum --csv ladder $D $c" || exit $?
            done' ;;
        ablate-te) cmd='"$L" $D $TE --stages 2,3,4 --ablate --breakdown --json ablate-te.json --svg ablate-te.svg' ;;
        ladder-gpt2-cuda-graph) cmd='"$L" $D $GPT2 --cuda-graph --json ladder-gpt2-cuda-graph.json' ;;
        fp8-no-fast-accum-te) cmd='SPEEDKIT_FP8_FAST_ACCUM=off "$L" $D $TE --stages 4 --json fp8-no-fast-accum-te.json' ;;
        # d_head 128 and T = 200: four 64-row tiles, the last padded; forward (v2, and v1 through
        # --ablate) and the backward (--train).
        racecheck-attention-d128) cmd='$cs --tool racecheck "$L" $D $D128 --stages 2 --ablate --train' ;;
        memcheck-train-d128) cmd='$cs --tool memcheck "$L" $D $D128 --train' ;;
        # One launch per launch configuration of each flash_attn kernel (v2, v1, backward), at the
        # GPU's own clocks (ncu locks them by default: 14.4 ms locked against 11.6 ms seen for v1).
        # The sections answer the kernel's questions: launch and occupancy, warp stalls, pipe use,
        # the memory tables, per-line counters (-lineinfo builds), shared-memory bank conflicts.
        ncu-attention-t4096) cmd='ncu --clock-control none --kernel-name regex:flash_attn --filter-mode per-launch-config \
            --launch-count 1 --section LaunchStats --section Occupancy --section WarpStateStats \
            --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section SourceCounters \
            --metrics "$smem" --import-source yes --export attention-t4096 \
            "$L" $D $T4096 --stages 2 --ablate --train --warmup 0 --iters 1 --rounds 1 --no-check > ncu.txt' ;;
        *) echo "gpu-check: step $1 is in step_table but has no command in step_cmd" >&2; exit 2 ;;
    esac
}
# Shared-memory bank conflicts and wavefronts of loads and stores (ncu metric names).
smem=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
smem+=,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum
export cs smem

# ---- run -------------------------------------------------------------------------------------
# A signal (Ctrl-C, kill) stops the step under way, packs what it wrote and ends the run: the
# steps already packed are kept.
stop=0
child=""
trap 'stop=1; [ -n "$child" ] && kill -TERM "$child" 2> /dev/null' INT TERM
ran=0
late=0  # not run for the deadline
failed=0
n_a=0
say "part $part, deadline ${deadline}s, device $device, archive $archive"
pack
for row in "${step_table[@]}"; do
    read -r p name limit est <<< "$row"
    [ "$p" = "$part" ] || continue
    wanted "$name" || continue
    step_cmd "$name"
    if [ -n "$na" ]; then
        printf '%s\t%s\t0\t%s\n' "$name" "n/a: $na" "$est" >> "$summary"
        say "$name: n/a ($na)"
        n_a=$(( n_a + 1 ))
        continue
    fi
    left=$(( deadline - ($(date +%s) - start) - 10 ))  # 10 s kept for the last pack
    if [ "$left" -lt 20 ]; then
        printf '%s\t%s\t0\t%s\n' "$name" "not run: deadline" "$est" >> "$summary"
        say "$name: not run (${left}s left of the ${deadline}s deadline)"
        failed=$(( failed + 1 )); late=$(( late + 1 ))
        continue
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    dir="$run/$name"
    mkdir -p "$dir"
    t0=$(date +%s)
    say "[$(( t0 - start ))s] $name (timeout ${limit}s, expected ~${est}s)"
    printf '%s\n' "$cmd" > "$dir/command.sh"
    (cd "$dir" && exec timeout --kill-after=5 "$limit" bash -c "$cmd") > "$dir/$name.log" 2>&1 &
    child=$!
    wait "$child"
    rc=$?
    if [ "$stop" = 1 ]; then wait "$child" 2> /dev/null; rc=130; fi
    child=""
    case "$rc" in
        0) result=pass ;;
        124|137) result="timeout (${limit}s)"; failed=$(( failed + 1 )) ;;
        130) result="interrupted"; failed=$(( failed + 1 )) ;;
        *) result="FAIL (exit $rc)"; failed=$(( failed + 1 )) ;;
    esac
    ran=$(( ran + 1 ))
    cap_logs "$dir"
    printf '%s\t%s\t%s\t%s\n' "$name" "$result" "$(( $(date +%s) - t0 ))" "$est" >> "$summary"
    say "    $result in $(( $(date +%s) - t0 ))s; last lines: $(tail -n 2 "$dir/$name.log" | tr '\n' ' ' | cut -c1-300)"
    pack
    [ "$stop" = 1 ] && break
done
trap - INT TERM

# ---- summary ---------------------------------------------------------------------------------
total=$(( $(date +%s) - start ))
echo "total	$total s" >> "$summary"
pack
echo
echo "gpu-check part $part summary ($device, $total s; everything in $archive)"
column -t -s $'\t' "$summary" 2> /dev/null || cat "$summary"
if [ "$stop" = 1 ]; then
    echo "gpu-check: stopped by a signal after $ran step(s); the archive holds the steps that ended: $archive" >&2
    exit 130
fi
if [ "$ran" = 0 ]; then
    echo "gpu-check: no step ran: the $n_a selected step(s) do not apply here or the deadline came first (see above). Fix: select steps that apply (--list), or run on a GPU machine with the tools installed." >&2
    exit 1
fi
echo "$failed of $(( ran + late )) step(s) did not pass"
[ "$failed" = 0 ]
