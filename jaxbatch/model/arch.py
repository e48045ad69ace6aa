"""The architecture of a supported decoder-only model, read from a Hugging Face config.

One forward (model/archs/llama.py) covers every family; this record says which of its options a model
uses. Families: Llama 2/3 (incl. `llama3` rope scaling), SmolLM2 (tied embeddings), Mistral,
Qwen2 (QKV bias), Qwen3 (per-head q/k RMSNorm), Gemma 2 and Gemma 3 text (sandwich norms,
(1 + w) RMSNorm, GeGLU, scaled embeddings, soft-capping, interleaved sliding/global layers, a
local rope base), Phi-3 (fused qkv / gate_up, split at load), Mixtral, Qwen2-MoE and Qwen3-MoE
(routed experts, model/archs/moe.py), gpt-oss (attention sinks, q/k/v/o biases, alternating sliding
and full layers, YaRN rope, biased router and experts with a clamped SwiGLU; model/archs/gpt_oss.py).
The hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet layers between gated
full-attention ones) run their own forward (model/archs/qwen35.py); their options are read by
model/arch_hybrid.py.
Frozen, hashable: it is a static argument of the jitted step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxbatch.model import arch_hybrid
from jaxbatch.model.arch_hybrid import HYBRID_TYPES, UnsupportedArchitectureError
from jaxbatch.model.archs import rope as rope_freqs

# HF `architectures` class -> the model_type its config carries. Loading refuses anything else,
# naming it (see `check_supported`).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # its text model only (model/arch_hybrid.py)
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    # the base model alone, without its LM head: embedding checkpoints (transformers' AutoModel,
    # sentence-transformers), served for /v1/embeddings (model/hf.py `base_model_tensors`)
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}
SUPPORTED_MODEL_TYPES = tuple(dict.fromkeys(SUPPORTED_ARCHITECTURES.values()))
GEMMA_TYPES = ("gemma2", "gemma3_text")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
# HF activation name -> what the MLP applies (llama.py ACTIVATIONS)
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# A sliding window wider than this is no window (a global layer fed as data; see llama.forward)
NO_WINDOW = 1 << 30


def check_supported(cfg: Any) -> str:
    """The config's model_type, or UnsupportedArchitectureError naming what is not supported."""
    names = list(getattr(cfg, "architectures", None) or [])
    bad = [a for a in names if a not in SUPPORTED_ARCHITECTURES]
    if bad:
        raise UnsupportedArchitectureError(
            f"architecture {', '.join(bad)} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    model_type = getattr(cfg, "model_type", "llama")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedArchitectureError(
            f"{model_type} with use_bidirectional_attention (an encoder) is not supported")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    return model_type


@dataclasses.dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q, k and v projections carry biases
    # rope scaling as a sorted tuple of (key, value) so the dataclass stays hashable
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    sliding_window: int | None = None  # None: no layer's window can cut a sequence
    # which layers are sliding-attention layers, when sliding and global layers mix (length
    # num_layers; they take `sliding_window` and the local rope); () = all layers alike
    sliding_layers: tuple[bool, ...] = ()
    # the rope of sliding layers when it differs from the global one (Gemma 3's local base)
    local_rope_theta: float | None = None
    local_rope_scaling: tuple[tuple[str, Any], ...] = ()
    qk_norm: bool = False  # RMSNorm over each head's q and k before rope (Qwen3, Gemma 3)
    gemma_norms: bool = False  # RMSNorm as x * (1 + w) in f32; post-attn and pre/post-MLP norms
    scale_embeddings: bool = False  # embeddings times sqrt(hidden), in the compute dtype
    hidden_act: str = "silu"
    attn_soft_cap: float | None = None  # cap * tanh(scores / cap) before the softmax
    final_soft_cap: float | None = None  # the same on the logits
    query_pre_attn_scalar: float | None = None  # softmax scale scalar**-0.5 instead of D**-0.5
    # routed experts (0: a dense MLP); see model/archs/moe.py
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert
    # gpt-oss (model/archs/gpt_oss.py)
    o_bias: bool = False  # the output projection carries a bias
    attention_sinks: bool = False  # a learned logit per head in each softmax denominator
    router_bias: bool = False  # router logits = h @ router + bias
    expert_bias: bool = False  # each expert's gate, up and down projections carry biases
    softmax_topk: bool = False  # routing: top-k of the logits, softmax over those k only
    swiglu_limit: float | None = None  # the experts' clamped SwiGLU (None: `hidden_act` GLU)
    swiglu_alpha: float = 1.702
    # hybrid models (model/archs/qwen35.py): each layer's kind, LINEAR (Gated DeltaNet) or FULL
    # (gated full attention); () = every layer is the Llama-style attention layer
    layer_kinds: tuple[str, ...] = ()
    linear_num_key_heads: int = 0  # the DeltaNet's q/k heads (each serves several value heads)
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0  # the causal depthwise convolution's width
    # value heads in the order llama.cpp's converter writes Qwen3.5's (position j * Hk + g reads
    # key head g, "tiled") rather than HF's (head g * r + j, "grouped"): GGUF files run in their
    # own order, so no tensor's blocks are reordered at load
    linear_v_tiled: bool = False
    partial_rotary_factor: float = 1.0  # rope turns the first head_dim * factor dims of q and k
    attn_output_gate: bool = False  # q_proj also gives a per-head gate: o * sigmoid(gate)
    norm_plus_one: bool = False  # RMSNorm as x * (1 + w) in f32, without Gemma's extra norms

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of {self.num_kv_heads}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for "
                             f"{self.num_layers} layers")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedArchitectureError(
                f"activation {self.hidden_act!r} is not supported ({SUPPORTED_ACTIVATIONS})")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} with "
                             f"{self.num_experts} experts")
        if self.layer_kinds:
            arch_hybrid.check(self)

    @property
    def is_hybrid(self) -> bool:
        """Gated DeltaNet layers among the attention ones: model/archs/qwen35.py runs it."""
        return bool(self.layer_kinds)

    @property
    def plus_one_norms(self) -> bool:
        """RMSNorm scales by (1 + w) in float32 (Gemma, Qwen3.5 / Qwen3-Next)."""
        return self.gemma_norms or self.norm_plus_one

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head rope turns (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def leaf_layers(self, leaf: str) -> tuple[int, ...]:
        """The layers a params["layers"] leaf stacks, in order: every layer, or in a hybrid model
        only the layers of its kind (a DeltaNet leaf over the DeltaNet layers, an attention leaf
        over the full-attention ones)."""
        if self.layer_kinds:
            return arch_hybrid.leaf_layers(self, leaf)
        return tuple(range(self.num_layers))

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    def rope_attention_factor(self, local: bool = False) -> float:
        """What HF multiplies into the cos/sin tables (YaRN's mscale; 1 otherwise)."""
        local = local and self.local_rope_theta is not None
        scaling = self.local_rope_scaling if local else self.rope_scaling
        return rope_freqs.attention_factor(dict(scaling), self.max_position_embeddings)

    @property
    def sm_scale(self) -> float:
        """The softmax scale: query_pre_attn_scalar**-0.5 (Gemma) or 1/sqrt(head_dim)."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def mixed_windows(self) -> bool:
        """Some layers slide and some are global: the window is per-layer data in the scan."""
        return self.sliding_window is not None and bool(self.sliding_layers)

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's window (NO_WINDOW for a global layer)."""
        if self.sliding_window is None:
            return (NO_WINDOW,) * self.num_layers
        slides = self.sliding_layers or (True,) * self.num_layers
        return tuple(self.sliding_window if s else NO_WINDOW for s in slides)

    @property
    def two_ropes(self) -> bool:
        """Sliding layers rotate with their own rope (Gemma 3): a table per kind in the scan."""
        return self.local_rope_theta is not None and bool(self.sliding_layers)

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelArch:
        model_type = check_supported(cfg)
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        cfg, model_type = arch_hybrid.text_config(cfg, model_type)
        theta, rope, local = _rope_settings(cfg, model_type)
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        num_layers = cfg.num_hidden_layers
        window, sliding_layers, all_slide = _sliding(cfg, model_type, num_layers)
        if local is not None and not sliding_layers:  # one kind of layer: one rope
            theta, rope = local if all_slide else (theta, rope)
            local = None
        bias = bool(getattr(cfg, "attention_bias", False)) or model_type == "qwen2" or (
            model_type == "qwen2_moe" and bool(getattr(cfg, "qkv_bias", True)))
        gemma = model_type in GEMMA_TYPES
        act = getattr(cfg, "hidden_activation", None) if gemma else None
        act = act or getattr(cfg, "hidden_act", None) or "silu"
        return cls(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=int(getattr(cfg, "intermediate_size", 0) or 0),  # none: MoE only
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=theta,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=tied,
            attention_bias=bias,
            rope_scaling=rope,
            sliding_window=window,
            sliding_layers=sliding_layers,
            local_rope_theta=None if local is None else local[0],
            local_rope_scaling=() if local is None else local[1],
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", *HYBRID_TYPES),
            gemma_norms=gemma,
            scale_embeddings=gemma,
            hidden_act=act,
            # HF's Gemma 3 attention takes no soft cap whatever its config says
            attn_soft_cap=getattr(cfg, "attn_logit_softcapping", None)
            if model_type == "gemma2" else None,
            final_soft_cap=getattr(cfg, "final_logit_softcapping", None) if gemma else None,
            query_pre_attn_scalar=getattr(cfg, "query_pre_attn_scalar", None) if gemma else None,
            # gpt-oss: attention_bias covers the output projection too; sinks in every layer
            o_bias=model_type == "gpt_oss" and bias,
            attention_sinks=model_type == "gpt_oss",
            **_moe_settings(cfg, model_type, num_layers),
            **arch_hybrid.settings(cfg, model_type, num_layers),
        )

    def inv_freq(self, local: bool = False):
        """Rotary inverse frequencies [head_dim/2], float32 numpy (scaling applied, each step in
        float32 as transformers takes it: model/archs/rope.py); `local`: those of the sliding layers
        when they have their own rope (`two_ropes`)."""
        theta, scaling = self.rope_theta, self.rope_scaling
        if local and self.local_rope_theta is not None:
            theta, scaling = self.local_rope_theta, self.local_rope_scaling
        return rope_freqs.inv_freq(theta, self.rotary_dim, dict(scaling),
                                   self.max_position_embeddings)

    def param_shapes(self) -> dict[str, Any]:
        """The params pytree's expected shapes; loaders check every tensor against it."""
        if self.layer_kinds:
            return arch_hybrid.param_shapes(self)
        L, H, I = self.num_layers, self.hidden_size, self.intermediate_size
        D = self.head_dim
        qd, kvd = self.num_heads * D, self.num_kv_heads * D
        layers: dict[str, tuple[int, ...]] = {
            "attn_norm": (L, H),
            "wq": (L, H, qd),
            "wk": (L, H, kvd),
            "wv": (L, H, kvd),
            "wo": (L, qd, H),
            "mlp_norm": (L, H),
        }
        if self.attention_bias:
            layers.update(bq=(L, qd), bk=(L, kvd), bv=(L, kvd))
        if self.o_bias:
            layers.update(bo=(L, H))
        if self.attention_sinks:
            layers.update(sinks=(L, self.num_heads))
        if self.qk_norm:
            layers.update(q_norm=(L, D), k_norm=(L, D))
        if self.gemma_norms:
            layers.update(post_attn_norm=(L, H), post_mlp_norm=(L, H))
        if self.num_experts:
            E, Ie = self.num_experts, self.moe_intermediate_size
            layers.update(router=(L, H, E), experts_gate=(L, E, H, Ie),
                          experts_up=(L, E, H, Ie), experts_down=(L, E, Ie, H))
            if self.router_bias:
                layers.update(router_bias=(L, E))
            if self.expert_bias:
                layers.update(experts_gate_bias=(L, E, Ie), experts_up_bias=(L, E, Ie),
                              experts_down_bias=(L, E, H))
            I = self.shared_expert_intermediate_size
            if I:
                layers.update(shared_gate=(L, H, 1))
        if I:  # the dense MLP, or the MoE's shared expert
            layers.update(w_gate=(L, H, I), w_up=(L, H, I), w_down=(L, I, H))
        shapes: dict[str, Any] = {
            "embed": (self.vocab_size, H),
            "layers": layers,
            "final_norm": (H,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (H, self.vocab_size)
        return shapes


def _one_rope(rope: dict[str, Any], cfg: Any, model_type: str = ""
              ) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(theta, hashable scaling) of one rope parameter dict; refuses what the forward lacks
    (a partial rotary factor outside the hybrid families, which read it themselves)."""
    rope = dict(rope)
    theta = rope.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    if rope["rope_type"] not in rope_freqs.SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(f"rope_type {rope['rope_type']!r} is not supported")
    partial = rope.pop("partial_rotary_factor", None)
    if partial is None:
        partial = getattr(cfg, "partial_rotary_factor", 1.0)
    if float(partial) != 1.0 and model_type not in HYBRID_TYPES:
        raise UnsupportedArchitectureError(f"partial_rotary_factor {partial} is not supported")
    return float(theta), tuple(sorted((k, v) for k, v in rope.items() if _hashable(v)))


def _rope_settings(cfg: Any, model_type: str = ""):
    """-> (theta, scaling, local (theta, scaling) or None). transformers >= 5 keeps rope settings
    in `rope_parameters`, per layer type for Gemma 3; 4.x in rope_theta / rope_scaling."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if "full_attention" in params or "sliding_attention" in params:
        theta, scaling = _one_rope(params.get("full_attention") or {}, cfg)
        local = _one_rope(params.get("sliding_attention") or {}, cfg)
        return theta, scaling, (None if local == (theta, scaling) else local)
    legacy = getattr(cfg, "rope_scaling", None) or {}
    theta, scaling = _one_rope({**legacy, **params}, cfg, model_type)
    return theta, scaling, None


def _sliding(cfg: Any, model_type: str,
             num_layers: int) -> tuple[int | None, tuple[bool, ...], bool]:
    """(window, which layers are sliding ones when kinds mix (else ()), whether all are).
    Layer kinds come from `layer_types` when the config has them, else every layer slides when
    there is a window (Mistral, Phi-3, Mixtral). A window no sequence can exceed is None."""
    window = getattr(cfg, "sliding_window", None)
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", *HYBRID_TYPES) and \
            not getattr(cfg, "use_sliding_window", False):
        window = None
    if not window or window <= 0 or window >= cfg.max_position_embeddings:
        window = None
    types = getattr(cfg, "layer_types", None)
    if types is None or model_type in HYBRID_TYPES:  # their kinds: arch_hybrid.settings
        return (None if window is None else int(window)), (), window is not None
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedArchitectureError(f"layer types {unknown} are not supported")
    slides = tuple(t == "sliding_attention" for t in types)
    if len(slides) != num_layers:
        raise ValueError(f"layer_types has {len(slides)} entries for {num_layers} layers")
    if not any(slides):
        window = None
    kinds = slides if any(slides) and not all(slides) else ()
    return (None if window is None else int(window)), kinds, all(slides)


def _moe_settings(cfg: Any, model_type: str, num_layers: int) -> dict[str, Any]:
    if model_type in HYBRID_TYPES:
        return arch_hybrid.moe_settings(cfg, model_type, num_layers)
    if model_type not in MOE_TYPES:
        return {}
    if model_type == "gpt_oss":  # the experts' width is the config's intermediate_size
        return {"num_experts": cfg.num_local_experts, "num_experts_per_tok":
                cfg.num_experts_per_tok, "moe_intermediate_size": cfg.intermediate_size,
                "router_bias": True, "expert_bias": True, "softmax_topk": True,
                "swiglu_limit": float(cfg.swiglu_limit), "swiglu_alpha": float(cfg.swiglu_alpha)}
    if model_type == "mixtral":  # Mixtral always renormalises its top-k weights
        return {"num_experts": cfg.num_local_experts, "num_experts_per_tok":
                cfg.num_experts_per_tok, "moe_intermediate_size": cfg.intermediate_size,
                "norm_topk_prob": True}
    dense = list(getattr(cfg, "mlp_only_layers", None) or [])
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    dense += [i for i in range(num_layers) if (i + 1) % step]
    if dense:
        raise UnsupportedArchitectureError(
            f"{model_type} with dense MLP layers {sorted(set(dense))} among the expert layers "
            "is not supported (mlp_only_layers / decoder_sparse_step): every layer must be MoE")
    return {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": bool(getattr(cfg, "norm_topk_prob", False)),
            "shared_expert_intermediate_size":
                int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
                if model_type == "qwen2_moe" else 0}


def _hashable(v: Any) -> bool:
    try:
        hash(v)
        return True
    except TypeError:
        return False
