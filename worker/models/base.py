"""The model-adapter interface: what visbatch needs to know about one VLM family.

Four things, and nothing else: the token rule (how many visual tokens an image of a given
size becomes, without weights), encode (pixels -> visual tokens with the vision tower), the
prompt template, and how generation inputs are built from cached tokens (embedding injection).
Engines and the pipeline only talk to this interface, so adding a family is one module.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from ingest.budget import PixelBounds, TokenGeometry
from ingest.token_rules import TokenRule, load_token_rule
from worker.visual_tokens import VisualTokens


@dataclass(frozen=True)
class ModelRef:
    source: str  # hub id or local folder
    revision: str | None = None
    device: str = "auto"
    dtype: str = "auto"

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            # bf16 halves memory on GPU; CPUs here are faster and exact in fp32.
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


class ModelAdapter(ABC):
    """One model family. Construction is cheap (config and processor only); weights load lazily."""

    family: str = ""
    # Set when another engine (vLLM) generates: encoding then loads the vision tower alone.
    vision_only: bool = False

    def __init__(self, ref: ModelRef) -> None:
        self.ref = ref
        self.device = ref.torch_device()
        self.dtype = ref.torch_dtype()

    # --- token rule (no weights, no torch: ingest.token_rules) ---------------------------

    @property
    def token_rule(self) -> TokenRule:
        return load_token_rule(self.ref.source, self.ref.revision)

    def visual_tokens(self, width: int, height: int, bounds: PixelBounds | None = None) -> int:
        """Visual tokens this image becomes, by the processor's own resize rule (within `bounds`:
        a job's budget; None = the processor's own bounds)."""
        return self.token_rule.visual_tokens(width, height, bounds)

    @property
    def token_geometry(self) -> TokenGeometry:
        """Pixels per visual token and the processor's own resize bounds (for budgets)."""
        return self.token_rule.token_geometry

    @abstractmethod
    def preprocessing(self, bounds: PixelBounds | None = None) -> dict[str, Any]:
        """Every parameter that changes the pixels the tower sees (for the cache key)."""

    @property
    def fingerprint(self) -> str:
        """Model, revision, dtype and preprocessing: equal fingerprints give equal tokens."""
        return self.fingerprint_for(None)

    def fingerprint_for(self, bounds: PixelBounds | None) -> str:
        """The fingerprint with a job's resize bounds; the model's own bounds give `fingerprint`."""
        bounds = self.token_geometry.normalize(bounds)
        cache = self.__dict__.setdefault("_fingerprints", {})
        if bounds not in cache:
            blob = json.dumps(
                {
                    "family": self.family,
                    "model": self.ref.source,
                    "revision": self.ref.revision,
                    "dtype": str(self.dtype),
                    "preprocessing": self.preprocessing(bounds),
                },
                sort_keys=True,
                default=str,
            )
            cache[bounds] = hashlib.sha256(blob.encode()).hexdigest()[:32]
        return cache[bounds]

    def cache_key(self, image_hash: str, bounds: PixelBounds | None = None) -> str:
        return hashlib.sha256(f"{image_hash}:{self.fingerprint_for(bounds)}".encode()).hexdigest()

    # --- weights -----------------------------------------------------------------------

    @property
    @abstractmethod
    def hidden_size(self) -> int: ...

    @property
    @abstractmethod
    def merge_size(self) -> int: ...

    @property
    @abstractmethod
    def tokenizer(self) -> Any: ...

    @property
    @abstractmethod
    def model(self) -> torch.nn.Module:
        """The whole VLM, loaded on first use and kept for the life of the process."""

    @abstractmethod
    def encode(self, images: list[Image.Image], bounds: PixelBounds | None = None) -> list[VisualTokens]:
        """Run the vision tower over a batch of images (resized within `bounds`)."""

    @abstractmethod
    def prompt_ids(self, prompt: str, num_visual_tokens: int) -> list[int]:
        """Token ids of the chat prompt with the image first and its placeholders expanded."""

    @abstractmethod
    def generation_inputs(self, prompts: list[list[int]], visuals: list[VisualTokens]) -> dict[str, Any]:
        """Left-padded batch inputs for `model.generate` with cached embeddings injected."""

    def pruned_generation_inputs(
        self, prompts: list[list[int]], visuals: list[VisualTokens], keeps: list[float]
    ) -> tuple[dict[str, Any], list[int]]:
        """Like `generation_inputs`, each row's visual tokens pruned to the fraction `keeps[row]`
        (kept tokens keep their positions); also returns the tokens pruned per row."""
        raise NotImplementedError(f"{type(self).__name__} cannot prune visual tokens")

    def vllm_prompt(self, prompt_ids: list[int], visual: VisualTokens, uuid: str) -> dict[str, Any]:
        """The request as vLLM's `LLM.generate` takes it (a TokensPrompt dict), fed cached embeddings.

        `prompt_ids` are ours (placeholders expanded); `uuid` names the image for vLLM's caches.
        Raises ValueError when the prompt and the visual tokens do not belong together.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot build vLLM inputs")

    def decode_tokens(self, data: bytes, fingerprint: str | None = None) -> VisualTokens:
        """A serialized cache entry, checked against this model (InvalidVisualTokens otherwise)."""
        return VisualTokens.from_bytes(
            data,
            fingerprint=fingerprint or self.fingerprint,
            hidden_size=self.hidden_size,
            merge_size=self.merge_size,
            dtype=self.dtype,
        )

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos or [])
