#!/usr/bin/env bash
# The jobs with Burn's fusion and autotune (bonfire-cli's `fusion` feature) on a GPU machine, warm,
# against PyTorch eager in the same lease (BENCHMARKS.md, "Burn's fusion and autotune on CUDA").
# Runs on the GPU machine, from the repository root, with $GPU_DIR (default .gpu-fused) holding
# `bonfire.xz` (`GPU_DIR=.gpu-fused CLI_FEATURES=fusion bash benches/gpu/build.sh`) and the MNIST
# package's tarball; logs and a summary go to $OUT (default ./gpu-out).
#
# 1. Tuning: one short run of each part (PARTS, default "vision64 gpt vision256") with the shapes
#    of its measured run, all at once (each tunes on a CPU core of its own; the GPU idles while
#    NVRTC compiles candidates), sharing one kernel cache ($BONFIRE_KERNEL_CACHE, which bonfire
#    gives CubeCL). A cache brought back from an earlier lease ($GPU_DIR/kernels.tar.xz.*) is
#    unpacked first, so tuning resumes where that lease stopped.
# 2. Measuring: as each part's tuning ends, its measured run, then PyTorch eager on the same model
#    and batch, one at a time (a lock keeps measured runs apart; parts still tuning go on beside
#    them, at a few percent of the GPU).
#    PROFILE=1 adds, for each part: a sampler beside the measured run (the GPU's utilisation and
#    each thread's CPU time, benches/gpu/sampler.py), then the same run again with CubeCL's kernel
#    profile (each kernel launched and awaited alone, so its time includes the launch), summarised
#    against the measured run's step by benches/gpu/kernel_profile.py (PROFILE_PARTS: only those).
#    With a second build in $GPU_DIR as `bonfire-alt.xz` (another commit's `bonfire.xz`, whose
#    kernels the carried cache already holds: it is not tuned here), each measured run is made by
#    both builds in turn, `bonfire` first, then the peer; ROUNDS (default 1) repeats that. The
#    vision parts train 200 batches each (IMAGES overrides), so their steady window is 190.
#    RANKS (default 1) runs each job with that many ranks, processes sharing the GPU (the vision
#    parts' 200 batches are then split between them), and the GPT's peer with as many.
# 3. The cache comes back in $OUT as kernels.tar.xz.NN (15 MiB pieces), for the next lease's
#    $GPU_DIR.
# Everything stops by DEADLINE seconds (default 500) after the script starts; the cache is packed
# in the last 40.
set -uo pipefail
cd "$(dirname "$0")/../.."
dir="${GPU_DIR:-.gpu-fused}"
out="${OUT:-gpu-out}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=/tmp/tuned-logs
ck=/tmp/tuned-checkpoints # each run's own, left by an earlier run of this script on the machine
rm -rf "$logs" "$ck"
mkdir -p "$logs" "$ck"
start=$(date +%s)
deadline=$((start + ${DEADLINE:-500}))
pack_at=$((deadline - 40))
# shellcheck source=benches/gpu/machine.sh
source benches/gpu/machine.sh
rm -f "$bin/bonfire-alt" # an earlier run's, on a machine used again: only $dir's is measured
gpu_machine "$dir"
zcat datasets/embedded/shakespeare-head.txt.gz >/tmp/shakespeare-head.txt

say() { printf '[+%3ds] %s\n' $(($(date +%s) - start)) "$*" | tee -a "$out/summary.txt"; }
left() { # seconds: the smaller of $1 and what remains before the cache is packed, at least 1
    local l=$((pack_at - $(date +%s)))
    ((l < 1)) && l=1
    ((l < $1)) && echo "$l" || echo "$1"
}
cache_stats() { # the cache's autotune verdicts and compiled kernels, counted by their index lines
    local v k
    v=$(find "$BONFIRE_KERNEL_CACHE" -path '*autotune*' -name '*.json.log' -exec cat {} + 2>/dev/null | wc -l)
    k=$(find "$BONFIRE_KERNEL_CACHE" -path '*ptx*' -name '*.json.log' -exec cat {} + 2>/dev/null | wc -l)
    echo "verdicts $v, kernels $k"
}
show="(throughput|step split|no autotune|error|panick)"

if kernel_cache_in "$dir"; then
    say "cache carried in: $(cache_stats)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$out/summary.txt"

want() { [[ " ${PARTS:-vision64 gpt vision256} " == *" $1 "* ]]; }
job() { # part, tune|warm -> the job's command line (BACKEND, default cuda; RANKS, default 1: ranks
    # as processes sharing the GPU; IMAGES, TUNE_IMAGES,
    # TEST_IMAGES and GPT_STEPS shrink the runs for a dry run of this script without a GPU)
    local b=${1#vision} be=${BACKEND:-cuda} ranks=${RANKS:-1}
    case $1:$2 in
    vision*:tune) echo "train vision --backend $be --ranks $ranks --batch $b --epochs 1 --train-limit ${TUNE_IMAGES:-1280} --test-limit ${TEST_IMAGES:-1024}" ;;
    vision*:warm) echo "train vision --backend $be --ranks $ranks --batch $b --epochs 1 --train-limit ${IMAGES:-$((200 * b))} --test-limit ${TEST_IMAGES:-1024}" ;;
    gpt:tune) echo "train gpt --backend $be --dp $ranks --steps 12 --eval-every 100000 --sample-chars 0" ;;
    gpt:warm) echo "train gpt --backend $be --dp $ranks --steps ${GPT_STEPS:-60} --eval-every 100000 --sample-chars 0" ;;
    esac
}
batches() { # part -> the batches its measured run trains (its evaluation's kernels count too)
    case $1 in
    vision*) echo $((${IMAGES:-$((200 * ${1#vision}))} / ${1#vision})) ;;
    gpt) echo "${GPT_STEPS:-60}" ;;
    esac
}
peer() { # part -> PyTorch eager on the same model and batch (the ResNet's script runs 1 and 2 ranks)
    local ranks=${RANKS:-1}
    case $1 in
    vision*) echo "benches/ddp_mnist_style.py --model resnet --device cuda --batch ${1#vision} --steps 200" ;;
    gpt) echo "benches/gpt_ddp_torch.py --device cuda --text /tmp/shakespeare-head.txt --dp $ranks --steps 60" ;;
    esac
}
profiled() { # part: PROFILE=1, and the part is in PROFILE_PARTS (default: every part)
    [ "${PROFILE:-0}" = 1 ] && [[ " ${PROFILE_PARTS:-$1} " == *" $1 "* ]]
}
builds=(bonfire)
[ -x "$bin/bonfire-alt" ] && builds+=(bonfire-alt)
warm() { # part, build, round: one measured run (PROFILE=1: a sampler beside each build's first)
    local p=$1 b=$2 r=$3 t0 run job_pid
    t0=$(date +%s)
    # shellcheck disable=SC2046
    timeout "$(left 120)" "$bin/$b" $(job "$p" warm) --checkpoint-dir "$ck/$p-$b-$r" \
        >"$logs/$p-$b-r$r.log" 2>&1 &
    run=$!
    gpu_memory_watch "$run" "$logs/$p-$b-r$r.mem" &
    if profiled "$p" && [ "$r" = 1 ]; then
        sleep 0.5
        job_pid=$(awk '{print $1}' "/proc/$run/task/$run/children" 2>/dev/null)
        [ -n "$job_pid" ] && python3 benches/gpu/sampler.py "$job_pid" "$logs/$p-$b-samples.txt" &
    fi
    wait "$run"
    say "$p: $b warm run, round $r, rc=$? in $(($(date +%s) - t0)) s ($(cache_stats))"
    wait # the sampler and the memory watch
    grep -E "$show" "$logs/$p-$b-r$r.log" | sed "s/^/  $p $b: /" | tee -a "$out/summary.txt"
    gpu_memory_said "$logs/$p-$b-r$r.mem" | sed "s/^/  $p $b: /" | tee -a "$out/summary.txt"
}
part() { # tune, then (one measured run at a time) measure warm and the peer
    local p=$1 t0 rc
    t0=$(date +%s)
    # shellcheck disable=SC2046
    timeout "$(left 600)" "$bin/bonfire" $(job "$p" tune) --checkpoint-dir "$ck/$p-tune" \
        >"$logs/$p-tune.log" 2>&1
    rc=$?
    say "$p: tuning run rc=$rc in $(($(date +%s) - t0)) s ($(cache_stats))"
    grep -E "$show" "$logs/$p-tune.log" | sed "s/^/  $p tune: /" | tee -a "$out/summary.txt"
    [ "$rc" = 0 ] || return 0
    (
        flock 9
        local r b
        for ((r = 1; r <= ${ROUNDS:-1}; r++)); do
            for b in "${builds[@]}"; do
                warm "$p" "$b" "$r"
            done
            # shellcheck disable=SC2046
            PYTHONUNBUFFERED=1 timeout "$(left 90)" python3 $(peer "$p") >"$logs/$p-peer-r$r.log" 2>&1 &
            local peer_pid=$! rc
            gpu_memory_watch "$peer_pid" "$logs/$p-peer-r$r.mem" &
            wait "$peer_pid"
            rc=$?
            wait
            say "$p: PyTorch eager, round $r, rc=$rc"
            tail -3 "$logs/$p-peer-r$r.log" | sed "s/^/  $p peer: /" | tee -a "$out/summary.txt"
            gpu_memory_said "$logs/$p-peer-r$r.mem" | sed "s/^/  $p peer: /" | tee -a "$out/summary.txt"
        done
        if profiled "$p"; then
            for b in "${builds[@]}"; do
                # The same run with CubeCL's kernel profile: every kernel awaited alone, one line each.
                t0=$(date +%s)
                # shellcheck disable=SC2046
                CUBECL_DEBUG_LOG="$logs/$p-$b-kernels.log" CUBECL_DEBUG_OPTION=profile \
                    timeout "$(left 120)" "$bin/$b" $(job "$p" warm) \
                    --checkpoint-dir "$ck/$p-$b-prof" >"$logs/$p-$b-prof.log" 2>&1
                say "$p: $b profiled run rc=$? in $(($(date +%s) - t0)) s"
                local samples=()
                [ -f "$logs/$p-$b-samples.txt" ] && samples=(--samples "$logs/$p-$b-samples.txt")
                python3 benches/gpu/kernel_profile.py "$logs/$p-$b-kernels.log" "$logs/$p-$b-r1.log" \
                    --batches "$(batches "$p")" "${samples[@]}" 2>&1 |
                    sed "s/^/  $p $b profile: /" | tee -a "$out/summary.txt"
            done
        fi
    ) 9>/tmp/tuned-measure.lock
}

say "tuning $(for p in vision64 gpt vision256; do want $p && printf '%s ' $p; done)($(cache_stats))"
pids=()
for p in vision64 gpt vision256; do
    want "$p" || continue
    part "$p" &
    pids+=($!)
done
# The cache grows while the parts tune: a line a minute.
next=$(($(date +%s) + 60))
while sleep 5; do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    if (($(date +%s) >= next)); then
        say "... $(cache_stats); GPU $(nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader)"
        next=$((next + 60))
    fi
done
wait
pkill -f "$bin/bonfire(-alt)? train" 2>/dev/null
say "done: $(cache_stats)"
kernel_cache_out "$out"
du -sh "$BONFIRE_KERNEL_CACHE" "$out"/kernels.tar.xz.* | tee -a "$out/summary.txt"
tar czf "$out/logs.tar.gz" -C "$logs" .
