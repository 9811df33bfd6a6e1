"""Train a ConvNet with stripe-wise pruning: `python train.py [group=option ...] [key=value ...]`.

Config: conf/train.yaml and the groups conf/{model,data,prune,optim}/. Outputs go to the Hydra run
directory (outputs/<date>/<time>/): checkpoints/, tensorboard/, summary.json.
"""

import hydra
from omegaconf import DictConfig

from compress.engine import run


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
