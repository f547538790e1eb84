# Sourced by .ci's scripts. `stage NAME` prints a stage's heading with the
# time since the whole run began (the first script to source this sets the
# start), so that a CI log shows what each stage costs.
export PYENGINE_CI_STARTED_AT=${PYENGINE_CI_STARTED_AT:-$(date +%s)}

stage() {
    local elapsed=$(($(date +%s) - PYENGINE_CI_STARTED_AT))
    printf '== %s  [%dm%02ds into the run]\n' "$*" $((elapsed / 60)) $((elapsed % 60))
}
