"""What a token rule is (`TokenRule`) and the refusal of a family that has none (`UnsupportedModel`).

Kept apart from the rules so that a rule in a module of its own (ingest.anyres) and the module
that picks one per family (ingest.token_rules) both import it, and neither imports the other.
Callers import both names from ingest.token_rules, as before.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from ingest.budget import PixelBounds, TokenGeometry


class UnsupportedModel(ValueError):
    """The model's family has no token rule (and no adapter) in visbatch."""


class TokenRule(ABC):
    """One model's token rule: how many visual tokens an image becomes, without weights."""

    family: str
    # Why the family's cached tokens cannot make a prompt of several images (a window of pages or
    # frames), or None: they can. Read by the job check before anything runs, without weights.
    several_images_unsupported: ClassVar[str | None] = None

    @property
    @abstractmethod
    def token_geometry(self) -> TokenGeometry:
        """Pixels per visual token and the processor's own bounds (for budgets)."""

    @abstractmethod
    def count_visual_tokens(self, width: int, height: int, bounds: PixelBounds | None = None) -> int:
        """Visual tokens of a `width` x `height` image resized within `bounds` (None: the model's)."""
