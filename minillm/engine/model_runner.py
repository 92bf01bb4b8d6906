"""One step's tokens through the model (chapters 预填充, 解码 and 调度).

:class:`ModelRunner` takes the scheduler's decisions for a step, moves swapped blocks, asks the KV
cache for the step's input ids, positions and attention metadata (one host-to-device copy), runs
the flat batch through the model (a decode step replays a CUDA graph) and samples the next token of
every request whose tokens are now all computed (its stop tokens masked while it is short of
``min_tokens``, its logit bias and penalties applied, and for a structured request what its
grammar forbids): one device-to-host copy, and one more for the logprobs of the requests that ask
for them. A request that asks for its prompt's logprobs has the logits of all its prompt positions
in the step computed too and turned into them, before the sampled rows' and at most
``max_sampled_rows`` rows at a time, so that they stay under the sampler's planned peak. A
request with proposed tokens (speculative decoding) feeds them after its last token (a draft of
the model's first layers drafts them first, on the same cache);
:func:`~minillm.engine.speculative.verify` turns the logits at its positions into the tokens it keeps.
"""
from __future__ import annotations

import torch

from minillm.engine.decode_graph import CompiledDecode, DecodeGraphs, graph_sizes
from minillm.engine.engine_config import EngineConfig
from minillm.engine.kernels import warmup
from minillm.engine.model import Transformer
from minillm.engine.paged_cache import PagedKVCache
from minillm.engine.request import Request
from minillm.engine.quantization import warmup_quantized
from minillm.engine.sampling import (TokenLogprob, apply_penalties, make_generator, mask_early_stops, sample,
                                     token_logprobs)
from minillm.engine.scheduler import SchedulerOutput
from minillm.engine.speculative import LayerDraft, verify
from minillm.engine.structured import StructuredOutputs


class ModelRunner:
    """The model, its paged KV cache, its decode graphs and the requests' seeded random generators.

    Decode graphs: ``config.cuda_graph_sizes`` if given (off CUDA they run eagerly on the same padded
    inputs), else vLLM's ladder up to ``max_num_seqs`` on CUDA; none with ``enforce_eager`` or under
    tensor parallelism, where ``workers`` (``minillm.engine.workers.Workers``) get each step's
    inputs by broadcast and run the same forward on their shards. With ``config.compile_decode``
    (the CPU) a decode step of one sequence runs compiled (``CompiledDecode``)."""

    def __init__(self, model: Transformer, kv_cache: PagedKVCache, config: EngineConfig, workers=None):
        self.model = model
        self.kv = kv_cache
        self.workers = workers
        self.device = model.device
        self.generators: dict[str, torch.Generator] = {}  # per-request seeded RNGs
        self.structured = StructuredOutputs(getattr(model, "tokenizer", None), model.config.vocab_size,
                                            model.config.eos_token_ids)  # per-request grammar matchers
        # compile before any timed step: the attention kernels, and the quantized linears' matmuls
        warmup(model.config, model.dtype, self.device, kv_cache.block_size, kv_cache.kv.dtype)
        warmup_quantized(model)
        sizes = config.cuda_graph_sizes
        moe_on_cuda = model.config.is_moe and self.device.type == "cuda"  # its shapes follow the routing
        if moe_on_cuda and sizes and not config.enforce_eager:
            raise ValueError(f"{model.config.name}: an MoE model's step cannot be captured in a CUDA "
                             f"graph (its experts' shapes follow the routing); drop cuda_graph_sizes")
        if sizes is None:
            sizes = (graph_sizes(config.max_num_seqs) if self.device.type == "cuda" and not moe_on_cuda
                     and workers is None else [])
        self.decode_graphs = DecodeGraphs(model, kv_cache, [] if config.enforce_eager else list(sizes))
        self.compiled_decode = CompiledDecode(model, kv_cache) if config.compile_decode else None
        self.max_sampled_rows = config.max_sampled_rows  # also the most prompt rows scored at once
        spec = config.speculative_config
        self.draft = LayerDraft(model, kv_cache, spec) if spec is not None and spec.method == "draft_layers" else None
        self.draft_probs: dict[str, torch.Tensor] = {}  # this step's q rows of the drawn drafts
        self.logprobs: dict[str, list[TokenLogprob]] = {}  # this step's, for the requests that ask
        self.prompt_logprobs: dict[str, list[TokenLogprob]] = {}  # this step's prompt tokens', likewise

    def add_generator(self, request_id: str, seed: int | None) -> None:
        generator = make_generator(seed, self.device)
        if generator is not None:
            self.generators[request_id] = generator

    def drop_generator(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, list[int]]:
        """Run the scheduled tokens; return request_id -> sampled tokens for every request whose
        tokens are now all computed (a finished prompt or a decode): its next token, or with
        proposed tokens those of them the target accepts and one more. The logprobs of the requests
        that ask for them are in :attr:`logprobs` until the next step (one per sampled token), those
        of the prompt tokens this step scored in :attr:`prompt_logprobs`."""
        self.logprobs, self.prompt_logprobs = {}, {}
        self.kv.swap(output.blocks_to_swap_out, output.blocks_to_swap_in)
        self.draft_probs = (self.draft.propose([r for r, _ in output.scheduled if r.num_spec_tokens], self.generators)
                            if self.draft is not None and output.num_draft_tokens else {})
        batch, input_ids, last_rows, sampled_requests = [], [], [], []
        prompt_rows, scoring = [], []  # rows whose logits score a prompt token; (request, positions)
        for request, num_new in output.scheduled:
            start, proposed = request.num_computed_tokens, request.spec_token_ids
            batch.append((request.request_id, start, num_new))
            positions = request.unscored_prompt(start, num_new)
            if positions:
                prompt_rows += range(len(input_ids) + positions.start - start, len(input_ids) + positions.stop - start)
                scoring.append((request, positions))
            input_ids += request.token_ids(start, start + num_new - len(proposed))
            if proposed:
                input_ids += proposed
            if start + num_new - len(proposed) == request.num_tokens:
                last_rows += range(len(input_ids) - len(proposed) - 1, len(input_ids))
                sampled_requests.append(request)
        input_ids, positions, attn = self.kv.prepare_inputs(batch, input_ids)
        logit_rows = prompt_rows + last_rows
        step = self.max_sampled_rows  # logits are computed for the prompt rows this many at a time, then the rest
        prompt_slices = [min(step, len(prompt_rows) - i) for i in range(0, len(prompt_rows), step)]
        slices = prompt_slices + ([len(last_rows)] if last_rows else [])
        if self.workers is not None:
            self.workers.broadcast_step(input_ids, attn, logit_rows, slices, output.blocks_to_swap_out,
                                        output.blocks_to_swap_in)
        compiled = self.compiled_decode
        if attn.max_query_len == 1 and compiled is not None and compiled.holds(len(batch), attn.max_seq_len):
            hidden = compiled.run(input_ids, positions, attn)
        elif attn.max_query_len == 1 and self.decode_graphs.holds(len(batch)):
            hidden = self.decode_graphs.run(input_ids, positions, attn)
        else:
            hidden = self.model(input_ids, positions, attn, self.kv.layer_caches)
        if not logit_rows:
            return {}
        if prompt_rows or len(last_rows) < len(hidden):  # only the rows whose logits are needed
            hidden = hidden[torch.tensor(logit_rows, device=self.device)]
        hidden = hidden.split(slices)
        if scoring:
            self._prompt_logprobs(scoring, hidden[:len(prompt_slices)])
        if not sampled_requests:
            return {}
        compute_logits = compiled.logits if compiled is not None and len(hidden[-1]) == 1 else self.model.compute_logits
        raw = logits = compute_logits(hidden[-1])
        rows = [(r, j) for r in sampled_requests for j in range(len(r.spec_token_ids) + 1)]
        params = [r.params for r, _ in rows]
        if any(len(r.output_token_ids) + j < r.params.min_tokens for r, j in rows):
            logits = mask_early_stops(logits, params, [len(r.output_token_ids) + j for r, j in rows],
                                      self.model.config.eos_token_ids)
        if any(p.penalized for p in params):
            logits = apply_penalties(logits, params, [r.prompt_token_ids for r, _ in rows],
                                     [r.output_token_ids + r.spec_token_ids[:j] for r, j in rows])
        if not output.num_draft_tokens:
            generators = ([self.generators.get(r.request_id) for r in sampled_requests] if self.generators
                          else [None] * len(sampled_requests))
            request_ids = [r.request_id for r in sampled_requests]
            filled = self.structured.fill(request_ids)
            if filled is not None:  # the grammar's mask, on a copy: logprobs are the raw logits'
                logits = logits.clone() if logits is raw else logits
                self.structured.apply(logits, *filled)
            tokens = sample(logits, params, generators).tolist()
            self.structured.accept(request_ids, tokens)
            sampled = {r.request_id: [t] for r, t in zip(sampled_requests, tokens, strict=True)}
        else:
            sampled = self._verify(sampled_requests, logits)
        if any(p.logprobs is not None for p in params):
            self._logprobs(sampled_requests, sampled, raw)
        return sampled

    def _logprobs(self, requests: list[Request], sampled: dict[str, list[int]], logits: torch.Tensor) -> None:
        """:attr:`logprobs` of the requests that ask: each sampled token's row of raw logits."""
        rows, tokens, asking, row = [], [], [], 0
        for request in requests:
            got = sampled[request.request_id]
            if request.params.logprobs is not None:
                rows += range(row, row + len(got))
                tokens += got
                asking.append(request)
            row += len(request.spec_token_ids) + 1
        found = iter(token_logprobs(logits[torch.tensor(rows, device=logits.device)], tokens,
                                    [r.params.logprobs for r in asking for _ in sampled[r.request_id]]))
        for request in asking:
            self.logprobs[request.request_id] = [next(found) for _ in sampled[request.request_id]]

    def _prompt_logprobs(self, scoring: list[tuple[Request, range]], hidden: tuple[torch.Tensor, ...]) -> None:
        """:attr:`prompt_logprobs`: the prompt token after each scored position, by its row of the
        ``hidden`` slices' logits (one slice's logits at a time)."""
        tokens = [t for request, positions in scoring
                  for t in request.prompt_token_ids[positions.start + 1:positions.stop + 1]]
        num_top = [request.params.prompt_logprobs for request, positions in scoring for _ in positions]
        found, row = [], 0
        for rows in hidden:
            found += token_logprobs(self.model.compute_logits(rows), tokens[row:row + len(rows)],
                                    num_top[row:row + len(rows)])
            row += len(rows)
        found = iter(found)
        for request, positions in scoring:
            self.prompt_logprobs[request.request_id] = [next(found) for _ in positions]

    def _verify(self, requests: list[Request], logits: torch.Tensor) -> dict[str, list[int]]:
        """A step with proposals: each request's rows verified, the others sampled as usual."""
        out, plain, plain_rows, row = {}, [], [], 0
        for request in requests:
            proposed = request.spec_token_ids
            if proposed:
                out[request.request_id] = verify(proposed, logits[row:row + len(proposed) + 1], request.params,
                                                 self.generators.get(request.request_id),
                                                 self.draft_probs.get(request.request_id))
            else:
                plain.append(request)
                plain_rows.append(row)
            row += len(proposed) + 1
        if plain:
            tokens = sample(logits[plain_rows], [r.params for r in plain],
                            [self.generators.get(r.request_id) for r in plain]).tolist()
            out.update((r.request_id, [t]) for r, t in zip(plain, tokens, strict=True))
        return out
