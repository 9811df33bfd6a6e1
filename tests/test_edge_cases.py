"""tests/edge_cases.py, the edge-case checks of every op and module against float64 references, as tests: on the
CPU in the default suite (the CUDA-only cases skipped), on CUDA under `pytest -m cuda`. The script runs in a process
of its own (it sets the device and the thread count for the whole process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_ONLY = {"stripe/large_index_gt_2^31", "stripe/nondefault_stream"}


def _run(device: str, out: Path) -> dict:
    r = subprocess.run([sys.executable, "tests/edge_cases.py", "--device", device, "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    report = json.loads(out.read_text())
    failed = {x["name"]: x["error"] for x in report["results"] if x["status"] == "fail"}
    assert r.returncode == 0 and not failed, (failed, r.stdout[-3000:] + r.stderr[-3000:])
    return report


def test_edge_cases_cpu(tmp_path):
    report = _run("cpu", tmp_path / "edge.json")
    skipped = {x["name"] for x in report["results"] if x["status"] == "skip"}
    assert skipped == CUDA_ONLY and report["summary"]["counts"]["pass"] > 200


@pytest.mark.cuda
def test_edge_cases_cuda(tmp_path):
    report = _run("cuda", tmp_path / "edge.json")
    assert report["summary"]["counts"] == {"pass": report["summary"]["total"], "fail": 0, "skip": 0}
