"""The built-in synthetic tasks with exact-match verifiers (the lab's workloads).

The ``Task`` protocol, ``TASKS`` and the helpers every task uses (splits, rewards, prompt
encoding) are the core's, ``asyncrl.workloads.tasks``; this module registers the built-ins into
``TASKS`` when imported (the ``asyncrl.task`` entry point, ``asyncrl.registry``). Each makes
``Example(prompt, answer, prompt_id)`` lists deterministically from a seed; ``verify`` is exact
match after stripping whitespace, ``reward`` is 1.0 / 0.0 (optionally partial credit). Built-ins:

* ``addition``: ``"57+08="`` -> ``"065"``; operands uniform in ``[0, 10**digits)`` (digits = 2
  by default), written zero-padded to ``digits`` characters, and the sum zero-padded to
  ``digits + 1``. Fixed widths align the digits by position, which is what lets a ~100k
  parameter teacher learn it to >= 95 % in seconds on a CPU (unpadded operands take about 3x
  more steps). The answer is written normally (most significant digit first);
  ``reverse_answer=True`` writes it least significant digit first.
* ``running_sum``: ``"30417...="`` (32 random digits) -> the running sums mod 10
  (``"33780..."``): 32 generated tokens + EOS, the long-output workload. Every output digit
  depends on the input digit at a fixed distance and on the previous output digit, so errors
  compound along the sequence; the ``tiny`` teacher learns it to >= 97 % in ~850 steps, and
  its student is a 1-layer, 2-head model (the preset's default student stays on the loss
  plateau: ``Preset.per_task``). ``running_sum_long`` is the same with 128 digits: 129-token
  completions, the generation-dominated regime.
* ``reverse``: ``"qwerty...="`` -> the string reversed, 32-40 lowercase letters. A harder
  long-output stress task: the built-in presets do *not* learn it to exact match within
  their budgets (measured: ``tiny`` teacher at 0.01 exact match after 1200 steps, seed 0) and
  refuse to pretrain it up front; use it for throughput and long-sequence tests, or with
  ``partial_credit`` rewards.

Train and eval are disjoint by construction (``split_of``): a prompt belongs to the eval split iff
``crc32(prompt) % 10 == 0``, independent of the seed.
"""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.workloads.tasks import SPLITS, TASKS, Example, Split, char_overlap, is_exact_match, split_of

__all__ = ["Addition", "Reverse", "RunningSum", "SyntheticTask"]


@dataclass(frozen=True)
class SyntheticTask:
    """Shared split logic of the built-in tasks; subclasses define ``sample(rng)``.

    ``partial_credit``: ``reward`` returns ``char_overlap`` instead of 1.0 / 0.0.
    """

    partial_credit: bool = False

    name = "synthetic"
    max_prompt_chars = 0
    max_answer_chars = 0

    def sample(self, rng: random.Random) -> tuple[str, str]:
        raise NotImplementedError

    def make_examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """``n`` examples of ``split``, a pure function of ``(task options, split, n, seed)``."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(f"{self.name}/{split}/{seed}")  # str seeds hash deterministically
        out: list[Example] = []
        seen: set[str] = set()
        attempts, budget = 0, 200 * max(n, 1) + 10_000
        while len(out) < n:
            attempts += 1
            if attempts > budget:
                raise ValueError(
                    f"task {self.name!r} has only about {len(out)} distinct {split!r} prompts "
                    f"(asked for {n}); ask for fewer eval examples or use a harder task setting"
                )
            prompt, answer = self.sample(rng)
            if split_of(prompt) != split:
                continue
            if split == "eval":
                if prompt in seen:
                    continue
                seen.add(prompt)
            out.append(Example(prompt=prompt, answer=answer, prompt_id=len(out)))
        return out

    def verify(self, completion: str, answer: str) -> bool:
        return is_exact_match(completion, answer)

    def reward(self, completion: str, answer: str, metadata: Mapping[str, Any] | None = None) -> float:
        if self.partial_credit:
            return char_overlap(completion, answer)
        return 1.0 if is_exact_match(completion, answer) else 0.0


@dataclass(frozen=True)
class Addition(SyntheticTask):
    """``"a+b="`` -> ``a + b`` with ``a, b`` uniform in ``[0, 10**digits)``, zero-padded to fixed widths."""

    digits: int = 2
    reverse_answer: bool = False

    name = "addition"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 18:
            raise ValueError(f"Addition.digits must be in [1, 18], got {self.digits}")

    @property
    def max_prompt_chars(self) -> int:  # type: ignore[override]
        return 2 * self.digits + 2

    @property
    def max_answer_chars(self) -> int:  # type: ignore[override]
        return self.digits + 1

    def sample(self, rng: random.Random) -> tuple[str, str]:
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        answer = str(a + b).zfill(self.digits + 1)
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}=", answer[::-1] if self.reverse_answer else answer


@dataclass(frozen=True)
class Reverse(SyntheticTask):
    """``"s="`` -> ``s[::-1]`` for a random string of ``min_len <= len(s) <= max_len`` characters.

    ``distinct=True`` draws the characters without replacement from ``alphabet``.
    """

    min_len: int = 32
    max_len: int = 40
    alphabet: str = string.ascii_lowercase
    distinct: bool = False

    name = "reverse"

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"Reverse needs 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if "=" in self.alphabet or len(set(self.alphabet)) < 2:
            raise ValueError("Reverse.alphabet needs >= 2 distinct characters and no '='")
        if self.distinct and self.max_len > len(set(self.alphabet)):
            raise ValueError(
                f"Reverse.max_len={self.max_len} exceeds the {len(set(self.alphabet))} distinct characters "
                f"of the alphabet; lower max_len or set distinct=False"
            )

    @property
    def max_prompt_chars(self) -> int:  # type: ignore[override]
        return self.max_len + 1

    @property
    def max_answer_chars(self) -> int:  # type: ignore[override]
        return self.max_len

    def sample(self, rng: random.Random) -> tuple[str, str]:
        n = rng.randint(self.min_len, self.max_len)
        chars = rng.sample(self.alphabet, n) if self.distinct else rng.choices(self.alphabet, k=n)
        s = "".join(chars)
        return f"{s}=", s[::-1]


@dataclass(frozen=True)
class RunningSum(SyntheticTask):
    """Running sums mod 10 of L digits (long outputs): ``"d_1..d_L="`` -> ``s_1..s_L``.

    ``s_j = (d_1 + ... + d_j) mod 10``.

    The length is fixed so that input digit ``j`` sits at a constant distance from output
    digit ``j`` (what makes it learnable for small models with relative positions).
    Registered as ``running_sum`` (L = 32) and ``running_sum_long`` (L = 128: completions of
    129 tokens with EOS, the generation-dominated regime); ``name`` keys the cache directory
    and the example streams, so each length has its own.
    """

    length: int = 32
    name: str = "running_sum"

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"RunningSum.length must be >= 1, got {self.length}")

    @property
    def max_prompt_chars(self) -> int:  # type: ignore[override]
        return self.length + 1

    @property
    def max_answer_chars(self) -> int:  # type: ignore[override]
        return self.length

    def sample(self, rng: random.Random) -> tuple[str, str]:
        digits = [rng.randrange(10) for _ in range(self.length)]
        sums = itertools.accumulate(digits)
        return "".join(map(str, digits)) + "=", "".join(str(s % 10) for s in sums)


TASKS.add("addition", Addition())
TASKS.add("running_sum", RunningSum())
TASKS.add("running_sum_long", RunningSum(length=128, name="running_sum_long"))
TASKS.add("reverse", Reverse())
