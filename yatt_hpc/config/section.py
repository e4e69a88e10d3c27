"""The base every config section derives from (`yatt_hpc.config.schema`, `.reward`, `.placement`, `.cluster`)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: frozen, unknown keys rejected, field docstrings read by config/docs.py."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
