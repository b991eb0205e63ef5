#!/usr/bin/env bash
# Thread placement A/B on the mnist-style example: N ranks (default 2) under `bonfire launch`,
# alternating BONFIRE_CPU_BIND=none and =cores for ROUNDS rounds (default 5), the same flags as
# benches/dp_scaling.sh. Prints each run's last-epoch images/s and its backward, communication and
# exposed ms per step. RAYON_NUM_THREADS is left to the placement (one compute thread per compute
# CPU of the rank's share); COMM_CPUS sets BONFIRE_COMM_CPUS for the unbound arm. BIN_DIR runs another
# build's `bonfire` and `mnist-style` instead of building this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${N:-2}"; BATCH="${BATCH:-32}"; STEPS="${STEPS:-300}"; EPOCHS="${EPOCHS:-3}"; ROUNDS="${ROUNDS:-5}"
if [ -z "${BIN_DIR:-}" ]; then
    cargo build -q --release -p mnist-style -p bonfire-cli
fi
target="${BIN_DIR:-${CARGO_TARGET_DIR:-target}/release}"
cores=$(env -u OMP_NUM_THREADS nproc)
threads=$((cores / N)); [ "$threads" -ge 1 ] || threads=1
echo "mnist-style, $N ranks on $cores CPUs, batch $BATCH per rank, $STEPS steps per epoch, epoch $EPOCHS timed"
for round in $(seq "$ROUNDS"); do
    for bind in none cores; do
        # Unbound ranks share the cores as `bonfire train` shares them (cores / ranks threads);
        # bound ones take their placement's compute CPUs.
        if [ "$bind" = none ]; then export RAYON_NUM_THREADS=$threads; else unset RAYON_NUM_THREADS; fi
        # A list names CPUs of the machine: unbound ranks only (a bound rank has its block).
        comm=""; [ "$bind" = none ] && comm="${COMM_CPUS:-}"
        line=$(env BONFIRE_CPU_BIND=$bind ${comm:+BONFIRE_COMM_CPUS=$comm} \
            "$target/bonfire" launch --nproc-per-node "$N" -- "$target/mnist-style" --epochs "$EPOCHS" \
            --batch "$BATCH" --train-size $((BATCH * STEPS * N)) | grep "epoch $EPOCHS:")
        echo "round $round, --cpu-bind $bind: $(echo "$line" | sed -E 's/.*, ([0-9]+ images\/s).*\((.*)\)/\1, \2/')"
    done
done
