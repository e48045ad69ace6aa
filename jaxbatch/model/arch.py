"""The architecture of a Llama-family model, read from a Hugging Face config.

Covers Llama 2/3 (incl. `llama3` rope scaling), SmolLM2 (tied embeddings), Mistral and Qwen2
(QKV bias). Frozen, hashable: it is a static argument of the jitted step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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
    attention_bias: bool
    # rope scaling as a sorted tuple of (key, value) so the dataclass stays hashable
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of {self.num_kv_heads}")

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelArch:
        model_type = getattr(cfg, "model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
            )
        # transformers >= 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta/rope_scaling
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        legacy = getattr(cfg, "rope_scaling", None) or {}
        rope = {**legacy, **rope}
        theta = rope.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        if rope["rope_type"] not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported")
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        sliding = getattr(cfg, "sliding_window", None)
        if model_type == "qwen2" and not getattr(cfg, "use_sliding_window", False):
            sliding = None
        if model_type == "mistral" and sliding is not None and sliding >= cfg.max_position_embeddings:
            sliding = None
        bias = bool(getattr(cfg, "attention_bias", False)) or model_type == "qwen2"
        return cls(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=bias,
            rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if _hashable(v))),
            sliding_window=sliding,
        )

    def inv_freq(self):
        """Rotary inverse frequencies [head_dim/2] as float64 numpy (scaling applied)."""
        import numpy as np

        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        rs = dict(self.rope_scaling)
        if self.rope_type == "linear":
            inv = inv / float(rs["factor"])
        elif self.rope_type == "llama3":
            factor = float(rs["factor"])
            low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
            old_ctx = float(rs["original_max_position_embeddings"])
            low_wl, high_wl = old_ctx / low, old_ctx / high
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wl, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            mid = (1 - smooth) * scaled / factor + smooth * scaled
            is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
            inv = np.where(is_mid, mid, scaled)
        return inv

    def param_shapes(self) -> dict[str, Any]:
        """The params pytree's expected shapes; loaders check every tensor against it."""
        L, H, I = self.num_layers, self.hidden_size, self.intermediate_size
        qd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layers = {
            "attn_norm": (L, H),
            "wq": (L, H, qd),
            "wk": (L, H, kvd),
            "wv": (L, H, kvd),
            "wo": (L, qd, H),
            "mlp_norm": (L, H),
            "w_gate": (L, H, I),
            "w_up": (L, H, I),
            "w_down": (L, I, H),
        }
        if self.attention_bias:
            layers.update(bq=(L, qd), bk=(L, kvd), bv=(L, kvd))
        shapes: dict[str, Any] = {
            "embed": (self.vocab_size, H),
            "layers": layers,
            "final_norm": (H,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (H, self.vocab_size)
        return shapes


def _hashable(v: Any) -> bool:
    try:
        hash(v)
        return True
    except TypeError:
        return False
