"""The spec (what the user asked for), its validators, and the answers (every value the templates
print), in that order: `core` <- `validate` <- `answers`. Import the public names from here.
"""

from generator.spec.answers import build_answers
from generator.spec.core import DTYPES, ScaffoldError, Spec, SpecError
from generator.spec.validate import (
    ENGINE_WEIGHT_GIB_PER_GPU,
    EP_TRICKS_REFUSED,
    MOE_FAMILIES,
    ROLLOUT_ALGOS,
    engine_tp_choices,
    engine_weight_note,
    model_config,
    resolve_engine_layout,
    trainer_gpus,
    validate_spec,
)

__all__ = [
    "DTYPES",
    "ENGINE_WEIGHT_GIB_PER_GPU",
    "EP_TRICKS_REFUSED",
    "MOE_FAMILIES",
    "ROLLOUT_ALGOS",
    "ScaffoldError",
    "Spec",
    "SpecError",
    "build_answers",
    "engine_tp_choices",
    "engine_weight_note",
    "model_config",
    "resolve_engine_layout",
    "trainer_gpus",
    "validate_spec",
]
