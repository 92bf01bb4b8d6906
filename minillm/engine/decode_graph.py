"""CUDA graphs for decode steps (chapter 解码), as vLLM and gpt-fast do.

An eager decode step launches a few dozen kernels per layer, each paying the host's launch cost;
at small batches the GPU waits for the host. A CUDA graph records one step's launches once and
replays them with one call. A graph's tensors are fixed, so the runner captures one graph per
batch size of a ladder (1, 2, 4, 8, 16, ...), pads each decode step to the next captured size,
copies the step's inputs into that graph's buffers and replays it. Padding rows compute garbage
that nobody reads: their K/V slot is -1 (not stored) and their context is one token.

Off CUDA there is nothing to capture; a :class:`DecodeGraph` then runs the model eagerly on the
same padded buffers, which is how the CPU tests check the padding. What a graph does there for
launches, a compiler does for ops: :class:`CompiledDecode` hands one sequence's decode step to
``torch.compile``, which fuses the norms, RoPE and residual adds into a few C++ loops and issues
the rest without Python in between (its output layer too).
"""
from __future__ import annotations

import bisect
import types

import torch

from minillm.engine.attention_metadata import AttentionMetadata
from minillm.engine.kernels.reference import attend
from minillm.engine.model import Transformer
from minillm.engine.paged_cache import PagedKVCache


def graph_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs`` (itself included)."""
    sizes = [size for size in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if size <= max_num_seqs]
    return sorted({*sizes, max_num_seqs})


class DecodeGraph:
    """One decode step of ``size`` rows: the buffers it reads, and its graph when captured."""

    def __init__(self, model: Transformer, kv_cache: PagedKVCache, size: int):
        self.model, self.kv, self.size = model, kv_cache, size
        # Static buffers, made the way every step's inputs are: each row a one-token sequence.
        tables = torch.zeros(size, kv_cache.manager.table_width, dtype=torch.int32)
        self.input_ids, self.positions, self.attn = kv_cache.step_builder.build(
            tables, [0] * size, [1] * size, kv_cache.block_size, [0] * size)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Record the step (after one eager run, so every kernel is compiled and warm)."""
        self._run_eagerly()
        torch.cuda.synchronize(self.kv.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.hidden = self._run_eagerly()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode step of at most ``size`` rows: copy in, pad, replay."""
        batch, width = len(input_ids), attn.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.attn.slot_mapping[:batch].copy_(attn.slot_mapping)
        self.attn.slot_mapping[batch:].fill_(-1)  # padding rows store nothing ...
        self.attn.seq_lens[:batch].copy_(attn.seq_lens)
        self.attn.seq_lens[batch:].fill_(1)  # ... and read one slot
        self.attn.block_tables[:batch, :width].copy_(attn.block_tables)
        self.attn.max_seq_len = attn.max_seq_len  # the padding rows' 1 is shorter
        if self.graph is None:
            return self._run_eagerly()[:batch]
        self.graph.replay()
        return self.hidden[:batch]

    def _run_eagerly(self) -> torch.Tensor:
        return self.model(self.input_ids, self.positions, self.attn, self.kv.layer_caches)


class DecodeGraphs:
    """The ladder of decode graphs; ``run`` pads a step to the smallest one that holds it."""

    def __init__(self, model: Transformer, kv_cache: PagedKVCache, sizes: list[int]):
        self.sizes = sorted(sizes)
        self.graphs = {size: DecodeGraph(model, kv_cache, size) for size in self.sizes}
        if kv_cache.device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
                self.graphs[size].capture(pool)

    def holds(self, batch: int) -> bool:
        return bool(self.sizes) and batch <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        size = self.sizes[bisect.bisect_left(self.sizes, len(input_ids))]
        return self.graphs[size].run(input_ids, positions, attn)


def own_code(function, instance):
    """``function`` bound to ``instance`` through a copy of its code object. Dynamo keeps compiled
    graphs per code object; called without guards, it would hand every instance the graph the
    first one compiled (another model's shapes), so each instance compiles its own copy."""
    return types.MethodType(types.FunctionType(function.__code__.replace(), function.__globals__), instance)


class CompiledDecode:
    """One sequence's decode step on the CPU, compiled by ``torch.compile`` (Inductor) once and
    kept for every length: the context's length is the one dynamic size of the graph.

    The step is the model's forward for one token (a dense model, one rank) up to the final norm;
    the output layer is compiled on its own (:meth:`logits`), for any step that needs one row's
    logits: an int8 output layer then reads its rows in one fused loop (``Int8Linear``), in float32.
    The step's attention differs from the reference in one way that matters to a compiler: the new
    K and V are written into the whole pool at (layer, k or v, block, offset), not into a view of
    one layer's cache, so that the compiled graph writes them in place (a view of an input written
    inside the graph would make Inductor copy the pool). Inductor writes the code that calls the
    kernels in C++ too (``cpp_wrapper``), and the calls skip Dynamo's guards, the checks of every
    weight's shape and dtype that would otherwise run before each call: the runner calls only
    when :meth:`holds`, and nothing the graph reads changes its shape or dtype afterwards. Both
    compile when it is made, on a step of a two-token context in block 0 (slot 1 there gets the
    values of token 0, finite, which the next request in that block overwrites before reading):
    a minute or more on a laptop core; Inductor keeps the result on disk, so the next process
    takes seconds."""

    def __init__(self, model: Transformer, kv_cache: PagedKVCache):
        config = model.config
        if kv_cache.device.type != "cpu" or config.is_moe:  # (EngineConfig refuses it with tensor parallelism)
            raise ValueError(f"{config.name}: compile_decode is for a dense model on the CPU (a step on CUDA "
                             f"replays a CUDA graph; an MoE step's shapes follow its routing)")
        self.model, self.kv = model, kv_cache
        options = {"cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_all_guards_unsafe}  # (vLLM skips them too)
        self.step = torch.compile(own_code(CompiledDecode._step, self), fullgraph=True, options=options)
        self.output_layer = torch.compile(own_code(CompiledDecode._logits, self), fullgraph=True, dynamic=False,
                                          options=options)
        self.table = torch.zeros(kv_cache.manager.table_width, dtype=torch.int32)  # one width for every step
        with torch.inference_mode():
            self.logits(self.run(*kv_cache.step_builder.build(self.table[None], [1], [1], kv_cache.block_size, [0])))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[1, vocab]`` of one hidden state ``[1, hidden]``."""
        return self.output_layer(hidden).float()

    def _logits(self, hidden):
        return self.model.lm_head(hidden)

    @staticmethod
    def holds(batch: int, context: int) -> bool:
        """One sequence, its context two tokens or more (a one-token prompt's step, a context of 1,
        is a size the compiler would specialize on and compile again for)."""
        return batch == 1 and context >= 2

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Hidden state ``[1, hidden]`` of one sequence's next token."""
        self.table[:attn.block_tables.shape[1]].copy_(attn.block_tables[0])
        context = torch.arange(attn.max_seq_len)
        torch._dynamo.mark_dynamic(context, 0)
        return self.step(self.kv.kv, input_ids, positions, self.table, context)

    def _step(self, pool, input_ids, positions, table, context):
        net, block_size = self.model, pool.shape[3]
        x = net.model.embed_tokens(input_ids)
        cos, sin = net.rotary(positions, x.dtype)
        slot = table[positions // block_size].long(), (positions % block_size).long()
        past = table[context // block_size].long(), (context % block_size).long()
        for i, layer in enumerate(net.model.layers):
            attention = layer.self_attn
            q, k, v = attention.rotated_qkv(layer.input_layernorm(x), cos, sin)
            which = torch.full_like(slot[0], i)
            pool.index_put_((which, torch.zeros_like(which), *slot), k)
            pool.index_put_((which, torch.ones_like(which), *slot), v)
            keys, values = (pool[i, kind][past][None].transpose(1, 2) for kind in (0, 1))
            out = attend(q[:, :, None, :], keys, values, attention.scale)
            x = x + attention.o_proj(out.reshape(1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return net.model.norm(x)
