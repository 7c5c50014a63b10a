"""The HSS predictor: the seeded projection P (:mod:`~hss.predictor.projection`), its calibration from sample keys
(:mod:`~hss.predictor.calibrate`), and the device predictor that projects keys at KV-write time and scores pages
(:mod:`~hss.predictor.predictor`)."""
from hss.predictor.calibrate import calibrate_projection, principal_directions
from hss.predictor.predictor import (
    A_G_BUDGET_PERCENT,
    Predictor,
    PredictorDims,
    check_projection,
    preflight_a_g,
    read_k_lr_slot,
)
from hss.predictor.projection import PredictorShape, build_projection, fnv1a64_bf16

__all__ = ["PredictorDims", "Predictor", "preflight_a_g", "check_projection", "read_k_lr_slot", "A_G_BUDGET_PERCENT",
           "PredictorShape", "build_projection", "fnv1a64_bf16", "calibrate_projection", "principal_directions"]
