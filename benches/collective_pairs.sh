#!/usr/bin/env bash
# Two builds of bonfire, and gloo, side by side: one all-reduce size per line, the builds
# alternating round by round so that a noisy neighbour hits both alike.
#
#   bash benches/collective_pairs.sh OLD_BONFIRE NEW_BONFIRE [TRANSPORT] [SIZES] [ROUNDS] [ITERS]
#
# TRANSPORT: shm (default), quic, inproc or auto; SIZES as `bonfire bench collectives --sizes`
# (default 1K,16K); ROUNDS (default 3); ITERS (default: the bench's own rule). Where `python3`
# has torch, each round also runs benches/gloo_allreduce.py with the same sizes and iterations.
# Prints `round build size time_us busbw_GBps`.
set -euo pipefail
old=${1:?usage: collective_pairs.sh OLD_BONFIRE NEW_BONFIRE [TRANSPORT] [SIZES] [ROUNDS] [ITERS]}
new=${2:?usage: collective_pairs.sh OLD_BONFIRE NEW_BONFIRE [TRANSPORT] [SIZES] [ROUNDS] [ITERS]}
transport=${3:-shm}
sizes=${4:-1K,16K}
rounds=${5:-3}
iters=${6:-}
here=$(cd "$(dirname "$0")" && pwd)
iter_flag=()
if [ -n "$iters" ]; then iter_flag=(--iters "$iters"); fi
gloo=0
if python3 -c 'import torch' 2>/dev/null; then gloo=1; fi

# The tables' rows: bonfire's are size, count, algorithm, iters, time(us), algbw, busbw, ...;
# gloo's have no algorithm column.
rows() {
    awk -v r="$1" -v b="$2" '!/^#/ && NF >= 7 {
        t = (b == "gloo") ? $5 : $6; w = (b == "gloo") ? $7 : $8
        printf "%s %s %s%s %s %s\n", r, b, $1, $2, t, w }'
}

echo "round build size time_us busbw_GBps"
for r in $(seq 1 "$rounds"); do
    for side in old new; do
        bin=$old
        if [ "$side" = new ]; then bin=$new; fi
        "$bin" bench collectives --transport "$transport" --nproc 2 --sizes "$sizes" \
            "${iter_flag[@]}" 2>/dev/null | rows "$r" "$side"
    done
    if [ "$gloo" = 1 ]; then
        python3 "$here/gloo_allreduce.py" --nproc 2 --sizes "$sizes" "${iter_flag[@]}" 2>/dev/null |
            rows "$r" gloo
    fi
done
