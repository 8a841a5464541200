"""Data loaders: digits, digit pairs and glyph pairs, CIFAR-format batches and image folders
generated here."""

import pickle

import numpy as np
import pytest
import torch

from accuracy.data import (
    DataError,
    cifar_splits,
    digit_pairs_splits,
    digits_splits,
    folder_dataset,
    folder_splits,
    glyph_pairs_splits,
    pair_dataset,
    read_cifar_batch,
)
from accuracy.glyphs import glyph_pairs, glyph_prototypes, render


def test_digits_split_is_fixed_stratified_and_upsampled():
    splits = digits_splits(image_size=16, test_size=400, val_size=200)
    assert splits.train.images.shape[1:] == (1, 16, 16)
    assert len(splits.train) + len(splits.val) + len(splits.test) == 1797
    assert len(splits.test) == 400 and len(splits.val) == 200
    assert 0.0 <= float(splits.test.images.min()) and float(splits.test.images.max()) <= 1.0
    counts = torch.bincount(splits.test.labels, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 45  # about 40 of each digit
    again = digits_splits(image_size=16, test_size=400, val_size=200)
    assert torch.equal(again.test.images, splits.test.images)


def test_digit_pairs_label_is_the_sum_of_the_two_digits():
    digits = digits_splits(image_size=4, test_size=100, val_size=50).train
    pairs = pair_dataset(digits, 64, seed=3)
    assert pairs.images.shape == (64, 1, 8, 8)
    assert len(pairs.classes) == 19
    for image, label in zip(pairs.images[:8], pairs.labels[:8], strict=True):
        top = (digits.images == image[:, :4, :4]).flatten(1).all(1).nonzero()[0]
        bottom = (digits.images == image[:, 4:, 4:]).flatten(1).all(1).nonzero()[0]
        assert int(digits.labels[top[0]] + digits.labels[bottom[0]]) == int(label)
    assert torch.equal(pair_dataset(digits, 64, seed=3).images, pairs.images)
    assert not torch.equal(pair_dataset(digits, 64, seed=4).images, pairs.images)


def test_digit_pairs_splits_sizes():
    splits = digit_pairs_splits(24, train_size=100, val_size=20, test_size=30)
    assert [len(s) for s in (splits.train, splits.val, splits.test)] == [100, 20, 30]
    assert splits.test.images.shape[1:] == (1, 24, 24)
    with pytest.raises(DataError, match="even image size"):
        digit_pairs_splits(25)


def test_glyph_pair_label_names_the_top_left_and_bottom_right_glyphs():
    prototypes = glyph_prototypes(8, seed=5)
    images, labels = glyph_pairs(prototypes, 200, seed=1, jitter=0.0, noise=0.0)
    assert images.shape == (200, 1, 24, 24) and set(labels.tolist()) <= set(range(64))
    clean = render(prototypes, torch.ones(8), torch.ones(8)).flatten(1)  # (8, 144)
    clean = clean / clean.norm(dim=1, keepdim=True)

    def nearest(cells):
        return (cells.flatten(1) @ clean.T).argmax(dim=1)  # the best-correlated prototype

    assert torch.equal(nearest(images[:, 0, :12, :12]), labels // 8)
    assert torch.equal(nearest(images[:, 0, 12:, 12:]), labels % 8)
    jittered, same = glyph_pairs(prototypes, 200, seed=1)
    assert torch.equal(same, labels) and not torch.equal(jittered, images)


def test_glyph_pairs_splits_are_fixed_and_distinct():
    splits = glyph_pairs_splits(24, glyphs=4, train_size=300, val_size=50, test_size=5000)
    assert [len(s) for s in (splits.train, splits.val, splits.test)] == [300, 50, 5000]
    assert len(splits.test.classes) == 16
    counts = torch.bincount(splits.test.labels, minlength=16)
    assert counts.min() > 250  # about 312 of each class
    again = glyph_pairs_splits(24, glyphs=4, train_size=300, val_size=50, test_size=5000)
    assert torch.equal(again.test.images, splits.test.images)
    assert not torch.equal(splits.train.images[:50], splits.val.images)
    assert 0.0 <= float(splits.test.images.min()) and float(splits.test.images.max()) <= 1.0


def _write_batch(path, count, label_key=b"labels", seed=0):
    rng = np.random.default_rng(seed)
    batch = {
        b"batch_label": b"generated",
        b"data": rng.integers(0, 256, size=(count, 3072), dtype=np.uint8),
        label_key: rng.integers(0, 10, size=count).tolist(),
    }
    path.write_bytes(pickle.dumps(batch))
    return batch


def test_cifar10_batches_are_parsed(tmp_path):
    first = _write_batch(tmp_path / "data_batch_1", 30)
    _write_batch(tmp_path / "data_batch_2", 30, seed=1)
    _write_batch(tmp_path / "test_batch", 20, seed=2)
    images, labels = read_cifar_batch(tmp_path / "data_batch_1")
    assert images.shape == (30, 3, 32, 32) and labels.tolist() == first[b"labels"]
    assert images[0, 1, 0, 0] == first[b"data"][0, 1024]  # channel-major rows
    splits = cifar_splits(tmp_path, image_size=16, channels=3, val_size=10)
    assert len(splits.train) == 50 and len(splits.val) == 10 and len(splits.test) == 20
    assert splits.test.images.shape[1:] == (3, 32, 32)  # resized when taken
    assert splits.test.take(slice(0, 4)).shape == (4, 3, 16, 16)
    assert splits.train.subset(torch.arange(3)).take(slice(None)).shape == (3, 3, 16, 16)
    grey = cifar_splits(tmp_path, image_size=32, channels=1, val_size=10)
    assert grey.test.take(slice(None)).shape == (20, 1, 32, 32)


def test_cifar100_fine_labels(tmp_path):
    _write_batch(tmp_path / "train", 20, label_key=b"fine_labels")
    _write_batch(tmp_path / "test", 10, label_key=b"fine_labels", seed=1)
    splits = cifar_splits(tmp_path, val_size=4)
    assert len(splits.test) == 10 and splits.test.images.shape[1:] == (3, 32, 32)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a pickle at all", "cannot be read"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8)}), "needs keys"),
        (pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}), r"\(n, 3072\)"),
        (pickle.dumps([1, 2, 3]), "expected a dict"),
    ],
)
def test_bad_cifar_batches_name_the_file(tmp_path, content, message):
    path = tmp_path / "data_batch_1"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as error:
        read_cifar_batch(path)
    assert str(path) in str(error.value)


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("echo owned",))


def test_cifar_loader_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _Exploit(), b"labels": [0]}))
    with pytest.raises(DataError, match="refusing to load") as error:
        read_cifar_batch(path)
    assert str(path) in str(error.value)


def test_missing_cifar_files_are_named(tmp_path):
    with pytest.raises(DataError, match="no CIFAR batches"):
        cifar_splits(tmp_path)
    with pytest.raises(DataError, match="not found"):
        read_cifar_batch(tmp_path / "data_batch_9")


def _write_folder(root, per_class=4, png=True):
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in ("cat", "ant", "bee"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(10, 12, 3), dtype=np.uint8)
            if png and i % 2:
                Image.fromarray(pixels).save(root / name / f"{i}.png")
            else:
                np.save(root / name / f"{i}.npy", pixels.astype(np.float32) / 255)


def test_image_folder_reads_npy_and_png(tmp_path):
    _write_folder(tmp_path)
    data = folder_dataset(tmp_path, image_size=8, channels=3)
    assert data.classes == ["ant", "bee", "cat"]
    assert data.images.shape == (12, 3, 8, 8)
    assert torch.bincount(data.labels).tolist() == [4, 4, 4]
    grey = folder_dataset(tmp_path, image_size=8, channels=1)
    assert grey.images.shape == (12, 1, 8, 8)
    splits = folder_splits(tmp_path, image_size=8, val_fraction=0.25, test_fraction=0.25)
    assert len(splits.train) + len(splits.val) + len(splits.test) == 12


def test_image_folder_with_train_and_test(tmp_path):
    _write_folder(tmp_path / "train")
    _write_folder(tmp_path / "test", per_class=2)
    splits = folder_splits(tmp_path, image_size=8, val_fraction=0.25)
    assert len(splits.test) == 6 and len(splits.train) + len(splits.val) == 12


def test_bad_images_name_the_file(tmp_path):
    _write_folder(tmp_path, png=False)
    bad = tmp_path / "bee" / "broken.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(DataError, match="cannot be read") as error:
        folder_dataset(tmp_path, image_size=8)
    assert str(bad) in str(error.value)
    bad.unlink()
    np.save(tmp_path / "ant" / "wide.npy", np.full((4, 4, 3), 2.0, dtype=np.float32))
    with pytest.raises(DataError, match=r"wide\.npy: float values must lie in \[0, 1\]"):
        folder_dataset(tmp_path, image_size=8)


def test_empty_folders_are_refused(tmp_path):
    with pytest.raises(DataError, match="not found"):
        folder_dataset(tmp_path / "missing", 8)
    with pytest.raises(DataError, match="no class subfolders"):
        folder_dataset(tmp_path, 8)
    (tmp_path / "a").mkdir()
    with pytest.raises(DataError, match="no images"):
        folder_dataset(tmp_path, 8)


# Fashion-MNIST ---------------------------------------------------------------------------


def write_idx(path, magic: int, shape: tuple[int, ...], data: bytes) -> None:
    import gzip

    header = magic.to_bytes(4, "big") + b"".join(n.to_bytes(4, "big") for n in shape)
    with gzip.open(path, "wb") as stream:
        stream.write(header + data)


def test_idx_files_are_read_and_checked(tmp_path):
    from accuracy.data import DataError, read_idx

    labels = bytes(range(10)) * 3
    write_idx(tmp_path / "l.gz", 0x801, (30,), labels)
    assert read_idx(tmp_path / "l.gz", 30, 0x801).tolist() == list(labels)
    write_idx(tmp_path / "i.gz", 0x803, (2, 28, 28), bytes(2 * 28 * 28))
    assert read_idx(tmp_path / "i.gz", 2, 0x803).shape == (2, 28, 28)
    with pytest.raises(
        DataError, match=r"i.gz: holds \(2, 28, 28\) in 1568 bytes, .* \(3, 28, 28\)"
    ):
        read_idx(tmp_path / "i.gz", 3, 0x803)
    with pytest.raises(DataError, match="not an IDX file of uint8 with 1 dimensions"):
        read_idx(tmp_path / "i.gz", 2, 0x801)
    write_idx(tmp_path / "short.gz", 0x801, (30,), labels[:20])
    with pytest.raises(DataError, match="holds"):
        read_idx(tmp_path / "short.gz", 30, 0x801)


def test_missing_fashion_files_say_what_to_install(tmp_path):
    from accuracy.data import DataError, fashion_splits

    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")
    with pytest.raises(DataError) as missing:
        fashion_splits(tmp_path)
    text = str(missing.value)
    assert "t10k-images-idx3-ubyte.gz" in text and "train-images-idx3-ubyte.gz" not in text
    assert "apt-get install dataset-fashion-mnist" in text


def test_debians_fashion_mnist_gives_the_published_splits():
    """Needs Debian's dataset-fashion-mnist (scripts/host-setup --for-tests installs it)."""
    from accuracy.data import FASHION_DIR, fashion_splits

    if not FASHION_DIR.is_dir():
        pytest.fail(f"{FASHION_DIR} missing: apt-get install dataset-fashion-mnist")
    splits = fashion_splits(val_size=5000, split_seed=0)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (55_000, 5_000, 10_000)
    assert splits.test.images.shape[1:] == (1, 28, 28)
    assert 0.0 <= float(splits.train.images.min()) and float(splits.train.images.max()) <= 1.0
    # the published test split: 1,000 images of each class; the validation split stratified
    assert torch.bincount(splits.test.labels).tolist() == [1000] * 10
    assert torch.bincount(splits.val.labels).tolist() == [500] * 10
    again = fashion_splits(val_size=5000, split_seed=0)
    assert torch.equal(again.val.labels, splits.val.labels)
