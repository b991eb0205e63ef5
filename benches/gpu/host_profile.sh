#!/usr/bin/env bash
# Where the host's time goes in a warm training step on the GPU machine (which has no `perf`):
# each part (PARTS, default "vision64 gpt") runs once as measured (its steady rate), then once
# longer with bonfire's own sampler (`BONFIRE_HOST_PROFILE`, a build with
# `CLI_FEATURES="fusion host-profile"`; HOST_IMAGES, default 51200, a whole number of batches:
# a last, smaller batch would be new shapes to tune), started HOST_AFTER seconds in (default 10:
# past the loading of the cached kernels) so that the window is steady steps;
# benches/gpu/host_profile.py sums the rank process's samples per thread and function into
# $OUT/summary.txt, and the folded stacks, the runs' logs and the kernel cache (kernels.tar.xz.NN)
# come back in $OUT. Runs from the repository root with $GPU_DIR (default .gpu-hp) holding
# `bonfire.xz`, the MNIST package's tarball and a kernel cache (`kernels.tar.xz.*`, from
# benches/gpu/tuned.sh: without it the first run tunes for minutes). Stops by DEADLINE seconds
# (default 300).
set -uo pipefail
cd "$(dirname "$0")/../.."
dir="${GPU_DIR:-.gpu-hp}"
out="${OUT:-gpu-out}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=/tmp/host-profile-logs
ck=/tmp/host-profile-checkpoints
rm -rf "$logs" "$ck"
mkdir -p "$logs" "$ck"
start=$(date +%s)
deadline=$((start + ${DEADLINE:-300}))
# shellcheck source=benches/gpu/machine.sh
source benches/gpu/machine.sh
gpu_machine "$dir"
zcat datasets/embedded/shakespeare-head.txt.gz >/tmp/shakespeare-head.txt
kernel_cache_in "$dir" || echo "host_profile.sh: no kernel cache in $dir: the first runs tune" >&2
say() { printf '[+%3ds] %s\n' $(($(date +%s) - start)) "$*" | tee -a "$out/summary.txt"; }
left() { # seconds: the smaller of $1 and what remains before the deadline, at least 1
    local l=$((deadline - $(date +%s)))
    ((l < 1)) && l=1
    ((l < $1)) && echo "$l" || echo "$1"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$out/summary.txt"
show="(throughput|step split|error|panick|host profile)"
job() { # part, measured|profiled -> the job's command line
    local b=${1#vision}
    case $1:$2 in
    vision*:measured) echo "train vision --backend cuda --ranks 1 --batch $b --epochs 1 --train-limit $((200 * b)) --test-limit 1024" ;;
    vision*:profiled) echo "train vision --backend cuda --ranks 1 --batch $b --epochs 1 --train-limit ${HOST_IMAGES:-51200} --test-limit 1024" ;;
    gpt:measured) echo "train gpt --backend cuda --dp 1 --steps 60 --eval-every 100000 --sample-chars 0" ;;
    gpt:profiled) echo "train gpt --backend cuda --dp 1 --steps ${HOST_GPT_STEPS:-900} --eval-every 100000 --sample-chars 0" ;;
    esac
}
for p in ${PARTS:-vision64 gpt}; do
    for how in measured profiled; do
        env=()
        # _ALL=1: samples in libc too (malloc, free, locks), as BENCHMARKS.md's profiles were
        # taken; the timeout bounds a run the sampler might hold.
        [ "$how" = profiled ] && env=(BONFIRE_HOST_PROFILE="$out/$p" BONFIRE_HOST_PROFILE_AFTER="${HOST_AFTER:-10}"
            BONFIRE_HOST_PROFILE_ALL=1)
        t0=$(date +%s)
        # shellcheck disable=SC2046
        env ${env[@]+"${env[@]}"} timeout "$(left 150)" "$bin/bonfire" $(job "$p" "$how") \
            --checkpoint-dir "$ck/$p-$how" >"$logs/$p-$how.log" 2>&1
        say "$p: $how run rc=$? in $(($(date +%s) - t0)) s"
        grep -E "$show" "$logs/$p-$how.log" | sed "s/^/  $p $how: /" | tee -a "$out/summary.txt"
    done
    # The rank process's file is the one with the most samples (the launcher's waits).
    f=$(ls -S "$out/$p".*.folded 2>/dev/null | head -1)
    [ -n "$f" ] && python3 benches/gpu/host_profile.py "$f" --threads 4 --top 25 \
        --match cudarc --match cuLaunchKernel --match memory_management --match autotune \
        --match burn_fusion --match burn_autodiff 2>&1 | sed "s/^/  $p: /" | tee -a "$out/summary.txt"
done
cp "$logs"/*.log "$out/"
say "done"
# The cache comes back for the next lease's $GPU_DIR (this script's runs may have tuned).
kernel_cache_out "$out"
