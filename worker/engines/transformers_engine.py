"""Generation with transformers from cached visual tokens: the vision tower never runs here."""

from __future__ import annotations

from itertools import groupby

import torch
from transformers import LogitsProcessorList

from worker.engines.base import EngineRequest, Generation
from worker.models.base import ModelAdapter
from worker.structured import GrammarLogitsProcessor


class TransformersEngine:
    name = "transformers"

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter

    def generate(self, requests: list[EngineRequest]) -> list[Generation]:
        results: dict[int, Generation] = {}
        order = sorted(range(len(requests)), key=lambda i: requests[i].sampling_key)
        # One generate call per sampling setting: transformers applies one setting per call.
        for _, group in groupby(order, key=lambda i: requests[i].sampling_key):
            idx = list(group)
            for i, gen in zip(idx, self._generate_group([requests[i] for i in idx]), strict=True):
                results[i] = gen
        return [results[i] for i in range(len(requests))]

    @torch.inference_mode()
    def _generate_group(self, requests: list[EngineRequest]) -> list[Generation]:
        adapter = self.adapter
        model = adapter.model
        prompts, visuals = [r.prompt_ids for r in requests], [r.visual for r in requests]
        prune_keeps, merge_keeps = [r.prune_keep for r in requests], [r.merge_keep for r in requests]
        pruned = merged = [0] * len(requests)
        if any(keep < 1.0 for keep in prune_keeps + merge_keeps):  # positions kept: worker.token_reduction
            inputs, pruned, merged = adapter.reduced_generation_inputs(
                prompts, visuals, prune_keeps, merge_keeps
            )
        else:
            inputs = adapter.generation_inputs(prompts, visuals)
        first = requests[0]
        processors = LogitsProcessorList()
        if any(r.json_schema is not None for r in requests):
            vocab = int(model.get_output_embeddings().weight.shape[0])
            processors.append(
                GrammarLogitsProcessor(adapter.tokenizer, vocab, [r.json_schema for r in requests])
            )
        sampling: dict = {"do_sample": False}
        if first.temperature > 0:
            torch.manual_seed(first.seed)
            sampling = {"do_sample": True, "temperature": first.temperature, "top_p": first.top_p}
        output = model.generate(
            **inputs,
            max_new_tokens=max(r.max_new_tokens for r in requests),
            logits_processor=processors,
            pad_token_id=adapter.tokenizer.pad_token_id,
            eos_token_id=adapter.eos_token_ids,
            top_k=None,
            **sampling,
        )
        width = inputs["input_ids"].shape[1]
        return [
            self._decode(output[row, width:].tolist(), r.max_new_tokens, pruned[row], merged[row])
            for row, r in enumerate(requests)
        ]

    def _decode(
        self, new_ids: list[int], max_new_tokens: int, pruned_tokens: int = 0, merged_tokens: int = 0
    ) -> Generation:
        eos = set(self.adapter.eos_token_ids)
        new_ids = new_ids[:max_new_tokens]
        finish = "length"
        for pos, tok in enumerate(new_ids):
            if tok in eos:
                new_ids, finish = new_ids[:pos], "stop"
                break
        text = self.adapter.tokenizer.decode(new_ids, skip_special_tokens=True)
        return Generation(
            token_ids=new_ids,
            text=text,
            finish_reason=finish,
            pruned_tokens=pruned_tokens,
            merged_tokens=merged_tokens,
        )
