"""Train a ConvNet with stripe-wise pruning: `python train.py [group=option ...] [key=value ...]`.

Config: conf/train.yaml and the groups conf/{model,data,prune,optim}/. Outputs go to the Hydra run
directory (outputs/<date>/<time>/): checkpoints/, tensorboard/, summary.json.
"""

import contextlib
import os
import signal
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from compress._files import remove_if_only_hydra
from compress.engine import run


class Terminated(SystemExit):
    """SIGTERM (a batch system stopping or preempting the job, `kill`): ends the run as an exception, so that its
    train.log says why it stopped; the process exits with status 143 (128 + SIGTERM), as the signal's default would."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)

    def __str__(self) -> str:
        return ("SIGTERM; resume=true continues from the run's last checkpoint, if it wrote one (last.pt: at each "
                "epoch's end, and every trainer.checkpoint_every steps)")


@contextlib.contextmanager
def _sigterm_as_exception():
    """Within: SIGTERM raises `Terminated` in this process (processes forked from it, DataLoader workers, keep the
    signal's default action); the previous handler comes back after."""
    pid = os.getpid()

    def handler(signum, frame):
        if os.getpid() != pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        with _sigterm_as_exception():
            run(cfg)
    except BaseException:  # a run refused before it wrote anything leaves no directory of Hydra's files only
        remove_if_only_hydra(Path(HydraConfig.get().runtime.output_dir), "train.log")
        raise


if __name__ == "__main__":
    main()
