#!/usr/bin/env python3
"""The chaos campaign: training jobs hit by failures at random moments must finish with the
weights of an uninterrupted run, bit for bit.

Each trial runs `bonfire train vision` (the embedded MNIST slice, a small epoch budget) as two
ranks under `bonfire launch --max-restarts 3`, and at a random moment (seeded; the seed and
the moment are printed) does one of:

  kill        SIGKILL a random rank;
  checkpoint  SIGKILL rank 0 while it writes a checkpoint (its temporary directory is on disk;
              if none is seen within the trial, at the moment drawn);
  stall       SIGSTOP a random rank (the launcher's peer timeout is 3 s; the stopped rank is
              never continued by this script);
  launcher    (with --nodes 2) SIGKILL one node's launcher, and start it again a second later,
              as a supervisor would.

With --nodes 2 the job is two launchers of one rank each on 127.0.0.1 (node 0 and node 1).

A trial survives when the job exits 0 and its last checkpoint's weight digest equals the
reference run's (the same job under the same launcher, with nothing injected). Reported per
trial and in all: restarts, recovery time (the failure to the first training step after the
restart, from the step notes rank 0 keeps in the run directory), steps trained again.

Usage: benches/chaos.py [--trials 20] [--seed 1] [--nodes 1|2] [--kinds kill,...] [--bonfire PATH]
                        [--out DIR]
Writes DIR/summary.json and prints a table.
"""

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

PEER_TIMEOUT = 3


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--nodes", type=int, choices=[1, 2], default=1)
    p.add_argument("--bonfire", default="target/release/bonfire")
    p.add_argument("--out", default="runs/chaos")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--train-limit", type=int, default=1536)
    p.add_argument("--timeout", type=float, default=900, help="seconds a trial may take")
    p.add_argument("--kinds", default=None,
                   help="comma-separated kinds to draw from (default: all of the layout's)")
    return p.parse_args()


def ranks_of(pid):
    """{rank: pid} of the children of process `pid` that have RANK in their environment."""
    found = {}
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return found
    for child in children:
        try:
            env = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                found[int(kv[5:])] = int(child)
    return found


class Node:
    """One `bonfire launch` process and its output, each line with the time it arrived."""

    def __init__(self, cmd, env, log):
        self.cmd, self.env = cmd, env
        self.lines = []
        self.log = open(log, "a")
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace", start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self.reader.start()

    def _read(self, proc):
        for line in proc.stdout:
            now = time.monotonic()
            self.lines.append((now, line.rstrip("\n")))
            self.log.write(f"{now:.3f} {line}")
            self.log.flush()

    def ranks(self):
        """{rank: pid} of the ranks this launcher started and that still run."""
        return ranks_of(self.proc.pid)

    def wait(self, deadline):
        try:
            code = self.proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = "timeout"
        self.reader.join(timeout=5)
        return code


def job(args, bonfire, ckpt, out, port, secret):
    """The launchers of one run (not yet started ones are started here)."""
    train = [
        bonfire, "train", "vision", "--dataset", "embedded", "--epochs", str(args.epochs),
        "--train-limit", str(args.train_limit), "--test-limit", "200",
        "--checkpoint-dir", ckpt,
    ]
    env = dict(os.environ, RAYON_NUM_THREADS="1", BONFIRE_DATA_DIR=os.path.join(args.out, "data"))
    common = ["--max-restarts", "3", "--peer-timeout", str(PEER_TIMEOUT), "--join-timeout", "60"]
    if args.nodes == 1:
        cmds = [[bonfire, "launch", "--nproc-per-node", "2", *common, "--", *train, "--ranks", "2"]]
    else:
        cmds = [
            [bonfire, "launch", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
             "--master-addr", f"127.0.0.1:{port}", "--secret-file", secret, *common, "--",
             *train, "--ranks", "2"]
            for n in range(2)
        ]
    return [Node(c, env, f"{out}.node{n}.log") for n, c in enumerate(cmds)]


def digest(ckpt, epochs):
    try:
        state = json.load(open(os.path.join(ckpt, f"epoch-{epochs}", "state.json")))
        return state["history"][-1]["param_digest"]
    except (OSError, KeyError, IndexError, ValueError):
        return None


def free_port():
    import socket
    while True:
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind(("127.0.0.1", 0))
        port = u.getsockname()[1]
        t = socket.socket()
        try:
            t.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            t.close()
            u.close()


def progress_mtime(ckpt):
    try:
        return os.stat(os.path.join(ckpt, "progress.json")).st_mtime_ns
    except OSError:
        return None


def run_trial(args, bonfire, i, kind, at, rank, node, secret, reference):
    name = f"trial-{i:02d}"
    ckpt = os.path.abspath(os.path.join(args.out, name))
    nodes = job(args, bonfire, ckpt, os.path.join(args.out, name), free_port(), secret)
    started = time.monotonic()
    deadline = started + args.timeout
    failed_at = None
    what = ""
    # The failure.
    if kind == "checkpoint":
        # Watch for rank 0's temporary checkpoint directory from the drawn moment on.
        while time.monotonic() < started + at:
            time.sleep(0.01)
        while failed_at is None and time.monotonic() < deadline:
            try:
                tmp = [e for e in os.listdir(ckpt) if e.startswith(".epoch-") and e.endswith(".tmp")]
            except OSError:
                tmp = []
            ranks = nodes[0].ranks()
            if tmp and 0 in ranks:
                os.kill(ranks[0], signal.SIGKILL)
                failed_at, what = time.monotonic(), f"SIGKILL rank 0 writing {tmp[0]}"
            elif nodes[0].proc.poll() is not None:
                break
            else:
                time.sleep(0.0002)
    else:
        while time.monotonic() < started + at:
            time.sleep(0.01)
        if kind == "launcher":
            victim = nodes[node]
            os.kill(victim.proc.pid, signal.SIGKILL)
            failed_at, what = time.monotonic(), f"SIGKILL node {node}'s launcher"
            victim.proc.wait()
            time.sleep(1.0)
            victim.start()
        else:
            owner = nodes[0] if args.nodes == 1 else nodes[rank]
            pid = owner.ranks().get(rank)
            if pid is not None:
                sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
                os.kill(pid, sig)
                failed_at = time.monotonic()
                what = f"{'SIGKILL' if kind == 'kill' else 'SIGSTOP'} rank {rank}"
    # Recovery: the first step noted after a launcher said it restarts the job.
    recovered_at = None
    if failed_at is not None:
        seen = progress_mtime(ckpt)
        restart_line = None
        while time.monotonic() < deadline and all(n.proc.poll() is None for n in nodes[:1]):
            if restart_line is None:
                for n in nodes:
                    for t, line in list(n.lines):
                        if t >= failed_at and "restart" in line and (
                            "restarting the job" in line or "restarts the job" in line
                            or re.search(r"restart \d+: ", line)
                        ):
                            restart_line = t
                            break
                if restart_line is not None:
                    seen = progress_mtime(ckpt)
            else:
                m = progress_mtime(ckpt)
                if m != seen:
                    recovered_at = time.monotonic()
                    break
            time.sleep(0.005)
    codes = [n.wait(deadline) for n in nodes]
    elapsed = time.monotonic() - started
    text = "\n".join(line for n in nodes for _, line in n.lines)
    restarts = max([int(x) for x in re.findall(r"restart (\d+): ", text)] or [0])
    redone = sum(int(x) for x in re.findall(r"; (\d+) steps? done before the failure", text))
    final = digest(ckpt, args.epochs)
    ok = all(c == 0 for c in codes) and final == reference
    return {
        "trial": i,
        "kind": kind,
        "at_s": round(at, 3),
        "injected": what or "nothing (the run ended first)",
        "exit": codes,
        "survived": ok,
        "bitwise_equal": final == reference,
        "restarts": restarts,
        "recovery_s": None if recovered_at is None else round(recovered_at - failed_at, 3),
        "steps_redone": redone,
        "elapsed_s": round(elapsed, 2),
    }


def main():
    args = parse_args()
    bonfire = os.path.abspath(args.bonfire)
    os.makedirs(args.out, exist_ok=True)
    secret = os.path.abspath(os.path.join(args.out, "secret"))
    with open(secret, "w") as f:
        f.write("chaos-campaign-secret-" + os.urandom(16).hex())
    # The reference: the same job under the same launcher(s), nothing injected.
    ref_dir = os.path.abspath(os.path.join(args.out, "reference"))
    subprocess.run(["rm", "-rf", ref_dir])
    t0 = time.monotonic()
    nodes = job(args, bonfire, ref_dir, os.path.join(args.out, "reference"), free_port(), secret)
    codes = [n.wait(t0 + args.timeout) for n in nodes]
    duration = time.monotonic() - t0
    reference = digest(ref_dir, args.epochs)
    if any(c != 0 for c in codes) or reference is None:
        sys.exit(f"the reference run failed (exit {codes}); see {args.out}/reference.node*.log")
    print(f"reference: {duration:.1f} s, digest {reference[:16]}..., seed {args.seed}, {args.nodes} node(s)")
    rng = random.Random(args.seed)
    kinds = ["kill", "checkpoint", "stall"] + (["launcher"] if args.nodes == 2 else [])
    if args.kinds:
        asked = args.kinds.split(",")
        unknown = [k for k in asked if k not in kinds]
        if unknown:
            sys.exit(f"--kinds: {unknown} not among {kinds}")
        kinds = asked
    results = []
    for i in range(args.trials):
        kind = rng.choice(kinds)
        at = rng.uniform(0.05, 0.65) * duration
        rank = rng.randrange(2)
        node = rng.randrange(2)
        subprocess.run(["rm", "-rf", os.path.join(args.out, f"trial-{i:02d}")])
        print(f"trial {i:2d}: {kind:10s} at {at:6.2f} s (rank {rank}, node {node}) ...", end=" ", flush=True)
        r = run_trial(args, bonfire, i, kind, at, rank, node, secret, reference)
        results.append(r)
        rec = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.2f} s"
        print(f"{'survived' if r['survived'] else 'FAILED'}; {r['injected']}; restarts {r['restarts']}, "
              f"recovery {rec}, steps redone {r['steps_redone']}, {r['elapsed_s']:.1f} s")
    survived = sum(r["survived"] for r in results)
    hit = sum(r["injected"] != "nothing (the run ended first)" for r in results)
    recoveries = [r["recovery_s"] for r in results if r["recovery_s"] is not None]
    summary = {
        "seed": args.seed,
        "nodes": args.nodes,
        "trials": len(results),
        "failures_injected": hit,
        "survived": survived,
        "bitwise_equal": sum(r["bitwise_equal"] for r in results),
        "restarts": sum(r["restarts"] for r in results),
        "mean_recovery_s": round(statistics.mean(recoveries), 3) if recoveries else None,
        "max_recovery_s": max(recoveries) if recoveries else None,
        "steps_redone": sum(r["steps_redone"] for r in results),
        "reference_s": round(duration, 2),
        "peer_timeout_s": PEER_TIMEOUT,
        "results": results,
    }
    json.dump(summary, open(os.path.join(args.out, "summary.json"), "w"), indent=1)
    print(f"\n{survived}/{len(results)} trials survived with bitwise-equal weights "
          f"({hit} had a failure injected; the others ended before the moment drawn); "
          f"{summary['restarts']} restarts; recovery mean {summary['mean_recovery_s']} s, "
          f"max {summary['max_recovery_s']} s; {summary['steps_redone']} steps trained again")
    sys.exit(0 if survived == len(results) else 1)


if __name__ == "__main__":
    main()
