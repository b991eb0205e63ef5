#!/usr/bin/env bash
# Weak scaling of the mnist-style example: 1 rank against N ranks (default 2) under bonfire launch,
# the same per-rank batch and steps per epoch, one compute thread per rank (RAYON_NUM_THREADS=1).
# Reports the last epoch's images/s and communication hidden by backward, then the efficiency
# images/s(N) / (N x images/s(1)). Then the peer, benches/ddp_mnist_style.py --epochs, which feeds
# PyTorch DDP (gloo) the same way (shuffled shard per epoch, gathered batches, loss read every step,
# last epoch timed); PEER=0 skips it, PYTHON picks the interpreter that has torch.
# The ranks talk over bonfire launch's default lanes (shared memory on one host); TRANSPORT=quic
# forces QUIC. BIN_DIR runs the `bonfire` and `mnist-style` of another build (a folder holding
# both) instead of building this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${N:-2}"; BATCH="${BATCH:-32}"; STEPS="${STEPS:-300}"; EPOCHS="${EPOCHS:-3}"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-1}"
if [ -z "${BIN_DIR:-}" ]; then
    cargo build -q --release -p mnist-style -p bonfire-cli
fi
target="${BIN_DIR:-${CARGO_TARGET_DIR:-target}/release}"
last() { grep "^.*epoch $EPOCHS:" | sed -E 's/.* ([0-9]+) images\/s.*communication ([0-9]+)% hidden.*/\1 \2/'; }
one=$("$target/mnist-style" --epochs "$EPOCHS" --batch "$BATCH" --train-size $((BATCH * STEPS)) | last)
many=$("$target/bonfire" launch --transport "${TRANSPORT:-auto}" --nproc-per-node "$N" -- \
    "$target/mnist-style" --epochs "$EPOCHS" --batch "$BATCH" --train-size $((BATCH * STEPS * N)) | last)
read -r r1 h1 <<<"$one"; read -r rn hn <<<"$many"
echo "bonfire DataParallel<Flex>, transport ${TRANSPORT:-auto}, batch $BATCH per rank, 1 thread per rank"
echo "  1 rank:  $r1 images/s"
echo "  $N ranks: $rn images/s (communication ${hn}% hidden by backward)"
python3 -c "print(f'  weak-scaling efficiency: {100 * $rn / ($N * $r1):.1f}%')"
if [ "${PEER:-1}" != 0 ]; then
    "${PYTHON:-python3}" benches/ddp_mnist_style.py --nproc "$N" --batch "$BATCH" --steps "$STEPS" \
        --epochs "$EPOCHS"
fi
