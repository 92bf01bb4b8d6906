"""The serving lab's kit (minillm.lab.chapters.ch09_serving): the scene at the lab's size, the
two servers of the chunking experiment, the floors of the step that stalls the decoders (chapter
8's computation at this machine's ceilings), the client-against-server arithmetic, and a real
server that frees what a client held when it hangs up."""
import pytest
import torch

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.chapters import ch08_scheduling as ch08
from minillm.lab.chapters import ch09_serving as ch09
from minillm.lab.notebook import Lab, room
from minillm.server.launcher import serve_in_background


def cpu_lab() -> Lab:
    return Lab(torch.device("cpu"), "tiny", torch.float32, "cpu", load_config("tiny"), None)


def test_the_scene_on_the_cpu_is_a_quarter_of_the_gpu_scene():
    sc = ch09.scene(cpu_lab())
    assert (sc.scale, sc.contract, sc.budget, sc.output) == (4, 2048, 512, 16)
    lens = sc.colleagues.input_lens
    assert len(lens) == ch09.COLLEAGUES and lens.count(2048) == 1 and lens[sc.contract_index] == 2048
    assert sc.pool_blocks == 2 * room(lens, 16, ch09.BLOCK) // ch09.BLOCK
    assert sc.warm_up().input_lens[sc.contract_index] == 2048 and sc.warm_up().prompts != sc.colleagues.prompts
    assert ch09.burst_settings(sc) == {
        "不分块": {"max_num_batched_tokens": 2048 + 20, "no_enable_chunked_prefill": True},
        "分块": {"max_num_batched_tokens": 512}}


def test_the_stall_floors_are_chapter_8s_steps_at_this_machines_ceilings():
    lab = cpu_lab()
    sc = ch09.scene(lab)
    steps = ch09.stall_floors(lab, sc)
    others = [n for n in sc.colleagues.input_lens if n != sc.contract]
    ctx = round(sum(others) / len(others) + sc.output / 2)
    p = lab.profile
    assert steps == ch08.contract_steps(lab.config, 2048, 512, 19, ctx, p.matmul_flops, p.copy_bandwidth,
                                        "float32", "cpu")
    # each chunk is the budget less one token for each of the 19 decoders
    assert steps.chunk_tokens == 493 and steps.chunk_count == 5
    assert steps.whole.flops == steps.decode.flops + L.prefill(lab.config, 2048).flops
    assert steps.worst_chunk.seconds < steps.whole.seconds


def run(ttfts, server_ttft_sum, e2es, server_e2e_sum, queue_sum, indexes=None):
    """A loadgen record with just what the kit reads."""
    n = len(ttfts)
    requests = [{"index": i, "ttft": t, "max_itl": 2 * t, "tpot": t / 2}
                for i, t in zip(indexes or range(n), ttfts)]
    delta = {"time_to_first_token_seconds_sum": server_ttft_sum, "time_to_first_token_seconds_count": n,
             "e2e_request_latency_seconds_sum": server_e2e_sum, "e2e_request_latency_seconds_count": n,
             "request_queue_time_seconds_sum": queue_sum, "request_queue_time_seconds_count": n}
    summary = {"ttft": {"mean": sum(ttfts) / n}, "e2e": {"mean": sum(e2es) / n}}
    return {"requests": requests, "server_metrics": {"delta": delta}, "summary": summary}


def test_client_against_server_and_the_short_questions():
    r = run([0.2, 0.4], 0.5, [1.0, 2.0], 2.8, 0.1)
    both = ch09.side_by_side(r)
    assert both["ttft"] == (pytest.approx(0.3), pytest.approx(0.25))
    assert both["e2e"] == (pytest.approx(1.5), pytest.approx(1.4))
    assert both["queue"] == pytest.approx(0.05)
    r = run([0.1, 9.0, 0.3], 1.0, [1.0] * 3, 3.0, 0.0)
    q = ch09.questions(r, "ttft", contract_index=1)  # the contract's 9 s left out
    assert q["mean"] == pytest.approx(0.2) and q["p99"] < 0.31
    assert ch09.questions(r, "max_itl", contract_index=1)["mean"] == pytest.approx(0.4)


def test_the_alone_requests_arrive_apart():
    work = ch09.alone_workload(4096)
    assert len(work) == ch09.ALONE and work.input_lens == [64] * ch09.ALONE
    assert work.arrival_times == pytest.approx([i * ch09.ALONE_GAP for i in range(ch09.ALONE)])


def test_a_client_that_hangs_up_leaves_nothing_held():
    with serve_in_background("tiny", weights="random", num_kv_blocks=256, max_model_len=4096,
                             env={"OMP_NUM_THREADS": "1"}) as server:
        hung = ch09.hang_up(server, prompt=list(range(1, 33)))
    running, waiting, kv = hung["during"]
    assert running == 1 and waiting == 0 and kv > 0
    assert ch09.freed(hung) and hung["polls"][-1][0] < ch09.HANG_UP_WITHIN
    assert not ch09.freed({"polls": [(0.0, 1.0, 0.0, 0.1)]})


def test_the_chunked_ttft_sentence_follows_the_p99s():
    assert ch09.chunk_ttft_words(0.100, 0.150).startswith("分块的代价在首字：短问题 TTFT 的 p99 从 100.0 ms 变成 150.0 ms")
    assert ch09.chunk_ttft_words(0.100, 0.105).endswith("相差不到一成。")
    assert "反而短了" in ch09.chunk_ttft_words(0.100, 0.050)
