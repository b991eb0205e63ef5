#!/usr/bin/env bash
# What a checkpoint of a fully sharded GPT costs: `bonfire train gpt --dp RANKS --zero 3`, whose
# checkpoints are per rank (each rank writes its slices and the optimizer state for them; the
# job's `checkpoint cost` line), against `--zero 2`, whose checkpoints rank 0 writes whole after
# gathering the optimizer's state (the way every checkpoint of a sharded run was written before),
# and, when PYTHON names an interpreter with torch, PyTorch's distributed checkpoint
# (`torch.distributed.checkpoint.save` of FSDP2's sharded state dicts, `fully_shard` resharded
# after forward) on the same GPT after the same training. PAIRS rounds.
#
# Each line: milliseconds per checkpoint on rank 0 (bonfire: the whole save, from the first rank's
# file to the renamed directory, including the exchange of the files' sums and fsync; PyTorch:
# get_state_dict + dcp.save between two barriers, fsync on as by default), the MiB rank 0 wrote to
# one checkpoint, and that as a share of the whole model and Adam state. SAVES checkpoints per
# run (bonfire: --eval-every STEPS/SAVES, so each comes with an evaluation, not timed here).
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS="${RANKS:-2}"; STEPS="${STEPS:-60}"; SAVES="${SAVES:-6}"; PAIRS="${PAIRS:-2}"
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1
target="${CARGO_TARGET_DIR:-target}/release"
if [ -z "${BIN:-}" ]; then
    cargo build -q --release -p bonfire-cli
fi
bin="${BIN:-$target/bonfire}"
data="${BONFIRE_DATA_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/bonfire/datasets}"
text="$data/shakespeare/shakespeare.txt"
scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
gpt() { # --zero N -> "ms-per-save MiB-by-rank-0 state-MiB-whole"
    local log="$scratch/log-$RANDOM"
    "$bin" train gpt --dp "$RANKS" --steps "$STEPS" --eval-every $((STEPS / SAVES)) \
        --eval-windows 64 --warmup 10 --checkpoint-dir "$scratch/run-$RANDOM" "$@" > "$log" 2>&1 ||
        { tail -5 "$log" >&2; exit 1; }
    local ms mib whole
    ms=$(grep "^checkpoint cost" "$log" | sed -nE 's/.*, ([0-9.]+) ms each on rank 0.*/\1/p')
    mib=$(grep "^checkpoint cost" "$log" | sed -nE 's/.*: ([0-9.]+) MiB.*/\1/p')
    # The model and Adam's state whole: parameters x 3 x 4 bytes.
    whole=$(grep "^model state" "$log" -A3 | tr '\n' ' ' |
        sed -nE 's/.*parameters [0-9.]+ MiB \((ZeRO-[0-9]: [0-9]+% of )?(the whole )?([0-9.]+) MiB.*/\3/p')
    [ -n "$ms" ] && [ -n "$mib" ] || { echo "zero3_checkpoint.sh: no checkpoint cost in $log" >&2; exit 1; }
    echo "$ms $mib ${whole:--}"
}
echo "round run ms/save vs-bonfire-zero3 MiB-by-rank-0"
for p in $(seq "$PAIRS"); do
    out=$(gpt --zero 3); read -r z zm _ <<< "$out"
    echo "$p bonfire-zero3-per-rank $z 1.00 $zm"
    out=$(gpt --zero 2); read -r w wm _ <<< "$out"
    echo "$p bonfire-zero2-whole $w $(awk -v a="$w" -v b="$z" 'BEGIN{printf "%.2f", a / b}') $wm"
    if [ -n "${PYTHON:-}" ]; then
        line=$("$PYTHON" benches/gpt_ddp_torch.py --text "$text" --dp "$RANKS" --steps "$STEPS" \
            --fsdp2 zero3 --dcp "$SAVES" | grep "^# dcp")
        t=$(sed -nE 's/.*, ([0-9.]+) ms each on rank 0.*/\1/p' <<< "$line")
        tm=$(sed -nE 's/.*; ([0-9.]+) MiB by rank 0.*/\1/p' <<< "$line")
        [ -n "$t" ] || { echo "zero3_checkpoint.sh: the PyTorch peer gave no time" >&2; exit 1; }
        echo "$p torch-fsdp2-dcp $t $(awk -v a="$t" -v b="$z" 'BEGIN{printf "%.2f", a / b}') $tm"
    fi
done
