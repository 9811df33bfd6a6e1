"""Train a ConvNet with stripe-wise pruning: `python train.py [group=option ...] [key=value ...]`.

Config: conf/train.yaml and the groups conf/{model,data,prune,optim}/. Outputs go to the Hydra run
directory (outputs/<date>/<time>/): checkpoints/, tensorboard/, summary.json.
"""

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from compress._files import remove_if_only_hydra
from compress._stop import Terminated, sigterm_raises
from compress.engine import run


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        with sigterm_raises():  # inside the training loop, a SIGTERM stops after the step (compress._stop)
            run(cfg)
    except BaseException as err:  # a run refused before it wrote anything leaves no directory of Hydra's files only
        hydra_cfg = HydraConfig.get()
        if isinstance(err, Terminated):  # Python reports no SystemExit: a batch job's output says why it ended
            rank = os.environ.get("RANK", "0")
            print(("" if rank == "0" else f"rank {rank}: ") + f"train.py stopped: {err}", file=sys.stderr, flush=True)
        elif isinstance(err, Exception) and hydra_cfg.mode == RunMode.MULTIRUN:  # Hydra shows the first failed job's
            # error only, once the sweep has run: each job's, as it fails
            print(f"train.py job {hydra_cfg.job.num} ({' '.join(hydra_cfg.overrides.task)}) failed: "
                  f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
        remove_if_only_hydra(Path(hydra_cfg.runtime.output_dir), "train.log")
        raise


if __name__ == "__main__":
    main()
