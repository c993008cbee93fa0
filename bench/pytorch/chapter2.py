"""bench/pytorch/chapter2.py: the book's multi-GPU LeNet from scratch, in
PyTorch, to time beside ./chapter2 (bench/run.sh runs both).

    python3 bench/pytorch/chapter2.py [--devices 1,2] [--epochs 10]
        [--train-samples N] [--device cuda|cpu] [--data DIR]

What runs is the PyTorch code of the book's section (seed 000, section 2),
as the book runs it: a LeNet written with raw parameter tensors
(conv 1->20 3x3, ReLU, 2x2 average pool, conv 20->50 5x5, ReLU, pool,
800->128, ReLU, 128->10; normal(0, 0.01) weights, zero biases), per-sample
cross-entropy summed per device, get_params, the book's allreduce (sum into
the first device, copy back), split_batch through nn.parallel.scatter,
the book's sgd (param -= lr * grad / batch_size, then zero the gradient),
and a training loop that synchronises the GPU after every batch. Batches of
256 from a shuffled DataLoader, lr 0.2, 10 epochs, runs on 1 and 2 devices.

Differences from the book, each for the benchmark's sake:
  - the data are the IDX files mgpu reads (fashion_mnist.py), not a
    torchvision download; the DataLoader draws from a TensorDataset of the
    pixels already divided by 255, in the main process (num_workers=0), so
    the loader costs less than the book's, which converts every image;
  - k devices on a machine with fewer GPUs reuse them (cuda:0 twice on one
    GPU), as mgpu's virtual devices do; nn.parallel.scatter copies to CUDA
    only, so CPU devices (--device cpu) split with torch.chunk, which cuts
    the same ceil(N/k) pieces;
  - on a GPU, PyTorch's default precision (TF32 in cuDNN's convolutions,
    float32 matrix products), which mgpu follows too; --tf32 0 or 1
    changes it as MGPU_TF32 does for mgpu.

Timing, as the book's: the seconds of each epoch's training loop (the test
accuracy is computed after the timer stops), averaged over the epochs.
Each run ends with the book's line and a line for bench/run.sh:
    test acc: 0.82, 2.512 sec/epoch, on [cuda:0]
    RESULT chapter2 devices=1 on=[cuda:0] epochs=10 train_samples=60000 sec_per_epoch=2.512 best_epoch=2.431 test_acc=0.8234
"""
import argparse
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import fashion_mnist


def init_params(scale=0.01):
    """The modified LeNet's parameters, on the CPU."""
    return [torch.randn(20, 1, 3, 3) * scale, torch.zeros(20),
            torch.randn(50, 20, 5, 5) * scale, torch.zeros(50),
            torch.randn(800, 128) * scale, torch.zeros(128),
            torch.randn(128, 10) * scale, torch.zeros(10)]


def lenet(X, params):
    h = F.avg_pool2d(F.relu(F.conv2d(X, params[0], params[1])), kernel_size=2, stride=2)
    h = F.avg_pool2d(F.relu(F.conv2d(h, params[2], params[3])), kernel_size=2, stride=2)
    h = F.relu(h.reshape(h.shape[0], -1) @ params[4] + params[5])
    return h @ params[6] + params[7]


loss = nn.CrossEntropyLoss(reduction="none")


def get_params(params, device):
    """A copy of the parameters on `device`, with gradients."""
    # copy=True: on the CPU .to(cpu) would return the same tensor, and the
    # devices (and the next run) would share one set of parameters
    return [p.to(device, copy=True).requires_grad_() for p in params]


def allreduce(data):
    """The book's: add everything into data[0], then copy the sum back."""
    for i in range(1, len(data)):
        data[0][:] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        data[i][:] = data[0].to(data[i].device)


def scatter(tensor, devices):
    if devices[0].type == "cuda":
        return nn.parallel.scatter(tensor, devices)
    return [chunk.to(d) for chunk, d in zip(tensor.chunk(len(devices)), devices)]


def split_batch(X, y, devices):
    assert X.shape[0] == y.shape[0]
    return scatter(X, devices), scatter(y, devices)


def sgd(params, lr, batch_size):
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad / batch_size
            p.grad.zero_()


def train_batch(X, y, device_params, devices, lr):
    X_shards, y_shards = split_batch(X, y, devices)
    losses = [loss(lenet(X_shard, w), y_shard).sum()
              for X_shard, y_shard, w in zip(X_shards, y_shards, device_params)]
    for l in losses:  # backward on every device
        l.backward()
    with torch.no_grad():  # sum every gradient across the devices
        for i in range(len(device_params[0])):
            allreduce([device_params[c][i].grad for c in range(len(devices))])
    for w in device_params:  # the same step everywhere, with the whole batch size
        sgd(w, lr, X.shape[0])


def evaluate_accuracy(net, loader, device):
    correct = total = 0
    with torch.no_grad():
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            correct += (net(X).argmax(dim=1) == y).sum().item()
            total += y.numel()
    return correct / total


def synchronize(devices):
    if devices[0].type == "cuda":
        torch.cuda.synchronize()


def train(params, devices, train_loader, test_loader, lr, epochs):
    device_params = [get_params(params, d) for d in devices]
    times, test_acc = [], 0.0
    for epoch in range(epochs):
        start = time.perf_counter()
        for X, y in train_loader:
            train_batch(X, y, device_params, devices, lr)
            synchronize(devices)  # the book's torch.cuda.synchronize() per batch
        times.append(time.perf_counter() - start)
        test_acc = evaluate_accuracy(lambda x: lenet(x, device_params[0]), test_loader, devices[0])
        print(f"  epoch {epoch + 1}/{epochs}: test acc {test_acc:.3f}, {times[-1]:.3f} sec",
              file=sys.stderr)
    return times, test_acc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="1,2", help="the runs: numbers of devices (default 1,2)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.2)
    fashion_mnist.add_common_args(ap)
    args = ap.parse_args()
    precision = fashion_mnist.check_device_set_precision(args, "chapter2.py")

    train_set = TensorDataset(*fashion_mnist.load("train", args.data, args.train_samples))
    test_set = TensorDataset(*fashion_mnist.load("test", args.data))
    torch.manual_seed(args.seed)
    train_loader = DataLoader(train_set, args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, args.batch_size)
    params = init_params()
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    print(f"PyTorch {torch.__version__}, {len(train_set)} training images, {args.epochs} epochs, "
          f"batch {args.batch_size}, lr {args.lr}, {precision}")

    for k in (int(n) for n in args.devices.split(",")):
        devices = [torch.device("cuda", i % gpus) if gpus else torch.device("cpu") for i in range(k)]
        names = "[" + ", ".join(str(d) for d in devices) + "]"
        times, test_acc = train(params, devices, train_loader, test_loader, args.lr, args.epochs)
        avg = sum(times) / len(times)
        print(f"test acc: {test_acc:.2f}, {avg:.3f} sec/epoch, on {names}")
        print(f"RESULT chapter2 devices={k} on={names.replace(' ', '')} epochs={args.epochs} "
              f"train_samples={len(train_set)} sec_per_epoch={avg:.4f} best_epoch={min(times):.4f} "
              f"test_acc={test_acc:.4f}", flush=True)


if __name__ == "__main__":
    main()
