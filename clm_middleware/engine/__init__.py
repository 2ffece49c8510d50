"""Generation through the block pool."""

from clm_middleware.engine.engine import Engine
from clm_middleware.engine.generation import Generation
from clm_middleware.engine.observe import Observe
from clm_middleware.engine.penalties import GenerationDefaults, penalty_processors
from clm_middleware.engine.sampling import SamplingParams
from clm_middleware.engine.stats import CallStats, EngineStats

__all__ = [
    "CallStats",
    "Engine",
    "EngineStats",
    "Generation",
    "GenerationDefaults",
    "Observe",
    "SamplingParams",
    "penalty_processors",
]
