#!/usr/bin/env bash
# Whether a warm training step of the fused build waits on the GPU or on the host (BENCHMARKS.md,
# "Burn's fusion and autotune on CUDA"). Runs on the GPU machine from the repository root, with
# $GPU_DIR (default .gpu-fused) holding `bonfire.xz` (`CLI_FEATURES=fusion`), the MNIST package's
# tarball and the kernel cache an earlier benches/gpu/tuned.sh brought back (kernels.tar.xz.*),
# so nothing is tuned here. For each part (PARTS, default "vision64 gpt vision256"), the job, warm,
# 200 batches, with benches/gpu/sampler.py beside it every 0.1 s: the GPU's utilisation and each
# thread's CPU time, the launcher's rank process included (CubeCL's device-server threads are
# named DSD-* for the compute server, DSU-* for the stage before it). Logs and the summary go to
# $OUT (default ./gpu-out); everything stops by DEADLINE seconds (default 200).
set -uo pipefail
cd "$(dirname "$0")/../.."
dir="${GPU_DIR:-.gpu-fused}"
out="${OUT:-gpu-out}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$(date +%s)
deadline=$((start + ${DEADLINE:-200}))
# shellcheck source=benches/gpu/machine.sh
source benches/gpu/machine.sh
gpu_machine "$dir"
if ! kernel_cache_in "$dir"; then
    echo "host_bound.sh: no kernel cache in $dir (kernels.tar.xz.*): run benches/gpu/tuned.sh first, or the runs below tune" >&2
    exit 2
fi
say() { printf '[+%3ds] %s\n' $(($(date +%s) - start)) "$*" | tee -a "$out/summary.txt"; }
left() {
    local l=$((deadline - $(date +%s)))
    ((l < 1)) && l=1
    ((l < $1)) && echo "$l" || echo "$1"
}
say "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
want() { [[ " ${PARTS:-vision64 gpt vision256} " == *" $1 "* ]]; }
job() { # part, batches -> the job's command line
    case $1 in
    vision*) echo "train vision --backend cuda --ranks 1 --batch ${1#vision} --epochs 1 --train-limit $(($2 * ${1#vision})) --test-limit 256" ;;
    gpt) echo "train gpt --backend cuda --dp 1 --steps $2 --eval-every 100000 --sample-chars 0" ;;
    esac
}
show="(throughput|step split|error|panick)"
for p in vision64 gpt vision256; do
    want "$p" || continue
    # shellcheck disable=SC2046
    timeout "$(left 60)" "$bin/bonfire" $(job "$p" 200) --checkpoint-dir "/tmp/ck-$p" >"$out/$p-warm.log" 2>&1 &
    run=$!
    sleep 0.3
    python3 benches/gpu/sampler.py "$run" "$out/$p-samples.txt" --every 0.1 &
    wait "$run"
    say "$p: warm run rc=$?"
    wait
    grep -E "$show" "$out/$p-warm.log" | sed "s/^/  $p: /" | tee -a "$out/summary.txt"
    sed "s/^/  $p: /" "$out/$p-samples.txt" | tee -a "$out/summary.txt"
done
say done
# Everything but the summary in one archive (what comes back from the machine is a few files).
cd "$out" || exit 1
files=()
for f in *; do [[ $f == summary.txt || $f == logs.tar.gz ]] || files+=("$f"); done
((${#files[@]})) && tar czf logs.tar.gz "${files[@]}" && rm -f "${files[@]}"
