#!/usr/bin/env python3
"""tests/make_fixtures.py: the PyTorch side of mgpu's whole-model checks.

Writes tests/fixtures/lenet.bin, resnet18_step.bin and adam.bin with what
PyTorch computes for:
  - the book's from-scratch LeNet (chapter 2): per-sample losses
    (reduction='none') and the gradient of their sum for every parameter;
  - one SGD step of the book's ResNet-18 (chapter 3) in training mode: the
    mean cross-entropy, the gradients of the first convolution, one batch
    norm layer and the last linear layer, and batch norm's running
    statistics after the step;
  - five steps of torch.optim.Adam (with L2 weight decay) and of
    torch.optim.AdamW (decoupled weight decay) on two parameters, from
    gradients given by the formula below: the parameters after the steps.

No weights are stored: every parameter and input is made by a formula that
tests/fixture.h computes the same way in C (value = base + amp * sin(a*i +
b*k) for element i of tensor k), so the fixtures stay a few kilobytes.

Run it where PyTorch is installed (the GPU machine, or `pip install torch`):
    python3 tests/make_fixtures.py            # all of them
    python3 tests/make_fixtures.py adam       # only adam.bin (or lenet, resnet)
File format (little-endian): "MGPUFIX1", uint32 count, then per tensor a
64-byte NUL-padded name, uint32 ndim, uint32 dims[4], float32 values.
"""
import math
import os
import struct

import torch
import torch.nn.functional as F
from torch import nn

torch.use_deterministic_algorithms(True)
HERE = os.path.dirname(os.path.abspath(__file__))


def formula(shape, k, base, amp):
    """Element i of tensor k: base + amp * sin(0.7 i + 1.3 k + 0.1), in
    double, rounded to float (as tests/fixture.h does)."""
    n = math.prod(shape)
    i = torch.arange(n, dtype=torch.float64)
    return (base + amp * torch.sin(0.7 * i + 1.3 * k + 0.1)).float().reshape(shape)


def images(n):
    # k = 1000 marks the input: pixels in [0, 1]
    return formula((n, 1, 28, 28), 1000, 0.5, 0.5)


def write(path, tensors):
    with open(path, "wb") as f:
        f.write(b"MGPUFIX1")
        f.write(struct.pack("<I", len(tensors)))
        for name, t in tensors:
            t = t.detach().float().contiguous()
            dims = list(t.shape) + [1] * (4 - t.dim())
            f.write(name.encode().ljust(64, b"\0"))
            f.write(struct.pack("<5I", t.dim(), *dims))
            f.write(struct.pack(f"<{t.numel()}f", *t.flatten().tolist()))
    print(f"wrote {path} ({len(tensors)} tensors)")


def lenet_fixture():
    shapes = [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]
    params = [formula(s, k, 0.0, 0.1).requires_grad_() for k, s in enumerate(shapes)]
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    x = images(8)
    y = torch.tensor([9, 0, 0, 3, 0, 2, 7, 2])
    h = F.avg_pool2d(F.relu(F.conv2d(x, w1, b1)), 2, 2)
    h = F.avg_pool2d(F.relu(F.conv2d(h, w2, b2)), 2, 2).reshape(8, -1)
    h = F.relu(h @ w3 + b3)
    logits = h @ w4 + b4
    losses = F.cross_entropy(logits, y, reduction="none")
    losses.sum().backward()
    names = ["W1", "b1", "W2", "b2", "W3", "b3", "W4", "b4"]
    out = [("labels", y.float()), ("losses", losses)]
    out += [("grad." + n, p.grad) for n, p in zip(names, params)]
    write(os.path.join(HERE, "fixtures", "lenet.bin"), out)


class Residual(nn.Module):
    """The book's residual block (d2l.Residual)."""

    def __init__(self, cin, cout, use_1x1conv=False, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv3 = nn.Conv2d(cin, cout, 1, stride=stride) if use_1x1conv else None
        self.bn1 = nn.BatchNorm2d(cout)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.conv3 is not None:
            x = self.conv3(x)
        return F.relu(y + x)


def resnet18(num_classes=10, in_channels=1):
    def stage(cin, cout, first):
        return nn.Sequential(
            Residual(cin, cout, use_1x1conv=not first, stride=1 if first else 2),
            Residual(cout, cout))

    return nn.Sequential(
        nn.Conv2d(in_channels, 64, 3, stride=1, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        stage(64, 64, True), stage(64, 128, False), stage(128, 256, False), stage(256, 512, False),
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(512, num_classes))


def resnet_fixture():
    torch.manual_seed(0)
    net = resnet18()
    # Parameters in mgpu's registration order, which is named_parameters()'
    # order; mgpu stores a linear weight as [in, out], PyTorch as [out, in].
    with torch.no_grad():
        for k, (name, p) in enumerate(net.named_parameters()):
            is_bn = p.dim() == 1 and ("bn" in name or name.startswith("1."))
            if p.dim() == 2:  # the linear layer: the formula runs over mgpu's [in, out]
                p.copy_(formula((p.shape[1], p.shape[0]), k, 0.0, 0.05).t())
            elif is_bn and name.endswith("weight"):
                p.copy_(formula(p.shape, k, 1.0, 0.1))
            elif p.dim() == 1:
                p.copy_(formula(p.shape, k, 0.0, 0.1))
            else:
                p.copy_(formula(p.shape, k, 0.0, 0.05))
    net.train()
    x = images(4)
    y = torch.tensor([9, 0, 3, 2])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt.zero_grad()
    logits = net(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in net.named_parameters()}
    opt.step()
    bn = net[4][0].bn1  # stage 2, block 1, bn1
    out = [
        ("labels", y.float()),
        ("logits", logits),
        ("loss", loss.reshape(1)),
        ("grad.stem.conv.weight", grads["0.weight"]),
        ("grad.stem.conv.bias", grads["0.bias"]),
        ("grad.stage2.block1.bn1.weight", grads["4.0.bn1.weight"]),
        ("grad.stage2.block1.bn1.bias", grads["4.0.bn1.bias"]),
        ("grad.fc.weight", grads["9.weight"].t()),
        ("grad.fc.bias", grads["9.bias"]),
        ("stem.bn.running_mean", net[1].running_mean),
        ("stem.bn.running_var", net[1].running_var),
        ("stage2.block1.bn1.running_mean", bn.running_mean),
        ("stage2.block1.bn1.running_var", bn.running_var),
        ("after.fc.bias", net[9].bias),
    ]
    write(os.path.join(HERE, "fixtures", "resnet18_step.bin"), out)


def adam_fixture():
    """A weight [6, 5] and a bias [5]; step s's gradient of tensor k is
    the formula's tensor 100 + 10 s + k."""
    shapes = [(6, 5), (5,)]
    out = []
    for name, opt_class in (("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)):
        params = [formula(s, k, 0.0, 0.5).requires_grad_() for k, s in enumerate(shapes)]
        opt = opt_class(params, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        for step in range(5):
            for k, p in enumerate(params):
                p.grad = formula(p.shape, 100 + 10 * step + k, 0.0, 1.0)
            opt.step()
        out += [(f"{name}.weight", params[0]), (f"{name}.bias", params[1])]
    write(os.path.join(HERE, "fixtures", "adam.bin"), out)


if __name__ == "__main__":
    import sys

    os.makedirs(os.path.join(HERE, "fixtures"), exist_ok=True)
    fixtures = {"lenet": lenet_fixture, "resnet": resnet_fixture, "adam": adam_fixture}
    for name in sys.argv[1:] or fixtures:
        fixtures[name]()
