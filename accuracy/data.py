"""Image classification data for training and accuracy studies, all read offline.

Six sources, each giving float32 images (n, C, H, W) scaled to [0, 1] and int64 labels:

- `digits`: scikit-learn's 8x8 handwritten digits (1,797 images, shipped with the package),
  upsampled bilinearly to the model's image size (smooth patches rather than blocks of
  repeated pixels, whose few distinct values a large codebook would quantise exactly).
- `pairs`: a harder task the project generates itself, deterministic from a seed: two digits
  on a canvas twice their size (top-left a, bottom-right b), label a + b (19 classes). The
  tokens in row-major order put b on another device than the CLS token, so the class depends
  on how exactly the peers' tokens cross the link. Each split of pairs is drawn only from the
  same split of the digits.
- `glyphs`: glyph pairs (accuracy.glyphs), generated from a seed in any number: 64 classes,
  test splits as large as a study's sampling error needs.
- `cifar`: CIFAR-format python batches (`data_batch_*`, `test_batch`, or CIFAR-100's
  `train`/`test`): pickled dicts with `data` (n, 3072) uint8 and `labels` or `fine_labels`.
  They are read with an unpickler that only builds numpy arrays and plain containers.
- `folder`: an image folder, one subfolder per class (sorted names are the class order), of
  `.npy` arrays (H, W) or (H, W, C) and, because Pillow is installed here, PNG/JPEG/BMP files.
- `fashion`: Zalando's Fashion-MNIST as Debian's `dataset-fashion-mnist` package installs it
  (`/usr/share/datasets/fashion-mnist/*-idx?-ubyte.gz`): 60,000 training and 10,000 test
  images, 28x28 grey, 10 classes. Real photographs of clothes that nobody here made; the
  test split is the published one, the validation split is carved from the training set.

Splits are fixed by `split_seed`, independent of the seeds that vary training, so every seed of
a study is measured on the same test images. A validation split is carved from the training
data for choices (never the test split).
"""

from __future__ import annotations

import io
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from tracevq.errors import TraceError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


class DataError(TraceError):
    """A data file or folder cannot be used; the message names the file."""


@dataclass
class Dataset:
    """Images with labels. `size`: images are resized to size x size when taken (CIFAR at
    224 px would not fit in memory resized all at once)."""

    images: Tensor  # (n, C, H, W) float32, in [0, 1] until normalised
    labels: Tensor  # (n,) int64
    classes: list[str]
    size: int | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: Tensor | slice) -> Tensor:
        """The images at `index`, at the model's size: (n, C, size, size)."""
        images = self.images[index]
        return images if self.size is None else resize(images, self.size, clamp=False)

    def subset(self, index: Tensor | np.ndarray) -> Dataset:
        index = torch.as_tensor(index, dtype=torch.long)
        return Dataset(self.images[index], self.labels[index], self.classes, self.size)


@dataclass
class Splits:
    train: Dataset
    val: Dataset
    test: Dataset


def resize(images: Tensor, size: int, clamp: bool = True) -> Tensor:
    """Bilinear resize of (n, C, H, W) to (n, C, size, size); unchanged if already that size.
    `clamp` keeps [0, 1] images in range (normalised images are not clamped)."""
    if images.shape[-2:] == (size, size):
        return images
    resized = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return resized.clamp(0.0, 1.0) if clamp else resized


def match_channels(images: Tensor, channels: int, source: str) -> Tensor:
    """Grey to RGB by repetition, RGB to grey by the mean; anything else is an error."""
    have = images.shape[1]
    if have == channels:
        return images
    if have == 1:
        return images.expand(-1, channels, -1, -1).contiguous()
    if channels == 1:
        return images.mean(dim=1, keepdim=True)
    raise DataError(f"{source}: images have {have} channels, the model expects {channels}")


def split_off(data: Dataset, count: int, seed: int) -> tuple[Dataset, Dataset]:
    """A random (rest, held-out) split with exactly `count` held-out images, stratified by
    class (largest-remainder shares)."""
    if not 0 < count < len(data):
        raise DataError(f"cannot hold out {count} of {len(data)} images")
    rng = np.random.default_rng(seed)
    labels = data.labels.numpy()
    classes, sizes = np.unique(labels, return_counts=True)
    shares = count * sizes / len(labels)
    quota = np.floor(shares).astype(int)
    quota[np.argsort(quota - shares)[: count - quota.sum()]] += 1
    held = [
        rng.permutation(np.flatnonzero(labels == label))[:take]
        for label, take in zip(classes, quota, strict=True)
    ]
    mask = np.zeros(len(labels), dtype=bool)
    mask[np.concatenate(held)] = True
    return data.subset(np.flatnonzero(~mask)), data.subset(np.flatnonzero(mask))


def digits_splits(
    image_size: int = 16, test_size: int = 400, val_size: int = 200, split_seed: int = 0
) -> Splits:
    """scikit-learn's digits, upsampled, with fixed test and validation splits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
    data = Dataset(
        resize(images, image_size),
        torch.from_numpy(digits.target.astype(np.int64)),
        [str(d) for d in range(10)],
    )
    rest, test = split_off(data, test_size, split_seed)
    train, val = split_off(rest, val_size, split_seed + 1)
    return Splits(train, val, test)


# --------------------------------------------------------------------------- digit pairs


def pair_dataset(digits: Dataset, count: int, seed: int, noise: float = 0.05) -> Dataset:
    """`count` images of two digits: a in the top-left quadrant, b in the bottom-right one,
    label a + b (19 classes). The canvas is twice the digits' size; the other two quadrants
    hold faint noise.

    Tokens are in row-major order, so with two devices the top half (a, and the CLS token)
    is on device 0 and b lies entirely on device 1: the class needs what the peers send to be
    exact enough to tell b apart.
    """
    size = digits.images.shape[-1]
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(len(digits), (count,), generator=generator)
    second = torch.randint(len(digits), (count,), generator=generator)
    images = noise * torch.rand(
        count, digits.images.shape[1], 2 * size, 2 * size, generator=generator
    )
    images[:, :, :size, :size] = digits.images[first]
    images[:, :, size:, size:] = digits.images[second]
    labels = digits.labels[first] + digits.labels[second]
    return Dataset(images.clamp(0.0, 1.0), labels, [str(s) for s in range(19)])


def digit_pairs_splits(
    image_size: int = 24,
    train_size: int = 4000,
    val_size: int = 600,
    test_size: int = 1000,
    digits_test_size: int = 400,
    split_seed: int = 0,
) -> Splits:
    """Digit pairs on an image_size canvas; each split is built only from the same split of
    the digits (no digit of a test pair was seen in training), drawn with fixed seeds."""
    if image_size % 2:
        raise DataError(f"digit pairs need an even image size, got {image_size}")
    digits = digits_splits(image_size // 2, digits_test_size, split_seed=split_seed)
    return Splits(
        pair_dataset(digits.train, train_size, 1000 * split_seed + 1),
        pair_dataset(digits.val, val_size, 1000 * split_seed + 2),
        pair_dataset(digits.test, test_size, 1000 * split_seed + 3),
    )


# --------------------------------------------------------------------------- glyph pairs


def glyph_pairs_splits(
    image_size: int = 24,
    glyphs: int = 8,
    train_size: int = 30000,
    val_size: int = 2000,
    test_size: int = 60000,
    split_seed: int = 0,
) -> Splits:
    """Glyph pairs (accuracy.glyphs): every split drawn from its own seed with the same
    prototypes, so a test image is never a training image and the test split can be as large
    as the study's sampling error needs."""
    from accuracy.glyphs import glyph_pairs, glyph_prototypes

    prototypes = glyph_prototypes(glyphs, 1000 * split_seed)
    classes = [f"{a}-{b}" for a in range(glyphs) for b in range(glyphs)]

    def split(count: int, offset: int) -> Dataset:
        images, labels = glyph_pairs(prototypes, count, 1000 * split_seed + offset)
        return Dataset(resize(images, image_size), labels, classes)

    return Splits(split(train_size, 1), split(val_size, 2), split(test_size, 3))


# --------------------------------------------------------------------------- CIFAR


class _ArrayUnpickler(pickle.Unpickler):
    """Builds numpy arrays and plain containers only: a CIFAR batch needs nothing else."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def read_cifar_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-format batch: images (n, 3, 32, 32) uint8 and labels (n,) int64."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"CIFAR batch not found: {path}")
    try:
        batch = _ArrayUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
    except Exception as error:  # noqa: BLE001 - any unpickling failure means a bad file
        raise DataError(f"CIFAR batch {path} cannot be read: {error}") from error
    if not isinstance(batch, dict):
        raise DataError(f"CIFAR batch {path}: expected a dict, found {type(batch).__name__}")
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    label_key = next((k for k in ("fine_labels", "labels") if k in batch), None)
    if "data" not in batch or label_key is None:
        raise DataError(
            f"CIFAR batch {path}: needs keys 'data' and 'labels' (or 'fine_labels'), "
            f"has {sorted(batch)}"
        )
    data = np.asarray(batch["data"])
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise DataError(
            f"CIFAR batch {path}: 'data' must be (n, 3072) with one label per row, "
            f"got {data.shape} and {labels.shape[0]} labels"
        )
    return data.reshape(-1, 3, 32, 32).astype(np.uint8), labels


def cifar_splits(
    root: str | Path,
    image_size: int = 32,
    channels: int = 3,
    val_size: int = 1000,
    split_seed: int = 0,
) -> Splits:
    """CIFAR-10 (`data_batch_*`, `test_batch`) or CIFAR-100 (`train`, `test`) from `root`.
    Images stay at 32 px in memory and are resized to image_size when taken."""
    root = Path(root)
    train_files = sorted(root.glob("data_batch_*")) or sorted(root.glob("train"))
    test_files = sorted(root.glob("test_batch")) or sorted(root.glob("test"))
    if not train_files or not test_files:
        raise DataError(
            f"{root}: no CIFAR batches (expected data_batch_* and test_batch, or train and test)"
        )

    def load(files: list[Path]) -> Dataset:
        parts = [read_cifar_batch(f) for f in files]
        images = torch.from_numpy(np.concatenate([p[0] for p in parts])).float() / 255.0
        labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        images = match_channels(images, channels, str(files[0]))
        classes = [str(c) for c in range(int(labels.max()) + 1)]
        return Dataset(images, labels, classes, size=image_size if image_size != 32 else None)

    train, test = load(train_files), load(test_files)
    rest, val = split_off(train, min(val_size, len(train) // 5) or 1, split_seed)
    return Splits(rest, val, test)


# --------------------------------------------------------------------------- image folders


def read_image(path: Path) -> np.ndarray:
    """(H, W, C) float32 in [0, 1] from a .npy array or an image file."""
    try:
        if path.suffix == ".npy":
            array = np.load(path, allow_pickle=False)
        else:
            from PIL import Image

            with Image.open(path) as image:
                array = np.asarray(image.convert("RGB" if image.mode != "L" else "L"))
    except Exception as error:  # noqa: BLE001 - any reader failure means a bad file
        raise DataError(f"image {path} cannot be read: {error}") from error
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3):
        raise DataError(f"image {path}: expected (H, W), (H, W, 1) or (H, W, 3), {array.shape}")
    if array.dtype == np.uint8:
        return array.astype(np.float32) / 255.0
    array = array.astype(np.float32)
    if array.min() < 0.0 or array.max() > 1.0:
        raise DataError(f"image {path}: float values must lie in [0, 1]")
    return array


def folder_dataset(root: str | Path, image_size: int, channels: int = 3) -> Dataset:
    """Every image under root/<class>/; classes in sorted order."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"image folder not found: {root}")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"{root}: no class subfolders")
    images, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(
            f for f in (root / name).iterdir() if f.suffix.lower() in (*IMAGE_SUFFIXES, ".npy")
        )
        for file in files:
            array = torch.from_numpy(read_image(file)).permute(2, 0, 1)[None]  # (1, C, H, W)
            images.append(resize(match_channels(array, channels, str(file)), image_size))
            labels.append(label)
    if not images:
        raise DataError(f"{root}: no images (.npy or {', '.join(IMAGE_SUFFIXES)}) in {classes}")
    return Dataset(torch.cat(images), torch.tensor(labels), classes)


def folder_splits(
    root: str | Path,
    image_size: int,
    channels: int = 3,
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    split_seed: int = 0,
) -> Splits:
    """root/train and root/test (and root/val) if present, else random splits of root."""
    root = Path(root)
    if (root / "train").is_dir() and (root / "test").is_dir():
        train = folder_dataset(root / "train", image_size, channels)
        test = folder_dataset(root / "test", image_size, channels)
        if test.classes != train.classes:
            raise DataError(f"{root}: train and test have different class folders")
        if (root / "val").is_dir():
            return Splits(train, folder_dataset(root / "val", image_size, channels), test)
        rest, val = split_off(train, max(1, round(val_fraction * len(train))), split_seed)
        return Splits(rest, val, test)
    data = folder_dataset(root, image_size, channels)
    rest, test = split_off(data, max(1, round(test_fraction * len(data))), split_seed)
    train, val = split_off(rest, max(1, round(val_fraction * len(data))), split_seed + 1)
    return Splits(train, val, test)


# --------------------------------------------------------------------------- Fashion-MNIST

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
# file: (count, IDX magic: 0x801 labels (n,), 0x803 images (n, 28, 28))
FASHION_FILES = {
    "train-images-idx3-ubyte.gz": (60_000, 0x803),
    "train-labels-idx1-ubyte.gz": (60_000, 0x801),
    "t10k-images-idx3-ubyte.gz": (10_000, 0x803),
    "t10k-labels-idx1-ubyte.gz": (10_000, 0x801),
}
FASHION_INSTALL = "apt-get install dataset-fashion-mnist (Debian's package of the dataset)"


def read_idx(path: Path, count: int, magic: int) -> np.ndarray:
    """An IDX file (gzip-compressed) of uint8: `count` labels, or `count` 28x28 images;
    DataError naming the file when its header, shape or size is not that."""
    import gzip

    try:
        with gzip.open(path, "rb") as stream:
            data = stream.read()
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error}); {FASHION_INSTALL}") from None
    dims = magic & 0xFF
    header = 4 + 4 * dims
    if len(data) < header or int.from_bytes(data[:4], "big") != magic:
        raise DataError(f"{path}: not an IDX file of uint8 with {dims} dimensions")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    wanted = (count,) if dims == 1 else (count, 28, 28)
    if shape != wanted or len(data) != header + int(np.prod(shape)):
        raise DataError(
            f"{path}: holds {shape} in {len(data) - header} bytes, Fashion-MNIST's is {wanted}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def fashion_splits(
    root: str | Path | None = None,
    image_size: int = 28,
    channels: int = 1,
    val_size: int = 5000,
    split_seed: int = 0,
) -> Splits:
    """Fashion-MNIST: the published 10,000 test images; `val_size` training images held out
    (stratified, fixed by `split_seed`) for choices; the rest to train on."""
    root = Path(root) if root is not None else FASHION_DIR
    missing = [name for name in FASHION_FILES if not (root / name).is_file()]
    if missing:
        raise DataError(f"{root}: Fashion-MNIST's {', '.join(missing)} missing; {FASHION_INSTALL}")
    arrays = {name: read_idx(root / name, *spec) for name, spec in FASHION_FILES.items()}

    def dataset(prefix: str) -> Dataset:
        images = torch.from_numpy(arrays[f"{prefix}-images-idx3-ubyte.gz"].astype(np.float32))
        images = match_channels(images.unsqueeze(1) / 255.0, channels, str(root))
        labels = torch.from_numpy(arrays[f"{prefix}-labels-idx1-ubyte.gz"].astype(np.int64))
        return Dataset(images, labels, FASHION_CLASSES, image_size if image_size != 28 else None)

    train, val = split_off(dataset("train"), val_size, split_seed)
    return Splits(train, val, dataset("t10k"))
