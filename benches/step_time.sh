#!/usr/bin/env bash
# The regression guard of the bundled jobs' speed: each job for a fixed number of steps at fixed
# settings, on each backend, printing throughput (and the steady rate after the first 10 batches)
# and where a step goes (input, forward, backward
# and its exposed communication, optimizer) as the jobs' reports measure them, with the commit.
# A drop (655 -> 465 images/s was one) shows here as a number; record the table in BENCHMARKS.md.
#
#   bash benches/step_time.sh                      # flex and ndarray, 1 and 2 ranks
#   BACKENDS="flex wgpu" RANKS=2 bash benches/step_time.sh
#   BIN=/path/to/other/bonfire bash benches/step_time.sh   # another build, same settings
#
# Settings (fixed so runs compare): vision on the embedded MNIST slice, 1,280 training images per
# rank at batch 64 (20 steps), width 8; gpt on the embedded plays, 30 steps of 16 x 64
# characters per rank, the default model. The first run of a backend pays its warm-up (wgpu
# compiles its kernels), so each (job, backend, ranks) runs WARM (default 1) untimed first.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
bin="${BIN:-$target/release/bonfire}"
backends="${BACKENDS:-flex ndarray}"
ranks_list="${RANKS:-1 2}"
warm="${WARM:-1}"
if [ ! -x "$bin" ]; then
    echo "no bonfire binary at $bin: build it with cargo build --release -p bonfire-cli" >&2
    exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

run() { # job backend ranks -> the report on stdout
    local job=$1 backend=$2 ranks=$3 dir="$work/$1-$2-$3-$RANDOM"
    case $job in
        vision)
            "$bin" train vision --dataset embedded --epochs 1 --train-limit $((1280 * ranks)) \
                --test-limit 200 --batch 64 --ranks "$ranks" --backend "$backend" \
                --checkpoint-dir "$dir" ;;
        gpt)
            "$bin" train gpt --dataset embedded --steps 30 --eval-every 30 --eval-windows 16 \
                --warmup 3 --dp "$ranks" --backend "$backend" --checkpoint-dir "$dir" ;;
    esac
}

commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "# bonfire step time: commit $commit, $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ), binary $bin"
printf '%-7s %-8s %5s %12s %12s %10s %10s %10s %10s %10s %10s\n' job backend ranks "items/s" \
    "steady/s" "input" "forward" "backward" "exposed" "optimizer" "step(ms)"
for job in vision gpt; do
    for backend in $backends; do
        for ranks in $ranks_list; do
            for _ in $(seq 1 "$warm"); do run "$job" "$backend" "$ranks" >/dev/null 2>&1 || true; done
            if ! out="$(run "$job" "$backend" "$ranks" 2>&1)"; then
                printf '%-7s %-8s %5s failed: %s\n' "$job" "$backend" "$ranks" \
                    "$(printf '%s\n' "$out" | grep -v '^\s*$' | tail -n 1)"
                continue
            fi
            printf '%s\n' "$out" | python3 -c '
import re, sys
job, backend, ranks = sys.argv[1:4]
text = sys.stdin.read()
rate = re.search(r"^throughput\s+(\d+)", text, re.M)
steady = re.search(r"^throughput .*; (\d+) \S+/s after the first", text, re.M)
split = re.search(r"^step split .*?input ([\d.]+) ms, forward ([\d.]+) ms, backward ([\d.]+) ms "
                  r"\(([\d.]+) ms of it exposed communication\), optimizer ([\d.]+) ms", text, re.M)
if not (rate and split):
    sys.exit(f"{job} {backend} {ranks}: no throughput or step split line in its report:\n{text[-2000:]}")
i, f, b, e, o = (float(x) for x in split.groups())
steady = steady.group(1) if steady else "-"
print(f"{job:<7} {backend:<8} {ranks:>5} {int(rate.group(1)):>12} {steady:>12} {i:>10.1f} {f:>10.1f} {b:>10.1f} {e:>10.1f} {o:>10.1f} {i + f + b + o:>10.1f}")
' "$job" "$backend" "$ranks"
        done
    done
done
echo "# items/s: images (vision) or characters (gpt) per second over all ranks; steady/s: the same after"
echo "# each run's first 10 batches (the warm-up a GPU spends compiling kernels); the split is rank 0's, ms per batch"
