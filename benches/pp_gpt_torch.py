#!/usr/bin/env python3
"""PyTorch pipelining peer for `bonfire train gpt --pp 2`: the same GPT split the same way.

The model is `benches/tp_gpt_torch.py`'s (bonfire's `models/src/gpt.rs` in PyTorch: token and
position embeddings, pre-norm blocks, GELU MLP, a final layer norm and a head tied to the token
embedding), split into 2 stages as bonfire's job splits it: stage 0 holds the embeddings and the
first half of the blocks, stage 1 the other half, the final norm and the head. The head's weight
is the token embedding's, so stage 1 keeps a copy of it (drawn from the same seed) and after each
backward the two stages sum their gradients of it in one all-reduce before Adam steps, as
bonfire's `Pipeline::sum_shared` does. Each step is `--micro-batches M` micro-batches of
`--batch` windows of the text's first 90%, drawn at random (the same on both ranks), through
`torch.distributed.pipelining` (`Schedule1F1B` or `ScheduleGPipe`, gradients scaled by 1/M: the
mean loss) over gloo on 127.0.0.1, one compute thread per process; Adam with betas (0.9, 0.99)
and eps 1e-5 at a constant learning rate. The schedule `interleaved` is
`ScheduleInterleaved1F1B` with `--chunks V` chunks per rank, as `bonfire train gpt --chunks V`
cuts the model: `2 V` chunks of equal blocks, rank `r` holding chunks `r`, `r + 2`, ...; the
embeddings on chunk 0 (rank 0), the final norm and the head on chunk `2 V - 1` (rank 1).

    python3 benches/pp_gpt_torch.py --text PATH [--micro-batches 4,8] [--batch 8]
        [--schedules 1f1b,gpipe,interleaved] [--chunks 2] [--steps 40] [--skip 10]

Prints, per schedule and M, the characters per second over the steps after the first `--skip`
(wall time on the last stage; `bonfire train gpt --dp 1 --pp 2 --batch B --micro-batches M
--schedule S` prints its steady rate after its first 10 micro-batches instead, a window that
starts earlier), and the first step's loss. A stage that fails or waits past `--timeout`
seconds ends the run with an error. Without torch it says so and exits 0.
"""

import argparse
import importlib.util
import os
import queue
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def ddp_peer():
    """`gpt_ddp_torch.py`, whose model (`tp_gpt_torch.py`'s) and helpers this peer shares."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("gpt_ddp_torch", os.path.join(here, "gpt_ddp_torch.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stage_module(whole, stage, stages):
    """Stage `stage` of `stages` of the whole model: its blocks, with the embeddings first and the
    final norm and head last."""
    import torch
    from torch import nn

    per = len(whole.blocks) // stages
    blocks = list(whole.blocks)[stage * per : (stage + 1) * per]

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            first, last = stage == 0, stage == stages - 1
            self.tok = whole.tok if first else None
            self.pos = whole.pos if first else None
            self.blocks = nn.ModuleList(blocks)
            self.ln_f = whole.ln_f if last else None
            if last:
                # Its own copy of the tied embedding, the same values as stage 0's.
                self.head = nn.Linear(whole.tok.weight.shape[1], whole.tok.weight.shape[0], bias=False)
                with torch.no_grad():
                    self.head.weight.copy_(whole.tok.weight)
            else:
                self.head = None

        def forward(self, x):
            if self.tok is not None:
                b, s = x.shape
                positions = torch.arange(s).unsqueeze(0).expand(b, s)
                x = self.tok(x) + self.pos(positions)
            s = x.shape[1]
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            for block in self.blocks:
                x = block(x, mask)
            if self.head is not None:
                x = self.head(self.ln_f(x))
            return x

    return Stage()


def rank_main(rank, world, port, args, micro, schedule_name, out):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    torch.set_num_threads(1)
    import datetime
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text[: int(len(text) * 0.9)]], dtype=torch.long)
    windows = len(ids) - args.context
    args.vocab = len(chars)
    torch.manual_seed(args.seed)  # the whole model drawn alike on both ranks, then split
    whole = ddp_peer().model_module().build_model(args)
    chunks = args.chunks if schedule_name == "interleaved" else 1
    # Rank r holds the model's chunks r, r + world, ...
    indices = [k * world + rank for k in range(chunks)]
    modules = [stage_module(whole, i, world * chunks) for i in indices]
    del whole
    stages = [PipelineStage(m, i, world * chunks, torch.device("cpu")) for m, i in zip(modules, indices)]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))

    if schedule_name == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, micro, loss_fn=loss_fn)
    else:
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
        sched = kind(stages[0], micro, loss_fn=loss_fn)
    params = [q for m in modules for q in m.parameters()]
    opt = torch.optim.Adam(params, lr=args.lr, betas=(0.9, 0.99), eps=1e-5)
    tied = modules[0].tok.weight if rank == 0 else modules[-1].head.weight
    gen = torch.Generator().manual_seed(args.seed)  # the same windows on both ranks
    offsets = torch.arange(args.context + 1)
    first_loss, start = None, None
    for step in range(args.steps):
        if step == args.skip:
            start = time.perf_counter()
        starts = torch.randint(windows, (micro * args.batch,), generator=gen)
        w = ids[starts.unsqueeze(1) + offsets]
        x, y = w[:, :-1], w[:, 1:]
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        else:
            losses = []
            sched.step(target=y, losses=losses)
            if first_loss is None:
                first_loss = float(sum(l.detach() for l in losses) / len(losses))
        dist.all_reduce(tied.grad)  # the tied embedding's two gradients, summed on both stages
        opt.step()
    elapsed = time.perf_counter() - start
    if rank == world - 1:
        timed = args.steps - args.skip
        out.put((micro * args.batch * args.context * timed / elapsed, first_loss))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", required=True)
    p.add_argument("--micro-batches", default="4,8")
    p.add_argument("--batch", type=int, default=8, help="windows per micro-batch")
    p.add_argument("--schedules", default="1f1b,gpipe", help="1f1b, gpipe, interleaved")
    p.add_argument("--chunks", type=int, default=2, help="chunks per rank under interleaved")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=10, help="steps before the timed ones")
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=int, default=600, help="seconds a configuration may take")
    args = p.parse_args()
    if args.layers % 2:
        p.error("--layers must be even: two stages of equal blocks")
    schedules = args.schedules.split(",")
    if any(s not in ("1f1b", "gpipe", "interleaved") for s in schedules):
        p.error(f"--schedules {args.schedules}: each must be 1f1b, gpipe or interleaved")
    if "interleaved" in schedules and (args.chunks < 1 or args.layers % (2 * args.chunks)):
        p.error(f"--chunks {args.chunks}: --layers {args.layers} must split into 2 x chunks equal parts")
    if not 0 <= args.skip < args.steps:
        p.error("--skip must be below --steps")
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        print("# torch is not installed: nothing to compare (pip install torch)")
        return 0
    print(f"# PyTorch {torch.__version__} pipelining (gloo), GPT {args.layers} layers x {args.embd}, "
          f"context {args.context}, 2 stages, {args.batch} windows per micro-batch, 1 thread per "
          f"stage, {args.steps} steps, the last {args.steps - args.skip} timed")
    ctx = mp.get_context("spawn")
    for schedule in schedules:
        for micro in [int(m) for m in args.micro_batches.split(",")]:
            out = ctx.Queue()
            port = ddp_peer().free_port()
            procs = [ctx.Process(target=rank_main, args=(r, 2, port, args, micro, schedule, out),
                                 daemon=True)
                     for r in range(2)]
            for proc in procs:
                proc.start()
            result = None
            deadline = time.monotonic() + args.timeout
            while result is None:
                try:
                    result = out.get(timeout=1)
                except queue.Empty:
                    failed = [p for p in procs if p.exitcode not in (None, 0)]
                    if failed or time.monotonic() > deadline:
                        for p in procs:
                            p.terminate()
                        why = (f"stage {procs.index(failed[0])} exited with {failed[0].exitcode}"
                               if failed else f"no result within {args.timeout} s")
                        print(f"pp_gpt_torch.py: {schedule}, {micro} micro-batches: {why}", file=sys.stderr)
                        return 1
            rate, loss = result
            for proc in procs:
                proc.join(timeout=60)
            name = f"interleaved ({args.chunks} chunks)" if schedule == "interleaved" else schedule
            print(f"torch pp 2 {name:>5}, {micro:>2} micro-batches of {args.batch}: "
                  f"{rate:>8.0f} chars/s, first loss {loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
