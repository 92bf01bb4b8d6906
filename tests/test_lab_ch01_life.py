"""The kit of chapter 1 (一次请求的一生): prompts built from the book's English text with the real
SmolLM2 tokenizer, the GPU memory guard, the tables' arithmetic over real engine runs, the page's
ledger (the generic 7B of the story) and the sentences chosen from measurements."""
import pytest
import torch

from minillm import LLM, SamplingParams, load_model
from minillm.engine.config import resolve_checkpoint
from minillm.engine.gguf_file import GGUFFile, gguf_tokenizer
from minillm.lab import estimate as L
from minillm.lab import records
from minillm.lab.chapters import ch01_life as kit
from minillm.lab.estimate import GiB
from minillm.lab.gpus import lookup_gpu
from minillm.lab.tokens import count, sample_text


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2-135M-Instruct's own tokenizer and chat template, read from its GGUF."""
    return gguf_tokenizer(GGUFFile(resolve_checkpoint("smollm2-135m")))


@pytest.fixture(scope="module")
def tiny(one_thread):
    return load_model("tiny", device="cpu", dtype=torch.float32, weights="random")


def run(model, prompts, max_tokens, **settings):
    llm = LLM(model, num_kv_blocks=64, block_size=16, enable_prefix_caching=False, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return kit.Run(llm.generate(prompts, params, use_tqdm=False), records.run_record(llm))


# --- prompts ------------------------------------------------------------------------------------

def test_the_colleagues_ask_in_english_and_the_first_is_the_scene():
    assert kit.QUESTIONS[0] == sample_text("scene_en") == "Explain the KV cache in three sentences."
    assert len(kit.QUESTIONS) == 20 and len(set(kit.QUESTIONS)) == 20
    assert all(q.isascii() for q in kit.QUESTIONS + kit.CONTRACT_QUESTIONS)
    assert kit.CONTRACT_QUESTIONS[0] == sample_text("question_en")


def test_contract_prompt_has_the_exact_length_and_keeps_the_chat_template(tokenizer):
    ids = kit.contract_ids(tokenizer, 1024)
    assert len(ids) == 1024
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert kit.CONTRACT_INTRO.strip() in text and sample_text("question_en") in text
    assert "Article 7 Payment and Invoices" in text
    longer = kit.contract_ids(tokenizer, 2048, kit.CONTRACT_QUESTIONS[1])
    assert len(longer) == 2048 and longer[:900] == ids[:900]  # one contract: a prefix to share
    with pytest.raises(ValueError, match="cannot hold"):
        kit.contract_ids(tokenizer, 20)


def test_split_cuts_consecutive_pieces():
    ids = list(range(1030))
    pieces = kit.split(ids, 8)
    assert [len(p) for p in pieces] == [128] * 7 + [134]
    assert sum(pieces, []) == ids
    with pytest.raises(ValueError):
        kit.split([1, 2], 3)


def test_the_guard_keeps_room_for_activations():
    each = 2 * GiB
    assert kit.requests_that_fit(20 * GiB, each, 4) == 4
    assert kit.requests_that_fit(10 * GiB, each, 4) == 3  # (10 - 4) / 2
    assert kit.requests_that_fit(3 * GiB, each, 4) == 1  # always at least one


# --- the tables' arithmetic over real runs --------------------------------------------------------

def test_run_rows_from_the_step_log(tiny):
    cfg = tiny.config
    alone = run(tiny, [[5] * 40], 12)
    batch = run(tiny, [[7] * 200] * 3, 12)
    assert alone.answer_lengths() == [12] and batch.answer_lengths() == [12, 12, 12]
    assert len(alone.decode_steps(1)) == 11  # one prefill step, then eleven decode steps
    assert len(batch.decode_steps(3)) == 11
    assert kit.step_context(batch) == 200 + 12 / 2
    rows = kit.slow_rows(alone, batch, cfg, "float32", 1e11, 2e10)
    assert rows["slow"]["batch"] == 3 and rows["alone"]["batch"] == 1
    assert rows["slow"]["floor"].bytes > rows["alone"]["floor"].bytes  # the batch reads its KV too
    assert rows["slow"]["step"] == pytest.approx(sorted(batch.decode_steps(3))[5])


def test_ab_rows_count_the_prefill_as_the_engine_does(tiny):
    cfg = tiny.config
    prompt = list(range(3, 259))
    ab = {}
    for budget in (32, 128):
        ab[budget, "A"] = run(tiny, [prompt], 2, max_num_batched_tokens=budget)
        ab[budget, "B"] = run(tiny, kit.split(prompt, 8), 2, max_num_batched_tokens=budget)
    rows = kit.ab_rows(ab, cfg, "float32", 1e11, 2e10)
    assert rows[32]["a_steps"] == 256 // 32 + 1 and rows[128]["a_steps"] == 256 // 128 + 1
    assert rows[32]["a_first_step"] == 256 // 32  # the last prefill chunk's step
    assert rows[32]["b_first_steps"] == sorted(rows[32]["b_first_steps"]) and rows[32]["b_first_steps"][0] == 1
    assert sum(rows[32]["b_first_steps"]) / 8 < rows[32]["a_first_step"]
    assert rows[128]["tokens"] == 256 and rows[128]["pieces"] == 8
    assert rows[128]["a_attention"] == L.prefill_attention_flops(cfg, 256)
    assert rows[128]["b_attention"] == 8 * L.prefill_attention_flops(cfg, 32)
    assert rows[128]["a_floor"].flops == L.prefill(cfg, 256, "float32").flops


def test_the_ledger_matches_the_engine_to_the_byte(tiny):
    a = run(tiny, [list(range(3, 259))], 2, max_num_batched_tokens=64)
    rows = kit.ledger_rows(a.record, 256, tiny.config, "float32")
    assert [what for what, _, _ in rows][:2] == ["权重", "每 token 的 KV"]
    assert all(ledger == engine for _, ledger, engine in rows)
    assert rows[2][2] == 256 * L.kv_bytes_per_token(tiny.config, "float32")


def test_crowd_rows_split_queueing_from_the_rest(tiny):
    prompts = [[9] * 20] * 3 + [[4] * 300] + [[9] * 20] * 3
    crowd = run(tiny, prompts, 8, max_num_batched_tokens=300, enable_chunked_prefill=False)
    row = kit.crowd_row(crowd, 3)
    assert 0 < row["queue_share"] < 1 and row["preemptions"] == 0
    assert row["after_queue"] > 0.5  # behind an unchunked contract the questions wait
    assert row["contract"] > row["before"]


# --- the page's ledger ------------------------------------------------------------------------------

def test_page_numbers_reproduce_the_story():
    v = kit.page_numbers()
    assert (v["w7_gb"], v["w7_gib"], v["kv_token7"], v["kv_req7"]) == ("14 GB", "13.0 GiB", "512 KiB", "4 GiB")
    assert (v["one7"], v["eight7"]) == ("17.0 GiB", "45.0 GiB")
    assert int(v["fit48"]) < kit.EIGHT  # eight 8K requests do not fit 48 GiB x 0.92
    assert (v["usable_48"], v["fit48"], v["fit80"]) == ("44.2 GiB", "7", "15")
    assert (v["a100_floor"], v["h100_floor"]) == ("6.9 ms", "4.2 ms")
    assert kit.decode7(kit.EIGHT, kit.CTX, lookup_gpu("H100 SXM")).bound == "memory"
    assert (v["w70_gb"], v["cards70"]) == ("140 GB", "2")
    assert (v["kv_token8"], v["ex1_kv8"], v["ex1_fit48"]) == ("128 KiB", "1.00 GiB", "29")
    assert (v["recompute_tokens"], v["ex3_recomputed_short"]) == ("33,550,336", "523,776")


def test_the_chinese_contract_costs_more_in_every_column():
    v = kit.contract_in_chinese({"Tekken": 1.2, "BPE": 2.0})
    assert (v["tok_contract_Tekken"], v["tok_contract_BPE"]) == ("9,830", "16,384")
    assert int(v["tok_fit48_en"]) > int(v["tok_fit48_Tekken"]) > int(v["tok_fit48_BPE"])
    assert v["tok_floor_BPE"].endswith("（算力：F/P）")


def test_smollm2_counts_chinese_as_more_tokens_than_english(tokenizer):
    counts = kit.token_counts(tokenizer)
    assert {c.tokenizer.kind for c in counts} == {"SentencePiece", "Tekken", "BPE"}
    for name in ("contract", "question", "scene"):
        assert count(counts, f"{name}_zh", "BPE").tokens > count(counts, f"{name}_en", "BPE").tokens
    assert count(counts, "scene_en", "BPE").tokens == len(tokenizer.encode(kit.QUESTIONS[0], add_special_tokens=False))


# --- sentences chosen from measurements -------------------------------------------------------------------

def _budget_rows(a_small, a_big, b_small, b_big):
    floor = L.roofline_floor(2.9e11, 5.4e8, 8.75e10, 2.6e10)  # a 1,024-token prefill on a one-thread CPU
    row = lambda a, b, steps: {"a": a, "a_steps": steps, "b": [b] * 8, "b_steps": steps + 1, "a_floor": floor}
    return {64: row(a_small, b_small, 17), 256: row(5.0, 4.0, 5), 1024: row(a_big, b_big, 2)}


@pytest.mark.parametrize("values", [(9.0, 6.0, 3.0, 5.0), (6.0, 9.0, 5.0, 3.0)])
def test_exercise_four_sentences_follow_the_numbers(values):
    v = kit._budget_values(_budget_rows(*values), 256)
    a_small, a_big = values[:2]
    assert ("首字就越晚" in v["ex4_a_words"]) == (a_small > a_big)
    assert ("却没有变晚" in v["ex4_a_words"]) == (a_small <= a_big)
    for key in ("ex4_a_words", "ex4_b_words"):
        assert v[key].endswith("。") and v[key].count("。") >= 1
    assert v["ex4_a_small"] == f"{a_small:,.1f} s" and v["ex4_a_steps_small"] == "17"
    if a_small <= a_big:  # the sentence says, in numbers, how little the extra steps should cost
        assert "多出来的 15 步" in v["ex4_a_words"] and kit.ms(15 * 5.4e8 / 2.6e10) in v["ex4_a_words"]


def test_lengths_and_times_read_as_the_page_prints_them():
    assert kit.lengths_cell([81]) == "81" and kit.lengths_cell([6, 29, 115]) == "29（6–115）"
    assert kit.lengths_words([6, 29, 115]) == "回答长度的中位数是 29 个 token，最短 6 个，最长 115 个"
    assert kit.seconds_words(0.8504) == "850.4 ms" and kit.seconds_words(12.34) == "12.3 s"


def test_a_measurement_under_its_floor_is_explained_in_numbers():
    from minillm.lab.machine_profile import MachineProfile

    profile = MachineProfile("cpu", "test CPU", 1, 1e10, 4e10, "torch.float32", 5.7, "2026-01-01")
    floor = L.roofline_floor(2e11, 5e8, profile.matmul_flops, profile.copy_bandwidth)  # 5 s of compute
    assert floor.bound == "compute" and kit.floor_sentence(floor, 6.25, profile) == "实测里这个下界占了 80%。"
    why = kit.floor_sentence(floor, 4.0, profile)
    assert why.startswith("这一步实际跑出 50.0 GFLOP/s，高于机器画像里的矩阵乘速率 40.0 GFLOP/s")
    assert "负载 5.7" in why and why.endswith("并不成立。")


@pytest.mark.parametrize("top, attainment, says", [(0.13, 0.31, "大多数用户都嫌它慢"), (0.08, 0.75, "仍然过半"),
                                                   (0.058, 0.9, "没有变长")])
def test_the_tpot_sentence_draws_its_conclusion_from_the_slo(top, attainment, says):
    words = kit.tpot_words(0.06, top, attainment, 0.004, 0.005)
    assert says in words and words.endswith("。")
    assert sum(s in words for s in ("大多数用户都嫌它慢", "仍然过半", "没有变长")) == 1
    if top > 0.06:
        assert f"是一个人时的 {top / 0.06:.1f} 倍" in words
    else:
        assert "4.0 ms 涨到 5.0 ms" in words


@pytest.mark.parametrize("step_ratio, says", [(2.6, "远多于"), (1.1, "远小于"), (1.6, "相去不远")])
def test_the_slow_step_sentence_has_three_bands(step_ratio, says):
    words = kit.slow_words(step_ratio, 1.69, 3.9)
    assert says in words and "1.69 倍" in words and words.endswith("。")
    assert sum(s in words for s in ("远多于", "远小于", "相去不远")) == 1
    assert ("3.9 倍" in words) == (says == "远小于")


def test_the_after_contract_sentence_stands_alone():
    down, flat = kit.after_words(8.8, 5.4), kit.after_words(5.0, 5.4)
    assert down.startswith("合同后面的问题不再等前面的人写完") and "8.8 s 降到 5.4 s" in down
    assert "并没有因此降下来（5.0 s → 5.4 s）" in flat and "不再等" not in flat
