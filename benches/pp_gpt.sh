#!/usr/bin/env bash
# The bundled GPT over a pipeline against data parallelism and one process, at the same
# characters per step: `--pp 2` (one replica of two stages, 1F1B, interleaved 1F1B with 2 chunks
# per rank, and GPipe, M micro-batches),
# `--dp 2` (two replicas of M/2 micro-batches each) and `--dp 1` (M micro-batches), the default
# model on the embedded plays, in alternating rounds. Prints each run's steady rate (after the
# first 10 micro-batches; a pipeline step counts from the one they end in) and, for the pipelines, each stage's idle time against the bubble's formula.
#
#   bash benches/pp_gpt.sh                        # M=8, 40 steps, 2 rounds
#   M=16 STEPS=30 ROUNDS=1 bash benches/pp_gpt.sh
#   BIN=/path/to/other/bonfire bash benches/pp_gpt.sh
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
bin="${BIN:-$target/release/bonfire}"
m="${M:-8}"
steps="${STEPS:-40}"
rounds="${ROUNDS:-2}"
if [ ! -x "$bin" ]; then
    echo "no bonfire binary at $bin: build it with cargo build --release -p bonfire-cli" >&2
    exit 2
fi
if [ $((m % 2)) -ne 0 ]; then
    echo "pp_gpt.sh: M=$m must be even (--dp 2 takes M/2 micro-batches per replica)" >&2
    exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "# $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u +%FT%TZ) M=$m steps=$steps"
printf '%-28s %12s %s\n' run "steady/s" "stages (idle against the bubble)"
for round in $(seq 1 "$rounds"); do
    for cfg in "pp2-1f1b:--dp 1 --pp 2 --micro-batches $m --schedule 1f1b" \
        "pp2-1f1b-2chunks:--dp 1 --pp 2 --micro-batches $m --chunks 2" \
        "dp2:--dp 2 --micro-batches $((m / 2))" \
        "pp2-gpipe:--dp 1 --pp 2 --micro-batches $m --schedule gpipe" \
        "dp1:--dp 1 --micro-batches $m"; do
        name="${cfg%%:*}"
        # shellcheck disable=SC2086
        out="$("$bin" train gpt --dataset embedded --steps "$steps" --eval-every "$steps" \
            --eval-windows 16 --sample-chars 20 --warmup 4 ${cfg#*:} \
            --checkpoint-dir "$work/$name-$round" 2>&1)"
        steady="$(grep -o '[0-9]* chars/s after the first 10 batches' <<<"$out" | grep -o '^[0-9]*' || echo '-')"
        stages="$(grep -o 'pipeline stage [0-9] of [0-9]: .*idle [0-9.]*% of its pipeline steps (the bubble ([^ ]*) is [0-9.]*%)' <<<"$out" \
            | sed 's/pipeline stage \([0-9]\) of [0-9]: blocks [^,]*, [0-9]* parameters; idle \([0-9.]*%\).*is \([0-9.]*%\))/s\1 \2 (\3)/' | paste -sd' ' || true)"
        printf '%-28s %12s %s\n' "$name round $round" "$steady" "$stages"
    done
done
