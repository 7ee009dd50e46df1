"""The HTML report in a real headless browser: it renders, every picture decodes, and it loads nothing.

The plan is hand-built with everything the page can show (a comparison, per-layer times, sharded tensors,
pipeline stages), so all five pictures are drawn. Chromium renders the page twice: once to a screenshot that
must not be blank, once with a small script appended to a copy of the page that reports how many images
decoded. The browser is Debian's ``chromium`` (``.ci/run`` installs it); without one the browser test skips.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from plan_helpers import hand_plan

from autoshard.html_report import write_html
from autoshard.ir.graph import Role
from autoshard.ir.spec import Spec
from autoshard.ir.trace import trace
from autoshard.plans.breakdown import LayerTime
from examples import gpt

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--host-resolver-rules=MAP * ~NOTFOUND")  # a page that fetched anything would fail to
CHECK_SCRIPT = """<script>window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const broken = images.filter(i => !(i.complete && i.naturalWidth > 0)).length;
  document.body.setAttribute("data-images", images.length);
  document.body.setAttribute("data-broken", broken);
});</script>"""


def _browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    work = gpt.workload("tiny", abstract=True)
    graph = trace(work.step, *work.args)
    specs = {i: Spec((("x", "y"),) + ((),) * (graph.values[v].rank - 1)) for i, v in enumerate(graph.inputs)
             if graph.values[v].role == Role.BATCH}
    specs.update({i: Spec(((), ("y",))) for i, v in enumerate(graph.inputs)
                  if graph.values[v].role == Role.PARAM and graph.values[v].rank == 2})
    memory = {"param": 3e5, "opt_state": 6e5, "activation": 9e5}
    stages = ({"name": "s0", "forward_s": 1e-3, "backward_s": 2e-3, "num_devices": 4, "memory_by_kind": memory},
              {"name": "s1", "forward_s": 1e-3, "backward_s": 2e-3, "num_devices": 4, "memory_by_kind": memory})
    row = {"peak_memory_bytes": 2e6, "batch_ceiling": 512, "speedup": 1.0}
    plan = dataclasses.replace(
        hand_plan(graph, specs, stages=stages), num_microbatches=4, schedule="1f1b",
        baselines={"autoshard": {**row, "step_s": 1.3e-3, "fits": True}, "DP": {**row, "step_s": 2.6e-3, "fits": True},
                   "FSDP/ZeRO-3": {**row, "step_s": 1.9e-3, "fits": False, "batch_ceiling": None}},
        layer_times=(LayerTime("token_embed", 1e-5, 2e-5, 0.0, 1e-6), LayerTime("blocks.0", 2e-4, 1e-4, 5e-5, 2e-5),
                     LayerTime("blocks.1", 2e-4, 1e-4, 5e-5, 2e-5), LayerTime("lm_head", 5e-5, 1e-5, 1e-5, 0.0)))
    path = tmp_path_factory.mktemp("report") / "report.html"
    write_html(plan, path)
    return path


def test_the_page_is_self_contained_and_shows_every_picture(report):
    page = report.read_text()
    assert re.findall(r"""(?:src|href)\s*=\s*["'](?!data:)""", page) == []  # nothing to load from anywhere
    assert "<link" not in page and "@import" not in page and "url(" not in page
    for caption in ("comparison", "time per layer", "tensor layouts", "memory per device", "pipeline schedule"):
        assert f'alt="{caption}"' in page
    assert "What this plan does not know" in page


def _run(browser: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / "profile"
    return subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HOME": str(tmp_path)})


def test_chromium_renders_the_report(report, tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install -y chromium; .ci/run installs it)")
    shot = tmp_path / "shot.png"
    done = _run(browser, tmp_path, "--window-size=1280,3000", f"--screenshot={shot}", report.as_uri())
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (3000, 1280)
    ink = (pixels[..., :3] < 0.9).any(axis=-1).mean()  # share of pixels that are not (near) white
    assert 0.05 < ink < 0.95, f"the screenshot is {ink:.1%} ink: blank or broken"
    assert np.unique(pixels.reshape(-1, pixels.shape[-1])[::97], axis=0).shape[0] > 50  # pictures, not flat fill

    checked = tmp_path / "checked.html"
    checked.write_text(report.read_text().replace("</body>", CHECK_SCRIPT + "</body>"))
    dom = _run(browser, tmp_path, "--virtual-time-budget=10000", "--dump-dom", checked.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    images = re.search(r'data-images="(\d+)"', dom.stdout)
    broken = re.search(r'data-broken="(\d+)"', dom.stdout)
    assert images and broken, dom.stdout[-1000:]
    assert (int(images.group(1)), int(broken.group(1))) == (5, 0)
