"""bench/pytorch/fsdp.py: a training step of PyTorch's fully sharded data
parallelism (FSDP2, torch.distributed.fsdp.fully_shard) beside its
DistributedDataParallel, on the CPU (gloo), to time beside mgpu's ZeRO-3
(./bench/zero).

    torchrun --nproc-per-node 2 bench/pytorch/fsdp.py [--batch-size N]
        [--steps N] [--warmup N] [--units blocks|whole]

The model is chapter 3's ResNet-18 (bench/pytorch/chapter3.py's resnet18) on
1x28x28 images, weights from normal(0, 0.01), trained with Adam (lr 0.001),
as bench/zero.c's. --batch-size is each process's batch (default 16, as
bench/zero.c's on a CPU); the data are random images and labels drawn once
(seeded, another draw on each rank).

Two wrappers of the same model, each with its own copy:
  ddp   DistributedDataParallel (25 MiB buckets, overlapped);
  fsdp  fully_shard: with --units blocks (the default) each residual block
        is a unit of its own, gathered before its forward and backward
        passes and freed after, and the root holds the rest; with
        --units whole the root alone, one unit.
They take their steps in turn, step by step, the first of each turn
rotating. A step: zero_grad(set_to_none=True), forward, mean
cross-entropy, backward (with the reduction), Adam, then a barrier of the
group. --warmup untimed steps, then --steps timed ones; a step's time is
the longest over the ranks, and the median over the steps is reported.
One line a wrapper:
    RESULT fsdp.py procs=2 batch=16 way=fsdp units=blocks steps=10 step_ms=... min_ms=...
and the ratio:
    RESULT fsdp.py procs=2 batch=16 fsdp_over_ddp=...
"""
import argparse
import os
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chapter3 import Residual, init_weights, resnet18  # noqa: E402


def wrapped(way, units, seed):
    torch.manual_seed(seed)
    net = resnet18()
    net.apply(init_weights)
    if way == "ddp":
        return DDP(net, bucket_cap_mb=25)
    if units == "blocks":
        for module in net.modules():
            if isinstance(module, Residual):
                fully_shard(module)
    fully_shard(net)
    return net


def make_step(model, x, y):
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        dist.barrier()
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=16, help="each process's batch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--units", choices=["blocks", "whole"], default="blocks")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = max(1, len(os.sched_getaffinity(0)) // local_world)
    torch.set_num_threads(threads)

    torch.manual_seed(args.seed * 1000 + rank)
    x = torch.rand(args.batch_size, 1, 28, 28)
    y = torch.tensor([(i * 7 + rank * 3) % 10 for i in range(args.batch_size)], dtype=torch.long)

    ways = ["ddp", "fsdp"]
    steps = {way: make_step(wrapped(way, args.units, args.seed), x, y) for way in ways}
    for _ in range(args.warmup):
        for way in ways:
            steps[way]()
    times = {way: [] for way in ways}
    for s in range(args.steps):
        for way in ways[s % 2:] + ways[:s % 2]:
            t0 = time.perf_counter()
            steps[way]()
            times[way].append(time.perf_counter() - t0)

    median = {}
    if rank == 0:
        print(f"PyTorch {torch.__version__}, ResNet-18 with Adam, {world} process(es) of {threads} thread(s) "
              f"(gloo), batch {args.batch_size} per process; median of {args.steps} steps after "
              f"{args.warmup} of warm-up")
    for way in ways:
        t = torch.tensor(times[way], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank is done
        median[way], fastest = statistics.median(t.tolist()), min(t.tolist())
        if rank == 0:
            print(f"  {way:<5} {median[way] * 1e3:9.2f} ms per step (fastest {fastest * 1e3:.2f})")
            print(f"RESULT fsdp.py procs={world} batch={args.batch_size} way={way} units={args.units} "
                  f"threads={threads} steps={args.steps} step_ms={median[way] * 1e3:.3f} "
                  f"min_ms={fastest * 1e3:.3f}", flush=True)
    if rank == 0:
        print(f"RESULT fsdp.py procs={world} batch={args.batch_size} "
              f"fsdp_over_ddp={median['fsdp'] / median['ddp']:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
