"""GGUF checkpoints (llama.cpp's format) of Llama- and Qwen2-architecture models: read and
write.

Read with ggml's own `gguf` package (GGUFReader); everything else follows llama.cpp:
  arch       `general.architecture` "llama" (Llama 1/2/3, SmolLM, TinyLlama and Mistral,
             which llama.cpp's converter writes as llama) or "qwen2" (Qwen2 / Qwen2.5:
             attn_q / attn_k / attn_v biases); any other is refused naming it.
  config     from the `<arch>.*` metadata (sizes, rope.freq_base, rms epsilon as stored);
             a `rope_freqs.weight` tensor (Llama 3.1 / 3.2 RoPE scaling) is matched to the
             llama3 rule; MoE, other RoPE scaling types and partial rotary are refused.
             `<arch>.attention.sliding_window` is read as a window in every layer; llama.cpp's
             converter does not write it for Mistral (a Mistral GGUF then loads with full
             attention, which is what llama.cpp runs it with: equal to transformers' Mistral
             only up to sliding_window tokens) and llama.cpp ignores it for these
             architectures when `save_gguf` writes it.
  weights    dequantized by `gguf.quants.dequantize` from F32, F16, BF16, Q8_0, Q4_0, Q4_1,
             Q4_K, Q5_K and Q6_K, then laid out as the flat contract of `llm.weights`. llama.cpp's
             converter permutes the rows of attn_q / attn_k of "llama" files from transformers'
             half-split RoPE layout to Meta's interleaved one (its `permute`); loading permutes
             them back. "qwen2" files keep the half-split layout (llama.cpp's NEOX RoPE).
  tokenizer  the embedded vocabulary through the `tokenizers` library: `gpt2` (byte-level BPE
             from tokens + merges, pre-tokenized as `tokenizer.ggml.pre` says) and `llama`
             (SentencePiece BPE from tokens + scores, merges ranked by score, byte fallback);
             BOS / EOS and whether they are added as the file says (llama.cpp's defaults when
             it is silent); `tokenizer.chat_template`.
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
import warnings
from typing import Any

import numpy as np

from core import errors
from llm.config import LlamaConfig, RopeScaling

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
              "attention.sliding_window"}
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


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


@dataclasses.dataclass
class GGUFVocab:
  """The `tokenizer.ggml.*` metadata of a GGUF file (what `save_gguf` writes back)."""

  model: str                       # "gpt2" (byte-level BPE) | "llama" (SentencePiece)
  tokens: list[str]
  token_types: list[int]
  scores: list[float] | None = None
  merges: list[str] | None = None
  pre: str | None = None
  bos_id: int | None = None
  eos_id: int | None = None
  unk_id: int | None = None
  eot_id: int | None = None
  add_bos: bool | None = None
  add_eos: bool | None = None
  add_space_prefix: bool | None = None
  chat_template: str | None = None


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
    if scaling not in (None, "none"):
      raise ValueError(f"{path}: {arch}.rope.scaling.type={scaling!r}; only plain RoPE and "
                       "Llama 3's rope_freqs.weight factors are supported")
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
                      qkv_bias=arch == "qwen2", sliding_window=window)
    freqs = stored.get("rope_freqs.weight")
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
# Tokenizer


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


# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by `tokenizer.ggml.pre`. GPT-2's is the
# one `tokenizers`' ByteLevel pre-tokenizer applies itself.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_GPT2 = ("default", "gpt-2")
_PRE_DIGITS_GPT2 = ("smollm", "starcoder", "refact")   # each digit alone, then GPT-2's regex
_PRE_LLAMA3 = ("llama-bpe", "llama3", "llama-v3")
SUPPORTED_PRE = _PRE_GPT2 + _PRE_DIGITS_GPT2 + _PRE_LLAMA3


def _bpe_tokenizer(v: GGUFVocab, where: str):
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  pre = v.pre
  if pre is None:
    warnings.warn(f"{where}: no tokenizer.ggml.pre; using GPT-2's pre-tokenizer as llama.cpp "
                  "does (it warns that generation quality may suffer)")
    pre = "default"
  if pre not in SUPPORTED_PRE:
    raise ValueError(f"{where}: tokenizer.ggml.pre={pre!r}; supported pre-tokenizers: "
                     f"{', '.join(SUPPORTED_PRE)}")
  if not v.merges:
    raise ValueError(f"{where}: a gpt2 (BPE) vocabulary without tokenizer.ggml.merges")
  merges = []
  for m in v.merges:
    cut = m.find(" ", 1)   # llama.cpp splits at the first space after the first character
    if cut < 0:
      raise ValueError(f"{where}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
    merges.append((m[:cut], m[cut + 1:]))
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(v.tokens)}, merges=merges,
                             fuse_unk=False, byte_fallback=False,
                             ignore_merges=pre in _PRE_LLAMA3))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _PRE_LLAMA3)
  if pre in _PRE_GPT2:
    tok.pre_tokenizer = byte_level
  elif pre in _PRE_DIGITS_GPT2:
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 byte_level])
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"), byte_level])
  tok.decoder = decoders.ByteLevel()
  return tok, pre


def _spm_tokenizer(v: GGUFVocab, where: str):
  """SentencePiece BPE as transformers' LlamaConverter builds it: merges of normal pieces
  ranked by the merged piece's score, byte fallback, "▁" for spaces and a leading one."""
  from tokenizers import Tokenizer, decoders, models, normalizers
  if v.scores is None or len(v.scores) != len(v.tokens):
    raise ValueError(f"{where}: a llama (SentencePiece) vocabulary needs one score per token "
                     f"(tokenizer.ggml.scores has {0 if v.scores is None else len(v.scores)}, "
                     f"tokens {len(v.tokens)})")
  types = v.token_types or [_NORMAL] * len(v.tokens)
  ids = {}
  for i, t in enumerate(v.tokens):
    ids.setdefault(t, i)
  normal = {t: i for t, i in ids.items() if types[i] == _NORMAL}
  merges = []
  for piece, i in normal.items():
    for cut in range(1, len(piece)):
      a, b = piece[:cut], piece[cut:]
      if a in normal and b in normal:
        merges.append((-v.scores[i], i, a, b))
  merges = [(a, b) for *_, a, b in sorted(merges)]
  unk = v.tokens[v.unk_id] if v.unk_id is not None else None
  tok = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=True,
                             byte_fallback=True))
  steps = [normalizers.Replace(" ", "▁")]
  if v.add_space_prefix is None or v.add_space_prefix:   # llama.cpp's default for llama vocabs
    steps.insert(0, normalizers.Prepend("▁"))
  tok.normalizer = normalizers.Sequence(steps)
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  return tok


def vocab_tokenizer(v: GGUFVocab | None, where: str, vocab_size: int | None = None):
  """`llm.tokenizer.HFTokenizer` for a GGUF vocabulary (None: the file has none)."""
  from tokenizers import AddedToken

  from llm.tokenizer import HFTokenizer
  if v is None:
    raise ValueError(f"{where}: no tokenizer.ggml.model: the file carries no vocabulary; pass "
                     "--tokenizer")
  if vocab_size is not None and len(v.tokens) > vocab_size:
    raise ValueError(f"{where}: {len(v.tokens)} tokens in tokenizer.ggml.tokens, more than the "
                     f"model's vocabulary of {vocab_size}")
  if v.token_types and len(v.token_types) != len(v.tokens):
    raise ValueError(f"{where}: {len(v.token_types)} token types for {len(v.tokens)} tokens")
  for name, i in (("unknown_token_id", v.unk_id), ("eot_token_id", v.eot_id)):
    if i is not None and not 0 <= i < len(v.tokens):
      raise ValueError(f"{where}: tokenizer.ggml.{name}={i} outside the {len(v.tokens)} tokens")
  try:
    if v.model == "gpt2":
      tok, pre = _bpe_tokenizer(v, where)
      default_bos = pre in _PRE_LLAMA3             # llama.cpp: llama3-family BPE adds BOS
    elif v.model == "llama":
      tok, default_bos = _spm_tokenizer(v, where), True
    else:
      raise ValueError(f"{where}: tokenizer.ggml.model={v.model!r}; supported: 'gpt2' "
                       "(byte-level BPE) and 'llama' (SentencePiece)")
  except ValueError:
    raise
  except Exception as e:   # the tokenizers library raises a bare Exception naming no file
    raise ValueError(f"{where}: the tokenizer.ggml.* vocabulary does not build a tokenizer "
                     f"({e})") from None
  types = v.token_types or [_NORMAL] * len(v.tokens)
  special = [AddedToken(t, special=True, normalized=False)
             for t, k in zip(v.tokens, types) if k in (_CONTROL, _UNKNOWN)]
  user = [AddedToken(t, special=False, normalized=False)
          for t, k in zip(v.tokens, types) if k == _USER_DEFINED]
  tok.add_special_tokens(special)
  tok.add_tokens(user)
  bos = v.bos_id if v.bos_id is not None else (1 if v.model == "llama" else None)
  eos = v.eos_id if v.eos_id is not None else (2 if v.model == "llama" else None)
  add_bos = default_bos if v.add_bos is None else v.add_bos
  add_eos = bool(v.add_eos)
  for name, i, on in (("bos", bos, add_bos), ("eos", eos, add_eos)):
    if i is not None and not 0 <= i < len(v.tokens):
      raise ValueError(f"{where}: tokenizer.ggml.{name}_token_id={i} outside the "
                       f"{len(v.tokens)} tokens")
    if on and i is None:
      raise ValueError(f"{where}: tokenizer.ggml.add_{name}_token is true but there is no "
                       f"tokenizer.ggml.{name}_token_id")
  stop = tuple(dict.fromkeys(i for i in (eos, v.eot_id) if i is not None))
  return HFTokenizer.from_tokenizers(tok, where, bos_id=bos, eos_id=eos, stop_ids=stop,
                                     add_bos=add_bos, add_eos=add_eos,
                                     chat_template=v.chat_template)


def vocab_from_llama2c(tok) -> GGUFVocab:
  """A llama2.c tokenizer.bin vocabulary as GGUF `llama` (SentencePiece) metadata."""
  tokens, types = [], []
  for i, p in enumerate(tok.pieces):
    if i in tok.byte_of:
      tokens.append(p.decode("ascii"))
      types.append(_BYTE)
    elif i in (tok.bos_id, tok.eos_id):
      tokens.append("<s>" if i == tok.bos_id else "</s>")
      types.append(_CONTROL)
    elif p == b"<unk>":
      tokens.append("<unk>")
      types.append(_UNKNOWN)
    else:
      tokens.append(p.decode("utf-8", errors="replace").replace(" ", "▁"))
      types.append(_NORMAL)
  unk = next((i for i, k in enumerate(types) if k == _UNKNOWN), None)
  return GGUFVocab(model="llama", tokens=tokens, token_types=types, scores=list(tok.scores),
                   bos_id=tok.bos_id, eos_id=tok.eos_id, unk_id=unk, add_bos=True,
                   add_eos=False, add_space_prefix=True)


# ---------------------------------------------------------------------------------------------
# Writing


def save_gguf(path: str, cfg: LlamaConfig, weights: dict[str, np.ndarray], qtype: str = "F16",
              vocab: GGUFVocab | None = None, name: str = "llama") -> str:
  """Writes `cfg` / `weights` as a GGUF file llama.cpp loads, of general.architecture
  "qwen2" for a Qwen2 config (q / k / v biases; `llm.config.family`), else "llama" (a
  Mistral too, as llama.cpp's converter writes it): matrices in `qtype` (F32, F16 or Q8_0;
  a Q8_0 matrix whose rows are not whole 32-blocks is stored F16, as llama.cpp's converter
  does), norms and biases in F32, "llama" q / k rows permuted to llama.cpp's interleaved
  RoPE layout, Llama 3 RoPE scaling as rope_freqs.weight, a sliding window as
  `<arch>.attention.sliding_window` (read back here; llama.cpp ignores it for these
  architectures and runs full attention). `vocab` (GGUFCheckpoint.vocab,
  `vocab_from_llama2c`) is written as tokenizer.ggml.*; llama.cpp needs one to run the file."""
  gguf = _gguf()
  from llm.config import family
  from llm.weights import _from_contract, _hf_names, check_weights, half_to_interleaved
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
  w.add_vocab_size(cfg.vocab_size)
  w.add_file_type(int(file_type))
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  if vocab is not None:
    _add_vocab(w, vocab)
  if cfg.rope_scaling is not None:
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
      w.add_tensor(to_gguf[contract], a.astype(np.float16))
    else:
      q = gguf.quants.quantize(a, T.Q8_0)
      w.add_tensor(to_gguf[contract], q, raw_shape=q.shape, raw_dtype=T.Q8_0)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


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
