"""docs/config_reference.md is generated from the config classes and must be committed up to date."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_config_reference", REPO / "scripts" / "gen_config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_reference_is_up_to_date() -> None:
    committed = (REPO / "docs" / "config_reference.md").read_text()
    assert committed == _generator().render(), "run: python scripts/gen_config_reference.py"


def test_reference_documents_every_field_and_component() -> None:
    from asyncrl.config import RunConfig
    from asyncrl.configurable import field_docs
    from asyncrl.controllers import CONTROLLERS
    from asyncrl.estimators import ESTIMATORS

    text = _generator().render()
    for name, *_ in field_docs(RunConfig):
        assert f"| `{name}` |" in text, name
    for registry in (ESTIMATORS, CONTROLLERS):
        for name in registry.names():
            assert f"### `{name}`" in text, name
    assert "| `tail` | `'drop' \\| 'bucket' \\| 'renorm'` | `bucket` |" in text  # Literal choices, escaped
    assert "| `estimator.name` | `str` | `forward_kl` |" in text  # the effective default


def test_check_mode_detects_a_stale_file(tmp_path: Path) -> None:
    gen = _generator()
    stale = tmp_path / "ref.md"
    stale.write_text("old\n")
    assert gen.main(["--check", "--output", str(stale)]) == 1
    assert gen.main(["--output", str(stale)]) == 0
    assert gen.main(["--check", "--output", str(stale)]) == 0
