#!/usr/bin/env python3
"""Where a GPU job's step goes, from CubeCL's kernel profile and the job's own report.

    kernel_profile.py PROFILE_LOG JOB_LOG [--batches N] [--samples SAMPLER_LOG] [--top K]

PROFILE_LOG is what CubeCL writes with `CUBECL_DEBUG_LOG=<file> CUBECL_DEBUG_OPTION=profile`:
one line `| <duration> | <kernel>` per kernel launched. CubeCL's CUDA and wgpu servers time a
kernel with the host's clock from a synchronised stream to the kernel's end, launch included, so
each figure is an upper bound of the kernel's device time (on an H100 no kernel read below 11 us,
a tenth of them below 17 us), and the run that writes the log, which waits for every kernel, is
slower than an unprofiled one. JOB_LOG is an unprofiled run of the same job and batch: its
`step split` line gives the step's wall time. The summary says how many kernels a batch launches,
their awaited time per batch against the unprofiled step, that step per kernel launched (the
cost of a launch when the step is bound by launching), and the kernels that take the most time.

SAMPLER_LOG, when given, is sampler.py's output for the unprofiled run: the device's utilisation
and each thread's CPU time.
"""

import argparse
import collections
import re
import sys

UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
DURATION = re.compile(r"^([0-9.]+)(ns|µs|us|ms|s)$")


def seconds(text):
    m = DURATION.match(text.strip())
    return float(m.group(1)) * UNITS[m.group(2)] if m else None


def kernels(path):
    """(name, seconds) for every per-kernel line of CubeCL's profile log."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            cells = line.rstrip("\n").split("|")
            # `| 12.3µs     | Name | Runtime`: an empty cell, the duration, the name (which may
            # hold `|` itself). The summary tables' rows start with a name, not a duration.
            if len(cells) < 3 or cells[0].strip():
                continue
            secs = seconds(cells[1])
            if secs is not None:
                out.append(("|".join(cells[2:]).strip(), secs))
    return out


def job_split(path):
    """The job's per-batch step split in ms (input, forward, backward, exposed, optimizer) and its
    throughput line."""
    split, rate = None, None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if "step split" in line:
                nums = [float(x) for x in re.findall(r"([0-9.]+) ms", line)]
                if len(nums) == 5:
                    split = dict(zip(["input", "forward", "backward", "exposed", "optimizer"], nums))
            if "throughput" in line:
                rate = line.strip()
    return split, rate


def short(name, width=90):
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("profile")
    p.add_argument("job")
    p.add_argument("--batches", type=int, required=True, help="batches the profiled run trained")
    p.add_argument("--samples", help="sampler.py's output for the unprofiled run")
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()

    ks = kernels(a.profile)
    if not ks:
        print(f"no kernel lines in {a.profile}")
        return 1
    total = sum(s for _, s in ks)
    by = collections.defaultdict(lambda: [0, 0.0])
    for name, s in ks:
        by[name][0] += 1
        by[name][1] += s
    per_batch_ms = 1e3 * total / a.batches
    launches = len(ks) / a.batches
    ds = sorted(t for _, t in ks)
    print(
        f"kernels: {len(ks)} launches of {len(by)} kinds over {a.batches} batches (evaluation "
        f"included): {launches:.0f} per batch; each awaited alone {1e6 * total / len(ks):.1f} us "
        f"on average (min {1e6 * ds[0]:.1f}, tenth {1e6 * ds[len(ds) // 10]:.1f}, median "
        f"{1e6 * ds[len(ds) // 2]:.1f}: launch and sync included), {per_batch_ms:.2f} ms per batch"
    )
    split, rate = job_split(a.job)
    if split:
        step = split["input"] + split["forward"] + split["backward"] + split["optimizer"]
        print(
            f"unprofiled step: {step:.1f} ms per batch (forward {split['forward']:.1f}, backward "
            f"{split['backward']:.1f}, optimizer {split['optimizer']:.1f}; the first batches "
            f"included), {1e3 * step / launches:.1f} us per kernel launched"
        )
    if rate:
        print(f"unprofiled {rate}")
    print(f"top {a.top} kernels by awaited time:")
    for name, (n, s) in sorted(by.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"  {100 * s / total:5.1f}%  {1e3 * s:9.2f} ms  {n:7d} x {1e6 * s / n:8.1f} us  {short(name)}")
    if a.samples:
        with open(a.samples, encoding="utf-8") as f:
            for line in f:
                if line.startswith(("gpu", "thread", "wall")):
                    print(line.rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
