"""The book's figure style: Chinese labels render with a real CJK font."""
import io
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import font_manager  # noqa: E402

from minillm.lab.plotting import CJK_FONT_FILE, cjk_font_path, use_book_style  # noqa: E402


def _missing_glyph_warnings() -> list[str]:
    """Render a figure with Chinese title, labels, legend and negative ticks; return glyph warnings."""
    fig, ax = plt.subplots()
    ax.plot([-2, -1, 0, 1], [3, 1, 0, 1], label="估计值")
    ax.plot([-2, -1, 0, 1], [2, 1, 1, 2], label="本机实测")
    ax.set_title("解码：每步时间随批大小变化")
    ax.set_xlabel("批大小 B")
    ax.set_ylabel("每步时间（毫秒）")
    ax.legend()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.savefig(io.BytesIO(), format="png")
    plt.close(fig)
    return [str(w.message) for w in caught if "missing from font" in str(w.message)]


def test_chinese_renders_without_missing_glyphs():
    with matplotlib.rc_context():
        use_book_style()
        assert _missing_glyph_warnings() == []
        assert matplotlib.rcParams["axes.unicode_minus"] is False
        chosen = font_manager.findfont(font_manager.FontProperties(family=["sans-serif"]))
        assert chosen.endswith(CJK_FONT_FILE)


def test_without_the_style_the_same_figure_misses_glyphs():
    # The check above can fail: matplotlib's default font has no Chinese glyphs.
    with matplotlib.rc_context({"font.family": "sans-serif", "font.sans-serif": ["DejaVu Sans"]}):
        assert _missing_glyph_warnings()


def test_style_is_idempotent():
    with matplotlib.rc_context():
        path = str(cjk_font_path())
        use_book_style()
        registered = sum(font.fname == path for font in font_manager.fontManager.ttflist)
        use_book_style()
        assert registered >= 1
        assert sum(font.fname == path for font in font_manager.fontManager.ttflist) == registered
