"""The paging lab's kit (minillm.lab.chapters.ch07_paging): the ledger of what a conversation's
prompts could take from the prefix cache, checked against the engine's own hits, and the block
bookkeeping behind the fragmentation and index experiments."""
import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
import torch  # noqa: E402

from minillm import LLM, load_model  # noqa: E402
from minillm.engine.config import load_config  # noqa: E402
from minillm.lab import estimate as L  # noqa: E402
from minillm.lab.chapters import ch07_paging as ch07  # noqa: E402
from minillm.lab.notebook import greedy  # noqa: E402
from minillm.lab.workload import random_prompts  # noqa: E402


def test_reusable_is_whole_blocks_and_leaves_the_last_token():
    earlier = [list(range(40))]
    assert ch07.common_prefix(list(range(40)) + [99], earlier[0]) == 40
    r = ch07.reusable(list(range(40)) + [99], earlier, 16)
    assert (r["lcp"], r["tokens"], r["end_of_source"]) == (40, 32, True)
    # a prompt equal to what was computed: its last token must still be computed
    assert ch07.reusable(list(range(32)), earlier, 16)["tokens"] == 16
    assert ch07.reusable(list(range(32)), earlier, 1)["tokens"] == 31
    assert ch07.reusable([7, 8, 9], [], 16) == {"lcp": 0, "tokens": 0, "end_of_source": False}


def test_the_answers_last_token_was_never_computed():
    turn = {"prompt": [1, 2, 3], "answer": [4, 5, 6]}
    assert ch07.computed_tokens(turn) == [1, 2, 3, 4, 5]


def _turn(prompt, answer, cached=0):
    return {"prompt": prompt, "answer": answer, "cached": cached, "finish": "stop", "ttft": 0.1}


def test_chat_ledger_finds_where_the_prefix_breaks():
    t1 = _turn(list(range(50)), [100, 101, 102])
    t2 = _turn(list(range(50)) + [100, 101, 102, 7, 8], [200, 201, 202])  # follows the whole history
    t3 = _turn(list(range(50)) + [100, 101, 102, 7, 8] + [200, 999, 5], [300])  # answer retokenized
    rows = ch07.chat_ledger([t1, t2, t3], 16)
    assert [r["lcp"] for r in rows] == [0, 52, 56]
    assert [r["reusable"] for r in rows] == [0, 48, 48]
    assert [r["reusable_1"] for r in rows] == [0, 52, 56]
    assert rows[0]["broke"].startswith("第一轮") and rows[1]["broke"].startswith("上一轮")
    assert rows[2]["broke"].startswith("模型的回答")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("tiny", device="cpu", dtype=torch.float32, weights="random")


def test_the_engine_hits_what_the_ledger_says(tiny):
    """A conversation in token ids: each turn's prompt is the last prompt, its answer and new tokens."""
    llm = LLM(tiny, block_size=16, num_kv_blocks=64)
    prompt, turns = random_prompts([37], tiny.config.vocab_size, seed=1)[0], []
    for k in range(4):
        out = llm.generate([prompt], greedy(5 + 3 * k), use_tqdm=False)[0]
        turns.append(ch07.turn_record(prompt, out, llm.stats()))
        prompt = prompt + list(out.token_ids) + random_prompts([11], tiny.config.vocab_size, seed=10 + k)[0]
    ledger = ch07.chat_ledger(turns, 16)
    assert [r["cached"] for r in ledger] == [r["reusable"] for r in ledger]
    assert ledger[-1]["reusable"] > 0 and [t["run_hits"] for t in turns] == [t["cached"] for t in turns]


def test_utilization_and_the_waste_bound():
    assert ch07.utilization(16, [16, 17]) == pytest.approx(33 / 48)
    assert ch07.utilization(1, [5, 9]) == 1.0
    assert ch07.estimated_utilization(1, 100) == 1.0
    assert ch07.estimated_utilization(17, 100) == pytest.approx(100 / 108)
    kv, admitted = ch07.fill_pool(16, 3, [16, 17, 1])
    assert admitted == 2 and kv.num_free_blocks == 0


def test_fragmentation_in_a_card_sized_pool():
    lengths = [100] * 10 + [3000]
    f = ch07.fragmentation(lengths, [50, 60], pool_tokens=2 * ch07.MAX_LEN)
    assert f["fit_contiguous"] == f["fit_contiguous_est"] == 2
    assert f["fit_paged"] == 11 and f["util_contiguous"] == pytest.approx(sum(lengths) / (11 * ch07.MAX_LEN))
    assert f["chat_paged"] == pytest.approx(110 / 128)


def test_both_indexes_agree_when_nothing_is_evicted():
    stream = ch07.popular_stream(1000, systems=3, system_len=64, requests=40)
    big = 64 // 16 * 3 + 4 * 20
    assert ch07.replay(stream, "hash", big) == pytest.approx(ch07.replay(stream, "radix", big))
    assert ch07.replay(stream, "hash", 4 * 13) < ch07.replay(stream, "hash", big)


def test_decode_attention_floor_is_the_kv_read():
    cfg = load_config("llama-3.1-8b")
    floor = ch07.kernel_floor(cfg, 16, 16384, "bf16", 989e12, 3.35e12)
    assert floor.bound == "memory"
    assert floor.bytes == L.kv_bytes(cfg, 16 * 16384) // cfg.num_layers
    assert floor.intensity == pytest.approx(cfg.num_heads / cfg.num_kv_heads)
