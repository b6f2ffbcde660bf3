"""GGUF files as checkpoints (``asyncrl.workloads.gguf``): tiny GGUF files written here by the
``gguf`` package, as llama.cpp's ``convert_hf_to_gguf.py`` writes them (its tensor names, its
q/k row permutation for Llama, its transposes for GPT-2, a byte-level BPE vocabulary with merges
and a chat template as metadata), converted and checked against the model they were written
from: logits, token ids, the chat template, the learner's and the HF engine's loaders. Then the
conversion cache, the one-line errors, and the plan's refusals (``asyncrl validate``: no Ray)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from asyncrl.cli import main
from asyncrl.configurable import ConfigError
from asyncrl.workloads import gguf as G
from asyncrl.workloads.checkpoints import load_model, load_tokenizer, read_meta
from asyncrl.workloads.tokenizer import CHATML_TEMPLATE

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "configs" / "opd_tiny.yaml"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: unk, bos, eos (= pad)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "12 + 345 = 357, 1000 - 1 = 999",
    "user: what is the capital of France? assistant: Paris.",
    "Hello, world! hello WORLD; system prompts and chat templates",
]
TEXTS = [
    "the lazy fox",
    "12 + 34 = 46",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "unseen wörds ünïcode 🙂 and  double  spaces\n\ttabs",
]

#: GGUF architecture name -> the gguf package's enum (its tensor-name maps)
ARCHS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}

torch.set_num_threads(1)


# --- writing a GGUF file as llama.cpp does ----------------------------------------------------------------
def bpe_tokenizer(vocab_size: int = 300, chat_template: str | None = CHATML_TEMPLATE, *, pre: str = "gpt-2"):
    """A byte-level BPE (what ``tokenizer.ggml.model = gpt2`` describes), split before merging as
    GPT-2 (``pre="gpt-2"``) or Qwen2 (``pre="qwen2"``: digits one by one) split text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "qwen2":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=SPECIALS[0],
        bos_token=SPECIALS[1],
        eos_token=SPECIALS[2],
        pad_token=SPECIALS[2],
        chat_template=chat_template,
    )
    out.gguf_pre = pre  # what write_gguf states as tokenizer.ggml.pre
    return out


def tiny_model(kind: str, vocab: int, *, tied: bool = True, seed: int = 0) -> torch.nn.Module:
    """A 2-layer model of ``kind`` with weights far from the init (so a wrong permutation, a
    missed transpose or a dropped bias shows in the logits)."""
    import transformers as T

    common = {"vocab_size": vocab, "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2}
    if kind == "gpt2":
        config = T.GPT2Config(n_positions=48, n_embd=64, n_layer=2, n_head=4, n_inner=96, **common)
    else:
        decoder = {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 48,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
        }
        cls = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config}[kind]
        config = cls(**decoder, **common, **({"head_dim": 16} if kind == "qwen3" else {}))
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name or ".ln_" in name) and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (rotary pairs interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, tok, path: Path, *, q8: bool = False, arch: str | None = None) -> Path:
    """``model`` and ``tok`` as a GGUF file (F32 tensors; 2-D ones as Q8_0 with ``q8``, in which
    case ``model``'s weights are set to their dequantised values, the reference to compare with)."""
    cfg = model.config
    kind = cfg.model_type
    arch = arch or kind
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{kind}")
    if kind == "gpt2":
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_feed_forward_length(cfg.n_inner)
        w.add_block_count(cfg.n_layer)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if kind == "llama":
            w.add_rope_dimension_count(head_dim)
        if kind == "qwen3":
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_vocab_size(cfg.vocab_size)
    # the tokenizer, as llama.cpp's gpt2-style vocab writer stores it
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tok.all_special_tokens)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.gguf_pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3: CONTROL, 1: NORMAL
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_unk_token_id(tok.unk_token_id)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
    # the tensors, with llama.cpp's names and layout
    names = gguf.get_tensor_name_map(ARCHS[arch], 2)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied head
        data = t.detach().float().numpy().copy()
        if q8 and data.ndim == 2:
            blocks = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            data = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).reshape(data.shape)
            with torch.no_grad():  # the reference model holds what the file holds
                t.copy_(torch.from_numpy(data))
        if kind == "llama" and name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        if kind == "llama" and name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        if kind == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            data = data.T.copy()  # HF's Conv1D stores [in, out]
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        if q8 and data.ndim == 2:
            blocks = gguf.quants.quantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(new, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(new, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


# --- the round trip ---------------------------------------------------------------------------------------
CASES = {  # id: (model type, tied embeddings, Q8_0 weights, tokenizer.ggml.pre, the HF engine's decode path)
    "llama": ("llama", True, False, "gpt-2", "fast"),
    "llama-untied-q8_0": ("llama", False, True, "gpt-2", "fast"),
    "qwen2": ("qwen2", True, False, "qwen2", "hf"),
    "qwen3": ("qwen3", False, False, "qwen2", "fast"),
    "gpt2": ("gpt2", True, False, "gpt-2", "hf"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_gguf_file_converts_to_the_model_and_tokenizer_it_was_written_from(
    case: str, tmp_path: Path
) -> None:
    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.hf import HFEngine

    kind, tied, q8, pre, decode_path = CASES[case]
    tok = bpe_tokenizer(pre=pre)
    model = tiny_model(kind, len(tok), tied=tied)
    src = write_gguf(model, tok, tmp_path / f"{case}.gguf", q8=q8)
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(src)).tensors}
    assert ("Q8_0" in types) == q8

    out = G.gguf_to_checkpoint(src, tmp_path / "converted")
    meta = read_meta(out)
    st = src.stat()
    assert meta["source"] == {
        "format": "gguf",
        "file": str(src.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "architecture": kind,
        "name": f"tiny-{kind}",
        "file_type": None,
    }
    assert meta["versions"]["gguf"] == "0.19.0" and meta["versions"]["transformers"]
    assert meta["chat_template"] is True and meta["vocab_size"] == len(tok) and meta["model_type"] == kind
    assert "quantization_config" not in json.loads((out / "config.json").read_text())

    # the learner's loader: same config, same weights, same logits
    converted, ctok = load_model(out)
    assert meta["parameters"] == sum(p.numel() for p in model.parameters())
    assert converted.config.tie_word_embeddings == tied
    if tied:
        assert converted.get_output_embeddings().weight is converted.get_input_embeddings().weight
    if kind == "qwen3":
        assert converted.config.head_dim == 16  # restored: the reader leaves Qwen3Config's 128
    if kind == "gpt2":
        assert (converted.config.n_positions, converted.config.n_inner) == (48, 96)
    else:
        assert converted.config.rope_parameters["rope_theta"] == 5000.0
    ids = torch.randint(0, len(tok), (2, 12), generator=torch.Generator().manual_seed(1))
    ref = logits(model, ids)
    assert ref.std() > 1.0  # far from uniform: a misplaced weight would show
    torch.testing.assert_close(logits(converted, ids), ref, rtol=1e-5, atol=1e-4)

    # the tokenizer: same ids, special tokens, chat template
    assert len(ctok) == len(tok) and ctok.get_vocab() == tok.get_vocab()
    assert ctok(TEXTS)["input_ids"] == tok(TEXTS)["input_ids"]
    assert (ctok.bos_token, ctok.eos_token, ctok.pad_token) == (tok.bos_token, tok.eos_token, tok.pad_token)
    assert ctok.chat_template == CHATML_TEMPLATE
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2 = ?"}]
    assert ctok.apply_chat_template(chat, add_generation_prompt=True) == tok.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert ctok.decode(ctok(TEXTS[3])["input_ids"]) == TEXTS[3]

    # the HF engine: its fast decoder for llama/qwen3, transformers' forward for the others;
    # the same samples and log-probabilities as the original model
    engine = HFEngine.from_pretrained(out)
    assert engine.decode_path == decode_path, engine.decode_reason
    prompt = torch.tensor(ctok([TEXTS[0], TEXTS[1]])["input_ids"][0][:4]).repeat(2, 1)
    mask = torch.ones_like(prompt, dtype=torch.bool)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    a = engine.generate(prompt, mask, params, seed=3)
    b = HFEngine(model, tok, decode=decode_path).generate(prompt, mask, params, seed=3)
    assert torch.equal(a["completion_ids"], b["completion_ids"])
    torch.testing.assert_close(a["behavior_logprobs"], b["behavior_logprobs"], rtol=1e-4, atol=1e-4)


def test_a_gguf_without_a_chat_template_converts_without_one(tmp_path: Path) -> None:
    tok = bpe_tokenizer(chat_template=None)
    src = write_gguf(tiny_model("llama", len(tok)), tok, tmp_path / "plain.gguf")
    out = G.gguf_to_checkpoint(src, tmp_path / "out")
    assert read_meta(out)["chat_template"] is False and not load_tokenizer(out).chat_template


def test_a_tokenizer_that_reloads_differently_from_the_file_is_a_warning(tmp_path: Path) -> None:
    """transformers loads a qwen2 directory's tokenizer as Qwen2Tokenizer, with Qwen2's digit
    split, whatever the file said: a qwen2 file with GPT-2's split is converted, with a warning."""
    tok = bpe_tokenizer(pre="gpt-2")
    src = write_gguf(tiny_model("qwen2", len(tok)), tok, tmp_path / "odd.gguf")
    with pytest.warns(UserWarning, match=r"as Qwen2Tokenizer.*tokenizer.ggml.pre='gpt-2'"):
        out = G.gguf_to_checkpoint(src, tmp_path / "out")
    assert load_tokenizer(out)("12")["input_ids"] != tok("12")["input_ids"]


# --- the cache --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = bpe_tokenizer()
    return write_gguf(tiny_model("llama", len(tok)), tok, tmp_path_factory.mktemp("src") / "tiny.gguf")


def counting(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = G.gguf_to_checkpoint

    def convert(src, out, **kw):
        calls.append(Path(out))
        return real(src, out, **kw)

    monkeypatch.setattr(G, "gguf_to_checkpoint", convert)
    return calls


def test_materialize_converts_once_and_again_after_the_file_changes(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "model.gguf"
    src.write_bytes(tiny_gguf.read_bytes())
    calls = counting(monkeypatch)
    cache = tmp_path / "cache"
    first = Path(G.materialize(src, cache))
    assert first.parent == cache / "gguf" and first.name.startswith("model-") and len(calls) == 1
    weights = (first / "model.safetensors").stat()
    assert Path(G.materialize(str(src), cache)) == first and len(calls) == 1  # reused
    assert (first / "model.safetensors").stat().st_mtime_ns == weights.st_mtime_ns
    # a directory, or a missing path that is not a .gguf, is returned as it is
    assert G.materialize(first, cache) == str(first)
    assert G.materialize(tmp_path / "nope", cache) == str(tmp_path / "nope")

    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed
    second = Path(G.materialize(src, cache))
    assert (
        second != first
        and len(calls) == 2
        and read_meta(second)["source"]["mtime_ns"] == src.stat().st_mtime_ns
    )
    assert Path(G.materialize(src, cache)) == second and len(calls) == 2


def test_an_interrupted_conversion_never_looks_complete(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncrl.workloads import checkpoints

    cache = tmp_path / "cache"
    target = G.cached_dir(tiny_gguf, cache)

    def interrupted(src, dst):  # every file written, then killed before the rename
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(checkpoints.os, "replace", interrupted)
        with pytest.raises(KeyboardInterrupt):
            G.materialize(tiny_gguf, cache)
    assert not target.exists() and [p.name for p in target.parent.iterdir()] == [f".{target.name}.lock"]
    # a directory left incomplete some other way (no meta: not written by a finished conversion)
    target.mkdir()
    (target / "config.json").write_text("{}")
    calls = counting(monkeypatch)
    assert Path(G.materialize(tiny_gguf, cache)) == target and len(calls) == 1
    assert read_meta(target)["source"]["file"] == str(tiny_gguf.resolve())


# --- one-line errors --------------------------------------------------------------------------------------
def test_bad_gguf_paths_are_one_line_errors_naming_the_field_the_file_and_the_fix(tmp_path: Path) -> None:
    def error(path: Path) -> str:
        with pytest.raises(ConfigError) as err:
            G.materialize(path, tmp_path / "cache", field="workload.teacher_path")
        msg = str(err.value)
        assert "\n" not in msg and "workload.teacher_path" in msg and str(path) in msg, msg
        assert "save_pretrained" in msg or ".gguf" in msg
        return msg

    assert "does not exist" in error(tmp_path / "missing.gguf")
    (tmp_path / "notes.gguf").write_text("not a model")
    assert "not a GGUF file" in error(tmp_path / "notes.gguf")
    (tmp_path / "weights.bin").write_bytes(b"\x80\x04 pickle")
    assert "not a GGUF file" in error(tmp_path / "weights.bin")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00")
    assert "header does not read" in error(tmp_path / "cut.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    msg = error(tmp_path / "bert.gguf")
    assert "architecture 'bert'" in msg and "llama" in msg and "qwen3" in msg and "gpt2" in msg
    assert not (tmp_path / "cache" / "gguf").exists() or not [
        p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.startswith(".")
    ]


def test_the_supported_architectures_include_the_tested_ones() -> None:
    supported = G.architectures()
    assert {"llama", "qwen2", "qwen3", "gpt2", "mistral", "qwen2moe"} <= set(supported)
    assert not {"t5", "umt5", "general", "tokenizer"} & set(supported)


# --- the plan: GGUF paths in a config, refusals before any Ray process ------------------------------------
def validate(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str]:
    code = main(["validate", "--quiet", str(TINY), *overrides])
    return code, capsys.readouterr().err


def test_gguf_paths_validate_and_resolve_to_the_converted_directory(
    tiny_gguf: Path, tmp_path: Path, capsys
) -> None:
    from asyncrl.config import load_config
    from asyncrl.plan import absolute_paths, resolve_models

    cache = tmp_path / "cache"
    overrides = [
        f"workload.teacher_path={tiny_gguf}",
        f"workload.student_path={tiny_gguf}",
        f"workload.cache_dir={cache}",
        f"run_dir={tmp_path / 'run'}",
    ]
    code, err = validate(capsys, *overrides)
    assert code == 0 and "ok:" in err, err
    models = resolve_models(absolute_paths(load_config(TINY, overrides)), rl=False)
    converted = str(G.cached_dir(tiny_gguf, cache).resolve())
    assert models.teacher_dir == models.student_dir == converted


def test_a_tokenizer_mismatch_is_refused_naming_both_vocabularies(
    tiny_gguf: Path, tmp_path: Path, capsys
) -> None:
    tok = bpe_tokenizer(vocab_size=280)
    other = write_gguf(tiny_model("llama", len(tok), seed=1), tok, tmp_path / "other.gguf")
    cache = tmp_path / "cache"
    code, err = validate(
        capsys,
        f"workload.teacher_path={tiny_gguf}",
        f"workload.student_path={other}",
        f"workload.cache_dir={cache}",
    )
    lines = [
        ln for ln in err.strip().splitlines() if ln.startswith("asyncrl:")
    ]  # after the conversions' bars
    assert code == 2 and len(lines) == 1 and lines[0].startswith("asyncrl: error: "), err
    line = lines[0]
    t_dir, s_dir = G.cached_dir(tiny_gguf, cache).resolve(), G.cached_dir(other, cache).resolve()
    assert f"teacher tokenizer ({t_dir} (converted from {tiny_gguf}))" in line
    assert f"student tokenizer ({s_dir} (converted from {other}))" in line
    assert "teacher vocabulary 300 tokens vs student vocabulary 280 tokens" in line


def test_messages_rows_need_the_students_chat_template(tmp_path: Path, capsys) -> None:
    tok = bpe_tokenizer(chat_template=None)
    plain = write_gguf(tiny_model("llama", len(tok)), tok, tmp_path / "plain.gguf")
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cache = tmp_path / "cache"
    code, err = validate(
        capsys,
        f"workload.teacher_path={plain}",
        f"workload.student_path={plain}",
        f"workload.cache_dir={cache}",
        f"workload.prompts_path={prompts}",
        "sampling.max_new_tokens=4",
    )
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("asyncrl:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("asyncrl: error: "), err
    student = G.cached_dir(plain, cache).resolve()
    assert f"prompt file {str(prompts)!r}" in lines[0] and f"student checkpoint {str(student)!r}" in lines[0]
    assert "no chat template" in lines[0] and "tokenizer.save_pretrained" in lines[0]
