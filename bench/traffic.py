"""bench/traffic.py: what a ResNet-18 training step must cost on a GPU, in
mgpu's design, before any GPU is asked: FLOPs and bytes of device memory
traffic per layer, and the two floors they give (METHOD: count the work,
know the floor, then measure against it).

    python3 bench/traffic.py [--batch 256] [--tflops 495] [--tbps 3.0] [--scratch-mb 64]
                             [--implicit]

The model follows mgpu's code, not an ideal implementation:
  convolution forward   im2col (read x, write col), the product (read col,
                        write the [K, n*P*Q] result), the layout swap with
                        the bias (read that, write y);
  convolution backward  dy swapped to [K, n*P*Q] (read, write), im2col
                        again (read x, write col), dW = G col^T (read G,
                        read col), dcol = W^T G (read G, write col; not
                        for the stem, which needs no dx), col2im (read
                        dcol, write dx), the bias gradient (read dy;
                        only for the shortcut convolutions: before batch
                        norm in training the bias's gradient is exactly 0
                        and is not computed);
  batch norm            forward: statistics (read x), then y (read x,
                        write y), ReLU fused; backward: the two sums (read
                        dy, x), then dx (read dy, x, write dx);
  residual end          bn2's output pass adds the skip and applies the
                        ReLU (one read more than batch norm alone);
                        backward: ReLU's mask (read dy, y, write dsum),
                        and conv1 adds its dx to the skip path's as it
                        writes it (one read more);
  SGD                   read the parameter, its gradient (and the momentum
                        buffer when there is one), write the parameter;
--implicit counts instead a convolution that never writes a col buffer
(an implicit GEMM, as cuDNN's: the products gather x or dy as they go):
forward read x, write y; backward read dy and x for dW, read dy and write
dx for dx, read dy for the bias gradient (where there is one).
The products are counted once each (2 m n k FLOPs; cuBLAS keeps its tiles'
re-reads in the caches) and weights are small beside activations. Every
byte is counted at the device memory's rate, although a col buffer of a
chunk (at most --scratch-mb, mgpu's default 256 MiB on a GPU) may partly
stay in the 50 MB L2 cache between im2col and the product: the measured
time may beat the byte floor for that reason, and bench/profile's
--scratch-mb sweep (bench/gpu_session.sh profile) shows by how much.

Defaults: batch 256 (chapter 3 on one device), an H100 SXM's dense TF32
tensor-core rate (495 TFLOP/s; 67 without tensor cores) and the 3.0 TB/s a
device-to-device copy reached on this workplace's H100 (2026-11-13).
"""
import argparse


def resnet18_layers(batch):
    """(name, kind, shape...) of every layer of the book's ResNet-18 on
    1x28x28 images, in forward order."""
    layers, hw, c = [], 28, 64
    # conv: (..., needs_dx, bias_grad); bias_grad False before batch norm
    layers.append(("stem.conv", "conv", batch, 1, hw, hw, 64, 3, 1, 1, False, False))
    layers.append(("stem.bn", "bn", batch, 64, hw, hw))
    for stage in range(4):
        out = 64 * 2 ** stage
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            name = f"stage{stage + 1}.block{block + 1}"
            layers.append((name + ".conv1", "conv", batch, c, hw, hw, out, 3, stride, 1, True, False))
            hw_out = (hw + 2 - 3) // stride + 1
            layers.append((name + ".bn1", "bn", batch, out, hw_out, hw_out))
            layers.append((name + ".conv2", "conv", batch, out, hw_out, hw_out, out, 3, 1, 1, True, False))
            layers.append((name + ".bn2", "bn", batch, out, hw_out, hw_out))
            if stride != 1 or c != out:
                layers.append((name + ".conv3", "conv", batch, c, hw, hw, out, 1, stride, 0, True, True))
            layers.append((name + ".add_relu", "add", batch, out, hw_out, hw_out))
            c, hw = out, hw_out
    return layers


def conv_cost(n, c, h, w, k, r, stride, pad, needs_dx, bias_grad, scratch_floats, implicit):
    """(FLOPs, bytes, chunks) of one convolution's forward and backward."""
    p = (h + 2 * pad - r) // stride + 1
    npq, crs = n * p * p, c * r * r
    per_image = (crs + k) * p * p
    chunks = -(-n // max(1, min(n, scratch_floats // per_image)))
    x, y, col, kout = n * c * h * w, n * k * p * p, crs * npq, k * npq
    db = y if bias_grad else 0
    if implicit:
        fwd, bwd, chunks = x + y, (y + x) + db + ((y + x) if needs_dx else 0), 1
    else:
        fwd = (x + col) + (col + kout) + (kout + y)
        bwd = 2 * y + (x + col) + (kout + col) + db
        if needs_dx:
            bwd += (kout + col) + (col + x)
    products = 3 if needs_dx else 2
    return products * 2 * k * crs * npq, 4 * (fwd + bwd), chunks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tflops", type=float, default=495.0, help="the products' rate, TFLOP/s")
    ap.add_argument("--tbps", type=float, default=3.0, help="device memory, TB/s (read + write)")
    ap.add_argument("--scratch-mb", type=int, default=64)
    ap.add_argument("--implicit", action="store_true", help="convolutions without a col buffer")
    args = ap.parse_args()
    scratch = args.scratch_mb << 18
    total_flop = total_bytes = 0
    print(f"{'layer':28} {'GFLOP':>8} {'MB moved':>10} {'chunks':>6}")
    for layer in resnet18_layers(args.batch):
        name, kind = layer[0], layer[1]
        chunks = ""
        if kind == "conv":
            flop, moved, chunks = conv_cost(*layer[2:], scratch_floats=scratch,
                                            implicit=args.implicit)
        else:
            n, c, h, w = layer[2:]
            size = n * c * h * w
            flop, moved = 0, 4 * size * (3 + 5 if kind == "bn" else 1 + 4)
        total_flop += flop
        total_bytes += moved
        print(f"{name:28} {flop / 1e9:8.1f} {moved / 1e6:10.1f} {chunks!s:>6}")
    params = 11.2e6  # the network's parameters; SGD with momentum: 4 passes
    total_bytes += 4 * params * 4
    flop_ms = total_flop / (args.tflops * 1e12) * 1e3
    byte_ms = total_bytes / (args.tbps * 1e12) * 1e3
    print(f"{'step':28} {total_flop / 1e9:8.1f} {total_bytes / 1e6:10.1f}")
    print(f"floors at batch {args.batch}: products {flop_ms:.2f} ms at {args.tflops:g} TFLOP/s, "
          f"memory {byte_ms:.2f} ms at {args.tbps:g} TB/s; the larger, {max(flop_ms, byte_ms):.2f} ms "
          f"per step, is {max(flop_ms, byte_ms) * 60000 / args.batch / 1e3:.2f} s per epoch of 60000")


if __name__ == "__main__":
    main()
