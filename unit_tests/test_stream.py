"""The prompt stream: ids, groups and blocks (BlockCutter), and the streamed file order
(FileStream over the Ray-free reader): seeded epochs, windows, resume without repeats,
laziness, the prompt width."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pytest

from asyncrl import records as R
from asyncrl.stream import BlockCutter, FileStream, local_reader
from asyncrl.workloads.prompts import PromptSource
from asyncrl.workloads.tokenizer import char_tokenizer

TOK = char_tokenizer()


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def addition_rows(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"{i}+0=", "answer": str(i), "k": i} for i in range(start, start + n)]


def stream(source, *, G=1, local=4, window=1000, seed=0, skip=None, reader=None, **kw) -> FileStream:
    return FileStream(
        source,
        TOK,
        seed=seed,
        group_size=G,
        block_samples=local,
        window=window,
        skip_ids=skip,
        reader=reader or local_reader(source.kind),
        **kw,
    )


def take(s: FileStream, n: int) -> list[dict[str, np.ndarray]]:
    return [s.block(i) for i in range(n)]


def keys_of(blocks) -> list[int]:
    """The metadata key ``k`` (= the row's index in the files) of every sample, in stream order."""
    return [json.loads(m)["k"] for b in blocks for m in b[R.METADATA]]


# --- BlockCutter -------------------------------------------------------------------------------------
def test_cutter_assigns_group_ids_sample_ids_and_block_indices() -> None:
    c = BlockCutter(group_size=2, block_samples=4)
    c.add({"x": np.arange(3)}, np.arange(3))
    blocks = list(c.blocks())
    assert len(blocks) == 1  # 6 samples: one block of 4, 2 wait
    b = blocks[0]
    assert b[R.SAMPLE_ID].tolist() == [0, 1, 2, 3]
    assert b[R.GROUP_ID].tolist() == [0, 0, 1, 1]
    assert b["x"].tolist() == [0, 0, 1, 1]
    assert b[R.BLOCK_INDEX].tolist() == [0] * 4
    c.add({"x": np.arange(3, 4)}, np.asarray([7]))  # positions may have gaps (skipped rows)
    (b,) = list(c.blocks())
    assert b[R.SAMPLE_ID].tolist() == [4, 5, 14, 15] and b[R.BLOCK_INDEX].tolist() == [1] * 4
    assert list(c.blocks()) == []


def test_cutter_drops_ledger_ids_and_renumbers_blocks() -> None:
    c = BlockCutter(group_size=2, block_samples=4, skip_ids=np.asarray([0, 1, 2, 3, 8, 9]))
    assert c.consumed(np.arange(6)).tolist() == [True, True, False, False, True, False]
    c.add({"x": np.arange(6)}, np.arange(6))
    blocks = list(c.blocks())
    assert [b[R.SAMPLE_ID].tolist() for b in blocks] == [[4, 5, 6, 7]]
    assert blocks[0][R.BLOCK_INDEX].tolist() == [0] * 4  # a resumed stream starts at block 0


def test_cutter_refuses_blocks_of_partial_groups() -> None:
    with pytest.raises(ValueError, match="whole groups"):
        BlockCutter(group_size=3, block_samples=4)


# --- FileStream ---------------------------------------------------------------------------------------
def test_each_epoch_is_a_seeded_permutation_of_every_row(tmp_path) -> None:
    src = PromptSource.open(write_jsonl(tmp_path / "p.jsonl", addition_rows(10)))
    blocks = take(stream(src, local=5), 6)  # three epochs of 10 rows
    keys = keys_of(blocks)
    epochs = [keys[0:10], keys[10:20], keys[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert keys_of(take(stream(src, local=5), 6)) == keys  # deterministic given the seed
    assert keys_of(take(stream(src, local=5, seed=1), 2)) != keys[:10]
    ids = np.concatenate([b[R.SAMPLE_ID] for b in blocks])
    assert ids.tolist() == list(range(30))  # sample id = stream position
    assert [int(b[R.BLOCK_INDEX][0]) for b in blocks] == list(range(6))
    b = blocks[0]
    assert b[R.PROMPT_IDS].shape == b[R.PROMPT_MASK].shape == (5, 5)  # P = longest "N+0=" + <bos>
    k = json.loads(b[R.METADATA][0])["k"]
    assert b[R.ANSWER][0] == str(k)
    row = b[R.PROMPT_IDS][0][b[R.PROMPT_MASK][0]].tolist()
    assert row == TOK(f"{k}+0=")["input_ids"]


def test_rows_are_shuffled_within_windows_and_files_in_seeded_order(tmp_path) -> None:
    d = tmp_path / "shards"
    d.mkdir()
    for f in range(3):  # three files of 8 rows, keys 8f .. 8f+7
        write_jsonl(d / f"part-{f}.jsonl", addition_rows(8, start=8 * f))
    src = PromptSource.open(d)
    assert src.kind == "jsonl" and len(src.files) == 3
    keys = keys_of(take(stream(src, local=4, window=4), 12))  # two epochs, windows of 4 rows
    for e in range(2):
        epoch = keys[24 * e : 24 * (e + 1)]
        files = [epoch[8 * i] // 8 for i in range(3)]
        assert sorted(files) == [0, 1, 2]
        order = np.random.default_rng([0, e]).permutation(3)
        assert files == order.tolist()  # files in the seeded order
        for w in range(6):  # each window: a permutation of 4 consecutive rows of one file
            window = epoch[4 * w : 4 * (w + 1)]
            assert sorted(window) == list(range(min(window), min(window) + 4)) and min(window) % 4 == 0


def test_groups_repeat_each_prompt(tmp_path) -> None:
    src = PromptSource.open(write_jsonl(tmp_path / "p.jsonl", addition_rows(6)))
    b = stream(src, G=3, local=6).block(0)
    assert b[R.GROUP_ID].tolist() == [0, 0, 0, 1, 1, 1]
    assert b[R.SAMPLE_ID].tolist() == list(range(6))
    assert len(set(b[R.METADATA][:3])) == 1 and b[R.METADATA][0] != b[R.METADATA][3]


def test_resume_skips_the_ledger_without_repeats_or_gaps(tmp_path) -> None:
    """A run that consumed blocks 0..4 and had 5..6 in flight: the resumed stream holds every
    sample of the uninterrupted stream but the ledger's, in the same order, once."""
    src = PromptSource.open(write_jsonl(tmp_path / "p.jsonl", addition_rows(7)))  # epochs of 7 rows
    full = take(stream(src, G=2, local=4), 12)
    ledger = np.concatenate([b[R.SAMPLE_ID] for b in full[:5]])
    resumed = take(stream(src, G=2, local=4, skip=ledger), 7)
    before = np.concatenate([b[R.SAMPLE_ID] for b in full])
    after = np.concatenate([b[R.SAMPLE_ID] for b in resumed])
    assert after.tolist() == [i for i in before.tolist() if i not in set(ledger.tolist())]
    assert [int(b[R.BLOCK_INDEX][0]) for b in resumed] == list(range(7))
    same = {int(i): m for b in full for i, m in zip(b[R.SAMPLE_ID], b[R.METADATA])}
    assert all(same[int(i)] == m for b in resumed for i, m in zip(b[R.SAMPLE_ID], b[R.METADATA]))


def test_the_stream_reads_lazily(tmp_path) -> None:
    """Block 0 needs one window, not the file: a source far larger than the run is never read whole."""
    src = PromptSource.open(write_jsonl(tmp_path / "p.jsonl", addition_rows(5000)))
    seen = []

    def counting(files: Sequence[str]) -> Iterator[pa.Table]:
        for table in local_reader("jsonl")(files):
            for part in table.to_batches(max_chunksize=100):
                seen.append(part.num_rows)
                yield pa.Table.from_batches([part])

    s = stream(src, local=8, window=200, reader=counting)
    s.block(0)
    assert sum(seen) == 200
    s.block(40)  # 328 rows in: two more windows
    assert sum(seen) == 400


def test_a_restarted_stream_replays_up_to_the_block_asked_for(tmp_path) -> None:
    src = PromptSource.open(write_jsonl(tmp_path / "p.jsonl", addition_rows(9)))
    first = take(stream(src), 4)
    again = stream(src).block(3)
    assert again[R.SAMPLE_ID].tolist() == first[3][R.SAMPLE_ID].tolist()
    s = stream(src)
    s.block(2)
    with pytest.raises(ValueError, match="already produced"):
        s.block(1)


def test_prompts_longer_than_the_width_are_skipped_with_a_warning(tmp_path) -> None:
    rows = [*addition_rows(6), {"prompt": "9" * 30 + "=", "answer": "x", "k": 99}]
    src = PromptSource.open(write_jsonl(tmp_path / "p.jsonl", rows))
    warnings: list[str] = []
    s = stream(src, local=3, max_prompt_tokens=6, warn=warnings.append)
    blocks = take(s, 4)
    assert 99 not in keys_of(blocks) and sorted(keys_of(blocks)[:6]) == list(range(6))
    assert len(warnings) == 1 and "32 tokens" in warnings[0] and "workload.max_prompt_tokens" in warnings[0]
    assert blocks[0][R.PROMPT_IDS].shape[1] == 6
    ids = np.concatenate([b[R.SAMPLE_ID] for b in blocks[:2]]).tolist()
    assert len(set(ids)) == 6 and set(ids) < set(range(7))  # epoch 0: 7 positions, the long one unused


def test_messages_use_the_chat_template(tmp_path) -> None:
    rows = [{"messages": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(4)]
    src = PromptSource.open(write_jsonl(tmp_path / "chat.jsonl", rows))
    assert src.prompt_column == "messages"
    b = stream(src, local=4).block(0)
    for ids, mask, answer in zip(b[R.PROMPT_IDS], b[R.PROMPT_MASK], b[R.ANSWER]):
        i = int(answer) - 1  # one user turn encodes exactly as the plain prompt does
        assert ids[mask].tolist() == TOK(f"{i}+1=")["input_ids"]
    assert b[R.METADATA].tolist() == ["{}"] * 4


def test_an_empty_source_fails_with_one_line(tmp_path) -> None:
    f = tmp_path / "p.jsonl"
    write_jsonl(f, addition_rows(2))
    src = PromptSource.open(f)
    f.write_text("")  # emptied after the plan was made

    with pytest.raises(ValueError, match="no rows"):
        stream(src).block(0)


@pytest.mark.parametrize("name", ["char", "qwen"])
def test_streamed_prompts_encode_as_the_models_are_prompted(tmp_path, name) -> None:
    """A ``prompt`` row reaches the generators with the ids ``encode_prompts`` gives a built-in
    task's prompt: a user turn of the chat template for qwen, ``<bos>`` + text for char."""
    from asyncrl.workloads.tasks import encode_prompts
    from asyncrl.workloads.tokenizer import TOKENIZERS

    tok = TOKENIZERS.get(name).build()
    rows = addition_rows(4)
    src = PromptSource.open(write_jsonl(tmp_path / "p.jsonl", rows))
    s = FileStream(
        src, tok, seed=0, group_size=1, block_samples=4, window=1, reader=local_reader(src.kind)
    )  # window 1: file order
    (block,) = take(s, 1)
    ids, mask = encode_prompts(tok, [r["prompt"] for r in rows], block[R.PROMPT_IDS].shape[1])
    assert np.array_equal(block[R.PROMPT_IDS], ids.numpy())
    assert np.array_equal(block[R.PROMPT_MASK], mask.numpy())
    if name == "qwen":
        assert tok.decode(block[R.PROMPT_IDS][0][block[R.PROMPT_MASK][0]]).startswith(
            "<|im_start|>user\n0+0="
        )
