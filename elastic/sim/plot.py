"""PNG figures of simulated policies (`flexfloor simulate --plot DIR`); matplotlib is imported here
and in elastic/timeline_plot.py only, so nothing else in elastic/ needs it."""
from __future__ import annotations

import re
from pathlib import Path

from elastic.ledger import STATES
from elastic.sim.replay import TraceResult
from elastic.timeline import Timeline
from elastic.timeline_plot import COLOURS, plot_timelines


def write_plots(results: list[TraceResult], out_dir: str | Path) -> list[Path]:
    """Active ranks over time in the first rollout (one line per policy) and the summed ledger of
    every policy as stacked bars; returns the files written."""
    # Deferred: matplotlib is optional and heavy, imported only when a plot is asked for.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for res in results:
        first = res.rollouts[0]
        times = [t for t, _ in first.timeline] + [first.ledger.wall_s]
        active = [a for _, a in first.timeline]
        ax.step(times, active + active[-1:], where="post", label=res.policy.label)
    ax.set_xlabel("seconds into the first simulated rollout")
    ax.set_ylabel("ranks in the EP group")
    ax.set_title("Active ranks over time")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out / "active_ranks.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(results) + 2), 4.5))
    labels = [r.policy.label for r in results]
    bottoms = [0.0] * len(results)
    for state in STATES:
        vals = [r.ledger().rank_seconds()[state] for r in results]
        ax.bar(range(len(results)), vals, bottom=bottoms, label=state, color=COLOURS[state])
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_xticks(range(len(results)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("rank-seconds (summed over rollouts)")
    ax.set_title("Rank-time ledger per policy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "ledger.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written + write_timelines(results, out)


def write_timelines(results: list[TraceResult], out: Path) -> list[Path]:
    """The first rollout's per-rank timeline of every policy simulated with `SimConfig.timeline`
    (the figure `flexfloor rollout --plot` draws of a real rollout): `timeline.png` for one policy,
    `timeline-<label>.png` each for several."""
    written = []
    for res in results:
        first = res.rollouts[0].ledger
        if not first.ranks[0].timeline.states:
            continue
        slug = re.sub(r"[^a-z0-9]+", "-", res.policy.label.lower()).strip("-")
        name = "timeline" if len(results) == 1 else f"timeline-{slug}"
        title = f"{res.policy.label} (simulated, first rollout)"
        written.append(plot_timelines([Timeline.of_ledger(first, title=title)], out / f"{name}.png"))
    return written
