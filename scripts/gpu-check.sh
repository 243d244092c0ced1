#!/usr/bin/env bash
# The whole GPU check in one command, on a GPU machine with no Rust and no network: finds the
# CUDA libraries, runs selftest, report, the ladder (small, gpt2, te; all five stages, eager and
# with --cuda-graph), --breakdown, --ablate, a T sweep to 4096, compute-sanitizer at tiny and
# Nsight Compute on the attention kernel at te (when installed), each step with its own timeout
# (8 minutes at most), one failing step never stopping the others. Each step packs its own
# .tar.gz the moment it ends, so a step that is killed loses only itself; a summary table prints
# last. About 13 minutes on an H100 (an estimate: --list gives each step's).
#
# Usage (from the unpacked bundle, scripts/gpu-bundle.sh):
#   ./gpu-check.sh                       # bin/ladder beside this script, device cuda
#   ./gpu-check.sh --list                # the steps in run order, with their timeouts
#   ./gpu-check.sh --only selftest,ladder-te   # only these steps (exact names, see --list)
#   ./gpu-check.sh --bin PATH/ladder     # another binary
#   ./gpu-check.sh --out DIR             # where the run's folder goes (default .; created if
#                                        # missing; nothing is written outside it)
#   ./gpu-check.sh --device cpu          # the same steps on the CPU at tiny shapes: checks this
#                                        # script (CI does), measures nothing worth keeping
# Writes DIR/gpu-check-<host>-<time>/: one <step>.tar.gz per step that ran and summary.tar.gz
# (the table, this script's log, the libraries found, nvidia-smi); send back those archives.
# Exit code: 0 when every step that applies here ran and passed; 1 when a step failed, timed
# out or was interrupted, or none ran; 2 for a usage error (nothing run, nothing written).
set -uo pipefail

die() {  # a usage or setup error: one paragraph on stderr, before anything runs or is written
    echo "gpu-check: $*" >&2
    exit 2
}

# ---- the steps, in run order (most valuable first, profilers last) ---------------------------
# name, timeout in seconds (at most 480), and the expected seconds on an H100: an estimate from
# what the step runs (presets, iterations; the te ladder's stage 0 is ~0.3 s a forward), not a
# measurement. Their commands are in step_argv below.
step_table=(
    "selftest                  120  25"
    "report                     60   5"
    "ladder-small              120  20"
    "ladder-gpt2               150  25"
    "ladder-te                 180  60"
    "ladder-small-cuda-graph   120  20"
    "ladder-gpt2-cuda-graph    150  25"
    "ladder-te-cuda-graph      180  60"
    "breakdown-te              180  60"
    "ablate-gpt2               150  30"
    "ablate-te                 180  60"
    "sweep-te                  240  90"
    "memcheck-tiny             240  60"
    "memcheck-tiny-cuda-graph  240  60"
    "racecheck-attention-tiny  240  90"
    "ncu-attention-te          360 150"
)
step_names=()
for row in "${step_table[@]}"; do read -r n _ <<< "$row"; step_names+=("$n"); done

list_steps() {
    local row n limit est total=0 worst=0
    printf '%-26s %8s  %s\n' step timeout "expected on an H100 (estimate)"
    for row in "${step_table[@]}"; do
        read -r n limit est <<< "$row"
        printf '%-26s %6s s  ~%s s\n' "$n" "$limit" "$est"
        total=$(( total + est )); worst=$(( worst + limit ))
    done
    echo "total: ~$total s expected (about $(( (total + 59) / 60 )) min), $worst s if every step runs to its timeout."
    echo "Estimates from each step's presets and iterations, not measurements. The *-cuda-graph,"
    echo "memcheck, racecheck and ncu steps need a GPU (and compute-sanitizer / ncu on PATH)."
}

# ---- arguments -------------------------------------------------------------------------------
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin="$here/bin/ladder"
device=cuda
only=""
only_given=0
out_root=.
value() {  # value OPTION "$#" "$2": the option's argument, or a usage error
    [ "$2" -ge 2 ] || die "$1 needs a value (none followed it). Fix: see ./gpu-check.sh --help."
    case "$3" in --*) die "$1 needs a value, got the option $3. Fix: see ./gpu-check.sh --help." ;; esac
}
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) value "$1" $# "${2-}"; bin="$2"; shift 2 ;;
        --device) value "$1" $# "${2-}"; device="$2"; shift 2 ;;
        --only) value "$1" $# "${2-}"; only="$2"; only_given=1; shift 2 ;;
        --out) value "$1" $# "${2-}"; out_root="$2"; shift 2 ;;
        --list) list_steps; exit 0 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) die "unknown argument '$1'. Fix: the options are --bin, --device, --only, --out, --list and --help (see --help)." ;;
    esac
done
case "$device" in
    cuda|cuda:[0-9]*|cpu) ;;
    *) die "--device $device is not a device this script knows. Fix: use cuda, cuda:N or cpu." ;;
esac

# --only: exact step names, each one known; an empty or unknown name is refused with the list.
selected=()
if [ "$only_given" = 1 ]; then
    IFS=, read -r -a wanted_names <<< "$only"
    [ "${#wanted_names[@]}" -gt 0 ] || die "--only '' names no step, so nothing would run. Fix: give step names separated by commas, from: ${step_names[*]}."
    for w in "${wanted_names[@]}"; do
        w="${w//[[:space:]]/}"
        known=0
        for n in "${step_names[@]}"; do [ "$n" = "$w" ] && known=1; done
        [ "$known" = 1 ] || die "--only names '$w', which is not a step (names are exact, not patterns). Fix: use names from this list, separated by commas: ${step_names[*]}. (--list shows them with their timeouts.)"
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

# --out: created when missing; a file, or a folder this user cannot write into, is refused
# before anything runs. Every file this script writes is inside it.
if [ -e "$out_root" ] && [ ! -d "$out_root" ]; then
    die "--out $out_root is a file, not a folder. Fix: pass a folder (it is created when missing), e.g. --out gpu-results."
fi
if [ ! -d "$out_root" ] && ! mkdir -p -- "$out_root" 2> /dev/null; then
    die "--out $out_root does not exist and cannot be created (a parent is a file, read-only or missing permissions). Fix: pass a folder you can write to, e.g. --out \$HOME/gpu-results."
fi
out_root=$(cd -- "$out_root" 2> /dev/null && pwd) || die "--out $out_root cannot be entered (no permission). Fix: pass a folder you can write to."
stamp=$(date -u +%Y%m%d-%H%M%S)
run_name="gpu-check-$(hostname -s 2> /dev/null || echo host)-$stamp"
run="$out_root/$run_name"
if ! mkdir -- "$run" 2> /dev/null || ! : 2> /dev/null > "$run/gpu-check.log"; then
    rmdir -- "$run" 2> /dev/null
    die "cannot write into --out $out_root (read-only, or this user lacks permission). Fix: pass a folder you can write to, e.g. --out \$HOME/gpu-results."
fi
mkdir -p "$run/machine"
summary="$run/summary.tsv"
printf 'step\tresult\tseconds\tfiles\n' > "$summary"
start=$(date +%s)

say() { echo "gpu-check: $*" | tee -a "$run/gpu-check.log"; }

# ---- packing: one archive per step, written as the step ends ---------------------------------
# Each archive holds <run>/<step>/ (its JSON, charts and log), so unpacking them all in one place
# rebuilds the run's folder. Written beside as .part and renamed: a kill leaves no half archive.
archive_limit=$(( 16 * 1024 * 1024 ))
log_limit=$(( 8 * 1024 * 1024 ))  # text packs ~5x, so two of these still fit the archive limit
pack() {  # pack ARCHIVE_NAME PATH...: the paths are relative to $out_root
    local archive="$run/$1.tar.gz" size
    shift
    if ! tar -czf "$archive.part" -C "$out_root" "$@" 2>> "$run/gpu-check.log" || ! mv -f "$archive.part" "$archive"; then
        say "could not pack $archive (see gpu-check.log)"
        return 1
    fi
    size=$(stat -c %s "$archive")
    if [ "$size" -gt "$archive_limit" ]; then
        say "$archive is $(( size / 1024 / 1024 )) MiB, over the 16 MiB aimed for: look at what grew (tar tzvf)"
    fi
}
cap_logs() {  # a runaway log keeps its first and last 4 MiB, so the archive stays small
    local f
    for f in "$1"/*.log; do
        if [ ! -f "$f" ] || [ "$(stat -c %s "$f")" -le "$log_limit" ]; then continue; fi
        { head -c $(( log_limit / 2 )); echo; echo "[gpu-check: log over 8 MiB, cut here]"; } < "$f" > "$f.cut"
        tail -c $(( log_limit / 2 )) "$f" >> "$f.cut"
        mv -f "$f.cut" "$f"
    done
}
pack_summary() { pack summary "$run_name/summary.tsv" "$run_name/gpu-check.log" "$run_name/machine"; }

# ---- CUDA libraries, wherever this machine keeps them --------------------------------------
# The binary links libcuda.so.1 (the driver) and libcublas/libcublasLt/libcudart .so.13, and
# loads libnvrtc.so.13 (+ libnvrtc-builtins.so.13.0 beside it) and libcurand.so.10. They may be
# under the system CUDA folder, a Python environment's nvidia/ packages, or conda.
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

libs_found=()
libs_missing=()
if [ "$device" != cpu ]; then
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
    ldd "$bin" > "$run/machine/ldd.txt" 2>&1 || true
    if grep -q 'not found' "$run/machine/ldd.txt"; then
        say "the binary still misses: $(grep 'not found' "$run/machine/ldd.txt" | awk '{print $1}' | tr '\n' ' ')"
    fi
    nvidia-smi > "$run/machine/nvidia-smi.txt" 2>&1 || say "nvidia-smi failed (see machine/nvidia-smi.txt)"
fi
[ -f "$here/BUILD.txt" ] && cp "$here/BUILD.txt" "$run/machine/"
export RUST_BACKTRACE=0

# ---- each step's command ---------------------------------------------------------------------
L="$bin"
dev=(--device "$device")
if [ "$device" = cpu ]; then
    # The orchestration on the CPU: every step at tiny, two iterations.
    small=(--preset tiny --warmup 1 --iters 2); gpt2=("${small[@]}"); te=("${small[@]}"); tiny=("${small[@]}"); te_short=("${small[@]}")
    sweep=(--preset tiny --warmup 0 --iters 1 --sweep "seq=16,32")
else
    small=(--preset small --iters 30); gpt2=(--preset gpt2 --iters 30); te=(--preset te --iters 20); te_short=(--preset te --iters 10)
    tiny=(--preset tiny --warmup 1 --iters 2)
    sweep=(--preset te --warmup 3 --iters 10 --sweep "seq=512,1024,2048,4096")
fi
cs=(compute-sanitizer --print-limit 20 --error-exitcode 1)

# step_argv NAME: sets argv to the step's command, or na to why it does not apply here. Each
# runs in its own folder <run>/NAME/, so its relative --json/--svg paths land there.
# Shared-memory bank conflicts and wavefronts of loads and stores (ncu metric names).
smem_conflicts=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
smem_conflicts+=,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum

step_argv() {
    argv=()
    na=""
    case "$1" in
        *-cuda-graph|memcheck-*|racecheck-*|ncu-*) [ "$device" = cpu ] && na="a CPU run" ;;
    esac
    case "$1" in
        memcheck-*|racecheck-*) [ -z "$na" ] && ! command -v compute-sanitizer > /dev/null && na="compute-sanitizer not on PATH" ;;
        ncu-*) [ -z "$na" ] && ! command -v ncu > /dev/null && na="ncu not on PATH" ;;
    esac
    [ -n "$na" ] && return 0
    case "$1" in
        selftest) argv=("$L" selftest "${dev[@]}" --json selftest.json) ;;
        report) argv=("$L" report "${dev[@]}") ;;
        ladder-small) argv=("$L" "${dev[@]}" "${small[@]}" --json ladder-small.json) ;;
        ladder-gpt2) argv=("$L" "${dev[@]}" "${gpt2[@]}" --json ladder-gpt2.json) ;;
        ladder-te) argv=("$L" "${dev[@]}" "${te[@]}" --json ladder-te.json --svg ladder-te.svg) ;;
        ladder-small-cuda-graph) argv=("$L" "${dev[@]}" "${small[@]}" --cuda-graph --json ladder-small-cuda-graph.json) ;;
        ladder-gpt2-cuda-graph) argv=("$L" "${dev[@]}" "${gpt2[@]}" --cuda-graph --json ladder-gpt2-cuda-graph.json) ;;
        ladder-te-cuda-graph) argv=("$L" "${dev[@]}" "${te[@]}" --cuda-graph --json ladder-te-cuda-graph.json --svg ladder-te-cuda-graph.svg) ;;
        breakdown-te) argv=("$L" "${dev[@]}" "${te_short[@]}" --breakdown --json breakdown-te.json --svg breakdown-te.svg) ;;
        ablate-gpt2) argv=("$L" "${dev[@]}" "${gpt2[@]}" --stages "2,3,4" --ablate --json ablate-gpt2.json) ;;
        ablate-te) argv=("$L" "${dev[@]}" "${te_short[@]}" --stages "2,3,4" --ablate --json ablate-te.json) ;;
        sweep-te) argv=("$L" "${dev[@]}" "${sweep[@]}" --stages "2,3" --json sweep-te.json --svg sweep-te.svg) ;;
        memcheck-tiny) argv=("${cs[@]}" --tool memcheck "$L" "${dev[@]}" "${tiny[@]}") ;;
        memcheck-tiny-cuda-graph) argv=("${cs[@]}" --tool memcheck "$L" "${dev[@]}" "${tiny[@]}" --cuda-graph) ;;
        racecheck-attention-tiny) argv=("${cs[@]}" --tool racecheck "$L" "${dev[@]}" "${tiny[@]}" --stages "2,3") ;;
        # Our attention kernels, v2 and v1 (the ablation), one launch each at te (one per launch
        # configuration: their grids differ), at the GPU's own clocks (ncu locks them by default:
        # 14.4 ms locked against 11.6 ms seen for v1 on the H100). The sections answer the
        # kernel's questions: launch and occupancy (registers, blocks per SM), warp stalls,
        # pipe use (tensor cores vs ALU), the memory tables, per-line counters (the kernels are
        # built with -lineinfo), and the shared-memory bank conflicts of loads and stores.
        ncu-attention-te) argv=(ncu --clock-control none --kernel-name regex:flash_attn --filter-mode per-launch-config
            --launch-count 1 --section LaunchStats --section Occupancy --section WarpStateStats
            --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section SourceCounters
            --metrics "$smem_conflicts" --import-source yes --export attention-te
            "$L" "${dev[@]}" --preset te --stages 2 --ablate --warmup 0 --iters 1 --no-check) ;;
        *) echo "gpu-check: step $1 is in step_table but has no command in step_argv" >&2; exit 2 ;;
    esac
}

# ---- run -------------------------------------------------------------------------------------
# A signal (Ctrl-C, kill) stops the step under way, packs what it wrote and the summary, and
# ends the run: the steps already packed are kept.
stop=0
child=""
trap 'stop=1; [ -n "$child" ] && kill -TERM "$child" 2> /dev/null' INT TERM
ran=0
failed=0
n_a=0
for row in "${step_table[@]}"; do
    read -r name limit _ <<< "$row"
    wanted "$name" || continue
    step_argv "$name"
    if [ -n "$na" ]; then
        printf '%s\t%s\t0\t-\n' "$name" "n/a: $na" >> "$summary"
        say "$name: n/a ($na)"
        n_a=$(( n_a + 1 ))
        continue
    fi
    dir="$run/$name"
    mkdir -p "$dir"
    t0=$(date +%s)
    say "[$(( t0 - start ))s] $name: ${argv[*]} (timeout ${limit}s)"
    (cd "$dir" && exec timeout --kill-after=15 "$limit" "${argv[@]}") > "$dir/$name.log" 2>&1 &
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
    printf '%s\t%s\t%s\t%s\n' "$name" "$result" "$(( $(date +%s) - t0 ))" "$name.tar.gz" >> "$summary"
    say "    $result in $(( $(date +%s) - t0 ))s"
    pack "$name" "$run_name/$name"
    pack_summary
    [ "$stop" = 1 ] && break
done
trap - INT TERM

# ---- summary ---------------------------------------------------------------------------------
total=$(( $(date +%s) - start ))
pack_summary
echo
echo "gpu-check summary ($device, $total s; one archive per step and summary.tar.gz in $run)"
column -t -s $'\t' "$summary" 2> /dev/null || cat "$summary"
if [ "$stop" = 1 ]; then
    echo "gpu-check: stopped by a signal after $ran step(s); the archives of the steps that ended are in $run." >&2
    exit 130
fi
if [ "$ran" = 0 ]; then
    echo "gpu-check: no step ran: the $n_a selected step(s) do not apply here (see the n/a reasons above). Fix: select steps that apply (--list), or run on a GPU machine with the tools installed." >&2
    exit 1
fi
echo "$failed of $ran step(s) did not pass"
[ "$failed" = 0 ]
