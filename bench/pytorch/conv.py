"""ResNet-18's convolutions one by one in PyTorch (cuDNN), beside bench/convolutions.c.

    python3 bench/pytorch/conv.py [--batch-size 256] [--steps 20] [--device cuda|cpu] [--tf32 ...]

The same 11 convolutions as bench/convolutions.c (the book's ResNet-18 on 1x28x28
images, with how often each occurs), timed the same way: microseconds per
call, the mean of --steps calls between two synchronisations after one
warm-up call. The passes are the ones autograd runs:
aten.convolution_backward with only the input gradient (dx) or only the
weight gradient (dW) asked for. torch.backends.cudnn.benchmark is on, as
in the tuned chapter-3 variant, and each pass is timed with the tensors
in PyTorch's default layout (NCHW) and in channels-last (NHWC). The last
line is for bench/run.sh:
    RESULT conv_pytorch on=cuda batch=256 nchw_ms=... nhwc_ms=... best_ms=...
where each figure is a step's convolutions, summed with their counts.
"""
import argparse
import time

import torch

from fashion_mnist import check_device_set_precision

# name, count in the network, in channels, out channels, kernel, stride, padding, input size
CASES = [
    ("first 1->64 3x3", 1, 1, 64, 3, 1, 1, 28),
    ("stage1 64->64 3x3", 4, 64, 64, 3, 1, 1, 28),
    ("stage2 64->128 3x3 /2", 1, 64, 128, 3, 2, 1, 28),
    ("stage2 64->128 1x1 /2", 1, 64, 128, 1, 2, 0, 28),
    ("stage2 128->128 3x3", 3, 128, 128, 3, 1, 1, 14),
    ("stage3 128->256 3x3 /2", 1, 128, 256, 3, 2, 1, 14),
    ("stage3 128->256 1x1 /2", 1, 128, 256, 1, 2, 0, 14),
    ("stage3 256->256 3x3", 3, 256, 256, 3, 1, 1, 7),
    ("stage4 256->512 3x3 /2", 1, 256, 512, 3, 2, 1, 7),
    ("stage4 256->512 1x1 /2", 1, 256, 512, 1, 2, 0, 7),
    ("stage4 512->512 3x3", 3, 512, 512, 3, 1, 1, 4),
]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(run, device, steps):
    run()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        run()
    synchronize(device)
    return (time.perf_counter() - start) * 1e6 / steps


def passes(x, w, b, dy, stride, pad, first):
    """The forward and the two gradients, as autograd calls them."""
    def backward(mask):
        return lambda: torch.ops.aten.convolution_backward(
            dy, x, w, [w.shape[0]], [stride, stride], [pad, pad], [1, 1], False, [0, 0], 1, mask)
    runs = {"fwd": lambda: torch.nn.functional.conv2d(x, w, b, stride, pad)}
    if not first:
        runs["dx"] = backward([True, False, False])
    runs["dW"] = backward([False, True, False])
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=0, help="default 256 on a GPU, 32 on the CPU")
    ap.add_argument("--steps", type=int, default=0, help="calls timed per figure (default 20 on a GPU, 2 on the CPU)")
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tf32", choices=["default", "0", "1"], default="default",
                    help="as mgpu's MGPU_TF32 (see fashion_mnist.py)")
    args = ap.parse_args()
    precision = check_device_set_precision(args, "bench/pytorch/conv.py")
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    batch = args.batch_size or (256 if on_gpu else 32)
    steps = args.steps or (20 if on_gpu else 2)
    if batch < 1 or steps < 1:
        raise SystemExit("bench/pytorch/conv.py: --batch-size and --steps must be positive")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(1)
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    print(f"ResNet-18's convolutions in PyTorch {torch.__version__} on {name}, batch {batch}: "
          f"microseconds per call (mean of {steps}); {precision}; cudnn.benchmark on")
    print(f"{'convolution':24} {'count':>5} {'pass':>5} {'GFLOP':>7} {'NCHW':>9} {'NHWC':>9} {'TFLOP/s':>9}")
    step_us = {"nchw": 0.0, "nhwc": 0.0, "best": 0.0}
    step_flop = 0.0
    for i, (label, count, c, k, r, stride, pad, h) in enumerate(CASES):
        x = torch.randn(batch, c, h, h, device=device)
        w = torch.randn(k, c, r, r, device=device) * 0.1
        b = torch.zeros(k, device=device)
        p = (h + 2 * pad - r) // stride + 1
        dy = torch.randn(batch, k, p, p, device=device)
        flop = 2.0 * batch * k * p * p * c * r * r
        layouts = {"nchw": (x, w, dy),
                   "nhwc": tuple(t.contiguous(memory_format=torch.channels_last) for t in (x, w, dy))}
        times = {layout: {pass_name: time_us(run, device, steps)
                          for pass_name, run in passes(*tensors[:2], b, tensors[2], stride, pad, i == 0).items()}
                 for layout, tensors in layouts.items()}
        for pass_name in times["nchw"]:
            nchw, nhwc = times["nchw"][pass_name], times["nhwc"][pass_name]
            best = min(nchw, nhwc)
            print(f"{label if pass_name == 'fwd' else '':24} {count:5} {pass_name:>5} {flop * 1e-9:7.2f} "
                  f"{nchw:9.1f} {nhwc:9.1f} {flop / best * 1e-6:9.1f}")
            step_us["nchw"] += count * nchw
            step_us["nhwc"] += count * nhwc
            step_us["best"] += count * best
            step_flop += count * flop
    print(f"a step's convolutions, {step_flop * 1e-9:.1f} GFLOP: NCHW {step_us['nchw'] * 1e-3:.3f} ms "
          f"({step_flop / step_us['nchw'] * 1e-6:.1f} TFLOP/s), NHWC {step_us['nhwc'] * 1e-3:.3f} ms "
          f"({step_flop / step_us['nhwc'] * 1e-6:.1f} TFLOP/s), the better per pass "
          f"{step_us['best'] * 1e-3:.3f} ms")
    print(f"RESULT conv_pytorch on={args.device} batch={batch} nchw_ms={step_us['nchw'] * 1e-3:.4f} "
          f"nhwc_ms={step_us['nhwc'] * 1e-3:.4f} best_ms={step_us['best'] * 1e-3:.4f}")


if __name__ == "__main__":
    main()
