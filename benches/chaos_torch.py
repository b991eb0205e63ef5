#!/usr/bin/env python3
"""The chaos campaign's peer: PyTorch DDP (gloo, CPU) under torchrun's elastic agent
(`torchrun --nproc-per-node 2 --max-restarts 3`), the same kill-a-rank trials as
`benches/chaos.py`'s `kill` kind.

The job is the bundled ResNet of `bonfire train vision` (from ddp_mnist_style.py) with Adam, 2
ranks, 64 images per rank per step, 12 steps per epoch, 4 epochs, on seeded random 28x28 images
(bonfire's embedded MNIST slice is compiled into bonfire; the failures and the restart, not the
accuracy, are what is measured here). Rank 0 writes a checkpoint after each epoch (a temporary
file renamed into place) and notes its step after each step, as bonfire's job does; a started
worker resumes from the checkpoint, the pattern torchrun's documentation asks of elastic
programs. A trial survives when torchrun exits 0 and the final weights equal the uninterrupted
run's bit for bit; recovery is the kill to the first step noted after the restart.

Usage: PYTHON=venv/bin/python benches/chaos_torch.py [--trials 10] [--seed 1] [--out DIR]
(torchrun is taken from the same directory as the Python running this script). Without torch it
says so and exits 0.
"""

import argparse
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chaos import progress_mtime as mtime, ranks_of as children_with_rank  # noqa: E402

EPOCHS, STEPS, BATCH = 4, 12, 64


def worker(ckpt):
    import torch
    import torch.distributed as dist

    from ddp_mnist_style import make_resnet

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    torch.manual_seed(42)
    model = torch.nn.parallel.DistributedDataParallel(make_resnet(torch))
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(7)
    images = torch.rand(STEPS * BATCH * world, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (STEPS * BATCH * world,), generator=g)
    start = 0
    path = os.path.join(ckpt, "checkpoint.pt")
    if os.path.exists(path):
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["epoch"]
    for epoch in range(start, EPOCHS):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(100 + epoch))
        mine = order[rank::world]
        for step in range(STEPS):
            idx = mine[step * BATCH:(step + 1) * BATCH]
            opt.zero_grad()
            loss = loss_fn(model(images[idx]), labels[idx])
            loss.backward()
            opt.step()
            loss.item()
            if rank == 0:
                tmp = os.path.join(ckpt, ".progress.tmp")
                with open(tmp, "w") as f:
                    json.dump({"epoch": epoch + 1, "step": step + 1, "steps": STEPS}, f)
                os.replace(tmp, os.path.join(ckpt, "progress.json"))
        if rank == 0:
            tmp = path + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1}, tmp)
            os.replace(tmp, path)
        dist.barrier()
    if rank == 0:
        h = hashlib.sha256()
        for k, v in sorted(model.module.state_dict().items()):
            h.update(k.encode())
            h.update(repr(v.detach().flatten().tolist()).encode())  # exact: repr round-trips
        with open(os.path.join(ckpt, "digest"), "w") as f:
            f.write(h.hexdigest())
    dist.destroy_process_group()


def job(torchrun, ckpt, log):
    os.makedirs(ckpt, exist_ok=True)
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
           os.path.abspath(__file__), "--worker", ckpt]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    lines = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)

    def read():
        with open(log, "w") as f:
            for line in proc.stdout:
                lines.append((time.monotonic(), line))
                f.write(line)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return proc, lines, t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="runs/chaos-torch")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not installed here: skipping the torchrun peer (pip install torch)")
        return
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    os.makedirs(args.out, exist_ok=True)
    ref = os.path.abspath(os.path.join(args.out, "reference"))
    subprocess.run(["rm", "-rf", ref])
    t0 = time.monotonic()
    proc, _, t = job(torchrun, ref, os.path.join(args.out, "reference.log"))
    code = proc.wait()
    duration = time.monotonic() - t0
    t.join(5)
    if code != 0:
        sys.exit(f"the reference run failed (exit {code}); see {args.out}/reference.log")
    reference = open(os.path.join(ref, "digest")).read()
    print(f"reference: {duration:.1f} s, digest {reference[:16]}..., seed {args.seed}")
    rng = random.Random(args.seed)
    results = []
    for i in range(args.trials):
        at = rng.uniform(0.05, 0.65) * duration
        rank = rng.randrange(2)
        ckpt = os.path.abspath(os.path.join(args.out, f"trial-{i:02d}"))
        subprocess.run(["rm", "-rf", ckpt])
        print(f"trial {i:2d}: kill at {at:6.2f} s (rank {rank}) ...", end=" ", flush=True)
        started = time.monotonic()
        proc, lines, t = job(torchrun, ckpt, ckpt + ".log")
        while time.monotonic() < started + at:
            time.sleep(0.01)
        # Not before the workers exist (torchrun takes a few seconds to start them).
        pid = children_with_rank(proc.pid).get(rank)
        while pid is None and proc.poll() is None:
            time.sleep(0.01)
            pid = children_with_rank(proc.pid).get(rank)
        failed_at = recovered_at = None
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            failed_at = time.monotonic()
            # The first step noted after the agent restarted the workers: a new worker of rank 0.
            first = children_with_rank(proc.pid).get(0)
            seen = mtime(ckpt)
            while proc.poll() is None and time.monotonic() < started + 900:
                now0 = children_with_rank(proc.pid).get(0)
                if now0 is not None and now0 != first and now0 != pid:
                    m = mtime(ckpt)
                    if m != seen and m is not None:
                        recovered_at = time.monotonic()
                        break
                else:
                    seen = mtime(ckpt)
                time.sleep(0.005)
        try:
            code = proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = "timeout"
        t.join(5)
        try:
            digest = open(os.path.join(ckpt, "digest")).read()
        except OSError:
            digest = None
        ok = code == 0 and digest == reference
        rec = None if recovered_at is None else round(recovered_at - failed_at, 3)
        results.append({"trial": i, "at_s": round(at, 3), "rank": rank, "killed": failed_at is not None,
                        "exit": code, "survived": ok, "bitwise_equal": digest == reference,
                        "recovery_s": rec, "elapsed_s": round(time.monotonic() - started, 2)})
        print(f"{'survived' if ok else 'FAILED'}; exit {code}; recovery {rec} s; "
              f"{results[-1]['elapsed_s']:.1f} s")
    recs = [r["recovery_s"] for r in results if r["recovery_s"] is not None]
    summary = {"seed": args.seed, "trials": len(results), "survived": sum(r["survived"] for r in results),
               "killed": sum(r["killed"] for r in results),
               "mean_recovery_s": round(statistics.mean(recs), 3) if recs else None,
               "max_recovery_s": max(recs) if recs else None, "reference_s": round(duration, 2),
               "results": results}
    json.dump(summary, open(os.path.join(args.out, "summary.json"), "w"), indent=1)
    print(f"\n{summary['survived']}/{len(results)} survived with bitwise-equal weights "
          f"({summary['killed']} killed a rank); recovery mean {summary['mean_recovery_s']} s, "
          f"max {summary['max_recovery_s']} s")


if __name__ == "__main__":
    main()
