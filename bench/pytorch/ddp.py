"""bench/pytorch/ddp.py: a training step of PyTorch's DistributedDataParallel
on the CPU (gloo), to time beside ./bench/ddp (bench/ddp.sh runs both).

    torchrun --nproc-per-node 2 bench/pytorch/ddp.py [--model lenet|resnet18]
        [--batch-size N] [--steps N] [--warmup N] [--reduce overlapped|after|none|all]

The models are bench/ddp.c's, layer for layer: chapter 2's LeNet (conv
1->20 3x3, ReLU, avg-pool 2, conv 20->50 5x5, ReLU, avg-pool 2, linear
800->128, ReLU, linear 128->10) and chapter 3's ResNet-18
(bench/pytorch/chapter3.py's resnet18), on 1x28x28 images, weights from
normal(0, 0.01) as the book's. --batch-size is each process's batch
(default 256 for LeNet, 32 for ResNet-18); the data are random images and
labels drawn once (seeded, another draw on each rank).

Ways of combining the gradients, as bench/ddp.c's:
  overlapped  DDP as it comes: its 25 MiB buckets are allreduced while the
              backward pass goes on;
  after       the backward pass under no_sync(), then the gradients
              averaged in 25 MiB buckets (flattened, one allreduce each,
              from the last layer back), as DDP would without overlap;
  none        the backward pass under no_sync(): no reduction.
--reduce all wraps one model for each way and times them in turn, step by
step, the first of each turn rotating.

Threads: each process takes its share of the cores it may run on (its
affinity divided by the processes on the machine, at least 1), as mgpu's
processes do; torchrun would otherwise set OMP_NUM_THREADS=1.

A step, as timed: zero_grad(set_to_none=True), forward, mean cross-entropy,
backward (with the reduction), SGD with lr 0.01, then a barrier of the
group, so that the step is over on every rank. --warmup untimed steps,
then --steps timed ones; a step's time is the longest over the ranks, and
the median over the steps is reported, with the fastest. One line a way:
    RESULT ddp.py model=lenet procs=2 batch=256 global_batch=512 reduce=overlapped
           steps=20 step_ms=... min_ms=... images_per_s=...
(one line; images_per_s is the global batch over the median step).
"""
import argparse
import os
import statistics
import sys
import time
import warnings

# (torch from PyPI warns at import when NumPy is missing; nothing here needs it)
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chapter3 import init_weights, resnet18  # noqa: E402

WAYS = ["overlapped", "after", "none"]
BUCKET_BYTES = 25 << 20


def lenet():
    return nn.Sequential(
        nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(20, 50, 5), nn.ReLU(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10))


def buckets(params):
    """The parameters from the last back, in groups of about BUCKET_BYTES."""
    group, size = [], 0
    for p in reversed(params):
        group.append(p)
        size += p.numel() * p.element_size()
        if size >= BUCKET_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


def average_after_backward(params, world):
    for group in buckets(params):
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for p in group:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()


def make_step(way, model, optimizer, x, y, world):
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        optimizer.zero_grad(set_to_none=True)
        if way == "overlapped":
            F.cross_entropy(model(x), y).backward()
        else:
            with model.no_sync():
                F.cross_entropy(model(x), y).backward()
            if way == "after" and world > 1:
                average_after_backward(params, world)
        optimizer.step()
        dist.barrier()
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["lenet", "resnet18"], default="lenet")
    ap.add_argument("--batch-size", type=int, default=0,
                    help="each process's batch (default 256 for lenet, 32 for resnet18)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reduce", choices=WAYS + ["all"], default="overlapped")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = max(1, len(os.sched_getaffinity(0)) // local_world)
    torch.set_num_threads(threads)
    batch = args.batch_size or (32 if args.model == "resnet18" else 256)

    torch.manual_seed(args.seed * 1000 + rank)
    x = torch.rand(batch, 1, 28, 28)
    y = torch.tensor([(i * 7 + rank * 3) % 10 for i in range(batch)], dtype=torch.long)

    ways = WAYS if args.reduce == "all" else [args.reduce]
    steps = {}
    for way in ways:
        torch.manual_seed(args.seed)
        net = resnet18() if args.model == "resnet18" else lenet()
        net.apply(init_weights)
        model = DDP(net, bucket_cap_mb=BUCKET_BYTES >> 20)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        steps[way] = make_step(way, model, optimizer, x, y, world)
    for _ in range(args.warmup):
        for way in ways:
            steps[way]()

    times = {way: [] for way in ways}
    for s in range(args.steps):
        # the ways take turns, the turn's first rotating, as bench/ddp.c's
        for way in ways[s % len(ways):] + ways[:s % len(ways)]:
            t0 = time.perf_counter()
            steps[way]()
            times[way].append(time.perf_counter() - t0)

    global_batch = batch * world
    if rank == 0:
        print(f"PyTorch {torch.__version__} DDP (gloo), {args.model}, {world} process(es) of {threads} "
              f"thread(s), batch {batch} per process, {global_batch} in all; median of {args.steps} steps "
              f"after {args.warmup} of warm-up")
    for way in ways:
        # a step is over when the slowest rank is done with it
        t = torch.tensor(times[way], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        median, fastest = statistics.median(t.tolist()), min(t.tolist())
        if rank == 0:
            print(f"  {way:<10} {median * 1e3:9.2f} ms per step (fastest {fastest * 1e3:.2f}), "
                  f"{global_batch / median:8.1f} images/s")
            print(f"RESULT ddp.py model={args.model} procs={world} batch={batch} global_batch={global_batch} "
                  f"reduce={way} threads={threads} steps={args.steps} step_ms={median * 1e3:.3f} "
                  f"min_ms={fastest * 1e3:.3f} images_per_s={global_batch / median:.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
