#!/usr/bin/env bash
# ZeRO-3's parameter gathers started ahead of need (`--prefetch N`) on the GPT job: `bonfire train
# gpt --dp 2` plain (DDP) and with --zero 3 at each N of DEPTHS (default "0 1 8": parameters
# gathered N at a time in one all-gather, ahead of need; 0 is every gather waited for where its
# op needs it), PAIRS rounds, the runs alternating. With PYTHON naming
# an interpreter with torch (one host only), PyTorch FSDP2 (`fully_shard`, resharded after
# forward, its default prefetch) and DDP on the same GPT in each round.
#
# With RTT_MS set, every run crosses `bonfire bench wan` instead: two "nodes" on this host, one
# rank each, whose only path is a link of RTT_MS round trip, LOSS percent loss (default 0) and
# MBIT Mbit/s (default 1000); needs root. That is where a gather's latency is more than its
# transfer on one host, and where starting it ahead matters.
#
# Each line: chars/s after the first 10 batches, the ratio to the round's DDP, rank 0's
# all-gathers while training, how many of its reads of a parameter found their gather started
# ahead, what the gathers held rank 0's thread (and its share of the training time), the step
# time and the weights digest (every --zero 3 run of a
# round must end on one: starting gathers ahead changes no bit). BIN runs another build of
# bonfire (then nothing is built).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${STEPS:-100}"; PAIRS="${PAIRS:-2}"; DEPTHS="${DEPTHS:-0 1 8}"
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1
target="${CARGO_TARGET_DIR:-target}/release"
if [ -z "${BIN:-}" ]; then
    cargo build -q --release -p bonfire-cli
fi
bin="${BIN:-$target/bonfire}"
data="${BONFIRE_DATA_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/bonfire/datasets}"
text="$data/shakespeare/shakespeare.txt"
scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
gpt() { # [--zero 3 --prefetch N] -> "chars/s gathers ahead waited step-ms digest"
    local log="$scratch/log-$RANDOM"
    local job=(train gpt --steps "$STEPS" --eval-every "$STEPS" --eval-windows 16 --warmup 10
        --checkpoint-dir "$scratch/run-$RANDOM" "$@")
    if [ -n "${RTT_MS:-}" ]; then
        # The kernel removes the last run's namespaces (and their addresses) in the background.
        for _ in $(seq 50); do ip -br addr | grep -q '^bf' || break; sleep 0.2; done
        "$bin" bench wan --rtt-ms "$RTT_MS" --loss-percent "${LOSS:-0}" --mbit "${MBIT:-1000}" \
            -- "$bin" "${job[@]}" > "$log" 2>&1 || { tail -5 "$log" >&2; exit 1; }
    else
        "$bin" "${job[@]}" --dp 2 > "$log" 2>&1 || { tail -5 "$log" >&2; exit 1; }
    fi
    local rate gathers ahead wait step digest
    rate=$(grep "throughput" "$log" | sed -nE 's/.* ([0-9]+) chars\/s after the first.*/\1/p')
    gathers=$(grep "fully sharded" "$log" | sed -nE 's/.*; ([0-9]+) all-gathers \(.*/\1/p')
    ahead=$(grep "fully sharded" "$log" |
        sed -nE 's/.*training: ([0-9]+) reads of sharded parameters, ([0-9]+) served.*/\2\/\1/p')
    wait=$(grep "fully sharded" "$log" | sed -nE 's/.*waited ([0-9.]+ s \([0-9]+%).*/\1)/p' | tr -d ' ')
    step=$(grep "data parallel" "$log" | sed -nE 's/.*data parallel +([0-9.]+) ms per step.*/\1/p')
    digest=$(grep "weights digest" "$log" | awk '{print substr($NF, 1, 12)}')
    [ -n "$rate" ] || { echo "zero3_prefetch.sh: no steady rate in $log" >&2; tail -5 "$log" >&2; exit 1; }
    echo "$rate ${gathers:--} ${ahead:--} ${wait:--} ${step:--} $digest"
}
torch() { # [--fsdp2 zero3] -> chars/s
    "$PYTHON" benches/gpt_ddp_torch.py --text "$text" --dp 2 --steps "$STEPS" "$@" |
        awk '!/^#/ && NF > 2 {print $2}'
}
echo "# ${RTT_MS:+across a ${RTT_MS} ms, ${LOSS:-0}% loss, ${MBIT:-1000} Mbit/s link; }$STEPS steps, 2 ranks"
echo "round run chars/s vs-ddp all-gathers served-ahead/reads gathers-waited step-ms digest"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2f", a / b}'; }
# Each run's line is read from a command substitution, so that a failed run stops the script.
for p in $(seq "$PAIRS"); do
    out=$(gpt); read -r d _ _ _ ds dd <<< "$out"
    echo "$p bonfire-ddp $d 1.00 - - - $ds $dd"
    for n in $DEPTHS; do
        out=$(gpt --zero 3 --prefetch "$n"); read -r r g a w s x <<< "$out"
        echo "$p bonfire-zero3-prefetch-$n $r $(ratio "$r" "$d") $g $a $w $s $x"
    done
    if [ -n "${PYTHON:-}" ] && [ -z "${RTT_MS:-}" ]; then
        t=$(torch); f=$(torch --fsdp2 zero3)
        [ -n "$t" ] && [ -n "$f" ] || { echo "zero3_prefetch.sh: the PyTorch peer gave no rate" >&2; exit 1; }
        echo "$p torch-ddp $t $(ratio "$t" "$d") - - - - -"
        echo "$p torch-fsdp2-zero3 $f $(ratio "$f" "$d") - - - - -"
    fi
done
