"""One figure style for the whole book (all chapters' labs).

Chinese labels need a CJK font. The pinned PyPI package ``mplfonts`` ships Noto Sans CJK SC; this
module registers that file with matplotlib directly (no network, no ``mplfonts init``), so a
fresh machine renders every figure without missing-glyph boxes.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import matplotlib
from cycler import cycler
from matplotlib import font_manager

CJK_FONT_NAME = "Noto Sans CJK SC"
CJK_FONT_FILE = "NotoSansCJKsc-Regular.otf"

# Okabe-Ito: distinguishable with every common form of color blindness, and in grayscale print.
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#E69F00", "#56B4E9", "#CC79A7", "#F0E442", "#000000"]
# The same meaning gets the same color in every chapter's "estimate | measured | recorded" plots.
ROLE_COLORS = {"estimate": "#0072B2", "measured": "#D55E00", "recorded": "#009E73"}

BOOK_RC = {
    "font.family": "sans-serif",
    "font.sans-serif": [CJK_FONT_NAME, "DejaVu Sans"],  # DejaVu as fallback for rare symbols
    "axes.unicode_minus": False,  # the CJK font has no U+2212 minus sign
    "figure.figsize": (6.4, 4.0),
    "figure.dpi": 100,
    "figure.constrained_layout.use": True,
    "savefig.dpi": 150,
    "font.size": 10,
    "axes.titlesize": 12,
    "axes.labelsize": 10.5,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "axes.prop_cycle": cycler(color=PALETTE),
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "lines.linewidth": 1.8,
    "lines.markersize": 5,
}


def cjk_font_path() -> Path:
    """The Noto Sans CJK SC file inside the installed ``mplfonts`` package."""
    spec = importlib.util.find_spec("mplfonts")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the book's figures need the CJK font of the PyPI package "
                                  "'mplfonts' (pip install -r requirements.txt)")
    path = Path(next(iter(spec.submodule_search_locations))) / "fonts" / CJK_FONT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall mplfonts (pip install -r requirements.txt)")
    return path


def use_book_style() -> None:
    """Register the CJK font and set the book's figure style (safe to call more than once)."""
    path = str(cjk_font_path())
    if not any(font.fname == path for font in font_manager.fontManager.ttflist):
        font_manager.fontManager.addfont(path)
    matplotlib.rcParams.update(BOOK_RC)


def ceilings(device) -> tuple[float, float]:
    """(P, W) of a GPU spec row (datasheet bf16 rate, bandwidth) or of a probe (measured ones)."""
    if hasattr(device, "bf16_flops"):
        return device.bf16_flops, device.bandwidth
    return device.matmul_flops, device.copy_bandwidth


SPEC_STYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (1, 2)))


def plot_roofline(ax, specs, probe, prefill_points=(), decode_points=(), on=None):
    """The roofline min(P, I·W) of each GPU spec (grey, one line style each, named in the legend)
    and of this device's probe (in color), in TFLOP/s against FLOP per byte.

    ``prefill_points`` / ``decode_points`` are (label, intensity) pairs placed on the roofline of
    ``on`` (a spec or the probe): circles for prefill, labelled above; triangles for decode,
    labelled below.
    """
    import numpy as np

    from minillm.lab.estimate import attainable_flops

    intensity = np.logspace(-1, 4.5, 200)
    for spec, style in zip(specs, SPEC_STYLES):
        peak, bandwidth = ceilings(spec)
        ax.plot(intensity, [attainable_flops(i, peak, bandwidth) / 1e12 for i in intensity],
                lw=1.2, color="#777777", linestyle=style, label=f"{spec.name}（规格，脊点 {spec.ridge_point:,.0f}）")
    peak, bandwidth = ceilings(probe)
    ax.plot(intensity, [attainable_flops(i, peak, bandwidth) / 1e12 for i in intensity],
            color=ROLE_COLORS["measured"], lw=2.2, label=f"本机实测（{probe.device}，脊点 {peak / bandwidth:,.1f}）")
    if on is not None:
        peak, bandwidth = ceilings(on)
        for points, marker, color, dy in ((prefill_points, "o", ROLE_COLORS["estimate"], 7),
                                          (decode_points, "^", ROLE_COLORS["recorded"], -15)):
            for label, i in points:
                rate = attainable_flops(i, peak, bandwidth) / 1e12
                ax.plot(i, rate, marker, color=color, markersize=6)
                ax.annotate(label, (i, rate), xytext=(0, dy), textcoords="offset points", fontsize=9,
                            ha="center")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("算术强度（FLOP/字节）")
    ax.set_ylabel("可达速率（TFLOP/s）")
    ax.legend(loc="upper left", fontsize=9)


MEMORY_SEGMENTS = (("权重", "weight_bytes", "#0072B2"), ("激活峰值", "activation_peak_bytes", "#D55E00"),
                   ("PyTorch 之外", "other_bytes", "#CC79A7"), ("KV 块", "kv_cache_bytes", "#009E73"),
                   ("未用", "unused_bytes", "#DDDDDD"))


def plot_memory_plans(ax, plans, min_share: float = 12.0, fontsize: float = 10) -> None:
    """Where each card's memory goes, one stacked bar per ``(label, MemoryPlan)`` in ``plans``
    (a list of pairs or a dict), as shares of the whole card so cards of any size compare: weights,
    activation peak, memory outside PyTorch, KV blocks, unused (chapter 一张 24 GiB 的卡放 8B 模型).

    The ledger's plan has no activation peak and nothing outside PyTorch; segments wider than
    ``min_share`` percent are labelled with their bytes.
    """
    from minillm.engine.units import fmt_bytes

    plans = list(plans.items()) if isinstance(plans, dict) else list(plans)
    for row, (_, plan) in enumerate(plans):
        left = 0.0
        for label, field, color in MEMORY_SEGMENTS:
            size = getattr(plan, field)
            share = 100 * size / plan.total_bytes
            ax.barh(row, share, left=left, color=color, edgecolor="white", label=label if row == 0 else None)
            if share > min_share:
                ax.text(left + share / 2, row, fmt_bytes(size), ha="center", va="center", fontsize=fontsize)
            left += share
    ax.set_yticks(range(len(plans)), [label for label, _ in plans], fontsize=fontsize)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("占整张卡的比例（%）")
    ax.grid(False)
    ax.legend(ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.25), fontsize=fontsize)


def flowchart(ax, nodes: dict[str, tuple[float, float, str]], edges: list[tuple[str, str, str]],
              colors: dict[str, str] | None = None, width: float = 1.6, height: float = 0.6,
              fontsize: float = 8.5) -> None:
    """A box-and-arrow diagram in the book's style, drawn by matplotlib so it renders offline with
    the CJK font: ``nodes`` maps a name to ``(x, y, label)`` (box centers, data units); ``edges``
    are ``(from, to, label)`` arrows; ``colors`` maps a name to its box color (default: light grey).
    ``fontsize`` (points) is the boxes' text; edge labels are a point smaller, set beside their
    arrow, never on it.
    """
    from matplotlib.patches import FancyBboxPatch

    for name, (x, y, label) in nodes.items():
        color = (colors or {}).get(name, "#EEEEEE")
        ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height,
                                    boxstyle="round,pad=0.04,rounding_size=0.12", facecolor=color,
                                    edgecolor="#555555", linewidth=0.8))
        ax.text(x, y, label, ha="center", va="center", fontsize=fontsize)
    def border(x, y, dx, dy):  # where the line from a box's center along (dx, dy) leaves the box
        scale = min(width / 2 / abs(dx) if dx else float("inf"), height / 2 / abs(dy) if dy else float("inf"))
        return x + dx * scale * 1.08, y + dy * scale * 1.08

    for start, end, label in edges:
        (x0, y0, _), (x1, y1, _) = nodes[start], nodes[end]
        tail, head = border(x0, y0, x1 - x0, y1 - y0), border(x1, y1, x0 - x1, y0 - y1)
        ax.annotate("", xy=head, xytext=tail,
                    arrowprops=dict(arrowstyle="-|>", color="#555555", lw=1.0, shrinkA=0, shrinkB=0))
        if label:  # offset from the arrow's midpoint along its normal, so the arrow never strikes it
            dx, dy = head[0] - tail[0], head[1] - tail[1]
            norm = (dx * dx + dy * dy) ** 0.5 or 1.0
            nx, ny = -dy / norm, dx / norm
            if ny < 0 or (ny == 0 and nx < 0):  # the side above (or right of) the arrow
                nx, ny = -nx, -ny
            ax.annotate(label, ((tail[0] + head[0]) / 2, (tail[1] + head[1]) / 2),
                        xytext=(6 * nx, 6 * ny), textcoords="offset points",
                        ha="left" if nx > 0.3 else ("right" if nx < -0.3 else "center"),
                        va="bottom" if ny > 0.3 else "center", fontsize=fontsize - 1, color="#333333")
    xs, ys = [x for x, _, _ in nodes.values()], [y for _, y, _ in nodes.values()]
    ax.set_xlim(min(xs) - width, max(xs) + width)
    ax.set_ylim(min(ys) - 2 * height, max(ys) + 2 * height)
    ax.set_aspect("equal")
    ax.axis("off")
