"""Mixture-of-Experts models (Mixtral, Qwen3-MoE): greedy parity with transformers in float64 in a
mixed batch with chunked prefill and prefix hits, the routing's normalization, quantized experts,
bad configs refused, and the ledger of total and active parameters and experts touched."""
import copy
import json

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from minillm import LLM, SamplingParams, load_model
from minillm.engine.config import ModelConfig, load_config
from minillm.engine.model import MoE, Router
from minillm.engine.quantization import Int8Linear
from minillm.lab import estimate as L

COMMON = dict(vocab_size=160, num_hidden_layers=2, max_position_embeddings=2048)
SHAPES = {
    "mixtral-top2": (MixtralForCausalLM, MixtralConfig(**COMMON, hidden_size=64, intermediate_size=48,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    # held out: one expert per token, MQA, three layers
    "mixtral-top1": (MixtralForCausalLM, MixtralConfig(**COMMON | dict(num_hidden_layers=3), hidden_size=48,
                     intermediate_size=40, num_attention_heads=4, num_key_value_heads=1,
                     num_local_experts=5, num_experts_per_tok=1)),
    "qwen3moe-top2": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**COMMON, hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    # held out: every expert for every token, renormalized (a no-op then), odd widths
    "qwen3moe-all": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**COMMON, hidden_size=48, intermediate_size=64,
                     moe_intermediate_size=24, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                     num_experts=6, num_experts_per_tok=6, norm_topk_prob=True)),
}
STEPS = 24


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, tmp_path_factory):
    """A tiny transformers MoE model, every parameter random (norms around 1), saved."""
    cls, config = SHAPES[request.param]
    torch.manual_seed(0)
    hf = cls(copy.deepcopy(config)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    hf.set_experts_implementation("eager")  # its grouped matmul takes no float64
    return folder, hf.to(torch.float64)


def _prompts():
    """Two prompts sharing a 14-token prefix (a prefix hit: blocks of 4), two others."""
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, COMMON["vocab_size"], (n,), generator=generator).tolist() for n in (14, 6, 11, 3, 5)]
    base = tokens[0]
    return [base + tokens[1], tokens[2], base + tokens[4], tokens[3]]


def _hf_greedy(hf, prompt):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_greedy_matches_transformers_in_a_mixed_batch(checkpoint):
    folder, hf = checkpoint
    model = load_model(folder, device="cpu", dtype=torch.float64)
    cfg = model.config
    assert cfg.num_experts == (getattr(hf.config, "num_experts", None) or hf.config.num_local_experts)
    llm = LLM(model, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    prompts = _prompts()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True),
                           use_tqdm=False)
    ours = [o.token_ids for o in outputs]
    assert len(set(sum(ours, []))) >= 8  # varied output, so a mismatch would show
    assert ours == [_hf_greedy(hf, p) for p in prompts]
    stats = llm.stats()
    assert stats["prefix_hit_tokens"] > 0
    assert max(s["num_prefill_tokens"] for s in stats["steps"]) == 16  # prompts cut in chunks


def _moe(model) -> MoE:
    layer = model.model.layers[0]
    return getattr(layer, layer.mlp_name)


def test_routing_normalization_and_experts_used(checkpoint):
    """Each token's weights sum to 1 when renormalized (Mixtral always), to less otherwise; the
    tokens spread over several experts; a one-token forward reads exactly k of them."""
    folder, _ = checkpoint
    model = load_model(folder, device="cpu", dtype=torch.float64)
    moe, cfg = _moe(model), model.config
    x = torch.randn(40, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(moe.gate(x).float(), dim=-1)
    top = probs.topk(cfg.num_experts_per_tok, dim=-1).values
    out = moe(x)
    assert sum(moe.expert_tokens) == 40 * cfg.num_experts_per_tok
    assert sum(n > 0 for n in moe.expert_tokens) >= min(cfg.num_experts, 3)
    # the same tokens one at a time: each reads k experts, and the grouped result equals it
    rows = []
    for row in x:
        rows.append(moe(row[None]))
        assert sum(n > 0 for n in moe.expert_tokens) == cfg.num_experts_per_tok
    torch.testing.assert_close(out, torch.cat(rows), rtol=0, atol=1e-12)
    # by hand: the k picked experts, weighted by (renormalized) probabilities
    weights = top / top.sum(-1, keepdim=True) if cfg.norm_topk_prob else top
    picked = probs.topk(cfg.num_experts_per_tok, dim=-1).indices
    by_hand = torch.stack([sum(w.double() * moe.experts[e](x[t][None])[0] for w, e in zip(weights[t], picked[t]))
                           for t in range(3)])
    torch.testing.assert_close(out[:3], by_hand, rtol=0, atol=1e-12)
    assert cfg.norm_topk_prob == (cfg.model_type == "mixtral" or cfg.num_experts == cfg.num_experts_per_tok)


def test_quantized_experts_leave_the_router(checkpoint):
    folder, _ = checkpoint
    model = load_model(folder, device="cpu", dtype=torch.float64, quantization="int8")
    moe = _moe(model)
    assert isinstance(moe.gate, Router) and moe.gate.weight.dtype == torch.float64
    assert all(isinstance(m, Int8Linear) for e in moe.experts for m in e.children())
    from minillm.engine.planner import model_bytes

    assert model_bytes(model) == L.weight_bytes(model.config, "float64", "int8")


def _write(tmp_path, **changes):
    """A tiny Qwen3-MoE config.json with ``changes`` (None removes a field)."""
    hf = SHAPES["qwen3moe-top2"][1].to_dict() | {"model_type": "qwen3_moe"}
    hf.update(changes)
    hf = {k: v for k, v in hf.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) is more than num_experts \(8\)"),
    (dict(num_experts_per_tok=0), "both positive"),
    (dict(num_experts=0, num_local_experts=0), "num_experts"),
    (dict(scoring_func="sigmoid"), r"router field\(s\) \['scoring_func'\]"),
    (dict(n_shared_experts=1, topk_method="noaux_tc"), r"\['n_shared_experts', 'topk_method'\]"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\]"),
    (dict(model_type="qwen2_moe"), "model_type 'qwen2_moe' is not supported"),
])
def test_bad_configs_are_refused_before_loading(tmp_path, changes, message):
    folder = _write(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(folder, device="cpu", weights="random")


def test_top_k_above_experts_refused_for_a_bare_config():
    with pytest.raises(ValueError, match="more than num_experts"):
        load_config("mixtral-8x7b").replace(num_experts_per_tok=9)


def test_cuda_graphs_refused_for_moe_only_on_cuda():
    """On the CPU explicit graph sizes run eagerly (padded), so an MoE model decodes with them."""
    cfg = ModelConfig.from_dict(SHAPES["mixtral-top2"][1].to_dict(), name="tiny-moe")
    llm = LLM(load_model(cfg, device="cpu", weights="random"), num_kv_blocks=16, block_size=4,
              cuda_graph_sizes=(1, 2))
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 3


# --- The ledger ---------------------------------------------------------------------------------

def test_published_parameter_counts():
    """Mixtral-8x7B: 46.7B total, 12.9B active; Qwen3-30B-A3B: 30.5B total, 3.3B active."""
    mixtral, qwen = load_config("mixtral-8x7b"), load_config("qwen3-30b-a3b")
    assert round(L.param_count(mixtral) / 1e9, 1) == 46.7 and round(L.active_param_count(mixtral) / 1e9, 1) == 12.9
    assert round(L.param_count(qwen) / 1e9, 1) == 30.5 and L.active_param_count(qwen) // 10**8 == 33
    assert L.param_breakdown(qwen)["router"] == 48 * 128 * 2048
    dense = load_config("llama-3.1-8b")
    assert L.active_param_count(dense) == L.param_count(dense) and "router" not in L.param_breakdown(dense)


def test_meta_models_count_what_the_ledger_counts():
    from minillm.engine.model import Transformer
    from minillm.engine.memory_plan import MemoryPlanError
    from minillm.engine.planner import model_bytes, plan

    cfg = load_config("qwen3-30b-a3b")
    with torch.device("meta"):
        net = Transformer(cfg).to(torch.bfloat16)
    assert sum(p.numel() for p in net.parameters()) == L.param_count(cfg)
    assert model_bytes(net) == L.weight_bytes(cfg) == 2 * L.param_count(cfg)
    dry = plan("qwen3-30b-a3b", gpu_memory="80GiB", dtype="bf16", max_model_len=4096)
    assert dry.weight_bytes == L.weight_bytes(cfg)  # every expert on the card, 3.3B active or not
    for model, card in (("qwen3-30b-a3b", "24GiB"), ("mixtral-8x7b", "80GiB")):
        with pytest.raises(MemoryPlanError):
            plan(model, gpu_memory=card, dtype="bf16", max_model_len=4096)


def test_experts_touched_per_decode_step():
    cfg = load_config("qwen3-30b-a3b")
    e, k = 128, 8
    assert L.experts_touched(cfg, 1) == pytest.approx(k)
    assert L.experts_touched(cfg, 2) == pytest.approx(2 * k - k * k / e)  # two tokens share k²/E
    assert L.experts_touched(cfg, 256) == pytest.approx(e, rel=1e-6)
    touched = [L.experts_touched(cfg, b) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert all(a < b for a, b in zip(touched, touched[1:]))
    assert L.experts_touched(load_config("llama-3.1-8b"), 64) == 1.0
    with pytest.raises(ValueError, match="batch"):
        L.experts_touched(cfg, 0)


def test_decode_bytes_and_floor_grow_with_the_experts_touched():
    cfg, bandwidth, peak = load_config("mixtral-8x7b"), 3.35e12, 989e12
    expert = L.expert_bytes(cfg)
    assert expert == 3 * 4096 * 14336 * 2
    one, many = L.decode_step(cfg, 1, 1024, bandwidth), L.decode_step(cfg, 64, 1024, bandwidth)
    assert one.experts_touched == pytest.approx(2) and many.experts_touched == pytest.approx(8, abs=1e-6)
    assert one.weight_bytes == pytest.approx(2 * L.active_param_count(cfg))  # batch 1 reads the active weights
    assert many.weight_bytes == pytest.approx(L.weight_bytes(cfg))  # batch 64 reads them all
    b4 = L.decode_step(cfg, 4, 1024, bandwidth)
    assert b4.weight_bytes == pytest.approx(L.weight_bytes(cfg) - 32 * 8 * (3 / 4) ** 4 * expert)
    floor = one.floor(peak)
    assert floor.bound == "memory" and floor.seconds == pytest.approx(one.bytes / bandwidth)
    # MBU counts the bytes read: a step at its floor uses the whole bandwidth
    assert one.mbu(floor.seconds) == pytest.approx(1.0)
    all_weights = (L.weight_bytes(cfg) + one.kv_read_bytes) / floor.seconds / bandwidth
    assert all_weights == pytest.approx(3.6, abs=0.05)  # counting every expert would claim 360%
    int4 = L.decode_step(cfg, 1, 1024, bandwidth, quantization="int4")
    assert int4.weight_bytes == pytest.approx(L.weight_bytes(cfg, "bf16", "int4")
                                              - 32 * 6 * L.expert_bytes(cfg, "bf16", "int4"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_estimate_bounds_the_profiled_moe_step(dtype):
    """Every token to every expert (k = E) is the formula's worst case, met exactly; with k < E
    each expert gets fewer rows and the formula stays above what the step allocates."""
    from minillm.engine.planner import activation_estimate, profile_activation_peak

    shape = dict(vocab_size=160, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    for experts, k in ((4, 4), (8, 2)):
        hf = MixtralConfig(**shape, num_local_experts=experts, num_experts_per_tok=k).to_dict()
        cfg = ModelConfig.from_dict(hf, name=f"moe-{experts}-{k}")
        model = load_model(cfg, device="cpu", dtype=dtype, weights="random")
        measured, estimate = profile_activation_peak(model, 512, 4, 16), activation_estimate(cfg, 512, 4, dtype)
        assert measured == estimate if k == experts else measured < estimate


def test_matmul_weights_a_step_reads():
    """What diagnose's MBU counts per step: one token's k experts at batch 1, all E at a large
    batch; a dense model's matmul weights whatever the batch."""
    cfg, dense = load_config("mixtral-8x7b"), load_config("llama-3.1-8b")
    assert L.matmul_weight_bytes(cfg, 1) == 2 * L.matmul_param_count(cfg)
    all_experts = 2 * (L.matmul_param_count(cfg) + 32 * 6 * 3 * 4096 * 14336)
    assert L.matmul_weight_bytes(cfg, 256) == pytest.approx(all_experts)
    assert L.matmul_weight_bytes(dense, 64) == 2 * L.matmul_param_count(dense)
