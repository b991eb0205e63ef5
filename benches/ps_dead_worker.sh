#!/usr/bin/env bash
# What a worker's death costs `--strategy ps-async`: the bundled GPT (default model, embedded
# plays) at `--dp 4` (workers 0 to 2, rank 3 serving), STEPS steps (default 200) with an
# evaluation every EVAL (default 50), run undisturbed and then with worker KILL (default 1)
# killed by SIGKILL as soon as the first checkpoint is written, ROUNDS times (default 1). The job
# trains on without it, with no restart.
#
# Each line: the run's wall time, the last validation loss, the evaluations recorded, the
# server's optimizer steps (one per push), the steps of rank 0's progress after the first 10
# batches in chars/s, and how the run ended (the launcher's summary; "-" when every rank
# finished). BIN runs another build of bonfire (then nothing is built).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${STEPS:-200}"; EVAL="${EVAL:-50}"; KILL="${KILL:-1}"; ROUNDS="${ROUNDS:-1}"
target="${CARGO_TARGET_DIR:-target}/release"
if [ -z "${BIN:-}" ]; then
    cargo build -q --release -p bonfire-cli
fi
bin="${BIN:-$target/bonfire}"
scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
gpt() { # kill|keep -> "wall val evals steps rate ended"
    local run="$scratch/run-$RANDOM" log="$scratch/log-$RANDOM"
    local t0; t0=$(date +%s.%N)
    "$bin" train gpt --dataset embedded --dp 4 --strategy ps-async --steps "$STEPS" \
        --eval-every "$EVAL" --checkpoint-dir "$run" > "$log" 2>&1 &
    local parent=$!
    if [ "$1" = kill ]; then
        while [ ! -e "$run/latest" ]; do
            kill -0 "$parent" 2>/dev/null || { tail -5 "$log" >&2; exit 1; }
            sleep 0.05
        done
        local c
        for c in $(cat "/proc/$parent/task/$parent/children"); do
            if tr '\0' '\n' < "/proc/$c/environ" | grep -qx "RANK=$KILL"; then kill -KILL "$c"; fi
        done
    fi
    wait "$parent" || { echo "ps_dead_worker.sh: the run failed" >&2; tail -5 "$log" >&2; exit 1; }
    local wall val evals steps rate ended
    wall=$(echo "$(date +%s.%N) - $t0" | bc)
    val=$(grep "^validation loss" "$log" | awk '{print $3}')
    evals=$(grep -c "^eval [0-9]*/[0-9]* at step" "$log" || true)
    steps=$(grep "parameter server 0" "$log" | sed -nE 's/.* ([0-9]+) steps from.*/\1/p')
    rate=$(grep "throughput" "$log" | sed -nE 's/.* ([0-9]+) chars\/s after the first.*/\1/p')
    ended=$(grep "the run finished" "$log" | sed -nE 's/.*\((rank [0-9]+).*/without \1/p')
    printf '%.1f %s %s %s %s %s\n' "$wall" "$val" "$evals" "$steps" "${rate:--}" "${ended:--}"
}
echo "# ps-async, --dp 4 (3 workers, 1 server), $STEPS steps, an evaluation every $EVAL"
echo "round run wall-s val-loss evaluations server-steps chars/s ended"
for r in $(seq "$ROUNDS"); do
    line=$(gpt keep) || exit 1
    echo "$r undisturbed $line"
    line=$(gpt kill) || exit 1
    echo "$r worker-$KILL-killed $line"
done
