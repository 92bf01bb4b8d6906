"""The sentences a lab writes about its floors (minillm.lab.report, minillm.lab.claims)."""
import pytest

from minillm.lab import estimate as L
from minillm.lab.claims import STRICT, ClaimError, floors_beaten
from minillm.lab.machine_profile import MachineProfile
from minillm.lab.report import beaten_words, profile_beat_words

PROFILE = MachineProfile("cpu", "test CPU", 1, 1e10, 4e10, "torch.float32", 5.7, "2026-01-01")


def test_a_time_under_its_floor_names_the_rate_it_reached_and_the_probed_one():
    compute = L.roofline_floor(2e11, 5e8, PROFILE.matmul_flops, PROFILE.copy_bandwidth)  # 5 s of compute
    assert compute.bound == "compute" and profile_beat_words(5.0, compute, PROFILE) is None
    why = profile_beat_words(4.0, compute, PROFILE, "预填充")
    assert why.startswith("预填充实际跑出 50.0 GFLOP/s，高于机器画像里的矩阵乘速率 40.0 GFLOP/s")
    assert "负载 5.7" in why and not why.endswith("。")
    memory = L.roofline_floor(1e8, 5e9, PROFILE.matmul_flops, PROFILE.copy_bandwidth)  # 0.5 s of bytes
    assert "实际跑出 20.0 GB/s，高于机器画像里的拷贝带宽 10.0 GB/s" in profile_beat_words(0.25, memory, PROFILE)


def test_the_floors_sentence_says_which_were_beaten_and_why():
    assert beaten_words([], "都守住了。", "探测不是上限。") == "都守住了。"
    assert beaten_words(["甲快了", "乙快了"], "都守住了。", "探测不是上限。") == \
        "有 2 个计时比它的下界还快：甲快了；乙快了。探测不是上限。"
    assert beaten_words(["甲快了", None], "都守住了。", "探测不是上限。") == \
        "有 2 个计时比它的下界还快。其中 1 个：甲快了。探测不是上限。其余 1 个，这一次量到的数解释不了。"
    assert beaten_words([None], "都守住了。") == "有 1 个计时比它的下界还快，这一次量到的数解释不了。"


def test_only_the_beaten_floors_are_kept_and_an_unexplained_one_fails_the_build(monkeypatch):
    floor = L.roofline_floor(2e11, 5e8, PROFILE.matmul_flops, PROFILE.copy_bandwidth)
    monkeypatch.setenv(STRICT, "0")
    assert floors_beaten([(6.0, floor, None), (4.0, floor, "快了"), (3.0, floor, None)]) == ["快了", None]
    monkeypatch.setenv(STRICT, "1")
    with pytest.raises(ClaimError, match="下界"):
        floors_beaten([(4.0, floor, None)])
