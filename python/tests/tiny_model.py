"""A tiny, deterministic Qwen2 model + tokenizer for running a real vLLM engine offline.

No weights can be downloaded here, so tests build their own model: Qwen2 with hidden 128,
2 layers, 4 attention heads, 2 KV heads, bf16, and a byte-level BPE tokenizer trained with
`tokenizers` on a few lines of text. `initializer_range=0.3` (not the default 0.02) makes
greedy output depend on the prompt, so a corrupted KV cache visibly changes the tokens.

The model is built once per directory and reused: a `umbp-tiny-model.json` stamp records the
spec it was built from; a directory whose stamp differs is rebuilt. Building is atomic
(temp dir + rename), so concurrent test processes may call `build_tiny_model` safely.

    python python/tests/tiny_model.py [DIR]     # prints the model directory
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO_ROOT / ".cache" / "tiny-qwen2"

# Everything that determines the built files; bump "version" when the recipe changes.
SPEC = {
    "version": 1,
    "seed": 1234,
    "vocab_size": 1024,  # model vocab; the trained tokenizer uses <= 1000 of it
    "tokenizer_vocab": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.3,
    "dtype": "bfloat16",
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A pool of host memory keeps key value cache blocks for language models.",
    "When a prefix falls out of device memory it must be recomputed, unless it was kept.",
    "Engines share prompts: system prompts, documents, few-shot examples and chat history.",
    "Every worker attaches to the pool over a unix socket and submits transfers on a ring.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 and more numbers.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "In the beginning the universe was created. This has made a lot of people very angry.",
    "To be, or not to be, that is the question: whether it is nobler in the mind to suffer.",
    "Rust gives memory safety without garbage collection; Python glues the pieces together.",
]


def default_model_dir() -> Path:
    """`$UMBP_TEST_MODEL_DIR` or `<repo>/.cache/tiny-qwen2`."""
    env = os.environ.get("UMBP_TEST_MODEL_DIR")
    return Path(env) if env else DEFAULT_DIR


def _stamp_ok(path: Path, spec: dict) -> bool:
    try:
        return json.loads((path / "umbp-tiny-model.json").read_text()) == spec
    except (OSError, ValueError):
        return False


def train_tokenizer(out: Path, vocab_size: int, max_len: int):
    """A byte-level BPE tokenizer (any text, and any byte, tokenizes) trained on the corpus
    with `vocab_size` entries at most, saved into `out`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>", model_max_length=max_len
    )
    fast.save_pretrained(out)
    return fast


def model_config(spec: dict, fast, max_len: int) -> dict:
    """The config fields every tiny model takes from its `spec` and its tokenizer `fast`."""
    eos = fast.convert_tokens_to_ids("<|endoftext|>")
    return dict(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        max_position_embeddings=max_len,
        initializer_range=spec["initializer_range"],
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=fast.convert_tokens_to_ids("<|pad|>"),
    )


def build_stamped(target: Path, spec: dict, build_into: Callable[[Path], None]) -> str:
    """The model directory `target` built from `spec` by `build_into(dir)`, or reused when
    its stamp already records `spec`. Built in a temp dir and renamed into place, so
    concurrent processes may call this safely; the stamp is written last."""
    target = target.resolve()
    if _stamp_ok(target, spec):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build_into(tmp)
        (tmp / "umbp-tiny-model.json").write_text(json.dumps(spec, indent=1) + "\n")
        if target.exists():
            if _stamp_ok(target, spec):  # someone else finished first
                return str(target)
            shutil.rmtree(target)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _stamp_ok(target, spec):  # lost a race to a broken dir: give up loudly
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _build_into(out: Path) -> None:
    # Imports are local so that importing this module (e.g. from conftest) stays cheap.
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fast = train_tokenizer(out, SPEC["tokenizer_vocab"], SPEC["max_position_embeddings"])
    assert len(fast) <= SPEC["vocab_size"], len(fast)

    config = Qwen2Config(**model_config(SPEC, fast, SPEC["max_position_embeddings"]))
    torch.manual_seed(SPEC["seed"])
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)


def build_tiny_model(path: str | os.PathLike | None = None) -> str:
    """Build (or reuse) the tiny model in `path` (default: `default_model_dir()`).

    Returns the model directory as a string, ready for `vllm.LLM(model=...)`.
    """
    return build_stamped(Path(path) if path is not None else default_model_dir(), SPEC, _build_into)


if __name__ == "__main__":
    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else None))
