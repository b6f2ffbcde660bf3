"""Model presets by name, and the tokenizer a run uses before any model is loaded.

``PRESETS`` maps a preset name (``workload.preset``) to a teacher/student pair that is trained and
cached under ``cache_dir`` (``checkpoints.run_dir_for``). The core reads two attributes of a
preset: ``name`` and ``tokenizer`` (a ``TOKENIZERS`` name, what its models are saved with). The
built-in presets (``tiny``, ``small``, ...: architectures and pretraining budgets) belong to the
lab, ``asyncrl.lab.presets``, which registers them here as a plugin does (the ``asyncrl.preset``
entry point, ``asyncrl.registry.load_plugins``); the real presets are ``asyncrl.workloads.real``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.registry import Registry
from asyncrl.workloads.checkpoints import missing_parts, run_dir_for
from asyncrl.workloads.tasks import get_task
from asyncrl.workloads.tokenizer import TOKENIZERS

__all__ = ["PRESETS", "workload_tokenizer"]

#: preset name -> a preset (anything with ``name`` and ``tokenizer``; ``asyncrl.lab.presets.Preset``)
PRESETS: Registry[Any] = Registry("preset")


def workload_tokenizer(
    task: str,
    preset: str,
    *,
    cache_dir: str | Path = ".asyncrl_cache",
    seed: int = 0,
    student_path: str | Path | None = None,
) -> Any:
    """The tokenizer a run uses: ``student_path``'s, else the cached pretrained student's, else
    (not pretrained yet) the one the preset's models will be saved with. Loads nothing but
    tokenizer files, so configs can be resolved before any model exists."""
    from asyncrl.workloads.checkpoints import shared_tokenizer

    if student_path is not None:  # a .gguf file: its converted directory (converted once, cached)
        from asyncrl.workloads.gguf import materialize

        student_path = materialize(student_path, cache_dir, field="workload.student_path")
        return _load_tokenizer(student_path, "workload.student_path")
    task_name = get_task(task).name
    preset_obj = PRESETS.get(preset)
    student = run_dir_for(task_name, preset_obj.name, seed, cache_dir) / "student"
    if not missing_parts(student):
        return shared_tokenizer(student)
    return TOKENIZERS.get(preset_obj.tokenizer).build()


def _load_tokenizer(path: str | Path, what: str) -> Any:
    """``path``'s tokenizer; a path that is not a directory with tokenizer files is a ConfigError
    naming the field (``what``) and the fix."""
    from asyncrl.configurable import ConfigError
    from asyncrl.workloads.checkpoints import shared_tokenizer

    if not str(path).strip() or not Path(path).is_dir():
        raise ConfigError(
            what,
            str(path),
            "not a directory; give a checkpoint directory saved with save_pretrained, or set "
            "sampling.max_new_tokens to a number",
        )
    try:
        return shared_tokenizer(path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            what,
            str(path),
            f"no loadable tokenizer ({' '.join(str(err).split())[:120]}); save one there with "
            f"tokenizer.save_pretrained(dir), or set sampling.max_new_tokens to a number",
        ) from err
