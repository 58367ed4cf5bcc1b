"""What a token rule is (`TokenRule`) and the refusal of a family that has none (`UnsupportedModel`).

Kept apart from the rules so that a rule in a module of its own (ingest.anyres) and the module
that picks one per family (ingest.token_rules) both import it, and neither imports the other.
Callers import both names from ingest.token_rules, as before.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ingest.budget import PixelBounds, TokenGeometry


class UnsupportedModel(ValueError):
    """The model's family has no token rule (and no adapter) in visbatch."""


class TokenRule(ABC):
    """One model's token rule: how many visual tokens an image becomes, without weights."""

    family: str

    @property
    @abstractmethod
    def token_geometry(self) -> TokenGeometry:
        """Pixels per visual token and the processor's own bounds (for budgets)."""

    @abstractmethod
    def count_visual_tokens(self, width: int, height: int, bounds: PixelBounds | None = None) -> int:
        """Visual tokens of a `width` x `height` image resized within `bounds` (None: the model's)."""

    @property
    def window_view_tokens(self) -> int | None:
        """The visual tokens of each image in a prompt of several (a window of pages or frames)
        when the family's processor shows such an image on another view than a prompt's only
        image (LLaVA-OneVision: one square view); None: the same view (`count_visual_tokens`)."""
        return None

    def count_window_tokens(self, width: int, height: int, bounds: PixelBounds | None = None) -> int:
        """Visual tokens of an image in a prompt of several images."""
        if self.window_view_tokens is not None:
            return self.window_view_tokens
        return self.count_visual_tokens(width, height, bounds)
