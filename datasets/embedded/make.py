"""Rebuilds the MNIST slice compiled into bonfire-datasets: the first 2,000 training and the first
500 test images and labels, as gzipped IDX files (header sizes rewritten). Run with the directory
holding MNIST's four IDX files (for example the cache's `mnist/`):

    python3 make.py ~/.cache/bonfire/datasets/mnist
"""
import gzip
import struct
import sys
from pathlib import Path


def cut(src: Path, dst: str, n: int) -> None:
    data = src.read_bytes()
    ndims = data[3]
    dims = list(struct.unpack(">" + "I" * ndims, data[4 : 4 + 4 * ndims]))
    item = 1
    for d in dims[1:]:
        item *= d
    body = data[4 + 4 * ndims : 4 + 4 * ndims + n * item]
    header = data[:4] + struct.pack(">" + "I" * ndims, n, *dims[1:])
    # mtime=0 so the output is byte-for-byte reproducible.
    with open(dst, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, compresslevel=9) as g:
        g.write(header + body)


def main() -> None:
    src = Path(sys.argv[1])
    here = Path(__file__).parent
    cut(src / "train-images-idx3-ubyte", str(here / "mnist-train-2000-images.idx.gz"), 2000)
    cut(src / "train-labels-idx1-ubyte", str(here / "mnist-train-2000-labels.idx.gz"), 2000)
    cut(src / "t10k-images-idx3-ubyte", str(here / "mnist-test-500-images.idx.gz"), 500)
    cut(src / "t10k-labels-idx1-ubyte", str(here / "mnist-test-500-labels.idx.gz"), 500)


if __name__ == "__main__":
    main()
