#!/usr/bin/env bash
# Pipeline parallelism's bubble and memory, measured: the book's pipeline program (Burn's
# TransformerEncoder, 4 layers, split one stage per rank) under `bonfire launch` at pp 2 and 4,
# GPipe and 1F1B, 4, 8 and 16 micro-batches of one 16-row batch. Every stage prints the part of
# steps 5-29 it idled beside the bubble's formula (p-1)/(m+p-1), the step time, and the most
# micro-batches and activation bytes it held.
#
#   bash benches/pp_bubble.sh [STAGES...]      (default: 2 4)
#
# Needs release builds of the CLI and the program:
#   cargo build --release -p bonfire-cli -p bonfire-book --bin bonfire --bin pipeline
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}/release"
for bin in bonfire pipeline; do
    [ -x "$target/$bin" ] || { echo "pp_bubble.sh: $target/$bin is not built (see the header)" >&2; exit 2; }
done
stages=("${@:-2 4}")
# shellcheck disable=SC2068
for p in ${stages[@]}; do
    for schedule in gpipe 1f1b; do
        for m in 4 8 16; do
            BONFIRE_PP="$p" BOOK_REPORT=1 BOOK_SCHEDULE="$schedule" BOOK_MICRO_BATCHES="$m" RAYON_NUM_THREADS=1 \
                "$target/bonfire" launch --nproc-per-node "$p" -- "$target/pipeline" \
                | grep '^\(\[rank [0-9]*\] \)\?stage ' | sed 's/^\[rank [0-9]*\] //'
        done
    done
done
