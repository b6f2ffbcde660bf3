"""Build-time refusals: what an engine cannot serve, and GPU shares a cluster cannot hold, fail
before any Ray actor starts, with the setting to change (``RolloutEngine.check_supported``,
``plan.check_gpus``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.config import load_config
from asyncrl.engines import ENGINES, SamplingParams
from asyncrl.engines.vllm import INSTALL_HINT
from asyncrl.plan import check_components, check_gpus, generator_engine_options

REPO = Path(__file__).resolve().parents[1]

MC = SamplingParams(max_new_tokens=4, temperature=1.0, mc_samples=4)
NO_MC = SamplingParams(max_new_tokens=4, temperature=1.0)


def _checkpoint(tmp_path, vocab: int, hidden: int = 64, heads: int = 2):
    cfg = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_hf_engine_serves_everything_but_checks_the_directory(tmp_path):
    hf = ENGINES.get("hf")
    hf.check_supported(_checkpoint(tmp_path, 50_000), MC)  # exact MC draws at any vocabulary
    hf.check_supported(None, MC)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        hf.check_supported(str(tmp_path / "missing"), NO_MC)


def test_vllm_without_vllm_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)
    for path in (None, _checkpoint(tmp_path, 64)):
        with pytest.raises(ImportError) as err:
            ENGINES.get("vllm").check_supported(path, NO_MC)
        assert INSTALL_HINT in str(err.value)


def test_vllm_refuses_mc_draws_over_its_vocabulary_limit(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="stand-in"))  # no CPU platform
    vllm = ENGINES.get("vllm")
    big = _checkpoint(tmp_path, 5000)
    with pytest.raises(ValueError, match=r"sampling\.mc_samples=4.*5000 > 4096.*pipeline\.engine=hf"):
        vllm.check_supported(big, MC)
    vllm.check_supported(big, NO_MC)  # one token per position comes from vLLM's own sampler
    vllm.check_supported(big, MC, mc_max_vocab=8192)  # the option raises the limit
    vllm.check_supported(big, SamplingParams(temperature=0.0, mc_samples=4))  # greedy: no draws


def test_pipeline_refuses_vllm_engine_without_vllm_at_build_time(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    cfg = load_config(REPO / "examples" / "configs" / "opd_tiny.yaml", ["pipeline.engine=vllm"])
    with pytest.raises(ImportError, match=r"scripts/vllm_cpu_env\.sh"):
        check_components(cfg, None)


def _gpu_cfg(*more: str):
    return load_config(REPO / "examples" / "configs" / "opd_tiny.yaml", ["pipeline.device=cuda", *more])


def test_check_gpus_counts_every_share_against_the_cluster():
    cfg = _gpu_cfg("pipeline.learner_workers=2", "pipeline.gpus_per_worker=1", "pipeline.gpus_per_actor=0.25")
    check_gpus(cfg, 2.5, rl=False)  # 2 x 1 + (1 generator + 1 scorer) x 0.25
    with pytest.raises(ValueError, match=r"reserves 2\.5 GPUs .* has 2: .*gpus_per_worker=0\.5"):
        check_gpus(cfg, 2.0, rl=False)
    with pytest.raises(ValueError, match=r"has 0: .*pipeline\.device=cpu"):
        check_gpus(_gpu_cfg(), 0.0, rl=False)
    check_gpus(load_config(REPO / "examples" / "configs" / "opd_tiny.yaml"), 0.0, rl=False)  # cpu needs none
    with pytest.raises(ValueError, match=r"NCCL refuses"):
        check_gpus(_gpu_cfg("pipeline.learner_workers=2", "pipeline.gpus_per_worker=0.5"), 8.0, rl=False)


def test_grpo_reward_stage_reserves_no_gpu():
    cfg = load_config(REPO / "examples" / "configs" / "grpo.yaml", ["pipeline.device=cuda"])
    need = cfg.pipeline.gpus_per_worker + cfg.pipeline.generators * cfg.pipeline.gpus_per_actor
    check_gpus(cfg, need, rl=True)


@pytest.mark.parametrize("key", ["gpus_per_worker", "gpus_per_actor"])
def test_gpu_shares_must_be_positive(key):
    with pytest.raises(ValueError, match=rf"pipeline\.{key}"):
        _gpu_cfg(f"pipeline.{key}=0")


def test_cuda_puts_the_engines_on_the_gpu_share_unless_the_user_says_otherwise():
    assert generator_engine_options(_gpu_cfg()) == {"device": "cuda"}
    vllm = generator_engine_options(_gpu_cfg("pipeline.engine=vllm", "pipeline.gpus_per_actor=0.5"))
    assert vllm == {"gpu_memory_utilization": 0.45}  # inside its share; vLLM's default is 0.9
    own = _gpu_cfg("pipeline.engine=vllm", "pipeline.engine_options={gpu_memory_utilization: 0.3}")
    assert generator_engine_options(own) == {"gpu_memory_utilization": 0.3}
    cpu = load_config(REPO / "examples" / "configs" / "opd_tiny.yaml", ["pipeline.engine_options={seed: 1}"])
    assert generator_engine_options(cpu) == {"seed": 1}
