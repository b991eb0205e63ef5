#!/usr/bin/env python3
"""A straggler on purpose: runs the chaos campaign's job (`bonfire train vision`, 2 ranks under
`bonfire launch`) while one rank is paused for a share of every 100 ms (SIGSTOP, then SIGCONT),
as a rank on a busier or slower machine would be, and checks that the job names that rank as
the straggler, with compute as the cause, in its epoch lines and its report.

Usage: benches/straggler.py [--rank 1] [--duty 0.3] [--bonfire PATH] [--out DIR]
"""

import argparse
import os
import re
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chaos  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--duty", type=float, default=0.3, help="share of each 100 ms the rank is stopped")
    p.add_argument("--bonfire", default="target/release/bonfire")
    p.add_argument("--out", default="runs/straggler")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-limit", type=int, default=1536)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    args.nodes = 1
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.abspath(os.path.join(args.out, "run"))
    os.system(f"rm -rf '{ckpt}'")
    nodes = chaos.job(args, os.path.abspath(args.bonfire), ckpt, os.path.join(args.out, "run"),
                      chaos.free_port(), None)
    done = threading.Event()

    def pause():
        while not done.is_set():
            pid = nodes[0].ranks().get(args.rank)
            if pid is None:
                time.sleep(0.01)
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.1 * args.duty)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            time.sleep(0.1 * (1 - args.duty))

    t = threading.Thread(target=pause, daemon=True)
    t.start()
    code = nodes[0].wait(time.monotonic() + args.timeout)
    done.set()
    text = "\n".join(line for _, line in nodes[0].lines)
    named = re.findall(r"straggler: (rank \d+ is \d+% slower[^\n]*)", text)
    report = re.findall(r"stragglers\s+([^\n]*)", text)
    for line in named:
        print("epoch line:", line)
    for line in report:
        print("report:    ", line)
    ok = code == 0 and named and all(f"rank {args.rank} " in n for n in named) and report \
        and report[-1].startswith(f"rank {args.rank} in epoch") and "(compute;" in report[-1]
    print(f"{'ok' if ok else 'FAILED'}: rank {args.rank} paused {100 * args.duty:.0f}% of the time; exit {code}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
