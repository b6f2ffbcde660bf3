"""Tied weights (``asyncrl.tied``) and every path a state dict takes from the learner to an engine:
``publishable_state`` -> ``pack_weights`` -> pickle (the object store) -> ``unpack_weights`` ->
``HFEngine.load_weights``. A tied tensor is copied, shipped and written once, and arrives tied."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.coordinator import pack_weights, publishable_state, unpack_weights
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.hf import HFEngine
from asyncrl.lab.presets import ModelSpec, build_model
from asyncrl.tied import copy_once, drop_tied_duplicates, tied_aliases
from asyncrl.workloads.tasks import encode_prompts
from asyncrl.workloads.tokenizer import char_tokenizer

TOK = char_tokenizer()


def _qwen(seed: int) -> torch.nn.Module:
    """A qwen3 model: its input embedding and LM head are one parameter (``ModelSpec``)."""
    spec = ModelSpec("qwen3", hidden=16, layers=1, heads=2, intermediate=32, max_positions=32)
    return build_model(spec, len(TOK), seed).eval()


def test_tied_aliases_names_ties_not_equal_values_nor_empty_tensors() -> None:
    w = torch.randn(4, 3)
    state = {
        "a": w,
        "b": w,  # the same tensor
        "c": w.clone(),  # equal values, its own memory
        "d": w.view(4, 3),  # another view of the same memory, same layout: a tie
        "e": w.t(),  # same memory, another layout: not interchangeable
        "f": w[1:],  # a slice: another address
        "g": torch.zeros(0),
        "h": torch.zeros(0),  # empty tensors may share address 0
        "i": w.double(),
    }
    assert tied_aliases(state) == {"b": "a", "d": "a"}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=12), st.integers(0, 2**16))
def test_pack_unpack_keep_values_and_ties(sources: list[int], seed: int) -> None:
    """Key j holds tensor ``sources[j]`` of a pool (repeats are ties): through pack, pickle 5 and
    unpack every key has its values, tied keys are one tensor, untied ones are not, and each tied
    tensor's bytes travel once."""
    g = torch.Generator().manual_seed(seed)
    pool = [torch.randn(3 + i, 2, generator=g) for i in range(6)]
    state = {f"k{j}": pool[i] for j, i in enumerate(sources)}
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(pack_weights(state), protocol=5, buffer_callback=buffers.append)
    assert sum(memoryview(b).nbytes for b in buffers) == sum(pool[i].nbytes for i in set(sources))
    back = unpack_weights(pickle.loads(blob, buffers=buffers))
    assert list(back) == list(state)
    for j, i in enumerate(sources):
        assert torch.equal(back[f"k{j}"], pool[i])
        for j2, i2 in enumerate(sources):
            assert (back[f"k{j}"] is back[f"k{j2}"]) == (i == i2)
    copies = copy_once(state, torch.clone)
    assert tied_aliases(copies) == tied_aliases(state)
    assert all(copies[k].data_ptr() != state[k].data_ptr() for k in state)


def test_unpack_rejects_a_tie_to_a_key_it_was_not_given() -> None:
    with pytest.raises(ValueError, match=r"'lm_head\.weight' is tied to 'embed'"):
        unpack_weights({"lm_head.weight": "embed"})


def test_published_tied_model_copies_once_and_loads_tied_and_equal() -> None:
    """The learner's publication of a tied model (qwen3): one copy of the embedding/LM head, the
    bytes shipped once, and an engine on another seed samples exactly as the learner's model."""
    learner, other = _qwen(seed=0), _qwen(seed=1)
    keyed = learner.state_dict()
    assert tied_aliases(keyed) == {"lm_head.weight": "model.embed_tokens.weight"}
    published = publishable_state(learner)
    assert published["lm_head.weight"] is published["model.embed_tokens.weight"]
    assert published["lm_head.weight"].data_ptr() != learner.lm_head.weight.data_ptr()
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(pack_weights(published), protocol=5, buffer_callback=buffers.append)
    distinct = {v.data_ptr(): v.nbytes for v in keyed.values()}
    assert (
        sum(memoryview(b).nbytes for b in buffers)
        == sum(distinct.values())
        < sum(v.nbytes for v in keyed.values())
    )

    engine = HFEngine(other, TOK, version=0)
    engine.load_weights(unpack_weights(pickle.loads(blob, buffers=buffers)), version=3)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied
    for k, v in keyed.items():
        assert torch.equal(engine.model.state_dict()[k], v), k
    ids, mask = encode_prompts(TOK, ["12+34=", "7+8="], 8)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    ours = HFEngine(learner, TOK).generate(ids, mask, params, seed=0)["completion_ids"]
    assert torch.equal(engine.generate(ids, mask, params, seed=0)["completion_ids"], ours)


def test_engine_loads_tied_key_missing_or_sent_separately() -> None:
    """A sender that drops the tied key (safetensors-style) or sends it as its own equal copy
    (an older publisher, ``model.state_dict()`` cloned key by key) loads the same weights."""
    source = _qwen(seed=0).state_dict()
    for state in (
        {k: v for k, v in source.items() if k != "lm_head.weight"},
        {k: v.clone() for k, v in source.items()},
    ):
        engine = HFEngine(_qwen(seed=1), TOK, version=0)
        engine.load_weights(state, version=1)
        assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
        assert torch.equal(engine.model.lm_head.weight, source["model.embed_tokens.weight"])


def test_drop_tied_duplicates_only_where_both_sides_tie_the_same_keys() -> None:
    model = _qwen(seed=0)
    state = copy_once(model.state_dict(), torch.clone)
    assert set(state) - set(drop_tied_duplicates(state, model)) == {"lm_head.weight"}
    separate = {k: v.clone() for k, v in model.state_dict().items()}
    assert drop_tied_duplicates(separate, model).keys() == separate.keys()
    untied = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    shared = {"0.weight": torch.ones(2, 2), "1.weight": None}
    shared["1.weight"] = shared["0.weight"]
    assert drop_tied_duplicates(shared, untied).keys() == shared.keys()  # the model keeps two


def test_vllm_payload_ships_a_tied_tensor_once_and_keeps_the_tie() -> None:
    """``VLLMEngine.load_weights``' bytes (``torch.save``): the tie survives and its bytes go once."""
    from asyncrl.engines.vllm_worker import deserialize_state_dict, serialize_state_dict

    published = publishable_state(_qwen(seed=0))
    blob = serialize_state_dict(published)
    back = deserialize_state_dict(blob)
    assert back["lm_head.weight"].data_ptr() == back["model.embed_tokens.weight"].data_ptr()
    assert all(torch.equal(back[k], v) for k, v in published.items())
    untied = serialize_state_dict({k: v.clone() for k, v in published.items()})
    embed = published["lm_head.weight"].nbytes
    assert len(untied) - len(blob) >= embed
