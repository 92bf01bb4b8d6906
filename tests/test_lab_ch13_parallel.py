"""The tensor-parallelism chapter's kit (minillm.lab.chapters.ch13_parallel): the ledger of Llama-3.1-8B
and 70B on 1/2/4/8 cards, where adding a card stops paying on each example link, the α–β fit, and
the engine really run at tp=1 and tp=2 (gloo processes) with its all-reduces counted and timed."""
import pytest
import torch

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.chapters import ch13_parallel as ch13
from minillm.lab.estimate import AllReduceCost, GiB, KiB
from minillm.lab.gpus import lookup_gpu

B8, B70 = load_config("llama-3.1-8b"), load_config("llama-3.1-70b")
H100 = lookup_gpu("H100 SXM")
NVLINK, PCIE = ch13.LINKS["NVLink 类"], ch13.LINKS["PCIe 类"]


def test_which_card_counts_hold_the_weights():
    rows = {(r[0], r[1]): r for r in ch13.card_rows(ch13.models())}
    assert rows[("llama-3.1-70b", 1)][4:] == ["放不下", "放不下"]
    assert rows[("llama-3.1-70b", 2)][4] == "放不下" and rows[("llama-3.1-70b", 2)][5] != "放不下"
    assert rows[("llama-3.1-70b", 8)][4] != "放不下"  # 8 × 24 GiB hold 70B
    assert rows[("llama-3.1-8b", 1)][2] == "15.0 GiB" and rows[("llama-3.1-8b", 8)][3] == "16 KiB"
    # the tokens a card holds: its budget less its weights, over its KV per token
    left = 0.92 * 80 * GiB - L.weight_bytes_per_card(B70, 2)
    assert ch13.kv_tokens_left(B70, 2, 80) == int(left // (80 * 2 * 4 * 128 * 2))
    assert ch13.kv_tokens_left(B70, 1, 80) == 0


def test_allreduces_per_token_and_their_bytes():
    rows = ch13.allreduce_rows(ch13.models())
    assert rows[0][:5] == ["llama-3.1-8b", 2, 64, "8 KiB", "8.0 KiB"]
    assert rows[1][:5] == ["llama-3.1-8b", 8, 64, "8 KiB", "14.0 KiB"]  # 2·7/8 of 8 KiB
    assert rows[2][2:4] == [160, "16 KiB"]
    # at one token, α is nearly all of an all-reduce on either link
    assert NVLINK.latency_share(8 * KiB, 8) > 0.99 and PCIE.latency_share(8 * KiB, 8) > 0.95


def test_where_adding_a_card_stops_paying():
    # NVLink-like: every doubling still shortens the 8B step; PCIe-like: tp=2 is already slower
    assert ch13.last_paying(B8, NVLINK, H100) == 8
    assert ch13.last_paying(B8, PCIE, H100) == 1
    two, one = ch13.decode(B8, 2, PCIE, H100), ch13.decode(B8, 1, PCIE, H100)
    assert two.seconds > one.seconds
    assert two.allreduce_seconds == pytest.approx(64 * (40e-6 + 8 * KiB / 20e9))
    assert ch13.decode(B70, 8, NVLINK, H100).floor.seconds == pytest.approx(
        ch13.decode(B70, 1, NVLINK, H100).floor.seconds / 8, rel=0.01)


def test_fit_link_recovers_alpha_and_beta():
    truth = AllReduceCost(latency=50e-6, bandwidth=2e9)
    points = {n: truth.seconds(n, 2) for n in (2 * KiB, 64 * KiB, 1024 * KiB)}
    fitted = ch13.fit_link(points)
    assert fitted.latency == pytest.approx(50e-6) and fitted.bandwidth == pytest.approx(2e9)
    with pytest.raises(ValueError, match="does not grow"):
        ch13.fit_link({2 * KiB: 1e-3, 64 * KiB: 1e-4})
    with pytest.raises(ValueError, match="multiple of 4"):
        ch13.allreduce_sweep((2 * KiB, 3))


def test_the_allreduce_sweep_between_two_gloo_processes():
    points = ch13.allreduce_sweep((4 * KiB, 4096 * KiB), repeats=5)
    assert list(points) == [4 * KiB, 4096 * KiB] and points[4096 * KiB] > points[4 * KiB] > 0


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine can run the NCCL half")
def test_the_nccl_half_is_refused_without_two_gpus():
    for run in (lambda: ch13.run_engine(2, device="cuda"), lambda: ch13.allreduce_sweep(device="cuda")):
        with pytest.raises(ValueError, match="need two GPUs, this machine has"):
            run()
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        ch13.lab_device("meta")
    assert ch13.lab_device("cpu") == torch.device("cpu")


def test_the_engine_at_tp1_and_tp2():
    cfg = ch13.LAB_MODEL.replace(name="tp-test", num_layers=2, hidden_size=128, intermediate_size=256,
                                 num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=256)
    one, two = (ch13.run_engine(tp, cfg, batch=2, prompt=8, tokens=6) for tp in (1, 2))
    assert one.steps == two.steps == 6 and one.allreduce_calls == 0 and one.allreduce_share == 0
    assert two.allreduces_per_step == 2 * 2 + 1  # two per layer and the embedding's
    assert 0 < two.allreduce_share < 1 and two.step_seconds > 0
    link = AllReduceCost(latency=1e-4, bandwidth=1e9)
    assert ch13.estimated_allreduce_per_step(two, link, cfg) == pytest.approx(5 * (1e-4 + 2 * 128 * 4 / 1e9))


def test_the_engine_table_quotes_times_as_the_page_does():
    """One number per measured quantity: the lab's table formats each time as the page's glue does."""
    one = ch13.EngineRun(tp=1, batch=4, steps=32, step_seconds=0.00821, allreduce_calls=0, allreduce_seconds=0.0)
    two = ch13.EngineRun(tp=2, batch=4, steps=32, step_seconds=0.01912, allreduce_calls=288, allreduce_seconds=0.36864)
    rows = ch13.engine_rows({1: one, 2: two})
    assert rows[0][2] == "8.2 ms" and rows[0][5] == "—"
    assert rows[1][2:] == ["19.1 ms", "9", "8 KiB", "11.5 ms", "60%"]


def test_the_decode_table_names_the_binding_ceiling_as_the_book_writes_it():
    rows = ch13.decode_rows(load_config("llama-3.1-8b"), lookup_gpu("H100 SXM"))
    assert [r[0] for r in rows] == list(ch13.CARD_COUNTS)
    assert all(r[1].startswith("≥ ") and r[1].endswith("（带宽：M/W）") for r in rows)  # batch 1: bandwidth-bound


def test_the_estimate_against_the_engine_is_one_sentence_per_band():
    longer, shorter, close = (ch13.est_vs_measured(m, 1e-3) for m in (2e-3, 0.5e-3, 1.2e-3))
    assert longer.startswith("引擎里量到的 all-reduce 时间比 α–β 估算的长得多")
    assert shorter.startswith("引擎里量到的 all-reduce 时间比 α–β 估算的还短得多")
    assert close.startswith("引擎里量到的 all-reduce 时间和 α–β 估算相差不到一半")
    assert ch13.est_vs_measured(1.5e-3, 1e-3) == close and ch13.est_vs_measured(1e-3 / 1.5, 1e-3) == close
