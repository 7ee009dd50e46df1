"""Quiet by default: the launcher forwards gloo's line per peer connection only with --verbose."""
from __future__ import annotations

import io
import sys

from autoshard.runtime.launch import launch

PROGRAM = ("print('[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3'); "
           "print('step 0: loss 1.0')")


def _run(verbose: bool) -> str:
    out, err = io.StringIO(), io.StringIO()
    assert launch([sys.executable, "-c", PROGRAM], 2, 1, stdout=out, stderr=err, verbose=verbose) == 0
    return out.getvalue()


def test_gloo_connection_lines_only_with_verbose():
    quiet = _run(verbose=False)
    assert "[p0] step 0: loss 1.0" in quiet and "[p1] step 0: loss 1.0" in quiet
    assert "Gloo" not in quiet
    assert _run(verbose=True).count("[Gloo] Rank 1 is connected") == 2
