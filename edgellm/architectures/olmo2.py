"""OLMo 2 (transformers `model_type: olmo2`): Llama's layout (llama.py) with norms after each
branch instead of before (`post_attention_layernorm`, `post_feedforward_layernorm`) and q and k
normalized over the whole projection, before the heads are split.
"""

from __future__ import annotations

from . import llama
from .registry import GgufLayout

ARCHITECTURE = llama.relative(
    "olmo2", "OLMo 2 (Llama layout with post-norms and q/k norms over the projection)",
    llama.Variant(qk_norm="whole", norms="post",
                  rotary="olmo2.modeling_olmo2:Olmo2RotaryEmbedding"), "OLMo 2",
    gguf=GgufLayout("olmo2"))
