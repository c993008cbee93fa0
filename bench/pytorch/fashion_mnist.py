"""Fashion-MNIST for the PyTorch reference programs, read from the same IDX
files mgpu reads.

The book gets the data through torchvision (which downloads it); the
benchmark must not download anything and must train on exactly the bytes
the C programs train on, so this reads the four IDX files itself: the
folder from --data, else $MGPU_DATA, else data/fashion-mnist (the lookup
of mgpu_data_dir), each file gzip-compressed or not.

IDX: a big-endian 32-bit magic number whose low byte is the number of
dimensions and whose third byte is the element type (0x08: unsigned byte),
one big-endian 32-bit size per dimension, then the elements. Pixels are
scaled to [0, 1] as torchvision's ToTensor does; labels become int64, as
CrossEntropyLoss wants them. Only what the benchmark needs is checked
(magic, sizes, length): mgpu's reader is the one that validates everything.
"""
import gzip
import os
import struct

import torch

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def data_dir(flag=None):
    for folder in (flag, os.environ.get("MGPU_DATA"), "data/fashion-mnist"):
        if folder and _find(folder, FILES["train"][0]):
            return folder
    raise SystemExit("fashion_mnist: no Fashion-MNIST files in --data, $MGPU_DATA or "
                     "data/fashion-mnist (`make data` fills data/fashion-mnist)")


def _find(folder, name):
    for path in (os.path.join(folder, name + ".gz"), os.path.join(folder, name)):
        if os.path.isfile(path):
            return path
    return None


def read_idx(path):
    """The elements of one IDX file as a uint8 tensor of its shape."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4:
        raise SystemExit(f"{path}: too short for an IDX header")
    magic = struct.unpack(">I", raw[:4])[0]
    ndim, element_type = magic & 0xFF, (magic >> 8) & 0xFF
    if magic >> 16 != 0 or element_type != 0x08 or ndim == 0:
        raise SystemExit(f"{path}: magic number 0x{magic:08x} is not an IDX file of bytes")
    header = 4 + 4 * ndim
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    count = 1
    for size in shape:
        count *= size
    if len(raw) != header + count:
        raise SystemExit(f"{path}: {len(raw) - header} bytes of data, the header says {count}")
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8).reshape(shape)


def load(split, folder=None, samples=0):
    """(images [N, 1, 28, 28] float32 in [0, 1], labels [N] int64) of "train"
    or "test"; the first `samples` of them when samples > 0, as mgpu's
    --train-samples / --test-samples take them."""
    folder = data_dir(folder)
    images_name, labels_name = FILES[split]
    images = read_idx(_find(folder, images_name))
    labels = read_idx(_find(folder, labels_name))
    if images.shape[0] != labels.shape[0]:
        raise SystemExit(f"{folder}: {images.shape[0]} {split} images but {labels.shape[0]} labels")
    if samples > 0:
        images, labels = images[:samples], labels[:samples]
    return images.unsqueeze(1).float().div_(255), labels.long()


def add_common_args(ap):
    """The flags both benchmark programs take (as mgpu's chapters do)."""
    ap.add_argument("--train-samples", type=int, default=0, help="the first N training images (0: all)")
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data", help="Fashion-MNIST folder (else $MGPU_DATA, then data/fashion-mnist)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tf32", choices=["default", "0", "1"], default="default",
                    help="as mgpu's MGPU_TF32: default: PyTorch's defaults (TF32 in cuDNN's "
                         "convolutions, float32 matrix products); 0: float32 everywhere; 1: TF32 in both")


def check_device_set_precision(args, program):
    """Fails clearly when --device cuda has no GPU; then sets which float32
    products may use TF32 (--tf32), the same choice as mgpu's MGPU_TF32,
    explicitly rather than through the defaults of this PyTorch version.
    Returns the setting in words, for the first line of the output."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{program}: --device cuda, but PyTorch sees no GPU")
    conv, matmul = {"default": ("tf32", "ieee"), "0": ("ieee", "ieee"), "1": ("tf32", "tf32")}[args.tf32]
    torch.backends.cudnn.conv.fp32_precision = conv
    torch.backends.cuda.matmul.fp32_precision = matmul
    if args.device != "cuda":
        return "float32 (a CPU)"
    return {"default": "TF32 in convolutions, float32 matrix products (PyTorch's defaults)",
            "0": "float32 everywhere (--tf32 0)", "1": "TF32 in every product (--tf32 1)"}[args.tf32]
