#!/usr/bin/env bash
# Tensor parallelism on this host, bonfire against PyTorch, back to back in one session: the
# bundled GPT trained over 1, 2, 4 ranks by `bonfire bench tp` (TensorParallel<Flex> over QUIC),
# then the same model, plan, data and step window by benches/tp_gpt_torch.py (DTensor over gloo).
# Both print one row per tp size with the same columns; threads per rank = cores / ranks in both.
# Extra arguments go to both (--layers, --embd, --heads, --context, --batch, --vocab, --warmup,
# --threads). PYTHON picks the interpreter that has torch (default python3; without torch the
# peer says so and is skipped).
#
#     bash benches/tp_scaling.sh [--embd 512 ...]
#     TP=1,2 STEPS=20 PYTHON=~/.cache/bonfire/torch-venv/bin/python bash benches/tp_scaling.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TP="${TP:-1,2,4}"; STEPS="${STEPS:-10}"; PYTHON="${PYTHON:-python3}"
bonfire="${CARGO_TARGET_DIR:-target}/release/bonfire"
if [ ! -x "$bonfire" ]; then
    echo "error: $bonfire is missing: build it with cargo build --release -p bonfire-cli" >&2
    exit 1
fi
args=(--tp "$TP" --steps "$STEPS" "$@")
echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
"$bonfire" bench tp "${args[@]}"
echo
"$PYTHON" benches/tp_gpt_torch.py "${args[@]}"
