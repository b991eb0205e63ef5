#!/usr/bin/env bash
# The GPU checks and figures of BENCHMARKS.md ("On a GPU"), in one go on a machine with an NVIDIA
# GPU, the CUDA driver and NVRTC. Takes the binaries that `benches/gpu/build.sh` made (built
# where Rust is; the GPU machine needs none) from $GPU_DIR (default .gpu), and writes logs to
# $OUT (default ./gpu-out).
#
#   bash benches/gpu/build.sh            # here: release binaries with --features cuda
#   bash benches/gpu/run.sh              # there: tests, kernel bench, training, the peer
#
# SECTIONS picks what runs (default: all of "tests lane nodes lanejobs fusion bench train peer"; KERNEL_TESTS=0
# leaves the CubeCL kernel tests out of "tests", LANE_BENCHES=0 the benches out of "lane"); BATCHES the per-rank
# batches of the training runs and their peer (default 64); EPOCHS the epochs (default 1).
set -uo pipefail
cd "$(dirname "$0")/../.."
dir="${GPU_DIR:-.gpu}"
out="${OUT:-gpu-out}"
sections="${SECTIONS:-tests lane nodes lanejobs fusion bench train peer}"
batches="${BATCHES:-64}"
mkdir -p "$out"
# shellcheck source=benches/gpu/machine.sh
source benches/gpu/machine.sh
gpu_machine "$dir"
export RUST_BACKTRACE=1
step() { printf '\n==> [%s] %s\n' "$(date +%T)" "$*" | tee -a "$out/summary.txt"; }
want() { [[ " $sections " == *" $1 "* ]]; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$out/summary.txt"

if want tests; then
    if [ "${KERNEL_TESTS:-1}" = 1 ]; then
        step "kernel tests on CUDA (every kernel against its plain Rust reference)"
        timeout 300 "$bin/kernels-tests" --test-threads 1 --nocapture cuda 2>&1 | tee "$out/kernels-tests.log" | tail -12 | tee -a "$out/summary.txt"
    fi
    step "DataParallel<Cuda>: device packing against the host path and one rank"
    timeout 240 "$bin/dp-gpu-tests" --test-threads 1 cuda 2>&1 | tee "$out/dp-gpu-tests.log" | tail -5 | tee -a "$out/summary.txt"
fi

if want lane; then
    step "device lane: every collective against the host reference, threads and processes (CUDA IPC), a rank killed"
    timeout 300 "$bin/lane-tests" --test-threads 1 2>&1 | tee "$out/lane-tests.log" | tail -8 | tee -a "$out/summary.txt"
    if [ "${LANE_BENCHES:-1}" = 1 ]; then
        for dtype in ${LANE_DTYPES:-f32 bf16}; do
            step "bonfire bench collectives --device cuda --dtype $dtype: 2 processes on one GPU"
            timeout 200 "$bin/bonfire" bench collectives --device cuda --nproc 2 --dtype "$dtype" \
                --sizes "${LANE_SIZES:-1K,64K,1M,16M,64M,256M,1G}" 2>&1 | tee -a "$out/lane-bench.log" | tee -a "$out/summary.txt"
        done
        step "the host lane, same ranks and sizes: bonfire bench collectives --transport shm"
        timeout 200 "$bin/bonfire" bench collectives --transport shm --nproc 2 \
            --sizes "${HOST_SIZES:-1K,64K,1M,16M,64M,256M}" 2>&1 | tee -a "$out/lane-bench.log" | tee -a "$out/summary.txt"
        step "the peer: PyTorch gloo all_reduce of CUDA tensors, 2 processes on one GPU"
        PYTHONUNBUFFERED=1 timeout 200 python3 benches/gloo_allreduce.py --device cuda --nproc 2 \
            --sizes "${HOST_SIZES:-1K,64K,1M,16M,64M,256M}" 2>&1 | tee -a "$out/lane-bench.log" | tee -a "$out/summary.txt"
        step "the peer: NCCL with 2 processes on one GPU"
        PYTHONUNBUFFERED=1 timeout 30 python3 benches/gloo_allreduce.py --device cuda --nproc 2 --backend nccl \
            --sizes 1M 2>&1 | tee -a "$out/lane-bench.log" | grep -iE "error|duplicate|invalid" | head -4 | tee -a "$out/summary.txt"
    fi
fi

if want nodes; then
    # Two nodes of two ranks on this one host: two launchers, each its own --node-rank, both at
    # 127.0.0.1, so the ranks of a node share memory and the nodes talk over QUIC as two hosts
    # would. The device lane then runs its hierarchical schedule: each node's lane
    # reduce-scatters and all-gathers on the GPU, and each rank's share alone crosses nodes.
    # The host lane (--transport auto, host buffers) is the baseline, same ranks and sizes.
    (umask 077; head -c 32 /dev/urandom | base64 >/tmp/nodes.secret)
    two_nodes() { # port, log, command...
        local port=$1 log=$2
        shift 2
        for node in 1 0; do
            mkdir -p "/tmp/node$node"
            (cd "/tmp/node$node" && timeout "${NODES_TIMEOUT:-200}" "$bin/bonfire" launch --nnodes 2 --node-rank $node \
                --nproc-per-node 2 --master-addr "127.0.0.1:$port" --secret-file /tmp/nodes.secret -- "$@" \
                >"$out/$log-node$node.log" 2>&1) &
        done
        wait
        grep -E "${SHOW:-.}" "$out/$log-node0.log" | tee -a "$out/summary.txt"
        grep -iE "error|panick" "$out/$log-node1.log" | head -5 | tee -a "$out/summary.txt"
    }
    step "bonfire bench collectives --device cuda across 2 nodes of 2 ranks (one GPU)"
    two_nodes 29611 nodes-lane "$bin/bonfire" bench collectives --device cuda --sizes "${NODES_SIZES:-1K,1M,16M,64M,256M}"
    step "the host lane, same ranks and sizes: bonfire bench collectives --transport auto across 2 nodes"
    two_nodes 29613 nodes-host "$bin/bonfire" bench collectives --transport auto --sizes "${NODES_SIZES:-1K,1M,16M,64M,256M}"
    step "the peer: PyTorch gloo all_reduce of CUDA tensors, 4 processes on one GPU (gloo has no notion of nodes)"
    PYTHONUNBUFFERED=1 timeout 90 python3 benches/gloo_allreduce.py --device cuda --nproc 4 \
        --sizes "${NODES_GLOO_SIZES:-1M,16M}" 2>&1 | tee -a "$out/nodes-gloo.log" | tee -a "$out/summary.txt"
    for lane in ${NODES_GPT_RUNS:-1 0 1 0}; do
        step "bonfire train gpt --backend cuda across 2 nodes of 2 ranks, BONFIRE_DEVICE_LANE=$lane"
        rm -rf /tmp/node0/gpt /tmp/node1/gpt
        SHOW="(data parallel|throughput|weights digest|gradients take|step split|exposed|error|panick)" BONFIRE_DEVICE_LANE=$lane two_nodes $((29620 + lane)) "gpt-nodes-$lane" "$bin/bonfire" train gpt --backend cuda \
            --steps "${NODES_GPT_STEPS:-30}" --eval-every 100000 --checkpoint-dir gpt
    done
fi

if want fusion; then
    # The jobs against PyTorch eager on the same models, same GPU, one lease; and against
    # `bonfire-alt`, another build of bonfire to compare, when one came along in $GPU_DIR (on
    # 2026-11-26: burn-cuda with its default `fusion` and `autotune`, which the workspace turns
    # off). The first run of each binary compiles its kernels, which its figures include.
    limit="${FUSION_TRAIN_LIMIT:-12800}"
    show="(throughput|step split|data parallel|error|panick)"
    for batch in ${FUSION_BATCHES:-64 256}; do
        step "the peer: PyTorch eager, the bundled ResNet, batch $batch, 1 and 2 ranks"
        PYTHONUNBUFFERED=1 timeout 90 python3 benches/ddp_mnist_style.py --model resnet --device cuda \
            --batch "$batch" --steps 200 2>&1 | tee -a "$out/fusion.log" | tee -a "$out/summary.txt"
        for run in bonfire:1 bonfire-alt:1 bonfire:2; do
            binary=${run%:*} ranks=${run#*:}
            [ -x "$bin/$binary" ] || continue
            step "$binary train vision --backend cuda --ranks $ranks --batch $batch --train-limit $limit"
            rm -rf "/tmp/fu-$binary-$ranks"
            timeout 90 "$bin/$binary" train vision --backend cuda --ranks "$ranks" --batch "$batch" --epochs 1 \
                --train-limit "$limit" --checkpoint-dir "/tmp/fu-$binary-$ranks" 2>&1 | tee -a "$out/fusion.log" |
                grep -E "$show" | tee -a "$out/summary.txt"
        done
    done
    zcat datasets/embedded/shakespeare-head.txt.gz >/tmp/shakespeare-head.txt
    step "the peer: PyTorch eager, the bundled GPT, batch 16, 1 and 2 ranks (the embedded text)"
    PYTHONUNBUFFERED=1 timeout 90 python3 benches/gpt_ddp_torch.py --device cuda --text /tmp/shakespeare-head.txt \
        --dp 1,2 --steps "${FUSION_GPT_STEPS:-60}" 2>&1 | tee -a "$out/fusion.log" | tee -a "$out/summary.txt"
    for run in bonfire:1 bonfire-alt:1 bonfire:2; do
        binary=${run%:*} ranks=${run#*:}
        [ -x "$bin/$binary" ] || continue
        step "$binary train gpt --backend cuda --dp $ranks"
        rm -rf "/tmp/fg-$binary-$ranks"
        timeout 90 "$bin/$binary" train gpt --backend cuda --dp "$ranks" --steps "${FUSION_GPT_STEPS:-60}" \
            --eval-every 100000 --checkpoint-dir "/tmp/fg-$binary-$ranks" 2>&1 | tee -a "$out/fusion.log" |
            grep -E "$show" | tee -a "$out/summary.txt"
    done
fi

if want bench; then
    step "bonfire bench kernels --runtime cuda"
    timeout 200 "$bin/bonfire" bench kernels --runtime cuda --sizes 1M,4M,25M,100M,400M \
        --vectors-per-unit "${VPU:-0,8,16}" --iters 50 2>&1 | tee "$out/bench-kernels.log" | tee -a "$out/summary.txt"
    step "device memory bandwidth through PyTorch (clone: read n + write n), the independent roofline"
    timeout 100 python3 - <<'PY' 2>&1 | tee -a "$out/summary.txt"
import torch
for mib in (1, 4, 25, 100, 400):
    n = mib * (1 << 20) // 4
    x = torch.rand(n, device="cuda")
    y = torch.empty_like(x)
    for _ in range(10):
        y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = max(5, min(200, (1 << 30) // (mib << 21)))
    s.record()
    for _ in range(iters):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    t = s.elapsed_time(e) / 1e3 / iters
    print(f"  torch copy {mib:>4} MiB: {t * 1e6:9.1f} us  {2 * n * 4 / t / 1e9:9.1f} GB/s")
PY
fi

if want lanejobs; then
    # The bundled jobs with 2 ranks on the GPU: buckets through the device lane against the host
    # lane (BONFIRE_DEVICE_LANE=0), alternating, twice each, after a warm-up run that compiles
    # the kernels; the weights digests say whether the runs agree bit for bit.
    for job in vision gpt; do
        for run in warm-up lane host lane-again host-again; do
            step "bonfire train $job --backend cuda, 2 ranks, $run"
            lane=1
            [[ "$run" == host* || "$run" == warm-up ]] && lane=0
            rm -rf "/tmp/$job-$run"
            case $job in
                vision) args=(train vision --backend cuda --ranks 2 --epochs 1 --train-limit "${LANE_TRAIN_LIMIT:-25600}") ;;
                gpt) args=(train gpt --backend cuda --dp 2 --steps "${LANE_GPT_STEPS:-40}" --eval-every 100000) ;;
            esac
            BONFIRE_DEVICE_LANE=$lane timeout "${LANE_JOB_TIMEOUT:-150}" "$bin/bonfire" "${args[@]}" \
                --checkpoint-dir "/tmp/$job-$run" 2>&1 | tee "$out/$job-$run.log" |
                grep -E "^(data parallel|throughput|weights digest)|gradients take|error" | tee -a "$out/summary.txt"
        done
    done
fi

for batch in $batches; do
    if want peer; then
        step "the peer: PyTorch on the same ResNet, batch $batch and GPU"
        PYTHONUNBUFFERED=1 timeout 120 python3 benches/ddp_mnist_style.py --model resnet --device cuda \
            --batch "$batch" --steps 300 2>&1 | tee -a "$out/peer.log" | tee -a "$out/summary.txt"
    fi
    if want train; then
        for ranks in 1 2; do
            step "bonfire train vision --backend cuda --ranks $ranks --batch $batch"
            rm -rf "/tmp/run-$ranks"
            timeout 200 "$bin/bonfire" train vision --backend cuda --ranks "$ranks" --batch "$batch" \
                --epochs "${EPOCHS:-1}" --checkpoint-dir "/tmp/run-$ranks" 2>&1 |
                tee -a "$out/train.log" | tail -9 | tee -a "$out/summary.txt"
        done
    fi
done
step "done"
