"""Rollout: inference engines behind one interface (``from yatt_hpc.rollout import build_engine``).

See ``engine.py`` for the interface; ``hf_engine.py`` (CPU / one GPU) and ``sglang_engine.py`` (GPUs)
implement it and are imported only by ``build_engine``.
"""

from yatt_hpc.rollout.engine import (
    ENGINE_KINDS,
    BaseEngine,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    build_engine,
)

__all__ = ["ENGINE_KINDS", "BaseEngine", "FinishReason", "GenerationRequest", "GenerationResult", "build_engine"]
