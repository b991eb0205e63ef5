#!/usr/bin/env bash
# ZeRO-3 on the GPT job: `bonfire train gpt --dp RANKS` plain (DDP) and with --zero 3, and, when
# BASE names an older build of bonfire, that build's --zero 3 too; PyTorch DDP and FSDP2
# (`fully_shard`, resharded after forward) on the same GPT when PYTHON names an interpreter with
# torch. PAIRS rounds, the runs alternating. The GPT and the window are those of BENCHMARKS.md's
# GPT tables: 100 steps of 16 x 64 characters per rank, Adam, one compute thread per rank.
#
# Each bonfire line: chars/s after the first 10 batches, the ratio to the round's bonfire DDP,
# the gradient KiB per step its buckets held and the KiB this rank received back reduced (an
# all-reduce receives them all; --zero 3 reduce-scatters), what the parameter gathers cost rank 0
# while training, and the bytes the host's loopback interface carried during the run (with
# TRANSPORT=quic, the default here, every rank's frames cross it, so this is the job's traffic:
# gathers, gradients, evaluations; other processes' loopback traffic is in it too), and the
# weights digest. BIN runs another build of bonfire (then nothing is built).
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS="${RANKS:-2}"; STEPS="${STEPS:-100}"; PAIRS="${PAIRS:-2}"; TRANSPORT="${TRANSPORT:-quic}"
export RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 BONFIRE_TRANSPORT="$TRANSPORT"
target="${CARGO_TARGET_DIR:-target}/release"
if [ -z "${BIN:-}" ]; then
    cargo build -q --release -p bonfire-cli
fi
bin="${BIN:-$target/bonfire}"
data="${BONFIRE_DATA_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/bonfire/datasets}"
text="$data/shakespeare/shakespeare.txt"
lo=/sys/class/net/lo/statistics/tx_bytes
scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
gpt() { # BINARY [--zero 3] -> "chars/s KiB-per-step KiB-received gather-wait loopback-MiB digest"
    local b="$1"; shift
    local log="$scratch/log-$RANDOM" before after
    before=$(cat "$lo")
    "$b" train gpt --dp "$RANKS" --steps "$STEPS" --eval-every "$STEPS" --eval-windows 64 \
        --warmup 10 --checkpoint-dir "$scratch/run-$RANDOM" "$@" > "$log" 2>&1 ||
        { tail -5 "$log" >&2; exit 1; }
    after=$(cat "$lo")
    local rate kib received wait digest
    rate=$(grep "^throughput" "$log" | sed -nE 's/.* ([0-9]+) chars\/s after the first.*/\1/p')
    kib=$(grep "^data parallel" "$log" | sed -nE 's/.*; ([0-9]+) KiB of gradients.*/\1/p')
    received=$(grep "^data parallel" "$log" | sed -nE 's/.*reduce-scattered \(([0-9]+) KiB received\).*/\1/p')
    wait=$(grep "^fully sharded" "$log" | sed -nE 's/.*waited ([0-9.]+ s \([0-9]+%).*/\1)/p' | tr -d ' ')
    digest=$(grep "^weights digest" "$log" | awk '{print substr($3, 1, 12)}')
    [ -n "$rate" ] || { echo "zero3_gpt.sh: no steady rate in $log (STEPS over 10?)" >&2; exit 1; }
    echo "$rate ${kib:--} ${received:-${kib:--}} ${wait:--} $(((after - before) / 1048576)) $digest"
}
torch() { # [--fsdp2 zero3] -> chars/s
    "$PYTHON" benches/gpt_ddp_torch.py --text "$text" --dp "$RANKS" --steps "$STEPS" "$@" |
        awk '!/^#/ && NF > 2 {print $2}'
}
echo "round run chars/s vs-bonfire-ddp grad-KiB/step received-KiB/step gathers-waited loopback-MiB digest"
# Each run's line is read from a command substitution, so that a failed run stops the script.
for p in $(seq "$PAIRS"); do
    out=$(gpt "$bin"); read -r d dk dr dw dl dd <<< "$out"
    echo "$p bonfire-ddp $d 1.00 $dk $dr $dw $dl $dd"
    if [ -n "${BASE:-}" ]; then
        out=$(gpt "$BASE" --zero 3); read -r r k rc w l g <<< "$out"
        echo "$p base-zero3 $r $(awk -v a="$r" -v b="$d" 'BEGIN{printf "%.2f", a / b}') $k $rc $w $l $g"
    fi
    out=$(gpt "$bin" --zero 3); read -r r k rc w l g <<< "$out"
    echo "$p bonfire-zero3 $r $(awk -v a="$r" -v b="$d" 'BEGIN{printf "%.2f", a / b}') $k $rc $w $l $g"
    if [ -n "${PYTHON:-}" ]; then
        t=$(torch); f=$(torch --fsdp2 zero3)
        [ -n "$t" ] && [ -n "$f" ] || { echo "zero3_gpt.sh: the PyTorch peer gave no rate" >&2; exit 1; }
        echo "$p torch-ddp $t $(awk -v a="$t" -v b="$d" 'BEGIN{printf "%.2f", a / b}') - - - - -"
        echo "$p torch-fsdp2-zero3 $f $(awk -v a="$f" -v b="$d" 'BEGIN{printf "%.2f", a / b}') - - - - -"
    fi
done
