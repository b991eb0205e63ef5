#!/usr/bin/env bash
# bonfire's all-reduce against PyTorch gloo's between two "hosts": two network namespaces joined by
# one veth pair (10.74.0.1 and 10.74.0.2), one rank in each, so every byte crosses the link as it
# would between machines (QUIC for bonfire, TCP for gloo), not shared memory. Rounds alternate
# the two, the same sizes and iteration counts on both sides. Needs root and `ip`; gloo needs torch.
#
#   bash benches/two_hosts.sh [BONFIRE_BINARY]     (SIZES=4K,64K,1M,16M,64M ROUNDS=2 ITERS=...)
set -euo pipefail
cd "$(dirname "$0")/.."
bonfire="$(realpath "${1:-${CARGO_TARGET_DIR:-target}/release/bonfire}")"
sizes="${SIZES:-4K,64K,1M,16M,64M}"
rounds="${ROUNDS:-2}"
iters=()
[ -n "${ITERS:-}" ] && iters=(--iters "$ITERS")
a=bfbench-a
b=bfbench-b
cleanup() {
    ip netns del "$a" 2>/dev/null || true
    ip netns del "$b" 2>/dev/null || true
}
trap cleanup EXIT
cleanup
ip netns add "$a"
ip netns add "$b"
ip link add bfbench-va type veth peer name bfbench-vb
ip link set bfbench-va netns "$a"
ip link set bfbench-vb netns "$b"
ip -n "$a" addr add 10.74.0.1/24 dev bfbench-va
ip -n "$b" addr add 10.74.0.2/24 dev bfbench-vb
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set bfbench-va up
ip -n "$b" link set bfbench-vb up
secret="$(mktemp)"
head -c 32 /dev/urandom | base64 > "$secret"
out="$(mktemp -d)"
echo "# $(nproc) cores; bonfire: $bonfire"
for round in $(seq "$rounds"); do
    port=$((29700 + 2 * round))
    echo "== round $round: bonfire, QUIC across the link"
    timeout 900 ip netns exec "$b" "$bonfire" launch --nnodes 2 --node-rank 1 --nproc-per-node 1 \
        --master-addr "10.74.0.1:$port" --secret-file "$secret" -- \
        "$bonfire" bench collectives --transport quic --sizes "$sizes" "${iters[@]}" \
        > "$out/b.log" 2>&1 &
    timeout 900 ip netns exec "$a" "$bonfire" launch --nnodes 2 --node-rank 0 --nproc-per-node 1 \
        --master-addr "10.74.0.1:$port" --secret-file "$secret" -- \
        "$bonfire" bench collectives --transport quic --sizes "$sizes" "${iters[@]}"
    wait || { cat "$out/b.log"; exit 1; }
    if python3 -c "import torch" 2>/dev/null; then
        echo "== round $round: PyTorch gloo, TCP across the link"
        # gloo takes its interface from the host name (127.0.0.1 here) unless told.
        timeout 900 ip netns exec "$b" env GLOO_SOCKET_IFNAME=bfbench-vb python3 benches/gloo_allreduce.py --master "10.74.0.1:$((port + 1))" \
            --rank 1 --world 2 --sizes "$sizes" "${iters[@]}" > "$out/g.log" 2>&1 &
        timeout 900 ip netns exec "$a" env GLOO_SOCKET_IFNAME=bfbench-va python3 benches/gloo_allreduce.py --master "10.74.0.1:$((port + 1))" \
            --rank 0 --world 2 --sizes "$sizes" "${iters[@]}"
        wait || { cat "$out/g.log"; exit 1; }
    else
        echo "# skipped gloo: PyTorch is not installed (pip install torch)"
    fi
done
rm -rf "$out" "$secret"
