# Sourced by .ci's scripts. `stage NAME` prints a stage's heading with the
# time since the whole run began (the first script to source this sets the
# start), so that a CI log shows what each stage costs. `concurrently` runs
# independent stages side by side, one per core.
export PYENGINE_CI_STARTED_AT=${PYENGINE_CI_STARTED_AT:-$(date +%s)}

stage() {
    local elapsed=$(($(date +%s) - PYENGINE_CI_STARTED_AT))
    printf '== %s  [%dm%02ds into the run]\n' "$*" $((elapsed / 60)) $((elapsed % 60))
}

# concurrently JOB...: runs each JOB (a command and its arguments as one
# word, split on spaces: a function defined by the caller, say) in the
# background, at most PYENGINE_CI_JOBS (default: the number of cores) at
# once, each with its output in a file of its own. As each ends, its output
# is printed whole, under a heading that says how it ended, so that a log
# never interleaves two stages. Returns 1 when any job failed, after all
# have ended (a failed job does not stop the others: their output tells
# whether the failure is the only one).
# Why: the run's stages are single-threaded in the main (a pytest process,
# pip), and on 2 cores two of them side by side take little more than the
# longer of the two.
concurrently() {
    local slots=${PYENGINE_CI_JOBS:-$(nproc)} logs index=0 pid finished status failed=0
    local -a jobs=("$@")
    local -A index_of=()
    logs=$(mktemp -d)
    for job in "${jobs[@]}"; do
        if [ "${#index_of[@]}" -ge "$slots" ]; then
            _concurrently_reap
        fi
        # shellcheck disable=SC2086  # a job is a command and its arguments, split on spaces
        $job >"$logs/$index.log" 2>&1 &
        index_of[$!]=$index
        index=$((index + 1))
    done
    while [ "${#index_of[@]}" -gt 0 ]; do
        _concurrently_reap
    done
    rm -rf "$logs"
    return "$failed"
}

# Waits for one of concurrently's jobs to end and prints its output; uses
# (bash's dynamic scope) concurrently's locals.
_concurrently_reap() {
    status=0
    wait -n -p finished "${!index_of[@]}" || status=$?
    local ended=${index_of[$finished]}
    unset "index_of[$finished]"
    if [ "$status" -eq 0 ]; then
        echo "== ended: ${jobs[$ended]}"
    else
        echo "== FAILED (exit $status): ${jobs[$ended]}"
        failed=1
    fi
    cat "$logs/$ended.log"
}
