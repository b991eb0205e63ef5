#!/usr/bin/env bash
# What the vision job's evaluation costs in memory under ZeRO-3 (`--zero 3`). A ResNet of width
# WIDTH trains for STEPS steps of one image per rank at RANKS ranks and is evaluated once. When
# rank 0 notes its last step, the script resets every rank's peak resident memory (writing 5 to
# /proc/PID/clear_refs, Linux's reset of VmHWM), so the peak each rank's report gives then (its
# `model state` line) covers the evaluation and the checkpoint that follow, not the start (where
# every rank builds the whole model and takes rank 0's) or the training steps, which would hide
# it.
# Runs: DDP (each rank holds the whole model and Adam's state), ZeRO-3 with BIN and, when BASE
# names another build, ZeRO-3 with that one; ROUNDS rounds, the runs alternating. Each line: the
# run, each rank's peak in MiB after the reset, the seconds from the last step's note to the end
# of the run (the evaluation, the checkpoint, the report), the model state per rank, the test
# loss and accuracy, and the weights digest (the same for every run: ZeRO changes no bit at 2
# ranks).
#
# First, a check of the evaluation's arithmetic on shards of unequal batch counts: with
# --test-limit 1001 at 2 ranks, rank 0 evaluates 2 batches of up to 500 images and rank 1 one, so
# under ZeRO-3 rank 1 runs a forward it does not count; the test results must equal DDP's.
#
# BIN runs another build of bonfire (then nothing is built).
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS="${RANKS:-2}"; WIDTH="${WIDTH:-256}"; STEPS="${STEPS:-8}"; ROUNDS="${ROUNDS:-2}"
export RAYON_NUM_THREADS=1
target="${CARGO_TARGET_DIR:-target}/release"
if [ -z "${BIN:-}" ]; then
    cargo build -q --release -p bonfire-cli
fi
bin="${BIN:-$target/bonfire}"
data="${BONFIRE_DATA_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/bonfire/datasets}"
if [ ! -f "$data/mnist/t10k-images-idx3-ubyte" ]; then
    echo "zero3_eval_memory.sh: no MNIST in $data/mnist: fetch it first (bonfire train vision --dataset mnist --epochs 1 --train-limit 64)" >&2
    exit 2
fi
scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
vision() { # BINARY ARGS... -> "peaks-MiB tail-s state-MiB test-loss test-accuracy digest"
    local b="$1" log="$scratch/log-$RANDOM"
    shift
    python3 - "$log" "$b" train vision --dataset mnist --ranks "$RANKS" --epochs 1 \
        --checkpoint-dir "$scratch/run-$RANDOM" "$@" <<'PY' || { tail -5 "$log" >&2; exit 1; }
import json, os, subprocess, sys, time
log, cmd = sys.argv[1], sys.argv[2:]
run = cmd[cmd.index("--checkpoint-dir") + 1]
job = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
def descendants(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for c in out for d in [int(c)] + descendants(int(c))]
reset = False
while job.poll() is None:
    try:
        p = json.load(open(os.path.join(run, "progress.json")))
        reset = p["step"] == p["steps"]
    except (OSError, ValueError, KeyError):
        pass
    if reset:
        noted = time.monotonic()
        for pid in descendants(job.pid):
            try:
                open(f"/proc/{pid}/clear_refs", "w").write("5")
            except OSError:
                pass
        break
    time.sleep(0.005)
if not reset:
    sys.exit("the last step was not seen before the run ended: raise STEPS")
code = job.wait()
open(log + ".tail", "w").write(f"{time.monotonic() - noted:.2f}")
sys.exit(code)
PY
    local peaks state loss acc digest
    peaks=$(grep "^model state" "$log" | sed -E 's/.*by rank (.*) MiB$/\1/; s/ //g')
    state=$(grep "^model state" "$log" | sed -E 's/.*\): ([0-9.]+) MiB;.*/\1/')
    loss=$(grep "^epoch 1/1:" "$log" | sed -E 's/.*test loss ([0-9.]+),.*/\1/')
    acc=$(grep "^epoch 1/1:" "$log" | sed -E 's/.*test accuracy ([0-9.]+)%.*/\1/')
    digest=$(grep "^weights digest" "$log" | awk '{print substr($3, 1, 12)}')
    [ -n "$loss" ] && [ -n "$digest" ] || { echo "zero3_eval_memory.sh: no result in $log" >&2; exit 1; }
    echo "$peaks $(cat "$log.tail") $state $loss $acc $digest"
}
uneven=(--width 8 --batch 16 --train-limit 512 --test-limit 1001)
# At 2 ranks whatever RANKS says: 1,001 images over 2 ranks is what makes the counts unequal.
ddp=$(RANKS=2 vision "$bin" "${uneven[@]}"); zero=$(RANKS=2 vision "$bin" "${uneven[@]}" --zero 3)
echo "uneven batches (--test-limit 1001): ddp $(cut -d' ' -f4-5 <<< "$ddp"), zero3 $(cut -d' ' -f4-5 <<< "$zero")"
[ "$(cut -d' ' -f4-6 <<< "$ddp")" = "$(cut -d' ' -f4-6 <<< "$zero")" ] ||
    { echo "zero3_eval_memory.sh: ZeRO-3's test results differ from DDP's" >&2; exit 1; }
args=(--width "$WIDTH" --batch 1 --train-limit $((STEPS * RANKS)) --test-limit $((2 * RANKS)))
echo "round run peak-MiB-by-rank after-last-step-s state-MiB-per-rank test-loss test-accuracy digest"
# Each run's line is read from a command substitution first, so that a failed run stops the
# script.
for r in $(seq "$ROUNDS"); do
    out=$(vision "$bin" "${args[@]}"); echo "$r ddp $out"
    if [ -n "${BASE:-}" ]; then
        out=$(vision "$BASE" "${args[@]}" --zero 3); echo "$r zero3-base $out"
    fi
    out=$(vision "$bin" "${args[@]}" --zero 3); echo "$r zero3 $out"
done
