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
    assert [r["break"] for r in rows] == ["first", "end", "retokenized"]
    t3_rewritten = _turn([0, 1, 2, 77] + list(range(4, 50)), [300])  # the template changed turn 1's text
    assert ch07.chat_ledger([t1, t3_rewritten], 16)[1]["break"] == "template"


def test_chat_break_notes_count_only_retokenized_turns():
    rows = [{"break": b} for b in ("first", "end", "retokenized", "retokenized")]
    notes = ch07.chat_break_notes(rows)
    assert "有 2 轮的公共前缀断在上一轮回答的中间" in notes["chat_broken_note"]
    assert notes["chat_gap_note"].endswith("整块的截断，和文本再切词造成的断点。")
    assert "再切词的断点这两处损失" in notes["chat_page_one_note"]
    clean = ch07.chat_break_notes([{"break": b} for b in ("first", "end", "end")])
    assert "每一轮的公共前缀也都一直延伸到上一轮算过的最后一个 token" in clean["chat_broken_note"]
    assert "没有造成断点" in clean["chat_gap_note"] and "这一处损失" in clean["chat_page_one_note"]


def test_kernel_block_note_turns_on_the_smallest_block_against_the_page():
    slow = ch07.kernel_block_note({1: 300.0, 16: 200.0, 256: 190.0})
    assert slow.startswith("块很小时它却明显变慢了（块 1 对块 16）") and "读取的连续性要求它别太小" in slow
    # a large block that is slowest does not make the small-block sentence true
    even = ch07.kernel_block_note({1: 210.0, 16: 200.0, 256: 400.0})
    assert even.startswith("块很小时它也没有明显变慢（块 1 对块 16）") and "主要看利用率和记账" in even


def test_lookup_note_explains_whichever_index_won():
    radix = ch07.lookup_note(hash_us=400.0, radix_us=100.0)
    assert radix.startswith("基数树快 4.0 倍：") and "压在一个节点里" in radix
    chain = ch07.lookup_note(hash_us=100.0, radix_us=250.0)
    assert chain.startswith("这一次反倒是哈希链快 2.5 倍。") and "谁快取决于" in chain


def test_lookup_scaling_note_asks_for_time_per_token_within_2x():
    lengths = [1000, 4000]
    even = ch07.lookup_scaling_note(lengths, {"hash": [60.0, 250.0], "radix": [14.0, 50.0]})
    assert even.startswith("两者的耗时都和提示词长度成正比")
    skewed = ch07.lookup_scaling_note(lengths, {"hash": [60.0, 250.0], "radix": [10.0, 100.0]})
    assert skewed.startswith("这一次，每个 token 摊到的查找时间在几种长度之间最多差了 2.5 倍")
    assert skewed.endswith("和它能省下的预填充相比很小。")


def test_kernel_floor_note_has_a_whole_sentence_for_each_case():
    assert ch07.kernel_floor_note(True, None) == "实测没有快过这个下界。"
    assert ch07.kernel_floor_note(False, "读的是缓存") == "实测比这个下界还快：读的是缓存。"
    assert ch07.kernel_floor_note(False, None) == "实测比这个下界还快，这一次量到的数解释不了。"


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
