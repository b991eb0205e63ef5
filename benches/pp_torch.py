#!/usr/bin/env python3
"""PyTorch pipeline parallelism (torch.distributed.pipelining over gloo), the peer for
`benches/pp_bubble.sh`.

The same model and step as the book's pipeline program (`book/programs/src/bin/pipeline.rs`): a
character model of an embedding (vocabulary 128, width 64), 4 transformer encoder layers (4
heads, feed-forward 256, post-norm, GELU as Burn's default, dropout 0, causal mask) and a linear head, trained with
Adam (lr 3e-3) on 16 windows of 32 bytes of the same sonnet per step, the batch cut into M
micro-batches; split one stage per process by layers (stage 0 holds the embedding, the last the
head), under ScheduleGPipe or Schedule1F1B. Each stage prints its step time over steps 5-29
(their sum over 25, as the bonfire program does) and, from the last stage, the first loss.

    python3 benches/pp_torch.py [--stages 2] [--micro-batches 4,8,16] [--schedules gpipe,1f1b]

Each configuration runs as its own set of processes on 127.0.0.1 with one thread each.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

TEXT = (
    "Shall I compare thee to a summer's day?\n"
    "Thou art more lovely and more temperate:\n"
    "Rough winds do shake the darling buds of May,\n"
    "And summer's lease hath all too short a date;\n"
    "Sometime too hot the eye of heaven shines,\n"
    "And often is his gold complexion dimm'd;\n"
    "And every fair from fair sometime declines,\n"
    "By chance or nature's changing course untrimm'd;\n"
    "But thy eternal summer shall not fade,\n"
    "Nor lose possession of that fair thou ow'st;\n"
    "Nor shall death brag thou wander'st in his shade,\n"
    "When in eternal lines to time thou grow'st:\n"
    "So long as men can breathe or eyes can see,\n"
    "So long lives this, and this gives life to thee.\n"
)
VOCAB, WIDTH, LAYERS, CONTEXT, BATCH, STEPS = 128, 64, 4, 32, 16, 30


def batch(step):
    """The book's `text::batch(step, 0, BATCH, CONTEXT)`: the same windows."""
    tokens = list(TEXT.encode())
    starts = len(tokens) - CONTEXT - 1
    xs, ys = [], []
    for row in range(BATCH):
        start = (step * 131 + row * 37) % starts
        xs.append(tokens[start : start + CONTEXT])
        ys.append(tokens[start + 1 : start + CONTEXT + 1])
    return torch.tensor(xs), torch.tensor(ys)


class Stage(nn.Module):
    def __init__(self, first, last, layers):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH) if first else None
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                WIDTH, 4, 4 * WIDTH, dropout=0.0, activation="gelu", batch_first=True
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(WIDTH, VOCAB) if last else None
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False
        )

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x, src_mask=self.mask, is_causal=True)
        if self.head is not None:
            x = self.head(x)
        return x


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def run(rank, world, port, micro, schedule_name, out):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    per = LAYERS // world
    model = Stage(rank == 0, rank == world - 1, per)
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    sched = kind(stage, micro, loss_fn=loss_fn)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3, eps=1e-5)
    total, first_loss = 0.0, None
    for step in range(STEPS):
        x, y = batch(step)
        started = time.perf_counter()
        optim.zero_grad()
        if rank == 0 and world > 1:
            sched.step(x)
        elif rank == world - 1:
            losses = []
            if world == 1:
                sched.step(x, target=y, losses=losses)
            else:
                sched.step(target=y, losses=losses)
            if first_loss is None:
                first_loss = float(sum(l.detach() for l in losses) / len(losses))
        else:
            sched.step()
        optim.step()
        if step >= 5:
            total += time.perf_counter() - started
    out.put((rank, total / (STEPS - 5) * 1000, first_loss))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", default="4,8,16")
    p.add_argument("--schedules", default="gpipe,1f1b")
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    port = 29650
    for schedule in a.schedules.split(","):
        for micro in [int(m) for m in a.micro_batches.split(",")]:
            port += 1
            out = ctx.Queue()
            procs = [
                ctx.Process(target=run, args=(r, a.stages, port, micro, schedule, out))
                for r in range(a.stages)
            ]
            for proc in procs:
                proc.start()
            rows = sorted(out.get(timeout=600) for _ in procs)
            for proc in procs:
                proc.join(timeout=60)
            for rank, ms, loss in rows:
                extra = f", first loss {loss:.4f}" if loss is not None else ""
                print(f"torch stage {rank} of {a.stages}, {schedule}, {micro} micro-batches: step {ms:.1f} ms{extra}")


if __name__ == "__main__":
    main()
