"""Prompt files: what ``workload.prompts_path`` may name, and how a row becomes a prompt.

Sources (``PromptSource.open``):

* a Parquet file (``.parquet``, ``.pq``) or a JSON Lines file (``.jsonl``, ``.json``,
  ``.ndjson``: one object per line);
* a directory of such files, all of one format, taken in sorted path order (recursively;
  names starting with ``.`` or ``_`` are skipped, as Spark and Ray skip ``_SUCCESS``);
* a ``datasets`` ``save_to_disk`` folder (``state.json`` + ``data-*.arrow`` Arrow IPC
  streams), read directly with pyarrow, so the ``datasets`` package is not needed.

Columns of a row:

* ``prompt`` (a string) **or** ``messages`` (a chat: a list of ``{"role", "content"}``
  ending with a user turn). A chat is rendered with the tokenizer's chat template
  (``add_generation_prompt=True``); a plain prompt is encoded as the built-in tasks' prompts are.
* ``answer`` (optional): the reference the task's reward compares against, as a string
  (missing or null is ``""``).
* ``prompt_id`` (optional integer): the prompt's id in telemetry; without it, a 63-bit hash of
  the prompt's text, so one prompt keeps one id over epochs and files.
* every other column is **metadata**: the row's values as a dict, handed to the reward
  (``Task.reward(completion, answer, metadata)``; ``asyncrl.workloads.tasks.reward_function``)
  and carried through the pipeline as one JSON string per sample (column ``metadata``).

Two readers over the same per-file code: ``read_file`` (pyarrow, Ray-free: the schema probe,
validation, tests) and ``read_dataset`` (Ray Data ``read_parquet`` / ``read_json`` / an Arrow
IPC datasource: the pipeline's streamed reads, ``asyncrl.stream``). Errors name the file and
the fix in one line: a missing file, an unsupported extension, a file that is not UTF-8, a
line that is not a JSON object, an unreadable Parquet file, no rows, no ``prompt`` column, a
non-string or empty prompt (``PromptSource.head`` checks rows by number, as ``asyncrl
validate`` does; ``load_prompts`` reads a small file whole as ``Example`` s).
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa

Kind = Literal["parquet", "jsonl", "arrow"]

PROMPT, MESSAGES, ANSWER, PROMPT_ID = "prompt", "messages", "answer", "prompt_id"
#: columns with a meaning of their own; every other column is metadata for the reward
RESERVED = (PROMPT, MESSAGES, ANSWER, PROMPT_ID)
SUFFIXES: dict[str, Kind] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
}
#: rows per batch of the Ray-free reader
READ_BATCH_ROWS = 8192


@dataclass(frozen=True)
class PromptSource:
    """A resolved prompt source: its files in canonical (sorted) order, their format, and
    which column holds the prompt (``prompt`` or ``messages``)."""

    path: str
    kind: Kind
    files: tuple[str, ...]
    prompt_column: str

    @classmethod
    def open(cls, path: str | Path) -> PromptSource:
        """Resolve ``path`` (see the module docstring) and probe its schema; one-line errors."""
        kind, files = _resolve(Path(path))
        columns = _first_columns(kind, files, str(path))
        return cls(str(Path(path).resolve()), kind, tuple(files), prompt_column(columns, str(path)))

    def head(self, n: int) -> list[tuple[str, pa.Table, int]]:
        """The first ``n`` rows in file order (not the stream's order), checked row by row
        (``check_rows``), as ``(file, rows, number of its first row in that file)`` pieces."""
        out: list[tuple[str, pa.Table, int]] = []
        left = n
        for f in self.files:
            first = 0
            for table in read_file(f, self.kind):
                if left <= 0:
                    return out
                table = table.slice(0, left)
                check_rows(table, self.prompt_column, f, first)
                out.append((f, table, first))
                first += table.num_rows
                left -= table.num_rows
        return out


# --- resolving a path -------------------------------------------------------------------------------
def _resolve(p: Path) -> tuple[Kind, list[str]]:
    if not p.exists():
        raise FileNotFoundError(
            f"workload.prompts_path {str(p)!r} does not exist; pass a Parquet or JSONL file, a "
            f"directory of them, or a datasets save_to_disk folder"
        )
    if p.is_file():
        return _kind_of(p), [str(p.resolve())]
    if (p / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in p.iterdir() if d.is_dir())
        raise ValueError(
            f"workload.prompts_path {str(p)!r} is a datasets DatasetDict folder; point it at one split, "
            f"e.g. {str(p / splits[0]) if splits else str(p / 'train')!r}"
        )
    if (p / "state.json").is_file():
        return "arrow", _arrow_files(p)
    files = sorted(
        f
        for f in p.rglob("*")
        if f.is_file()
        and not any(part.startswith((".", "_")) for part in f.relative_to(p).parts)
        and f.suffix.lower() in SUFFIXES
    )
    if not files:
        raise ValueError(
            f"workload.prompts_path {str(p)!r} is a directory without .parquet or .jsonl files; "
            f"put the prompt files there or point at one file"
        )
    kinds = {SUFFIXES[f.suffix.lower()] for f in files}
    if len(kinds) > 1:
        raise ValueError(
            f"workload.prompts_path {str(p)!r} mixes Parquet and JSONL files; keep one format per "
            f"directory (convert one kind, or point at a subdirectory)"
        )
    return kinds.pop(), [str(f.resolve()) for f in files]


def _kind_of(p: Path) -> Kind:
    kind = SUFFIXES.get(p.suffix.lower())
    if kind is None:
        raise ValueError(
            f"prompt file {str(p)!r}: unsupported extension {p.suffix!r}; use .parquet or .jsonl "
            f"(or a directory of them, or a datasets save_to_disk folder)"
        )
    return kind


def _arrow_files(folder: Path) -> list[str]:
    """The data files of a ``save_to_disk`` folder, in the order ``state.json`` lists them."""
    try:
        state = json.loads((folder / "state.json").read_text())
        names = [f["filename"] for f in state["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(
            f"{folder / 'state.json'} is not a datasets save_to_disk state file ({err}); "
            f"save the dataset again with Dataset.save_to_disk"
        ) from None
    if state.get("_indices_data_files"):
        raise ValueError(
            f"datasets folder {str(folder)!r} stores an indices mapping; save it with "
            f"ds.flatten_indices().save_to_disk(...)"
        )
    files = [folder / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ValueError(
            f"datasets folder {str(folder)!r} lacks its data files {missing or '(none listed)'}; "
            f"save the dataset again with Dataset.save_to_disk"
        )
    return [str(f.resolve()) for f in files]


def prompt_column(columns: Sequence[str], where: str) -> str:
    """``prompt`` or ``messages``, whichever the source has; exactly one is required."""
    has = [c for c in (PROMPT, MESSAGES) if c in columns]
    if len(has) == 1:
        return has[0]
    if not has:
        raise ValueError(
            f"prompt file {where!r} has no 'prompt' column (nor a chat 'messages' column; columns: "
            f"{sorted(columns)}); rename the column holding the prompt text to 'prompt' (or a chat to "
            f"'messages')"
        )
    raise ValueError(f"prompts {where!r} have both a 'prompt' and a 'messages' column; keep one of them")


def _first_columns(kind: Kind, files: Sequence[str], where: str) -> list[str]:
    """Column names of the first non-empty batch of the source (reads one batch, not the files)."""
    for f in files:
        for table in read_file(f, kind):
            if table.num_rows:
                return table.column_names
    raise ValueError(f"prompt file {where!r} has no rows; add at least one row with a 'prompt'")


# --- reading ------------------------------------------------------------------------------------------
def _one_line(err: BaseException | str, limit: int = 160) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_error(path: str, err: Exception) -> ValueError:
    """Why pyarrow could not read a JSON Lines file, found again line by line (only on this error
    path): not UTF-8, a line that is not JSON or not an object, a prompt that is not text."""
    try:
        with open(path, "rb") as f:
            prompt_types: list[tuple[int, Any]] = []
            for line_no, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as bad:
                    return ValueError(
                        f"prompt file {path!r} is not UTF-8 text (line {line_no}, byte {bad.start}); "
                        f"re-encode it as UTF-8"
                    )
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as bad:
                    return ValueError(
                        f"prompt file {path!r}: line {line_no} is not valid JSON ({bad.msg}); write one "
                        f"object per line"
                    )
                if not isinstance(row, dict):
                    return ValueError(
                        f"prompt file {path!r}: line {line_no} is not a JSON object; write "
                        f"{{'prompt': ...}} per line"
                    )
                prompt_types.append((line_no, row.get(PROMPT)))
    except OSError as bad:
        return ValueError(f"prompt file {path!r} cannot be read ({_one_line(bad)})")
    row = next((i for i, (_, v) in enumerate(prompt_types) if v is not None and not isinstance(v, str)), None)
    if row is not None:
        return ValueError(
            f"prompt file {path!r}: row {row} has a non-string 'prompt' ({_short(prompt_types[row][1])}); "
            f"every prompt must be text"
        )
    return ValueError(
        f"prompt file {path!r} is not valid JSON Lines ({_one_line(err)}); write one JSON object per line, "
        f"each column of one type in every row"
    )


def _parquet_error(path: str, err: Exception) -> ValueError:
    return ValueError(
        f"prompt file {path!r} is not a readable Parquet file ({_one_line(err)}); write it with "
        f"pandas.DataFrame.to_parquet, or use a .jsonl file"
    )


def read_file(path: str, kind: Kind, batch_rows: int = READ_BATCH_ROWS) -> Iterator[pa.Table]:
    """Yield one file's rows in order, a batch at a time (pyarrow; the whole file is never held)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            f = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as err:
            raise _parquet_error(path, err) from None
        batches = f.iter_batches(batch_size=batch_rows)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as err:
                raise _parquet_error(path, err) from None
            if batch is None:
                return
            yield pa.Table.from_batches([batch], schema=f.schema_arrow)
    elif kind == "jsonl":
        import pyarrow.json as pj

        try:
            reader = pj.open_json(path)
        except (pa.ArrowException, UnicodeDecodeError) as err:
            if "Empty JSON stream" in str(err):  # an empty file (or only blank lines): no rows
                return
            raise _json_error(path, err) from None
        while True:
            try:
                batch = next(reader, None)
                if batch is None:
                    return
                table = pa.Table.from_batches([batch])
                table.validate(full=True)  # pyarrow does not check UTF-8 until a value is read
            except (pa.ArrowException, UnicodeDecodeError) as err:
                raise _json_error(path, err) from None
            yield table
    else:
        yield from read_arrow_stream(pa.memory_map(path), path)


def read_arrow_stream(f: Any, path: str) -> Iterator[pa.Table]:
    """Record batches of an Arrow IPC stream (what ``datasets`` writes) as tables."""
    try:
        reader = pa.ipc.open_stream(f)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(
            f"prompt file {path!r} is not an Arrow IPC stream ({_one_line(err)}); save the dataset again "
            f"with Dataset.save_to_disk"
        ) from None
    for batch in reader:
        yield pa.Table.from_batches([batch])


def read_dataset(files: Sequence[str], kind: Kind, *, num_cpus: float = 0.25) -> Any:
    """The files as a lazy Ray Data dataset whose rows come in ``files`` order (with the
    context's ``preserve_order``): ``read_parquet``, ``read_json`` or an Arrow IPC stream
    datasource. Partition columns are not added (``partitioning=None``).

    JSON Lines go through Ray's Arrow JSON reader (``read_json`` without ``lines=True``, which
    would parse with pandas: nulls become NaN, integers floats), the parser ``read_file`` uses, so
    both readers give the same rows and types. It parses a file whole inside its read task (a
    Ray worker, not the driver): shard a very large JSONL set into files, or use Parquet, which
    is read a row group at a time."""
    import ray.data

    files = list(files)
    if kind == "parquet":
        return ray.data.read_parquet(files, partitioning=None, num_cpus=num_cpus)
    if kind == "jsonl":
        return ray.data.read_json(files, partitioning=None, num_cpus=num_cpus)
    return ray.data.read_datasource(_arrow_datasource(files), num_cpus=num_cpus)


def _arrow_datasource(files: list[str]) -> Any:
    from ray.data.datasource import FileBasedDatasource

    class ArrowStreamDatasource(FileBasedDatasource):
        """Arrow IPC stream files (``datasets`` ``save_to_disk`` shards)."""

        def _read_stream(self, f: Any, path: str) -> Iterator[pa.Table]:
            yield from read_arrow_stream(f, path)

    return ArrowStreamDatasource(files, partitioning=None)


# --- rows -> prompts --------------------------------------------------------------------------------
def _prompt_problem(value: Any) -> str | None:
    """Why a ``prompt`` value cannot be a prompt (None: it can)."""
    if not isinstance(value, str):
        return f"a non-string 'prompt' ({_short(value)}); every prompt must be text"
    if not value.strip():
        return "an empty 'prompt'; remove the row"
    return None


def check_rows(table: pa.Table, column: str, where: str, first: int = 0) -> None:
    """Every row of ``table`` (rows ``first, first + 1, ...`` of the file ``where``) has a usable
    prompt (or chat) and an integer ``prompt_id`` if it has one; the error names the row."""
    if column not in table.column_names:
        raise ValueError(
            f"prompt file {where!r}: a batch lacks the {column!r} column the source started with; give "
            f"every file the same columns"
        )
    for i, value in enumerate(table.column(column).to_pylist()):
        problem = _prompt_problem(value) if column == PROMPT else _chat_problem(value)
        if problem is not None:
            raise ValueError(f"prompt file {where!r}: row {first + i} has {problem}")
    prompt_ids(table, column, where)


def prompt_token_ids(table: pa.Table, column: str, tokenizer: Any, where: str) -> list[list[int]]:
    """Token ids of each row's prompt, as the models are prompted everywhere: a ``prompt``
    through ``asyncrl.workloads.tasks.prompt_token_ids`` (one user turn of the tokenizer's chat
    template if it has one, else the text with its special tokens: the char tokenizer's
    ``<bos>``), a ``messages`` chat rendered with the tokenizer's chat template and encoded as
    rendered (the template places BOS)."""
    from asyncrl.workloads.tasks import prompt_token_ids as task_prompt_token_ids

    if column not in table.column_names:
        raise ValueError(
            f"prompt file {where!r}: a batch lacks the {column!r} column the source started with; give "
            f"every file the same columns"
        )
    values = table.column(column).to_pylist()
    if column == PROMPT:
        for v in values:
            problem = _prompt_problem(v)
            if problem is not None:
                raise ValueError(f"prompt file {where!r}: a row has {problem}")
        return task_prompt_token_ids(tokenizer, values)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(no_chat_template(where, getattr(tokenizer, "name_or_path", None)))
    texts = [render_chat(tokenizer, chat, where) for chat in values]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def no_chat_template(where: str, checkpoint: str | None) -> str:
    """The error for ``messages`` rows and a student tokenizer without a chat template."""
    whose = f"the student checkpoint {checkpoint!r}" if checkpoint else "the student's tokenizer"
    return (
        f"prompt file {where!r} has chat 'messages' rows but {whose} has no chat template (chats are "
        f"rendered with the student's tokenizer.chat_template); save one with the student "
        f"(tokenizer.chat_template = ...; tokenizer.save_pretrained(dir)), or give 'prompt' text rows"
    )


def _chat_problem(chat: Any) -> str | None:
    """Why a ``messages`` value cannot be a prompt (None: it can)."""
    ok = (
        isinstance(chat, list)
        and chat
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in chat
        )
    )
    if not ok:
        return (
            f"a 'messages' value that is not a non-empty list of {{'role': str, 'content': str}} "
            f"({_short(chat)})"
        )
    if chat[-1]["role"] == "assistant":
        return (
            f"a chat that ends with an assistant turn ({_short(chat[-1]['content'])}); the prompt must end "
            f"with the turn to answer: move the reference to the 'answer' column"
        )
    return None


def render_chat(tokenizer: Any, chat: Any, where: str) -> str:
    """One ``messages`` value through the chat template, with the assistant turn opened."""
    problem = _chat_problem(chat)
    if problem is not None:
        raise ValueError(f"prompt file {where!r}: a row has {problem}")
    return tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in chat],
        tokenize=False,
        add_generation_prompt=True,
    )


def answers(table: pa.Table) -> np.ndarray:
    """The ``answer`` column as strings (``""`` where missing)."""
    if ANSWER not in table.column_names:
        return np.full(table.num_rows, "", dtype=object)
    return np.asarray(["" if a is None else str(a) for a in table.column(ANSWER).to_pylist()], dtype=object)


def prompt_ids(table: pa.Table, column: str, where: str | None = None) -> np.ndarray:
    """The ``prompt_id`` column, else a 63-bit hash of each prompt's text (stable over epochs)."""
    if PROMPT_ID in table.column_names:
        values = table.column(PROMPT_ID).to_pylist()
        if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
            bad = next(v for v in values if not isinstance(v, int) or isinstance(v, bool))
            raise ValueError(
                f"{f'prompt file {where!r}: ' if where else ''}a 'prompt_id' value is not an integer "
                f"({_short(bad)}); use integer ids or drop the column"
            )
        return np.asarray(values, dtype=np.int64)
    values = table.column(column).to_pylist()
    return np.asarray([_hash63(v if isinstance(v, str) else json.dumps(v)) for v in values], dtype=np.int64)


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def metadata(table: pa.Table) -> np.ndarray:
    """Each row's metadata columns (all but ``RESERVED``) as a JSON object string (``"{}"`` if none)."""
    cols = [c for c in table.column_names if c not in RESERVED]
    if not cols:
        return np.full(table.num_rows, "{}", dtype=object)
    rows = table.select(cols).to_pylist()
    return np.asarray([json.dumps(r, default=_json_value, ensure_ascii=False) for r in rows], dtype=object)


def _json_value(value: Any) -> Any:
    """JSON for the metadata values pyarrow yields beyond JSON's own types."""
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    raise ValueError(
        f"a metadata value of type {type(value).__name__} ({_short(value)}) cannot reach the reward as JSON; "
        f"convert the column to strings or numbers, or drop it"
    )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_prompts(path: str | Path, limit: int | None = None) -> list[Any]:
    """A prompt source's rows (the first ``limit``, else all) as ``tasks.Example`` s, in file
    order, checked row by row: for a small file in memory (tests, notebooks). Runs never do
    this: they stream the source (``asyncrl.stream``). Needs a ``prompt`` column."""
    from asyncrl.workloads.tasks import Example

    source = PromptSource.open(path)
    if source.prompt_column != PROMPT:
        raise ValueError(
            f"prompt file {str(path)!r} has a chat 'messages' column; load_prompts reads 'prompt' text "
            f"(chats are rendered by the run's tokenizer: asyncrl.stream)"
        )
    out = []
    for file, table, _ in source.head(limit if limit is not None else np.iinfo(np.int64).max):
        texts = table.column(PROMPT).to_pylist()
        for text, answer, pid in zip(texts, answers(table), prompt_ids(table, PROMPT, file)):
            out.append(Example(prompt=text, answer=str(answer), prompt_id=int(pid)))
    return out
