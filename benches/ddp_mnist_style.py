#!/usr/bin/env python3
"""PyTorch DDP (gloo, CPU) on the mnist-style example's model, as the peer for bonfire's weak-scaling
figure. Same CNN (conv 1->8 3x3, max-pool 2, conv 8->16 3x3, max-pool 2, linear 400->10), SGD with
momentum, cross-entropy, the same per-rank batch; one intra-op thread per rank.

Prints images/s for 1 process and for N processes (default 2) under DistributedDataParallel, and
the weak-scaling efficiency = images/s(N) / (N x images/s(1)).

    python3 benches/ddp_mnist_style.py [--nproc 2] [--batch 32] [--steps 300]

Without torch installed it says so and exits 0 (install it with `pip install torch`).
"""

import argparse
import os
import socket
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def make_model(torch):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Conv2d(8, 16, 3), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 10),
    )


def run(rank, world, port, batch, steps, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(42)
    model = make_model(torch)
    if world > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    data = torch.rand(batch * 16, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (batch * 16,), generator=g)
    warm = 10
    for step in range(steps + warm):
        if step == warm:
            start = time.perf_counter()
        i = (step * batch) % data.shape[0]
        x, y = data[i:i + batch], labels[i:i + batch]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    elapsed = time.perf_counter() - start
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    queue.put(steps * batch / elapsed)


def measure(world, batch, steps):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, world, port, batch, steps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rates = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return sum(rates)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        print("ddp_mnist_style: torch is not installed (pip install torch); skipped")
        return 0
    one = measure(1, a.batch, a.steps)
    many = measure(a.nproc, a.batch, a.steps)
    print(f"pytorch ddp (gloo, cpu), batch {a.batch} per rank, 1 thread per rank")
    print(f"  1 rank:  {one:.0f} images/s")
    print(f"  {a.nproc} ranks: {many:.0f} images/s")
    print(f"  weak-scaling efficiency: {100 * many / (a.nproc * one):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
