#!/usr/bin/env python3
"""Samples a running process and the GPU until the process ends:

    sampler.py PID OUT [--every SECONDS]

every SECONDS (default 0.2) the device's utilisation (nvidia-smi) and the CPU time of each thread
of the process and its descendants (/proc: a launcher's ranks are its children). When the process ends, OUT gets: `wall` (seconds sampled), `gpu`
(utilisation: mean and share of samples at 0%, over the samples after the first quarter of the
run, where a job has compiled its kernels), and one `thread` line for each of the busiest threads
(CPU seconds and share of the wall time over the same window).
"""

import argparse
import os
import subprocess
import sys
import time


def tree(pid):
    """The process and its descendants (a launcher's ranks are its children)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return pids


def threads(root):
    """{(pid, tid): (name, cpu seconds)} of every thread of the process and its descendants."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in tree(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[(pid, tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def alive(pid):
    """The process exists and has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def gpu_util():
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=5,
        )
        return float(r.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("pid", type=int)
    p.add_argument("out")
    p.add_argument("--every", type=float, default=0.2)
    a = p.parse_args()
    t0 = time.monotonic()
    samples = []  # (t, gpu, threads)
    while alive(a.pid):
        samples.append((time.monotonic() - t0, gpu_util(), threads(a.pid)))
        time.sleep(a.every)
    with open(a.out, "w") as f:
        if len(samples) < 4:
            print(f"wall {len(samples)} samples: too few", file=f)
            return 0
        wall = samples[-1][0]
        start = next(i for i, s in enumerate(samples) if s[0] >= wall / 4)
        window = samples[start:]
        span = window[-1][0] - window[0][0]
        gpu = [g for _, g, _ in window if g is not None]
        print(f"wall {wall:.1f} s sampled; window after the first quarter: {span:.1f} s", file=f)
        if gpu:
            print(
                f"gpu utilisation in the window: mean {sum(gpu) / len(gpu):.0f}%, "
                f"{100 * sum(g == 0 for g in gpu) / len(gpu):.0f}% of {len(gpu)} samples at 0%",
                file=f,
            )
        # Each thread's CPU time at the window's start and at its last sample (a thread that
        # ended, or the whole process at its exit, is missing from the last samples).
        first, last = window[0][2], {}
        for _, _, seen in window:
            last.update(seen)
        busy = []
        for tid, (name, cpu) in last.items():
            before = first.get(tid, (name, 0.0))[1]
            busy.append((cpu - before, name, tid))
        busy.sort(reverse=True)
        for cpu, name, (pid, tid) in busy[:6]:
            print(
                f"thread {name} (process {pid}, thread {tid}): {cpu:.2f} s CPU in the window, "
                f"{100 * cpu / max(span, 1e-9):.0f}% of it",
                file=f,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
