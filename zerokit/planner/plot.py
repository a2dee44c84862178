"""Stacked bars of GPU memory per stage against the device's capacity (matplotlib, imported lazily
so that the planner itself needs nothing beyond the standard library)."""

from __future__ import annotations

from zerokit.planner.advice import Plan
from zerokit.planner.memory import CATEGORIES
from zerokit.planner.spec import GB

COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
           "activations": "#c44e52", "buffers": "#8172b3", "overhead": "#937860"}


def plot_plan(plan: Plan, path: str) -> None:
    """Write a PNG (or any format matplotlib infers from `path`)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'zerokit[plot]'") from None
    bars = list(plan.stages)
    if plan.pick is not None and plan.pick.offload.any:
        bars.append(plan.pick)
    labels = [f"ZeRO-{b.stage}" + ("\n" + b.offload.name if b.offload.any else "") for b in bars]
    figure = Figure(figsize=(2.0 + 1.6 * len(bars), 5.0))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    bottoms = [0.0] * len(bars)
    for category in CATEGORIES:
        heights = [b.memory.as_dict()[category] / GB for b in bars]
        axes.bar(labels, heights, bottom=bottoms, label=category.replace("_", " "), color=COLOURS[category])
        bottoms = [low + h for low, h in zip(bottoms, heights)]
    reference = bars[0] if bars else None
    if reference is not None:
        capacity = reference.capacity / GB
        axes.axhline(capacity, color="black", linewidth=1.2, label="GPU capacity")
        axes.axhline(reference.usable / GB, color="black", linestyle="--", linewidth=1.0,
                     label=f"usable ({1 - plan.policy.headroom:.0%})")
        top = min(max(max(bottoms), capacity), 3 * capacity) * 1.12  # very tall bars are clipped, labelled
        axes.set_ylim(0, top)
        for x, total in enumerate(bottoms):
            clipped = total > 0.94 * top
            axes.text(x, 0.94 * top if clipped else total + 0.01 * top,
                      f"{total:.1f} GB" + (" (clipped)" if total > top else ""), ha="center", va="bottom", fontsize=8,
                      bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})  # legible over the lines
    pick = plan.pick.label if plan.pick else "nothing fits"
    axes.set_title(f"{plan.scenario.model.name} on {plan.scenario.cluster.gpu.name}: pick {pick}", fontsize=10)
    axes.set_ylabel("GB per GPU (1 GB = 1e9 bytes)")
    axes.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
