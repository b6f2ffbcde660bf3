"""A DeepSpeed test module's process group (one process, a 1-rank gloo group), shared by the modules
that build DeepSpeed engines: ``from ds_group import process_group  # noqa: F401`` (autouse)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """One process group for the module; torn down so no other test sees it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    forget_deepspeed_groups()  # a group another module destroyed must not be reused here
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    forget_deepspeed_groups()


def forget_deepspeed_groups() -> None:
    """DeepSpeed caches the process groups it made (``deepspeed.utils.groups``) past
    ``destroy_process_group``; a later module's engine would reuse a destroyed one."""
    import deepspeed.utils.groups as groups

    for name in (
        "_WORLD_GROUP",
        "_DATA_PARALLEL_GROUP",
        "_MODEL_PARALLEL_GROUP",
        "_TENSOR_MODEL_PARALLEL_GROUP",
        "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
        "_ALL_TO_ALL_GROUP",
    ):
        if getattr(groups, name, None) is not None:
            setattr(groups, name, None)
