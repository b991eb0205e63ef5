#!/usr/bin/env bash
# Where a bonfire built with Burn's `fusion` and `autotune` spends its first steps on a GPU, and
# what it trains at once CubeCL's caches are warm (BENCHMARKS.md, "Burn's fusion and autotune on
# CUDA"). Runs on the GPU machine, from the repository root, with two builds in $GPU_DIR (default
# .gpu-probe): `bonfire.xz` (the workspace's plain `CubeBackend<CudaRuntime>`) and
# `bonfire-fused.xz` (bonfire-jobs' burn-cuda with `fusion` and `autotune`), plus the MNIST
# package's tarball. Logs go to $OUT (default ./gpu-out).
#
# Each fused run gets a cubecl.toml (in a directory of its own, the one it runs in) that logs
# every kernel compilation and every autotune verdict to stderr, which this script stamps with
# the seconds since the run began; a sampler beside it records the GPU's utilisation and the
# process's CPU time every 2 s. The autotune results and the compiled PTX are cached under
# /tmp/cubecl-cache, so the first fused run pays for both and the later ones pay for neither.
# Everything stops by DEADLINE seconds (default 540) after the script starts. PARTS picks what
# runs (default "vision64 gpt vision256 ranks2"); FUSED_ONLY=1 leaves out PyTorch and the plain
# build; CUBECL_AUTOTUNE_LEVEL (minimal, balanced, extensive, full) reaches CubeCL as it is.
set -uo pipefail
cd "$(dirname "$0")/../.."
dir="${GPU_DIR:-.gpu-probe}"
out="${OUT:-gpu-out}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$(date +%s)
deadline=$((start + ${DEADLINE:-540}))
# shellcheck source=benches/gpu/machine.sh
source benches/gpu/machine.sh
gpu_machine "$dir"
zcat datasets/embedded/shakespeare-head.txt.gz >/tmp/shakespeare-head.txt

step() { printf '\n==> [%s +%ds] %s\n' "$(date +%T)" $(($(date +%s) - start)) "$*" | tee -a "$out/summary.txt"; }
left() { # seconds: the smaller of $1 and what the deadline leaves, at least 1 (`timeout 0` never ends)
    local l=$((deadline - $(date +%s)))
    ((l < 1)) && l=1
    ((l < $1)) && echo "$l" || echo "$1"
}
want() { [[ " ${PARTS:-vision64 gpt vision256 ranks2} " == *" $1 "* ]]; }
peers() { [ "${FUSED_ONLY:-0}" != 1 ]; }
show="(throughput|step split|data parallel|error|panick|epoch 1/1 \[)"

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$out/summary.txt"
nproc | sed 's/^/cpus: /' | tee -a "$out/summary.txt"

cache=/tmp/cubecl-cache
mkdir -p "$cache"
# A cubecl.toml in the run's directory: kernels compiled and autotune verdicts to stderr, both
# caches in $cache.
cubecl_dir() { # name -> a directory holding the config
    local d="/tmp/cubecl-run-$1"
    mkdir -p "$d"
    cat >"$d/cubecl.toml" <<EOF
[compilation]
cache = { file = "$cache/ptx" }
[compilation.logger]
level = "basic"
stderr = true
[autotune]
cache = { file = "$cache/autotune" }
[autotune.logger]
level = "minimal"
stderr = true
EOF
    echo "$d"
}
# Stamps each line with the seconds since it started.
stamp() { python3 -u -c '
import sys, time
t0 = time.monotonic()
for line in sys.stdin:
    sys.stdout.write(f"{time.monotonic() - t0:8.2f} {line}")'; }
# name, seconds, command...: a fused run, stamped, with the sampler; prints a digest.
fused_run() {
    local name=$1 secs=$2
    shift 2
    local d
    d=$(cubecl_dir "$name")
    rm -rf "/tmp/ck-$name"
    (cd "$d" && exec timeout "$(left "$secs")" "$@" --checkpoint-dir "/tmp/ck-$name") 2>&1 | stamp >"$out/$name.log" &
    local pipe=$!
    sleep 1
    local pid
    pid=$(pgrep -n -f "bonfire-fused train" || true)
    (
        t0=$(date +%s.%N)
        while kill -0 "$pipe" 2>/dev/null; do
            util=$(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits 2>/dev/null | tr -d ' ')
            cpu=0
            for p in $(pgrep -f "bonfire-fused train"); do
                c=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)
                cpu=$((cpu + c))
            done
            printf '%8.2f gpu_util,mem=%s cpu_ticks=%s\n' "$(awk "BEGIN { print $(date +%s.%N) - $t0 }")" "$util" "$cpu"
            sleep 2
        done
    ) >"$out/$name.samples" 2>&1 &
    wait "$pipe"
    local compiled tuned
    compiled=$(grep -c "\[Compiling kernel\]" "$out/$name.log")
    tuned=$(grep -c "Fastest result" "$out/$name.log")
    echo "  kernels compiled: $compiled, autotune verdicts: $tuned, pid $pid" | tee -a "$out/summary.txt"
    grep -E "$show" "$out/$name.log" | tee -a "$out/summary.txt"
    tail -1 "$out/$name.log" | tee -a "$out/summary.txt"
}

vision() { # batch
    local batch=$1
    want "vision$batch" || return 0
    if peers; then
    step "PyTorch eager, the bundled ResNet, batch $batch"
    PYTHONUNBUFFERED=1 timeout "$(left 60)" python3 benches/ddp_mnist_style.py --model resnet --device cuda \
        --batch "$batch" --steps 200 2>&1 | tee -a "$out/peer.log" | tail -2 | tee -a "$out/summary.txt"
    step "plain bonfire train vision, batch $batch, 1 rank, 12,800 images"
    rm -rf /tmp/ck-plain
    timeout "$(left 60)" "$bin/bonfire" train vision --backend cuda --ranks 1 --batch "$batch" --epochs 1 \
        --train-limit 12800 --checkpoint-dir /tmp/ck-plain 2>&1 | tee "$out/plain-$batch.log" |
        grep -E "$show" | tee -a "$out/summary.txt"
    fi
    step "fused, batch $batch, cold caches (for this batch's shapes), 1,280 images"
    fused_run "fused-cold-$batch" 200 "$bin/bonfire-fused" train vision --backend cuda --ranks 1 --batch "$batch" \
        --epochs 1 --train-limit 1280
    step "fused, batch $batch, warm caches, 12,800 images"
    fused_run "fused-warm-$batch" 90 "$bin/bonfire-fused" train vision --backend cuda --ranks 1 --batch "$batch" \
        --epochs 1 --train-limit 12800
}

# In order of what matters most, since the deadline may cut the end: batch 64, the GPT, batch 256.
vision 64
if want gpt; then
if peers; then
step "PyTorch eager, the bundled GPT, batch 16, 1 rank"
PYTHONUNBUFFERED=1 timeout "$(left 60)" python3 benches/gpt_ddp_torch.py --device cuda --text /tmp/shakespeare-head.txt \
    --dp 1 --steps 60 2>&1 | tee -a "$out/peer.log" | tail -3 | tee -a "$out/summary.txt"
step "plain bonfire train gpt, 1 rank, 60 steps"
rm -rf /tmp/ck-gpt-plain
timeout "$(left 60)" "$bin/bonfire" train gpt --backend cuda --dp 1 --steps 60 --eval-every 100000 \
    --checkpoint-dir /tmp/ck-gpt-plain 2>&1 | tee "$out/plain-gpt.log" | grep -E "$show" | tee -a "$out/summary.txt"
fi
for run in cold warm; do
    step "fused bonfire train gpt, 1 rank, 60 steps, $run caches"
    fused_run "fused-gpt-$run" 150 "$bin/bonfire-fused" train gpt --backend cuda --dp 1 --steps 60 --eval-every 100000
done
fi
vision 256
if want ranks2; then
step "fused, batch 64, 2 ranks, warm caches"
fused_run "fused-warm-64-2ranks" 90 "$bin/bonfire-fused" train vision --backend cuda --ranks 2 --batch 64 \
    --epochs 1 --train-limit 12800
fi
step "done"
du -sh "$cache"/* 2>/dev/null | tee -a "$out/summary.txt"
