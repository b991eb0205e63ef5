#!/usr/bin/env bash
# The bundled GPT's data-parallel strategies side by side: `--strategy allreduce`, `local-sgd`
# and `diloco` (meeting every H steps), the default model on the embedded plays at 2 ranks on
# this host, the same steps and batches. Prints, per strategy, the validation loss at each
# evaluation, the step at which it first reached TARGET nats/char (or "-"), the wall time, and
# the bytes each rank all-reduced (the job's report: gradient buckets for allreduce, the
# meetings' deltas for the others).
#
#   bash benches/strategies_gpt.sh                 # 400 steps, evaluations every 100, H=50
#   STEPS=800 H=100 TARGET=2.3 bash benches/strategies_gpt.sh
#   BIN=/path/to/other/bonfire bash benches/strategies_gpt.sh
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
bin="${BIN:-$target/release/bonfire}"
steps="${STEPS:-400}"
every="${EVAL_EVERY:-100}"
h="${H:-50}"
goal="${TARGET:-2.35}"
if [ ! -x "$bin" ]; then
    echo "no bonfire binary at $bin: build it with cargo build --release -p bonfire-cli" >&2
    exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "# $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u +%FT%TZ) steps=$steps H=$h target=$goal"
for s in allreduce local-sgd diloco; do
    extra=()
    [ "$s" != allreduce ] && extra=(--strategy "$s" --sync-every "$h")
    t0=$(date +%s.%N)
    out="$("$bin" train gpt --dataset embedded --steps "$steps" --eval-every "$every" \
        "${extra[@]}" --checkpoint-dir "$work/$s" 2>&1)" || {
        echo "$out" >&2
        exit 1
    }
    t1=$(date +%s.%N)
    losses="$(echo "$out" | sed -n 's/.*at step \([0-9]*\)\/.*validation loss \([0-9.]*\) nats.*/\1:\2/p' | tr '\n' ' ')"
    reached="$(echo "$losses" | tr ' ' '\n' | awk -F: -v g="$goal" '$2 != "" && $2 <= g {print $1; exit}')"
    sent="$(echo "$out" | grep -E '^(data parallel|strategy)' | grep -oE '[0-9.]+ (MiB|KiB)[^,;]*' | head -2 | tr '\n' ';')"
    printf '%-10s wall %6.1f s  reached %s at step %s  val loss %s\n    sent: %s\n' \
        "$s" "$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')" "$goal" "${reached:--}" "$losses" "$sent"
done
