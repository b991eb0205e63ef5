#!/usr/bin/env python3
"""PyTorch DDP peer for `bonfire train gpt`: the same model, text, batch and optimizer, nanoGPT-style.

Trains the GPT-style model of `benches/tp_gpt_torch.py` (bonfire's `models/src/gpt.rs` written in
PyTorch: tied head, pre-norm blocks, GELU MLP, biases, dropout 0) on the same character text the
bonfire job reads (the Shakespeare text in bonfire's data cache, or any UTF-8 file), with
bonfire's defaults: 4 layers, 4 heads, width 128, context 64, 16 windows per rank per step drawn
at random from the rank's equal shard of the training windows (the first 90% of the text), Adam
with betas (0.9, 0.99) and eps 1e-5, warmup then cosine to a tenth. Each step reads the loss
(`.item()`), as the bonfire job does for its progress line.

    python3 benches/gpt_ddp_torch.py --text PATH [--dp 1,2] [--steps 100] [--threads 1]
        [--zero | --fsdp2 zero2|zero3] [--dcp N] [--device cpu|cuda] [--batch 16] [--json PATH]

`--dp 2` runs two processes with DistributedDataParallel over gloo on 127.0.0.1, one compute
thread each (`torch.set_num_threads`), as bonfire's job gives each of its two ranks on two cores.
It prints, per dp size, the characters per second over all ranks during the training steps
(wall time from the first step to the last, evaluation and start-up excluded: what the bonfire
job's `throughput` line measures), and the loss of the last step. With `--zero` the Adam of a
run of several ranks is wrapped in `torch.distributed.optim.ZeroRedundancyOptimizer` (ZeRO stage 1,
the peer of `bonfire train gpt --zero 1`). With `--fsdp2 zero2` the model is sharded with FSDP2
(`fully_shard` on every block and on the whole model, `reshard_after_forward=False`: gradients
reduce-scattered, the optimizer's state sharded, parameters whole from the forward to the end of
backward, the peer of `--zero 2`); `--fsdp2 zero3` reshards after the forward too (ZeRO-3). The
gradients counted are the rank's shards. Each row also gives the model state of the rank
holding the most (parameters, gradients and the optimizer's state tensors, in bytes) and every
rank's peak resident memory (`ru_maxrss`). `--device cuda` trains on the GPU (every rank on
device 0; DDP still over gloo, since NCCL refuses two ranks on one device), the peer of
`bonfire train gpt --backend cuda`; the loss is read every step there too, which waits for the
GPU as the bonfire job's progress line does. `--dcp N` (several ranks) saves N distributed
checkpoints after training with `torch.distributed.checkpoint.save` of `get_state_dict` (under
FSDP2 each rank writes its shards of the model and of Adam's state), timed on rank 0 between two
barriers, and prints a `# dcp` line: milliseconds per save and the MiB rank 0 wrote (its own file
and the metadata): the peer of a `--zero 3` run's per-rank checkpoints.

Without torch installed it says so and exits 0 (install it with `pip install torch`).
"""

import argparse
import importlib.util
import json
import math
import os
import socket
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def model_module():
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("tp_gpt_torch", os.path.join(here, "tp_gpt_torch.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def lr_at(args, step):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    span = max(args.total_steps - args.warmup, 1)
    p = min((step - args.warmup) / span, 1.0)
    lo = args.lr / 10
    return lo + 0.5 * (1 + math.cos(math.pi * p)) * (args.lr - lo)


def rank_main(rank, world, port, args, out):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text[: int(len(text) * 0.9)]], dtype=torch.long)
    windows = len(ids) - args.context
    per_rank = windows // world
    first = rank * per_rank
    args.vocab = len(chars)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = model_module().build_model(args).to(device)
    if world > 1 and args.fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        reshard = args.fsdp2 == "zero3"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
    if args.zero and world > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=args.lr, betas=(0.9, 0.99), eps=1e-5)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-5)
    gen = torch.Generator().manual_seed(args.seed + rank)
    offsets = torch.arange(args.context + 1)
    start = None
    loss_value = float("nan")
    for step in range(args.steps):
        if step == 1:
            start = time.perf_counter()  # step 0 builds the autograd graph's caches
        for g in opt.param_groups:
            g["lr"] = lr_at(args, step)
        starts = first + torch.randint(per_rank, (args.batch,), generator=gen)
        w = ids[starts.unsqueeze(1) + offsets]
        x, y = w[:, :-1].to(device), w[:, 1:].to(device)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = loss.item()
        if step == args.steps - 1:
            # Gradients are still alive here (the next zero_grad frees them).
            grad_bytes = sum(local_tensor(q.grad).numel() * q.grad.element_size()
                             for q in model.parameters() if q.grad is not None)
    elapsed = time.perf_counter() - start
    dcp_secs, dcp_bytes = [], 0
    if args.dcp and world > 1:
        import shutil
        import tempfile
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        root = tempfile.mkdtemp() if rank == 0 else None
        box = [root]
        dist.broadcast_object_list(box, src=0)
        root = box[0]
        for i in range(args.dcp):
            dist.barrier()
            t0 = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"step-{i}"))
            dist.barrier()
            dcp_secs.append(time.perf_counter() - t0)
        last = os.path.join(root, f"step-{args.dcp - 1}")
        # This rank's own file(s) (__<rank>_*.distcp), plus the metadata for rank 0.
        dcp_bytes = sum(os.path.getsize(os.path.join(last, n)) for n in os.listdir(last)
                        if n.startswith(f"__{rank}_") or (rank == 0 and n == ".metadata"))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    import resource
    local = opt.optim if hasattr(opt, "optim") else opt
    state_bytes = sum(local_tensor(t).numel() * t.element_size() for st in local.state.values()
                      for t in st.values() if torch.is_tensor(t))
    # Whole under DDP and FSDP2's zero2 (every parameter is unsharded from the forward to the end
    # of backward); the rank's shard at rest under zero3 (plus one block at a time in compute).
    whole = not (args.fsdp2 == "zero3" and world > 1)
    param_bytes = sum((q if whole else local_tensor(q)).numel() * q.element_size()
                      for q in model.parameters())
    mine = {"rank": rank, "optimizer_bytes": state_bytes, "param_bytes": param_bytes,
            "grad_bytes": grad_bytes, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "dcp_secs": dcp_secs, "dcp_bytes": dcp_bytes}
    if world > 1:
        import torch.distributed as dist
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    if rank == 0:
        chars_per_s = world * args.batch * args.context * (args.steps - 1) / elapsed
        with open(out, "w") as f:
            json.dump({"dp": world, "chars_per_s": chars_per_s, "loss": loss_value,
                       "seconds": elapsed, "steps": args.steps - 1, "zero": bool(args.zero and world > 1),
                       "fsdp2": args.fsdp2 if world > 1 else None,
                       "ranks": everyone}, f)
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()


def local_tensor(t):
    """This rank's part of a tensor: an FSDP2 shard (a DTensor) or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", required=True)
    p.add_argument("--dp", default="1,2")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--total-steps", type=int, default=1200, help="the schedule's length (bonfire's --steps)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer around Adam (dp > 1)")
    p.add_argument("--fsdp2", choices=["zero2", "zero3"],
                   help="shard with FSDP2's fully_shard (dp > 1): zero2 keeps parameters whole after forward")
    p.add_argument("--dcp", type=int, default=0,
                   help="after training, save N distributed checkpoints (torch.distributed.checkpoint: "
                        "every rank writes its shards) and time them")
    p.add_argument("--json")
    args = p.parse_args()
    if args.zero and args.fsdp2:
        p.error("--zero and --fsdp2 are two peers: give one")
    if args.fsdp2 and args.device == "cuda":
        p.error("--fsdp2 shards over a CPU mesh here: run it with --device cpu")
    try:
        import torch  # noqa: F401
        import torch.multiprocessing as mp
    except ImportError:
        print("# torch is not installed: nothing to compare (pip install torch)")
        return 0
    import tempfile
    rows = []
    print(f"# PyTorch {torch.__version__} DDP (gloo), GPT {args.layers} layers x {args.embd}, context "
          f"{args.context}, batch {args.batch} per rank, {args.threads} thread(s) per rank, {args.steps} steps"
          + (", ZeroRedundancyOptimizer(Adam)" if args.zero else "")
          + (f", FSDP2 fully_shard ({args.fsdp2})" if args.fsdp2 else "") + f", on {args.device}")
    print(f"# {'dp':>3} {'chars/s':>10} {'per rank':>10} {'loss':>8} {'params MiB':>10} {'grads MiB':>9} "
          f"{'optim MiB (most)':>16} {'state MiB':>9}  peak RSS MiB by rank")
    for dp in [int(d) for d in args.dp.split(",")]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        if dp == 1:
            rank_main(0, 1, 0, args, out)
        else:
            mp.spawn(rank_main, args=(dp, free_port(), args, out), nprocs=dp, join=True)
        with open(out) as f:
            r = json.load(f)
        os.unlink(out)
        rows.append(r)
        mib = lambda b: b / (1 << 20)
        most = max(x["optimizer_bytes"] for x in r["ranks"])
        x0 = r["ranks"][0]
        peaks = ", ".join(f"{mib(x['peak_rss']):.0f}" for x in r["ranks"])
        print(f"  {dp:>3} {r['chars_per_s']:>10.0f} {r['chars_per_s'] / dp:>10.0f} {r['loss']:>8.4f} "
              f"{mib(x0['param_bytes']):>10.2f} {mib(x0['grad_bytes']):>9.2f} {mib(most):>16.2f} "
              f"{mib(x0['param_bytes'] + x0['grad_bytes'] + most):>9.2f}  {peaks}")
        if x0["dcp_secs"]:
            each = 1e3 * sum(x0["dcp_secs"]) / len(x0["dcp_secs"])
            print(f"# dcp {len(x0['dcp_secs'])} save(s), {each:.1f} ms each on rank 0; "
                  f"{mib(x0['dcp_bytes']):.2f} MiB by rank 0 of {dp}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
