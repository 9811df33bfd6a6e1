"""Datasets and loaders by name: digits (bundled with scikit-learn, the default), cifar10/cifar100 and
imagenet/imagefolder from a local root, and fake (synthetic, for speed tests).

`build_data(cfg, rank, world_size)` returns train/test DataLoaders (NCHW float32 images, int64
labels) with the number of classes and the input geometry. Nothing is downloaded unless
`download=true` is set for CIFAR. The training order is `EpochSampler`'s: epoch e's permutation, drawn from
(seed + e), dealt out to the ranks, so that any number of processes sees the same samples in each global batch
and a run stopped inside an epoch can go on with that epoch's remaining samples on another number of processes.
Random augmentation draws from torch's RNG: in loader workers it is seeded from the loader's seeded generator; with
num_workers=0 it follows `torch.manual_seed` (each rank's seed is trainer.seed + rank), so the augmented images
of a global batch depend on the number of processes; without augmentation (data=fake) they do not.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

__all__ = ["Data", "DatasetNotFoundError", "EpochSampler", "build_data", "load_image", "DATASETS"]

# Accepted cfg keys and their defaults (None: dataset-specific or unset).
_DEFAULTS: dict[str, Any] = {
    "name": "digits",
    "root": None,
    "download": False,
    "batch_size": 64,
    "eval_batch_size": None,  # default: batch_size
    "num_workers": 0,
    "pin_memory": None,  # default: torch.cuda.is_available()
    "input_size": None,  # default: 224 for imagenet/imagefolder, else 32
    "in_chans": None,  # default 3; digits and fake accept any value
    "seed": 0,
    "num_classes": None,  # fake: number of classes (default 10); others: checked against the data
    "train_size": 1024,  # fake only
    "test_size": 256,  # fake only
}

MAX_SEED = 2**32 - 1  # numpy's seed range (np.random.seed), which trainer.seed and data.seed must fit
MAX_FAKE_SIZE = 2**31 - 1  # data=fake train and test images have 32-bit generator keys of their own (_FakeImages)

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
_CIFAR = {  # name: (torchvision class, folder under root, classes, mean, std)
    "cifar10": ("CIFAR10", "cifar-10-batches-py", 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ("CIFAR100", "cifar-100-python", 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
DIGITS_TEST_SIZE, DIGITS_SPLIT_SEED = 360, 0


@dataclass
class Data:
    """Loaders and geometry of a dataset: images (B, in_chans, input_size, input_size)."""

    train: DataLoader
    test: DataLoader
    num_classes: int
    input_size: int
    in_chans: int
    classes: list[str] | None = None  # class names in label order, where the data names them (folders, CIFAR)


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files are not where the config says."""


class EpochSampler(Sampler[int]):
    """One rank's training indices for an epoch, the same order for every number of processes.

    Epoch e's order is `torch.randperm(size)` drawn from a generator seeded with `seed + e` (DistributedSampler's
    order, which this reproduces at `start=0`). Its first `start` samples are left out (a run resumed inside the
    epoch trained them before); the rest is padded, by repeating its first samples, to a multiple of `world_size`,
    and rank r takes every world_size-th sample from the r-th. A run of W ranks at per-rank batch b therefore trains,
    step by step, on the samples one process at batch W*b trains on (up to the epoch's last global batch where the
    images left are not a multiple of W*b: there the ranks' shares are padded, and a rank's batch of one dropped),
    and the samples of an epoch that W ranks have trained after k batches each are the first `start + k*b*W` of
    its order. A rank's share that would end on a batch of one sample drops that sample (BatchNorm cannot train on
    one value per channel at a 1x1 map), unless it is all a fresh epoch has (a resumed one then has none left).
    Call `set_epoch` before each epoch.
    """

    def __init__(self, size: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.size, self.batch_size, self.seed, self.rank, self.world_size = size, batch_size, seed, rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Draw epoch `epoch`'s order on the next pass, without its first `start` samples (0 <= start < size)."""
        if not 0 <= start < self.size:
            raise ValueError(f"EpochSampler: start={start} must be in [0, {self.size}) (samples of the epoch trained)")
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        """Samples this rank takes: its padded share, less a last batch of one."""
        share = -(-(self.size - self.start) // self.world_size)
        return share - 1 if share % self.batch_size == 1 and (share > 1 or self.start > 0) else share

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        rest = torch.randperm(self.size, generator=generator, device="cpu")[self.start:]
        taken = self.world_size * len(self)  # every rank's share, padded by repeating the first samples
        padded = rest.repeat(-(-taken // len(rest)))[:taken] if taken else rest[:0]
        return iter(padded[self.rank :: self.world_size].tolist())


def build_data(cfg, rank: int = 0, world_size: int = 1) -> Data:
    """Build train/test loaders from `cfg` (a dict or OmegaConf node with the keys of `_DEFAULTS`).

    The train loader samples with an `EpochSampler` (shuffled with `seed`; call `data.train.sampler.set_epoch(epoch)`
    each epoch); with world_size > 1 the test loader gets a DistributedSampler (unshuffled, padded to equal length).
    `batch_size` is per rank.
    """
    opts = _options(cfg)
    if not 0 <= rank < world_size:
        raise ValueError(f"build_data: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    name = opts["name"]
    unread = [k for k in ("root", "download") if opts[k] not in (None, False)]
    if unread and name in ("digits", "fake") and rank == 0:  # e.g. data.root=/data/cifar10 without data=cifar10
        warnings.warn(f"build_data: data.{unread[0]}={opts[unread[0]]!r} has no effect: it is read by the datasets "
                      f"on disk only ({', '.join(d for d in DATASETS if d not in ('digits', 'fake'))}), and data={name} "
                      "never reads it; to train on one, choose it too (e.g. data=cifar10 data.root=...)", stacklevel=2)
    elif opts["download"] and name in ("imagenet", "imagefolder") and rank == 0:
        warnings.warn(f"build_data: data.download=true has no effect with data={name}: only cifar10 and cifar100 "
                      "are downloaded; put the images under data.root yourself (see README, Data)", stacklevel=2)
    train, test, num_classes = _BUILDERS[name](opts)
    if opts["num_classes"] is not None and opts["num_classes"] != num_classes:
        raise ValueError(
            f"build_data: data.num_classes={opts['num_classes']} but {name} has {num_classes} classes; "
            "fix data.num_classes or leave it unset"
        )
    if num_classes < 2:
        raise ValueError(f"build_data: {name} has {num_classes} class; a classifier needs at least 2 (an image folder "
                         "needs a subfolder per class under train/ and val/)")
    train_loader, test_loader = _loaders(train, test, opts, rank, world_size)
    classes = getattr(train, "classes", None)
    return Data(train_loader, test_loader, num_classes, opts["input_size"], opts["in_chans"],
                [str(c) for c in classes] if classes is not None else None)


def _options(cfg) -> dict[str, Any]:
    """cfg (dict or OmegaConf node) -> dict with every key of _DEFAULTS, dataset defaults filled in."""
    from omegaconf import OmegaConf

    if not isinstance(cfg, Mapping):  # (dicts and OmegaConf nodes; 'digits' failed in dict(): "update sequence ...")
        hint = f"; e.g. build_data({{'name': {cfg!r}}})" if isinstance(cfg, str) else ""
        raise TypeError(f"build_data: cfg is a dict or OmegaConf node of data settings, got {type(cfg).__name__} "
                        f"{cfg!r:.80}{hint}")
    given = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"build_data: unknown data keys {unknown}; accepted keys: {', '.join(_DEFAULTS)}")
    opts = {**_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    name = opts["name"]
    if name not in DATASETS:
        raise ValueError(f"build_data: unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    if opts["root"] is not None and not isinstance(opts["root"], (str, os.PathLike)):
        raise ValueError(f"build_data: data.root={opts['root']!r} is of type {type(opts['root']).__name__}; give the "
                         f"folder as a string or path (e.g. root='{opts['root']}')")
    if opts["input_size"] is None:
        opts["input_size"] = 224 if name in ("imagenet", "imagefolder") else 32
    if opts["in_chans"] is None:
        opts["in_chans"] = 3
    elif opts["in_chans"] != 3 and name not in ("digits", "fake"):
        raise ValueError(f"build_data: {name} images have 3 channels, got data.in_chans={opts['in_chans']}")
    if opts["eval_batch_size"] is None:
        opts["eval_batch_size"] = opts["batch_size"]
    sized = [k for k in ("train_size", "test_size") if given.get(k) is not None]
    if sized and name != "fake":
        where = ("all 1,797 of its bundled images (trainer.max_steps=N shortens a run)" if name == "digits" else
                 "every image under data.root (give a smaller folder, or trainer.max_steps=N, for a quick run)")
        raise ValueError(f"build_data: data.{sized[0]} sets the size of data=fake only; {name} uses {where}")
    lowest = {"batch_size": 1, "eval_batch_size": 1, "input_size": 1, "in_chans": 1, "num_workers": 0,
              "train_size": 1, "test_size": 1, "num_classes": 2, "seed": 0}  # (one class: nothing to learn)
    for key, least in lowest.items():
        value, most = opts[key], {"seed": MAX_SEED, "train_size": MAX_FAKE_SIZE, "test_size": MAX_FAKE_SIZE}.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least
                                  or (most is not None and value > most)):
            raise ValueError(f"build_data: data.{key}={value!r}; it must be an int >= {least}"
                             + (f" and <= {most}" if most is not None else ""))
    for key in ("download", "pin_memory"):
        if opts[key] is not None and not isinstance(opts[key], bool):
            raise ValueError(f"build_data: data.{key}={opts[key]!r}; it must be true or false")
    if opts["pin_memory"] is None:
        opts["pin_memory"] = torch.cuda.is_available()
    return opts


_CAN_HOLD = hasattr(signal, "pthread_sigmask")  # (POSIX; Windows has none: its workers start without a fork)


def _ignore_sigterm(worker_id: int) -> None:
    """DataLoader workers ignore SIGTERM: a batch system (Slurm) sends it to every process of a job, and a worker
    killed by it fails the training process's next batch (PyTorch's SIGCHLD check), before train.py could write its
    checkpoint at the step it stops after. Workers still end with their loader, or within seconds of the training
    process (PyTorch's watchdog)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _CAN_HOLD:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one held since the fork (`_Loader`) is dropped


_LIVE_ITERATORS: weakref.WeakSet = weakref.WeakSet()  # the multi-worker iterators of `_Loader`s not yet collected


def _end_live_workers() -> None:
    """At interpreter exit: the workers of `_Loader` iterators still alive (one an error's traceback holds, or a
    script's variable) are told to stop and joined. multiprocessing's own exit handler, which runs after this one
    (atexit runs the later registered first), would SIGTERM them, which they ignore (`_ignore_sigterm`), and then
    wait for them forever: a run stopped by an error hung instead of exiting."""
    for it in list(_LIVE_ITERATORS):
        with contextlib.suppress(Exception):  # (exiting: one that cannot be ended must not keep the others)
            it._shutdown_workers()


@functools.cache
def _end_workers_at_exit() -> None:
    """Registers `_end_live_workers` once, at the first multi-worker iterator: after multiprocessing's own exit
    handler (imported by then), so that it runs before that one."""
    atexit.register(_end_live_workers)


class _Loader(DataLoader):
    """A DataLoader that holds (blocks) SIGTERM in this thread while `iter()` forks its workers: each worker starts
    with it blocked until `_ignore_sigterm` has set it ignored, so a signal in between (PyTorch's own worker
    handler would die of it) is dropped; this process takes one that came meanwhile once `iter()` returns. Its
    iterators' workers are ended at interpreter exit (`_end_live_workers`)."""

    def __iter__(self):
        if not self.num_workers:
            return super().__iter__()
        _end_workers_at_exit()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if _CAN_HOLD else None
        try:
            it = super().__iter__()
        finally:
            if held is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
        _LIVE_ITERATORS.add(it)
        return it


def _loaders(train: Dataset, test: Dataset, opts: dict, rank: int, world_size: int):
    workers = opts["num_workers"]
    # Workers start afresh each epoch (not persistent): their RNG streams then come from the loader's generator at
    # the epoch's start, which a checkpoint holds, so a resumed run draws the augmentations an uninterrupted one does
    common = dict(num_workers=workers, pin_memory=opts["pin_memory"], persistent_workers=False,
                  worker_init_fn=_ignore_sigterm if workers else None)
    # Seeds the per-epoch worker seeds; differs across ranks. (The order is the sampler's: seed + epoch.)
    generator = torch.Generator().manual_seed(opts["seed"] + rank)
    train_sampler = EpochSampler(len(train), opts["batch_size"], opts["seed"], rank, world_size)
    train_loader = _Loader(train, opts["batch_size"], sampler=train_sampler, generator=generator, **common)
    test_sampler = DistributedSampler(test, world_size, rank, shuffle=False) if world_size > 1 else None
    # A generator of its own: each pass over the test set draws its base seed from it, not from the global RNG that
    # training's augmentations and dropout draw from, so evaluating (eval_every, a max_steps stop) never changes
    # what the training run does next
    test_loader = _Loader(test, opts["eval_batch_size"], shuffle=False, sampler=test_sampler,
                          generator=torch.Generator().manual_seed(opts["seed"] + rank), **common)
    return train_loader, test_loader


def _require_root(opts: dict, expected: str, how: str) -> Path:
    """The configured root as a Path; DatasetNotFoundError naming what belongs there if unset or missing."""
    name, root = opts["name"], opts["root"]
    root = None if root == "???" else root  # OmegaConf's mark of a value the config leaves to the command line
    where = ("data.root is not set" if root is None else f"data.root={root} is not a directory"
             if Path(root).expanduser().exists() else f"data.root={root} does not exist")
    if root is None or not Path(root).expanduser().is_dir():
        raise DatasetNotFoundError(f"{name}: {where}; expected {expected} there. {how}")
    return Path(root).expanduser()


# ---- digits ---------------------------------------------------------------------------------------


class _ImageTensors(Dataset):
    """Images (N, 1, H, W) repeated to `in_chans` channels, optionally randomly shifted by up to
    `pad` pixels (the uncovered border takes the value `fill`)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, in_chans: int, pad: int = 0, fill=0.0):
        self.images, self.labels, self.in_chans, self.pad, self.fill = images, labels, in_chans, pad, fill

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i]
        if self.pad:
            p, (h, w) = self.pad, x.shape[-2:]
            dy, dx = torch.randint(0, 2 * p + 1, (2,), device="cpu").tolist()
            x = F.pad(x, (p, p, p, p), value=self.fill)[:, dy : dy + h, dx : dx + w]
        return x.expand(self.in_chans, -1, -1), self.labels[i]


def _digits(opts: dict):
    """scikit-learn's 1,797 8x8 digits in [0, 1], bilinearly resized to input_size and normalised
    with the train split's mean/std; a fixed stratified 1,437/360 split. Train: random shifts of up
    to max(1, input_size // 16) pixels, none below 8 pixels (where one pixel would move most of the digit off the
    image); no flips: digits are not mirror-invariant."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    size = opts["input_size"]
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8)
    images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        np.arange(len(labels)),
        test_size=DIGITS_TEST_SIZE,
        stratify=digits.target,
        random_state=DIGITS_SPLIT_SEED,
    )
    idx_train, idx_test = torch.from_numpy(idx_train), torch.from_numpy(idx_test)
    mean, std = images[idx_train].mean(), images[idx_train].std()
    images = (images - mean) / std
    pad = max(1, size // 16) if size >= 8 else 0
    train = _ImageTensors(
        images[idx_train], labels[idx_train], opts["in_chans"], pad, fill=(-mean / std).item()
    )
    test = _ImageTensors(images[idx_test], labels[idx_test], opts["in_chans"])
    return train, test, 10


# ---- cifar10 / cifar100 ---------------------------------------------------------------------------


def _cifar(opts: dict):
    """torchvision CIFAR from data.root; train: random crop (pad input_size/8) + flip; both normalised."""
    import torchvision.datasets as tvd
    import torchvision.transforms as T

    name, size = opts["name"], opts["input_size"]
    cls_name, folder, num_classes, mean, std = _CIFAR[name]
    how = f"Set data.root=<dir containing {folder}/>, or data.download=true to download it into data.root."
    made = None  # the topmost folder this call creates for the download (removed again if the download fails)
    if opts["download"] and opts["root"] is not None and not Path(opts["root"]).expanduser().exists():
        target = Path(opts["root"]).expanduser().absolute()
        made = next(p for p in reversed([target, *target.parents]) if not p.exists())
        target.mkdir(parents=True)
    root = _require_root(opts, f"{folder}/ (the python version of {name}, extracted)", how)
    if not opts["download"] and not (root / folder).is_dir():
        inside = f" data.root names {folder}/ itself: give the folder holding it, data.root={root.parent}." \
            if root.name == folder else ""
        raise DatasetNotFoundError(f"{name}: {root / folder}/ not found under data.root={root}.{inside} {how}")
    resize = [T.Resize(size)] if size != 32 else []
    normalize = [T.ToTensor(), T.Normalize(mean, std)]
    train_tf = T.Compose(
        resize + [T.RandomCrop(size, padding=size // 8), T.RandomHorizontalFlip()] + normalize
    )
    test_tf = T.Compose(resize + normalize)
    cls = getattr(tvd, cls_name)
    try:
        try:
            train = cls(str(root), train=True, transform=train_tf, download=opts["download"])
            test = cls(str(root), train=False, transform=test_tf, download=opts["download"])
        except BaseException:
            if made is not None:  # what this call created holds a partial download at most
                shutil.rmtree(made, ignore_errors=True)
            raise
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted"
        raise DatasetNotFoundError(
            f"{name}: {_bad_cifar_files(cls, root / folder)} under {root / folder}/ (torchvision checks each file's "
            f"MD5 before reading it). {how}"
        ) from e
    except OSError as e:
        if not opts["download"]:  # reading a file (its permissions, a failing disk): no download was asked for
            raise DatasetNotFoundError(f"{name}: cannot read {getattr(e, 'filename', None) or root / folder} "
                                       f"({e.strerror or e}); check the files' permissions under {root / folder}/") from e
        raise DatasetNotFoundError(  # the download itself (no network, a refused or broken connection)
            f"{name}: downloading into data.root={root} failed ({e}); on a machine without access to the dataset's "
            f"site, fetch the python version elsewhere and extract it there as {folder}/"
        ) from e
    return train, test, num_classes


def _bad_cifar_files(cls, folder: Path) -> str:
    """Which of a torchvision CIFAR class's files are missing under `folder` or are not the originals (their MD5)."""
    from torchvision.datasets import cifar

    files = [*cls.train_list, *cls.test_list, [cls.meta["filename"], cls.meta["md5"]]]
    missing = [f for f, _ in files if not (folder / f).is_file()]
    altered = [f for f, md5 in files if f not in missing and not cifar.check_integrity(str(folder / f), md5)]
    parts = ([f"missing: {', '.join(missing)}"] if missing else []) + (
        [f"not the original files (MD5 differs): {', '.join(altered)}"] if altered else [])
    return "; ".join(parts) or "the files do not load"


# ---- imagenet / imagefolder -----------------------------------------------------------------------


def _image_folder(opts: dict):
    """ImageFolder train/ and val/ under data.root; train: RandomResizedCrop + flip; eval: resize to
    input_size/0.875 and center-crop; ImageNet mean/std."""
    import torchvision.datasets as tvd
    import torchvision.transforms as T

    name, size = opts["name"], opts["input_size"]
    expected = "train/ and val/ class folders (train/<class>/<image>, val/<class>/<image>)"
    how = "Set data.root=<that dir>."
    if name == "imagenet":
        how += " For ImageNet, extract ILSVRC2012 train and val there with val sorted into class folders."
    root = _require_root(opts, expected, how)
    missing = [d for d in ("train", "val") if not (root / d).is_dir()]
    if missing:
        inside = (f" data.root names its {root.name}/ itself: give the folder holding train/ and val/, data.root="
                  f"{root.parent}." if root.name in ("train", "val") and (root.parent / "train").is_dir() else "")
        raise DatasetNotFoundError(
            f"{name}: no {' or '.join(d + '/' for d in missing)} in data.root={root}; expected {expected}.{inside} {how}"
        )
    normalize = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip()] + normalize)
    test_tf = T.Compose([T.Resize(round(size / 0.875)), T.CenterCrop(size)] + normalize)
    splits = []
    for split, transform in (("train", train_tf), ("val", test_tf)):
        loop, unreadable = _walk_problems(root / split)
        if loop is not None:
            raise ValueError(f"{name}: {loop} is a symlink to a folder that contains it: ImageFolder would follow it "
                             f"again and again, reading every image below it many times; remove the link")
        if unreadable is not None:  # (ImageFolder's walk skips it: its images would be left out without a word)
            raise DatasetNotFoundError(f"{name}: cannot read the folder {unreadable.filename} ({unreadable.strerror}); "
                                       "fix its permissions, or move it out of data.root")
        try:
            splits.append(tvd.ImageFolder(str(root / split), transform=transform, loader=load_image))
        except FileNotFoundError as e:  # torchvision: no class folders or no images
            raise DatasetNotFoundError(
                f"{name}: {split}/: {e}; expected {expected} in data.root={root}: every folder in {split}/ is a class "
                "and needs images (a hidden one such as .ipynb_checkpoints counts too, as in torchvision's "
                f"ImageFolder: remove it). {how}") from e
    train, test = splits
    if train.classes != test.classes:
        only = [f"only in {split}/: {', '.join(sorted(extra)[:5])}{', ...' if len(extra) > 5 else ''}"
                for split, extra in (("train", set(train.classes) - set(test.classes)),
                                     ("val", set(test.classes) - set(train.classes))) if extra]
        raise ValueError(
            f"{name}: train/ has {len(train.classes)} class folders and val/ {len(test.classes)} in data.root={root} "
            f"({'; '.join(only)}); both need the same class folders (a hidden folder such as .ipynb_checkpoints "
            "counts as a class, as in torchvision's ImageFolder: remove it)"
        )
    return train, test, len(train.classes)


def _walk_problems(folder: Path) -> tuple[str | None, OSError | None]:
    """(loop, unreadable) of a walk of `folder` as ImageFolder walks it: `loop`, a symlinked folder under it whose
    target is a folder the walk is already inside (itself or one above it, also through other links, or one above
    `folder`: ImageFolder follows links, so such a loop repeats the images below it until the OS stops the walk),
    the first the walk reaches; `unreadable`, the error of the first folder that could not be listed (ImageFolder's
    walk skips it, leaving its images out); each None where there is none."""
    folder = os.path.abspath(folder)
    real = os.path.realpath(folder)
    errors: list[OSError] = []
    for top, dirs, _ in os.walk(folder, followlinks=True, onerror=errors.append):
        rel = os.path.relpath(top, folder)
        parts = [] if rel == "." else rel.split(os.sep)
        inside = {os.path.realpath(os.path.join(folder, *parts[:i])) for i in range(len(parts) + 1)}
        for d in dirs:
            link = os.path.join(top, d)
            target = os.path.realpath(link)
            if os.path.islink(link) and (target in inside or os.path.commonpath([target, real]) == target):
                return link, None
    unreadable = [e for e in errors if e.filename != folder]  # (a missing split folder: ImageFolder names it)
    return None, unreadable[0] if unreadable else None


def load_image(path: str):
    """The image file at `path` as an 8-bit RGB PIL image. 16-bit images (PNG/TIFF modes I;16 and I) are scaled to
    8 bits (PIL's convert would clip them at 255: nearly white); an unreadable or truncated file, and float or
    32-bit pixels (PIL's convert would make them near-black), are an OSError naming it (PIL's error does not)."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            img.load()
    except Exception as err:
        raise OSError(f"cannot read the image {path} ({type(err).__name__}: {err}); remove or replace the file") from None
    # mode I is 32-bit integers in PIL; older Pillow opens 16-bit PNGs in it too, so a TIFF's own bit count decides
    bits = max(getattr(img, "tag_v2", {}).get(258, (0,)))  # TIFF BitsPerSample, when the file has it
    if img.mode == "F" or img.mode.startswith("I;32") or (img.mode == "I" and bits > 16):
        raise OSError(f"cannot read the image {path}: its pixels are {img.mode} values (float or 32-bit), whose "
                      "range is not known; save it with 8 or 16 bits per channel")
    if img.mode.startswith("I;16") or img.mode == "I":
        wide = np.asarray(img, dtype=np.float64)
        if wide.size and not 0 <= wide.min() <= wide.max() <= 65535:
            raise OSError(f"cannot read the image {path}: its pixels reach {wide.min():g}..{wide.max():g}, outside "
                          "the 16-bit range 0..65535 this loader scales; save it with 8 or 16 bits per channel")
        img = Image.fromarray((wide * (255 / 65535)).round().astype(np.uint8))
    return img.convert("RGB")


# ---- fake -----------------------------------------------------------------------------------------


class _FakeImages(Dataset):
    """`size` standard-normal images (in_chans, s, s), image i drawn from its own generator, seeded with image key
    `first` + i of data seed `seed` (so the images cost no memory, and every worker sees the same data; torch's CPU
    generator keeps a seed's low 32 bits, so the keys of one seed's train and test images, 0 .. train_size +
    test_size - 1, never share a generator; seeds s and s + 1 do share images once train_size + test_size exceeds
    1,000,003), with fixed random labels (8 bytes each, held) drawn with `label_seed`."""

    def __init__(self, size: int, num_classes: int, shape: tuple[int, int, int], seed: int, first: int,
                 label_seed: int):
        self.shape, self.base = shape, seed * 1_000_003 + 1 + first
        self.labels = torch.randint(0, num_classes, (size,), generator=torch.Generator().manual_seed(label_seed),
                                    device="cpu")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed((self.base + i) % 2**32)
        return torch.randn(self.shape, generator=g, device="cpu"), self.labels[i]


def _fake(opts: dict):
    """Random images and labels, deterministic in data.seed (train and test drawn independently)."""
    num_classes = opts["num_classes"] or 10
    shape = (opts["in_chans"], opts["input_size"], opts["input_size"])
    seed = opts["seed"]
    train = _FakeImages(opts["train_size"], num_classes, shape, seed, 0, label_seed=2 * seed)
    test = _FakeImages(opts["test_size"], num_classes, shape, seed, opts["train_size"], label_seed=2 * seed + 1)
    return train, test, num_classes


# name -> builder(opts) -> (train dataset, test dataset, num_classes)
_BUILDERS = {
    "digits": _digits,
    "cifar10": _cifar,
    "cifar100": _cifar,
    "imagenet": _image_folder,
    "imagefolder": _image_folder,
    "fake": _fake,
}
DATASETS = tuple(_BUILDERS)
