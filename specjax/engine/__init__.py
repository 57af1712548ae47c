"""The serving engine (see :mod:`specjax.engine.engine` for the layout of this package)."""
from specjax.engine.engine import Engine
from specjax.engine.requests import (CONFIDENCE_POLICIES, FINISH_REASONS, EngineConfig, LoopStats,
                                     Request, Result, StepStats)

__all__ = ["CONFIDENCE_POLICIES", "FINISH_REASONS", "Engine", "EngineConfig", "LoopStats",
           "Request", "Result", "StepStats"]
