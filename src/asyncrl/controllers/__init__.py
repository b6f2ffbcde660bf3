"""Staleness controllers: every point where a run reacts to stale samples (DESIGN.md section 7).

A controller implements any subset of the hooks of ``StalenessController`` (``base.py``):
admission, consumption gate, per-token loss weights, gradient transform, LR scale, metrics and
state. ``chain(a, b, ...)`` composes them; ``build(name, options)`` / ``build_chain(specs)``
construct them from config, validating options through each controller's frozen ``Config``.

Built-ins (registered names): ``bounded_staleness`` (BoundedStaleness), ``truncated_is``
(TruncatedIS), ``ess_lr`` (ESSLR), ``gradient_alignment`` (GradientAlignment, GAC),
``staleness_lr_law`` (StalenessLRLaw), ``lag_bucket_decay`` (LagBucketDecay). Add your own with
``@CONTROLLERS.register("my_name")`` or reference a class by dotted path
``"my_pkg.module:MyController"`` (see ``examples/custom_controller.py``).

The math lives in ``asyncrl.controllers.functional``; the producer-side budget the
coordinator wraps is ``asyncrl.controllers.admission.AdmissionBudget``; a discrete-event
simulator for the staleness bound (a study tool, outside this math package) is ``asyncrl.lab.simulator``.
"""

from asyncrl.controllers.admission import AdmissionBudget
from asyncrl.controllers.alignment import GradientAlignment
from asyncrl.controllers.base import AdmissionRequest, SampleInfo, StalenessController, StepContext, scaled_lr
from asyncrl.controllers.bounded import BoundedStaleness
from asyncrl.controllers.bucket_decay import LagBucketDecay
from asyncrl.controllers.chain import Chain, as_controller, chain
from asyncrl.controllers.ess import ESSLR
from asyncrl.controllers.factory import CONTROLLERS, build, build_chain
from asyncrl.controllers.importance import TruncatedIS
from asyncrl.controllers.lr_law import StalenessLRLaw

__all__ = [
    "CONTROLLERS",
    "ESSLR",
    "AdmissionBudget",
    "AdmissionRequest",
    "BoundedStaleness",
    "Chain",
    "GradientAlignment",
    "LagBucketDecay",
    "SampleInfo",
    "StalenessController",
    "StalenessLRLaw",
    "StepContext",
    "TruncatedIS",
    "as_controller",
    "build",
    "build_chain",
    "chain",
    "scaled_lr",
]
