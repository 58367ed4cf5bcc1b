"""The model-adapter interface: what visbatch needs to know about one VLM family.

Four things, and nothing else: the token rule (how many visual tokens an image of a given
size becomes, without weights), encode (pixels -> visual tokens with the vision tower), the
prompt template, and how generation inputs are built from cached tokens (embedding injection).
Engines and the pipeline only talk to this interface, so adding a family is one module.

Nothing here knows a family's geometry: the layout of an image's tokens (`VisualTokens.grid_thw`),
its positions (M-RoPE for Qwen, plain 1-D for Idefics3) and the extra tower outputs its language
model takes are read and written by the family's own adapter; token pruning and merging
(`reduced_generation_inputs`) only ask it for the full batch's positions and its grid rows.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from PIL import Image

from ingest.budget import PixelBounds, TokenGeometry
from ingest.token_rules import TokenRule, load_token_rule
from storage.keys import window_view_key
from worker.tokens.tensors import TokenSpec, VisualTokens


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
    # Why the vLLM engine cannot generate for this family from cached tokens (None: it can).
    vllm_unsupported: str | None = "visbatch has no vLLM inputs for this model family"
    # vLLM takes this family's cached tokens only with visbatch's plugin loaded in it
    # (worker/engines/vllm_models.py): certain in process, not in a server started elsewhere.
    vllm_needs_plugin: bool = False

    def __init__(self, ref: ModelRef) -> None:
        self.ref = ref
        self.device = ref.torch_device()
        self.dtype = ref.torch_dtype()

    # --- token rule (no weights, no torch: ingest.token_rules) ---------------------------

    @property
    def token_rule(self) -> TokenRule:
        return load_token_rule(self.ref.source, self.ref.revision)

    @property
    def has_window_view(self) -> bool:
        """Whether an image in a prompt of several (a window) is shown on another view, encoded
        and cached apart (`encode_window_view`, `cache_key(..., window_view=True)`):
        LLaVA-OneVision's square view."""
        return self.token_rule.window_view_tokens is not None

    def count_visual_tokens(self, width: int, height: int, bounds: PixelBounds | None = None) -> int:
        """Visual tokens this image becomes, by the processor's own resize rule (within `bounds`:
        a job's budget; None = the processor's own bounds)."""
        return self.token_rule.count_visual_tokens(width, height, bounds)

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

    def fingerprint_for(self, bounds: PixelBounds | None, window_view: bool = False) -> str:
        """The fingerprint with a job's resize bounds (the model's own bounds give `fingerprint`);
        of the images' window view (`has_window_view`) if asked."""
        bounds = self.token_geometry.normalize(bounds)
        cache = self.__dict__.setdefault("_fingerprints", {})
        if (bounds, window_view) not in cache:
            fields = {
                "family": self.family,
                "model": self.ref.source,
                "revision": self.ref.revision,
                "dtype": str(self.dtype),
                "preprocessing": self.preprocessing(bounds),
            }
            if window_view:  # absent for the usual view: its keys stay what they were
                fields["view"] = "window"
            blob = json.dumps(fields, sort_keys=True, default=str)
            cache[(bounds, window_view)] = hashlib.sha256(blob.encode()).hexdigest()[:32]
        return cache[(bounds, window_view)]

    def cache_key(self, image_hash: str, bounds: PixelBounds | None = None, window_view: bool = False) -> str:
        key = hashlib.sha256(f"{image_hash}:{self.fingerprint_for(bounds)}".encode()).hexdigest()
        return window_view_key(key) if window_view else key

    # --- weights: what every family reads the same way from its transformers checkpoint ------

    # The transformers class of the whole VLM (e.g. "Qwen2VLForConditionalGeneration").
    model_class_name: str = ""

    @cached_property
    def processor(self) -> Any:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(self.ref.source, revision=self.ref.revision)

    @cached_property
    def config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.ref.source, revision=self.ref.revision)

    @property
    def hidden_size(self) -> int:
        return int(self.config.text_config.hidden_size)

    @abstractmethod
    def tokens_for_grid(self, grid: torch.Tensor) -> int:
        """Visual tokens of a cached layout (`VisualTokens.grid_thw`); ValueError for a layout
        this family cannot make."""

    @property
    def token_spec(self) -> TokenSpec:
        """What this model's visual tokens must look like (layout -> count, hidden size, extras)."""
        return TokenSpec(hidden_size=self.hidden_size, dtype=self.dtype, tokens_for_grid=self.tokens_for_grid)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @cached_property
    def model(self) -> torch.nn.Module:
        """The whole VLM, loaded on first use and kept for the life of the process."""
        import transformers

        cls = getattr(transformers, self.model_class_name)
        model = cls.from_pretrained(self.ref.source, revision=self.ref.revision, dtype=self.dtype)
        return model.to(self.device).eval()

    def inner_model_for_encoding(self, language_model: str) -> torch.nn.Module:
        """The inner model (`.model`: tower, connector, language model) of the whole model when it
        is (or will be) loaded for generation; else a CPU load of the checkpoint (every published
        key layout maps as transformers maps it) with its language model (the inner model's
        attribute `language_model`) dropped, so that an encode worker beside vLLM holds no second
        copy of the LM. For families whose `get_image_features` is the inner model's."""
        if not self.vision_only or "model" in self.__dict__:
            return self.model.model
        import transformers

        cls = getattr(transformers, self.model_class_name)
        inner = cls.from_pretrained(self.ref.source, revision=self.ref.revision, dtype=self.dtype).model
        setattr(inner, language_model, torch.nn.Module())  # its weights go with the dropped model
        return inner.to(self.device).eval()

    @abstractmethod
    def encode(self, images: list[Image.Image], bounds: PixelBounds | None = None) -> list[VisualTokens]:
        """Run the vision tower over a batch of images (resized within `bounds`)."""

    def encode_window_view(
        self, images: list[Image.Image], bounds: PixelBounds | None = None
    ) -> list[VisualTokens]:
        """The images as the processor shows each one in a prompt of several (`has_window_view`)."""
        raise NotImplementedError(f"{type(self).__name__} shows every image on one view")

    def prompt_ids(
        self,
        prompt: str,
        visual: VisualTokens | Sequence[VisualTokens] | None,
        history: Sequence[tuple[str, str]] = (),
    ) -> list[int]:
        """Token ids of the chat prompt with the image(s) first and their placeholders expanded.

        `history`: the conversation's earlier turns, (question, answer) each (a follow-up turn,
        `--then`): the images go with the first question, each answer is the assistant's turn,
        and `prompt` is the last user turn.

        `visual` is one image's tokens, or several images' in order (a window of pages or frames:
        one user turn with an image entry each, as the model's own processor lays out several
        images), or none (an empty sequence: a text-only request). The layout can shape the
        prompt (Idefics3 tags every tile), so it takes the visual tokens themselves; None gives
        the prompt of one image without its placeholders (a count of the text tokens, e.g. for
        the planner).
        """
        images: list[VisualTokens | None]
        if visual is None:
            images = [None]
        elif isinstance(visual, Sequence) and not isinstance(visual, VisualTokens) and len(visual) == 0:
            images = []  # a text-only request (a source's summary, `--summarize`)
        elif isinstance(visual, VisualTokens):
            images = [visual]
        elif isinstance(visual, Sequence) and visual and all(isinstance(v, VisualTokens) for v in visual):
            images = list(visual)
        else:
            raise TypeError(
                "prompt_ids takes the images' VisualTokens (their layout shapes the prompt), "
                f"or None for the text alone; got {type(visual).__name__}"
            )
        return self.template_ids(prompt, images, history)

    # The processor's placeholder of one image in the chat template's text ("<image>", ...).
    @property
    def image_placeholder(self) -> str:
        return str(self.processor.image_token)

    # Whether the tokenizer adds its special tokens (BOS) to the rendered chat text.
    add_special_tokens: bool = True

    def template_ids(
        self, prompt: str, images: list[VisualTokens | None], history: Sequence[tuple[str, str]] = ()
    ) -> list[int]:
        """`prompt_ids` for a checked list of images: the chat template rendered with an image entry
        per image, each placeholder replaced by that image's own expansion (`image_text`), as the
        model's processor does it, then tokenized."""
        placeholder = self.image_placeholder
        texts = [prompt, *(text for turn in history for text in turn)]
        if any(marker in text for text in texts for marker in self.reserved_markers()):
            raise ValueError("the prompt must not contain image placeholder tokens")
        content: list[dict[str, str]] = [{"type": "image"} for _ in images]
        questions = [question for question, _ in history] + [prompt]
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": [*content, {"type": "text", "text": questions[0]}]}
        ]
        for (_, answer), question in zip(history, questions[1:], strict=True):
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
            messages.append({"role": "user", "content": [{"type": "text", "text": question}]})
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        parts = text.split(placeholder)
        if len(parts) != len(images) + 1:
            raise ValueError(f"the chat template gave {len(parts) - 1} image placeholders for {len(images)}")
        text = parts[0] + "".join(
            self.image_text(image) + part for image, part in zip(images, parts[1:], strict=True)
        )
        ids = self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"]
        expected = sum(v.num_tokens for v in images if v is not None)
        if ids.count(self.image_token_id) != expected:
            raise ValueError(
                f"the prompt has {ids.count(self.image_token_id)} image placeholders, "
                f"the visual tokens are {expected}"
            )
        return ids

    def reserved_markers(self) -> list[str]:
        """Text a user's prompt must not hold: the processor's image (and video) markers."""
        return [self.image_placeholder]

    @abstractmethod
    def image_text(self, visual: VisualTokens | None) -> str:
        """What one image's placeholder expands to in the prompt's text, by the processor's own rule
        (None: the image's frame without its visual tokens)."""

    @cached_property
    def image_token_id(self) -> int:
        """The placeholder id whose positions take the visual tokens."""
        return int(self.config.image_token_id)

    def generation_inputs(self, prompts: list[list[int]], visuals: list[VisualTokens]) -> dict[str, Any]:
        """Left-padded batch inputs for `model.generate` with cached embeddings injected: by
        default the images' embeddings in batch order, which the model places over its image
        placeholders in order (a family with more inputs, such as Qwen's grids, overrides this)."""
        input_ids, attention = self.left_padded(prompts)
        return {
            "input_ids": input_ids,
            "attention_mask": attention,
            "mm_encoder_outputs": self.mm_encoder_outputs([v.embeds.to(self.dtype) for v in visuals], []),
        }

    def left_padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask of a batch, left-padded (every row's next token lands in
        the last column), on the model's device."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention[row, width - len(ids) :] = 1
        return input_ids.to(self.device), attention.to(self.device)

    # --- token pruning and merging (transformers engine) ----------------------------------

    def token_rows(self, visual: VisualTokens) -> list[int]:
        """Lengths of the image's grid rows, in token order: merging joins neighbours in a row only."""
        return [visual.num_tokens]

    def prompt_positions(self, inputs: dict[str, Any]) -> torch.Tensor:
        """Positions of the full batch (generation_inputs), as (rows, batch, length): what the
        model itself would use. Default: plain 1-D positions of a left-padded batch."""
        mask = inputs["attention_mask"]
        return (mask.long().cumsum(-1) - 1).clamp(min=0).unsqueeze(0)

    def positions_for_generate(self, positions: torch.Tensor) -> torch.Tensor:
        """`prompt_positions`' layout as `generate(position_ids=...)` takes it."""
        return positions[0] if positions.shape[0] == 1 else positions

    def mm_encoder_outputs(
        self, embeds: list[torch.Tensor], extras: list[dict[str, torch.Tensor]]
    ) -> dict[str, Any]:
        """The `mm_encoder_outputs` that put these embeddings (and extras) at the image positions."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return {"image": BaseModelOutputWithPooling(pooler_output=tuple(e.to(self.device) for e in embeds))}

    # Per-column inputs besides input_ids and attention_mask that drop with a dropped column.
    column_inputs: tuple[str, ...] = ()

    def reduced_generation_inputs(
        self,
        prompts: list[list[int]],
        visuals: list[VisualTokens | tuple[VisualTokens, ...]],
        prune_keeps: list[float],
        merge_keeps: list[float],
        drop_statics: list[float] | None = None,
    ) -> tuple[dict[str, Any], list[int], list[int]]:
        """Like `generation_inputs`, each row's image merged to `merge_keeps[row]` of its tokens
        and then pruned to `prune_keeps[row]` of what is left, or a row's window of frames without
        its static patches (`drop_statics[row]`) (worker.tokens.reduction); every token that stays
        keeps its original position. Also returns the tokens pruned (or dropped as static) and
        merged away per row."""
        from worker.tokens.reduction import reduce_inputs

        flat = [image for row in visuals for image in (row if isinstance(row, tuple) else (row,))]
        return reduce_inputs(
            self, self.generation_inputs(prompts, flat), visuals, prune_keeps, merge_keeps, drop_statics
        )

    def vllm_llm_options(self) -> dict[str, Any]:
        """Family-specific `vllm.LLM` arguments. Default: embeddings-only with no image or video
        per prompt, so vLLM does not even load the vision tower."""
        return {"limit_mm_per_prompt": {"image": 0, "video": 0}}

    def vllm_prompt(
        self, prompt_ids: list[int], images: Sequence[VisualTokens], uuids: Sequence[str]
    ) -> dict[str, Any]:
        """The request as vLLM's `LLM.generate` takes it (a TokensPrompt dict), fed cached embeddings.

        `prompt_ids` are ours, each image's placeholders expanded (one run per image, in order);
        vLLM expands a single placeholder per image itself, from the embeddings. `uuids` name the
        images for vLLM's caches (our cache keys: no tensor hashing, and a page asked several
        prompts, or in overlapping windows, shares its cached KV blocks). Raises ValueError when
        the prompt and the visual tokens do not belong together.
        """
        if self.vllm_unsupported:
            raise NotImplementedError(
                f"{type(self).__name__} cannot build vLLM inputs: {self.vllm_unsupported}"
            )
        if len(uuids) != len(images):
            raise ValueError(f"{len(uuids)} cache keys for {len(images)} images")
        return {
            "prompt_token_ids": self.collapse_image_placeholders(prompt_ids, images),
            "multi_modal_data": {"image": self.vllm_embeddings(images)},
            "multi_modal_uuids": {"image": list(uuids)},
        }

    def collapse_image_placeholders(self, prompt_ids: list[int], images: Sequence[VisualTokens]) -> list[int]:
        """Our prompt with each image's run of placeholder ids (one per visual token) collapsed to
        ONE id (given an expanded run, vLLM would expand every id again). ValueError when the runs
        and the images' tokens disagree."""
        counts = [v.num_tokens for v in images]
        at = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        if not at:
            raise ValueError("prompt has no image placeholder")
        runs: list[tuple[int, int]] = []  # (first, last) of each run
        for i in at:
            if runs and runs[-1][1] == i - 1:
                runs[-1] = (runs[-1][0], i)
            else:
                runs.append((i, i))
        found = [last - first + 1 for first, last in runs]
        if found != list(counts):
            raise ValueError(
                f"prompt has image placeholders in runs of {found}, the visual tokens are {list(counts)}"
            )
        out: list[int] = []
        at_id = 0
        for first, last in runs:
            start, end = self.vllm_image_span(prompt_ids, first, last)
            out += prompt_ids[at_id:start] + [self.image_token_id]
            at_id = end + 1
        return out + prompt_ids[at_id:]

    def vllm_image_span(self, prompt_ids: list[int], first: int, last: int) -> tuple[int, int]:
        """The ids vLLM writes itself for the placeholder run `first..last` (inclusive): the run
        (Qwen, LLaVA-OneVision); InternVL's wraps it in its own start and end tags."""
        return first, last

    def vllm_image_data(self, visual: VisualTokens) -> Any:
        """One image's embeddings as vLLM takes them (a content part of `vllm serve` too): the
        (tokens, hidden) tensor; Qwen adds its grid."""
        return visual.embeds

    def vllm_embeddings(self, images: Sequence[VisualTokens]) -> Any:
        """The request's images as vLLM's `multi_modal_data["image"]`: one (1, tokens, hidden)
        tensor for one image, a list of (tokens, hidden) tensors (one item each) for several;
        embeddings with their layout (a dict: Qwen, Idefics3) end to end and one layout row each
        (vLLM splits the embeddings by the layouts' sizes, in order)."""
        data = [self.vllm_image_data(v) for v in images]
        if isinstance(data[0], dict):
            return {name: torch.cat([d[name] for d in data]) for name in data[0]}
        if len(images) == 1:
            return data[0].unsqueeze(0)
        return data

    def decode_tokens(self, data: bytes, fingerprint: str | None = None) -> VisualTokens:
        """A serialized cache entry, checked against this model (InvalidVisualTokens otherwise)."""
        return VisualTokens.from_bytes(
            data, fingerprint=fingerprint or self.fingerprint, spec=self.token_spec
        )

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos or [])


class TiledImageAdapter(ModelAdapter):
    """What the tile families (Idefics3, InternVL) share: an image's tokens are square tiles of
    `tile_rule.image_seq_len` tokens each (pixel shuffle keeps each tile's grid), and the model
    scatters one concatenated run of the batch's tokens over its image placeholders, in order."""

    tile_rule: Any  # the family's tile rule (ingest.token_rules): image_seq_len tokens per tile

    def mm_encoder_outputs(
        self, embeds: list[torch.Tensor], extras: list[dict[str, torch.Tensor]]
    ) -> dict[str, Any]:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        # One (tokens, hidden) tensor for the batch, scattered over the placeholders in order
        # (Idefics3 before transformers 5.20 takes no per-image tuple; InternVL's placeholder check
        # counts elements, so any leading shape works).
        merged = torch.cat([e.to(self.device, self.dtype) for e in embeds])
        return {"image": BaseModelOutputWithPooling(pooler_output=merged)}

    def token_rows(self, visual: VisualTokens) -> list[int]:
        """Each tile's tokens are a square grid in row-major order (pixel shuffle keeps it)."""
        seq_len = self.tile_rule.image_seq_len
        side = round(seq_len**0.5)
        if side * side != seq_len:
            return [seq_len] * (visual.num_tokens // seq_len)  # not square: a tile is one row
        return [side] * (visual.num_tokens // side)
