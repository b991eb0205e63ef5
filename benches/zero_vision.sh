#!/usr/bin/env bash
# ZeRO on the vision job: `bonfire train vision` at RANKS ranks with DDP (no --zero) and with each
# of --zero 1, 2 and 3, against PyTorch DDP and FSDP2 (`fully_shard` on each residual block and the
# model, resharded after forward: ZeRO-3) on the same ResNet, fed and timed alike (as
# benches/resnet_scaling.sh: the first BATCH x STEPS x RANKS MNIST training images from bonfire's
# data set cache, batch BATCH per rank, Adam at 0.003, one compute thread per rank, the loss read
# every step, images/s over the last of EPOCHS epochs). PAIRS rounds, the six runs alternating.
# Each line: the run, its images/s, its ratio to its own DDP's in the round, the model state per
# rank (bonfire: its report's `model state` line, MiB; PyTorch: the bytes of each rank's local
# parameters, gradients and Adam moments, MiB) and, for bonfire, its weights digest (equal at
# every stage: ZeRO changes no bit at 2 ranks). PYTHON names an interpreter with torch; BIN runs
# another build of bonfire (then nothing is built).
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS="${RANKS:-2}"; BATCH="${BATCH:-64}"; STEPS="${STEPS:-60}"; EPOCHS="${EPOCHS:-2}"
PAIRS="${PAIRS:-2}"; PYTHON="${PYTHON:-python3}"
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1
target="${CARGO_TARGET_DIR:-target}/release"
if [ -z "${BIN:-}" ]; then
    cargo build -q --release -p bonfire-cli
fi
bin="${BIN:-$target/bonfire}"
data="${BONFIRE_DATA_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/bonfire/datasets}"
if [ ! -f "$data/mnist/train-images-idx3-ubyte" ]; then
    echo "zero_vision.sh: no MNIST in $data/mnist: fetch it first (bonfire train vision --dataset mnist --epochs 1 --train-limit 64)" >&2
    exit 2
fi
scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
vision() { # [--zero N] -> "images/s state-MiB digest"
    local log="$scratch/log-$RANDOM"
    "$bin" train vision --dataset mnist --ranks "$RANKS" --epochs "$EPOCHS" --batch "$BATCH" \
        --train-limit $((BATCH * STEPS * RANKS)) --test-limit 100 \
        --checkpoint-dir "$scratch/run-$RANDOM" "$@" > "$log" 2>&1 || { tail -5 "$log" >&2; exit 1; }
    local rate state digest
    rate=$(grep "^epoch $EPOCHS/$EPOCHS:" "$log" | sed -E 's/.* ([0-9]+) images\/s.*/\1/')
    state=$(grep "^model state" "$log" | sed -E 's/.*\): ([0-9.]+) MiB;.*/\1/')
    digest=$(grep "^weights digest" "$log" | awk '{print substr($3, 1, 12)}')
    [ -n "$rate" ] || { echo "zero_vision.sh: no rate in $log" >&2; exit 1; }
    echo "$rate $state $digest"
}
torch() { # [--fsdp2 zero3] -> "images/s state-MiB"
    "$PYTHON" benches/ddp_mnist_style.py --model resnet --nproc "$RANKS" --batch "$BATCH" \
        --steps "$STEPS" --epochs "$EPOCHS" --mnist "$data/mnist" --many-only "$@" |
        awk '/state/{if ($4 > s) s = $4} /ranks:/{r = $3} END{printf "%s %.3f\n", r, s / 1048576}'
}
torch_rate() { # [--fsdp2 zero3] -> "images/s state-MiB", or exits when the peer gave no rate
    local out
    out=$(torch "$@")
    case "$out" in
    "" | " "* | 0\ * | skipped*) echo "zero_vision.sh: the PyTorch peer gave no rate ($PYTHON)" >&2; exit 1 ;;
    esac
    echo "$out"
}
echo "round run images/s vs-own-ddp state-MiB-per-rank digest"
# Each run's line is read from a command substitution, so that a failed run stops the script.
for p in $(seq "$PAIRS"); do
    out=$(vision); read -r d ds dd <<< "$out"
    echo "$p bonfire-ddp $d 1.00 $ds $dd"
    for z in 1 2 3; do
        out=$(vision --zero "$z"); read -r r s g <<< "$out"
        echo "$p bonfire-zero$z $r $(python3 -c "print(f'{$r/$d:.2f}')") $s $g"
    done
    out=$(torch_rate); read -r t ts <<< "$out"
    echo "$p pytorch-ddp $t 1.00 $ts"
    out=$(torch_rate --fsdp2 zero3); read -r f fs <<< "$out"
    echo "$p pytorch-fsdp2-zero3 $f $(python3 -c "print(f'{$f/$t:.2f}')") $fs"
done
