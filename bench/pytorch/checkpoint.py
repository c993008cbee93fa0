#!/usr/bin/env python3
"""bench/pytorch/checkpoint.py: PyTorch's side of bench/checkpoint.c.

The book's ResNet-18 (bench/pytorch/chapter3.py) cut into mgpu's 12
layers (stem convolution; batch norm with its ReLU; 8 residual blocks;
pooling; flatten with the linear layer), one SGD step (momentum 0.9) on
random 1x28x28 images, plain and through
torch.utils.checkpoint.checkpoint_sequential with 3 segments
(use_reentrant=False), the two in turn step by step, 2 untimed and then
--steps timed each, each step timed to the device's end. Prints the
medians, their ratio, on a GPU the peak memory each allocated, and
    RESULT checkpoint.py device=cpu batch=32 segments=3 plain_ms=... checkpointed_ms=... ratio=...

    python3 bench/pytorch/checkpoint.py [--batch-size B] [--steps N] [--device cpu|cuda]
"""
import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chapter3 import init_weights, resnet18  # noqa: E402


def layers():
    """mgpu's 12 layers of the book's ResNet-18, as one Sequential."""
    net = resnet18()
    net.apply(init_weights)
    conv, bn, relu, *stages, pool, flatten, linear = net
    blocks = [block for stage in stages for block in stage]
    return nn.Sequential(conv, nn.Sequential(bn, relu), *blocks, pool, nn.Sequential(flatten, linear))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--segments", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    dev = torch.device(a.device)
    batch = a.batch_size or (256 if dev.type == "cuda" else 32)
    torch.manual_seed(7)
    x = torch.randn(batch, 1, 28, 28, device=dev)
    y = (torch.arange(batch, device=dev) % 10)
    nets, opts = [], []
    for _ in range(2):
        torch.manual_seed(1)
        net = layers().to(dev).train()
        nets.append(net)
        opts.append(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    loss_fn = nn.CrossEntropyLoss()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times = [[], []]
    peaks = [0, 0]
    for s in range(-2, a.steps):
        for k in range(2):
            sync()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            opts[k].zero_grad(set_to_none=True)
            out = checkpoint_sequential(nets[k], a.segments, x, use_reentrant=False) if k else nets[k](x)
            loss_fn(out, y).backward()
            opts[k].step()
            sync()
            if s >= 0:
                times[k].append(1e3 * (time.perf_counter() - start))
            if dev.type == "cuda":
                peaks[k] = torch.cuda.max_memory_allocated() / 2**20
    plain, cut = statistics.median(times[0]), statistics.median(times[1])
    peak = f", peak memory {peaks[0]:.1f} and {peaks[1]:.1f} MiB" if dev.type == "cuda" else ""
    print(f"ResNet-18 step on {dev.type}, batch {batch}, median of {a.steps}: plain {plain:.2f} ms, "
          f"{a.segments} checkpointed segments {cut:.2f} ms: {cut / plain:.3f}x{peak}")
    print(f"RESULT checkpoint.py device={dev.type} batch={batch} segments={a.segments} plain_ms={plain:.3f} "
          f"checkpointed_ms={cut:.3f} ratio={cut / plain:.4f}")


if __name__ == "__main__":
    main()
