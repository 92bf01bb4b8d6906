"""A GGUF file, llama.cpp's one-file checkpoint (chapter 预填充).

A GGUF holds a whole model in one file: a header, metadata (key -> value: the model's shape, the
tokenizer's vocabulary and merges, its chat template), a table of tensors (name, shape, type,
offset) and then the tensor data. :class:`GGUFFile` reads the header, the metadata and the table
with ``struct`` (pure Python, nothing of the data is read), :func:`model_fields` turns the metadata
into the fields of a ``ModelConfig`` (``minillm.engine.config.load_config`` builds it), and
:meth:`GGUFFile.read` dequantizes one tensor into float32 (:meth:`GGUFFile.read_q4_1` reads a Q4_1
one as it is stored, which is already minillm's int4 in groups of 32):

* F32, F16, BF16 hold plain values;
* Q8_0: blocks of 32 int8 values ``q`` with one fp16 scale ``d``: ``w = d * q`` (34 bytes per 32);
* Q4_0: blocks of 32 4-bit values with one fp16 scale: ``w = d * (q - 8)`` (18 bytes per 32);
* Q4_1: blocks of 32 4-bit values with an fp16 scale and an fp16 minimum: ``w = d * q + m``
  (20 bytes per 32). In a 4-bit block, byte ``j`` holds value ``j`` in its low nibble and value
  ``j + 16`` in its high one.

llama.cpp rotates each query and key head by interleaved pairs (x0, x1), (x2, x3)...; Hugging Face
and minillm rotate its two halves. llama.cpp's converter therefore permutes the rows of every
``attn_q`` and ``attn_k``; :func:`unpermute_qk` puts them back.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from math import prod
from pathlib import Path


MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # the two metadata value types that are not fixed-size
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                  10: "<Q", 11: "<q", 12: "<d"}

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30  # ggml's type numbers
TYPE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1"}
UNSUPPORTED_TYPE_NAMES = {6: "Q5_0", 7: "Q5_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K",
                          14: "Q6_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
                          20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 28: "F64", 29: "IQ1_M"}
ELEMENT_BYTES = {F32: 4, F16: 2, BF16: 2}
BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20}  # per block of BLOCK_SIZE values
BLOCK_SIZE = 32

SUPPORTED_ARCHITECTURES = ("llama",)
LAYER_TENSORS = {  # GGUF's names inside blk.N -> Hugging Face's inside model.layers.N
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table: where a tensor's bytes are and how they encode it."""

    name: str
    shape: tuple[int, ...]  # torch's order, rows first (ggml lists the fastest dimension first)
    ggml_type: int
    offset: int  # bytes from the start of the file

    @property
    def type_name(self) -> str:
        names = TYPE_NAMES | UNSUPPORTED_TYPE_NAMES
        return names.get(self.ggml_type, f"ggml type {self.ggml_type}")

    @property
    def nbytes(self) -> int:
        count = prod(self.shape)
        if self.ggml_type in ELEMENT_BYTES:
            return count * ELEMENT_BYTES[self.ggml_type]
        return count // BLOCK_SIZE * BLOCK_BYTES[self.ggml_type]


class GGUFFile:
    """The metadata and tensor table of a ``.gguf`` file, read without touching the tensor data.

    ``metadata`` holds every key; string arrays (the vocabulary, the merges) are read as their
    length only, unless named in ``string_arrays``; number arrays (the token types) in one unpack.
    """

    def __init__(self, path: str | Path, string_arrays: tuple[str, ...] = ()):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if self._data[:4] != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (it does not start with b'GGUF')")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self._data, 4)
        if version not in VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported ({VERSIONS})")
        self._pos = 24
        self.metadata = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"), key in string_arrays)
        self._metadata_end = self._pos
        table = [self._tensor_entry() for _ in range(tensor_count)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = {name: GGUFTensor(name, shape, kind, data_start + offset)
                        for name, shape, kind, offset in table}

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._data, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        self._pos += length
        return self._data[self._pos - length:self._pos].decode("utf-8", errors="replace")

    def _value(self, kind: int, keep_strings: bool):
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            return self._scalar(SCALAR_FORMATS[kind])
        item_kind, count = self._scalar("<I"), self._scalar("<Q")
        if item_kind in SCALAR_FORMATS:
            fmt = f"<{count}{SCALAR_FORMATS[item_kind][1]}"
            values = struct.unpack_from(fmt, self._data, self._pos)
            self._pos += struct.calcsize(fmt)
            return list(values)
        if item_kind == STRING and not keep_strings:
            for _ in range(count):
                length = self._scalar("<Q")
                self._pos += length
            return count
        return [self._value(item_kind, keep_strings) for _ in range(count)]

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
        return name, tuple(reversed(dims)), self._scalar("<I"), self._scalar("<Q")

    def metadata_digest(self) -> str:
        """A hash of the header and metadata bytes: the same for every copy of the same model."""
        return hashlib.sha256(self._data[:self._metadata_end]).hexdigest()[:32]

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "unknown")

    def read(self, tensor: GGUFTensor):
        """The tensor's values as a float32 CPU tensor of ``tensor.shape`` (dequantized)."""
        import torch

        return dequantize(self._raw(tensor), tensor.ggml_type).view(tensor.shape)

    def read_q4_1(self, tensor: GGUFTensor):
        """A Q4_1 tensor ``[N, K]`` as stored: its codes (uint8 ``[N, K]`` in [0, 15]) and each
        block's fp16 ``d`` and ``m`` (``[N, K / 32]`` each), with ``w = d * q + m``."""
        import torch

        if tensor.ggml_type != Q4_1:
            raise ValueError(f"{tensor.name} is {tensor.type_name}, not Q4_1")
        rows = tensor.shape[0]
        blocks = self._raw(tensor).view(-1, BLOCK_BYTES[Q4_1])
        packed = blocks[:, 4:]
        codes = _nibbles(packed).view(rows, -1)
        scale, minimum = (blocks[:, i:i + 2].view(torch.float16).view(rows, -1) for i in (0, 2))
        return codes, scale, minimum

    def _raw(self, tensor: GGUFTensor):
        import torch

        return torch.frombuffer(self._data, dtype=torch.uint8, count=tensor.nbytes, offset=tensor.offset)


def dequantize(raw, ggml_type: int):
    """Float32 values of the bytes ``raw`` (a flat uint8 tensor) stored as ``ggml_type``."""
    import torch

    if ggml_type in ELEMENT_BYTES:
        dtype = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}[ggml_type]
        return raw.view(dtype).to(torch.float32, copy=True)
    blocks = raw.view(-1, BLOCK_BYTES[ggml_type])
    scale = blocks[:, 0:2].view(torch.float16).to(torch.float32)
    if ggml_type == Q8_0:
        return (blocks[:, 2:].view(torch.int8).to(torch.float32) * scale).flatten()
    packed = blocks[:, 4:] if ggml_type == Q4_1 else blocks[:, 2:]
    nibbles = _nibbles(packed)
    if ggml_type == Q4_0:
        return (scale * (nibbles.to(torch.int8) - 8).to(torch.float32)).flatten()
    minimum = blocks[:, 2:4].view(torch.float16).to(torch.float32)
    return (scale * nibbles.to(torch.float32) + minimum).flatten()


def _nibbles(packed):
    """The 4-bit codes of blocks ``packed`` ``[blocks, 16]``, in ggml's order ``[blocks, 32]``:
    the low nibbles of a block's bytes are its first 16 codes, the high nibbles the last 16."""
    import torch

    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def unpermute_qk(weight, num_heads: int):
    """Rows of a query or key projection from llama.cpp's interleaved rotary order back to the
    half-split one: within each head, rows (0, 2, 4, ..., 1, 3, 5, ...) become (0, 1, 2, ...)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def model_fields(gguf: GGUFFile) -> dict:
    """The ``ModelConfig`` fields a GGUF's metadata describes (all but the name); ``ValueError``
    for what minillm cannot run."""
    arch, meta = gguf.architecture, gguf.metadata
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf.path.name}: architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def key(suffix: str, default=None):
        value = meta.get(f"{arch}.{suffix}", default)
        if value is None:
            raise ValueError(f"{gguf.path.name}: metadata has no {arch}.{suffix}")
        return value

    heads, kv_heads = key("attention.head_count"), key("attention.head_count_kv", 0) or None
    if isinstance(kv_heads, list):
        raise ValueError(f"{gguf.path.name}: a KV head count per layer is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in gguf.tensors:
        raise ValueError(f"{gguf.path.name}: RoPE scaling ({scaling}, or rope_freqs.weight) is not "
                         f"supported for GGUF files; load the Hugging Face checkpoint instead")
    if meta.get(f"{arch}.attention.sliding_window"):
        raise ValueError(f"{gguf.path.name}: sliding-window attention is not supported; minillm "
                         f"attends to the whole context")
    hidden = key("embedding_length")
    head_dim = meta.get(f"{arch}.attention.key_length") or hidden // heads
    if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{gguf.path.name}: RoPE on part of each head is not supported")
    vocab = meta.get(f"{arch}.vocab_size") or gguf.tensors["token_embd.weight"].shape[0]
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if k in meta]
    types = {t.ggml_type for t in gguf.tensors.values()}
    return dict(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads or heads,
        head_dim=head_dim,
        max_position_embeddings=key("context_length"),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
        o_bias="blk.0.attn_output.bias" in gguf.tensors,
        mlp_bias="blk.0.ffn_up.bias" in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        torch_dtype="float16" if F16 in types and BF16 not in types else "bfloat16",
    )


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face (and minillm) parameter name of a GGUF tensor; None if it has none."""
    base, dot, kind = gguf_name.rpartition(".")
    if base in MODEL_TENSORS and kind == "weight":
        return f"{MODEL_TENSORS[base]}.weight"
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match[2] in LAYER_TENSORS:
        return f"model.layers.{match[1]}.{LAYER_TENSORS[match[2]]}.{match[3]}"
    return None


def checked_tensors(gguf: GGUFFile) -> dict[str, GGUFTensor]:
    """Hugging Face name -> tensor, after checking that every tensor has a name and a type minillm
    reads (``ValueError`` naming the first few that do not)."""
    unknown = [n for n in gguf.tensors if hf_name(n) is None]
    if unknown:
        raise ValueError(f"{gguf.path.name}: tensors minillm does not know: {unknown[:5]}")
    unsupported = [f"{t.name} ({t.type_name})" for t in gguf.tensors.values() if t.ggml_type not in TYPE_NAMES]
    if unsupported:
        raise ValueError(f"{gguf.path.name}: tensor types minillm cannot dequantize: {unsupported[:5]} "
                         f"(it reads {', '.join(TYPE_NAMES.values())})")
    return {hf_name(n): t for n, t in gguf.tensors.items()}


def hf_rows(name: str, rows, config):
    """The rows of tensor ``name`` in Hugging Face's order: a query or key projection's unpermuted
    (:func:`unpermute_qk`), any other's as they are."""
    if ".self_attn.q_proj." in name:
        return unpermute_qk(rows, config.num_heads)
    if ".self_attn.k_proj." in name:
        return unpermute_qk(rows, config.num_kv_heads)
    return rows


def gguf_tokenizer(gguf: GGUFFile):
    """The tokenizer (vocabulary, merges, special tokens, chat template) a GGUF's metadata
    describes, as a :class:`~minillm.engine.tokenizer.Tokenizer`; None when it has none.

    transformers builds it the first time, as its own GGUF loading does (slowly: it reads the
    metadata again and converts the vocabulary), and the result is saved under
    :func:`cache_dir`, keyed by the file's metadata and transformers' version. Every later load
    reads those files without importing transformers. (``PreTrainedTokenizerFast`` directly:
    ``AutoTokenizer`` would first read the whole file again with the ``gguf`` package to choose
    the class, which takes seconds.)"""
    if "tokenizer.ggml.tokens" not in gguf.metadata:
        return None
    from importlib.metadata import version

    from minillm.engine.tokenizer import Tokenizer

    saved = cache_dir() / "tokenizers" / f"{gguf.metadata_digest()}-transformers-{version('transformers')}"
    if (saved / "tokenizer.json").is_file():
        return Tokenizer(saved)
    from transformers import PreTrainedTokenizerFast

    built = PreTrainedTokenizerFast.from_pretrained(gguf.path.parent, gguf_file=gguf.path.name)
    if _save_into(built, saved):
        return Tokenizer(saved)
    with tempfile.TemporaryDirectory() as scratch:  # a cache that cannot be written: read a copy
        built.save_pretrained(scratch)
        return Tokenizer(scratch)


def cache_dir() -> Path:
    """Where minillm keeps what it derives from a model once: ``$MINILLM_CACHE``, else
    ``$XDG_CACHE_HOME/minillm``, else ``~/.cache/minillm``."""
    if os.environ.get("MINILLM_CACHE"):
        return Path(os.environ["MINILLM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minillm"


def _save_into(tokenizer, folder: Path) -> bool:
    """Save into a fresh folder beside ``folder``, then rename it into place, so that no reader
    ever sees half the files; whether ``folder`` now holds them (False: a cache that cannot be
    written; another process that got there first has written them too)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        fresh = tempfile.mkdtemp(dir=folder.parent, prefix=".partial-")
    except OSError:
        return False
    try:
        tokenizer.save_pretrained(fresh)
        os.rename(fresh, folder)
    except OSError:
        shutil.rmtree(fresh, ignore_errors=True)
    return (folder / "tokenizer.json").is_file()
