"""The engine/trainer importance weights (`yatt_hpc/algos/off_policy.py`) by hand, and `train.off_policy`'s refusals.

Two samples: tokens with log w = proximal - behavior of (ln 3, 0, -ln 4) and (ln 1.5, ln 1.5), so token
weights (3, 1, 0.25) and (1.5, 1.5), sequence weights 3 x 1 x 0.25 = 0.75 and 1.5 x 1.5 = 2.25.
"""
import math

import numpy as np
import pytest
from pydantic import ValidationError

from yatt_hpc.algos.off_policy import importance_weights
from yatt_hpc.config.train import OffPolicyConfig

BEHAVIOR = [np.array([-1.0, -2.0, -0.5], np.float32), np.array([-0.3, -0.7], np.float32)]
PROXIMAL = [BEHAVIOR[0] + np.log([3.0, 1.0, 0.25]), BEHAVIOR[1] + np.log([1.5, 1.5])]


def _weights(mode: str, **bounds) -> tuple[list[list[float]], object]:
    weights, stats = importance_weights(PROXIMAL, BEHAVIOR, mode, **bounds)
    return [np.round(w.astype(np.float64), 5).tolist() for w in weights], stats


def test_token_truncate_caps_each_token_tis():
    weights, stats = _weights("token_truncate", cap=2.0)
    assert weights == [[2.0, 1.0, 0.25], [1.5, 1.5]]
    assert stats.truncated == 1 and stats.masked == 0 and stats.tokens == 5
    assert stats.weight_sum == pytest.approx(3 + 1 + 0.25 + 1.5 + 1.5, rel=1e-6)  # the raw weights
    assert stats.weight_max == pytest.approx(3.0, rel=1e-6)
    assert stats.abs_log_ratio_max == pytest.approx(math.log(4), rel=1e-6)


def test_sequence_truncate_puts_the_capped_product_on_every_token():
    weights, stats = _weights("sequence_truncate", cap=2.0)
    assert weights == [[0.75] * 3, [2.0, 2.0]]  # 0.75 stays; 2.25 is capped at 2
    assert stats.truncated == 2 and stats.weight_max == pytest.approx(2.25, rel=1e-6)


def test_token_mask_zeroes_tokens_outside_the_interval_icepop():
    weights, stats = _weights("token_mask", low=0.5, high=2.0)
    assert weights == [[0.0, 1.0, 0.0], [1.5, 1.5]]  # 3 above, 0.25 below: their policy-gradient terms go
    assert stats.masked == 2 and stats.truncated == 0


def test_sequence_mask_drops_whole_sequences():
    weights, stats = _weights("sequence_mask", low=0.5, high=2.0)
    assert weights == [[0.75] * 3, [0.0, 0.0]]  # 2.25 is outside [0.5, 2]
    assert stats.masked == 2


def test_none_weighs_every_token_one_and_still_measures_the_gap():
    weights, stats = _weights("none")
    assert weights == [[1.0, 1.0, 1.0], [1.0, 1.0]]
    assert stats.abs_log_ratio_max == pytest.approx(math.log(4), rel=1e-6)


def test_on_policy_weights_are_exactly_one():
    weights, stats = importance_weights(BEHAVIOR, BEHAVIOR, "token_mask")
    assert all(np.array_equal(w, np.ones_like(w)) for w in weights) and stats.masked == 0


def test_a_weighted_advantage_is_a_weighted_loss():
    """Why the trainer weighs the advantages: w > 0 scales the clipped-ratio loss (and the dual clip) exactly."""
    import torch

    from yatt_hpc.algos.policy_loss import token_loss

    logp, old = torch.tensor([[-0.9, -2.4, -0.1]]), torch.tensor([[-1.0, -2.0, -0.5]])
    adv, w = torch.tensor([[1.0, -2.0, -0.5]]), torch.tensor([[2.0, 0.3, 1.7]])
    mask = torch.ones(1, 3)
    for c in (None, 3.0):
        plain, _ = token_loss("vanilla", logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=c)
        weighted, _ = token_loss("vanilla", logp, old, adv * w, mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=c)
        assert torch.allclose(weighted, plain * w)


@pytest.mark.parametrize("fields, needle", [
    ({"correction": "token_truncate"}, "set train.off_policy.proximal=recompute"),
    ({"proximal": "recompute", "cap": 3.0}, "train.off_policy.cap=3 caps a truncating correction"),
    ({"proximal": "recompute", "correction": "token_truncate", "mask_low": 0.2}, "train.off_policy.mask_low=0.2 "
     "bounds a masking correction"),
    ({"proximal": "recompute", "correction": "token_mask", "mask_high": 0.9}, "mask_low <= 1 <= mask_high"),
])
def test_settings_that_cannot_act_are_refused(fields, needle):
    with pytest.raises(ValidationError, match=needle):
        OffPolicyConfig(**fields)
