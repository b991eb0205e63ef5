#!/usr/bin/env bash
# What DataParallel costs per training step, measured in one build: Autodiff<DataParallel<Flex>>
# at world size 1 running no bonfire code (the default) against the same binary with
# BONFIRE_SYNC_ALONE=1, where every backward runs bonfire's whole gradient path (hook, buckets,
# a one-rank all-reduce, write-back) without a peer to wait for. ROUNDS alternations, the median
# of the per-run median step times; both must end with the same loss. PLAIN=1 adds plain Burn
# (Autodiff<Flex>), which needs a second build without Burn's `distributed` feature: that column
# compares two builds of Burn, not bonfire. MODEL picks the model: cnn (the mnist-style
# example's, default), gpt or resnet (the bundled jobs'; BATCH 16 and 64 are the jobs'). STACKS
# adds the other decorators at a group of one to each round, pass-through: "tp"
# (Autodiff<TensorParallel<Flex>>), "hybrid" (Autodiff<Hybrid<Flex>>, dp 1 x tp 1), or both.
set -euo pipefail
cd "$(dirname "$0")"
ROUNDS="${ROUNDS:-7}"; STEPS="${STEPS:-300}"; BATCH="${BATCH:-32}"; PLAIN="${PLAIN:-0}"
MODEL="${MODEL:-cnn}"; STACKS="${STACKS:-}"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-1}"
cargo build -q --release --target-dir target/dp --features dp
[ "$PLAIN" = 1 ] && cargo build -q --release --target-dir target/plain
bin=target/dp/release/dp-overhead-bench
off=(); on=(); plain=(); exp=(); loss_off=""; loss_on=""; loss_plain=""
declare -A stack_times stack_loss
for _ in $(seq "$ROUNDS"); do
    # An assignment, so that a failing run stops the script (set -e).
    line=$(BONFIRE_SYNC_ALONE=0 "$bin" "$STEPS" "$BATCH" "$MODEL")
    read -r _ t _ loss_off buckets_off _ <<< "$line"; off+=("$t")
    line=$(BONFIRE_SYNC_ALONE=1 "$bin" "$STEPS" "$BATCH" "$MODEL")
    read -r _ t _ loss_on buckets_on exposed <<< "$line"; on+=("$t"); exp+=("$exposed")
    if [ "$PLAIN" = 1 ]; then
        line=$(target/plain/release/dp-overhead-bench "$STEPS" "$BATCH" "$MODEL")
        read -r _ t _ loss_plain _ <<< "$line"; plain+=("$t")
    fi
    for stack in $STACKS; do
        line=$(STACK="$stack" BONFIRE_SYNC_ALONE=0 "$bin" "$STEPS" "$BATCH" "$MODEL")
        read -r _ t _ l _ <<< "$line"
        stack_times[$stack]="${stack_times[$stack]:-} $t"; stack_loss[$stack]="$l"
    done
done
for stack in $STACKS; do
    [ "${stack_loss[$stack]}" = "$loss_off" ] ||
        { echo "STACK=$stack ended at loss ${stack_loss[$stack]}, DataParallel at $loss_off" >&2; exit 1; }
done
[ "$buckets_off" = 0 ] || { echo "the pass-through all-reduced $buckets_off buckets" >&2; exit 1; }
[ "$buckets_on" -gt 0 ] || { echo "BONFIRE_SYNC_ALONE=1 all-reduced no bucket" >&2; exit 1; }
[ "$loss_off" = "$loss_on" ] || { echo "losses differ: $loss_off against $loss_on" >&2; exit 1; }
stacks_arg=""
for stack in $STACKS; do stacks_arg="$stacks_arg;$stack:${stack_times[$stack]}"; done
echo "model $MODEL, batch $BATCH, $STEPS timed steps per run after 10 untimed, $ROUNDS rounds"
python3 - "${off[*]}" "${on[*]}" "${plain[*]}" "$buckets_on" "$loss_on" "${exp[*]}" "$stacks_arg" "$loss_plain" <<'PY'
import statistics, sys
off = [float(x) for x in sys.argv[1].split()]; on = [float(x) for x in sys.argv[2].split()]
m0, m1 = statistics.median(off), statistics.median(on)
print(f"DataParallel<Flex> ws=1, pass-through:     median step {m0:.3f} ms  (runs {off})")
print(f"DataParallel<Flex> ws=1, BONFIRE_SYNC_ALONE=1: median step {m1:.3f} ms  (runs {on})")
print(f"bonfire's gradient path: {m1 - m0:+.3f} ms per step, {100 * (m1 / m0 - 1):+.2f}% "
      f"({sys.argv[4]} buckets all-reduced in the last run; both end at loss {sys.argv[5]})")
e = [float(x) for x in sys.argv[6].split()]
print(f"of which the synchronisation after backward (exposed, mean per step): median {statistics.median(e):.3f} ms")
if sys.argv[3]:
    p = [float(x) for x in sys.argv[3].split()]
    mp = statistics.median(p)
    print(f"plain Autodiff<Flex> (another Burn build): median step {mp:.3f} ms  (runs {p}), "
          f"DataParallel pass-through / plain {m0 / mp:.3f}; loss {sys.argv[8]}")
for part in sys.argv[7].split(";"):
    if not part:
        continue
    name, runs = part.split(":")
    t = [float(x) for x in runs.split()]
    mt = statistics.median(t)
    label = {"tp": "TensorParallel<Flex>, a group of one", "hybrid": "Hybrid<Flex>, dp 1 x tp 1"}[name]
    print(f"{label}: median step {mt:.3f} ms  (runs {t}), / DataParallel pass-through {mt / m0:.3f}")
PY
