"""RL with speculative rollouts: a Tunix rollout engine over the specjax engine, the policy adapter
Tunix's learner calls, exact scoring and the verifiable math task (see docs/RL.md).

``SpeculativeRollout`` needs the ``rl`` extra (``google-tunix``); the rest does not.
"""
from specjax.rl.policy import TunixPolicy

__all__ = ["TunixPolicy", "SpeculativeRollout", "require_tunix"]


def require_tunix() -> None:
    """Imports Tunix, or raises a ``ModuleNotFoundError`` that names the extra to install."""
    import importlib
    try:
        importlib.import_module("tunix")
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "tunix":
            raise
        raise ModuleNotFoundError(
            f"{e}: specjax's RL rollouts run through Tunix, the `rl` extra: "
            "pip install 'specjax[rl]' (in a checkout: pip install -e '.[rl]', or make install)",
            name=e.name) from e


def __getattr__(name):
    if name == "SpeculativeRollout":  # imports tunix: only when asked for
        from specjax.rl.rollout import SpeculativeRollout
        return SpeculativeRollout
    raise AttributeError(f"module 'specjax.rl' has no attribute {name!r}")
