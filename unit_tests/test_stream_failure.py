"""A stage that raises ends the run without learner restarts: how the learner recognises it
(``asyncrl.rollouts.stream_failure``: Ray Data's ``UserCodeException``, whose remote text holds the
stage's own exception) and the note it leaves (``asyncrl.checkpoint.write_stream_failure``)."""

from __future__ import annotations

from pathlib import Path

from ray.exceptions import RayActorError, UserCodeException

from asyncrl import checkpoint
from asyncrl.rollouts import StreamFailed, _stage_exception, stream_failure

HEADER = "\x1b[36mray::MapWorker(MapBatches(StreamBlocks)).submit()\x1b[39m (pid=7794, ip=192.0.2.2)"
FRAMES = """  File "/usr/lib/python3.11/concurrent/futures/thread.py", line 58, in run
    result = self.fn(*self.args, **self.kwargs)
             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/src/asyncrl/workloads/prompts.py", line 380, in prompt_token_ids
    raise ValueError(f"prompt file {where!r}: a row has {problem}")
"""
UDF = """ray.exceptions.UserCodeException: UDF failed to process a data block.
Failed to apply UDF transform after 1/1 attempts (total backoff 0.0s)."""
MARK = "The above exception was the direct cause of the following exception:"
# what a RayTaskError(UserCodeException) prints, as measured with Ray 2.60 (a two-line message)
REMOTE = (
    f"{HEADER}\n{FRAMES}ValueError: prompt file '/data/p': a row has\nan empty 'prompt'; remove the row\n"
    f"{MARK}\n{HEADER}\n{UDF}"
)


def test_the_stage_exception_is_read_from_the_remote_text():
    assert (
        _stage_exception(REMOTE)
        == "ValueError: prompt file '/data/p': a row has\nan empty 'prompt'; remove the row"
    )
    # a stage exception with its own cause: the one the stage raised (just before the UDF wrapper)
    inner = f"{HEADER}\n{FRAMES}KeyError: 'prompt'\n{MARK}\n"
    assert _stage_exception(inner + REMOTE).startswith("ValueError: prompt file")
    assert _stage_exception("no traceback at all") is None
    assert _stage_exception(f"{HEADER}\nValueError: x\n{MARK}\n{UDF}") is None  # no frame: not guessed


def test_only_a_stages_exception_is_a_stream_failure():
    failed = stream_failure(UserCodeException(REMOTE))
    assert isinstance(failed, StreamFailed) and str(failed).startswith("ValueError: prompt file '/data/p'")
    wrapper = RuntimeError("iterator failed")
    wrapper.__cause__ = UserCodeException(REMOTE)
    assert str(stream_failure(wrapper)).startswith("ValueError")  # found anywhere in the chain
    assert "UDF failed" in str(stream_failure(UserCodeException(UDF)))  # unparsable: Ray's own line
    # a dead actor, a stalled stream: Ray Train may restart the learners
    assert stream_failure(RayActorError()) is None
    assert stream_failure(TimeoutError("no progress for 120 s")) is None


def test_the_note_says_where_the_rerun_resumes(tmp_path: Path):
    assert checkpoint.read_abort(tmp_path) is None
    checkpoint.write_stream_failure(tmp_path, "ValueError: bad row")
    note = checkpoint.read_abort(tmp_path)
    assert note["kind"] == "stream" and "ValueError: bad row" in note["message"]
    assert "resumes from the start (no checkpoint yet)" in note["message"]
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.ABORT_FILE]  # written whole, nothing left over
    # an old note without a kind (the numerics guard's, before kinds) reads as the numerics guard's
    (tmp_path / checkpoint.ABORT_FILE).write_text('{"step": 3, "message": "m"}')
    assert checkpoint.read_abort(tmp_path)["kind"] == "numerics"
