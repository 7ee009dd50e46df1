"""The HTML report of a plan (``autoshard explain plan.json --html report.html``): one self-contained page.

From the top: the headline figures (modeled step, memory against the budget,
the margin over the best classic plan), what the plan does not know
(``plans/caveats.py``, with the safer classic choice when there is one), then
the pictures of ``figures.py`` (comparison, time per layer, tensor layouts,
memory per device, pipeline schedule) and last the explain tables of
``report.py``. Pictures are inline PNGs and styles inline CSS: the page loads
nothing from anywhere, so it can be mailed or attached to a ticket.
"""
from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console, Group

from autoshard.figures import figures, png_bytes
from autoshard.plans.ledger import fmt_bytes, fmt_s
from autoshard.plans.plan import Plan
from autoshard.report import explain_renderables

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto; max-width: 1250px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; margin-bottom: .2em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
.sub { color: #666; margin-top: 0; }
.cards { display: flex; flex-wrap: wrap; gap: .8em; margin: 1em 0; }
.card { border: 1px solid #ddd; border-radius: 8px; padding: .6em 1em; min-width: 11em; }
.card b { display: block; font-size: 1.3em; } .card span { color: #666; font-size: .85em; }
.bad b { color: #c44e52; }
.caveats { border-left: 5px solid #dd8452; background: #fff8f1; padding: .4em 1.2em; border-radius: 4px; }
.caveats dt { font-weight: 600; margin-top: .5em; } .caveats dd { margin-left: 1.2em; }
.safer { background: #fde8e8; border: 1px solid #c44e52; border-radius: 6px; padding: .5em 1em; font-weight: 600; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: .9em; }
details summary { cursor: pointer; font-weight: 600; }
"""


def _card(title: str, value: str, note: str = "", bad: bool = False) -> str:
    return (f'<div class="card{" bad" if bad else ""}"><span>{html.escape(title)}</span><b>{html.escape(value)}</b>'
            f'<span>{html.escape(note)}</span></div>')


def _cards(plan: Plan) -> str:
    led = plan.ledger
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.axis_names, plan.mesh_shape))
    cards = [_card("modeled step", fmt_s(plan.step_s), f"compute {fmt_s(led.compute_s)}, collectives "
                   f"{fmt_s(led.comm_s)}, resharding {fmt_s(led.reshard_s)}"),
             _card("peak memory per device", fmt_bytes(led.peak_memory_bytes),
                   f"budget {fmt_bytes(plan.memory_budget_bytes)}" + ("" if plan.fits else ": OVER"),
                   bad=not plan.fits),
             _card("mesh", mesh, plan.cluster.name)]
    fallback = plan.best_baseline(fitting=True)
    if fallback and plan.step_s > 0:
        ratio = float(plan.baselines[fallback]["step_s"]) / plan.step_s
        cards.append(_card("against the best classic plan that fits", f"{ratio:.2f}x", fallback,
                           bad=plan.caveats.safer_choice is not None))
    return '<div class="cards">' + "".join(cards) + "</div>"


def _caveats(plan: Plan) -> str:
    caveats = plan.caveats
    body = "".join(f"<dt>{html.escape(title)}</dt>" + "".join(f"<dd>{html.escape(item)}</dd>" for item in items)
                   for title, items in caveats.sections())
    safer = (f'<p class="safer">Safer choice: {html.escape(caveats.safer_choice)}, the classic plan; autoshard\'s '
             "modeled gain over it is within the model's error.</p>" if caveats.safer_choice else "")
    return f'<section class="caveats"><h2>What this plan does not know</h2>{safer}<dl>{body}</dl></section>'


def report_html(plan: Plan, renderables: Sequence[Any] | None = None) -> str:
    """The page (module docstring) as one string."""
    import matplotlib.pyplot as plt

    console = Console(record=True, width=140, file=io.StringIO())
    console.print(Group(*(renderables if renderables is not None else explain_renderables(plan))))
    tables = console.export_html(inline_styles=True, code_format="<pre style=\"font-family:monospace\">{code}</pre>")
    pictures = []
    for caption, fig in figures(plan):
        data = base64.b64encode(png_bytes(fig)).decode()
        pictures.append(f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{html.escape(caption)}</figcaption></figure>")
        plt.close(fig)
    origin = ", ".join(f"{k} {v}" for k, v in plan.origin.items())
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>autoshard plan {html.escape(plan.name)}</title><style>{STYLE}</style></head><body>"
            f"<h1>autoshard plan {html.escape(plan.name)}</h1>"
            f'<p class="sub">{html.escape(origin or "origin not recorded")}; every time below is modeled</p>'
            f"{_cards(plan)}{_caveats(plan)}<h2>Pictures</h2>{''.join(pictures)}"
            f"<details open><summary>Tables</summary>{tables}</details></body></html>")


def write_html(plan: Plan, path: str | Path, renderables: Sequence[Any] | None = None) -> None:
    """Write ``report_html`` to ``path``."""
    Path(path).write_text(report_html(plan, renderables))
