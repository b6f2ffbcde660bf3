"""Names a run directory is read by: file names, per-step metric keys, per-sample columns, summary keys.

The learner writes these and the report, the CLI and users' notebooks read them, so they
live in one place. Metric keys are slash-namespaced (``area/quantity``); a per-sample
quantity ``q`` reported for lag bucket ``b`` is ``bucket/<b>/<q>`` (labels from
``asyncrl.telemetry.staleness.LAG_BUCKETS``, e.g. ``0``, ``3-4``, ``17+``).
"""

from __future__ import annotations

# --- run directory (DESIGN.md section 8) ----------------------------------------------------
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.parquet"
#: one Parquet part per ``RunWriter.log_samples`` call while the run is live; consolidated on close
SAMPLES_PARTS_DIR = "samples"
SUMMARY_FILE = "summary.json"
CHECKPOINTS_DIR = "checkpoints"
TENSORBOARD_DIR = "tb"
REPORT_FILE = "report.html"

# --- per-step record: one JSON object per learner step in metrics.jsonl -----------------------
STEP = "step"
#: wall-clock seconds since the run started (continues across resumes)
TIME_S = "time_s"
LOSS = "loss"
LAG_MEAN = "staleness/lag_mean"
LAG_MAX = "staleness/lag_max"
#: the largest lag of any trained token (learner version - the version that produced the token);
#: with in-flight updates tokens of one sample differ, and each is <= the sample's head lag
TOKEN_LAG_MAX = "staleness/token_lag_max"
#: prefix of the trained tokens' count per lag bucket: ``staleness/token_lag_hist/<bucket>``
TOKEN_LAG_HIST = "staleness/token_lag_hist"
#: samples dropped at consumption in this step because their lag exceeded max_lag
DROPPED = "staleness/dropped"
#: the learner's ESS fraction rho = (sum w)^2 / (N sum w^2) of the unclipped sequence importance
#: weights w = pi_theta/pi_b over every rank's kept samples; logged every step, whatever the controllers
ESS_RHO = "ess/rho_seq"
#: the ESS fraction the ``ess_lr`` controller scaled the LR by (its ``source``: seq, seq_clipped or
#: tok), logged by the controller only when it runs; differs from ``ESS_RHO`` unless source=seq
ESS_LR_RHO = "ess/rho"
LR_APPLIED = "lr/applied"
LR_SCHEDULED = "lr/scheduled"
#: KL(pi_b || pi_theta) per token over the sampled tokens (k3 estimator), batch mean
KL_BEHAVIOR_CURRENT = "kl/behavior_current"
GRAD_NORM = "grad/norm"
#: cosine between this step's gradient and the previous step's (GAC)
GAC_COS_PREV = "gac/cos_prev"
#: 1 when GAC acted on this step's direction (cos above tau and lag >= min_lag), else 0
GAC_ACTIVE = "gac/active"
#: ``active/<controller>``: the fraction of what a controller acts on that it changed at this step
#: (samples it dropped, tokens it reweighted, or 1/0 for a step whose LR or gradient it changed);
#: its mean over steps is the controller's acting fraction over the run (``controllers.chain``)
ACTIVE_PREFIX = "active/"
#: cosine between the gradients applied at this step and the previous one (telemetry.grad_cos_prev)
GRAD_COS_PREV = "grad/cos_prev"
#: gradient diagnostics against the exact dense KL (telemetry.grad_reference; asyncrl.telemetry.gradients)
GRADREF_COS = "gradref/cos"
GRADREF_REL_ERR = "gradref/rel_err"
GRADREF_BIAS_SQ_REL = "gradref/bias_sq_rel"
GRADREF_NOISE_REL = "gradref/noise_rel"
#: one probe's cross-product squared bias B, |g|^2 and noise |d|^2 - B (absolute): runs and cells
#: report sum(B) / sum(|g|^2) over their probes (asyncrl.telemetry.gradients.ratio_of_sums)
GRADREF_BIAS_SQ = "gradref/bias_sq"
GRADREF_REF_SQ = "gradref/ref_sq"
GRADREF_NOISE_SQ = "gradref/noise_sq"
#: row groups the probe split the batch into
GRADREF_GROUPS = "gradref/groups"
#: exact KL(pi_theta || p) and KL(p || pi_theta) per valid token on the probed batch (grad_reference)
KL_TEACHER_REVERSE = "kl/teacher_reverse"
KL_TEACHER_FORWARD = "kl/teacher_forward"
#: teacher probability mass the cache keeps per position (top-k caches), per-sample mean over tokens
SAMPLE_TEACHER_MASS = "teacher_mass"
SAMPLES_PER_S = "throughput/samples_per_s"
#: samples trained in this step (all ranks)
SAMPLES_KEPT = "samples/kept"
#: valid completion tokens trained in this step (all ranks)
TOKENS = "tokens/trained"
#: 1 when this step's loss or gradient was not finite and the optimizer step was skipped
NUMERICS_SKIPPED = "numerics/skipped"
#: learner version (optimizer steps applied) after this step
VERSION = "version"
#: fraction of the [B, P + T] positions of this step's batch (rank 0's) that are padding, after
#: trimming to its longest prompt and completion (``records.padding_fraction``): compute paid for nothing
PADDING_FRAC = "tokens/padding_frac"
LEARNER_IDLE_FRAC = "throughput/learner_idle_frac"
#: teacher probability mass the cache keeps per position (e.g. top-k mass), batch mean
TEACHER_MASS = "est/teacher_mass"
#: greedy exact-match accuracy; present only on eval steps
EVAL_ACCURACY = "eval/accuracy"
#: evaluation without a verifier (``asyncrl.workloads.agreement``), on held-out prompts: per-token
#: exact KL(teacher || student) and KL(student || teacher) on the student's own samples, top-1
#: agreement, the teacher's NLL per token of the student's greedy response, ROUGE-L of the
#: student's vs the teacher's greedy responses, distinct-2 of the student's greedy responses (near 0:
#: degenerate repetition), and, teacher-forced on the teacher's greedy responses, KL(teacher || student)
#: and top-1 agreement (``_ref``: measured where the teacher goes, so a student cannot lower them by
#: moving to states the teacher finds easy); ``eval/step`` the version they were measured at (they run
#: beside training and land on the step record at which they finished)
EVAL_KL_FORWARD = "eval/kl_forward"
EVAL_KL_REVERSE = "eval/kl_reverse"
EVAL_TOP1_AGREE = "eval/top1_agree"
EVAL_TEACHER_NLL = "eval/teacher_nll"
EVAL_ROUGE_L = "eval/rouge_l"
EVAL_DISTINCT_2 = "eval/distinct_2"
EVAL_KL_FORWARD_REF = "eval/kl_forward_ref"
EVAL_TOP1_AGREE_REF = "eval/top1_agree_ref"
EVAL_STEP = "eval/step"
EVAL_AGREEMENT = (
    EVAL_KL_FORWARD, EVAL_KL_REVERSE, EVAL_TOP1_AGREE, EVAL_TEACHER_NLL, EVAL_ROUGE_L, EVAL_DISTINCT_2,
    EVAL_KL_FORWARD_REF, EVAL_TOP1_AGREE_REF,
)  # fmt: skip
#: every agreement evaluation of a run, one JSON line each: ``{"step", "seconds", "metrics",
#: "samples"}`` (a few prompts' student and teacher greedy responses); summary.json's initial and
#: final agreement figures come from here
EVAL_FILE = "evals.jsonl"
#: start-up marks (wall clock, epoch seconds), logged with the learner process's first step: its
#: training loop began, it published its first weights (admission opened), its first rollout
#: batch arrived, its first optimizer step was done
LEARNER_START_AT = "time/learner_start_at"
LEARNER_READY_AT = "time/learner_ready_at"
FIRST_BATCH_AT = "time/first_batch_at"
FIRST_STEP_AT = "time/first_step_at"
STARTUP_MARKS = (LEARNER_START_AT, LEARNER_READY_AT, FIRST_BATCH_AT, FIRST_STEP_AT)
#: summary.json: where a run's start-up went (``telemetry.summary.startup``), in order
STARTUP_PARTS = (
    "startup_driver_s",
    "startup_train_workers_s",
    "startup_learner_init_s",
    "startup_first_batch_s",
    "startup_first_step_s",
    "startup_ray_init_s",
)

BUCKET_PREFIX = "bucket/"


def bucket_key(label: str, metric: str) -> str:
    """``bucket/<label>/<metric>``: ``metric`` restricted to the samples of lag bucket ``label``."""
    if "/" in label:
        raise ValueError(f"lag bucket label {label!r} must not contain '/'")
    return f"{BUCKET_PREFIX}{label}/{metric}"


def active_key(controller: str) -> str:
    """``active/<controller>``: the acting fraction of the chain's controller named ``controller``."""
    if not controller or "/" in controller:
        raise ValueError(f"controller name {controller!r} must be non-empty and contain no '/'")
    return f"{ACTIVE_PREFIX}{controller}"


def parse_bucket_key(key: str) -> tuple[str, str] | None:
    """Inverse of ``bucket_key``: ``(label, metric)``, or None if ``key`` is not a per-bucket key."""
    if not key.startswith(BUCKET_PREFIX):
        return None
    label, sep, metric = key[len(BUCKET_PREFIX) :].partition("/")
    return (label, metric) if sep and label and metric else None


# --- per-sample record: one row per consumed sample in samples.parquet -------------------------
SAMPLE_COLUMNS = (
    "sample_id",
    "prompt_id",
    "group_id",
    "version_first",
    "version_last",
    "learner_version",
    "lag",
    "kept",
    "reward",
    "kl_behavior_current",
    "completion_len",
    "loss",
    "step",
    "drop_reason",
)
#: per-sample ``drop_reason``: "" for a trained sample, else why it was consumed without training
DROP_REASON = "drop_reason"
DROPPED_CONTROLLERS = "controllers"  # the controller chain's keep() said no (e.g. lag > max_lag)
DROPPED_NONFINITE = "nonfinite"  # its optimizer step had a non-finite loss or gradient (skipped)

# --- summary.json ----------------------------------------------------------------------------
SUMMARY_KEYS = (
    "algo",
    "estimator",
    "max_lag",
    "steps",
    "samples_trained",
    "samples_dropped",
    "wall_time_s",
    "samples_per_s",
    "tokens_per_s",
    "padding_frac",
    "lag_p50",
    "lag_max",
    "eval_accuracy_initial",
    "eval_accuracy_final",
    *(f"eval_{k.split('/')[1]}_{w}" for k in EVAL_AGREEMENT for w in ("initial", "final")),
    "teacher_accuracy",
    "reward_mean_first",
    "reward_mean_last",
    "admission_wait_s",
    "in_flight_regenerated_on_resume",
    "status",
    "error",
    "samples_drawn",
    "samples_dropped_controllers",
    "samples_dropped_nonfinite",
    "samples_regenerated",
    "samples_in_flight_end",
    "ledger_balanced",
    "learner_restarts",
    "driver_resumes",
    "generation_retries",
    "engine_restarts",
    "startup_s",
    "first_step_s",
    *STARTUP_PARTS,
    "run_dir",
)
#: summary ``status``: the run reached train.steps / stopped with an error / was stopped by the
#: numerics guard (train.max_nonfinite_steps)
STATUS_COMPLETED = "completed"
STATUS_FAILED = "failed"
STATUS_ABORTED = "aborted"

__all__ = [
    "ACTIVE_PREFIX",
    "BUCKET_PREFIX",
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "DROPPED",
    "DROPPED_CONTROLLERS",
    "DROPPED_NONFINITE",
    "DROP_REASON",
    "ESS_LR_RHO",
    "ESS_RHO",
    "EVAL_ACCURACY",
    "EVAL_AGREEMENT",
    "EVAL_FILE",
    "EVAL_KL_FORWARD",
    "EVAL_KL_REVERSE",
    "EVAL_ROUGE_L",
    "EVAL_STEP",
    "EVAL_TEACHER_NLL",
    "EVAL_TOP1_AGREE",
    "FIRST_BATCH_AT",
    "FIRST_STEP_AT",
    "GAC_ACTIVE",
    "GAC_COS_PREV",
    "GRADREF_BIAS_SQ",
    "GRADREF_BIAS_SQ_REL",
    "GRADREF_COS",
    "GRADREF_GROUPS",
    "GRADREF_NOISE_REL",
    "GRADREF_NOISE_SQ",
    "GRADREF_REF_SQ",
    "GRADREF_REL_ERR",
    "GRAD_COS_PREV",
    "GRAD_NORM",
    "KL_BEHAVIOR_CURRENT",
    "KL_TEACHER_FORWARD",
    "KL_TEACHER_REVERSE",
    "LAG_MAX",
    "LAG_MEAN",
    "LEARNER_IDLE_FRAC",
    "LEARNER_READY_AT",
    "LEARNER_START_AT",
    "LOSS",
    "LR_APPLIED",
    "LR_SCHEDULED",
    "METRICS_FILE",
    "NUMERICS_SKIPPED",
    "PADDING_FRAC",
    "REPORT_FILE",
    "SAMPLES_FILE",
    "SAMPLES_KEPT",
    "SAMPLES_PARTS_DIR",
    "SAMPLES_PER_S",
    "SAMPLE_COLUMNS",
    "SAMPLE_TEACHER_MASS",
    "STARTUP_MARKS",
    "STARTUP_PARTS",
    "STATUS_ABORTED",
    "STATUS_COMPLETED",
    "STATUS_FAILED",
    "STEP",
    "SUMMARY_FILE",
    "SUMMARY_KEYS",
    "TEACHER_MASS",
    "TENSORBOARD_DIR",
    "TIME_S",
    "TOKENS",
    "TOKEN_LAG_HIST",
    "TOKEN_LAG_MAX",
    "VERSION",
    "active_key",
    "bucket_key",
    "parse_bucket_key",
]
