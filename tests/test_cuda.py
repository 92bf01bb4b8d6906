"""On a CUDA machine only: the engine as a GPU runs it (CUDA graphs, Triton kernels, pinned copies).

Skipped without CUDA; ``scripts/gpu_check.sh`` runs it on a GPU. Greedy tokens must not change
whether a decode step runs eagerly or replays a CUDA graph over a padded batch."""
import random

import pytest
import torch

from minillm import LLM, SamplingParams, load_model
from minillm.engine.config import load_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("count, lengths", [(13, (3, 90)), (6, (300, 1100))])  # long: split
def test_decode_graphs_give_the_eager_tokens(count, lengths):
    config = load_config("tiny").replace(name="cuda-check", num_layers=2)
    model = load_model(config, device="cuda", dtype=torch.float32, weights="random")
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(count)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eager = LLM(model, num_kv_blocks=512, enforce_eager=True)
    graphs = LLM(model, num_kv_blocks=512, max_num_seqs=16)
    assert graphs.runner.decode_graphs.sizes == [1, 2, 4, 8, 16]
    expected = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in graphs.generate(prompts, params, use_tqdm=False)] == expected
    assert graphs.stats()["num_free_blocks"] == graphs.stats()["num_kv_blocks"]


def test_swap_round_trips_through_pinned_memory():
    model = load_model("tiny", device="cuda", dtype=torch.float32, weights="random")
    llm = LLM(model, block_size=4, num_kv_blocks=24, preemption_mode="swap", enforce_eager=True)
    assert llm.kv_cache.swap_kv.is_pinned()
    prompts = [[i + 1] * (20 + i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    swapped = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.stats()["num_preemptions"] > 0
    roomy = LLM(model, block_size=4, num_kv_blocks=256, enforce_eager=True)
    assert swapped == [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]


def test_host_bench_counts_the_triton_launches():
    from minillm.lab.bench_host import decode_launches

    on_gpu = decode_launches("llama-3.1-8b", "cuda", torch.bfloat16)
    assert (on_gpu["triton_per_layer"], on_gpu["triton_outside_layers"]) == (2, 0)  # store, attend
    on_cpu = decode_launches("llama-3.1-8b", "cpu", torch.float32)
    assert on_cpu["triton_per_step"] == 0 and on_gpu["per_layer"] < on_cpu["per_layer"]
