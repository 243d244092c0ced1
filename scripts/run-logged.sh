# shellcheck shell=bash
# Sourced, not run, by the measuring scripts (measure-cpu.sh, train-pairs.sh) after they cd to
# the workspace and make their scratch folder: they set `prog` (their name in messages) and
# `tmp` (the folder) first.
#
# run LABEL COMMAND...: runs COMMAND with its output in $tmp/run.log; a failed run stops the
# script (exit 1) with "PROG: LABEL failed" and the log's last lines, not silently.
# shellcheck disable=SC2154  # prog and tmp are the sourcing script's (above)
run() {
    local label="$1"
    shift
    if ! "$@" > "$tmp/run.log" 2>&1; then
        echo "$prog: $label failed: $*. Its last lines:" >&2
        tail -n 15 "$tmp/run.log" >&2
        exit 1
    fi
}
