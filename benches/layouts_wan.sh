#!/usr/bin/env bash
# The bundled GPT split three ways over 2 ranks, side by side: data parallel (`--dp 2`, each rank
# half of each step's sequences, the gradients all-reduced), tensor parallel (`--dp 1 --tp 2`,
# each layer split, activations all-reduced inside forward and backward) and pipeline parallel
# (`--dp 1 --pp 2`, the blocks in two stages, one activation and its gradient per micro-batch
# between them). Every layout trains the same model with the same global batch per step (BATCH
# sequences, default 32, of 64 characters; the pipeline cuts it into MICRO micro-batches, default
# 4), the same STEPS (default 20) and seed. With WAN set, the two ranks are two "sites" joined by
# a slow link (`bonfire bench wan`, one rank per site; needs root), WAN holding its flags;
# without it, both on this host. ROUNDS (default 1) repeats the three in rotation.
#
# Prints, per run: the wall time, the steady rate (the report's rate after the first 10 batches:
# steps for dp and tp, micro-batches for pp, whose window so starts within its first steps),
# the first and last step's loss line, what the layout communicated (the report's data-parallel,
# tensor-parallel or pipeline line) and, across the link, what crossed it each way.
#
#   bash benches/layouts_wan.sh                                          # one host
#   WAN="--rtt-ms 20 --loss-percent 0 --mbit 100" bash benches/layouts_wan.sh
#   LAYOUTS="pp dp" ROUNDS=2 STEPS=40 WAN="..." BIN=/path/to/bonfire bash benches/layouts_wan.sh
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
bin="${BIN:-$target/release/bonfire}"
steps="${STEPS:-20}"
batch="${BATCH:-32}"
micro="${MICRO:-4}"
if [ ! -x "$bin" ]; then
    echo "no bonfire binary at $bin: build it with cargo build --release -p bonfire-cli" >&2
    exit 2
fi
if [ $((batch % 2)) -ne 0 ] || [ $((batch % micro)) -ne 0 ]; then
    echo "layouts_wan.sh: BATCH=$batch must be even and a multiple of MICRO=$micro" >&2
    exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Evaluation and samples off: every step is a training step, timed alike in the three layouts.
common=(train gpt --dataset embedded --steps "$steps" --eval-every 1000000 --sample-chars 0)
layout_args() { # layout -> its flags, each with BATCH sequences per optimizer step
    case "$1" in
    dp) echo "--dp 2 --tp 1 --pp 1 --batch $((batch / 2))" ;;
    tp) echo "--dp 1 --tp 2 --pp 1 --batch $batch" ;;
    pp) echo "--dp 1 --tp 1 --pp 2 --batch $((batch / micro)) --micro-batches $micro" ;;
    *)
        echo "layouts_wan.sh: layout $1 is not dp, tp or pp" >&2
        exit 2
        ;;
    esac
}
where="one host"
[ -n "${WAN:-}" ] && where="two sites: $WAN"
echo "# $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u +%FT%TZ) ${common[*]:2} batch $batch per step, pp micro-batches $micro ($where)"
for ((r = 1; r <= ${ROUNDS:-1}; r++)); do
    # shellcheck disable=SC2086 # the list splits on spaces
    for l in ${LAYOUTS:-dp tp pp}; do
        # shellcheck disable=SC2207 # the flags split on spaces
        flags=($(layout_args "$l"))
        if [ -n "${WAN:-}" ]; then
            # Under a launcher the ranks learn the mesh from the environment, as `bonfire
            # train` would set it.
            tp=1 pp=1
            [ "$l" = tp ] && tp=2
            [ "$l" = pp ] && pp=2
            # shellcheck disable=SC2206 # WAN's flags split on spaces, as written
            run=(env BONFIRE_TP=$tp BONFIRE_PP=$pp "$bin" bench wan ${WAN} --nproc-per-site 1 -- "$bin")
        else
            run=("$bin")
        fi
        t0=$(date +%s.%N)
        raw="$("${run[@]}" "${common[@]}" "${flags[@]}" --checkpoint-dir "$work/$l-$r" 2>&1)" || {
            echo "$raw" >&2
            exit 1
        }
        t1=$(date +%s.%N)
        # Under a launcher every line is prefixed "[rank N] " (N padded): the report is rank 0's,
        # the pipeline's last stage's line rank 1's.
        out="$(echo "$raw" | sed -e 's/^\[rank *[0-9]*\] //')"
        printf '%s round %d (%s): wall %.1f s\n' "$l" "$r" "${flags[*]}" \
            "$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')"
        echo "$out" | grep -E '^(throughput|step split|data parallel|tensor parallel|pipeline stage|weights digest)' |
            sed 's/^/    /' || true
        echo "$out" | grep -E '^bonfire bench wan: site [AB] -> ' | sed 's/^bonfire bench wan: /    link: /' || true
    done
done
