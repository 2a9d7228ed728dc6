"""The per-rank timeline figure (elastic/timeline.py) as a PNG: one strip per rank of its states over
wall time, its events marked on it; several rollouts side by side on one time axis. matplotlib is
imported here only (it is optional: `pip install matplotlib`)."""
from __future__ import annotations

from pathlib import Path

from elastic.ledger import STATES
from elastic.timeline import MARKS, Timeline

COLOURS = {"busy": "#2b8cbe", "dummy": "#e34a33", "transition": "#fdbb84", "leased": "#31a354", "idle": "#bdbdbd"}
# (marker, colour, legend text) per mark kind.
_MARK_STYLE = {"stage": ("v", "black", "stage change"), "migrate": ("D", "#756bb1", "requests migrated"),
               "lease-start": (">", "#006d2c", "lease starts"), "lease-end": ("<", "#00441b", "lease ends")}
assert set(_MARK_STYLE) == set(MARKS)


def plot_timelines(timelines: list[Timeline], path: str | Path) -> Path:
    """Write the timelines side by side (one panel each, one x axis) to `path`; returns it."""
    # Deferred: matplotlib is optional and heavy, imported only when a plot is asked for.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    n = len(timelines)
    ranks = max(t.ranks for t in timelines)
    height = min(12.0, 1.6 + 0.32 * ranks)
    fig, axes = plt.subplots(1, n, figsize=(max(7.0, 6.0 * n), height), sharex=True, squeeze=False)
    bar = 0.8  # of each rank's strip
    marker_size = max(2.0, min(7.0, 90.0 / ranks))
    for ax, tl in zip(axes[0], timelines):
        for state in STATES:
            for r in range(tl.ranks):
                spans = [(s.start_s, s.seconds) for s in tl.segments if s.rank == r and s.state == state]
                if spans:
                    ax.broken_barh(spans, (r - bar / 2, bar), facecolors=COLOURS[state], linewidth=0)
        for kind, (marker, colour, _) in _MARK_STYLE.items():
            pts = [(m.at_s, m.rank) for m in tl.marks if m.kind == kind]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] - bar / 2 if kind == "stage" else p[1] for p in pts],
                        linestyle="none", marker=marker, color=colour, markersize=marker_size)
        ax.set_ylim(tl.ranks - 0.5, -0.7)  # rank 0 at the top
        ax.set_yticks(range(tl.ranks) if tl.ranks <= 32 else range(0, tl.ranks, max(1, tl.ranks // 16)))
        ax.set_ylabel("rank")
        ax.set_xlabel("seconds into the rollout")
        ax.set_title(f"{tl.title}\n{tl.wall_s:.2f} s, {tl.ranks} ranks".strip(), fontsize=10)
        ax.set_xlim(0, max(t.wall_s for t in timelines) * 1.01)
    handles = [Patch(color=COLOURS[s], label=s) for s in STATES]
    handles += [Line2D([], [], linestyle="none", marker=m, color=c, label=text) for m, c, text in _MARK_STYLE.values()]
    rows = 1 if n > 1 else 2  # one panel is too narrow for the legend on one line
    fig.legend(handles=handles, loc="lower center", ncol=-(-len(handles) // rows), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, min(0.3, 0.3 * rows / height), 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
