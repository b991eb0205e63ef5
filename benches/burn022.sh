#!/usr/bin/env bash
# Burn 0.22 through bonfire against the Burn 0.21 decorator and Burn 0.22's own MultiDevice
# strategy: the guide's classifier (crates/bonfire-burn022's `guide`, book/programs' `guide-021`,
# the same model, data, optimizer and batch) on the embedded MNIST sample, Flex, in alternating
# rounds. Prints each run's milliseconds per step and images per second (ranks x batch / step).
#
#   bash benches/burn022.sh            # 3 rounds, 2 epochs each
#   ROUNDS=5 EPOCHS=3 bash benches/burn022.sh
#
# Needs the release builds: cargo build --release -p bonfire-cli -p bonfire-book --bin bonfire
# --bin guide-021, and cargo build --release --manifest-path crates/bonfire-burn022/Cargo.toml
# --bin guide (with CARGO_TARGET_DIR022 naming that workspace's target directory if moved).
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
target022="${CARGO_TARGET_DIR022:-${CARGO_TARGET_DIR:-crates/bonfire-burn022/target}}"
bonfire="$target/release/bonfire"
guide021="$target/release/guide-021"
guide022="$target022/release/guide"
rounds="${ROUNDS:-3}"
epochs="${EPOCHS:-2}"
for b in "$bonfire" "$guide021" "$guide022"; do
    if [ ! -x "$b" ]; then
        echo "no binary at $b: see this script's header for the builds" >&2
        exit 2
    fi
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# One run: its label, then the command. Prints "label ms/step images/s" from the rank-0 line.
run() {
    local label="$1" ranks="$2"
    shift 2
    local out="$work/out.txt"
    "$@" > "$out" 2>&1 || { echo "$label failed:" >&2; tail -20 "$out" >&2; exit 1; }
    local ms
    ms="$(grep -o 'rank 0 of [0-9]*: [0-9]* steps of [0-9]* images in [0-9.]* s ([0-9.]* ms per step)' "$out" \
        | sed -E 's/.*\(([0-9.]+) ms per step\)/\1/' || true)"
    if [ -z "$ms" ]; then
        echo "$label: no summary line" >&2
        tail -20 "$out" >&2
        exit 1
    fi
    awk -v l="$label" -v ms="$ms" -v r="$ranks" 'BEGIN { printf "%-28s %8.1f ms/step %8.0f images/s\n", l, ms, r * 64 * 1000 / ms }'
}

echo "== $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) cores, $epochs epochs of the 2,000-image sample, batch 64 per rank"
for round in $(seq 1 "$rounds"); do
    echo "-- round $round"
    run "0.22 bonfire, 1 rank" 1 "$guide022" --epochs "$epochs" --artifacts "$work/a"
    run "0.22 bonfire, 2 ranks" 2 "$bonfire" launch --nproc-per-node 2 -- \
        "$guide022" --epochs "$epochs" --artifacts "$work/b"
    run "0.22 Burn MultiDevice x2" 2 "$guide022" --epochs "$epochs" --burn-multi-device 2 \
        --artifacts "$work/c"
    run "0.21 bonfire, 1 rank" 1 "$guide021" --epochs "$epochs"
    run "0.21 bonfire, 2 ranks" 2 "$bonfire" launch --nproc-per-node 2 -- \
        "$guide021" --epochs "$epochs"
done
