"""GGUF checkpoints (llama.cpp's format) of Llama- and Qwen2-architecture models: read and
write.

Read with ggml's own `gguf` package (GGUFReader); everything else follows llama.cpp:
  arch       `general.architecture` "llama" (Llama 1/2/3, SmolLM, TinyLlama and Mistral,
             which llama.cpp's converter writes as llama) or "qwen2" (Qwen2 / Qwen2.5:
             attn_q / attn_k / attn_v biases); any other is refused naming it.
  config     from the `<arch>.*` metadata (sizes, rope.freq_base, rms epsilon as stored);
             a `rope_freqs.weight` tensor (Llama 3.1 / 3.2 RoPE scaling) is matched to the
             llama3 rule; `rope.scaling.type` yarn (factor, original_context_length,
             yarn_beta_fast / _slow) is YaRN; MoE, other RoPE scaling types and partial rotary
             are refused.
             `<arch>.attention.sliding_window` is read as a window in every layer, or in those
             `attention.sliding_window_pattern` (one bool per layer) marks; llama.cpp's
             converter does not write it for Mistral (a Mistral GGUF then loads with full
             attention, which is what llama.cpp runs it with: equal to transformers' Mistral
             only up to sliding_window tokens) and llama.cpp ignores it for these
             architectures when `save_gguf` writes it.
  weights    dequantized by `gguf.quants.dequantize` from F32, F16, BF16, Q8_0, Q4_0, Q4_1,
             Q4_K, Q5_K and Q6_K, then laid out as the flat contract of `llm.weights`. llama.cpp's
             converter permutes the rows of attn_q / attn_k of "llama" files from transformers'
             half-split RoPE layout to Meta's interleaved one (its `permute`); loading permutes
             them back. "qwen2" files keep the half-split layout (llama.cpp's NEOX RoPE).
  tokenizer  the `tokenizer.ggml.*` metadata read into and written from a `GGUFVocab`;
             `llm.gguf_vocab` turns it into a tokenizer (`gpt2` byte-level BPE or `llama`
             SentencePiece) and a llama2.c vocabulary into it.
Tensors are kept as stored (`StoredTensor`: type, raw blocks, row order) until asked for, so
a weight-only quantized path can take Q8_0 / Q4_x blocks directly (`StoredTensor.rows`).

    ckpt = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg, weights = ckpt.config, ckpt.weights()
    tok = ckpt.tokenizer()
    save_gguf("out.gguf", cfg, weights, qtype="Q8_0", vocab=ckpt.vocab)   # llama.cpp reads it

Errors name the file and, where there is one, the tensor or key: another architecture, a
truncated file, a quantization type outside the list above, a missing or misshapen tensor, a
metadata value of the wrong type or range. Every length and count in the header, metadata and
tensor table is checked against the file's size before anything is read or allocated for it,
and block_count against the blocks the tensors hold, so a corrupt file fails at once.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import struct
import sys
from typing import Any

import numpy as np

from core import errors
from llm.config import LlamaConfig, RopeScaling, YarnScaling
from llm.gguf_vocab import GGUFVocab, vocab_tokenizer

# general.architecture -> what it holds; the architectures read and written here.
ARCHS = {"llama": "Llama, Mistral, SmolLM, TinyLlama, ...", "qwen2": "Qwen2 / Qwen2.5"}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
EXPORT_TYPES = ("F32", "F16", "Q8_0")

# GGUF tensor name -> contract name (per layer `blk.{i}.` -> `layers.{i}.`).
_GLOBAL = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
           "output.weight": "lm_head"}
_LAYER = {"attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
          "attn_output": "wo", "ffn_norm": "mlp_norm", "ffn_gate": "w_gate", "ffn_up": "w_up",
          "ffn_down": "w_down"}
# Qwen2's q / k / v biases: blk.{i}.<name>.bias -> layers.{i}.<contract>.
_BIAS = {"attn_q": "bq", "attn_k": "bk", "attn_v": "bv"}
# `<arch>.*` keys read here; any other key of the architecture may change the arithmetic.
_ARCH_KEYS = {"context_length", "embedding_length", "block_count", "feed_forward_length",
              "rope.dimension_count", "rope.freq_base", "attention.head_count",
              "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
              "attention.key_length", "attention.value_length", "vocab_size",
              "rope.scaling.type", "expert_count", "expert_used_count",
              "attention.sliding_window", "attention.sliding_window_pattern",
              "rope.scaling.factor", "rope.scaling.original_context_length",
              "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow"}


def _gguf():
  try:
    import gguf
  except ImportError as e:   # a main dependency; say which package is missing
    raise ImportError("reading or writing GGUF needs ggml's `gguf` package: pip install "
                      "gguf") from e
  return gguf


# ---------------------------------------------------------------------------------------------
# Reading


def _reader(path: str):
  """GGUFReader whose tensor table is checked first: an unknown type id or a tensor past the
  end of the file (a truncated download) is an error naming the file and the tensor."""
  gguf = _gguf()

  class Reader(gguf.GGUFReader):
    source = path

    def _get(self, offset, dtype, count=1, override_order=None):
      # Every read of the header, metadata and tensor table comes here: a count or length
      # that runs past the end of the file is refused before anything is allocated or looped
      # over (the gguf package would return a short array and go on).
      need = int(offset) + np.dtype(dtype).itemsize * int(count)
      if need > len(self.data):
        raise ValueError(f"{path}: not a complete GGUF file: a field at byte {int(offset)} "
                         f"needs {need - int(offset)} bytes, the file has {len(self.data)}; the "
                         "metadata ends early, the file is truncated or not GGUF")
      return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
      # The package reads an array one element at a time through `_get` (about 20 us each:
      # seconds for a 49152-token vocabulary and its merges). Arrays of strings or scalars are
      # read here in one pass into the same parts (per element: the string's length and
      # bytes, or the scalar), the same data indices and types, so every reader of the fields
      # sees what the package would give; other fields, and files not in this machine's byte
      # order, take the package's path.
      value_type = gguf.GGUFValueType
      if raw_type != value_type.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
        return super()._get_field_parts(orig_offs, raw_type)
      raw_itype = self._get(orig_offs, np.uint32)
      alen = self._get(orig_offs + 4, np.uint64)
      try:
        sub = value_type(int(raw_itype[0]))
      except ValueError:
        return super()._get_field_parts(orig_offs, raw_type)   # the package's own error
      n, offs = int(alen[0]), orig_offs + 12
      parts, idxs = [raw_itype, alen], []
      if sub == value_type.STRING:
        data = self.data.view(np.ndarray)   # slices of a plain array: memmap's cost less
        size, view = len(data), memoryview(data)
        for _ in range(n):
          if offs + 8 > size:
            self._get(offs, np.uint64)                        # raises the truncation error
          (length,) = struct.unpack_from("<Q", view, offs)
          if offs + 8 + length > size:
            self._get(offs + 8, np.uint8, length)             # raises the truncation error
          parts.append(data[offs:offs + 8].view(np.uint64))
          parts.append(data[offs + 8:offs + 8 + length])
          idxs.append(len(parts) - 1)
          offs += 8 + length
      else:
        nptype = self.gguf_scalar_to_np.get(sub)
        if nptype is None:                                    # nested arrays
          return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, n).view(np.ndarray)
        for i in range(n):
          parts.append(values[i:i + 1])
          idxs.append(len(parts) - 1)
        offs += int(values.nbytes)
      types = [value_type.ARRAY] + ([sub] if n else [])
      return offs - orig_offs, parts, idxs, types

    def _build_tensors(self, start_offs, fields):
      size = len(self.data)
      for field in fields:
        _, name_data, _, dims, raw_dtype, offset = field.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        try:
          qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
        except ValueError:
          raise ValueError(f"{path}: tensor {name!r} has ggml type id {int(raw_dtype[0])}, which "
                           f"gguf {_gguf_version()} does not know; supported types: "
                           f"{', '.join(SUPPORTED_TYPES)}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = math.prod(int(x) for x in dims) * type_size // block
        begin = int(start_offs) + int(offset[0])   # Python ints: a huge offset must not wrap
        if begin + n > size:
          raise ValueError(f"{path}: tensor {name!r} ({qtype.name}, shape "
                           f"{tuple(int(d) for d in reversed(dims.tolist()))}) needs bytes "
                           f"[{begin}, {begin + n}) but the file has {size} bytes: the file is "
                           "truncated")
      super()._build_tensors(start_offs, fields)

  if not os.path.isfile(path):
    raise FileNotFoundError(errno.ENOENT, "no such GGUF file", path)
  try:
    return Reader(path)
  except ValueError as e:
    if str(e).startswith(path):
      raise
    raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
  except (IndexError, TypeError, OverflowError, KeyError, MemoryError) as e:
    raise ValueError(f"{path}: not a complete GGUF file ({type(e).__name__}: {e}); the "
                     "metadata ends early, the file is truncated or not GGUF") from None


def _gguf_version() -> str:
  from importlib.metadata import version
  try:
    return version("gguf")
  except Exception:  # noqa: BLE001 - only for the message
    return "(unknown version)"


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


# What a metadata value must be, by kind: (test, words for the message).
_KINDS = {
    "count": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "id": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "number": (lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v),
               "a finite number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
             "an array of strings"),
    "ids": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
            "an array of integers"),
    "numbers": (lambda v: isinstance(v, list) and all(
        (_is_int(x) or isinstance(x, float)) and math.isfinite(x) for x in v),
        "an array of finite numbers"),
}


def _field(reader, key: str, default: Any = None, kind: str | None = None) -> Any:
  """Metadata value `key` (`default` when absent), checked to be of `kind` (`_KINDS`)."""
  f = reader.fields.get(key)
  if f is None:
    return default
  try:
    v = f.contents()
  except (ValueError, IndexError, TypeError) as e:   # e.g. a string that is not UTF-8
    raise ValueError(f"{reader.source}: metadata {key} cannot be read ({type(e).__name__}: "
                     f"{e}); the file is corrupt") from None
  if kind is not None and not _KINDS[kind][0](v):
    shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
    raise errors.expected(reader.source, f"metadata {key}={shown}", _KINDS[kind][1])
  return v


@dataclasses.dataclass(frozen=True)
class StoredTensor:
  """One weight as the GGUF stores it: numpy shape [rows, cols] ([out, in] for matrices),
  ggml type, raw data ([rows, bytes per row] uint8 for block types), and for attn_q / attn_k
  the head count whose rows llama.cpp's converter interleaved (None otherwise)."""

  name: str
  contract: str
  qtype: str
  shape: tuple[int, ...]
  data: np.ndarray
  interleaved_heads: int | None = None

  def rows(self) -> np.ndarray:
    """The stored rows (raw blocks), reordered to the half-split RoPE layout for attn_q /
    attn_k: whole rows move, so quantized blocks stay valid."""
    if self.interleaved_heads is None:
      return self.data
    from llm.weights import interleaved_to_half
    return interleaved_to_half(self.data, self.interleaved_heads)

  def dequantize(self) -> np.ndarray:
    """float32 [rows, cols] in transformers' layout (half-split q / k rows)."""
    gguf = _gguf()
    w = gguf.quants.dequantize(self.rows(), gguf.GGMLQuantizationType[self.qtype])
    return np.asarray(w, np.float32).reshape(self.shape)


def _supported_archs() -> str:
  return ", ".join(f"{a!r} ({what})" for a, what in ARCHS.items())


class GGUFCheckpoint:
  """A Llama- or Qwen2-architecture GGUF file: `config`, `tensors` (contract name ->
  StoredTensor), `vocab`, `weights()` and `tokenizer()`."""

  def __init__(self, path: str):
    self.path = path
    r = _reader(path)
    self.metadata = {k: _field(r, k) for k in r.fields if not k.startswith("tokenizer.ggml.")
                     and not k.startswith("GGUF.")}
    arch = _field(r, "general.architecture", kind="str")
    if arch not in ARCHS:
      raise errors.expected(path, f"general.architecture={arch!r}, an architecture this "
                            "loader does not read", f"one of {_supported_archs()}")
    self.arch = arch
    n_split = _field(r, "split.count", 1, kind="id")
    if n_split > 1:
      raise ValueError(f"{path}: split.count={n_split}: one file of a split GGUF; merge the "
                       "parts first (llama.cpp's gguf-split --merge)")
    self._scaling_tensor = None
    stored = {}
    for t in r.tensors:
      stored[t.name] = t
    self.config = self._config(r, stored)
    self.tensors = self._tensors(stored)
    self.vocab = _vocab(r)

  # -- config

  def _config(self, r, stored) -> LlamaConfig:
    path, arch = self.path, self.arch
    unknown = sorted(k[len(arch) + 1:] for k in r.fields
                     if k.startswith(arch + ".") and k[len(arch) + 1:] not in _ARCH_KEYS)
    if unknown:
      raise ValueError(f"{path}: metadata keys {[f'{arch}.{k}' for k in unknown]} are not "
                       "understood by this loader and may change the model's arithmetic")

    def need(key, kind="count"):
      v = _field(r, f"{arch}.{key}", kind=kind)
      if v is None:
        raise ValueError(f"{path}: missing metadata key {arch}.{key!r}")
      return v

    def opt(key, default, kind="count"):
      return _field(r, f"{arch}.{key}", default, kind)

    experts = _field(r, f"{arch}.expert_count", 0, kind="id")
    if experts:
      raise ValueError(f"{path}: {arch}.expert_count={experts}: a mixture of experts (Mixtral "
                       "style); the Llama model here is dense")
    scaling = _field(r, f"{arch}.rope.scaling.type", kind="str")
    if scaling not in (None, "none", "yarn"):
      raise ValueError(f"{path}: {arch}.rope.scaling.type={scaling!r}; supported: none, yarn "
                       "and Llama 3's rope_freqs.weight factors")
    # llama.cpp reads an absent rope.scaling.type as "linear" and divides every RoPE angle by
    # rope.scaling.factor (unless it is 0 or 1); only type "none" makes it ignore the factor.
    factor = _field(r, f"{arch}.rope.scaling.factor", kind="number")
    if scaling is None and factor not in (None, 0, 1):
      raise errors.expected(path, f"metadata {arch}.rope.scaling.factor={factor} without "
                            f"{arch}.rope.scaling.type, which llama.cpp runs as linear RoPE "
                            "scaling (positions divided by the factor)", "no factor (or 1), "
                            "rope.scaling.type 'none' or 'yarn'; linear scaling is not supported")
    dim, n_heads = need("embedding_length"), need("attention.head_count")
    kv = _field(r, f"{arch}.attention.head_count_kv", n_heads)
    if isinstance(kv, list):
      if len(set(kv)) != 1:
        raise ValueError(f"{path}: {arch}.attention.head_count_kv varies by layer "
                         f"({kv[:8]}); expected one value")
      kv = kv[0]
    if not _KINDS["count"][0](kv) or n_heads % kv:
      raise errors.expected(path, f"metadata {arch}.attention.head_count_kv={kv!r}",
                            f"an integer >= 1 that divides head_count={n_heads}")
    head_dim = opt("attention.key_length", dim // n_heads)
    v_dim = opt("attention.value_length", head_dim)
    rot = opt("rope.dimension_count", head_dim)
    if head_dim < 2 or head_dim % 2:
      raise errors.expected(path, f"head dim {head_dim} (embedding_length={dim}, head_count="
                            f"{n_heads}, key_length)", "an even number >= 2")
    if v_dim != head_dim or rot != head_dim:
      raise ValueError(f"{path}: key_length={head_dim}, value_length={v_dim}, "
                       f"rope.dimension_count={rot}; expected all equal (full rotary, one head "
                       "dim)")
    # llama.cpp's defaults when a key is absent: RoPE base 10000.
    theta = float(opt("rope.freq_base", 10000.0, "number"))
    eps = float(need("attention.layer_norm_rms_epsilon", "number"))
    if not theta > 1 or not eps > 0:
      raise errors.expected(path, f"metadata {arch}.rope.freq_base={theta}, {arch}.attention."
                            f"layer_norm_rms_epsilon={eps}", "a RoPE base > 1 and an epsilon > 0")
    embed = stored.get("token_embd.weight")
    if embed is None:
      raise ValueError(f"{path}: no token_embd.weight tensor")
    vocab = opt("vocab_size", int(embed.shape[1]) if len(embed.shape) == 2 else None)
    if vocab is None:
      raise ValueError(f"{path}: token_embd.weight has shape {embed.shape.tolist()} and there "
                       f"is no {arch}.vocab_size; expected a 2-d embedding")
    window = opt("attention.sliding_window", None)
    pattern = _field(r, f"{arch}.attention.sliding_window_pattern")
    ctx = opt("context_length", 2048)
    n_layers = need("block_count")
    # Before a name is listed per layer: the blocks the tensors hold bound block_count.
    blocks = {n.split(".")[1] for n in stored if n.startswith("blk.")}
    if n_layers > len(blocks):
      raise errors.expected(path, f"metadata {arch}.block_count={n_layers}",
                            f"the {len(blocks)} blocks (blk.N.*) whose tensors the file holds")
    cfg = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads,
                      n_kv_heads=kv, ffn_dim=need("feed_forward_length"), head_dim=head_dim,
                      norm_eps=eps, rope_theta=theta,
                      tie_embeddings="output.weight" not in stored, max_seq_len=ctx,
                      qkv_bias=arch == "qwen2", sliding_window=window,
                      window_layers=_window_layers(path, arch, pattern, window, n_layers))
    if scaling == "yarn":
      cfg = cfg.replace(rope_scaling=YarnScaling(
          factor=float(need("rope.scaling.factor", "number")),
          original_max_position=need("rope.scaling.original_context_length"),
          beta_fast=float(opt("rope.scaling.yarn_beta_fast", 32.0, "number")),
          beta_slow=float(opt("rope.scaling.yarn_beta_slow", 1.0, "number"))))
    freqs = stored.get("rope_freqs.weight")
    if freqs is not None and scaling == "yarn":
      raise ValueError(f"{path}: both {arch}.rope.scaling.type='yarn' and a rope_freqs.weight "
                       "tensor; expected one RoPE scaling")
    if freqs is not None:
      cfg = cfg.replace(rope_scaling=self._rope_scaling(cfg, freqs))
    return cfg

  def _rope_scaling(self, cfg: LlamaConfig, t) -> RopeScaling | None:
    """rope_freqs.weight holds base / scaled frequency per pair (llama.cpp's converter writes
    it for rope_type llama3); match it to the llama3 rule with Llama 3.1's low / high factors
    and original length, the factor being its largest entry."""
    from llm.model import rope_frequencies
    gguf = _gguf()
    if t.tensor_type.name not in SUPPORTED_TYPES:
      raise ValueError(f"{self.path}: tensor 'rope_freqs.weight' is stored as "
                       f"{t.tensor_type.name}; supported types: {', '.join(SUPPORTED_TYPES)}")
    f = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
    if f.shape != (cfg.head_dim // 2,):
      raise ValueError(f"{self.path}: rope_freqs.weight has {f.size} entries, expected "
                       f"head_dim / 2 = {cfg.head_dim // 2}")
    if np.all(f == 1.0):
      return None
    scaling = RopeScaling(factor=float(np.float32(f.max())))
    base = rope_frequencies(cfg.head_dim, cfg.rope_theta, None)
    want = np.asarray(base, np.float64) / np.asarray(
        rope_frequencies(cfg.head_dim, cfg.rope_theta, scaling), np.float64)
    if not np.allclose(f, want, rtol=1e-5, atol=0):
      raise ValueError(f"{self.path}: rope_freqs.weight {np.round(f[:4], 4).tolist()}... does "
                       f"not match Llama 3's RoPE scaling with factor {scaling.factor}, low / "
                       "high frequency factors 1 / 4 and original length 8192; other per-pair "
                       "RoPE factors are not supported")
    return scaling

  # -- tensors

  def _tensors(self, stored) -> dict[str, StoredTensor]:
    from llm.weights import _hf_shape, param_shapes
    cfg, path = self.config, self.path
    want = param_shapes(cfg)
    names = _gguf_names(cfg)
    extra = [n for n in stored if n not in names and n != "rope_freqs.weight"]
    if extra:
      raise ValueError(f"{path}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected, e.g. "
                       f"biases or experts) for a {self.arch} model with "
                       f"{cfg.n_layers} layers")
    out = {}
    for gname, contract in names.items():
      if contract not in want:   # lm_head of a tied model
        continue
      t = stored.get(gname)
      if t is None:
        raise ValueError(f"{path}: missing tensor {gname!r} ({contract}) for "
                         f"{cfg.n_layers} layers, tie_embeddings={cfg.tie_embeddings}")
      qtype = t.tensor_type.name
      if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"{path}: tensor {gname!r} is quantized as {qtype}; supported types: "
                         f"{', '.join(SUPPORTED_TYPES)}")
      shape = tuple(int(d) for d in reversed(t.shape.tolist()))
      expected = _hf_shape(cfg, contract)
      if shape != expected:
        raise ValueError(f"{path}: tensor {gname!r} has shape {shape} (rows, cols), expected "
                         f"{expected} for {contract} from the metadata")
      heads = ({"wq": cfg.n_heads, "wk": cfg.n_kv_heads}.get(contract.rsplit(".", 1)[-1])
               if self.arch == "llama" else None)   # qwen2: half-split as transformers'
      out[contract] = StoredTensor(gname, contract, qtype, shape, t.data, heads)
    return out

  def weights(self) -> dict[str, np.ndarray]:
    """The flat contract (`llm.weights`) in float32; NaN / Inf are errors naming the tensor."""
    from llm.weights import _to_contract, check_finite
    out = {}
    for contract, t in self.tensors.items():
      w = t.dequantize()
      check_finite(t.name, w, f"{self.path} ({t.qtype}, dequantized)")
      out[contract] = _to_contract(self.config, contract, w)
    return out

  def tokenizer(self):
    """The embedded tokenizer as an `llm.tokenizer.HFTokenizer`."""
    return vocab_tokenizer(self.vocab, self.path, self.config.vocab_size)


def _window_layers(path, arch, pattern, window, n_layers) -> tuple[int, ...] | None:
  """The layers `<arch>.attention.sliding_window_pattern` marks true (llama.cpp's per-layer
  form: one bool per layer); None when absent."""
  if pattern is None:
    return None
  key = f"{arch}.attention.sliding_window_pattern"
  if not (isinstance(pattern, list) and len(pattern) == n_layers
          and all(isinstance(x, bool) for x in pattern)) or window is None:
    shown = repr(pattern) if len(repr(pattern)) <= 60 else repr(pattern)[:57] + "..."
    raise errors.expected(path, f"metadata {key}={shown}" + (
        f" without {arch}.attention.sliding_window" if window is None else ""),
        f"{n_layers} bools (block_count), true where the sliding window applies, with "
        "attention.sliding_window set")
  layers = tuple(i for i, on in enumerate(pattern) if on)
  if not layers:
    raise errors.expected(path, f"metadata {key} all false", "no attention.sliding_window "
                          "for a model without windowed layers")
  return layers


def _gguf_names(cfg: LlamaConfig) -> dict[str, str]:
  """GGUF tensor name -> contract name for `cfg` (lm_head listed even when tied)."""
  names = dict(_GLOBAL)
  for i in range(cfg.n_layers):
    names.update({f"blk.{i}.{g}.weight": f"layers.{i}.{c}" for g, c in _LAYER.items()})
    if cfg.qkv_bias:
      names.update({f"blk.{i}.{g}.bias": f"layers.{i}.{c}" for g, c in _BIAS.items()})
  return names


def read_gguf(path: str) -> GGUFCheckpoint:
  return GGUFCheckpoint(path)


def read_vocab(path: str) -> GGUFVocab | None:
  """The `tokenizer.ggml.*` vocabulary of any GGUF file (None: it has none); the
  architecture and the tensors are not looked at beyond the reader's checks."""
  return _vocab(_reader(path))


def load_gguf(path: str) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
  """(config, float32 contract weights) of a Llama / Qwen2 GGUF file."""
  ckpt = GGUFCheckpoint(path)
  return ckpt.config, ckpt.weights()


# ---------------------------------------------------------------------------------------------
# Vocabulary metadata


def _vocab(r) -> GGUFVocab | None:
  model = _field(r, "tokenizer.ggml.model", kind="str")
  if model is None:
    return None

  def get(key, kind, default=None):
    return _field(r, f"tokenizer.ggml.{key}", default, kind)

  return GGUFVocab(
      model=model, tokens=get("tokens", "strs", []), token_types=get("token_type", "ids", []),
      scores=get("scores", "numbers"), merges=get("merges", "strs"), pre=get("pre", "str"),
      bos_id=get("bos_token_id", "id"), eos_id=get("eos_token_id", "id"),
      unk_id=get("unknown_token_id", "id"), eot_id=get("eot_token_id", "id"),
      add_bos=get("add_bos_token", "bool"), add_eos=get("add_eos_token", "bool"),
      add_space_prefix=get("add_space_prefix", "bool"),
      chat_template=_field(r, "tokenizer.chat_template", kind="str"))


# ---------------------------------------------------------------------------------------------
# Writing


def save_gguf(path: str, cfg: LlamaConfig, weights: dict[str, np.ndarray], qtype: str = "F16",
              vocab: GGUFVocab | None = None, name: str = "llama") -> str:
  """Writes `cfg` / `weights` as a GGUF file llama.cpp loads, of general.architecture
  "qwen2" for a Qwen2 config (q / k / v biases; `llm.config.family`), else "llama" (a
  Mistral too, as llama.cpp's converter writes it): matrices in `qtype` (F32, F16 or Q8_0;
  a Q8_0 matrix whose rows are not whole 32-blocks is stored F16, as llama.cpp's converter
  does), norms and biases in F32, "llama" q / k rows permuted to llama.cpp's interleaved
  RoPE layout, Llama 3 RoPE scaling as rope_freqs.weight, YaRN as rope.scaling.*, a sliding
  window as `<arch>.attention.sliding_window` (its layers, when not all, as
  attention.sliding_window_pattern; read back here; llama.cpp ignores both for these
  architectures and runs full attention). `vocab` (GGUFCheckpoint.vocab,
  `llm.gguf_vocab.vocab_from_llama2c`) is written as tokenizer.ggml.*, padded to the
  embedding's rows with unused `[PAD<id>]` tokens where it has fewer (llama.cpp needs one to
  run the file, and one token per row)."""
  gguf = _gguf()
  from llm.config import family
  from llm.weights import _from_contract, _hf_names, check_weights, half_to_interleaved
  from llm.weights_layout import cast_for_export
  if qtype not in EXPORT_TYPES:
    raise ValueError(f"save_gguf: qtype={qtype!r}, expected one of {EXPORT_TYPES}")
  check_weights(cfg, weights, f"save_gguf({path})")
  T = gguf.GGMLQuantizationType
  file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
               "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]
  arch = "qwen2" if family(cfg) == "qwen2" else "llama"
  w = gguf.GGUFWriter(path, arch)
  w.add_name(name)
  w.add_context_length(cfg.max_seq_len)
  w.add_embedding_length(cfg.dim)
  w.add_block_count(cfg.n_layers)
  w.add_feed_forward_length(cfg.ffn_dim)
  w.add_head_count(cfg.n_heads)
  w.add_head_count_kv(cfg.n_kv_heads)
  w.add_rope_dimension_count(cfg.head_dim)
  if cfg.head_dim * cfg.n_heads != cfg.dim:
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  if cfg.sliding_window is not None:
    w.add_sliding_window(cfg.sliding_window)
    if cfg.window_layers is not None:
      w.add_sliding_window_pattern([i in cfg.window_layers for i in range(cfg.n_layers)])
  if isinstance(cfg.rope_scaling, YarnScaling):
    _add_yarn(w, cfg.rope_scaling, path)
  w.add_vocab_size(cfg.vocab_size)
  w.add_file_type(int(file_type))
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  if vocab is not None:
    _add_vocab(w, _padded_vocab(vocab, cfg.vocab_size, path))
  if isinstance(cfg.rope_scaling, RopeScaling):
    from llm.model import rope_frequencies
    base = rope_frequencies(cfg.head_dim, cfg.rope_theta, None)
    scaled = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    w.add_tensor("rope_freqs.weight", (np.asarray(base, np.float64)
                                       / np.asarray(scaled, np.float64)).astype(np.float32))
  to_gguf = {c: g for g, c in _gguf_names(cfg).items()}
  for hf_name, contract in _hf_names(cfg).items():
    a = np.asarray(_from_contract(contract, np.asarray(weights[contract])), np.float32)
    short = contract.rsplit(".", 1)[-1]
    if short in ("wq", "wk") and arch == "llama":
      a = half_to_interleaved(a, cfg.n_heads if short == "wq" else cfg.n_kv_heads)
    a = np.ascontiguousarray(a)
    if a.ndim == 1 or qtype == "F32":
      w.add_tensor(to_gguf[contract], a.astype(np.float32))
    elif qtype == "F16" or a.shape[-1] % 32:
      w.add_tensor(to_gguf[contract], cast_for_export(to_gguf[contract], a, np.float16,
                                                      f"save_gguf({path})"))
    else:
      q = gguf.quants.quantize(a, T.Q8_0)
      w.add_tensor(to_gguf[contract], q, raw_shape=q.shape, raw_dtype=T.Q8_0)
  try:   # the file opens with the header; a failed write (a full disk) still closes it
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
  finally:
    w.close()
  return path


def _add_yarn(w, s: YarnScaling, path: str) -> None:
  """YaRN as llama.cpp's converter writes it; settings GGUF has no key for are refused."""
  if s.attention_factor is not None or s.mscale or s.mscale_all_dim or not s.truncate:
    raise errors.expected(f"save_gguf({path})", f"{s}", "YaRN with the default attention "
                          "factor and truncate=True (GGUF keys: factor, original context, betas)")
  gguf = _gguf()
  w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
  w.add_rope_scaling_factor(s.factor)
  w.add_rope_scaling_orig_ctx_len(s.original_max_position)
  w.add_rope_scaling_yarn_beta_fast(s.beta_fast)
  w.add_rope_scaling_yarn_beta_slow(s.beta_slow)


def _padded_vocab(v: GGUFVocab, vocab_size: int, path: str) -> GGUFVocab:
  """`v` with one token per embedding row: llama.cpp sizes token_embd / output by the token
  list and refuses a file whose tensors have more rows. Missing ids become `[PAD<id>]`, unused
  (score -1000 for SentencePiece), as llama.cpp's converter pads Qwen2's embeddings."""
  n = len(v.tokens)
  if n > vocab_size:
    raise ValueError(f"save_gguf({path}): {n} vocabulary tokens, more than the model's "
                     f"{vocab_size} embedding rows")
  if n == vocab_size:
    return v
  pad = range(n, vocab_size)
  types = list(v.token_types) if v.token_types else [1] * n   # 1: normal
  return dataclasses.replace(
      v, tokens=list(v.tokens) + [f"[PAD{i}]" for i in pad],
      token_types=types + [5] * len(pad),                       # 5: unused
      scores=None if v.scores is None else list(v.scores) + [-1000.0] * len(pad))


def _add_vocab(w, v: GGUFVocab) -> None:
  w.add_tokenizer_model(v.model)
  if v.pre is not None:
    w.add_tokenizer_pre(v.pre)
  w.add_token_list(v.tokens)
  w.add_token_types(v.token_types)
  if v.scores is not None:
    w.add_token_scores(v.scores)
  if v.merges is not None:
    w.add_token_merges(v.merges)
  for key, value in (("bos_token_id", v.bos_id), ("eos_token_id", v.eos_id),
                     ("unknown_token_id", v.unk_id), ("eot_token_id", v.eot_id)):
    if value is not None:
      w.add_uint32(f"tokenizer.ggml.{key}", int(value))
  for key, value in (("add_bos_token", v.add_bos), ("add_eos_token", v.add_eos),
                     ("add_space_prefix", v.add_space_prefix)):
    if value is not None:
      w.add_bool(f"tokenizer.ggml.{key}", bool(value))
  if v.chat_template is not None:
    w.add_chat_template(v.chat_template)
