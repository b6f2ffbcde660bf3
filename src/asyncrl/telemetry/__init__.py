"""Telemetry: what a run records and how a person reads it.

- ``names``: the run-directory file names and the slash-namespaced metric keys (the contract).
- ``steps``: the learner's per-step and per-sample records (``StepLogger``).
- ``sinks``: ``RunWriter`` (metrics.jsonl, samples Parquet, TensorBoard, summary.json) and readers.
- ``staleness``: lag buckets and per-bucket aggregation.
- ``progress``: the live progress display (rich on a TTY, plain lines in logs, silent when quiet).

The HTML report, the tables over many runs and a sweep's plots are the lab's (``asyncrl.lab.report``,
``asyncrl.lab.aggregate``, ``asyncrl.lab.sweep_report``): they read what these modules write.
"""
