"""What the serving chapter (book/ch09-serving.md) says its ledger shows: one step that carries a
chunk of a prefill beside running decodes (``estimate.mixed_step``), chapter 8's contract on an
H100 with chunking off and on, and the exercises."""
import pytest

from minillm.engine.config import load_config
from minillm.engine.engine_config import EngineConfig
from minillm.lab import estimate as L
from minillm.lab.gpus import gpu_specs, lookup_gpu
from minillm.server.cli import MAX_QUEUE

CONTRACT, RUNNING, CTX = 8192, 7, 1024  # chapter 8's scene: seven colleagues decode at ~1K


@pytest.fixture(scope="module")
def llama8b():
    return load_config("llama-3.1-8b")


@pytest.fixture(scope="module")
def h100():
    return lookup_gpu("H100 SXM")


def contract_steps(cfg, gpu, budget, running=RUNNING):
    chunk = budget - running
    return [L.mixed_step(cfg, running, CTX, (s, min(s + chunk, CONTRACT)), CONTRACT, gpu.bf16_flops, gpu.bandwidth)
            for s in range(0, CONTRACT, chunk)]


def test_a_whole_prompt_alone_is_the_prefill_ledger(llama8b, h100):
    step = L.mixed_step(llama8b, 0, 1, (0, 2048), 2048, h100.bf16_flops, h100.bandwidth)
    prefill = L.prefill(llama8b, 2048)
    assert (step.flops, step.bytes) == (prefill.flops, prefill.bytes)


def test_decodes_add_their_flops_and_their_kv_not_the_weights_again(llama8b, h100):
    alone = L.mixed_step(llama8b, 0, 1, (0, 512), 512, h100.bf16_flops, h100.bandwidth)
    mixed = L.mixed_step(llama8b, 7, 1024, (0, 512), 512, h100.bf16_flops, h100.bandwidth)
    decode = L.decode_step(llama8b, 7, 1024, h100.bandwidth)
    assert mixed.flops == alone.flops + decode.flops
    assert mixed.bytes == alone.bytes + decode.kv_read_bytes


def test_a_chunk_attends_to_everything_before_it_and_reads_its_kv(llama8b, h100):
    """Positions [1000, 1500) of a 2000-token prompt: no logits (the prompt goes on), attention to
    1,001..1,500 positions, the KV of all 1,500 positions moved."""
    step = L.mixed_step(llama8b, 0, 1, (1000, 1500), 2000, h100.bf16_flops, h100.bandwidth)
    layers = 500 * (L.matmul_flops_per_token(llama8b) - L.output_layer_flops(llama8b))
    attention = sum(L.attention_flops_per_token(llama8b, c) for c in range(1001, 1501))
    assert step.flops == layers + attention
    assert step.bytes == L.weight_bytes(llama8b) + L.kv_bytes(llama8b, 1500)


@pytest.mark.parametrize("span", [(0, 0), (5, 3), (0, 9)])
def test_a_span_outside_the_prompt_is_refused(llama8b, span):
    with pytest.raises(ValueError, match="start < end <= prompt_len"):
        L.mixed_step(llama8b, 0, 1, span, 8, 1e15, 1e12)
    with pytest.raises(ValueError, match="running"):
        L.mixed_step(llama8b, -1, 1, (0, 8), 8, 1e15, 1e12)


def test_the_contract_on_the_h100(llama8b, h100):
    """The chapter's table: a 5 ms decode step; the whole contract in one step, compute-bound, 26
    times as long; in chunks of 2,041 tokens (minillm's default budget of 2,048 less the seven
    decodes), five steps, the heaviest about 37 ms, all five together a little longer than the one
    whole step; KV of 1 GiB per contract."""
    decode = L.decode_step(llama8b, RUNNING, CTX, h100.bandwidth).floor(h100.bf16_flops)
    (whole,) = contract_steps(llama8b, h100, CONTRACT + RUNNING)
    chunks = contract_steps(llama8b, h100, EngineConfig().max_num_batched_tokens)
    assert EngineConfig().max_num_batched_tokens == 2048
    assert decode.bound == "memory" and round(decode.seconds * 1e3, 1) == 5.1
    assert whole.bound == "compute" and round(whole.seconds / decode.seconds) == 26
    assert len(chunks) == 5 and round(max(f.seconds for f in chunks) * 1e3, 1) == 36.6
    assert all(f.seconds < whole.seconds for f in chunks)
    assert 1 < sum(f.seconds for f in chunks) / whole.seconds < 1.1
    assert L.kv_bytes(llama8b, CONTRACT) == 2**30


def test_chunks_compute_the_same_contract_and_read_the_weights_per_chunk(llama8b, h100):
    """"Both compute the same contract; chunking only reads the weights once per chunk and the KV
    of the chunks before it back": the FLOPs of the chunks are the whole step's plus one more set
    of decodes per extra step, and the bytes the whole step's plus a read of the weights, the
    decodes' KV and the earlier chunks' KV per extra step."""
    (whole,) = contract_steps(llama8b, h100, CONTRACT + RUNNING)
    chunks = contract_steps(llama8b, h100, 2048)
    extra = len(chunks) - 1
    decode = L.decode_step(llama8b, RUNNING, CTX, h100.bandwidth)
    starts = range(0, CONTRACT, 2048 - RUNNING)
    assert sum(f.flops for f in chunks) == whole.flops + extra * decode.flops
    assert sum(f.bytes for f in chunks) == (whole.bytes + extra * (L.weight_bytes(llama8b) + decode.kv_read_bytes)
                                             + sum(L.kv_bytes(llama8b, s) for s in starts))


def heaviest_and_whole(cfg, contract, budget, peak_flops, bandwidth, dtype, running=19, ctx=128):
    """The lab's two stalls: the whole contract beside ``running`` decodes, and its heaviest chunk."""
    chunk = budget - running
    whole = L.mixed_step(cfg, running, ctx, (0, contract), contract, peak_flops, bandwidth, dtype)
    heaviest = max((L.mixed_step(cfg, running, ctx, (s, min(s + chunk, contract)), contract, peak_flops,
                                 bandwidth, dtype) for s in range(0, contract, chunk)), key=lambda f: f.seconds)
    return heaviest, whole


@pytest.mark.parametrize("ridge", [1, 10, 100, 300])
def test_on_a_cpu_the_labs_heaviest_chunk_floor_is_below_the_whole_contracts(ridge):
    """The lab's claim "按账本，分块时最重的那一步，下界也比不分块的那一步短" at its CPU size (tiny,
    fp32, a 2,048-token contract, a budget of 512): the whole prompt is compute-bound on any ridge up
    to hundreds of FLOP per byte, and the heaviest chunk computes less than it and moves no more."""
    heaviest, whole = heaviest_and_whole(load_config("tiny"), 2048, 512, ridge * 1e10, 1e10, "fp32")
    assert whole.bound == "compute" and heaviest.flops < whole.flops and heaviest.bytes <= whole.bytes
    assert heaviest.seconds < whole.seconds


@pytest.mark.parametrize("gpu", [g.name for g in gpu_specs()])
@pytest.mark.parametrize("contract, budget", [(8192, 2048), (2048, 512)])
def test_on_every_gpu_the_labs_heaviest_chunk_floor_is_below_the_whole_contracts(llama8b, gpu, contract, budget):
    """The same claim at the lab's GPU sizes (the whole scene, or a quarter of it), on every card
    of the spec table."""
    spec = lookup_gpu(gpu)
    heaviest, whole = heaviest_and_whole(llama8b, contract, budget, spec.bf16_flops, spec.bandwidth, "bf16")
    assert whole.bound == "compute" and heaviest.seconds < whole.seconds


def test_exercise_1_a_smaller_budget(llama8b, h100):
    """At 512 every chunk but the last is still compute-bound: the stall shrinks and the prefill
    barely grows; at 128 every chunk is bandwidth-bound, the stall is within a tenth of a plain
    decode step and the prefill takes between two and three times as long ("长了一倍多")."""
    default = contract_steps(llama8b, h100, 2048)
    mid, low = contract_steps(llama8b, h100, 512), contract_steps(llama8b, h100, 128)
    decode = L.decode_step(llama8b, RUNNING, CTX, h100.bandwidth).floor(h100.bf16_flops)
    total = lambda steps: sum(f.seconds for f in steps)  # noqa: E731
    assert all(f.bound == "compute" for f in mid[:-1])
    assert max(f.seconds for f in mid) < max(f.seconds for f in default)
    assert abs(total(mid) / total(default) - 1) < 0.02
    assert all(f.bound == "memory" for f in low) and 2 < total(low) / total(default) < 3
    assert max(f.seconds for f in low) < 1.1 * decode.seconds


def test_exercise_3_the_back_of_the_default_queue(llama8b, h100):
    """A full H100 frees its seats slowly enough that the 1,024th in line waits over ten seconds."""
    seats = L.memory_budget(llama8b, h100.memory_bytes, 0.92).concurrent_requests(1024 + 256)
    step = L.decode_step(llama8b, seats, 1024 + 128, h100.bandwidth).floor(h100.bf16_flops)
    assert MAX_QUEUE == 1024 and step.bound == "memory"
    assert MAX_QUEUE * 256 * step.seconds / seats > 10
