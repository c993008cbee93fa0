"""bench/pytorch/chapter3.py: ResNet-18 on Fashion-MNIST in PyTorch, the
book's way and a tuned way, to time beside ./chapter3 (bench/run.sh runs
all three).

    python3 bench/pytorch/chapter3.py [--variant seed|tuned|both]
        [--epochs 1] [--steps N] [--batch-size 256] [--lr 0.1]
        [--train-samples N] [--test-samples N] [--device cuda|cpu] [--data DIR]
        [--tf32 default|0|1]

The model is the book's ResNet-18 for 28x28 grayscale images (seed 000,
section 3): a 3x3 stem convolution (stride 1, padding 1) with batch norm
and ReLU and no max-pool, four stages of two residual blocks with 64, 128,
256 and 512 channels (the first block of stages 2-4 halves the image with
stride 2 and a 1x1 strided convolution on the shortcut), global average
pooling and a linear layer to 10 classes. Convolutions have biases, as the
book's. Conv and linear weights are drawn from normal(0, 0.01). SGD with
lr 0.1 at batch 256 on one device, mean cross-entropy.

  seed   the book's training loop: nn.DataParallel over the devices (one
         here), a shuffled DataLoader over the images on the host (batches
         copied to the GPU one by one), optimizer.zero_grad / forward /
         backward / step. (The book's timer stops without waiting for the
         GPU; here the epoch ends with torch.cuda.synchronize() so that
         the time covers the work.)
  tuned  the same model, optimizer and batches, as one would write it for
         speed without changing the arithmetic: the whole data set on the
         GPU as one tensor, shuffled there with randperm, no DataParallel,
         torch.backends.cudnn.benchmark = True (cuDNN times its algorithms
         for each shape once and keeps the fastest), channels-last memory
         format. No automatic mixed precision.

Precision, both variants: PyTorch's defaults on a GPU, TF32 in cuDNN's
convolutions and float32 matrix products, which mgpu follows too (its
MGPU_TF32); --tf32 0 makes both float32 everywhere, --tf32 1 TF32 in
every product.

FLOPs. Only the convolutions and the linear layer count (batch norm, ReLU,
the additions and the pooling are a few FLOPs per element, memory-bound).
For each convolution, MACs = H_out * W_out * C_out * C_in * k_h * k_w per
image; for the linear layer, in * out. They are counted with hooks on one
forward pass of one image. One multiply-add is 2 FLOPs, and a training
step costs 3 forward passes (the forward, then the gradients with respect
to the inputs and to the weights, each as large as the forward), so
    FLOP per epoch = 2 * 3 * MACs per image * training images
and TFLOP/s = FLOP per epoch / seconds per epoch.

Timing: the seconds of each epoch's training loop; the test accuracy
(evaluation mode, batches of 256) is computed after the timer stops. The
first epoch includes the start-up (cuDNN's algorithm search, the caching
allocator's first requests), so with --epochs 2 or more the last epoch is
the steady state. --steps N times only the first N steps of each epoch and
extrapolates to a whole epoch (said in the output). Each variant ends with
the book's line and a line for bench/run.sh:
    test acc: 0.91, 18.100 sec/epoch, on [cuda:0] (seed)
    RESULT chapter3 variant=seed on=[cuda:0] epochs=1 steps=235 extrapolated=0 train_samples=60000 sec_per_epoch=... first_epoch=... last_epoch=... test_acc=... macs_per_image=... flop_per_epoch=... tflops=...
"""
import argparse
import math
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import fashion_mnist


class Residual(nn.Module):
    """Two 3x3 convolutions with batch norm; the input added back before the
    last ReLU, through a 1x1 convolution when the shape changes."""

    def __init__(self, in_channels, out_channels, use_1x1conv=False, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.conv3 = nn.Conv2d(in_channels, out_channels, 1, stride=stride) if use_1x1conv else None
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, X):
        Y = F.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        return F.relu(Y + (self.conv3(X) if self.conv3 is not None else X))


def resnet18(num_classes=10, in_channels=1):
    def stage(in_channels, out_channels, first):
        return nn.Sequential(
            Residual(in_channels, out_channels) if first
            else Residual(in_channels, out_channels, use_1x1conv=True, stride=2),
            Residual(out_channels, out_channels))

    return nn.Sequential(
        nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        stage(64, 64, first=True), stage(64, 128, False), stage(128, 256, False), stage(256, 512, False),
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(512, num_classes))


def init_weights(m):
    if type(m) in (nn.Linear, nn.Conv2d):
        nn.init.normal_(m.weight, std=0.01)


def macs_per_image(image_shape=(1, 28, 28)):
    """Multiply-adds of the convolutions and the linear layer for one image."""
    total = 0

    def count(module, inputs, output):
        nonlocal total
        if isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            total += output[0].numel() * module.in_channels // module.groups * kh * kw
        else:
            total += output[0].numel() * module.in_features

    net = resnet18().eval()
    hooks = [m.register_forward_hook(count) for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        net(torch.zeros(1, *image_shape))
    for h in hooks:
        h.remove()
    return total


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_epoch(batches, step, device, max_steps):
    """Runs step(X, y) on the epoch's batches; returns (seconds, steps run)."""
    start, steps = time.perf_counter(), 0
    for X, y in batches:
        if max_steps and steps == max_steps:
            break
        step(X, y)
        steps += 1
    synchronize(device)
    return time.perf_counter() - start, steps


def evaluate_accuracy(net, batches):
    net.eval()
    correct = total = 0
    with torch.no_grad():
        for X, y in batches:
            correct += (net(X).argmax(dim=1) == y).sum().item()
            total += y.numel()
    net.train()
    return correct / total


def seed_variant(net, args, device, train_set, test_set):
    """The book's loop; returns (the network, the batches of an epoch, the
    step, the test batches)."""
    torch.backends.cudnn.benchmark = False  # PyTorch's default
    net.to(device)  # (DataParallel on one device would move it too)
    if device.type == "cuda":
        net = nn.DataParallel(net, device_ids=[device])
    optimizer = torch.optim.SGD(net.parameters(), args.lr)
    criterion = nn.CrossEntropyLoss()
    train_loader = DataLoader(TensorDataset(*train_set), args.batch_size, shuffle=True)

    def step(X, y):
        optimizer.zero_grad()
        X, y = X.to(device), y.to(device)
        criterion(net(X), y).backward()
        optimizer.step()

    test = [(X.to(device), y.to(device)) for X, y in DataLoader(TensorDataset(*test_set), 256)]
    return net, (lambda epoch: train_loader), step, test


def tuned_variant(net, args, device, train_set, test_set):
    """The same, with the data on the device, cudnn.benchmark, channels-last
    and no DataParallel."""
    torch.backends.cudnn.benchmark = True
    fmt = torch.channels_last
    net.to(device, memory_format=fmt)
    optimizer = torch.optim.SGD(net.parameters(), args.lr)
    criterion = nn.CrossEntropyLoss()
    images = train_set[0].to(device).contiguous(memory_format=fmt)
    labels = train_set[1].to(device)
    n, bs = labels.shape[0], args.batch_size

    def batches(epoch):
        order = torch.randperm(n, device=device)
        for i in range(0, n, bs):
            idx = order[i:i + bs]
            yield images[idx].contiguous(memory_format=fmt), labels[idx]

    def step(X, y):
        optimizer.zero_grad()
        criterion(net(X), y).backward()
        optimizer.step()

    test_images = test_set[0].to(device).contiguous(memory_format=fmt)
    test_labels = test_set[1].to(device)
    test = [(test_images[i:i + 256], test_labels[i:i + 256]) for i in range(0, test_labels.shape[0], 256)]
    return net, batches, step, test


VARIANTS = {"seed": seed_variant, "tuned": tuned_variant}


def run(name, args, device, train_set, test_set, macs):
    torch.manual_seed(args.seed)
    net = resnet18()
    net.apply(init_weights)
    net, batches, step, test = VARIANTS[name](net, args, device, train_set, test_set)
    n = train_set[1].shape[0]
    steps_per_epoch = math.ceil(n / args.batch_size)
    times, steps, test_acc = [], steps_per_epoch, 0.0
    for epoch in range(args.epochs):
        seconds, steps = timed_epoch(batches(epoch), step, device, args.steps)
        times.append(seconds * steps_per_epoch / steps)  # a whole epoch, extrapolated if cut short
        test_acc = evaluate_accuracy(net, test)
        print(f"  {name} epoch {epoch + 1}/{args.epochs}: test acc {test_acc:.3f}, {times[-1]:.3f} sec"
              + (f" (extrapolated from {steps} of {steps_per_epoch} steps)" if steps < steps_per_epoch else ""),
              file=sys.stderr)
    avg = sum(times) / len(times)
    flop = 2 * 3 * macs * n
    names = f"[{device}]"
    print(f"test acc: {test_acc:.2f}, {avg:.3f} sec/epoch, on {names} ({name})")
    print(f"RESULT chapter3 variant={name} on={names} epochs={args.epochs} steps={steps} "
          f"extrapolated={int(steps < steps_per_epoch)} train_samples={n} sec_per_epoch={avg:.4f} "
          f"first_epoch={times[0]:.4f} last_epoch={times[-1]:.4f} test_acc={test_acc:.4f} "
          f"macs_per_image={macs} flop_per_epoch={flop:.4e} tflops={flop / times[-1] / 1e12:.3f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=["seed", "tuned", "both"], default="both")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0,
                    help="time only the first N steps of each epoch and extrapolate (0: whole epochs)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--test-samples", type=int, default=0, help="the first N test images (0: all)")
    fashion_mnist.add_common_args(ap)
    args = ap.parse_args()
    precision = fashion_mnist.check_device_set_precision(args, "chapter3.py")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")

    train_set = fashion_mnist.load("train", args.data, args.train_samples)
    test_set = fashion_mnist.load("test", args.data, args.test_samples)
    macs = macs_per_image()
    print(f"PyTorch {torch.__version__} on {device}, {train_set[1].shape[0]} training images, "
          f"{args.epochs} epoch(s), batch {args.batch_size}, lr {args.lr}, {precision}; "
          f"{macs / 1e6:.1f} M multiply-adds per image forward")
    for name in (["seed", "tuned"] if args.variant == "both" else [args.variant]):
        run(name, args, device, train_set, test_set, macs)


if __name__ == "__main__":
    main()
