"""The derived key namespace (umbp.vllm.keys) from real vLLM engine configs: everything that
changes the KV bytes — dtype, quantization, the HF config with hf_overrides applied, the
draft model — changes it; identical configs agree, also across processes (the scheduler and
the workers derive it separately)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import _ADD_PY_DIR

pytest.importorskip("vllm")

from umbp.vllm.keys import canonical_namespace_text, hf_config_digest  # noqa: E402


def engine_config(model: str, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=model, skip_tokenizer_init=True, dtype="bfloat16", enable_prefix_caching=True,
                enforce_eager=True, max_model_len=1024)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


def ns(model: str, **kw) -> str:
    return canonical_namespace_text(engine_config(model, **kw), None)


@pytest.fixture(scope="module")
def base(cfg_dir):
    return ns(cfg_dir)


def test_identical_configs_agree(cfg_dir, base):
    assert ns(cfg_dir) == base
    desc = json.loads(base)
    assert desc["hf_config"] and desc["draft"] is None and desc["dtype"] == "torch.bfloat16"


def test_identical_configs_agree_across_processes(cfg_dir, base):
    code = (
        "import sys; sys.path[:0] = sys.argv[2:]\n"
        "from test_namespace import ns\n"
        "print('@@NS@@' + ns(sys.argv[1]))\n"
    )
    here = Path(__file__).resolve().parent
    # The source tree only where umbp is not installed (a source tree has no _native module).
    extra = [str(here.parent)] if _ADD_PY_DIR else []
    r = subprocess.run([sys.executable, "-c", code, cfg_dir, str(here), *extra], capture_output=True,
                       text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("@@NS@@")]
    assert lines, r.stderr[-2000:]
    assert lines[0][len("@@NS@@"):] == base


@pytest.mark.parametrize(
    "name,kw",
    [
        ("dtype", dict(dtype="float16")),
        ("quantization", dict(quantization="fp8")),
        ("hf_overrides", dict(hf_overrides={"rope_theta": 5000.0})),
        ("kv_cache_dtype", dict(kv_cache_dtype="fp8")),
        ("ngram speculation", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                       "prompt_lookup_max": 3})),
    ],
)
def test_each_change_changes_the_namespace(cfg_dir, base, name, kw):
    try:
        text = ns(cfg_dir, **kw)
    except Exception as e:  # noqa: BLE001 - a config this vLLM build refuses
        pytest.skip(f"vLLM refuses {name} here: {e}")
    assert text != base, f"{name} did not change the namespace"
    assert ns(cfg_dir, **kw) == text, f"{name}: the same config gave two namespaces"


def test_hf_overrides_reach_the_effective_hf_config(cfg_dir):
    """The override is applied to hf_config (not only listed): its digest changes."""
    plain = engine_config(cfg_dir).model_config.hf_config
    over = engine_config(cfg_dir, hf_overrides={"rope_theta": 5000.0}).model_config.hf_config
    assert hf_config_digest(plain) != hf_config_digest(over)
    assert hf_config_digest(plain) == hf_config_digest(engine_config(cfg_dir).model_config.hf_config)


def test_draft_model_changes_the_namespace(cfg_dir, base, tmp_path):
    """A draft model (speculative decoding) is part of the namespace, and so is which one."""
    import shutil

    other = tmp_path / "draft2"
    shutil.copytree(cfg_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["initializer_range"] = 0.5  # another draft model: another config
    (other / "config.json").write_text(json.dumps(cfg))
    spec = {"model": cfg_dir, "num_speculative_tokens": 2, "method": "draft_model"}
    try:
        with_draft = ns(cfg_dir, speculative_config=spec)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"vLLM refuses a draft model here: {e}")
    assert with_draft != base
    assert json.loads(with_draft)["draft"]["model"] == cfg_dir
    other_draft = ns(cfg_dir, speculative_config={**spec, "model": str(other)})
    assert other_draft not in (base, with_draft)
    fewer = ns(cfg_dir, speculative_config={**spec, "num_speculative_tokens": 3})
    assert fewer not in (base, with_draft)


# Issue #33 item 10: the seed's namespace rules. Tensor parallelism, the block size and the
# KV layout change the bytes (or which bytes) a key names, so they change the namespace;
# the data-parallel rank does not (DP replicas of one engine share their pool objects).
@pytest.mark.parametrize(
    "name,kw",
    [
        ("tensor parallel size", dict(tensor_parallel_size=2)),
        ("block size", dict(block_size=32)),
    ],
)
def test_tp_and_block_size_change_the_namespace(cfg_dir, base, name, kw):
    try:
        text = ns(cfg_dir, **kw)
    except Exception as e:  # noqa: BLE001 - a config this vLLM build refuses
        pytest.skip(f"vLLM refuses {name} here: {e}")
    assert text != base, f"{name} did not change the namespace"
    key = {"tensor parallel size": "tp", "block size": "block_size"}[name]
    assert json.loads(text)[key] != json.loads(base)[key]


def test_pcp_size_changes_the_namespace(cfg_dir, base):
    """Issue #33: PCP is part of the namespace topology (as the seed's): an engine with
    PCP 2 never shares objects with one without (its keys also carry the PCP rank). vLLM's
    CPU build refuses PCP > 1 in a config (test_pcp.py), so it is set on the config as a
    GPU build has it."""
    cfg = engine_config(cfg_dir)
    cfg.parallel_config.prefill_context_parallel_size = 2
    text = canonical_namespace_text(cfg, None)
    assert text != base
    assert (json.loads(text)["pcp"], json.loads(base)["pcp"]) == (2, 1)


def test_kv_layout_changes_the_namespace(cfg_dir):
    class KVConfig:  # what canonical_namespace_text reads of vLLM's KVCacheConfig
        kv_cache_groups: list = []

        def __init__(self, layout: str):
            self.kv_cache_layout = layout

    cfg = engine_config(cfg_dir)
    nhd = canonical_namespace_text(cfg, KVConfig("NHD"))
    hnd = canonical_namespace_text(cfg, KVConfig("HND"))
    assert nhd != hnd
    assert canonical_namespace_text(cfg, KVConfig("NHD")) == nhd


def test_dp_rank_does_not_change_the_namespace(cfg_dir, base):
    # Each DP rank's engine has its own config, equal but for the rank fields (vLLM refuses
    # an explicit data_parallel_rank for a dense model outside its launcher, so the ranks
    # are set on the config as vLLM's DP launcher does).
    try:
        cfg = engine_config(cfg_dir, data_parallel_size=2)
    except Exception as e:  # noqa: BLE001 - a config this vLLM build refuses
        pytest.skip(f"vLLM refuses data_parallel_size=2 here: {e}")
    texts = set()
    for r in (0, 1):
        cfg.parallel_config.data_parallel_rank = r
        cfg.parallel_config.data_parallel_rank_local = r
        texts.add(canonical_namespace_text(cfg, None))
    assert len(texts) == 1, "the DP rank changed the namespace"
