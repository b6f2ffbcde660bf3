"""The character tokenizer: special ids, one token per character, save/load round trip."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from asyncrl.workloads.tokenizer import BOS_ID, CHARS, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID, char_tokenizer

TOK = char_tokenizer()


def test_special_ids_and_padding_side() -> None:
    assert isinstance(TOK, PreTrainedTokenizerFast)
    assert (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id, TOK.unk_token_id) == (0, 1, 2, 3)
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert TOK.padding_side == "left"
    assert len(TOK) == 4 + len(CHARS) == len(set(CHARS)) + 4


@settings(max_examples=50, deadline=None)
@given(text=st.text(alphabet=CHARS, min_size=1, max_size=40))
def test_one_token_per_char_and_decode_round_trip(text: str) -> None:
    assume(not any(s in text for s in SPECIAL_TOKENS))  # "<eos>" typed out *is* the EOS token
    ids = TOK(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and UNK_ID not in ids
    assert TOK.decode(ids) == text
    with_bos = TOK(text)["input_ids"]
    assert with_bos == [BOS_ID, *ids]
    assert TOK.decode([*with_bos, EOS_ID, PAD_ID], skip_special_tokens=True) == text


def test_unknown_chars_map_to_unk_and_special_strings_to_specials() -> None:
    assert TOK("é", add_special_tokens=False)["input_ids"] == [UNK_ID]
    assert TOK("1<eos>", add_special_tokens=False)["input_ids"] == [TOK.convert_tokens_to_ids("1"), EOS_ID]


def test_left_padding_batch() -> None:
    enc = TOK(["12+3=", "7="], padding=True)
    assert enc["input_ids"][1][:3] == [PAD_ID] * 3 and enc["attention_mask"][1][:3] == [0, 0, 0]


def test_save_pretrained_round_trip(tmp_path) -> None:
    TOK.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.get_vocab() == TOK.get_vocab()
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    text = "Hello, World! 12+34=046"
    assert loaded(text)["input_ids"] == TOK(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text


# --- Qwen BPE ----------------------------------------------------------------------------------------
def _qwen():
    from asyncrl.workloads.tokenizer import qwen_tokenizer

    return qwen_tokenizer()


def test_qwen_ids_match_qwens_own_tokenizer() -> None:
    """Ids the released Qwen2/3 tokenizer gives (BPE ranks + special ids after the 151,643 ranks)."""
    from asyncrl.workloads.tokenizer import QWEN_MODEL_VOCAB, TOKENIZERS

    tok = _qwen()
    assert len(tok) == 151_646 and TOKENIZERS.get("qwen").vocab_size(tok) == QWEN_MODEL_VOCAB == 151_936
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (151_643, 151_645, None)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151_644
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [9707, 1879]
    assert tok("123", add_special_tokens=False)["input_ids"] == [16, 17, 18]  # one token per digit
    assert tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"] == [151_644, 872, 198]
    assert tok.padding_side == "left"


def test_qwen_chat_template_and_round_trip(tmp_path) -> None:
    from asyncrl.workloads.tasks import encode_prompts, prompt_token_ids

    tok = _qwen()
    ids = prompt_token_ids(tok, ["12+34="])[0]
    assert tok.decode(ids) == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    assert ids.count(tok.eos_token_id) == 1  # the user turn's end, never a BOS
    pid, mask = encode_prompts(tok, ["1+2=", "12345+67890="])
    assert pid[0, 0] == tok.pad_token_id and not mask[0, 0] and mask[1].all()
    # answers decode back through the BPE; EOS, pad and ids past the tokenizer's 151,646 vanish
    answer = tok("579", add_special_tokens=False)["input_ids"]
    out = [*answer, tok.eos_token_id, tok.pad_token_id, 151_900]
    assert tok.decode(out, skip_special_tokens=True) == "579"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert again.get_vocab() == tok.get_vocab() and again.chat_template == tok.chat_template
    assert prompt_token_ids(again, ["12+34="])[0] == ids and again.padding_side == "left"


def test_char_tokenizer_prompts_keep_bos_through_its_chat_template() -> None:
    """The char tokenizer's chat template (for ``messages`` prompt files) changes no prompt's ids:
    ``<bos>`` + the prompt, exactly as before it had a template (the ids the cached pretrained
    models were trained on, and what a checkpoint saved without the template still gets)."""
    import copy

    from asyncrl.workloads.tasks import TASKS, get_task, prompt_token_ids
    from asyncrl.workloads.tokenizer import CHAR_CHAT_TEMPLATE

    assert TOK.chat_template == CHAR_CHAT_TEMPLATE
    untemplated = copy.deepcopy(TOK)
    untemplated.chat_template = None
    assert (
        prompt_token_ids(TOK, ["12+3="])[0]
        == TOK("12+3=")["input_ids"]
        == [BOS_ID, *TOK("12+3=", add_special_tokens=False)["input_ids"]]
    )
    for name in TASKS.names():
        prompts = [e.prompt for e in get_task(name).make_examples("train", 256, 0)]
        prompts += [e.prompt for e in get_task(name).make_examples("eval", 64, 0)]
        raw = TOK(prompts, add_special_tokens=True)["input_ids"]
        assert prompt_token_ids(TOK, prompts) == raw == prompt_token_ids(untemplated, prompts), name
        assert all(ids[0] == BOS_ID and BOS_ID not in ids[1:] for ids in raw)


@settings(max_examples=50, deadline=None)
@given(text=st.text(alphabet=CHARS, min_size=1, max_size=40))
def test_char_prompt_ids_are_bos_plus_text_for_any_text(text: str) -> None:
    from asyncrl.workloads.tasks import prompt_token_ids

    assert prompt_token_ids(TOK, [text])[0] == TOK(text)["input_ids"]


# --- load_tokenizer: AutoTokenizer's result without its model-config import ---------------------------
def _saved(tmp_path, tok, model_type: str):
    import json

    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return tmp_path


TEXTS = ["", "12+34=", "Hello, World! 12+34=046", "<eos>1", "é~\t"]


def _same_tokenizer(fast, auto) -> None:
    assert type(fast) is type(auto) and fast.get_vocab() == auto.get_vocab()
    assert fast.all_special_ids == auto.all_special_ids and fast.padding_side == auto.padding_side
    assert fast.chat_template == auto.chat_template
    assert fast(TEXTS)["input_ids"] == auto(TEXTS)["input_ids"]


def test_load_tokenizer_is_autotokenizer_for_the_char_tokenizer(tmp_path_factory) -> None:
    """Same class, vocabulary, special ids, padding side, chat template and ids as AutoTokenizer,
    under every built-in model type."""
    from asyncrl.workloads.checkpoints import _generic_tokenizer, load_tokenizer

    for model_type in ("llama", "gpt2", "qwen3"):
        d = _saved(tmp_path_factory.mktemp(model_type), TOK, model_type)
        assert _generic_tokenizer(d)  # the fast path is the one under test
        _same_tokenizer(load_tokenizer(d), AutoTokenizer.from_pretrained(d, local_files_only=True))


def test_load_tokenizer_is_autotokenizer_for_the_qwen_tokenizer(tmp_path) -> None:
    from asyncrl.workloads.checkpoints import _generic_tokenizer, load_tokenizer

    d = _saved(tmp_path, _qwen(), "qwen3")
    assert _generic_tokenizer(d)
    _same_tokenizer(load_tokenizer(d), AutoTokenizer.from_pretrained(d, local_files_only=True))


def test_load_tokenizer_defers_to_autotokenizer_where_it_may_differ(tmp_path, monkeypatch) -> None:
    """A model type on AutoTokenizer's override list, another tokenizer class, remote code or no
    config.json: AutoTokenizer decides (the fast path would be a guess)."""
    import json

    from transformers.models.auto import tokenization_auto

    from asyncrl.workloads.checkpoints import _generic_tokenizer, load_tokenizer

    d = _saved(tmp_path, TOK, "llama")
    assert _generic_tokenizer(d)
    overridden = next(iter(tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS))
    (d / "config.json").write_text(json.dumps({"model_type": overridden}))
    assert not _generic_tokenizer(d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    other_class = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for change in (other_class, {"auto_map": {"AutoTokenizer": ["x"]}}):
        (d / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, **change}))
        assert not _generic_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (d / "config.json").unlink()
    assert not _generic_tokenizer(d)
    calls = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert load_tokenizer(d).get_vocab() == TOK.get_vocab() and len(calls) == 1


# --- shared_tokenizer: one read-only instance per directory and process -------------------------------
def test_shared_tokenizer_is_one_instance_per_tokenizer_until_its_files_change(tmp_path) -> None:
    import json

    from transformers.models.auto import tokenization_auto

    from asyncrl.workloads.checkpoints import load_tokenizer, shared_tokenizer

    d = _saved(tmp_path / "a", TOK, "llama")
    first = shared_tokenizer(d)
    assert shared_tokenizer(str(d)) is first and shared_tokenizer(d / ".." / "a") is first
    assert load_tokenizer(d) is not first  # the public loader still gives a private copy
    # a teacher saved with the same tokenizer (other weights, other config): the same instance
    twin = _saved(tmp_path / "b", TOK, "llama")
    (twin / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert shared_tokenizer(twin) is first
    assert shared_tokenizer(_saved(tmp_path / "c", TOK, "gpt2")) is not first  # another model type
    assert shared_tokenizer(_saved(tmp_path / "q", _qwen(), "qwen3")) is not first
    (d / "model.safetensors").write_bytes(b"new weights")  # weights are not the tokenizer's
    assert shared_tokenizer(d) is first
    (d / "chat_template.jinja").write_text("{{ 'x' }}")
    resaved = shared_tokenizer(d)  # re-saved in place: loaded afresh, with the new file's content
    assert resaved is not first and resaved.chat_template == "{{ 'x' }}"
    assert shared_tokenizer(twin) is first
    # a directory AutoTokenizer decides for is keyed by its path: no twin shares it
    overridden = next(iter(tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS))
    o1, o2 = _saved(tmp_path / "o1", TOK, overridden), _saved(tmp_path / "o2", TOK, overridden)
    assert shared_tokenizer(o1) is shared_tokenizer(o1) and shared_tokenizer(o2) is not shared_tokenizer(o1)


def test_asyncrls_encoding_leaves_a_shared_backend_as_it_was(tmp_path, monkeypatch) -> None:
    """What makes sharing one tokenizer across the parts (and threads) of a process safe: the
    encodings and decodings asyncrl does never set padding or truncation on the Rust backend
    (the only calls that take it mutably), so concurrent use cannot change another's result."""
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.workloads.checkpoints import shared_tokenizer
    from asyncrl.workloads.prompts import render_chat
    from asyncrl.workloads.tasks import prompt_token_ids

    for name, tok in (("char", TOK), ("qwen", _qwen())):
        shared = shared_tokenizer(_saved(tmp_path / name, tok, "qwen3" if name == "qwen" else "llama"))
        prompts = [f"{i}+{i * 7}=" for i in range(64)]
        expected = prompt_token_ids(tok, prompts)
        strategies = set()  # what every encode asked of the backend
        real = shared.set_truncation_and_padding

        def spy(*a, real=real, strategies=strategies, **k):
            strategies.add((k["padding_strategy"].value, k["truncation_strategy"].value))
            return real(*a, **k)

        monkeypatch.setattr(shared, "set_truncation_and_padding", spy)

        def encode(_: int, shared=shared, prompts=prompts) -> list[list[int]]:
            ids = prompt_token_ids(shared, prompts)
            shared.batch_decode(ids, skip_special_tokens=True)
            shared([p[::-1] for p in prompts], add_special_tokens=False)
            if shared.chat_template:
                render_chat(shared, [{"role": "user", "content": prompts[0]}], "test")
            return ids

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(encode, range(16)))
        assert all(r == expected for r in results)
        assert strategies == {("do_not_pad", "do_not_truncate")}
        assert shared.backend_tokenizer.padding is None and shared.backend_tokenizer.truncation is None
