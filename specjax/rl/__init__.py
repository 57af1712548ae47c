"""RL with speculative rollouts: a Tunix rollout engine over the specjax engine, the policy adapter
Tunix's learner calls, exact scoring and the verifiable math task (see docs/RL.md).

``SpeculativeRollout`` needs the ``rl`` extra (``google-tunix``); the rest does not.
"""
from specjax.rl.policy import TunixPolicy

__all__ = ["TunixPolicy", "SpeculativeRollout"]


def __getattr__(name):
    if name == "SpeculativeRollout":  # imports tunix: only when asked for
        from specjax.rl.rollout import SpeculativeRollout
        return SpeculativeRollout
    raise AttributeError(f"module 'specjax.rl' has no attribute {name!r}")
