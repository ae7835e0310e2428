"""IDX files (the MNIST format) and a federated MNIST loader over a local directory.

IDX layout (big-endian): two zero bytes, a type byte (0x08 uint8, 0x09 int8, 0x0B int16,
0x0C int32, 0x0D float32, 0x0E float64), a byte with the number of dimensions, one uint32 per
dimension, then the data in C order. MNIST's images have magic 2051 (0x00000803) and its
labels 2049 (0x00000801). Files may be gzip-compressed (``.gz``). Nothing is downloaded.

Spec: ``shared/spec/data.md`` section 4.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import numpy as np

from fl_examples.core.dataset import (
    DataFormatError,
    FederatedDataset,
    _rng,
    class_assignment,
    from_partition,
    partition_by_classes,
    partition_iid,
)
from privkit import _validate as v
from privkit.errors import InvalidParameterError

__all__ = ["read_idx", "write_idx", "load_mnist", "find_mnist_files"]

_CODES: dict[int, np.dtype] = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _is_gz(path: Path) -> bool:
    return path.name.endswith(".gz")


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (optionally ``.gz``) into a native-endian numpy array.

    Raises:
        InvalidParameterError: ``path`` is not a file.
        DataFormatError: bad gzip stream, magic number, dimensions or data length; the
            message names the file and the header field (``magic``, ``dims``, ``data``).
    """
    p = Path(path)
    if not p.is_file():
        raise InvalidParameterError("path", str(p), "an existing IDX file")
    with open(p, "rb") as f:  # an OSError here (no permission, ...) names the file
        try:
            raw = gzip.GzipFile(fileobj=f).read() if _is_gz(p) else f.read()
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise DataFormatError(p, "gzip", f"cannot decompress ({exc})") from None
    if len(raw) < 4:
        raise DataFormatError(p, "magic", f"file has {len(raw)} bytes, fewer than the 4 of a magic")
    zero, code, ndim = struct.unpack(">HBB", raw[:4])
    magic = int.from_bytes(raw[:4], "big")
    if zero != 0:
        raise DataFormatError(p, "magic", f"0x{magic:08x}: the first two bytes must be zero")
    if code not in _CODES:
        raise DataFormatError(p, "magic", f"0x{magic:08x}: unknown type byte 0x{code:02x}")
    if ndim == 0:
        raise DataFormatError(p, "magic", f"0x{magic:08x}: zero dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataFormatError(p, "dims", f"file ends inside the {ndim} dimension sizes")
    shape = struct.unpack(">" + "I" * ndim, raw[4:header])
    dtype = _CODES[code]
    count = math.prod(shape)
    if len(raw) - header != count * dtype.itemsize:
        raise DataFormatError(
            p,
            "data",
            f"{len(raw) - header} data bytes, but shape {shape} of {dtype.name} needs "
            f"{count * dtype.itemsize}",
        )
    arr = np.frombuffer(raw, dtype=dtype, count=count, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (gzip-compressed when ``path`` ends in ``.gz``).

    Example:
        >>> import tempfile, os
        >>> f = os.path.join(tempfile.mkdtemp(), "a-idx1-ubyte.gz")
        >>> write_idx(f, np.arange(5, dtype=np.uint8)); read_idx(f).tolist()
        [0, 1, 2, 3, 4]
    """
    arr = np.asarray(array)
    codes = {dt.newbyteorder("=").str[1:]: c for c, dt in _CODES.items()}
    code = codes.get(arr.dtype.newbyteorder("=").str[1:])
    if code is None or arr.ndim == 0 or arr.ndim > 255:
        raise InvalidParameterError("array", arr.dtype, "an IDX dtype (u1 i1 i2 i4 f4 f8), ndim>=1")
    header = struct.pack(">HBB", 0, code, arr.ndim) + struct.pack(">" + "I" * arr.ndim, *arr.shape)
    body = np.ascontiguousarray(arr, dtype=_CODES[code]).tobytes()
    p = Path(path)
    with gzip.open(p, "wb") if _is_gz(p) else open(p, "wb") as fh:
        fh.write(header + body)


def _find(directory: Path, prefix: str, kind: str, rank: int) -> Path | None:
    for sep in ("-", "."):
        for ext in ("", ".gz"):
            p = directory / f"{prefix}-{kind}{sep}idx{rank}-ubyte{ext}"
            if p.is_file():
                return p
    return None


def find_mnist_files(directory: str | Path) -> dict[str, Path | None]:
    """Locate ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` (``.idx3`` also accepted).

    Returns:
        dict with keys ``train_images``, ``train_labels``, ``test_images``, ``test_labels``;
        missing test files map to None.
    """
    d = Path(directory)
    found = {
        f"{split}_{kind}": _find(d, prefix, kind, rank)
        for split, prefix in (("train", "train"), ("test", "t10k"))
        for kind, rank in (("images", 3), ("labels", 1))
    }
    if found["train_images"] is None or found["train_labels"] is None:
        raise InvalidParameterError(
            "directory",
            str(d),
            "a directory holding train-images-idx3-ubyte[.gz] and train-labels-idx1-ubyte[.gz]",
        )
    if (found["test_images"] is None) != (found["test_labels"] is None):
        raise InvalidParameterError("directory", str(d), "both t10k files or neither")
    return found


def _pair(files: dict[str, Path | None], split: str) -> tuple[Path, Path]:
    images, labels = files[f"{split}_images"], files[f"{split}_labels"]
    assert images is not None and labels is not None  # checked by find_mnist_files
    return images, labels


def _read_pair(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise DataFormatError(
            images_path,
            "magic",
            f"expected 2051 (uint8, 3 dims), got {images.dtype} with {images.ndim} dims",
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise DataFormatError(
            labels_path,
            "magic",
            f"expected 2049 (uint8, 1 dim), got {labels.dtype} with {labels.ndim} dims",
        )
    if len(images) == 0 or 0 in images.shape[1:]:
        raise DataFormatError(images_path, "dims", f"holds no image (shape {images.shape})")
    if len(labels) != len(images):
        raise DataFormatError(
            labels_path, "dims", f"{len(labels)} labels for {len(images)} images in {images_path}"
        )
    if len(labels) and labels.max() > 9:
        raise DataFormatError(labels_path, "data", f"label {labels.max()} is not a digit 0..9")
    x = (images.reshape(len(images), -1) / 255.0).astype(np.float32)
    return x, labels.astype(np.int64)


def load_mnist(
    directory: str | Path,
    *,
    rng: np.random.Generator | int,
    num_clients: int = 30,
    classes_per_client: int | None = None,
) -> FederatedDataset:
    """MNIST from local IDX files, split across clients.

    Pixels are divided by 255 for train and test alike (features in [0, 1], ``||x|| <= 28``).
    With ``classes_per_client=None`` the samples are dealt IID; with k, client i holds k
    label classes (:func:`~fl_examples.core.data.class_assignment`) and each class's samples
    are shared evenly by its holders (label-sorted shards). When the ``t10k`` files exist they
    are partitioned the same way, with the same class assignment, into the clients' test sets;
    otherwise every client's training share is split 90/10.
    """
    gen, seed = _rng(rng)
    k = v.positive_int("num_clients", num_clients)
    files = find_mnist_files(directory)
    x, y = _read_pair(*_pair(files, "train"))
    assignment = None
    if classes_per_client is not None:
        assignment = class_assignment(k, 10, classes_per_client, rng=gen)

    def parts(labels: np.ndarray) -> list:
        if assignment is None:
            return partition_iid(len(labels), k, rng=gen)
        return partition_by_classes(labels, assignment, rng=gen)

    description = {
        "recipe": "mnist_idx",
        "directory": str(directory),
        "files": sorted(p.name for p in files.values() if p is not None),
        "parameters": {
            "num_clients": k,
            "classes_per_client": classes_per_client,
            "partition": "iid" if assignment is None else "classes_per_client",
            "test": "t10k files" if files["test_images"] else "each client split 90/10",
        },
        "preprocessing": "pixel / 255 for train and test alike",
        "feature_l2_bound": 28.0,
        "seed": seed,
    }
    if files["test_images"] is None:
        return from_partition(x, y, parts(y), rng=gen, num_classes=10, description=description)
    x_te, y_te = _read_pair(*_pair(files, "test"))
    tr, te = parts(y), parts(y_te)
    return FederatedDataset(
        tuple(f"c_{i:05d}" for i in range(k)),
        tuple(x[p] for p in tr),
        tuple(y[p] for p in tr),
        tuple(x_te[p] for p in te),
        tuple(y_te[p] for p in te),
        num_features=x.shape[1],
        num_classes=10,
        description=description,
    ).with_pooled_test_heldout("the t10k files (dealt to the clients' test splits, which no "
                               "client trains on; MNIST's own held-out set); public")
