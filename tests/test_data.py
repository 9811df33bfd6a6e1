"""Data module: digits split/normalisation/determinism, fake sizes, samplers, clear errors for missing data."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from PIL import Image
from sklearn.datasets import load_digits
from torch.utils.data import DistributedSampler

from compress.data import _CIFAR, IMAGENET_MEAN, IMAGENET_STD, DatasetNotFoundError, EpochSampler, build_data


def _all(loader):
    xs, ys = zip(*loader)
    return torch.cat(xs), torch.cat(ys)


@pytest.fixture(scope="module")
def digits():
    return build_data({"name": "digits", "batch_size": 128, "seed": 0})


def test_digits_split_and_shapes(digits):
    assert (digits.num_classes, digits.input_size, digits.in_chans) == (10, 32, 3)
    x_test, y_test = _all(digits.test)
    x_train, y_train = _all(digits.train)
    assert x_train.shape == (1437, 3, 32, 32) and x_test.shape == (360, 3, 32, 32)
    assert x_train.dtype == torch.float32 and y_train.dtype == torch.int64
    assert torch.equal(x_test[:, 0], x_test[:, 2])  # grey repeated to 3 channels
    # Every digit is used once: train + test label counts equal scikit-learn's; test split stratified.
    target = load_digits().target
    full = np.bincount(target, minlength=10)
    counts_test = np.bincount(y_test.numpy(), minlength=10)
    assert np.array_equal(np.bincount(y_train.numpy(), minlength=10) + counts_test, full)
    assert np.all(np.abs(counts_test - full * 360 / len(target)) <= 1)


def test_digits_normalised(digits):
    x_test, _ = _all(digits.test)
    x_train, _ = _all(digits.train)  # shifted copies: only a little extra background
    for x in (x_train, x_test):
        assert abs(x.mean().item()) < 0.1 and abs(x.std().item() - 1) < 0.1
    images = digits.train.dataset.images  # the training split's own statistics (not the test images')
    assert abs(images.mean().item()) < 1e-5 and abs(images.std().item() - 1) < 1e-5


def test_digits_test_images_are_the_real_digits(digits):
    """Each test image, pooled back to 8x8, correlates (affine-invariant) with a scikit-learn digit
    of the same label; correlation is high only if it is that image, resized and normalised."""
    ref = load_digits()
    x_test, y_test = _all(digits.test)
    pooled = F.adaptive_avg_pool2d(x_test[:, :1], 8).flatten(1).double()
    pooled = (pooled - pooled.mean(1, keepdim=True)) / pooled.std(1, keepdim=True)
    src = torch.tensor(ref.data, dtype=torch.float64)
    src = (src - src.mean(1, keepdim=True)) / src.std(1, keepdim=True)
    corr = pooled @ src.T / 63
    best, idx = corr.max(1)
    assert best.min() > 0.95
    assert torch.equal(torch.tensor(ref.target)[idx], y_test)
    assert len(set(idx.tolist())) >= 355  # distinct source images (a few digits are near-duplicates)


def test_digits_augmentation_is_a_shift_not_a_flip(digits):
    ds = digits.train.dataset
    torch.manual_seed(1)
    views = [ds[5][0][0] for _ in range(12)]
    a, shifts = views[0], set()
    for b in views[1:]:
        # b equals a translated by some (dy, dx) within 2 * pad = 4 pixels on their overlap.
        found = set()
        for dy in range(-4, 5):
            for dx in range(-4, 5):
                ya, yb = slice(max(dy, 0), 32 + min(dy, 0)), slice(max(-dy, 0), 32 + min(-dy, 0))
                xa, xb = slice(max(dx, 0), 32 + min(dx, 0)), slice(max(-dx, 0), 32 + min(-dx, 0))
                if torch.equal(a[ya, xa], b[yb, xb]):
                    found.add((dy, dx))
        assert found
        shifts |= found
    assert any(not torch.equal(a, b) for b in views[1:])
    assert any(dy != dx for dy, dx in shifts)  # rows and columns shift independently
    # the uncovered border takes the background's value (the digits' corners are blank), not a grey frame
    background = digits.test.dataset[0][0][0, 0, 0].item()
    assert ds.fill == pytest.approx(background, abs=1e-6) and background < -0.5
    assert (torch.stack(views).amin((1, 2)) >= background - 1e-5).all()


def test_digits_shifts_reach_every_offset_up_to_the_pad():
    """The shifts run from -pad to +pad pixels in each direction (a draw from [0, 2 * pad) never moved +pad)."""
    from compress.data import _ImageTensors

    image = torch.zeros(1, 1, 9, 9)
    image[0, 0, 4, 4] = 1.0  # one lit pixel: its position after the shift gives the offset
    ds = _ImageTensors(image, torch.zeros(1, dtype=torch.long), 1, pad=2)
    torch.manual_seed(0)
    seen = set()
    for _ in range(300):
        (y, x), = (ds[0][0][0] == 1).nonzero().tolist()
        seen.add((y - 4, x - 4))
    assert {dy for dy, _ in seen} == {dx for _, dx in seen} == {-2, -1, 0, 1, 2}


def test_digits_deterministic():
    def first_batch(seed):
        data = build_data({"name": "digits", "batch_size": 32, "seed": seed})
        torch.manual_seed(123)  # augmentation RNG (num_workers=0)
        return next(iter(data.train))

    (x0, y0), (x1, y1), (_, y2) = first_batch(0), first_batch(0), first_batch(1)
    assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert not torch.equal(y0, y2)


def test_digits_options():
    data = build_data(OmegaConf.create({"name": "digits", "input_size": 16, "in_chans": 1, "batch_size": 8}))
    x, _ = next(iter(data.test))
    assert x.shape == (8, 1, 16, 16) and data.in_chans == 1 and data.input_size == 16
    assert len(data.test) == 45  # 360 / 8, eval_batch_size defaults to batch_size
    # training shifts: max(1, input_size // 16) pixels, none below 8 (a pixel there moves most of the digit off)
    assert [build_data({"name": "digits", "input_size": n}).train.dataset.pad for n in (4, 7, 8, 31, 32, 64)] == \
        [0, 0, 1, 1, 2, 4]


def test_fake_sizes_and_determinism():
    cfg = {
        "name": "fake",
        "input_size": 12,
        "num_classes": 7,
        "train_size": 50,
        "test_size": 20,
        "batch_size": 16,
    }
    data = build_data(cfg)
    x_train, y_train = _all(data.train)
    x_test, y_test = _all(data.test)
    assert x_train.shape == (50, 3, 12, 12) and x_test.shape == (20, 3, 12, 12)
    assert data.num_classes == 7 and 0 <= y_train.min() and y_train.max() < 7
    assert abs(x_train.mean().item()) < 0.05 and abs(x_train.std().item() - 1) < 0.05
    again = build_data(cfg)
    assert torch.equal(_all(again.test)[0], x_test)
    ds, ds_again = data.train.dataset, again.train.dataset
    assert all(torch.equal(ds[i][0], ds_again[i][0]) and ds[i][1] == ds_again[i][1] for i in range(50))
    other = build_data({**cfg, "seed": 1}).test.dataset
    assert not torch.equal(other[0][0], data.test.dataset[0][0])
    assert not torch.equal(ds[0][0], data.test.dataset[0][0])


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_pass_over_the_test_set_leaves_the_global_rng_alone(num_workers):
    """Evaluating must not change training: a pass over the test loader draws nothing from torch's global RNG
    (which training's augmentations and dropout use), so eval_every or a max_steps stop that evaluates at an
    epoch end cannot make a run, or its resumed continuation, train differently."""
    data = build_data({"name": "fake", "input_size": 8, "train_size": 8, "test_size": 6, "batch_size": 4,
                       "num_workers": num_workers})
    torch.manual_seed(3)
    before = torch.get_rng_state()
    assert len(_all(data.test)[0]) == 6
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("train_size, world_size, batches", [(9, 1, [4, 4]), (10, 1, [4, 4, 2]), (8, 1, [4, 4]),
                                                             (1, 1, [1]), (17, 2, [4, 4]), (18, 2, [4, 4])])
def test_a_last_training_batch_of_one_image_is_dropped(train_size, world_size, batches):
    """BatchNorm cannot train on one image at a 1x1 map: a training epoch never ends on a batch of one (per rank;
    17 and 18 images on 2 ranks are 9 each), unless that is all there is; other remainders are kept."""
    cfg = {"name": "fake", "input_size": 4, "train_size": train_size, "test_size": 5, "batch_size": 4}
    data = build_data(cfg, rank=0, world_size=world_size)
    if world_size > 1:
        data.train.sampler.set_epoch(0)
    assert [len(y) for _, y in data.train] == batches and len(data.train) == len(batches)
    assert sum(len(y) for _, y in data.test) == (5 if world_size == 1 else 3)  # evaluation drops nothing


def test_distributed_samplers():
    cfg = {"name": "fake", "input_size": 4, "train_size": 40, "test_size": 10, "batch_size": 4, "seed": 3}
    ranks = [build_data(cfg, rank=r, world_size=2) for r in range(2)]
    train_idx = []
    for rank, data in enumerate(ranks):
        sampler = data.train.sampler
        assert isinstance(sampler, EpochSampler)
        sampler.set_epoch(2)
        reference = DistributedSampler(range(40), 2, rank, shuffle=True, seed=3)  # the order it reproduces
        reference.set_epoch(2)
        assert list(sampler) == list(reference)
        train_idx.append(list(sampler))
    assert len(train_idx[0]) == 20 and sorted(train_idx[0] + train_idx[1]) == list(range(40))
    test_samplers = [data.test.sampler for data in ranks]
    assert [list(s) for s in test_samplers] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    with pytest.raises(ValueError, match="rank"):
        build_data(cfg, rank=2, world_size=2)


def _batches(size, batch, world_size, epoch=0, start=0, seed=5):
    """Each rank's list of index batches for one epoch of an EpochSampler."""
    ranks = []
    for rank in range(world_size):
        sampler = EpochSampler(size, batch, seed, rank, world_size)
        sampler.set_epoch(epoch, start)
        indices = list(sampler)
        ranks.append([indices[i : i + batch] for i in range(0, len(indices), batch)])
    return ranks


@pytest.mark.parametrize("size, world_size, batch", [(48, 2, 4), (48, 3, 2), (60, 4, 5)])
def test_epoch_sampler_gives_every_world_size_the_same_global_batches(size, world_size, batch):
    """W ranks at batch b train, step by step, on the samples one process at batch W*b trains on."""
    single = _batches(size, world_size * batch, 1, epoch=1)[0]
    ranks = _batches(size, batch, world_size, epoch=1)
    assert len(single) == len(ranks[0]) == size // (world_size * batch)
    for step, global_batch in enumerate(single):
        assert sorted(sum((r[step] for r in ranks), [])) == sorted(global_batch)
    assert sorted(sum(single, [])) == list(range(size))
    assert single != _batches(size, world_size * batch, 1, epoch=2)[0]  # another epoch, another order


@pytest.mark.parametrize("size, before, after", [(50, (2, 3), (3, 5)), (50, (1, 4), (2, 3)), (37, (3, 2), (1, 5)),
                                                 (64, (4, 2), (3, 4))])
def test_epoch_sampler_resumed_inside_an_epoch_trains_the_rest_once(size, before, after):
    """A run of W ranks at batch b stopped after k batches has trained the first k*b*W samples of the epoch's order;
    resumed at start=k*b*W on W' ranks at batch b', the epoch trains each remaining sample exactly once (plus the
    padding of the last round, repeats of the first remaining samples; the sizes here end on no batch of one, which
    a rank drops)."""
    (world, batch), (new_world, new_batch) = before, after
    ranks = _batches(size, batch, world, epoch=3)
    k = 2
    trained = [i for r in ranks for b in r[:k] for i in b]
    start = k * batch * world
    order = [i for step in zip(*ranks) for b in zip(*step) for i in b]  # rank-interleaved: the epoch's order
    assert sorted(trained) == sorted(order[:start])
    rest = [i for r in _batches(size, new_batch, new_world, epoch=3, start=start) for b in r for i in b]
    assert set(rest) | set(trained) == set(range(size)) and not set(rest) & set(trained)
    assert len(rest) - (size - start) < new_world  # padding only
    with pytest.raises(ValueError, match="start=50"):
        EpochSampler(50, 4, 0).set_epoch(0, start=50)


def test_epoch_sampler_drops_a_batch_of_one_left_by_a_resume():
    """A resumed remainder of 2 images on 2 ranks at batch 2 would give each a batch of one: dropped, so that epoch
    has no batch; a fresh epoch of a one-image data set keeps its image (all there is); at batch 1 nothing drops."""
    assert _batches(40, 2, 2, start=38) == [[], []]
    assert _batches(1, 2, 1) == [[[0]]]
    assert [len(r) for r in _batches(40, 1, 2, start=38)] == [1, 1]


def test_imagefolder(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("val", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / cls / f"{i}.png")
    data = build_data({"name": "imagefolder", "root": str(tmp_path), "input_size": 16, "batch_size": 4})
    x_train, y_train = _all(data.train)
    x_test, y_test = _all(data.test)
    assert data.num_classes == 2 and x_train.shape == (6, 3, 16, 16) and x_test.shape == (4, 3, 16, 16)
    assert sorted(y_test.tolist()) == [0, 0, 1, 1]
    for split in ("train", "val"):  # one class left: a classifier has nothing to learn (it trained to loss 0)
        shutil.rmtree(tmp_path / split / "dog")
    with pytest.raises(ValueError, match="imagefolder has 1 class; a classifier needs at least 2"):
        build_data({"name": "imagefolder", "root": str(tmp_path), "input_size": 16, "batch_size": 4})
    with pytest.raises(ValueError, match=r"data.num_classes=1; it must be an int >= 2"):
        build_data({"name": "fake", "num_classes": 1})


# What torchvision's CIFAR10/CIFAR100 read (the extracted cifar-*-python.tar.gz): folder, train files,
# test files, meta file, its class-name key, and the label key of the pickled batches.
_CIFAR_FILES = {
    "cifar10": (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)],
        ["test_batch"],
        "batches.meta",
        "label_names",
        "labels",
    ),
    "cifar100": ("cifar-100-python", ["train"], ["test"], "meta", "fine_label_names", "fine_labels"),
}


def _write_cifar(root, name, n_train, n_test, seed=0):
    """A tiny CIFAR in torchvision's on-disk python format: n_train images split evenly over the train
    files (5 for CIFAR-10, 1 for CIFAR-100), n_test in the test file, random pixels and labels.
    Returns {split: (uint8 images (N, 3, 32, 32), labels)}."""
    folder, train_files, test_files, meta, names_key, label_key = _CIFAR_FILES[name]
    num_classes = _CIFAR[name][2]
    rng = np.random.default_rng(seed)
    (root / folder).mkdir(parents=True)
    written = {}
    for split, files, n in (
        ("train", train_files, n_train // len(train_files)),
        ("test", test_files, n_test),
    ):
        images, labels = [], []
        for fname in files:
            rows = rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8)  # R, G, B planes, row-major
            y = rng.integers(0, num_classes, n).tolist()
            with open(root / folder / fname, "wb") as f:
                pickle.dump({"data": rows, label_key: y}, f)
            images.append(rows.reshape(n, 3, 32, 32))
            labels += y
        written[split] = (np.concatenate(images), labels)
    with open(root / folder / meta, "wb") as f:
        pickle.dump({names_key: [f"class{i}" for i in range(num_classes)]}, f)
    return written


def _skip_cifar_md5(monkeypatch):
    """Synthetic files cannot match the MD5s torchvision records for the real CIFAR files, so replace
    its checksum test by an existence test. Patching CIFAR10._check_integrity alone is not enough:
    _load_meta checks the meta file with the module's check_integrity too, so patch that function,
    which both use. Missing files are still reported."""
    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))


def _normalised(images: np.ndarray, mean, std) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> (x / 255 - mean) / std per channel, computed by hand."""
    mean, std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)
    return (torch.from_numpy(images).float() / 255 - mean) / std


def _shifted_or_flipped(view: torch.Tensor, ref: torch.Tensor, pad: int) -> str | None:
    """"shift" if view equals ref translated by at most `pad` pixels (on the overlap), "flip" if it equals ref
    mirrored left-right and so translated, else None."""
    h, w = ref.shape[-2:]
    for kind, v in (("shift", view), ("flip", view.flip(-1))):
        for dy in range(-pad, pad + 1):
            for dx in range(-pad, pad + 1):
                ya, yb = slice(max(dy, 0), h + min(dy, 0)), slice(max(-dy, 0), h + min(-dy, 0))
                xa, xb = slice(max(dx, 0), w + min(dx, 0)), slice(max(-dx, 0), w + min(-dx, 0))
                if torch.allclose(v[:, ya, xa], ref[:, yb, xb], atol=1e-5):
                    return kind
    return None


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_loads_written_files(tmp_path, monkeypatch, name):
    """build_data reads CIFAR's python files from data.root: test images are the written pixels,
    unresized at input_size=32 and normalised with the dataset's mean/std, in file order with their
    labels; train images are random crops (pad 4) / flips of the written ones."""
    n_train, n_test = 10, 6
    written = _write_cifar(tmp_path, name, n_train, n_test)
    cfg = {
        "name": name,
        "root": str(tmp_path),
        "download": False,
        "batch_size": 4,
        "eval_batch_size": 4,
        "num_workers": 0,
        "input_size": 32,
    }
    # torchvision rejects the synthetic files by checksum; build_data names them.
    with pytest.raises(DatasetNotFoundError, match=r"not the original files \(MD5 differs\): .*"
                                                   + _CIFAR_FILES[name][3]):
        build_data(cfg)
    _skip_cifar_md5(monkeypatch)
    data = build_data(cfg)
    _, _, num_classes, mean, std = _CIFAR[name]
    assert (data.num_classes, data.input_size, data.in_chans) == (num_classes, 32, 3)
    assert len(data.train.dataset) == n_train and len(data.test.dataset) == n_test
    assert len(data.train) == 3 and len(data.test) == 2  # 10 / 4 and 6 / 4 batches, rounded up

    # Test loader: unshuffled, first batch = the first 4 written test images, normalised by hand.
    assert not any(type(t).__name__ == "Resize" for t in data.test.dataset.transform.transforms)
    images, labels = written["test"]
    x, y = next(iter(data.test))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert y.tolist() == labels[:4] and 0 <= y.min() and y.max() < num_classes
    assert torch.allclose(x, _normalised(images[:4], mean, std), atol=1e-5)
    c, i, j = 1, 7, 20  # one pixel, spelled out
    by_hand = (images[2, c, i, j] / 255 - mean[c]) / std[c]
    assert abs(x[2, c, i, j].item() - by_hand) < 1e-5
    assert _all(data.test)[1].tolist() == labels

    # Train loader: shuffled batches of the written labels; each item a crop/flip of its own image.
    images, labels = written["train"]
    x, y = next(iter(data.train))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0 <= y.min() and y.max() < num_classes
    assert sorted(_all(data.train)[1].tolist()) == sorted(labels)
    ds = data.train.dataset
    assert ds.targets == labels  # train files read in order
    ref = _normalised(images, mean, std)
    torch.manual_seed(0)  # augmentation RNG (num_workers=0)
    views = [ds[k][0] for k in range(n_train)]
    assert all(_shifted_or_flipped(v, ref[k], 4) for k, v in enumerate(views))
    assert any(not torch.allclose(v, ref[k]) for k, v in enumerate(views))  # augmented, not identity
    kinds = [_shifted_or_flipped(ds[0][0], ref[0], 4) for _ in range(40)]  # about half the views mirrored
    assert None not in kinds and 8 <= kinds.count("flip") <= 32

    # A file gone (here the meta file) is reported as missing.
    os.remove(tmp_path / _CIFAR_FILES[name][0] / _CIFAR_FILES[name][3])
    with pytest.raises(DatasetNotFoundError, match=rf"{name}: missing: {_CIFAR_FILES[name][3]} under"):
        build_data(cfg)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_resized_input(tmp_path, monkeypatch, name):
    written = _write_cifar(tmp_path, name, 5, 3, seed=1)
    _skip_cifar_md5(monkeypatch)
    data = build_data({"name": name, "root": str(tmp_path), "batch_size": 2, "input_size": 40})
    assert data.input_size == 40
    x_train, _ = next(iter(data.train))
    x_test, y_test = next(iter(data.test))
    assert x_train.shape == (2, 3, 40, 40) and x_test.shape == (2, 3, 40, 40)
    assert y_test.tolist() == written["test"][1][:2]
    # Upsampling keeps each image's per-channel mean (within interpolation error).
    _, _, _, mean, std = _CIFAR[name]
    want = _normalised(written["test"][0][:2], mean, std).mean((2, 3))
    assert torch.allclose(x_test.mean((2, 3)), want, atol=0.05)
    # training crops pad input_size / 8 = 5 pixels: blank top rows up to 5, beyond the 4 of 32x32 CIFAR
    blank = ((0 - torch.tensor(mean)) / torch.tensor(std)).view(3, 1)
    torch.manual_seed(0)
    tops = []
    for _ in range(60):
        view = data.train.dataset[0][0]
        rows = [torch.allclose(view[:, r], blank.expand(3, 40), atol=1e-5) for r in range(8)]
        tops.append(rows.index(False))
    assert max(tops) == 5


def test_imagefolder_training_views_are_mirrored_about_half_the_time(tmp_path):
    """A left-to-right brightness ramp: a view brighter on its left was mirrored (RandomHorizontalFlip)."""
    ramp = np.repeat(np.linspace(0, 255, 48, dtype=np.uint8)[None, :, None], 40, 0).repeat(3, 2)
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / split / cls).mkdir(parents=True)
            Image.fromarray(ramp).save(tmp_path / split / cls / "0.png")
    data = build_data({"name": "imagefolder", "root": str(tmp_path), "input_size": 16, "num_workers": 0})
    torch.manual_seed(0)
    views = [data.train.dataset[0][0] for _ in range(40)]
    mirrored = sum(bool(v[..., :8].mean() > v[..., 8:].mean()) for v in views)
    assert 8 <= mirrored <= 32


def test_fake_images_of_train_and_test_never_coincide_and_seeds_are_bounded():
    """Image i of each split and seed has a generator of its own (train image 1,000,003 was test image 0); the
    loaders' worker seeds differ across ranks; a data.seed or size outside the generator's range is refused."""
    data = build_data({"name": "fake", "input_size": 4, "train_size": 1_000_004, "test_size": 2})
    assert not torch.equal(data.train.dataset[1_000_003][0], data.test.dataset[0][0])
    other = build_data({"name": "fake", "input_size": 4, "train_size": 2, "test_size": 2, "seed": 1})
    assert not torch.equal(other.train.dataset[0][0], data.test.dataset[0][0])
    cfg = {"name": "fake", "input_size": 4, "num_workers": 1}
    assert len({build_data(cfg, rank, 2).train.generator.initial_seed() for rank in (0, 1)}) == 2
    with pytest.raises(ValueError, match=r"data.seed=4294967296; it must be an int >= 0 and <= 4294967295"):
        build_data({"name": "fake", "seed": 2**32})
    with pytest.raises(ValueError, match=r"data.train_size=2147483648; it must be an int >= 1 and <= 2147483647"):
        build_data({"name": "fake", "train_size": 2**31})
    with pytest.raises(DatasetNotFoundError, match=r"imagefolder: data.root is not set; expected train/ and val/"):
        build_data({"name": "imagefolder", "root": "???"})  # imagefolder.yaml's placeholder


def test_imagenet_folder_loads_written_images(tmp_path):
    """name: imagenet on train/<class>/*.png and val/<class>/*.png: configured input size, classes
    indexed in ImageFolder's sorted order, lengths, and every image paired with its own label (class
    k's images are brightest in channel k, which survives cropping and resizing)."""
    classes = ["zebra", "cat", "mole"]  # created unsorted; indices follow sorted(): cat, mole, zebra
    counts = {"train": 3, "val": 2}
    rng = np.random.default_rng(1)
    for split, n in counts.items():
        for cls in classes:
            k = sorted(classes).index(cls)
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 128, (40, 48, 3), dtype=np.uint8)
                pixels[..., k] += 128
                Image.fromarray(pixels).save(tmp_path / split / cls / f"{i}.png")
    cfg = {
        "name": "imagenet",
        "root": str(tmp_path),
        "batch_size": 5,
        "eval_batch_size": 6,
        "num_workers": 0,
        "input_size": 24,
    }
    data = build_data(cfg)
    assert (data.num_classes, data.input_size, data.in_chans) == (3, 24, 3)
    for loader in (data.train, data.test):
        assert loader.dataset.classes == sorted(classes)
        assert loader.dataset.class_to_idx == {"cat": 0, "mole": 1, "zebra": 2}
    assert len(data.train.dataset) == 9 and len(data.test.dataset) == 6
    assert len(data.train) == 2 and len(data.test) == 1

    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    x, y = next(iter(data.train))
    assert x.shape == (5, 3, 24, 24) and x.dtype == torch.float32 and y.dtype == torch.int64
    x_train, y_train = _all(data.train)
    assert sorted(y_train.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert torch.equal((x_train * std + mean).mean((2, 3)).argmax(1), y_train)

    x_test, y_test = next(iter(data.test))
    assert x_test.shape == (6, 3, 24, 24) and x_test.dtype == torch.float32
    assert y_test.tolist() == [0, 0, 1, 1, 2, 2]  # unshuffled: class by class, sorted
    raw = x_test * std + mean
    assert torch.equal(raw.mean((2, 3)).argmax(1), y_test)
    assert raw.min() >= -1e-5 and raw.max() <= 1 + 1e-5  # de-normalised back to [0, 1]
    assert torch.equal(next(iter(data.test))[0], x_test)  # eval transform is deterministic
    # eval: the shorter side resized to round(24 / 0.875) = 27 (PIL bilinear), the centre 24x24, normalised
    image = Image.open(tmp_path / "val" / "cat" / "0.png").convert("RGB").resize((32, 27), Image.BILINEAR)
    ref = torch.tensor(np.asarray(image), dtype=torch.float32)[2:26, 4:28].permute(2, 0, 1) / 255
    torch.testing.assert_close(x_test[0], (ref - mean) / std, atol=1e-5, rtol=0)
    # train: random crops and flips, another view each pass
    torch.manual_seed(0)
    views = torch.stack([data.train.dataset[0][0] for _ in range(8)])
    assert views.shape == (8, 3, 24, 24) and len({v.sum().item() for v in views}) == 8


@pytest.mark.parametrize(
    "name, folder", [("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python")]
)
def test_missing_cifar(tmp_path, name, folder):
    with pytest.raises(DatasetNotFoundError, match=rf"{folder}/.*data\.root=.*data\.download=true") as err:
        build_data({"name": name, "root": str(tmp_path)})
    assert str(tmp_path) in str(err.value) and isinstance(err.value, FileNotFoundError)
    with pytest.raises(DatasetNotFoundError, match=rf"data\.root is not set.*{folder}/"):
        build_data({"name": name})


def test_failed_cifar_download_is_clear(tmp_path, monkeypatch):
    """No network here: the download's error becomes one naming data.root and what to put there."""
    import urllib.request

    def refuse(*args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    monkeypatch.setattr(urllib.request.OpenerDirector, "open", refuse)
    with pytest.raises(DatasetNotFoundError, match=r"downloading into data.root=.*failed.*cifar-10-batches-py/"):
        build_data({"name": "cifar10", "root": str(tmp_path / "new"), "download": True})
    assert not (tmp_path / "new").exists()  # the folder the download made is gone again
    with pytest.raises(DatasetNotFoundError, match=r"downloading into data.root=.*failed"):
        build_data({"name": "cifar10", "root": str(tmp_path / "a" / "b" / "c"), "download": True})
    assert not (tmp_path / "a").exists()  # and the folders above it that it made


def test_missing_imagenet(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(
        DatasetNotFoundError, match=rf"{missing} does not exist.*train/ and val/ class folders"
    ):
        build_data({"name": "imagenet", "root": str(missing)})
    (tmp_path / "train").mkdir()
    with pytest.raises(DatasetNotFoundError, match=r"no val/ in data\.root=.*ILSVRC2012"):
        build_data({"name": "imagenet", "root": str(tmp_path)})
    (tmp_path / "val").mkdir()
    with pytest.raises(DatasetNotFoundError, match=r"class folder.*train/ and val/ class folders"):
        build_data({"name": "imagefolder", "root": str(tmp_path)})


def test_config_errors():
    with pytest.raises(ValueError, match=r"unknown dataset 'mnist'.*digits, cifar10, cifar100, imagenet"):
        build_data({"name": "mnist"})
    with pytest.raises(ValueError, match=r"unknown data keys \['batchsize'\].*batch_size"):
        build_data({"name": "digits", "batchsize": 3})
    with pytest.raises(ValueError, match="data.num_classes=100 but digits has 10"):
        build_data({"name": "digits", "num_classes": 100})
    with pytest.raises(ValueError, match="3 channels"):
        build_data({"name": "cifar10", "in_chans": 1})
    # a dataset name or None where the settings go ("dictionary update sequence element #0 has length 1")
    with pytest.raises(TypeError, match=r"build_data: cfg is a dict or OmegaConf node of data settings, got str "
                                        r"'digits'; e.g. build_data\(\{'name': 'digits'\}\)"):
        build_data("digits")
    with pytest.raises(TypeError, match=r"got NoneType None$"):
        build_data(None)


def _folder(root, classes, n=2, size=(12, 10), seed=0):
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        for cls in classes:
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / split / cls / f"{i}.png")


def test_image_folders_read_16_bit_images_scaled_and_name_a_bad_file(tmp_path):
    """A 16-bit PNG is scaled to 8 bits (it was clipped at 255: almost white), equal to its 8-bit version within
    rounding; a truncated image fails naming its file; differing class folders and an empty class name themselves."""
    from compress.data import load_image

    ramp16 = np.tile(np.linspace(0, 65535, 40).round().astype(np.uint16), (12, 1))
    Image.fromarray(ramp16).save(tmp_path / "ramp16.png")
    Image.fromarray((ramp16 / 257).round().astype(np.uint8)).save(tmp_path / "ramp8.png")
    assert Image.open(tmp_path / "ramp16.png").mode.startswith("I")
    got = np.asarray(load_image(str(tmp_path / "ramp16.png")), dtype=np.int16)
    want = np.asarray(load_image(str(tmp_path / "ramp8.png")), dtype=np.int16)
    assert got.shape == (12, 40, 3) and np.abs(got - want).max() <= 1 and got.min() == 0 and got.max() == 255

    root = tmp_path / "folder"
    _folder(root, ["a", "b"])
    bad = root / "train" / "b" / "1.png"
    bad.write_bytes(bad.read_bytes()[: len(bad.read_bytes()) // 2])
    data = build_data({"name": "imagefolder", "root": str(root), "input_size": 8, "batch_size": 4})
    with pytest.raises(OSError, match=rf"cannot read the image {bad} .*remove or replace the file"):
        _all(data.train)

    (root / "train" / ".ipynb_checkpoints").mkdir()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / "train" / ".ipynb_checkpoints" / "x.png")
    with pytest.raises(ValueError, match=r"train/ has 3 class folders and val/ 2 .*only in train/: \.ipynb_checkpoints"):
        build_data({"name": "imagefolder", "root": str(root), "input_size": 8})
    shutil.rmtree(root / "train" / ".ipynb_checkpoints")
    (root / "val" / "c").mkdir()
    (root / "train" / "c").mkdir()
    (root / "train" / "c" / "0.png").write_bytes((root / "train" / "a" / "0.png").read_bytes())
    with pytest.raises(DatasetNotFoundError, match=r"imagefolder: val/: Found no valid file for the classes c.*every "
                                                   r"folder in val/ is a class and needs images \(a hidden one"):
        build_data({"name": "imagefolder", "root": str(root), "input_size": 8})
    with pytest.raises(DatasetNotFoundError, match=rf"data.root names its train/ itself: give the folder holding "
                                                   rf"train/ and val/, data.root={root}\."):
        build_data({"name": "imagefolder", "root": str(root / "train"), "input_size": 8})
    (root / "cifar-10-batches-py").mkdir()
    with pytest.raises(DatasetNotFoundError, match=rf"data.root names cifar-10-batches-py/ itself: give the folder "
                                                   rf"holding it, data.root={root}\."):
        build_data({"name": "cifar10", "root": str(root / "cifar-10-batches-py")})


def test_train_and_test_sizes_are_refused_outside_fake_data(tmp_path):
    _folder(tmp_path, ["a", "b"])
    with pytest.raises(ValueError, match=r"data.train_size sets the size of data=fake only; imagefolder uses every"):
        build_data({"name": "imagefolder", "root": str(tmp_path), "train_size": 2})
    with pytest.raises(ValueError, match=r"data.test_size sets the size of data=fake only; digits uses all 1,797 of its "
                                         r"bundled images \(trainer.max_steps=N"):
        build_data({"name": "digits", "test_size": 2})
    assert build_data({"name": "imagefolder", "root": str(tmp_path), "input_size": 8}).classes == ["a", "b"]


def test_a_root_given_to_data_that_never_reads_it_is_noted():
    """data.root (or data.download=true) with data=digits or fake, e.g. a forgotten data=cifar10, warns that it has
    no effect instead of training on the bundled data silently; other ranks stay quiet."""
    for name, key, value in (("digits", "root", "/data/cifar10"), ("fake", "download", True)):
        cfg = {"name": name, key: value, **({"train_size": 8, "test_size": 4} if name == "fake" else {})}
        with pytest.warns(UserWarning, match=rf"data.{key}={value!r} has no effect: it is read by the datasets on "
                                             rf"disk only \(cifar10, cifar100, imagenet, imagefolder\), and data={name}"):
            build_data(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_data({"name": "digits", "root": "/data/cifar10"}, rank=1, world_size=2)


def test_download_with_data_that_cannot_be_downloaded_is_noted(tmp_path):
    """data.download=true with data=imagefolder (or imagenet) trains on the images under data.root, and says that
    nothing was downloaded instead of ignoring the setting."""
    _folder(tmp_path, ["a", "b"])
    with pytest.warns(UserWarning, match=r"data.download=true has no effect with data=imagefolder: only cifar10 and "
                                         r"cifar100 are downloaded"):
        assert build_data({"name": "imagefolder", "root": str(tmp_path), "input_size": 8,
                           "download": True}).classes == ["a", "b"]


class _WorkerSignalState(torch.utils.data.Dataset):
    """Item i: (SIGTERM ignored, SIGTERM blocked) in the process that loads it."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import signal

        return torch.tensor([signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,
                             signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])])


def test_loader_workers_ignore_sigterm_and_the_main_process_keeps_its_mask(monkeypatch):
    """build_data's workers ignore SIGTERM (Slurm signals every process of a job; a worker killed by it fails the next
    batch before train.py writes its checkpoint) and have it unblocked again after `_Loader` held it over the fork;
    the loading thread's own signal mask is as before."""
    import signal

    import compress.data
    from compress.data import _ignore_sigterm, _Loader

    data = build_data({"name": "fake", "train_size": 8, "test_size": 4, "num_workers": 2})
    assert all(type(d) is _Loader and d.worker_init_fn is _ignore_sigterm for d in (data.train, data.test))
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    states = torch.cat(list(_Loader(_WorkerSignalState(), 1, num_workers=2, worker_init_fn=_ignore_sigterm)))
    assert states[:, 0].all() and not states[:, 1].any(), states
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before and signal.getsignal(signal.SIGTERM) != signal.SIG_IGN
    # where Python has no pthread_sigmask (Windows) the loader only sets the workers' handler
    monkeypatch.setattr(compress.data, "_CAN_HOLD", False)
    states = torch.cat(list(_Loader(_WorkerSignalState(), 1, num_workers=2, worker_init_fn=_ignore_sigterm)))
    assert states[:, 0].all() and not states[:, 1].any(), states


def test_a_root_that_is_not_a_path_is_a_clear_error(tmp_path):
    """build_data from Python with a number as data.root (a folder named 2024) raised a bare TypeError from pathlib;
    now a ValueError naming the value and the fix. A pathlib.Path works as a string does."""
    with pytest.raises(ValueError, match=r"data.root=2024 is of type int; give the folder as a string or "
                                         r"path \(e.g. root='2024'\)"):
        build_data({"name": "imagefolder", "root": 2024})
    _folder(tmp_path, ["a", "b"])
    assert build_data({"name": "imagefolder", "root": tmp_path, "input_size": 8}).classes == ["a", "b"]


def test_image_folders_refuse_symlink_loops_and_float_or_32_bit_images(tmp_path):
    """A symlink in a class folder to a folder above it made ImageFolder read each image below it ~40 times
    (followlinks); float and 32-bit pixels came out near-black; a data.root that is a file said 'does not exist'."""
    from compress.data import load_image

    root = tmp_path / "folder"
    _folder(root, ["a", "b"])
    assert len(build_data({"name": "imagefolder", "root": str(root), "input_size": 8}).train.dataset) == 4
    (root / "train" / "a" / "loop").symlink_to(root / "train" / "a")
    with pytest.raises(ValueError, match=rf"imagefolder: {root / 'train' / 'a' / 'loop'} is a symlink to a folder "
                                         "that contains it"):
        build_data({"name": "imagefolder", "root": str(root), "input_size": 8})
    (root / "train" / "a" / "loop").unlink()
    (root / "train" / "a" / "up").symlink_to("../..")  # above the walked folder: named as made, not one lap on
    with pytest.raises(ValueError, match=rf"imagefolder: {root / 'train' / 'a' / 'up'} is a symlink"):
        build_data({"name": "imagefolder", "root": str(root), "input_size": 8})
    (root / "train" / "a" / "up").unlink()
    (root / "train" / "a" / "x").symlink_to("../b")  # a loop through two links: a/x -> b, b/y -> a
    (root / "train" / "b" / "y").symlink_to("../a")
    with pytest.raises(ValueError, match=r"is a symlink to a folder that contains it"):
        build_data({"name": "imagefolder", "root": str(root), "input_size": 8})
    (root / "train" / "a" / "x").unlink()
    (root / "train" / "b" / "y").unlink()
    (root / "train" / "a" / "shared").symlink_to(root / "val" / "b")  # a link elsewhere is followed as before
    assert len(build_data({"name": "imagefolder", "root": str(root), "input_size": 8}).train.dataset) == 6

    Image.fromarray(np.full((4, 4), 0.8, np.float32)).save(tmp_path / "f.tif")
    with pytest.raises(OSError, match=r"cannot read the image .*f.tif: its pixels are F values"):
        load_image(str(tmp_path / "f.tif"))
    for value in (70000, 200):  # a 32-bit TIFF, also with values a 16-bit image could hold (200 came out as 1)
        Image.fromarray(np.full((4, 4), value, np.int32)).save(tmp_path / "i.tif")
        with pytest.raises(OSError, match=r"cannot read the image .*i.tif: its pixels are I values \(float or 32-bit\)"):
            load_image(str(tmp_path / "i.tif"))
    for value, want in ((65535, 255), (200, 1)):  # 16-bit TIFFs: scaled to 8 bits
        Image.fromarray(np.full((4, 4), value, np.uint16)).save(tmp_path / "w.tif")
        assert np.asarray(load_image(str(tmp_path / "w.tif"))).min() == want

    with pytest.raises(DatasetNotFoundError, match=r"data.root=.*0.png is not a directory"):
        build_data({"name": "imagefolder", "root": str(root / "train" / "a" / "0.png")})


def test_cifar_errors_name_the_bad_files(tmp_path):
    """A missing or altered CIFAR batch file is named (torchvision only says 'not found or corrupted')."""
    _write_cifar(tmp_path, "cifar10", 10, 6)
    folder = tmp_path / "cifar-10-batches-py"
    (folder / "data_batch_3").unlink()
    with pytest.raises(DatasetNotFoundError, match=r"cifar10: missing: data_batch_3; not the original files \(MD5 "
                                                   r"differs\): data_batch_1, data_batch_2, data_batch_4"):
        build_data({"name": "cifar10", "root": str(tmp_path)})


def test_an_unreadable_folder_inside_a_class_is_an_error_not_skipped(tmp_path, monkeypatch):
    """ImageFolder's walk skips a sub-folder it may not list (its permissions), leaving its images out of the
    dataset without a word; the folder is named now. (Root reads anything: the listing error is simulated.)"""
    root = tmp_path / "folder"
    _folder(root, ["a", "b"])
    blocked = root / "train" / "b" / "sub"
    blocked.mkdir()
    Image.fromarray(np.zeros((12, 10, 3), dtype=np.uint8)).save(blocked / "x.png")
    assert len(build_data({"name": "imagefolder", "root": str(root), "input_size": 8}).train.dataset) == 5
    listing = os.scandir

    def guarded_scandir(path="."):
        if os.fspath(path) == str(blocked):
            raise PermissionError(13, "Permission denied", str(blocked))
        return listing(path)

    monkeypatch.setattr(os, "scandir", guarded_scandir)
    with pytest.raises(DatasetNotFoundError, match=rf"imagefolder: cannot read the folder {re.escape(str(blocked))} "
                                                   r"\(Permission denied\); fix its permissions"):
        build_data({"name": "imagefolder", "root": str(root), "input_size": 8})


def test_an_unreadable_cifar_file_is_not_called_a_failed_download(tmp_path, monkeypatch):
    """A CIFAR file the process may not read (its permissions) was reported as 'downloading ... failed' with advice
    to fetch the dataset elsewhere, though no download was asked for; now the file and the problem are named."""
    import builtins

    import torchvision.datasets.cifar as tv_cifar

    _write_cifar(tmp_path, "cifar10", 10, 6)
    _skip_cifar_md5(monkeypatch)
    unreadable = str(tmp_path / "cifar-10-batches-py" / "data_batch_1")

    def guarded_open(file, *args, **kwargs):
        if str(file) == unreadable:
            raise PermissionError(13, "Permission denied", unreadable)
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(tv_cifar, "open", guarded_open, raising=False)
    with pytest.raises(DatasetNotFoundError, match=r"cifar10: cannot read .*data_batch_1 \(Permission denied\); "
                                                   r"check the files' permissions"):
        build_data({"name": "cifar10", "root": str(tmp_path)})


def test_a_process_with_a_live_worker_iterator_exits():
    """Loader workers ignore SIGTERM (a batch system's, before train.py's checkpoint); at interpreter exit
    multiprocessing SIGTERMs the workers of an iterator still alive and waits for them, so a script holding one,
    or train.py stopped by an error (whose traceback holds it), hung forever. Such workers are now ended first."""
    import subprocess
    import sys

    script = ("from compress.data import build_data\n"
              "d = build_data({'name': 'fake', 'input_size': 8, 'batch_size': 4, 'num_workers': 2, 'train_size': 32})\n"
              "it = iter(d.train)\n"
              "next(it)\n"
              "raise SystemExit(3)\n")
    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", script], cwd=root, timeout=120, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr


def test_normalisation_constants_are_the_published_ones():
    """The tests above compare against the constants they import, which a typo or a channel swap (BGR) in the table
    would pass: they must be the published per-channel statistics (RGB order), as timm and torchvision use."""
    assert (IMAGENET_MEAN, IMAGENET_STD) == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert _CIFAR["cifar10"][3:] == ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    assert _CIFAR["cifar100"][3:] == ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
