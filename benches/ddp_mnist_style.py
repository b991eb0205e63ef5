#!/usr/bin/env python3
"""PyTorch DDP (gloo, CPU) on the mnist-style example's model, as the peer for bonfire's weak-scaling
figure. Same CNN (conv 1->8 3x3, max-pool 2, conv 8->16 3x3, max-pool 2, linear 400->10), SGD with
momentum, cross-entropy, the same per-rank batch; one intra-op thread per rank.

Prints images/s for 1 process and for N processes (default 2) under DistributedDataParallel, and
the weak-scaling efficiency = images/s(N) / (N x images/s(1)).

    python3 benches/ddp_mnist_style.py [--nproc 2] [--batch 32] [--steps 300]

`--model resnet` swaps in the bundled ResNet of `bonfire train vision` (models/src/resnet.rs:
3x3 stem with batch norm and 2x2 max pool, basic blocks of width 8, 16, 32, global average pool,
linear head; 19,810 parameters) with Adam, for `bonfire train vision`'s weak-scaling figure
(use `--batch 64 --steps 100`).

`--epochs N` feeds the model the way `examples/mnist-style` does, for a like-for-like weak-scaling
figure (`benches/dp_scaling.sh` runs both): a training set of batch x steps x ranks images held in
memory, a fresh seeded shuffle each epoch split across the ranks (DistributedSampler), each batch
gathered from the set by index, the loss read back every step, and only the last of the N epochs
timed (the earlier ones are the warm-up). Without it, the older loop: 10 warm-up steps, then
`--steps` timed steps over slices of 16 pre-made batches, the loss never read.

`--mnist DIR` (with `--epochs`) trains on the first batch x steps x ranks MNIST training images
from the IDX files in DIR (bonfire's cache: ~/.cache/bonfire/datasets/mnist), normalised as
bonfire does, instead of noise: with `--model resnet` the like-for-like peer of `bonfire train
vision` (`benches/resnet_scaling.sh` runs both).

`--fsdp2 zero2|zero3` (with `--model resnet --epochs`) wraps the ResNet in FSDP2's `fully_shard`
instead of DDP, each residual block and then the whole model, and measures only the N-process
run: `zero3` frees the gathered parameters after forward and gathers them again in backward
(`reshard_after_forward=True`), the peer of `bonfire train vision --zero 3`; `zero2` keeps them
from forward to backward. `--many-only` measures only the N-process run under DDP too. With
`--epochs`, each rank of those runs prints the model state it holds (parameters, gradients
and the optimizer's state, the bytes of its local shards) as `rank R state B bytes`.

`--device cuda` runs every rank on a GPU (rank i on GPU i % count), NCCL when each rank has a
GPU of its own and gloo when ranks share one (NCCL refuses two ranks on one GPU); the timing then
waits for the GPU before it stops the clock. The bundled ResNet on a GPU is the peer of
`bonfire train vision --backend cuda` (BENCHMARKS.md, "On a GPU").

Without torch installed it says so and exits 0 (install it with `pip install torch`).
"""

import argparse
import os
import socket
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def make_model(torch):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Conv2d(8, 16, 3), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 10),
    )


def make_resnet(torch, width=8):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.short = None
            if stride != 1 or cin != cout:
                self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            idn = x if self.short is None else self.short(x)
            y = torch.relu(self.b1(self.c1(x)))
            return torch.relu(self.b2(self.c2(y)) + idn)

    w = width
    return nn.Sequential(
        nn.Conv2d(1, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2, 2),
        Block(w, w, 1), Block(w, 2 * w, 2), Block(2 * w, 4 * w, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, 10),
    )


def run(rank, world, port, batch, steps, queue, model_name="cnn", device="cpu", epochs=0, mnist=None,
        fsdp2=None, state=False):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(42)
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    dev = torch.device(f"cuda:{rank % gpus}") if gpus else torch.device("cpu")
    model = make_resnet(torch) if model_name == "resnet" else make_model(torch)
    model = model.to(dev)
    if world > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        backend = "nccl" if gpus >= world else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
        if fsdp2:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh(dev.type, (world,))
            reshard = fsdp2 == "zero3"
            for layer in model:
                if any(p.requires_grad for p in layer.parameters()) and len(list(layer.children())) > 0:
                    fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        else:
            ids = [dev.index] if gpus else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if model_name == "resnet":
        opt = torch.optim.Adam(model.parameters(), lr=0.003)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    if epochs:
        rate = run_epochs(torch, model, opt, loss_fn, rank, world, batch, steps, epochs, dev, mnist)
        if state:
            print(f"rank {rank} state {state_bytes(model, opt)} bytes", flush=True)
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
        queue.put(rate)
        return
    g = torch.Generator().manual_seed(rank)
    data = torch.rand(batch * 16, 1, 28, 28, generator=g).to(dev)
    labels = torch.randint(0, 10, (batch * 16,), generator=g).to(dev)
    warm = 10
    for step in range(steps + warm):
        if step == warm:
            start = time.perf_counter()
        i = (step * batch) % data.shape[0]
        x, y = data[i:i + batch], labels[i:i + batch]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    if gpus:
        torch.cuda.synchronize(dev)
    elapsed = time.perf_counter() - start
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    queue.put(steps * batch / elapsed)


def local(t):
    """The part of `t` this rank holds: an FSDP2 parameter's local shard, else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model, opt):
    """Bytes of model state this rank holds: its parameters, their gradients and the optimizer's
    tensors (Adam's two moments; the step counters are scalars), each as its local shard."""
    total = 0
    for p in model.parameters():
        total += local(p).nelement() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).nelement() * p.grad.element_size()
    for st in opt.state.values():
        for v in st.values():
            if hasattr(v, "nelement") and v.dim() > 0:
                total += local(v).nelement() * v.element_size()
    return total


def load_mnist(torch, root, size):
    """The first `size` training images and labels of the MNIST IDX files in `root` (the files
    bonfire's data set cache holds), normalised as bonfire normalises them."""
    with open(os.path.join(root, "train-images-idx3-ubyte"), "rb") as f:
        f.seek(16)
        pixels = f.read(size * 28 * 28)
    with open(os.path.join(root, "train-labels-idx1-ubyte"), "rb") as f:
        f.seek(8)
        marks = f.read(size)
    if len(marks) < size:
        raise SystemExit(f"ddp_mnist_style: {root} holds fewer than {size} training images")
    images = torch.frombuffer(bytearray(pixels), dtype=torch.uint8).float().div(255.0)
    images = images.sub(MNIST_MEAN).div(MNIST_STD).reshape(size, 1, 28, 28)
    labels = torch.frombuffer(bytearray(marks), dtype=torch.uint8).long()
    return images, labels


def run_epochs(torch, model, opt, loss_fn, rank, world, batch, steps, epochs, dev, mnist=None):
    """The example's loop: shuffled shard per epoch, gathered batches, loss read every step;
    returns this rank's images/s over the last epoch. With `mnist` (a directory of the IDX
    files), the images are MNIST's first batch x steps x ranks training images instead of noise."""
    g = torch.Generator().manual_seed(7)
    size = batch * steps * world
    if mnist:
        images, labels = load_mnist(torch, mnist, size)
    else:
        images = torch.rand(size, 1, 28, 28, generator=g)
        labels = torch.randint(0, 10, (size,), generator=g)
    rate = 0.0
    for epoch in range(epochs):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(100 + epoch))
        mine = order[rank::world]
        start = time.perf_counter()
        for i in range(0, len(mine) - batch + 1, batch):
            idx = mine[i:i + batch]
            x, y = images.index_select(0, idx).to(dev), labels.index_select(0, idx).to(dev)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.item()
            loss.backward()
            opt.step()
        rate = (len(mine) // batch) * batch / (time.perf_counter() - start)
    return rate


def measure(world, batch, steps, model_name="cnn", device="cpu", epochs=0, mnist=None, fsdp2=None,
            state=False):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, world, port, batch, steps, queue, model_name, device, epochs, mnist, fsdp2, state)) for r in range(world)]
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
    ap.add_argument("--model", choices=["cnn", "resnet"], default="cnn")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--epochs", type=int, default=0)
    ap.add_argument("--mnist", default=None, help="with --epochs: train on the MNIST IDX files in this directory")
    ap.add_argument("--fsdp2", choices=["zero2", "zero3"], default=None,
                    help="with --model resnet --epochs: FSDP2 in place of DDP, N processes only")
    ap.add_argument("--many-only", action="store_true", help="measure the N-process run only")
    a = ap.parse_args()
    if a.mnist and not a.epochs:
        ap.error("--mnist needs --epochs")
    if a.fsdp2 and (a.model != "resnet" or not a.epochs or a.nproc < 2):
        ap.error("--fsdp2 needs --model resnet, --epochs and --nproc 2 or more")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("ddp_mnist_style: torch is not installed (pip install torch); skipped")
        return 0
    if a.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        how = f"{'nccl' if gpus >= a.nproc else 'gloo'}, {gpus} gpu(s): {torch.cuda.get_device_name(0)}"
    else:
        how = "gloo, cpu"
    if a.fsdp2 or a.many_only:
        many = measure(a.nproc, a.batch, a.steps, a.model, a.device, a.epochs, a.mnist, a.fsdp2,
                       state=bool(a.epochs))
        what = f"fsdp2 {a.fsdp2}" if a.fsdp2 else "ddp"
        print(f"pytorch {what} ({how}), {a.model}, batch {a.batch} per rank, 1 thread per rank")
        print(f"  {a.nproc} ranks: {many:.0f} images/s")
        return 0
    one = measure(1, a.batch, a.steps, a.model, a.device, a.epochs, a.mnist)
    many = measure(a.nproc, a.batch, a.steps, a.model, a.device, a.epochs, a.mnist)
    print(f"pytorch ddp ({how}), {a.model}, batch {a.batch} per rank, 1 thread per rank")
    print(f"  1 rank:  {one:.0f} images/s")
    print(f"  {a.nproc} ranks: {many:.0f} images/s")
    print(f"  weak-scaling efficiency: {100 * many / (a.nproc * one):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
