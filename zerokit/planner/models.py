"""Model specs: a parameter count, or a decoder-only transformer's shapes from which parameters,
the stage-3 gather unit and activations are derived; named presets; a local config.json reader.

Parameter counts are exact for the presets: e.g. Llama-2-7B comes to 6,738,415,616, the figure the
Hugging Face checkpoint reports, and GPT-2 small to 124,439,808 (tied embeddings counted once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from zerokit.planner.spec import Trainable
from zerokit._support.jsonfile import read_json


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """A decoder-only transformer block stack (GPT-2 and Llama families)."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    head_dim: int = 0
    """0 means hidden // n_heads."""
    max_positions: int = 0
    """Learned position embeddings (GPT-2); 0 for rotary models."""
    tied_embeddings: bool = False
    gated_mlp: bool = True
    """SwiGLU (gate, up, down) as in Llama; False is GPT-2's fc -> GELU -> proj."""
    layernorm: bool = False
    """LayerNorm (weight and bias) instead of RMSNorm (weight only)."""
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    dropout: bool = False
    """Dropout layers present in training (each stores a 1-byte mask, Korthikanti et al. 2022)."""

    def __post_init__(self) -> None:
        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"architecture {name}={value!r} must be a positive integer")
        if self.head_dim == 0 and self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.n_heads}; give head_dim")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"heads={self.n_heads} is not a multiple of kv_heads={self.n_kv_heads}")
        if self.head_dim < 0 or self.max_positions < 0:
            raise ValueError("head_dim and max_positions must be >= 0")

    @property
    def q_dim(self) -> int:
        return self.n_heads * (self.head_dim or self.hidden // self.n_heads)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * (self.head_dim or self.hidden // self.n_heads)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of every linear layer of one block, by LoRA target name."""
        h, f = self.hidden, self.ffn
        shapes = {"q": (h, self.q_dim), "k": (h, self.kv_dim), "v": (h, self.kv_dim), "o": (self.q_dim, h),
                  "up": (h, f), "down": (f, h)}
        if self.gated_mlp:
            shapes["gate"] = (h, f)
        return shapes

    def norm_params(self) -> int:
        return (2 if self.layernorm else 1) * self.hidden

    def block_param_sizes(self) -> list[int]:
        """Elements of each parameter tensor of one block: weights, biases, norms."""
        sizes = [d_in * d_out for d_in, d_out in self.projections().values()]
        if self.qkv_bias:
            sizes += [self.q_dim, self.kv_dim, self.kv_dim]
        if self.out_bias:
            sizes.append(self.hidden)
        if self.mlp_bias:
            sizes += [self.ffn] * (2 if self.gated_mlp else 1) + [self.hidden]
        return sizes + [self.hidden] * (4 if self.layernorm else 2)

    def small_block_params(self, threshold: int) -> int:
        """Parameters of one block in tensors under `threshold` elements, which stage 3 gives to the root
        unit (stage3_param_persistence_threshold, per parameter, as the engine does)."""
        return sum(size for size in self.block_param_sizes() if size < threshold)

    def block_params(self) -> int:
        weights = sum(d_in * d_out for d_in, d_out in self.projections().values())
        biases = (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0) + (self.hidden if self.out_bias else 0)
        if self.mlp_bias:
            biases += (2 if self.gated_mlp else 1) * self.ffn + self.hidden
        return weights + biases + 2 * self.norm_params()

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.max_positions * self.hidden

    def head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def total_params(self) -> int:
        return (self.embedding_params() + self.n_layers * self.block_params() + self.norm_params()
                + self.head_params())

    def root_params(self) -> int:
        """Everything outside the repeated blocks: embeddings, final norm, head. Stage 3 keeps this
        root unit gathered for the whole step (zerokit/stages/units.py; torchtitan does the same)."""
        return self.total_params() - self.n_layers * self.block_params()

    def matmul_params(self) -> int:
        """Parameters that multiply every token (all but the embedding lookup; the output
        projection counts even when it is tied to the embedding)."""
        return self.n_layers * self.block_params() + self.vocab * self.hidden


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    total_params: int
    source: str
    architecture: Architecture | None = None
    """None for a bare parameter count: no activations, no stage-3 units."""
    context: int = 0
    """Longest sequence the model was trained for (0 = not known)."""

    def __post_init__(self) -> None:
        if isinstance(self.total_params, bool) or not isinstance(self.total_params, int) or self.total_params < 1:
            raise ValueError(f"parameter count {self.total_params!r} must be a positive integer")


def from_architecture(arch: Architecture, name: str = "custom", source: str = "given shapes",
                      context: int = 0) -> ModelSpec:
    return ModelSpec(name=name, total_params=arch.total_params(), source=source, architecture=arch,
                     context=context)


def from_param_count(params: float) -> ModelSpec:
    if (isinstance(params, bool) or not isinstance(params, (int, float)) or not math.isfinite(params) or params < 1
            or params != int(params)):
        raise ValueError(f"parameter count {params!r} must be a positive whole number (e.g. 13e9)")
    return ModelSpec(name=f"{_short(int(params))} parameters", total_params=int(params),
                     source="parameter count given; no shapes, so activations are not modelled")


def _short(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


# --- presets ------------------------------------------------------------------------------------

def _gpt2(layers: int, hidden: int, heads: int) -> Architecture:
    return Architecture(n_layers=layers, hidden=hidden, n_heads=heads, n_kv_heads=heads, ffn=4 * hidden,
                        vocab=50257, max_positions=1024, tied_embeddings=True, gated_mlp=False,
                        layernorm=True, qkv_bias=True, out_bias=True, mlp_bias=True, dropout=True)


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> Architecture:
    return Architecture(n_layers=layers, hidden=hidden, n_heads=heads, n_kv_heads=kv_heads, ffn=ffn, vocab=vocab)


_GPT2_SRC = ("Radford et al. 2019 (GPT-2); Hugging Face openai-community/{} config.json: n_layer={}, n_embd={}, "
             "n_head={}, vocab_size=50257, n_positions=1024, tied embeddings")
_LLAMA2_SRC = ("Touvron et al. 2023 (Llama 2), Table 1; Hugging Face meta-llama/{} config.json: "
               "num_hidden_layers={}, hidden_size={}, num_attention_heads={}, num_key_value_heads={}, "
               "intermediate_size={}, vocab_size=32000")
_LLAMA3_SRC = ("Meta Llama 3 model card; Hugging Face meta-llama/{} config.json: num_hidden_layers={}, "
               "hidden_size={}, num_attention_heads={}, num_key_value_heads={}, intermediate_size={}, "
               "vocab_size=128256")
_MISTRAL_SRC = ("Jiang et al. 2023 (Mistral 7B), Table 1: n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, "
                "hidden_dim=14336, vocab_size=32000; Hugging Face mistralai/Mistral-7B-v0.1 config.json")


def _presets() -> dict[str, ModelSpec]:
    table = {}
    for key, hf, (layers, hidden, heads) in (
            ("gpt2", "gpt2", (12, 768, 12)), ("gpt2-medium", "gpt2-medium", (24, 1024, 16)),
            ("gpt2-large", "gpt2-large", (36, 1280, 20)), ("gpt2-xl", "gpt2-xl", (48, 1600, 25))):
        table[key] = from_architecture(_gpt2(layers, hidden, heads), key,
                                       _GPT2_SRC.format(hf, layers, hidden, heads), context=1024)
    for key, hf, shape, context in (
            ("llama2-7b", "Llama-2-7b-hf", (32, 4096, 32, 32, 11008), 4096),
            ("llama2-13b", "Llama-2-13b-hf", (40, 5120, 40, 40, 13824), 4096),
            ("llama2-70b", "Llama-2-70b-hf", (80, 8192, 64, 8, 28672), 4096)):
        table[key] = from_architecture(_llama(*shape, vocab=32000), key, _LLAMA2_SRC.format(hf, *shape), context)
    for key, hf, shape in (("llama3-8b", "Meta-Llama-3-8B", (32, 4096, 32, 8, 14336)),
                           ("llama3-70b", "Meta-Llama-3-70B", (80, 8192, 64, 8, 28672))):
        table[key] = from_architecture(_llama(*shape, vocab=128256), key, _LLAMA3_SRC.format(hf, *shape), 8192)
    table["mistral-7b"] = from_architecture(_llama(32, 4096, 32, 8, 14336, 32000), "mistral-7b", _MISTRAL_SRC, 8192)
    return table


PRESETS: dict[str, ModelSpec] = _presets()


def preset(key: str) -> ModelSpec:
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {key!r}; accepted: {', '.join(PRESETS)}")
    return PRESETS[key]


# --- Hugging Face config.json (local file, no hub access) --------------------------------------

LLAMA_LIKE = ("llama", "mistral", "qwen2")
HF_MODEL_TYPES = ("gpt2",) + LLAMA_LIKE


def _require(cfg: dict, key: str, where: str) -> int:
    if key not in cfg:
        raise ValueError(f"{where}: missing key {key!r} (needed for model_type {cfg.get('model_type')!r})")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key}={value!r} must be a positive integer")
    return value


def _optional(cfg: dict, key: str, default: int, where: str) -> int:
    return default if cfg.get(key) is None else _require(cfg, key, where)


def _gpt2_from_config(cfg: dict, where: str) -> Architecture:
    hidden = _require(cfg, "n_embd", where)
    dropout = any(float(cfg.get(k, 0.1)) > 0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
    return Architecture(n_layers=_require(cfg, "n_layer", where), hidden=hidden, n_heads=_require(cfg, "n_head", where),
                        n_kv_heads=_require(cfg, "n_head", where), ffn=_optional(cfg, "n_inner", 4 * hidden, where),
                        vocab=_require(cfg, "vocab_size", where), max_positions=_require(cfg, "n_positions", where),
                        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)), gated_mlp=False, layernorm=True,
                        qkv_bias=True, out_bias=True, mlp_bias=True, dropout=dropout)


def _llama_from_config(cfg: dict, where: str) -> Architecture:
    heads = _require(cfg, "num_attention_heads", where)
    attention_bias = bool(cfg.get("attention_bias", False))
    return Architecture(n_layers=_require(cfg, "num_hidden_layers", where), hidden=_require(cfg, "hidden_size", where),
                        n_heads=heads, n_kv_heads=_optional(cfg, "num_key_value_heads", heads, where),
                        ffn=_require(cfg, "intermediate_size", where), vocab=_require(cfg, "vocab_size", where),
                        head_dim=_optional(cfg, "head_dim", 0, where),
                        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                        # Qwen2 hard-codes biases on q, k, v (not o); Llama has one attention_bias flag.
                        qkv_bias=attention_bias or cfg["model_type"] == "qwen2", out_bias=attention_bias,
                        mlp_bias=bool(cfg.get("mlp_bias", False)),
                        dropout=float(cfg.get("attention_dropout", 0.0) or 0.0) > 0)


def from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face `config.json` from disk (never from the Hub)."""
    path = Path(path)
    cfg = read_json(path, "config file")
    return from_hf_dict(cfg, f"config file {str(path)!r}", path.parent.name, str(path))


def from_hf_dict(cfg: object, where: str = "config", folder: str = "", source: str = "") -> ModelSpec:
    """The same from a config already read (a run record carries its model's config)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} must hold a JSON object")
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; accepted: {', '.join(HF_MODEL_TYPES)}")
    arch = _gpt2_from_config(cfg, where) if model_type == "gpt2" else _llama_from_config(cfg, where)
    context = cfg.get("n_positions") or cfg.get("max_position_embeddings") or 0
    name = cfg.get("_name_or_path") or folder or model_type
    return from_architecture(arch, str(name), f"{source or where} (model_type={model_type})",
                             context if isinstance(context, int) else 0)


def resolve_model(model: ModelSpec | Architecture | str | int | float) -> ModelSpec:
    """A preset name, a path to config.json, a parameter count, shapes or a ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Architecture):
        return from_architecture(model)
    if isinstance(model, str):
        if model in PRESETS:
            return PRESETS[model]
        if model.endswith(".json") or Path(model).is_file():
            return from_hf_config(model)
        raise ValueError(f"unknown model preset {model!r}; accepted: {', '.join(PRESETS)}, or a config.json path")
    return from_param_count(model)


# --- trainable parameters -----------------------------------------------------------------------

@dataclass(frozen=True)
class ParamCounts:
    total: int
    """Every parameter the model holds (base + adapters)."""
    trainable: int
    """Parameters with gradients and optimizer state."""

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


def lora_params(arch: Architecture, trainable: Trainable) -> int:
    """LoRA adds A (r x d_in) and B (d_out x r) to each targeted projection of every block
    (Hu et al. 2021, LoRA, Section 4.1)."""
    shapes = arch.projections()
    missing = [t for t in trainable.lora_targets if t not in shapes]
    if missing:
        raise ValueError(f"lora target(s) {', '.join(missing)} do not exist in this architecture; "
                         f"accepted: {', '.join(shapes)}")
    per_block = sum(trainable.lora_rank * (shapes[t][0] + shapes[t][1]) for t in trainable.lora_targets)
    return arch.n_layers * per_block


def param_counts(model: ModelSpec, trainable: Trainable) -> ParamCounts:
    if trainable.lora_rank is not None:
        if model.architecture is None:
            raise ValueError("a LoRA rank needs the model's shapes (a preset, --arch or a config.json), "
                             "not a bare parameter count; or give --trainable-fraction")
        adapters = lora_params(model.architecture, trainable)
        return ParamCounts(total=model.total_params + adapters, trainable=adapters)
    return ParamCounts(total=model.total_params, trainable=max(1, round(model.total_params * trainable.fraction)))
