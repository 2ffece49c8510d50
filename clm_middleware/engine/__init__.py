"""Generation through the block pool."""

from clm_middleware.engine.engine import Engine, Generation
from clm_middleware.engine.sampling import SamplingParams
from clm_middleware.engine.stats import CallStats, EngineStats

__all__ = ["CallStats", "Engine", "EngineStats", "Generation", "SamplingParams"]
