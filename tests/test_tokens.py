"""Real tokenizers on the book's own text (minillm.lab.tokens): the counts chapter 1 states, the
colleagues' questions and the long request built from the contract, through SmolLM2's own
tokenizer and chat template."""
import pytest
import torch

from minillm import LLM, load_model
from minillm.lab.tokens import CONTRACT_INTRO, TEXTS, colleague_questions, contract_prompt, sample_text, tokenizers


@pytest.fixture(scope="module")
def chat(one_thread):
    """The real SmolLM2-135M-Instruct behind an engine: its tokenizer and chat template."""
    return LLM(load_model("smollm2-135m", device="cpu", dtype=torch.float32), num_kv_blocks=4)


def test_the_colleagues_ask_in_english_and_the_first_is_the_opening_question():
    questions = colleague_questions()
    assert questions[0] == sample_text("scene_en") == "Explain the KV cache in three sentences."
    assert len(questions) == 20 and len(set(questions)) == 20 and all(q.isascii() for q in questions)


def test_the_contract_prompt_has_the_exact_length_and_keeps_the_chat_template(chat):
    ids = contract_prompt(chat, 1024)
    assert len(ids) == 1024
    text = chat.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert CONTRACT_INTRO.strip() in text and sample_text("question_en") in text
    assert "Article 7 Payment and Invoices" in text
    longer = contract_prompt(chat, 2048, "Who must issue the VAT invoice, and when?")
    assert len(longer) == 2048 and longer[:900] == ids[:900]  # one contract: a prefix to share
    with pytest.raises(ValueError, match="cannot hold"):
        contract_prompt(chat, 20)


def test_chinese_costs_more_tokens_and_tokenizers_disagree_on_it(chat):
    """Chapter 1: the same contract cuts into more tokens in Chinese than in English with every
    tokenizer; in English they nearly agree; in Chinese SmolLM2's BPE needs nearly twice Tekken's."""
    encoders = {t.kind: t.encode for t in tokenizers()} | {"BPE": lambda text: chat.tokenizer.encode(text, add_special_tokens=False)}
    assert [t.vocab_size for t in tokenizers()] == [32000, 131072] and len(chat.tokenizer) == 49152
    counts = {kind: {name: len(encode(sample_text(name))) for name in TEXTS} for kind, encode in encoders.items()}
    zh, en = ({kind: c[f"contract_{lang}"] for kind, c in counts.items()} for lang in ("zh", "en"))
    assert all(zh[k] > en[k] for k in encoders) and max(en.values()) < 1.15 * min(en.values())
    assert zh["Tekken"] < zh["SentencePiece"] < zh["BPE"] and 1.6 < zh["BPE"] / zh["Tekken"] < 2  # "差近一倍"
    for name in ("contract", "question", "scene"):
        assert counts["BPE"][f"{name}_zh"] > counts["BPE"][f"{name}_en"]
