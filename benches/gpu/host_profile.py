#!/usr/bin/env python3
"""Sums the folded stacks `bonfire` writes under `BONFIRE_HOST_PROFILE` (a build with
`--features host-profile`): per thread, its share of the samples; within each busy thread, the
functions the samples were in (self: the innermost frame) and under (inclusive: anywhere in the
stack, once per sample), and the crates the self samples fall in.

    python3 benches/gpu/host_profile.py PROFILE.folded [--top N] [--threads N] [--match TEXT]

`--match TEXT` adds, per thread, the share of samples whose stack has a frame containing TEXT
(repeatable), which is how a question like "how much of the launch thread is the allocator" is
answered from one file.
"""
import argparse
import collections
import re
import sys


def crate_of(frame):
    """The crate a demangled Rust name belongs to (`cubecl_cuda::...` -> `cubecl_cuda`), the
    library for other frames, `?` when the symbol is unknown."""
    name = frame.strip()
    if not name or name.startswith("0x") or name == "?":
        return "?"
    # `<T as Trait>::f` and `<impl ...>`: the crate of the type, the first path in the name.
    m = re.search(r"([A-Za-z_][A-Za-z0-9_]*)::", name)
    if m:
        return m.group(1)
    return name.split("(")[0][:40]


def short(frame, width=110):
    frame = re.sub(r"::h[0-9a-f]{16}$", "", frame)
    return frame if len(frame) <= width else frame[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folded")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--threads", type=int, default=4, help="busiest threads to detail")
    ap.add_argument("--match", action="append", default=[], help="report stacks through TEXT")
    args = ap.parse_args()

    per_thread = collections.Counter()
    self_fn = collections.defaultdict(collections.Counter)
    incl_fn = collections.defaultdict(collections.Counter)
    self_crate = collections.defaultdict(collections.Counter)
    incl_crate = collections.defaultdict(collections.Counter)
    matched = collections.defaultdict(collections.Counter)
    total = 0
    with open(args.folded, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            try:
                n = int(count)
            except ValueError:
                continue
            parts = stack.split(";")
            thread, frames = parts[0], parts[1:]
            frames = [f for f in frames if f]
            total += n
            per_thread[thread] += n
            leaf = frames[-1] if frames else "?"
            self_fn[thread][short(leaf)] += n
            self_crate[thread][crate_of(leaf)] += n
            for fr in set(short(f) for f in frames):
                incl_fn[thread][fr] += n
            for c in set(crate_of(f) for f in frames):
                incl_crate[thread][c] += n
            for text in args.match:
                if any(text in f for f in frames):
                    matched[thread][text] += n
    if total == 0:
        sys.exit(f"{args.folded}: no samples")
    print(f"{total} samples in {args.folded}")
    print("\nthreads (share of all samples):")
    for thread, n in per_thread.most_common():
        print(f"  {n / total:6.1%}  {n:7d}  {thread}")
    for thread, n in per_thread.most_common(args.threads):
        print(f"\n== {thread}: {n} samples ({n / total:.1%})")
        print("  self, by crate:")
        for c, k in self_crate[thread].most_common(args.top):
            print(f"    {k / n:6.1%}  {c}")
        print("  self, by function:")
        for fn, k in self_fn[thread].most_common(args.top):
            print(f"    {k / n:6.1%}  {fn}")
        print("  inclusive (a frame anywhere in the stack), by crate:")
        for c, k in incl_crate[thread].most_common(args.top):
            print(f"    {k / n:6.1%}  {c}")
        # Frames in every sample (the thread's entry) say nothing: left out.
        print("  inclusive, by function (frames in every sample left out):")
        shown = [(fn, k) for fn, k in incl_fn[thread].most_common() if k < n]
        for fn, k in shown[: args.top * 2]:
            print(f"    {k / n:6.1%}  {fn}")
        for text in args.match:
            k = matched[thread][text]
            print(f"  stacks through '{text}': {k / n:.1%}")


if __name__ == "__main__":
    main()
