#!/usr/bin/env bash
# Weak scaling of the bundled ResNet, 1 rank against 2, for `bonfire train vision` and PyTorch DDP
# (gloo) fed and timed alike: the same first BATCH x STEPS x ranks MNIST training images (from
# bonfire's data set cache), batch BATCH per rank, Adam at 0.003, one compute thread per rank
# (RAYON_NUM_THREADS for Flex, OMP_NUM_THREADS for LibTorch),
# the loss read every step, and images/s over the whole of the last of EPOCHS epochs (the earlier
# ones are the warm-up). PAIRS rounds, the two programs alternating; PYTHON names an
# interpreter with torch. BACKEND passes --backend to bonfire (default: auto); BIN runs another
# build of bonfire (then nothing is built), such as one with `--features libtorch`.
set -euo pipefail
cd "$(dirname "$0")/.."
BATCH="${BATCH:-64}"; STEPS="${STEPS:-100}"; EPOCHS="${EPOCHS:-2}"; PAIRS="${PAIRS:-3}"
PYTHON="${PYTHON:-python3}"
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1
target="${CARGO_TARGET_DIR:-target}/release"
if [ -z "${BIN:-}" ]; then
    cargo build -q --release -p bonfire-cli
fi
bin="${BIN:-$target/bonfire}"
data="${BONFIRE_DATA_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/bonfire/datasets}"
scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
vision() { # ranks -> images/s of the last epoch
    "$bin" train vision --ranks "$1" --epochs "$EPOCHS" --batch "$BATCH" --backend "${BACKEND:-auto}" \
        --train-limit $((BATCH * STEPS * $1)) --test-limit 100 \
        --checkpoint-dir "$scratch/run-$1-$RANDOM" |
        grep "^epoch $EPOCHS/$EPOCHS:" | sed -E 's/.* ([0-9]+) images\/s.*/\1/'
}
echo "pair bonfire-1 bonfire-2 bonfire-eff pytorch-1 pytorch-2 pytorch-eff"
for p in $(seq "$PAIRS"); do
    b1=$(vision 1); b2=$(vision 2)
    read -r t1 t2 < <("$PYTHON" benches/ddp_mnist_style.py --model resnet --batch "$BATCH" \
        --steps "$STEPS" --epochs "$EPOCHS" --mnist "$data/mnist" |
        awk '/1 rank:/{a=$3} /2 ranks:/{b=$3} END{print a, b}')
    python3 -c "print($p, $b1, $b2, f'{100*$b2/(2*$b1):.1f}%', $t1, $t2, f'{100*$t2/(2*$t1):.1f}%')"
done
