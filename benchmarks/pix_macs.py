"""MACs and params of the PiX ResNets of the paper's Table 1 against their dense ResNets (`compress.profile`).

    python benchmarks/pix_macs.py [--out benchmarks/results/pix_macs_paper_convention.json]

torchvision ResNet-50/101/152 at 224x224, 1000 classes; PiX inserted with zeta 4 (standard widths) and, for
ResNet-50, zeta 8 (the thin network); both MAC conventions of `compress.profile` ("layers": convs, Linear and
PiX's own work; "paper": also bias, BN, ReLU and pooling elements, as the paper and ptflops count). Counts only:
no timing, any machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compress.pix import insert_pix  # noqa: E402
from compress.profile import profile  # noqa: E402

PAPER_GMACS = {("resnet50", 4): 3.18, ("resnet101", 4): 6.05, ("resnet152", 4): 8.91, ("resnet50", 8): 1.39}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pix_macs_paper_convention.json"))
    args = ap.parse_args()
    rows = []
    for (name, zeta), paper in PAPER_GMACS.items():
        for pix in (None, zeta):
            model = getattr(torchvision.models, name)()
            if pix:
                insert_pix(model, pix)
            counts = {c: profile(model, (3, 224, 224), latency=False, convention=c) for c in ("paper", "layers")}
            row = {"model": name, "zeta": pix, "gmacs_paper": round(counts["paper"].macs / 1e9, 4),
                   "gmacs_layers": round(counts["layers"].macs / 1e9, 4),
                   "params_m": round(counts["layers"].params / 1e6, 3),
                   "paper_table_gmacs": paper if pix else None}
            if pix:
                row["error_vs_paper"] = round(row["gmacs_paper"] / paper - 1, 4)
            rows.append(row)
            print(row, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"benchmark": "PiX ResNet MACs and params (compress.profile)",
                                          "torch": torch.__version__, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
