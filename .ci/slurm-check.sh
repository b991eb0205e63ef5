#!/usr/bin/env bash
# The book's two sbatch scripts (book/programs/slurm) on a real Slurm cluster of two nodes on
# this host (.ci/slurm-cluster.sh; SLURM_CONF must point at it): a four-rank job of the book's
# swap-in program, started by srun directly and by one `bonfire launch` per node, must print the
# same losses as the same job under `bonfire launch` on one host. A program or a launcher run in
# the batch script itself (no srun) must refuse, saying to use srun.
#
#   .ci/slurm-check.sh DIR_OF_BONFIRE PROGRAM
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$(cd "${1:?the folder of the bonfire binary}" && pwd):$PATH"
train="$(realpath "${2:?the program to train}")"
work="$(mktemp -d)"
scripts="$PWD/book/programs/slurm"

# Runs one batch job and waits for it, five minutes at most.
batch() {
    local name="$1"
    shift
    if ! (cd "$work" && timeout 300 sbatch --wait --job-name="bonfire-ci-$name" \
        --output="$work/$name.out" "$@" >/dev/null); then
        scancel --name="bonfire-ci-$name" 2>/dev/null || true
        echo "the Slurm job '$name' failed:" >&2
        cat "$work/$name.out" >&2 || true
        return 1
    fi
}
losses() { grep -o 'epoch [0-9]*: loss [0-9.]*' "$1" || true; }

bonfire launch --nproc-per-node 4 -- "$train" > "$work/one-host.out" 2>&1
want="$(losses "$work/one-host.out")"
[ "$(echo "$want" | wc -l)" = 5 ] || { cat "$work/one-host.out"; exit 1; }

batch ranks "$scripts/ranks.sbatch" "$train"
batch launchers "$scripts/launchers.sbatch" "$train"
for name in ranks launchers; do
    got="$(losses "$work/$name.out")"
    if [ "$got" != "$want" ]; then
        echo "the '$name' job's losses differ from the same job under bonfire launch on one host:" >&2
        diff <(echo "$want") <(echo "$got") >&2 || true
        cat "$work/$name.out" >&2
        exit 1
    fi
    echo "$name.sbatch: the same losses as on one host ($(echo "$got" | tail -1))"
done
grep -q 'node 1 joined' "$work/launchers.out" || { cat "$work/launchers.out"; exit 1; }

# The batch script is no rank, and one launcher there would wait for the other node forever.
cat > "$work/no-srun.sbatch" <<SCRIPT
#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
"$train"; echo "program exit \$?"
bonfire launch --nproc-per-node 2 -- "$train"; echo "launcher exit \$?"
srun --ntasks-per-node=1 bonfire launch --nproc-per-node 2 -- "$train"; echo "step exit \$?"
SCRIPT
batch no-srun "$work/no-srun.sbatch"
for want in "is the batch script of Slurm job" "start the ranks with \`srun ./train\`" \
    "program exit 1" "bonfire launch is running in the batch script of Slurm job" \
    "start one launcher per node with \`srun --ntasks=2 --ntasks-per-node=1 bonfire launch" \
    "launcher exit 2" "bonfire launch runs once per node, but this srun step has 4 tasks" \
    "step exit 2"; do
    grep -qF "$want" "$work/no-srun.out" || {
        echo "no '$want' in what the batch script printed:" >&2
        cat "$work/no-srun.out" >&2
        exit 1
    }
done
echo "a program and a launcher in the batch script refuse, naming srun"
rm -rf "$work"
