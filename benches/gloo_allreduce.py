#!/usr/bin/env python3
"""PyTorch gloo all_reduce on this host, as the peer for `bonfire bench collectives`.

Runs N processes (default 2) on 127.0.0.1 with torch.distributed's gloo backend and prints the
same table as bonfire's bench: per size, the slowest rank's mean time per all_reduce (sum, f32),
algbw = size / time and busbw = algbw x 2(n-1)/n (nccl-tests definitions).

    python3 benches/gloo_allreduce.py [--nproc 2] [--sizes 1K,16K,256K,4M,64M,256M] [--iters N]
        [--device cpu|cuda] [--backend gloo|nccl]

Across hosts, one process per rank on each host, all naming rank 0's host (the table is printed
by rank 0):

    python3 benches/gloo_allreduce.py --master HOST:PORT --rank R --world N [--sizes ...]

With `--device cuda` the buffers are CUDA tensors on device LOCAL rank % device count (gloo
stages them through the host); `--backend nccl` tries NCCL, which refuses two ranks on one GPU.

Without torch installed it says so and exits 0 (install it with `pip install torch`).
"""

import argparse
import os
import socket
import sys
import time
import warnings

# torch warns on import when NumPy is absent; the benchmark does not use NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def parse_size(text):
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    suffix = text[-1] if text and text[-1] in units else ""
    return int(float(text[: len(text) - len(suffix)]) * units[suffix])


def format_size(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def rank_main(
    rank, world, port, sizes, iters_override, queue, device="cpu", backend="gloo", host="127.0.0.1"
):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for size in sizes:
        count = size // 4
        buf = torch.full((count,), float(rank + 1), dtype=torch.float32, device=device)
        iters = iters_override or max(5, min(2000, (256 << 20) // max(size, 1)))
        for _ in range(max(2, iters // 10)):
            dist.all_reduce(buf)
        buf.fill_(float(rank + 1))
        dist.all_reduce(buf)
        expected = world * (world + 1) / 2
        if count and not torch.all(buf == expected):
            raise SystemExit(f"rank {rank}: wrong all_reduce result at {size} bytes")
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync()
        mine = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        rows.append((size, count, iters, mine.item()))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default="1K,16K,256K,4M,64M,256M")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--master", help="HOST:PORT of rank 0: run one rank of a multi-host job")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("# skipped: PyTorch is not installed (pip install torch) - no gloo figures")
        return 0
    import torch.multiprocessing as mp

    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if args.master:
        host, port = args.master.rsplit(":", 1)

        class Rows:
            rows = None

            def put(self, rows):
                self.rows = rows

        mine = Rows()
        rank_main(
            args.rank, args.world, int(port), sizes, args.iters, mine, args.device, args.backend, host
        )
        if args.rank == 0:
            report(args, mine.rows, args.world, torch)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=rank_main,
            args=(r, args.nproc, port, sizes, args.iters, queue, args.device, args.backend),
        )
        for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    # Rank 0 reports its rows; a rank that dies first (NCCL's refusal, say: its error is above)
    # ends the wait at once, the hour is the limit for a live but stuck job.
    rows, deadline = None, time.monotonic() + 3600
    while rows is None and time.monotonic() < deadline:
        try:
            rows = queue.get(timeout=1)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        if rows is None and p.is_alive():
            p.terminate()
        p.join()
        if p.exitcode != 0:
            print(f"error: a {args.backend} rank exited with {p.exitcode}", file=sys.stderr)
            return 1
    if rows is None:
        print("error: rank 0 reported nothing within the hour", file=sys.stderr)
        return 1
    report(args, rows, args.nproc, torch)
    return 0


def report(args, rows, n, torch):
    where = "CUDA tensors" if args.device == "cuda" else "host tensors"
    print(f"# {args.backend} all_reduce (sum), {n} ranks, f32 {where}, torch {torch.__version__}, 1 thread per rank")
    print(f"# {'size':>10} {'count':>11} {'iters':>6} {'time(us)':>11} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11}")
    for size, count, iters, secs in rows:
        algbw = size / secs / 1e9
        busbw = algbw * 2 * (n - 1) / n
        print(f"  {format_size(size):>10} {count:>11} {iters:>6} {secs * 1e6:>11.1f} {algbw:>11.4f} {busbw:>11.4f}")
    print("# time: the slowest rank's mean; busbw = algbw x 2(n-1)/n (nccl-tests).")


if __name__ == "__main__":
    sys.exit(main())
