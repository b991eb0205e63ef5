#!/usr/bin/env bash
# The bundled jobs' data-parallel strategies side by side: `--strategy allreduce`, `local-sgd`
# and `diloco` (meeting every H steps), and `ps-sync` and `ps-async` (the
# last of the RANKS ranks serves, SERVERS=N for more; STALENESS=S for ps-async's bound: the
# same ranks, so RANKS-SERVERS workers train, each on 1/(RANKS-SERVERS) of the data with the same
# batch per step, which makes more steps per epoch and a smaller global batch), RANKS
# ranks (default 2) on this host, the same steps,
# batches and seed; with WAN set, over two "sites" joined by a slow link (`bonfire bench wan`,
# RANKS/2 ranks per site; needs root), WAN holding its flags.
# Prints, per strategy, the quality at each evaluation (GPT: validation loss in nats/char;
# vision: test accuracy in %), the first evaluation at which it reached TARGET (or "-"), the
# wall time, and what each rank all-reduced (the job's report: gradient buckets for allreduce,
# the meetings' deltas for the others).
#
#   bash benches/strategies.sh                  # GPT, embedded plays, 400 steps, H=50
#   STEPS=1200 EVAL_EVERY=200 bash benches/strategies.sh
#   JOB=vision EPOCHS=3 bash benches/strategies.sh   # ResNet on MNIST, target 98%
#   STRATEGIES=diloco OUTER="--outer-momentum 0.5" bash benches/strategies.sh   # OUTER: diloco's
#   STRATEGIES=local-sgd LOCAL="--int8-deltas" bash benches/strategies.sh   # LOCAL: local-sgd's and diloco's
#   STRATEGIES=local-sgd LOCAL="--overlap-steps 25" RANKS=4 WAN="..." bash benches/strategies.sh
#   JOB=vision EPOCHS=2 EXTRA="--non-iid" bash benches/strategies.sh         # EXTRA: every run's
#   BIN=/path/to/other/bonfire bash benches/strategies.sh
#   RANKS=4 WAN="--rtt-ms 50 --loss-percent 1 --mbit 100" bash benches/strategies.sh
#   JOB=vision RANKS=4 STRATEGIES="allreduce ps-sync ps-async" bash benches/strategies.sh
#   RANKS=3 STRATEGIES="allreduce ps-sync ps-async" bash benches/strategies.sh   # GPT
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
bin="${BIN:-$target/release/bonfire}"
job="${JOB:-gpt}"
h="${H:-50}"
ranks="${RANKS:-2}"
if [ ! -x "$bin" ]; then
    echo "no bonfire binary at $bin: build it with cargo build --release -p bonfire-cli" >&2
    exit 2
fi
case "$job" in
gpt)
    steps="${STEPS:-400}"
    every="${EVAL_EVERY:-100}"
    goal="${TARGET:-2.35}"
    args=(train gpt --dataset embedded --steps "$steps" --eval-every "$every")
    # "at step S/N: ... validation loss L nats/char" -> S:L; reached when L <= goal.
    quality='s/.*at step \([0-9]*\)\/.*validation loss \([0-9.]*\) nats.*/\1:\2/p'
    reached='$2 != "" && $2 <= g'
    ;;
vision)
    epochs="${EPOCHS:-3}"
    goal="${TARGET:-98}"
    args=(train vision --dataset mnist --epochs "$epochs")
    # "epoch E/N: ... test accuracy A% ..." -> E:A; reached when A >= goal.
    quality='s/^epoch \([0-9]*\)\/.*test accuracy \([0-9.]*\)%.*/\1:\2/p'
    reached='$2 != "" && $2 >= g'
    ;;
*)
    echo "strategies.sh: JOB=$job is not gpt or vision" >&2
    exit 2
    ;;
esac
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [ "$job" = vision ]; then
    # Fetched (or found in the cache) before any run is timed.
    "$bin" train vision --dataset mnist --epochs 1 --train-limit 64 --test-limit 64 \
        --checkpoint-dir "$work/fetch" >/dev/null
fi

run=("$bin")
if [ -n "${WAN:-}" ]; then
    if [ $((ranks % 2)) -ne 0 ]; then
        echo "strategies.sh: WAN needs an even RANKS (two sites), not $ranks" >&2
        exit 2
    fi
    # shellcheck disable=SC2206 # WAN's flags split on spaces, as written
    run=("$bin" bench wan ${WAN} --nproc-per-site $((ranks / 2)) -- "$bin")
else
    args+=(--ranks "$ranks")
fi
where="one host"
[ -n "${WAN:-}" ] && where="two sites: $WAN"
echo "# $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u +%FT%TZ) job=$job ${args[*]:2} H=$h target=$goal ranks=$ranks ($where)"
# shellcheck disable=SC2086 # the list splits on spaces
for s in ${STRATEGIES:-allreduce local-sgd diloco}; do
    extra=()
    case "$s" in
    allreduce) ;;
    ps-sync) extra=(--strategy "$s" --servers "${SERVERS:-1}") ;;
    ps-async) extra=(--strategy "$s" --servers "${SERVERS:-1}" --staleness "${STALENESS:-2}") ;;
    *) extra=(--strategy "$s" --sync-every "$h") ;;
    esac
    # shellcheck disable=SC2206 # OUTER's flags split on spaces, as written
    [ "$s" = diloco ] && extra+=(${OUTER:-})
    # shellcheck disable=SC2206 # LOCAL's flags split on spaces, as written
    case "$s" in local-sgd | diloco) extra+=(${LOCAL:-}) ;; esac
    # shellcheck disable=SC2206 # EXTRA's flags split on spaces, as written
    extra+=(${EXTRA:-})
    t0=$(date +%s.%N)
    raw="$("${run[@]}" "${args[@]}" "${extra[@]}" --checkpoint-dir "$work/$s" 2>&1)" || {
        echo "$raw" >&2
        exit 1
    }
    # Under a launcher every line is prefixed "[rank N] " (N padded): the report is rank 0's.
    out="$(echo "$raw" | sed -e '/^\[rank *[1-9][0-9]*\]/d' -e 's/^\[rank *0\] //')"
    t1=$(date +%s.%N)
    points="$(echo "$out" | sed -n "$quality" | tr '\n' ' ')"
    first="$(echo "$points" | tr ' ' '\n' | awk -F: -v g="$goal" "$reached {print \$1; exit}")"
    sent="$(echo "$out" | grep -E '^(data parallel|strategy)' | grep -oE '[0-9.]+ (MiB|KiB)[^,;]*|[0-9.]+ s in meetings|[0-9.]+ s of exchanges ran behind the steps|[0-9.]+ ms exposed' | tr '\n' ';' || true)"
    # Parameter servers: worker 0's traffic and each server's line.
    sent+="$(echo "$out" | grep -E '^parameter worker 0:' | sed 's/^parameter //' || true)"
    served="$(echo "$out" | grep -E '^parameter server' | sed 's/^parameter /    /' || true)"
    rate="$(echo "$out" | grep -E '^throughput' | grep -oE '[0-9]+ [a-z]+/s after the first [0-9]+ batches' || true)"
    printf '%-10s wall %6.1f s  reached %s at %s  quality %s\n    sent: %s\n    steady: %s\n' \
        "$s" "$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')" "$goal" "${first:--}" \
        "$points" "$sent" "$rate"
    [ -n "$served" ] && echo "$served"
    echo "$out" | grep -E '^bonfire bench wan: site [AB] -> ' | sed 's/^bonfire bench wan: /    link: /' || true
done
