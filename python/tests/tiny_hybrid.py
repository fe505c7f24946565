"""Tiny hybrid models for the hybrid-KV-cache (HMA) tests, built offline like tiny_model.py.

* `gemma2`: Gemma-2-like, 4 layers alternating sliding-window (window 128 tokens) and full
  attention. With the hybrid KV cache manager vLLM gives it two KV cache groups (full
  attention, sliding window); the sliding-window group keeps only the blocks inside the window.
* `granite_hybrid`: GraniteMoeHybrid (Mamba2 + attention, no experts), a Mamba hybrid: one full
  attention group and one Mamba state group.

    python python/tests/tiny_hybrid.py gemma2|granite_hybrid [DIR]   # prints the model dir

Same tokenizer as tiny_model.py; initializer ranges chosen so that greedy output depends on
the prompt. Each directory carries a stamp of the spec it was built from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tiny_model import REPO_ROOT, build_stamped, model_config, train_tokenizer

SPECS = {
    "gemma2": {
        "version": 3,
        "family": "gemma2",
        "seed": 99,
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 128,
        "initializer_range": 0.1,  # 0.3 saturates Gemma-2: one token whatever the prompt
    },
    "granite_hybrid": {
        "version": 1,
        "family": "granite_hybrid",
        "seed": 98,
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "initializer_range": 0.3,
    },
}


def default_dir(family: str) -> Path:
    return REPO_ROOT / ".cache" / f"tiny-{family}"


def _build_into(out: Path, spec: dict) -> None:
    import torch

    fast = train_tokenizer(out, 1000, 2048)
    common = model_config(spec, fast, 2048)
    if spec["family"] == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        n = spec["num_hidden_layers"]
        config = Gemma2Config(
            head_dim=spec["head_dim"],
            sliding_window=spec["sliding_window"],
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            query_pre_attn_scalar=spec["head_dim"],
            **{**common, "tie_word_embeddings": True},  # vLLM's Gemma2 ties them
        )
        cls = Gemma2ForCausalLM
    else:
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        config = GraniteMoeHybridConfig(
            layer_types=["mamba", "attention"],
            num_local_experts=0,
            shared_intermediate_size=spec["intermediate_size"],
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=64,
            position_embedding_type="rope",
            **common,
        )
        cls = GraniteMoeHybridForCausalLM
    torch.manual_seed(spec["seed"])
    model = cls(config).to(torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)


def build_tiny_hybrid(family: str, path: str | os.PathLike | None = None) -> str:
    spec = SPECS[family]
    target = Path(path) if path is not None else default_dir(family)
    return build_stamped(target, spec, lambda out: _build_into(out, spec))


if __name__ == "__main__":
    print(build_tiny_hybrid(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
