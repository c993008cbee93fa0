#!/usr/bin/env python3
"""bench/pytorch/pipeline.py: PyTorch's side of bench/pipeline.c, pipeline parallelism on the CPU.

    python3 bench/pytorch/pipeline.py [--batch-size 2048] [--micro-batches 8] [--steps 10] [--seed 1]

The model is bench/pipeline.c's MLP on random inputs of 1024 features: 16
blocks [Linear(1024, 1024), ReLU] and a classifier Linear(1024, 10),
PyTorch's default initialisation; the loss is the batch's mean
cross-entropy. It is cut into 2 stages of 8 blocks each (stage 0: blocks
1-8; stage 1: blocks 9-16 and the classifier), one process a stage
(torch.multiprocessing spawn, gloo on 127.0.0.1), each with
torch.set_num_threads(1): one core a stage, as mgpu gives each of its 2
CPU devices one core. The data are random (seeded) images and labels in
0..9, the same on both processes.

Three schedules of torch.distributed.pipelining, each stage a
PipelineStage with a micro-batch's input and output given (static
metadata, so no shape inference at the first step), each schedule on
its own copy of the model (the same initial weights):
  naive   ScheduleGPipe with 1 micro-batch: naive model parallelism, one
          stage at work at a time;
  gpipe   ScheduleGPipe with --micro-batches micro-batches (all forward
          passes, then all backward passes);
  1f1b    Schedule1F1B with --micro-batches micro-batches;
  interleaved  ScheduleInterleaved1F1B: the blocks cut in 4 stages of 4
          blocks, process r holding stages r and r + 2 (2 chunks a
          process, Megatron-LM's virtual stages);
  zero-bubble  ScheduleInterleavedZeroBubble (ZB1P) on the 2 stages of
          1f1b's cut, one a process: each backward pass split into the
          input's gradient and the weights', the latter filling the bubble.
How the schedules are driven (torch 2.15's pipelining/schedules.py): the
first stage's step() takes the whole batch and splits it along dim 0, the
last stage's takes target= (split alike) and fills losses= with one loss
a micro-batch; loss_fn(output, target) is called on each micro-batch, and
the stage's gradients, which accumulate over micro-batches (and steps:
zero_grad is ours), are divided by the number of micro-batches at the end
(scale_grads=True), so that with a mean loss each step's gradient is the
whole batch's mean. A step, as
timed on rank 0: a barrier, time.perf_counter, zero_grad, the schedule's
step, an SGD step (lr 0.01), a barrier, time.perf_counter. Each schedule
takes 2 untimed steps, then --steps timed ones; the schedules take turns
round by round (naive, gpipe, 1f1b, naive, ...) so that drift hits them
alike; the medians are reported, with
    RESULT pipeline.py device=cpu batch=2048 micro_batches=8 naive_ms=... gpipe_ms=...
           one_f_one_b_ms=... interleaved_ms=... zero_bubble_ms=... gpipe_speedup=...
           one_f_one_b_speedup=... interleaved_speedup=... zero_bubble_speedup=... steps=10
(one line; a speedup is naive_ms over the schedule's).

Before timing, one check a schedule: the gradients of its first step equal, within
1e-5 relative (per tensor, the largest difference over the largest
reference magnitude), those of the whole model in one process on the same
batch with the same weights; a failure exits with status 1. When
torch.distributed.pipelining cannot run here, one line on stderr says so
and the exit status is 1.
"""
import argparse
import logging
import os
import socket
import statistics
import sys
import time
import warnings

# (torch from PyPI warns at import when NumPy is missing; nothing here needs it)
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

STAGES = 2
TOLERANCE = 1e-5
SCHEDULES = ["naive", "gpipe", "1f1b", "interleaved", "zero-bubble"]
CHUNKS = 2  # interleaved 1F1B: the model cut in CHUNKS * STAGES stages, CHUNKS a process
BLOCKS, WIDTH = 16, 1024


def mlp():
    """The blocks and the classifier, as one Sequential."""
    layers = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def stage_of(model, stage, stages=STAGES):
    """Stage s of `stages` equal runs of blocks; the last one takes the classifier too."""
    per = BLOCKS // stages
    return model[2 * per * stage:2 * per * (stage + 1) if stage + 1 < stages else len(model)]


def data(batch, seed):
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(batch, WIDTH, generator=g), torch.randint(0, 10, (batch,), generator=g)


def first_line(e):
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def worker(rank, a, port):
    """One stage's process; an exception is said in one line on stderr, with its first cause."""
    try:
        run(rank, a, port)
    except Exception as e:
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        why = first_line(e) + (f" ({first_line(cause)})" if cause is not e else "")
        print(f"pipeline.py: torch.distributed.pipelining cannot run on {STAGES} CPU processes "
              f"(rank {rank}): {why}", file=sys.stderr, flush=True)
        sys.exit(1)


def run(rank, a, port):
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    device = torch.device("cpu")
    x, y = data(a.batch_size, a.seed)

    def build(name):
        m = 1 if name == "naive" else a.micro_batches
        torch.manual_seed(a.seed)
        model = mlp()
        chunks = CHUNKS if name == "interleaved" else 1
        total = chunks * STAGES
        mb = a.batch_size // m
        # static metadata: one micro-batch's activation in and out of each
        # stage. Its requires_grad matters: a stage after the first computes
        # and sends its input's gradient, and the stage before waits for its
        # output's, only where the example tensor requires grad (with none,
        # the backward gets None for a gradient); the images need none.
        stages, modules = [], []
        for index in range(rank, total, STAGES):
            module = stage_of(model, index, total)
            shape_in = torch.empty(mb, WIDTH, requires_grad=index > 0)
            shape_out = torch.empty(mb, WIDTH if index + 1 < total else 10, requires_grad=True)
            stages.append(PipelineStage(module, index, total, device, input_args=shape_in,
                                        output_args=shape_out))
            modules.append(module)
        if name in ("interleaved", "zero-bubble"):
            kind = ScheduleInterleaved1F1B if name == "interleaved" else ScheduleInterleavedZeroBubble
            schedule = kind(stages, n_microbatches=m, loss_fn=F.cross_entropy)
        else:
            kind = Schedule1F1B if name == "1f1b" else ScheduleGPipe
            schedule = kind(stages[0], n_microbatches=m, loss_fn=F.cross_entropy)
        params = [q for module in modules for q in module.parameters()]
        optimizer = torch.optim.SGD(params, lr=0.01)
        return params, schedule, optimizer

    runs = {name: build(name) for name in SCHEDULES}

    def step(name, check=False):
        params, schedule, optimizer = runs[name]
        optimizer.zero_grad(set_to_none=True)
        losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        result = None
        if check:
            result = [q.grad.clone() for q in params], losses
        optimizer.step()
        return result

    # the check: each schedule's first step against the whole model in one process
    torch.manual_seed(a.seed)
    whole = mlp()
    loss = F.cross_entropy(whole(x), y)
    loss.backward()
    for name in SCHEDULES[1:]:
        grads, losses = step(name, check=True)
        total = (CHUNKS if name == "interleaved" else 1) * STAGES
        reference = [q.grad for index in range(rank, total, STAGES)
                     for q in stage_of(whole, index, total).parameters()]
        worst = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, reference))
        loss_err = abs(torch.stack(losses).mean().item() - loss.item()) if losses else 0.0
        t = torch.tensor([worst, loss_err], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        worst, loss_err = t.tolist()
        ok = worst <= TOLERANCE
        if rank == 0:
            print(f"check: {name} ({a.micro_batches} micro-batches) gradients against one process's, "
                  f"largest relative difference {worst:.2e} (tolerance {TOLERANCE:.0e}), mean loss "
                  f"{loss.item():.6f} (difference {loss_err:.1e}): {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            dist.destroy_process_group()
            sys.exit(1)

    # (the first of each schedule's 2 untimed steps but naive's was the check's)
    for w in range(2):
        for name in SCHEDULES:
            if name == "naive" or w:
                step(name)
    times = {name: [] for name in SCHEDULES}
    for _ in range(a.steps):
        for name in SCHEDULES:
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            dist.barrier()
            times[name].append(1e3 * (time.perf_counter() - t0))

    if rank == 0:
        ms = {name: statistics.median(times[name]) for name in SCHEDULES}
        fastest = {name: min(times[name]) for name in SCHEDULES}
        print(f"PyTorch {torch.__version__} torch.distributed.pipelining (gloo), {STAGES} stages in "
              f"{STAGES} processes of 1 thread, {BLOCKS}-block MLP, batch {a.batch_size}; median of {a.steps} "
              f"steps after 2 untimed")
        print(f"  {'schedule':<11} {'micro-batches':>13} {'ms/step':>9} {'fastest':>9} {'speedup':>8}")
        for name in SCHEDULES:
            m = 1 if name == "naive" else a.micro_batches
            print(f"  {name:<11} {f'{m} x {a.batch_size // m}':>13} {ms[name]:9.2f} {fastest[name]:9.2f} "
                  f"{ms['naive'] / ms[name]:7.2f}x")
        key = {"naive": "naive", "gpipe": "gpipe", "1f1b": "one_f_one_b", "interleaved": "interleaved",
               "zero-bubble": "zero_bubble"}
        print(f"RESULT pipeline.py device=cpu batch={a.batch_size} micro_batches={a.micro_batches} "
              + " ".join(f"{key[n]}_ms={ms[n]:.3f}" for n in SCHEDULES) + " "
              + " ".join(f"{key[n]}_speedup={ms['naive'] / ms[n]:.3f}" for n in SCHEDULES[1:])
              + f" steps={a.steps}", flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    if a.batch_size % a.micro_batches:
        p.error(f"--batch-size {a.batch_size} is not a multiple of --micro-batches {a.micro_batches}")
    try:
        import torch.distributed.pipelining  # noqa: F401
        if not dist.is_available() or not dist.is_gloo_available():
            raise RuntimeError("torch.distributed with gloo is not available")
    except Exception as e:
        print(f"pipeline.py: torch.distributed.pipelining cannot run here: {e}", file=sys.stderr)
        sys.exit(1)
    # (when a worker fails, spawn warns that it ends the other; the worker has said why)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        mp.spawn(worker, args=(a, free_port()), nprocs=STAGES)
    except mp.ProcessExitedException as e:
        # a worker's exit: the check failed or the pipeline could not run,
        # and the worker said which
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)


if __name__ == "__main__":
    main()
