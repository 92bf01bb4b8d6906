"""Tables for the book's pages and labs: every lab ends in "estimate | measured here | recorded on GPU".

A recorded GPU number is only ever read from ``data/measurements/*.json`` (``minillm.lab.records``),
the files that ``python -m minillm bench`` writes; when there is none, the cell says so plainly.
"""
from __future__ import annotations

NOT_RECORDED = "尚未在 GPU 上记录"


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table; cells are printed with ``str``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def show_table(header: list[str], rows: list[list]):
    """Display a Markdown table in a notebook (renders in JupyterLab and in the built book)."""
    from IPython.display import Markdown, display

    display(Markdown(markdown_table(header, rows)))


COMPARISON_HEADER = ["量", "估算", "本机实测", "GPU 记录"]


def comparison_table(rows: list[tuple[str, str, str, str | None]]):
    """The lab's closing table: (quantity, estimate, measured here, recorded on GPU or None)."""
    show_table(COMPARISON_HEADER, [[q, e, m, r if r is not None else NOT_RECORDED]
                                   for q, e, m, r in rows])


BOUND_WORDS = {"compute": "算力", "memory": "带宽"}


def floor_words(floor) -> str:
    """A ``minillm.lab.estimate.Floor`` as the book writes it: the time and the ceiling that binds,
    e.g. ``≥ 2.7 ms（算力：F/P）``."""
    side = "F/P" if floor.bound == "compute" else "M/W"
    return f"≥ {floor.seconds * 1e3:,.2f} ms（{BOUND_WORDS[floor.bound]}：{side}）"


def profile_beat_words(measured: float, floor, profile, what: str = "这一步") -> str | None:
    """Why ``measured`` seconds of ``what`` beat ``floor`` (None when they did not), in numbers: the
    rate it really reached against the machine profile's ceiling that the floor divided by, and
    the load when that was probed."""
    if measured >= floor.seconds:
        return None
    if floor.bound == "compute":
        reached, ceiling, probe, unit = floor.flops / measured, floor.peak_flops, "矩阵乘速率", "GFLOP/s"
    else:
        reached, ceiling, probe, unit = floor.bytes / measured, floor.bandwidth, "拷贝带宽", "GB/s"
    load = "" if profile.load_average is None else f"，在 1 分钟平均负载 {profile.load_average:.1f} 时测得"
    return (f"{what}实际跑出 {reached / 1e9:,.1f} {unit}，高于机器画像里的{probe} {ceiling / 1e9:,.1f} {unit}"
            f"（一次方阵乘法或一次大拷贝的速率，每次构建探测一次{load}）：画像把这台机器的这个上限测低了，"
            "按它算出的下界对这一步并不成立")


def beaten_words(whys: list[str | None], held: str, after: str = "") -> str:
    """The page's sentence on a lab's floors, from the explanations of those beaten
    (``claims.floors_beaten``; None for one nothing measured explains): ``held`` when none was
    beaten, else how many were and why, then ``after``."""
    told, unexplained = [why for why in whys if why], whys.count(None)
    if not whys:
        return held
    if not told:
        return f"有 {unexplained} 个计时比它的下界还快，这一次量到的数解释不了。"
    if not unexplained:
        return f"有 {len(whys)} 个计时比它的下界还快：" + "；".join(told) + "。" + after
    return (f"有 {len(whys)} 个计时比它的下界还快。其中 {len(told)} 个：" + "；".join(told) + "。" + after +
            f"其余 {unexplained} 个，这一次量到的数解释不了。")


def show_answer(text: str):
    """A real model's answer, quoted as English (``lang="en"``) on the book's Chinese pages."""
    import html

    from IPython.display import HTML, display

    display(HTML(f'<blockquote lang="en">{html.escape(text).replace(chr(10), "<br/>")}</blockquote>'))


def show_english(text: str):
    """Verbatim English (a command's report, JSON on the wire) as a block marked ``lang="en"``."""
    import html

    from IPython.display import HTML, display

    display(HTML(f'<pre lang="en">{html.escape(text)}</pre>'))
