#!/usr/bin/env python3
"""PyTorch tensor parallelism (DTensor over gloo) on this host, as the peer for `bonfire bench tp`.

Trains the same GPT-style model as bonfire's bundled one (`models/src/gpt.rs`: token and learned
position embeddings, pre-norm blocks of causal multi-head attention with separate query, key,
value and output projections and a GELU MLP of 4 x width, a final layer norm, a head tied to the
token embedding; biases everywhere but the head, dropout 0) split over 1, 2, 4 ... processes on
127.0.0.1 with torch.distributed's gloo backend, and prints the same table as bonfire's bench:
per tp size the step time (median over the timed steps of the slowest rank's forward + backward +
Adam step; bonfire takes rank 0's, the same in lockstep), tokens/s, each rank's parameter and
Adam-state bytes, and the all-reduces of a step against Megatron-LM's for the same shapes.

    python3 benches/tp_gpt_torch.py [--tp 1,2,4] [--steps 10] [--warmup 2] [--layers 2]
        [--embd 256] [--heads 8] [--context 128] [--batch 8] [--vocab 64] [--threads N]
        [--json PATH]

The plan is bonfire's, written with PyTorch's own tensor parallelism
(`torch.distributed.tensor.parallel.parallelize_module`):

- `blocks.*.attn.{query,key,value}`, `blocks.*.mlp.fc1`: `ColwiseParallel` (split by heads and
  hidden features; attention runs on each rank's heads, as in PyTorch's TP tutorial);
- `blocks.*.attn.output`, `blocks.*.mlp.fc2`: `RowwiseParallel` (one all-reduce each, forward);
- `tok`: `RowwiseParallel` on the `nn.Embedding`, i.e. split by vocabulary (each rank looks up
  the rows it holds, one all-reduce); the tied head is a bias-free `nn.Linear` under
  `ColwiseParallel` with logits left sharded by vocabulary, re-tied to the embedding's sharded
  weight after `parallelize_module`, and the cross-entropy runs under `loss_parallel()`, so the
  logits are never gathered. All of it works on CPU over gloo; nothing had to stay replicated
  that bonfire splits.
- replicated on every rank, as in bonfire: `pos`, the layer norms, the row-parallel biases.

Every rank seeds the same generator and builds the whole model, rank 0's values are broadcast
before the split, and the tokens (uniform over the vocabulary, seed 7) are the same on every
rank, so the first step's loss equals tp 1's (printed: `loss@1`). tp 1 is the plain model, no
DTensor and no process group. Adam as Burn's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-5.

Collectives are counted by a dispatch mode on one extra step after the timed ones (it slows the
ops it sees, so it stays out of the timing): all-reduces and their bytes, all-gathers
(`gathers`), and every collective by name on a `#` line under each row. bonfire's `fallbacks`
column has no DTensor counterpart (DTensor redistributes instead; that shows as collectives): `-`.
At tp 2 and 4 a step is 17 all-reduces, no gathers: forward the embedding, each layer's attention
output and fc2 (5 activations at 2 layers) and loss_parallel's max, sum of exponentials and
target logit (3 per token); backward the input gradients of query, key, value and fc1 (DTensor
reduces each column-parallel layer's on its own, where Megatron and bonfire sum the three
attention ones first: 2 activations per layer more) and the tied head's (9 activations).

Without torch installed it says so and exits 0 (install it with `pip install torch`).
"""

import argparse
import json
import math
import os
import socket
import sys
import time
import warnings

# torch warns on import when NumPy is absent; the benchmark does not use NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def megatron_bytes(args, tp):
    """Each rank's all-reduce bytes in one step of Megatron-LM for the same model (f32, no
    sequence parallelism): as `megatron_bytes` in crates/bonfire-cli/src/bench/tp.rs."""
    if tp == 1:
        return 0
    tokens = args.batch * args.context
    return 4 * ((4 * args.layers + 2) * tokens * args.embd + 3 * tokens)


def build_model(args):
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.query = nn.Linear(args.embd, args.embd)
            self.key = nn.Linear(args.embd, args.embd)
            self.value = nn.Linear(args.embd, args.embd)
            self.output = nn.Linear(args.embd, args.embd)
            self.head_dim = args.embd // args.heads

        def forward(self, x, mask):
            b, s, _ = x.shape
            # Column-parallel outputs are this rank's heads: count them from the local width.
            q, k, v = self.query(x), self.key(x), self.value(x)
            heads = q.shape[-1] // self.head_dim
            q, k, v = (t.view(b, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            # Burn's MultiHeadAttention: scores / sqrt(d_head), masked to -1e4, softmax.
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            scores = scores.masked_fill(mask, -1.0e4).softmax(dim=-1)
            a = (scores @ v).transpose(1, 2).reshape(b, s, heads * self.head_dim)
            return self.output(a)

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(args.embd, 4 * args.embd)
            self.fc2 = nn.Linear(4 * args.embd, args.embd)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(args.embd)
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(args.embd)
            self.mlp = Mlp()

        def forward(self, x, mask):
            x = x + self.attn(self.ln1(x), mask)
            return x + self.mlp(self.ln2(x))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(args.vocab, args.embd)
            self.pos = nn.Embedding(args.context, args.embd)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.ln_f = nn.LayerNorm(args.embd)
            self.head = nn.Linear(args.embd, args.vocab, bias=False)
            self.head.weight = self.tok.weight  # tied, as bonfire's default
            # bonfire's embeddings start at N(0, 0.02) (GPT-2's), not PyTorch's N(0, 1): with the
            # head tied to them, N(0, 1) starts near 50 nats instead of ln(vocab).
            for emb in (self.tok, self.pos):
                nn.init.normal_(emb.weight, mean=0.0, std=0.02)

        def forward(self, tokens):
            b, s = tokens.shape
            positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
            x = self.tok(tokens) + self.pos(positions)
            mask = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu(1)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.ln_f(x))

    return Gpt()


def comm_counter():
    """A dispatch mode that counts the collectives DTensor issues (by name) and their bytes."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Comms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = {}
            self.bytes = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            # Let DTensor desugar into collectives on local tensors first (as CommDebugMode).
            if any(t is DTensor for t in types):
                return NotImplemented
            out = func(*args, **kwargs)
            if func.namespace in ("_c10d_functional", "c10d", "_c10d_functional_autograd"):
                name = func._overloadpacket.__name__.rstrip("_")
                if name.startswith(("wait", "_")):  # waits and autograd wrappers: no traffic
                    return out
                first = args[0] if args else None
                if isinstance(first, (list, tuple)) and first:
                    first = first[0]
                size = first.numel() * first.element_size() if torch.is_tensor(first) else 0
                self.counts[name] = self.counts.get(name, 0) + 1
                self.bytes[name] = self.bytes.get(name, 0) + size
            return out

    return Comms()


def rank_main(rank, tp, port, args, threads, queue):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(args)
    mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp
        )
        mesh = init_device_mesh("cpu", (tp,))
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p, 0)
        plan = {
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        for i in range(args.layers):
            for name in ("attn.query", "attn.key", "attn.value", "mlp.fc1"):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.output", "mlp.fc2"):
                plan[f"blocks.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
        model.head.weight = model.tok.weight  # parallelize_module split them apart: re-tie

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    params = list(model.parameters())
    split = [p for p in params if isinstance(p, DTensor)]
    whole = [p for p in params if not isinstance(p, DTensor)]
    # Two groups: foreach Adam does not mix DTensor and plain tensors in one list.
    groups = [g for g in ({"params": split}, {"params": whole}) if g["params"]]
    optim = torch.optim.Adam(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-5)

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    gen = torch.Generator().manual_seed(7)

    def batch():
        stream = torch.randint(
            0, args.vocab, (args.batch, args.context + 1), generator=gen, dtype=torch.int64
        )
        return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()

    def step(x, y):
        with loss_parallel():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss

    times, first_loss, last_loss = [], None, None
    for i in range(args.warmup + args.steps):
        x, y = batch()
        start = time.perf_counter()
        loss = step(x, y)
        elapsed = time.perf_counter() - start
        value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()
        if i == 0:
            first_loss = value
        last_loss = value
        if i >= args.warmup:
            times.append(elapsed)
    comms = comm_counter()
    x, y = batch()
    with comms:
        step(x, y)
    times = torch.tensor(times, dtype=torch.float64)
    if tp > 1:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per step, the slowest rank
    times = sorted(times.tolist())
    step_s = times[len(times) // 2] if times else 0.0
    param_bytes = sum(local(p).numel() * local(p).element_size() for p in params)
    adam_bytes = sum(
        local(t).numel() * local(t).element_size()
        for state in optim.state.values()
        for key, t in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    )
    if rank == 0:
        queue.put(
            {
                "tp": tp,
                "threads": threads,
                "step_ms": step_s * 1e3,
                "tokens_per_s": args.batch * args.context / step_s if step_s else 0.0,
                "param_bytes": param_bytes,
                "adam_bytes": adam_bytes,
                "all_reduces": sum(comms.counts.get(k, 0) for k in ("all_reduce", "allreduce")),
                "all_reduce_bytes": sum(comms.bytes.get(k, 0) for k in ("all_reduce", "allreduce")),
                "gathers": sum(n for k, n in comms.counts.items() if "gather" in k),
                "collectives": comms.counts,
                "collective_bytes": comms.bytes,
                "first_loss": first_loss,
                "loss": last_loss,
            }
        )
    if tp > 1:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=None, help="per rank [default: cores / ranks, at least 1]"
    )
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("# skipped: PyTorch is not installed (pip install torch) - no DTensor figures")
        return 0
    import torch.multiprocessing as mp

    sizes = [int(s) for s in args.tp.split(",") if s]
    for tp in sizes:
        if args.heads % tp or args.vocab % tp or args.embd % args.heads:
            print(f"error: tp {tp} must divide heads ({args.heads}) and vocab ({args.vocab}), "
                  f"and heads the width ({args.embd})",
                  file=sys.stderr)
            return 2
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    print(
        f"# torch tp (DTensor over gloo, torch {torch.__version__}): GPT, {args.layers} layers, "
        f"width {args.embd}, {args.heads} heads, context {args.context}, batch {args.batch}, "
        f"vocabulary {args.vocab}, Adam, {args.steps} timed steps after {args.warmup}"
    )
    print(
        f"# {'tp':>3} {'threads':>8} {'step(ms)':>10} {'tokens/s':>10} {'params/rank':>13} "
        f"{'adam/rank':>13} {'allreds':>10} {'allred bytes':>16} {'megatron bytes':>16} "
        f"{'gathers':>8} {'fallbacks':>9} {'loss@1':>10}"
    )
    ctx = mp.get_context("spawn")
    rows = []
    for tp in sizes:
        threads = args.threads or max(1, cores // tp)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=rank_main, args=(r, tp, port, args, threads, queue))
            for r in range(tp)
        ]
        for p in procs:
            p.start()
        f = queue.get(timeout=3600)
        for p in procs:
            p.join()
            if p.exitcode != 0:
                print(f"error: a tp {tp} rank exited with {p.exitcode}", file=sys.stderr)
                return 1
        f["megatron_bytes"] = megatron_bytes(args, tp)
        rows.append(f)
        print(
            f"  {f['tp']:>3} {f['threads']:>8} {f['step_ms']:>10.1f} {f['tokens_per_s']:>10.0f} "
            f"{f['param_bytes']:>13} {f['adam_bytes']:>13} {f['all_reduces']:>10} "
            f"{f['all_reduce_bytes']:>16} {f['megatron_bytes']:>16} {f['gathers']:>8} "
            f"{'-':>9} {f['first_loss']:>10.6f}",
            flush=True,
        )
        if f["collectives"]:
            counts = sorted(f["collectives"].items())
            parts = ", ".join(f"{k} {n} ({f['collective_bytes'][k]} B)" for k, n in counts)
            print(f"#   tp {tp} collectives per step: {parts}", flush=True)
    print(
        "# step: median over the timed steps of the slowest rank; bytes are each rank's "
        "all-reduce buffers per step (f32); megatron: (4 x layers + 2) x batch x context x "
        "width + 3 x batch x context, x 4 bytes (0 at tp = 1); loss@1: the first step's loss"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "args": vars(args), "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
