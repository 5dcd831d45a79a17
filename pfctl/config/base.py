"""The base of every config section: frozen, strict about unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. Unknown keys are errors; instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
