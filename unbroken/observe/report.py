"""``report.html``: the loss beside a fault-free run, the replicas' timeline, the goodput breakdown.

One self-contained file (matplotlib images embedded as base64), readable offline. Without
matplotlib (the ``[report]`` extra) the report has every table and the event log, and says
which plots it left out and how to get them.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from unbroken.extras import MissingExtra, require
from unbroken.observe.events import read_events, read_jsonl

STATE_COLOURS = {
    "launching": "#bbbbbb",
    "warming_up": "#9ecae1",
    "training": "#31a354",
    "failed": "#de2d26",
    "recovering": "#fd8d3c",
    "catching_up": "#fdd0a2",
    "isolated": "#756bb1",
    "stopped": "#636363",
    "finished": "#ffffff",
}


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _loss_plot(run_dir: Path, replicas: int, reference: list[float] | None) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    for r in range(replicas):
        rows = [x for x in read_jsonl(run_dir / f"metrics-r{r}.jsonl") if x.get("committed")]  # not "ready" lines
        ax.plot([x["step"] for x in rows], [x["loss"] for x in rows], lw=0.8, label=f"replica {r} (with faults)")
    if reference:
        ax.plot(range(len(reference)), reference, "k--", lw=1, label="fault-free reference")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    out = _png(fig)
    plt.close(fig)
    return out


def _timeline_plot(events: list[dict[str, Any]], replicas: int) -> str:
    import matplotlib.pyplot as plt

    t0 = min(e["t"] for e in events)
    t1 = max(e["t"] for e in events)
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.5 * replicas))
    for r in range(replicas):
        moves = [(e["t"] - t0, e["new"]) for e in events if e["kind"] == "replica_state" and e["replica"] == r]
        state, since = "launching", 0.0
        for t, new in moves + [(t1 - t0, None)]:
            ax.barh(r, t - since, left=since, color=STATE_COLOURS.get(state, "#000"), edgecolor="none")
            if new is not None:
                state, since = new, t
    for e in events:
        if e["kind"] == "fault_injected":
            ax.axvline(e["t"] - t0, color="k", lw=0.8)
            ax.text(e["t"] - t0, replicas - 0.4, e["fault_kind"], fontsize=7, rotation=90, va="bottom")
    ax.set_yticks(range(replicas), [f"replica {r}" for r in range(replicas)])
    ax.set_xlabel("seconds since start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for s, c in STATE_COLOURS.items() if s != "finished"]
    ax.legend(
        handles,
        [s for s in STATE_COLOURS if s != "finished"],
        fontsize=6,
        ncol=4,
        loc="upper left",
        bbox_to_anchor=(0, -0.35),
    )
    out = _png(fig)
    plt.close(fig)
    return out


def _goodput_plot(detail: dict[str, Any]) -> str:
    import matplotlib.pyplot as plt

    parts = {"productive": detail["productive_s"], **detail["lost_s"]}
    fig, ax = plt.subplots(figsize=(8, 1.3))
    left = 0.0
    for i, (k, v) in enumerate(parts.items()):
        ax.barh(0, v, left=left, color=plt.cm.tab10(i), label=f"{k} {v:.0f}s")
        left += v
    ax.set_yticks([])
    ax.set_xlabel("replica-seconds")
    ax.legend(fontsize=7, ncol=4, loc="upper left", bbox_to_anchor=(0, -0.6))
    out = _png(fig)
    plt.close(fig)
    return out


def write_report(
    path: Path, run_dir: Path, summary: dict[str, Any], reference: list[float] | None, replicas: int
) -> str | None:
    """Writes the report; returns why its plots were left out (matplotlib missing), else None."""
    try:
        require("matplotlib", "report", "the report's plots").use("Agg")
        missing = None
    except MissingExtra as e:
        missing = str(e)
    events = sorted(read_events(run_dir / "events.jsonl"), key=lambda e: e["t"])
    faults = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(f.get(c)))}</td>"
            for c in ("kind", "target", "detected", "attributed_correctly", "recovered", "detect_s", "detected_by")
        )
        + "</tr>"
        for f in summary["faults"]
    )
    scalars = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
        for k, v in summary.items()
        if k not in ("faults", "goodput_detail")
    )
    interesting = [e for e in events if e["kind"] not in ("replica_finished",)]
    log = "\n".join(
        html.escape(json.dumps({k: v for k, v in e.items() if k not in ("schedule", "donors")})) for e in interesting
    )

    def image(draw: Any, *args: Any) -> str:
        if missing is not None:
            return f"<p><i>plot left out: {html.escape(missing)}</i></p>"
        return f'<img src="data:image/png;base64,{draw(*args)}">'

    path.write_text(f"""<!doctype html><html><head><meta charset="utf-8"><title>unbroken demo report</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:auto}}td,th{{padding:2px 8px;border-bottom:1px solid #ddd}}
pre{{font-size:11px;max-height:30em;overflow:auto;background:#f6f6f6}}</style></head><body>
<h1>unbroken demo</h1>
<p>goodput <b>{summary['goodput']:.1%}</b> over {summary['wall_s']} s, {summary['global_restarts']} global restarts.</p>
<h2>Faults</h2><table><tr><th>kind</th><th>target</th><th>detected</th><th>attributed</th><th>recovered</th>
<th>detect s</th><th>detected by</th></tr>{faults}</table>
<h2>Loss beside a fault-free run</h2>{image(_loss_plot, run_dir, replicas, reference)}
<h2>Timeline of replica states and faults</h2>{image(_timeline_plot, events, replicas)}
<h2>Goodput</h2>{image(_goodput_plot, summary['goodput_detail'])}
<h2>Summary</h2><table>{scalars}</table>
<h2>Events</h2><pre>{log}</pre></body></html>""")
    return missing
