#!/usr/bin/env bash
# Step-time overhead of DataParallel<Flex> at world size 1 against plain Flex (both under Autodiff),
# alternating the two binaries ROUNDS times and reporting the median of their per-run medians.
set -euo pipefail
cd "$(dirname "$0")"
ROUNDS="${ROUNDS:-7}"; STEPS="${STEPS:-300}"; BATCH="${BATCH:-32}"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-1}"
cargo build -q --release --target-dir target/plain
cargo build -q --release --target-dir target/dp --features dp
plain=(); dp=()
for _ in $(seq "$ROUNDS"); do
    plain+=("$(target/plain/release/dp-overhead-bench "$STEPS" "$BATCH" | awk '{print $2}')")
    dp+=("$(target/dp/release/dp-overhead-bench "$STEPS" "$BATCH" | awk '{print $2}')")
done
python3 - "${plain[*]}" "${dp[*]}" <<'PY'
import statistics, sys
p = [float(x) for x in sys.argv[1].split()]; d = [float(x) for x in sys.argv[2].split()]
mp, md = statistics.median(p), statistics.median(d)
print(f"plain Autodiff<Flex>:              median step {mp:.3f} ms  (runs {p})")
print(f"Autodiff<DataParallel<Flex>> ws=1: median step {md:.3f} ms  (runs {d})")
print(f"overhead: {100 * (md / mp - 1):+.2f}%")
PY
