"""The prompt stream: the order in which prompts become samples, their ids, and their blocks.

**Positions, ids, blocks** (the scale-out contract, ``asyncrl.controllers.admission``). The
stream is a sequence of prompt rows over epochs ``e = 0, 1, ...``; the row at stream position
``p`` (counted over all epochs from 0) yields ``G`` samples (``train.group_size``) with
``sample_id = p G + g`` and ``group_id = p``. Samples are cut, in stream order, into blocks
of ``B / W`` samples (one learner worker's share of one rollout batch, whole groups);
``block_index`` counts blocks from 0. The PolicyStore admits blocks strictly in block order
and the learner consumes them in that order. A resumed run drops the sample ids its
checkpoint's ledger holds before cutting blocks (every sample is trained once; the ones in
flight at the checkpoint come again) and numbers its blocks from 0 (the PolicyStore restarts
its stream at block 0). ``BlockCutter`` does this for both sources below.

**Epoch order**, seeded by ``seed``:

* A built-in task (in memory, the demo path): the driver permutes the split with
  ``rng([seed, e])`` and cuts every block before Ray starts (``asyncrl.plan.prompt_blocks``):
  a Ray Data ``from_blocks`` source (metadata computed in the driver), no extra actor.
* Prompt files (``workload.prompts_path``, ``asyncrl.workloads.prompts``), streamed: the
  driver holds no prompt. Epoch ``e`` reads the files in the order
  ``rng([seed, e]).permutation(n_files)``, each front to back, and permutes the rows within
  consecutive windows of ``workload.shuffle_window`` rows, window ``w`` by
  ``rng([seed, e, w])``. Why windows: a uniform permutation of ``N`` rows needs all of them in
  one place; a window is the most the stream holds, and a window ``>= N`` (any set that fits)
  is exactly a uniform permutation. A file sorted by some key (difficulty, source) is only
  shuffled locally: shuffle it beforehand or shard it into files. The order is a function of
  the files' rows, ``seed`` and the window alone (never of Ray's block sizes or read
  parallelism), so a resumed run regenerates the same stream.

**How the files are streamed.** The Ray Data source is the list of block indices
(``from_items``, one row per block); ``map_batches(StreamBlocks)`` on an actor pool of *one*
(one owner of positions) turns index ``i`` into block ``i``: exactly ``B / W`` rows per
output block, which the generators' ``batch_size`` needs. Inside, the actor reads the files
with Ray Data (``read_parquet`` / ``read_json`` / Arrow IPC, ``asyncrl.workloads.prompts``),
so reads run as Ray tasks ahead of it (bounded by Ray Data's backpressure) while the actor
holds one window; it tokenizes only the rows it emits, just before it emits them. Ray Data
runs the actor ahead of generation as it does any stage; a restarted actor replays the
stream up to the block it is asked for.

**Prompt width.** Blocks are fixed-width tensor columns, so ``P`` is fixed for a run:
``workload.max_prompt_tokens``, else the longest of the stream's first 2048 prompts (of its
first window, if that is shorter; the built-in path measures its split's first 2048). A
streamed prompt longer than ``P`` is skipped with a warning on stderr (its position stays
unused), never truncated.

**Resume cost.** A streamed resume re-reads the rows before its position in the current
epoch (whole epochs before it too); rows whose samples are all in the ledger are not
tokenized.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from asyncrl import records as R

#: the first prompts of a stream that fix its width P when workload.max_prompt_tokens is unset
WIDTH_SAMPLE = 2048


class BlockCutter:
    """Rows in stream order -> blocks of ``block_samples`` samples: groups, ids, ledger skips.

    ``add(rows, positions)`` takes prompt rows (column -> array, first axis = row) at the given
    stream positions (increasing; gaps allowed); ``blocks()`` pops every full block, each with
    its ``block_index``. See the module docstring for the id rules.
    """

    def __init__(self, group_size: int, block_samples: int, skip_ids: np.ndarray | None = None) -> None:
        if group_size < 1 or block_samples < 1 or block_samples % group_size:
            raise ValueError(
                f"a block of {block_samples} samples must hold whole groups of {group_size} (both >= 1)"
            )
        self.group_size = group_size
        self.block_samples = block_samples
        self.skip = np.unique(np.asarray(skip_ids, dtype=np.int64)) if skip_ids is not None else None
        self.next_block = 0
        self._pending: list[dict[str, np.ndarray]] = []
        self._n_pending = 0

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """[n, G] sample ids of the rows at ``positions``."""
        return np.asarray(positions, dtype=np.int64)[:, None] * self.group_size + np.arange(self.group_size)

    def consumed(self, positions: np.ndarray) -> np.ndarray:
        """[n] bool: every sample of the row is in the ledger (the row need not be read further)."""
        if self.skip is None or not self.skip.size:
            return np.zeros(len(positions), dtype=bool)
        return np.isin(self.sample_ids(positions), self.skip).all(axis=1)

    def add(self, rows: Mapping[str, np.ndarray], positions: np.ndarray) -> None:
        positions = np.asarray(positions, dtype=np.int64)
        G = self.group_size
        cols = {k: np.repeat(np.asarray(v), G, axis=0) for k, v in rows.items()}
        cols[R.GROUP_ID] = np.repeat(positions, G)
        cols[R.SAMPLE_ID] = self.sample_ids(positions).reshape(-1)
        if self.skip is not None and self.skip.size:
            keep = ~np.isin(cols[R.SAMPLE_ID], self.skip)
            cols = {k: v[keep] for k, v in cols.items()}
        n = len(cols[R.SAMPLE_ID])
        if n:
            self._pending.append(cols)
            self._n_pending += n

    def blocks(self) -> Iterator[dict[str, np.ndarray]]:
        """Pop every full block, in order; the remainder waits for more rows."""
        full = self._n_pending // self.block_samples
        if not full:
            return
        keys = self._pending[0].keys()
        rows = {k: np.concatenate([p[k] for p in self._pending]) for k in keys}
        cut = full * self.block_samples
        rest = {k: v[cut:] for k, v in rows.items()}
        self._pending = [rest] if len(rest[R.SAMPLE_ID]) else []
        self._n_pending -= cut
        for b in range(full):
            block = {k: v[b * self.block_samples : (b + 1) * self.block_samples] for k, v in rows.items()}
            block[R.BLOCK_INDEX] = np.full(self.block_samples, self.next_block, dtype=np.int64)
            self.next_block += 1
            yield block


def left_pad(token_ids: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``prompt_ids`` [n, width] int64 (left-padded with ``pad_id``) and ``prompt_mask`` [n, width]."""
    n = len(token_ids)
    ids = np.full((n, width), pad_id, dtype=np.int64)
    mask = np.zeros((n, width), dtype=bool)
    for b, toks in enumerate(token_ids):
        if toks:
            ids[b, width - len(toks) :] = toks
            mask[b, width - len(toks) :] = True
    return ids, mask


#: reads files (in the given order) as tables of rows, in order
Reader = Callable[[Sequence[str]], Iterator[pa.Table]]


class FileStream:
    """The streamed prompt stream of a ``PromptSource`` (see the module docstring), Ray-free:
    ``reader`` does the I/O (``ray_reader`` in the pipeline, ``local_reader`` elsewhere)."""

    def __init__(
        self,
        source: Any,
        tokenizer: Any,
        *,
        seed: int,
        group_size: int,
        block_samples: int,
        window: int,
        max_prompt_tokens: int | None = None,
        skip_ids: np.ndarray | None = None,
        reader: Reader,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"workload.shuffle_window must be >= 1 row, got {window}")
        self.source = source
        self.tokenizer = tokenizer
        self.seed = seed
        self.window = window
        self.width = max_prompt_tokens
        self.cutter = BlockCutter(group_size, block_samples, skip_ids)
        self.reader = reader
        self.warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.too_long = 0
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError(
                "the model's tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token"
            )
        self.pad_id = int(pad)
        self._blocks = self._generate()
        self._produced = 0

    def block(self, index: int) -> dict[str, np.ndarray]:
        """Block ``index`` of the stream; blocks come in order (a restarted actor replays up to it)."""
        if index < self._produced:
            raise ValueError(f"block {index} was already produced; the stream only moves forward")
        while True:
            block = next(self._blocks)
            self._produced += 1
            if self._produced > index:
                return block

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for block in self._blocks:
            self._produced += 1
            yield block

    def close(self) -> None:
        """Stop reading: the reader's iterators close now (Ray Data's while Ray is still up)."""
        self._blocks.close()

    # -- the stream ------------------------------------------------------------------------------------
    def _generate(self) -> Iterator[dict[str, np.ndarray]]:
        files = list(self.source.files)
        rows_per_block = self.cutter.block_samples // self.cutter.group_size
        position, epoch = 0, 0
        while True:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(files))
            n_epoch = 0
            for w, window in enumerate(self._windows([files[i] for i in order])):
                window = window.take(
                    np.random.default_rng([self.seed, epoch, w]).permutation(window.num_rows)
                )
                positions = position + np.arange(window.num_rows, dtype=np.int64)
                position += window.num_rows
                n_epoch += window.num_rows
                if self.width is None:
                    self.width = self._measure(window.slice(0, WIDTH_SAMPLE))
                for start in range(0, window.num_rows, rows_per_block):
                    chunk = window.slice(start, rows_per_block)
                    pos = positions[start : start + rows_per_block]
                    fresh = ~self.cutter.consumed(pos)
                    if not fresh.any():
                        continue
                    self.cutter.add(*self._encode(chunk.filter(pa.array(fresh)), pos[fresh]))
                    yield from self.cutter.blocks()
            if n_epoch == 0:
                raise ValueError(f"prompts {self.source.path!r} have no rows; add prompts (one per row)")
            epoch += 1

    def _windows(self, files: list[str]) -> Iterator[pa.Table]:
        """The epoch's rows in file order, in windows of ``self.window`` rows (the last may be short)."""
        held: list[pa.Table] = []
        n = 0
        for table in self.reader(files):
            if not table.num_rows:
                continue
            held.append(table)
            n += table.num_rows
            while n >= self.window:
                rows = _concat(held)
                yield rows.slice(0, self.window)
                rest = rows.slice(self.window)
                held, n = ([rest] if rest.num_rows else []), rest.num_rows
        if n:
            yield _concat(held)

    def _token_ids(self, table: pa.Table) -> list[list[int]]:
        from asyncrl.workloads.prompts import prompt_token_ids

        return prompt_token_ids(table, self.source.prompt_column, self.tokenizer, self.source.path)

    def _measure(self, table: pa.Table) -> int:
        width = max((len(t) for t in self._token_ids(table)), default=1)
        return max(width, 1)

    def _encode(self, table: pa.Table, positions: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        from asyncrl.workloads.prompts import answers, metadata, prompt_ids

        tokens = self._token_ids(table)
        lengths = np.asarray([len(t) for t in tokens])
        fits = (lengths <= self.width) & (lengths > 0)
        if not fits.all():
            self._skipped(table, lengths, ~fits)
            table = table.filter(pa.array(fits))
            tokens = [t for t, ok in zip(tokens, fits) if ok]
            positions = positions[fits]
        ids, mask = left_pad(tokens, self.width, self.pad_id)
        rows = {
            R.PROMPT_IDS: ids,
            R.PROMPT_MASK: mask,
            R.ANSWER: answers(table),
            R.PROMPT_ID: prompt_ids(table, self.source.prompt_column),
            R.METADATA: metadata(table),
        }
        return rows, positions

    def _skipped(self, table: pa.Table, lengths: np.ndarray, bad: np.ndarray) -> None:
        """Warn about prompts that do not fit P: the first, then at every power of ten."""
        for i in np.flatnonzero(bad):
            self.too_long += 1
            if self.too_long == 1 or np.log10(self.too_long).is_integer():
                text = table.column(self.source.prompt_column)[int(i)].as_py()
                self.warn(
                    f"asyncrl: warning: skipped a prompt of {int(lengths[i])} tokens, longer than the run's "
                    f"prompt width {self.width} ({str(text)[:60]!r}); {self.too_long} skipped so far. Set "
                    f"workload.max_prompt_tokens to fit the longest prompt"
                )


def _concat(tables: list[pa.Table]) -> pa.Table:
    if len(tables) == 1:
        return tables[0]
    try:
        return pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ValueError(
            f"prompt files disagree on a column's type ({' '.join(str(err).split())}); give every file "
            f"the same columns and types"
        ) from None


def local_reader(kind: str) -> Reader:
    """Read files with pyarrow in this process (``asyncrl.workloads.prompts.read_file``)."""
    from asyncrl.workloads.prompts import read_file

    def read(files: Sequence[str]) -> Iterator[pa.Table]:
        for f in files:
            yield from read_file(f, kind)  # type: ignore[arg-type]

    return read


def ray_reader(kind: str, *, num_cpus: float = 0.25, timeout_s: float | None = None) -> Reader:
    """Read files with Ray Data (reads run as Ray tasks ahead of the caller), rows in file order."""

    def read(files: Sequence[str]) -> Iterator[pa.Table]:
        import ray.data

        from asyncrl.workloads.prompts import read_dataset

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # rows in the files' order: the stream's order
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        if timeout_s is not None:
            ctx.execution_no_progress_timeout_s = timeout_s
        ds = read_dataset(files, kind, num_cpus=num_cpus)  # type: ignore[arg-type]
        yield from ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1)

    return read


class StreamBlocks:
    """Ray Data actor UDF (a pool of one): block index in, that block of the file stream out."""

    def __init__(
        self,
        *,
        source: Any,
        tokenizer_dir: str,
        seed: int,
        group_size: int,
        block_samples: int,
        window: int,
        max_prompt_tokens: int | None,
        skip_ids: np.ndarray | None,
        read_timeout_s: float | None = None,
    ) -> None:
        from asyncrl.workloads.checkpoints import shared_tokenizer

        tokenizer = shared_tokenizer(tokenizer_dir)
        self.stream = FileStream(
            source,
            tokenizer,
            seed=seed,
            group_size=group_size,
            block_samples=block_samples,
            window=window,
            max_prompt_tokens=max_prompt_tokens,
            skip_ids=skip_ids,
            reader=ray_reader(source.kind, timeout_s=read_timeout_s),
        )
        # a run ends with the stream unfinished: close the Ray Data read before Ray's own exit
        # hook disconnects this process (Ray Data's iterator would log a traceback otherwise)
        atexit.register(self.stream.close)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        (index,) = np.asarray(batch[R.BLOCK_INDEX]).tolist()
        return self.stream.block(int(index))
