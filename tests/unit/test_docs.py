"""The repository explains itself, and only with what it holds.

No tracked file points outside the repository (a clone has nothing there to follow); every relative link
in the Markdown files resolves to a file of the repository; the README is the short first page and links the
docs/ that hold the rest; docs/ARCHITECTURE.md covers what a newcomer to the code needs; ``.ci/run`` runs the
README's test command.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# names of files that live beside the repository, never in it, and absolute paths of one machine
OUTSIDE = re.compile(r"\.\./shared|\bDESIGN\.md\b|\bSTYLE\.md\b|\bSTYLE convention|JAX-NOTES|/work/|/tmp/")
# a Markdown link to a file or folder: [text](docs/REFERENCE.md), [text](../benchmarks/RESULTS.md#anchor)
LINK = re.compile(r"\]\(((?:[\w.-]+/)*[\w.-]+(?:\.\w+|/))(?:#[^)]*)?\)")


def _tracked() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    paths = [ROOT / n for n in names.split("\0") if n]
    untracked = subprocess.run(["git", "ls-files", "-z", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True).stdout.decode()
    paths += [ROOT / n for n in untracked.split("\0") if n]  # new files count before they are committed
    return [p for p in paths if p.is_file() and p.suffix in (".py", ".md", ".toml", ".sh", ".txt", ".cfg", "")]


def test_no_file_points_outside_the_repository():
    found = []
    for path in _tracked():
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "references to files outside the repository:\n" + "\n".join(found)


def test_markdown_links_resolve_inside_the_repository():
    broken = []
    for path in [p for p in _tracked() if p.suffix == ".md"]:
        for target in LINK.findall(path.read_text()):
            if re.fullmatch(r"[\d.e+-]+B?", target):  # a figure in parentheses, e.g. all-reduce[x](1.68e+07B)
                continue
            resolved = (path.parent / target).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, "links that do not resolve to a file of the repository:\n" + "\n".join(broken)


def test_the_readme_is_the_short_first_page_and_links_the_docs():
    readme = (ROOT / "README.md").read_text()
    sections = re.findall(r"^## (.+)$", readme, flags=re.M)
    assert sections[:3] == ["Install and quick start", "The decorator", "The command line"], sections
    assert re.search(r"^\| command \| what it does \|$", readme, flags=re.M), "the command table"
    for doc in ("docs/REFERENCE.md", "docs/ARCHITECTURE.md", "docs/MULTIHOST.md"):
        assert f"]({doc})" in readme, f"README does not link {doc}"
    assert len(readme.splitlines()) <= 160, "the README grew: move the detail to docs/REFERENCE.md"
    assert "jax.make_mesh" in readme


def test_the_architecture_document_covers_what_a_newcomer_needs():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for heading in ("From a train step to a running plan", "The layers and what each may use", "The cost model",
                    "The intra-op pass and its three promises", "How a plan is checked"):
        assert f"## {heading}" in text, heading
    for promise in ("The objective is the truth", "Solved, or the bound said", "Arbitrated on the compiled program"):
        assert promise in text, promise
    # the layer table agrees with the test that enforces it
    from test_layout import RANKS

    for folder, rank in RANKS.items():
        if folder not in ("face", "base"):
            assert re.search(rf"^\| {rank} \| `{folder}/` \|", text, flags=re.M), f"{folder} at rank {rank}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    [command] = [line for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
                 for line in block.splitlines() if line.endswith("python -m pytest -q")]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    steps = command.split(" && ")
    assert steps[0].startswith("python3 -m venv") and steps[1].startswith(". ") and steps[1].endswith("/bin/activate")
    for step in steps[2:]:  # what runs inside the fresh environment, exactly as the README writes it
        wanted = {step, f"python -m {step}"}  # `python -m pip` is the same pip, run by the environment's python
        assert wanted & set(ci), f".ci/run does not run `{step}`"
