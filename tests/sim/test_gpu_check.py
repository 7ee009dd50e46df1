"""benchmarks/gpu_check.py on this CPU: it says no accelerator is present and writes its table, one row per
config with every column filled (the GPU run is the same code on jax.devices()[0])."""
from __future__ import annotations

import re

from benchmarks import gpu_check


def test_gpu_check_writes_its_table_on_cpu(devices8, tmp_path, capsys):
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--configs", "tiny:mixed", "--steps", "2", "--warmup", "1", "--cluster", "cpu-8",
                           "--out", str(out)]) == 0
    assert "no accelerator present" in capsys.readouterr().out
    text = out.read_text()
    assert text.startswith("no accelerator present")
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0] == "| " + " | ".join(gpu_check.HEADERS) + " |"
    assert len(rows) == 2 and rows[1].startswith("| tiny:mixed |")
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    assert len(cells) == len(gpu_check.HEADERS)
    assert re.fullmatch(r".+ \([+-]\d+\.\d%\)", cells[2])  # @autoshard's time and its overhead over jax.jit
    assert re.fullmatch(r".+ \(\d+\.\d\dx\)", cells[3])  # the modeled step and its ratio to jax.jit's
    assert " vs " in cells[4] and float(cells[5]) > 0


def test_config_names_pick_precision_and_batch():
    config, batch = gpt_check_config("large:mixed@8")
    assert (config.param_dtype, config.dtype, config.d_model, batch) == ("float32", "bfloat16", 2048, 8)
    config, batch = gpt_check_config("tiny:bf16")
    assert (config.param_dtype, config.dtype, batch) == ("bfloat16", "bfloat16", None)


gpt_check_config = gpu_check.gpt_config
