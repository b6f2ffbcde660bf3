"""Prompt files: each format, the ``messages`` column, metadata to the reward, one-line errors."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl import records as R
from asyncrl.lab.tasks import Addition
from asyncrl.stream import local_reader
from asyncrl.workloads.prompts import (
    PromptSource,
    answers,
    metadata,
    prompt_ids,
    prompt_token_ids,
    read_file,
)
from asyncrl.workloads.tasks import reward_function
from asyncrl.workloads.tokenizer import char_tokenizer

TOK = char_tokenizer()
ROWS = [
    {"prompt": "1+1=", "answer": "2", "level": 1, "tags": ["easy"]},
    {"prompt": "2+2=", "answer": None, "level": 2, "tags": []},
]


def read_all(src: PromptSource) -> pa.Table:
    return pa.concat_tables(list(local_reader(src.kind)(src.files)), promote_options="default")


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_datasets_folder(folder, table: pa.Table, shards: int = 1) -> None:
    """What ``datasets`` 5.2 ``Dataset.save_to_disk`` writes (checked against it): state.json
    listing Arrow IPC *stream* files."""
    folder.mkdir()
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    per = -(-table.num_rows // shards)
    for i, name in enumerate(names):
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table.slice(i * per, per))
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (folder / "dataset_info.json").write_text("{}")


# --- each format --------------------------------------------------------------------------------------
def test_jsonl_parquet_directory_and_datasets_folder_read_the_same_rows(tmp_path) -> None:
    write_jsonl(tmp_path / "p.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet")
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:1]), shards / "b.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[1:]), shards / "a.parquet")
    (shards / "_SUCCESS").write_text("")
    (shards / ".hidden.parquet").write_text("junk")
    write_datasets_folder(tmp_path / "hf", pa.Table.from_pylist(ROWS), shards=2)
    for path, kind in (
        ("p.jsonl", "jsonl"),
        ("p.parquet", "parquet"),
        ("shards", "parquet"),
        ("hf", "arrow"),
    ):
        src = PromptSource.open(tmp_path / path)
        assert src.kind == kind and src.prompt_column == "prompt", path
        table = read_all(src)
        got = sorted(table.column("prompt").to_pylist())
        assert got == ["1+1=", "2+2="], path
        assert answers(table).tolist() == [
            "" if r["answer"] is None else r["answer"] for r in table.to_pylist()
        ]
    assert [p.rsplit("/", 1)[1] for p in PromptSource.open(shards).files] == ["a.parquet", "b.parquet"]


def test_a_real_datasets_save_to_disk_folder(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    table = read_all(PromptSource.open(tmp_path / "ds"))
    assert table.column("prompt").to_pylist() == ["1+1=", "2+2="]


def test_read_file_yields_batches_not_the_whole_file(tmp_path) -> None:
    pq.write_table(pa.table({"prompt": [f"{i}=" for i in range(50)]}), tmp_path / "p.parquet")
    sizes = [t.num_rows for t in read_file(str(tmp_path / "p.parquet"), "parquet", batch_rows=16)]
    assert sizes == [16, 16, 16, 2]


# --- rows -> prompts ----------------------------------------------------------------------------------
def test_prompt_ids_prompt_id_column_or_a_stable_hash() -> None:
    t = pa.Table.from_pylist([{"prompt": "a", "prompt_id": 7}, {"prompt": "b", "prompt_id": 9}])
    assert prompt_ids(t, "prompt").tolist() == [7, 9]
    h = prompt_ids(pa.table({"prompt": ["a", "b", "a"]}), "prompt")
    assert h[0] == h[2] != h[1] and (h >= 0).all()
    with pytest.raises(ValueError, match="'prompt_id' value is not an integer"):
        prompt_ids(pa.table({"prompt": ["a"], "prompt_id": ["x"]}), "prompt")


def test_messages_render_through_the_chat_template() -> None:
    chats = [
        [{"role": "user", "content": "1+1="}],
        [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}],
    ]
    t = pa.table({"messages": chats})
    ids = prompt_token_ids(t, "messages", TOK, "x")
    assert ids[0] == TOK("1+1=")["input_ids"]  # one user turn = the plain prompt
    assert TOK.decode(ids[1]) == "<bos>add\n2+2="


def test_messages_errors_are_one_line(tmp_path) -> None:
    def bad(chats, tokenizer=TOK) -> str:
        with pytest.raises(ValueError) as err:
            prompt_token_ids(pa.table({"messages": chats}), "messages", tokenizer, "f.jsonl")
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "ends with an assistant turn" in bad(
        [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    )
    assert "not a non-empty list" in bad([[]])
    assert "not a non-empty list" in bad([[{"role": "user"}]])
    plain = char_tokenizer()
    plain.chat_template = None
    assert "no chat template" in bad([[{"role": "user", "content": "q"}]], plain)
    plain.name_or_path = "/models/student"  # what a tokenizer loaded from a checkpoint says
    msg = bad([[{"role": "user", "content": "q"}]], plain)
    assert "'f.jsonl'" in msg and "student checkpoint '/models/student'" in msg and "save_pretrained" in msg


def test_metadata_is_every_other_column_as_json() -> None:
    import datetime

    t = pa.Table.from_pylist(
        [
            {
                "prompt": "a",
                "answer": "1",
                "prompt_id": 3,
                "level": 2,
                "tags": ["x"],
                "when": datetime.date(2024, 1, 2),
            }
        ]
    )
    assert json.loads(metadata(t)[0]) == {"level": 2, "tags": ["x"], "when": "2024-01-02"}
    assert metadata(pa.table({"prompt": ["a"]})).tolist() == ["{}"]
    with pytest.raises(ValueError, match="cannot reach the reward as JSON"):
        metadata(pa.table({"prompt": ["a"], "blob": [b"\x00"]}))


# --- metadata reaches the reward ----------------------------------------------------------------------
class LevelTask(Addition):
    """Reward = the row's ``level`` metadata when the answer matches (a metadata-aware reward)."""

    def reward(self, completion: str, answer: str, metadata: Mapping[str, Any] | None = None) -> float:
        return float((metadata or {})["level"]) if completion.strip() == answer else 0.0


def test_reward_function_passes_metadata_only_to_rewards_that_take_it() -> None:
    assert reward_function(LevelTask())("2", "2", {"level": 3}) == 3.0
    assert reward_function(Addition())("2", "2", {"level": 3}) == 1.0

    class TwoArgs:
        name = "two"

        def reward(self, completion: str, answer: str) -> float:
            return 0.5

    assert reward_function(TwoArgs())("x", "y", {"level": 1}) == 0.5  # type: ignore[arg-type]

    class Kwargs:
        def reward(self, completion: str, answer: str, **kw: Any) -> float:
            return float(kw["metadata"]["level"])

    assert reward_function(Kwargs())("x", "y", {"level": 4}) == 4.0  # type: ignore[arg-type]


def test_the_reward_stage_hands_each_sample_its_metadata(tmp_path) -> None:
    from asyncrl.stages import ScoreReward

    TOK.save_pretrained(tmp_path / "tok")
    stage = ScoreReward(task="addition", tokenizer_dir=str(tmp_path / "tok"))
    stage.reward = reward_function(LevelTask())
    completions = [
        TOK("2", add_special_tokens=False)["input_ids"],
        TOK("5", add_special_tokens=False)["input_ids"],
    ]
    batch = {
        R.COMPLETION_IDS: np.asarray(completions),
        R.COMPLETION_MASK: np.ones((2, 1), dtype=bool),
        R.ANSWER: np.asarray(["2", "5"], dtype=object),
        R.METADATA: np.asarray([json.dumps({"level": 3}), json.dumps({"level": 7})], dtype=object),
    }
    assert stage.rewards(batch).tolist() == [3.0, 7.0]
    del batch[R.METADATA]  # a built-in task's blocks carry no metadata
    stage.reward = reward_function(Addition())
    assert stage.rewards(batch).tolist() == [1.0, 1.0]


# --- errors -------------------------------------------------------------------------------------------
def one_line_error(path, exc=ValueError) -> str:
    with pytest.raises(exc) as err:
        src = PromptSource.open(path)
        read_all(src)
    text = str(err.value)
    assert "\n" not in text, text
    return text


def test_bad_sources_fail_with_one_line_naming_the_file_and_the_fix(tmp_path) -> None:
    assert "does not exist" in one_line_error(tmp_path / "missing.jsonl", FileNotFoundError)
    csv = tmp_path / "p.csv"
    csv.write_text("prompt\n1\n")
    assert "unsupported extension '.csv'" in one_line_error(csv)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "no rows" in one_line_error(empty)
    text = tmp_path / "text.jsonl"
    write_jsonl(text, [{"text": "1+1="}])
    msg = one_line_error(text)
    assert "no 'prompt' column (nor a chat 'messages' column" in msg and "'text'" in msg
    both = tmp_path / "both.jsonl"
    write_jsonl(both, [{"prompt": "a", "messages": []}])
    assert "both a 'prompt' and a 'messages'" in one_line_error(both)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{not json\n')
    msg = one_line_error(broken)
    assert "broken.jsonl" in msg and "line 2 is not valid JSON" in msg
    notpq = tmp_path / "fake.parquet"
    notpq.write_text("hello")
    assert "not a readable Parquet file" in one_line_error(notpq)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), mixed / "b.parquet")
    assert "mixes Parquet and JSONL" in one_line_error(mixed)
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    assert "without .parquet or .jsonl files" in one_line_error(nothing)
    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text("{}")
    (dd / "train").mkdir()
    assert "DatasetDict" in one_line_error(dd) and "dd/train" in one_line_error(dd)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-0.arrow"}]}))
    assert "lacks its data files" in one_line_error(hf)


def test_non_string_prompts_fail_with_one_line() -> None:
    for value, needle in (
        (None, "a non-string 'prompt'"),
        ("", "an empty 'prompt'"),
        (" ", "an empty 'prompt'"),
    ):
        with pytest.raises(ValueError, match=f"f.jsonl': a row has {needle}"):
            prompt_token_ids(pa.table({"prompt": pa.array(["ok", value])}), "prompt", TOK, "f.jsonl")


def test_head_checks_rows_by_number_and_load_prompts_reads_examples(tmp_path) -> None:
    """What ``asyncrl validate`` reads of a prompt file: the first rows, checked row by row."""
    from asyncrl.workloads.prompts import load_prompts

    path, ok = tmp_path / "p.jsonl", tmp_path / "ok.jsonl"
    write_jsonl(path, [*ROWS, {"prompt": "  "}])
    write_jsonl(ok, ROWS)
    src = PromptSource.open(path)
    assert sum(t.num_rows for _, t, _ in src.head(len(ROWS))) == len(ROWS)  # the blank row unread
    with pytest.raises(ValueError, match=rf"p.jsonl': row {len(ROWS)} has an empty 'prompt'; remove the row"):
        src.head(len(ROWS) + 1)
    examples = load_prompts(ok)
    assert [e.prompt for e in examples] == [r["prompt"] for r in ROWS]
    assert [e.answer for e in examples] == [str(r.get("answer") or "") for r in ROWS]
