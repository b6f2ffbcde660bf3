"""The user-facing examples: the plain-loop example runs here (no Ray); the pipeline examples build
valid configs (their end-to-end runs need Ray and live in integration_tests)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from asyncrl.cli import _first_doc_line
from asyncrl.plan import check_components

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

torch.set_num_threads(1)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_every_example_has_main_and_a_main_guard(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), "start with a docstring saying what it shows and how to run it"
    assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
    guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guards, "guard the entry point with if __name__ == '__main__'"


def test_plain_loop_loss_goes_down(capsys: pytest.CaptureFixture[str]) -> None:
    losses = _load("estimator_plain_loop").main(steps=12, batch_size=16, verbose=True)
    assert len(losses) == 12 and all(loss == loss for loss in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    assert "forward KL (top-8)" in capsys.readouterr().out


def test_loss_step_loop_example_trains_with_stale_batches() -> None:
    results = _load("loss_step_loop").main(steps=12, batch_size=16, max_lag=2, verbose=False)
    lags = [int(r.lags_global.max()) for r in results]
    assert max(lags) == 2 and all(r.stepped for r in results)  # the chain kept lag <= 2, every step taken
    assert sum(r.loss for r in results[-3:]) < sum(r.loss for r in results[:3])
    stale = [r for r, lag in zip(results, lags) if lag > 0]
    assert any(r.lr_applied < r.lr_scheduled for r in stale)  # ess_lr shrank the LR on stale batches


@pytest.mark.parametrize(
    ("name", "algo", "preset"),
    [
        ("opd_quickstart", "opd", "tiny"),
        ("grpo_quickstart", "rl", "tiny"),
        ("submit_to_cluster", "opd", "tiny"),
    ],
)
def test_pipeline_examples_build_valid_small_configs(name: str, algo: str, preset: str) -> None:
    module = _load(name)
    cfg = module.build_config(["train.steps=2"])
    assert (cfg.algo, cfg.workload.preset, cfg.train.steps) == (algo, preset, 2)
    check_components(cfg, None)
    if name == "submit_to_cluster":
        assert cfg.pipeline.ray_address == "auto"


def test_ls_description_is_the_first_sentence() -> None:
    class Doc:
        """Clips ``w`` to [0, C]. Metrics: ``is/w_mean``,
        ``is/frac``.

        More."""

    class Named:
        doc = "from the doc attribute"

    assert _first_doc_line(Doc) == "Clips w to [0, C]."
    assert _first_doc_line(Named) == "from the doc attribute"
