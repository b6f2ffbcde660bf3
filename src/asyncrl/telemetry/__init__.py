"""Telemetry: what a run records and how a person reads it.

- ``names``: the run-directory file names and the slash-namespaced metric keys (the contract).
- ``steps``: the learner's per-step and per-sample records (``StepLogger``).
- ``sinks``: ``RunWriter`` (metrics.jsonl, samples Parquet, TensorBoard, summary.json) and readers.
- ``staleness``: lag buckets and per-bucket aggregation.
- ``progress``: the live progress display (rich on a TTY, plain lines in logs, silent when quiet).
- ``report``: one self-contained HTML page over one or several run directories.
- ``aggregate``: tables over many run directories (one row per run; mean, std, n over seeds).
- ``sweep_report``: a sweep's plots (figure against a swept key, curves per group) and its HTML page.
"""
