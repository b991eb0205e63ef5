#!/usr/bin/env bash
# A real Slurm cluster on this one host, for CI: munged, slurmctld and two slurmd playing the
# nodes n1 and n2 (127.0.1.1 and 127.0.1.2, 2 CPUs each). Debian's packages, no systemd, no
# accounting, no cgroups.
#
#   .ci/slurm-cluster.sh start DIR   installs what is missing, writes DIR/slurm.conf, starts the
#                                    daemons and waits until both nodes are idle
#   .ci/slurm-cluster.sh stop DIR    stops the daemons it started, by their pid files
#
# Clients need SLURM_CONF=DIR/slurm.conf.
set -euo pipefail

cmd="${1:?usage: slurm-cluster.sh start|stop DIR}"
dir="$(mkdir -p "${2:?usage: slurm-cluster.sh start|stop DIR}" && cd "$2" && pwd)"
if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi

stop() {
    for pid_file in "$dir"/slurmd-n1.pid "$dir"/slurmd-n2.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
        [ -s "$pid_file" ] || continue
        pid="$(cat "$pid_file")"
        $sudo kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do
            $sudo kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        $sudo kill -9 "$pid" 2>/dev/null || true
        rm -f "$pid_file"
    done
}

if [ "$cmd" = stop ]; then
    stop
    exit 0
fi
[ "$cmd" = start ] || { echo "usage: slurm-cluster.sh start|stop DIR" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    $sudo apt-get update -y
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends \
        slurmctld slurmd slurm-client munge
fi
for node in 1 2; do
    grep -q "^127.0.1.$node n$node\$" /etc/hosts || echo "127.0.1.$node n$node" | $sudo tee -a /etc/hosts >/dev/null
done

# Leftovers of an earlier run that did not stop.
stop
rm -rf "$dir/state" "$dir"/spool-* "$dir"/*.log
mkdir -p "$dir/state" "$dir/spool-n1" "$dir/spool-n2"

# munge: its key comes with the package; the daemon runs as its own user. One that already runs
# (a machine with Slurm of its own) is used as it is.
if ! (munge -n | unmunge) >/dev/null 2>&1; then
    $sudo install -d -o munge -g munge -m 0755 /run/munge
    $sudo runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        (munge -n | unmunge) >/dev/null 2>&1 && break
        sleep 0.1
    done
    pgrep -u munge -x -n munged > "$dir/munged.pid"
fi

cat > "$dir/slurm.conf" <<CONF
ClusterName=bonfire-ci
SlurmctldHost=localhost
SlurmctldPort=16817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.1.1 Port=16818 CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.1.2 Port=16819 CPUs=2 State=UNKNOWN
PartitionName=ci Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$dir/slurm.conf"

$sudo slurmctld -f "$SLURM_CONF"
$sudo slurmd -f "$SLURM_CONF" -N n1
$sudo slurmd -f "$SLURM_CONF" -N n2

for _ in $(seq 100); do
    if [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$')" = 2 ]; then
        sinfo -N
        exit 0
    fi
    sleep 0.2
done
echo "the Slurm nodes did not become idle within 20 s:" >&2
sinfo -N >&2 || true
tail -20 "$dir"/*.log >&2 || true
exit 1
