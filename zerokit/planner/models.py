"""Model specs: a parameter count, or a decoder-only transformer's shapes from which parameters,
the stage-3 gather unit and activations are derived; named presets; a local config.json reader.

Parameter counts are exact for the presets: e.g. Llama-2-7B comes to 6,738,415,616, the figure the
Hugging Face checkpoint reports, and GPT-2 small to 124,439,808 (tied embeddings counted once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from zerokit.planner.spec import Trainable, _fraction, _positive_int
from zerokit._support.jsonfile import read_json


@dataclass(frozen=True, kw_only=True)
class Experts:
    """A mixture-of-experts MLP (Mixtral, Qwen-MoE, DeepSeekMoE): a router sends each token to `top_k` of `count`
    gated MLPs of width `ffn`; `shared_ffn` is the width of the MLP every token also runs (shared experts, 0 none).
    See [Note: the expert degree] in memory.py for what a rank holds."""

    count: int
    """Routed experts per MoE layer (Mixtral num_local_experts, Qwen num_experts, DeepSeek n_routed_experts)."""
    top_k: int
    """Experts each token is routed to (num_experts_per_tok)."""
    ffn: int
    """Each routed expert's intermediate width (Mixtral intermediate_size, Qwen/DeepSeek moe_intermediate_size)."""
    shared_ffn: int = 0
    """Total intermediate width of the shared experts (Qwen2 shared_expert_intermediate_size; DeepSeek
    n_shared_experts x moe_intermediate_size); replicated like dense parameters, run by every token."""
    shared_gate: bool = False
    """Qwen2-MoE's sigmoid gate (hidden x 1) on the shared expert's output."""
    capacity: float = 1.0
    """Capacity factor: routed slots per token and expert choice; 1.0 is dropless, exactly the routed tokens."""
    dense_layers: int = 0
    """Layers whose MLP is dense, of the model's `ffn` (DeepSeek first_k_dense_replace, Qwen mlp_only_layers)."""

    def __post_init__(self) -> None:
        for name in ("count", "top_k", "ffn"):
            _positive_int(f"experts {name}", getattr(self, name))
        if self.top_k > self.count:
            raise ValueError(f"top-k={self.top_k} is above the {self.count} experts; route to at most {self.count}")
        for name in ("shared_ffn", "dense_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"experts {name}={value!r} must be an integer >= 0")
        _fraction("capacity factor", self.capacity, low=1.0, high=float(self.count), closed_high=True)


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
    qk_norm: bool = False
    """RMSNorm on each head's query and key (Qwen3): 2 x head_dim weights per block."""
    experts: Experts | None = None
    """A mixture of experts in place of the MLP (of all but `experts.dense_layers` leading blocks); None: dense."""

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
        if self.experts is not None and self.experts.dense_layers >= self.n_layers:
            raise ValueError(f"{self.experts.dense_layers} dense layers leave none of the {self.n_layers} for experts")

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

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.n_heads

    def attention_sizes(self) -> list[int]:
        """Elements of each tensor of one block outside its MLP: q, k, v, o and their biases, the norms."""
        sizes = [d_in * d_out for key, (d_in, d_out) in self.projections().items() if key in ("q", "k", "v", "o")]
        if self.qkv_bias:
            sizes += [self.q_dim, self.kv_dim, self.kv_dim]
        if self.out_bias:
            sizes.append(self.hidden)
        sizes += [self.head_size] * (2 if self.qk_norm else 0)
        return sizes + [self.hidden] * (4 if self.layernorm else 2)

    def dense_mlp_sizes(self, ffn: int) -> list[int]:
        sizes = [self.hidden * ffn] * (3 if self.gated_mlp else 2)
        return sizes + ([ffn] * (2 if self.gated_mlp else 1) + [self.hidden] if self.mlp_bias else [])

    def expert_params(self) -> int:
        """One routed expert: a gated MLP of the experts' width (no biases in Mixtral, Qwen or DeepSeek)."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.experts.ffn if self.experts else 0

    def moe_mlp_sizes(self, routed: int) -> list[int]:
        """A mixture-of-experts MLP with `routed` of its experts: the router, the experts, the shared ones."""
        x = self.experts
        sizes = [self.hidden * x.count] + [self.hidden * x.ffn] * (3 if self.gated_mlp else 2) * routed
        sizes += self.dense_mlp_sizes(x.shared_ffn) if x.shared_ffn else []
        return sizes + ([self.hidden] if x.shared_gate else [])

    @property
    def moe_layers(self) -> int:
        return self.n_layers - self.experts.dense_layers if self.experts else 0

    def block_param_sizes(self, routed: int | None = None) -> list[int]:
        """Elements of each parameter tensor of one block; with experts, an MoE block holding `routed` of them (None:
        all, as without expert parallelism)."""
        if self.experts is None:
            return self.attention_sizes() + self.dense_mlp_sizes(self.ffn)
        return self.attention_sizes() + self.moe_mlp_sizes(self.experts.count if routed is None else routed)

    def small_block_params(self, threshold: int, routed: int | None = None) -> int:
        """Parameters of one block in tensors under `threshold` elements, which stage 3 gives to the root
        unit (stage3_param_persistence_threshold, per parameter, as the engine does)."""
        return sum(size for size in self.block_param_sizes(routed) if size < threshold)

    def block_params(self, routed: int | None = None) -> int:
        """One block; with experts, one MoE block (the largest, stage 3's gather unit) with `routed` experts."""
        return sum(self.block_param_sizes(routed))

    def blocks_params(self, routed: int | None = None) -> int:
        """Every block, with `routed` experts per MoE layer (None: all of them)."""
        if self.experts is None:
            return self.n_layers * self.block_params()
        routed = self.experts.count if routed is None else routed
        dense = self.experts.dense_layers * sum(self.attention_sizes() + self.dense_mlp_sizes(self.ffn))
        return dense + self.moe_layers * sum(self.attention_sizes() + self.moe_mlp_sizes(routed))

    def routed_expert_params(self) -> int:
        """The routed experts of every MoE layer: what expert parallelism splits (shared experts stay dense)."""
        return self.moe_layers * self.experts.count * self.expert_params() if self.experts else 0

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.max_positions * self.hidden

    def head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def total_params(self) -> int:
        return self.embedding_params() + self.blocks_params() + self.norm_params() + self.head_params()

    def active_params(self) -> int:
        """The parameters one token runs through: every expert layer's top-k experts, not all of them (the figure
        model cards quote as "active")."""
        routed = self.experts.top_k if self.experts else None
        return self.embedding_params() + self.blocks_params(routed) + self.norm_params() + self.head_params()

    def root_params(self) -> int:
        """Everything outside the repeated blocks: embeddings, final norm, head. Stage 3 keeps this
        root unit gathered for the whole step (zerokit/stages/units.py; torchtitan does the same)."""
        return self.total_params() - self.blocks_params()

    def matmul_params(self) -> int:
        """Parameters that multiply every token (all but the embedding lookup; the output
        projection counts even when it is tied to the embedding); with experts, only the top-k a token is routed to."""
        return self.blocks_params(self.experts.top_k if self.experts else None) + self.vocab * self.hidden


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

_MIXTRAL_SRC = ("Jiang et al. 2024 (Mixtral of Experts): 46.7B parameters, 12.9B active; Hugging Face "
                "mistralai/Mixtral-8x7B-v0.1 config.json: num_hidden_layers=32, hidden_size=4096, "
                "num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, "
                "num_experts_per_tok=2, vocab_size=32000")
_QWEN3_MOE_SRC = ("Qwen3 technical report (Qwen3-30B-A3B: 30.5B parameters, 3.3B active); Hugging Face "
                  "Qwen/Qwen3-30B-A3B config.json: num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, "
                  "num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, "
                  "moe_intermediate_size=768, vocab_size=151936, q/k norms, untied embeddings")


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
    mixtral = replace(_llama(32, 4096, 32, 8, 14336, 32000), experts=Experts(count=8, top_k=2, ffn=14336))
    table["mixtral-8x7b"] = from_architecture(mixtral, "mixtral-8x7b", _MIXTRAL_SRC, 32768)
    qwen3 = Architecture(n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128, ffn=6144, vocab=151936,
                         qk_norm=True, experts=Experts(count=128, top_k=8, ffn=768))
    table["qwen3-30b-a3b"] = from_architecture(qwen3, "qwen3-30b-a3b", _QWEN3_MOE_SRC, 32768)
    return table


PRESETS: dict[str, ModelSpec] = _presets()


def preset(key: str) -> ModelSpec:
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {key!r}; accepted: {', '.join(PRESETS)}")
    return PRESETS[key]


# --- Hugging Face config.json (local file, no hub access) --------------------------------------

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek")
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3") + MOE_TYPES
HF_MODEL_TYPES = ("gpt2",) + LLAMA_LIKE
MLA_TYPES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention: shapes not modelled


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
                        qkv_bias=attention_bias or cfg["model_type"] in ("qwen2", "qwen2_moe"),
                        out_bias=attention_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
                        qk_norm=cfg["model_type"] in ("qwen3", "qwen3_moe"),
                        dropout=float(cfg.get("attention_dropout", 0.0) or 0.0) > 0,
                        experts=_experts_from_config(cfg, where) if cfg["model_type"] in MOE_TYPES else None)


def _experts_from_config(cfg: dict, where: str) -> Experts:
    """Mixtral's, Qwen-MoE's and DeepSeekMoE's names for the same few numbers."""
    kind = cfg["model_type"]
    count_key = {"mixtral": "num_local_experts", "deepseek": "n_routed_experts"}.get(kind, "num_experts")
    width_key = "intermediate_size" if kind == "mixtral" else "moe_intermediate_size"
    width = _require(cfg, width_key, where)
    shared = (_optional(cfg, "shared_expert_intermediate_size", 0, where) if kind == "qwen2_moe"
              else width * _optional(cfg, "n_shared_experts", 0, where) if kind == "deepseek" else 0)
    return Experts(count=_require(cfg, count_key, where), top_k=_require(cfg, "num_experts_per_tok", where),
                   ffn=width, shared_ffn=shared, shared_gate=kind == "qwen2_moe" and shared > 0,
                   dense_layers=_dense_layers(cfg, where))


def _dense_layers(cfg: dict, where: str) -> int:
    """Blocks with a dense MLP: DeepSeek's first k; Qwen's listed ones, or all but every step-th."""
    if cfg["model_type"] == "deepseek":
        return _optional(cfg, "first_k_dense_replace", 0, where)
    layers = _require(cfg, "num_hidden_layers", where)
    dense = set(cfg.get("mlp_only_layers") or [])
    step = _optional(cfg, "decoder_sparse_step", 1, where)
    return len(dense | {i for i in range(layers) if (i + 1) % step})


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
    if model_type in MLA_TYPES:
        raise ValueError(f"{where}: model_type {model_type!r} uses multi-head latent attention, whose shapes the "
                         "planner does not model; describe it with --arch or a llama-like config")
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
