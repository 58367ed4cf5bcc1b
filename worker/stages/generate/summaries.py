"""A source's summary (`--summarize`): one text-only request over the source's answers, each with
its page or time; in stages when they do not fit the model's context.

A stage asks the summary's prompt of as many answers as fit one request (the context, less
`--max-new-tokens`); when there are more, each part is summarized on its own and the parts'
answers are summarized the same way, until one request holds them all. Only the last answer is
stored (one row per source, scope `source`); the parts are redone if the run stops between them.
"""

from __future__ import annotations

from ingest.spec import JobSpec
from storage.summaries import SourceAnswer, SourceTask
from worker.engines.base import EngineRequest
from worker.models.base import ModelAdapter
from worker.results_export import question, span
from worker.stages.generate.requests import Prepared, SummaryChain

# A part is never cut below this many tokens (a context too small for even one answer).
MIN_PART_TOKENS = 64


def answer_lines(kind: str | None, answers: tuple[SourceAnswer, ...], spec: JobSpec) -> list[str]:
    """Each good answer with where it is and what it answers, in the source's order (an answer
    that failed is left out: it says nothing about the source)."""
    lines = []
    for a in answers:
        if a.error is not None or not (a.text or "").strip():
            continue
        where = span(kind, a.unit_from, a.unit_to, a.time_from, a.time_to)
        asked = question(spec.prompts, spec.then, a.prompt_index, a.turn) or ""
        lines.append(f"[{where}] {asked}\n{a.text.strip()}")
    return lines


def summary_index(spec: JobSpec) -> int:
    """The prompt index of a source's summary row: one past the job's prompts."""
    return len(spec.prompts)


class SummaryBuilder:
    """Builds the requests of a source's summary for one model (its chat template, its context)."""

    def __init__(self, adapter: ModelAdapter, context_tokens: int | None) -> None:
        self.adapter = adapter
        self.context_tokens = context_tokens

    def start(self, task: SourceTask, spec: JobSpec) -> list[Prepared]:
        texts = answer_lines(task.anchor.kind, task.answers, spec)
        chain = SummaryChain(task, spec, texts)
        if not texts:
            return [self._refused(chain, "no answers to summarize (every answer of the source failed)")]
        return self._stage(chain)

    def next(self, chain: SummaryChain) -> list[Prepared]:
        """The stage after the current one's parts are all answered."""
        chain.texts = [f"[part {i + 1}]\n{chain.answers[i]}" for i in range(chain.parts)]
        chain.stage += 1
        chain.answers = {}
        return self._stage(chain)

    def _stage(self, chain: SummaryChain) -> list[Prepared]:
        whole = self._prompt(chain, chain.texts, part=None)
        if self._fits(chain, whole):
            chain.final, chain.parts = True, 1
            return [self._prepared(chain, whole, 0)]
        groups = self._groups(chain)
        if chain.stage > 0 and len(groups) >= len(chain.texts):  # no stage would make them fewer
            return [self._refused(chain, "the answers do not fit the model's context even in parts")]
        chain.parts = len(groups)
        return [
            self._prepared(chain, self._prompt(chain, g, part=(i, len(groups))), i)
            for i, g in enumerate(groups)
        ]

    def _groups(self, chain: SummaryChain) -> list[list[str]]:
        """The texts in consecutive groups that each fit one request (a text too long alone is cut)."""
        # What a part's texts may take: the context, less the answer and the prompt around them.
        frame = len(self.adapter.prompt_ids(self._prompt(chain, [], part=(0, 2)), ()))
        room = (self.context_tokens or 0) - chain.spec.sampling.max_new_tokens - frame
        budget = max(MIN_PART_TOKENS, room)
        groups: list[list[str]] = [[]]
        used = 0
        for text in chain.texts:
            tokens = self._count(text) + 1
            if tokens > budget:  # one answer over a whole part: its start, said to be cut
                text = self._cut(text, budget)
                tokens = budget
            if used + tokens > budget and groups[-1]:
                groups.append([])
                used = 0
            groups[-1].append(text)
            used += tokens
        return groups

    def _prompt(self, chain: SummaryChain, texts: list[str], part: tuple[int, int] | None) -> str:
        source = chain.task.anchor.source_uri.rsplit("/", 1)[-1]
        what = "the answers about" if chain.stage == 0 else "summaries of parts of the answers about"
        head = f"{chain.spec.summarize}\n\nBelow are {what} {source}, in order"
        if part is not None:
            head += f" (part {part[0] + 1} of {part[1]}: answer for this part alone)"
        return head + ":\n\n" + "\n\n".join(texts)

    def _prepared(self, chain: SummaryChain, prompt: str, part: int) -> Prepared:
        s = chain.spec.sampling
        request = EngineRequest(
            prompt_ids=self.adapter.prompt_ids(prompt, ()),
            visual=(),
            cache_key=f"summary:{chain.task.source_id}:{chain.stage}:{part}",
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            prompt=prompt,
        )
        return Prepared(chain.task, chain.spec, summary_index(chain.spec), request, chain=chain, part=part)

    def _refused(self, chain: SummaryChain, why: str) -> Prepared:
        chain.final = True
        return Prepared(chain.task, chain.spec, summary_index(chain.spec), None, why, chain=chain)

    def _fits(self, chain: SummaryChain, prompt: str) -> bool:
        if self.context_tokens is None:
            return True
        tokens = len(self.adapter.prompt_ids(prompt, ())) + chain.spec.sampling.max_new_tokens
        return tokens <= self.context_tokens

    def _count(self, text: str) -> int:
        return len(self.adapter.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _cut(self, text: str, tokens: int) -> str:
        ids = self.adapter.tokenizer(text, add_special_tokens=False)["input_ids"][: max(1, tokens - 8)]
        return self.adapter.tokenizer.decode(ids) + " [cut]"
