"""What chapter 一张卡放不下 (book/ch13-parallel.md) says from the ledger: Llama-3.1-8B and 70B on
1/2/4/8 cards, where adding a card stops paying on each example link, the published numbers it
quotes read the way it reads them, and the α–β fit the lab uses."""
import json

import pytest

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.allreduce import fit_link, two_ranks
from minillm.lab.gpus import GPUS_CSV, lookup_gpu

B8, B70 = load_config("llama-3.1-8b"), load_config("llama-3.1-70b")
H100 = lookup_gpu("H100 SXM")
NV, PCIE = L.AllReduceCost(10e-6, 300e9), L.AllReduceCost(40e-6, 20e9)
PUBLISHED = json.loads((GPUS_CSV.parent / "published_tensor_parallel.json").read_text(encoding="utf-8"))


def decode(cfg, tp, link, gpu=H100, batch=1, ctx=4096):
    return L.tensor_parallel_decode(cfg, tp, batch, ctx, gpu.bf16_flops, gpu.bandwidth, link)


def test_the_cards_70b_needs():
    budget = lambda gib: 0.92 * gib * L.GiB
    assert L.weight_bytes(B70) > budget(80) and L.weight_bytes_per_card(B70, 2) <= budget(80)
    assert L.weight_bytes_per_card(B70, 2) / budget(80) > 0.5  # "more than half the budget"
    assert min(tp for tp in (1, 2, 4, 8) if L.weight_bytes_per_card(B70, tp) <= budget(24)) == 8
    assert B8.num_kv_heads == B70.num_kv_heads == 8
    assert L.kv_bytes_per_token_per_card(B8, 8) == 16 * L.KiB == L.kv_bytes_per_token_per_card(B8, 16)


def test_small_messages_pay_alpha():
    assert [L.allreduce_message_bytes(c) for c in (B8, B70)] == [8 * L.KiB, 16 * L.KiB]
    assert L.allreduces_per_token(B8) == 64 and L.allreduces_per_token(B70) == 160
    assert NV.latency_share(8 * L.KiB, 8) > 0.99 and PCIE.latency_share(8 * L.KiB, 8) > 0.95


def test_where_adding_a_card_stops_paying():
    tps = lambda cfg, link: [decode(cfg, tp, link).tokens_per_s for tp in (1, 2, 4, 8)]
    nv8, pcie8 = tps(B8, NV), tps(B8, PCIE)
    assert nv8 == sorted(nv8) and pcie8[1] < pcie8[0] < pcie8[2] < pcie8[3]  # PCIe: 2 cards lose, 4 and 8 win
    assert all(t == sorted(t) for t in (tps(B70, NV), tps(B70, PCIE)))  # 70B: every doubling pays
    assert decode(B8, 2, PCIE).allreduce_seconds == pytest.approx(64 * (40e-6 + 8 * L.KiB / 20e9))
    assert nv8[3] < 0.6 * 8 * nv8[0] and pcie8[1] > 0.9 * pcie8[0]  # "far from 8 times"; "a little slower"
    steps = [decode(B8, tp, NV).seconds for tp in (1, 2, 4, 8)]
    saved = [a - b for a, b in zip(steps, steps[1:])]
    assert saved == sorted(saved, reverse=True)  # each doubling saves less time than the one before
    for link in (NV, PCIE):  # the figure: 70B's lines lie far below 8B's, its PCIe line rises slower
        assert all(b70 < b8 / 2 for b70, b8 in zip(tps(B70, link), tps(B8, link)))
    assert tps(B70, PCIE)[-1] / tps(B70, PCIE)[0] < tps(B70, NV)[-1] / tps(B70, NV)[0]
    # exercise 2: the batch from which 2 cards beat 1 on PCIe; its message is still far below αβ
    even = next(b for b in range(1, 513) if decode(B8, 2, PCIE, batch=b).seconds < decode(B8, 1, PCIE, batch=b).seconds)
    assert 1 < even and L.allreduce_message_bytes(B8, even) < 0.1 * PCIE.latency * PCIE.bandwidth


def test_the_published_numbers_read_as_the_page_reads_them():
    gf = {m: {int(k): v for k, v in r.items()} for m, r in PUBLISHED["gpt_fast"]["tokens_per_s"].items()}
    assert 2.8 < gf["Llama-2-70B"][8] / gf["Llama-2-70B"][2] < 3 and 1.8 < gf["Llama-2-7B"][8] / gf["Llama-2-7B"][2] < 2.1
    a100, llama2 = lookup_gpu("A100 80GB SXM"), load_config("llama-2-7b")
    share = {tp: gf["Llama-2-7B"][tp] / decode(llama2, tp, NV, a100, 1, 256).tokens_per_s for tp in (1, 8)}
    assert 0.65 < share[1] < 0.75 and 0.4 < share[8] < 0.6  # "seven tenths", "about half"
    tgi = {g: {int(k): v for k, v in r.items()} for g, r in PUBLISHED["tgi_1315"]["ms_per_token"].items()}
    assert tgi["A100-80G"][4] > tgi["A100-80G"][2] and tgi["H100"][2] >= tgi["H100"][1]
    d8 = decode(llama2, 8, NV, a100, 1, 256)  # exercise 3: the alpha gpt-fast's 8 GPUs would need
    alpha = (1 / gf["Llama-2-7B"][8] - d8.floor.seconds) / d8.num_allreduces
    assert alpha > 3 * NV.latency


def test_fit_link_recovers_alpha_and_beta():
    truth = L.AllReduceCost(latency=50e-6, bandwidth=2e9)
    points = {n: truth.seconds(n, 2) for n in (2 * L.KiB, 64 * L.KiB, 1024 * L.KiB)}
    fitted = fit_link(points)
    assert fitted.latency == pytest.approx(50e-6) and fitted.bandwidth == pytest.approx(2e9)
    with pytest.raises(ValueError, match="does not grow"):
        fit_link({2 * L.KiB: 1e-3, 64 * L.KiB: 1e-4})


def test_two_ranks_are_refused_where_they_cannot_run():
    import torch

    from minillm.lab.allreduce import allreduce_sweep

    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        two_ranks("meta")
    assert two_ranks("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="multiple of 4"):
        allreduce_sweep((2 * L.KiB, 3))
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="need two GPUs, this machine has"):
            two_ranks("cuda")


def test_the_allreduce_sweep_between_two_gloo_processes():
    from minillm.lab.allreduce import allreduce_sweep

    points = allreduce_sweep((4 * L.KiB, 4096 * L.KiB), repeats=5)  # timings: no order asserted (noise)
    assert list(points) == [4 * L.KiB, 4096 * L.KiB] and all(t > 0 for t in points.values())
