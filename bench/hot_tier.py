"""Q15. The hot tier (the cache Redis): what a too-small one costs, and what one instance moves.

1. Eviction: the same job (a report PDF, one prompt, `--cache hot`) run with every page encoded
   before any is generated (bench.embedded.run_staged: the fleet's worst case, encode running
   ahead of generate), against a redis-server of its own whose maxmemory holds all the job's
   entries x 2 ("sized") or 4 entries ("small"). A page evicted between encode and generate is
   encoded again by generate: the tower's images per page and the two stages' seconds, side by side.
2. Bandwidth: SET then GET of 7B-sized entries (1,518 tokens x 3,584 x bf16 = 10.9 MB) through
   RedisTokenCache against that redis-server over loopback, one client: a floor for what one
   Redis instance moves (no NIC here; a real one is bounded by its network first: 10 GbE is
   1,250 MB/s, and each page costs one SET and one GET of its entry).

The machine is shared: the load average is recorded before and after; the two arms of (1) are
interleaved.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench.common import Check, arguments, bars, median, rounded, write_result
from bench.embedded import run_staged, runtime
from bench.media import report_pdf
from bench.models import bench_model
from ingest.spec import JobSpec, Sampling
from storage import repository as repo

ENTRY_7B = 1518 * 3584 * 2


def _redis(workdir: Path, maxmemory: int):  # -> tests.faults.RedisServer
    from tests.faults import RedisServer

    return RedisServer(workdir, "--appendonly", "no", "--maxmemory", str(maxmemory),
                       "--maxmemory-policy", "allkeys-lru")  # fmt: skip


def eviction_arm(pages: int, maxmemory_entries: float | None, entry: int) -> dict[str, float]:
    model = bench_model("tiny")
    spec = JobSpec(prompts=["What is on this page?"], sampling=Sampling(max_new_tokens=2), cache="hot")
    with tempfile.TemporaryDirectory(prefix="bench-hot-") as tmp:
        limit = int(entry * (maxmemory_entries if maxmemory_entries is not None else 2 * pages))
        server = _redis(Path(tmp) / "redis", limit)
        try:
            rt = runtime(Path(tmp) / "home", model, cache_url=server.url)
            job_id, seconds = run_staged(rt, [report_pdf(pages, variant="hot-tier")], spec)
            summary = repo.job_summary(rt.db, job_id)
            assert summary["results"] == pages, summary["errors"]
            out = {
                "maxmemory_bytes": limit,
                "tower_images_per_page": rt.token_store.stats.images_encoded / pages,
                "encode_s": seconds["encode"],
                "generate_s": seconds["generate"],
            }
            rt.close()
        finally:
            server.stop()
    return out


def entry_size(pages: int) -> int:
    """Bytes of one cache entry of the tiny model for this PDF's page (all pages are alike)."""
    model = bench_model("tiny")
    with tempfile.TemporaryDirectory(prefix="bench-hot-") as tmp:
        rt = runtime(Path(tmp) / "home", model)
        job_id, _ = run_staged(rt, [report_pdf(pages, variant="hot-tier")], JobSpec(
            prompts=["x"], sampling=Sampling(max_new_tokens=1)), stages=("ingest", "encode"))  # fmt: skip
        sizes = [p.stat().st_size for p in (Path(tmp) / "home" / "token-cache").glob("*/*.safetensors")]
        rt.close()
    return max(sizes)


def bandwidth(reps: int) -> dict[str, float]:
    from storage.token_cache import RedisTokenCache

    data = os.urandom(ENTRY_7B)
    with tempfile.TemporaryDirectory(prefix="bench-hot-") as tmp:
        server = _redis(Path(tmp) / "redis", 4 * 1024**3)
        try:
            cache = RedisTokenCache.from_url(server.url)
            cache.client.connection_pool.connection_kwargs["socket_timeout"] = 30
            n = 20
            set_s, get_s = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                for i in range(n):
                    cache.put(f"{i:064x}", data)
                t1 = time.perf_counter()
                for i in range(n):
                    assert cache.get(f"{i:064x}") == data
                t2 = time.perf_counter()
                set_s.append(t1 - t0)
                get_s.append(t2 - t1)
        finally:
            server.stop()
    mb = n * ENTRY_7B / 1e6
    return {"entry_mb": ENTRY_7B / 1e6, "set_mb_s": mb / median(set_s), "get_mb_s": mb / median(get_s)}


def main() -> None:
    args = arguments(__doc__, default_reps=2, quick_reps=1)
    pages = 8 if args.quick else 24
    load_before = [round(x, 2) for x in os.getloadavg()]
    entry = entry_size(pages)
    arms: dict[str, list[dict[str, float]]] = {"sized": [], "small": []}
    for _ in range(args.reps):
        arms["sized"].append(eviction_arm(pages, None, entry))
        arms["small"].append(eviction_arm(pages, 4, entry))
    bw = bandwidth(3 if not args.quick else 1)
    load_after = [round(x, 2) for x in os.getloadavg()]

    def med(arm: str, key: str) -> float:
        return rounded(median([r[key] for r in arms[arm]]))

    figures = {
        "pages": pages,
        "entry_bytes": entry,
        "arms": arms,
        "median": {arm: {k: med(arm, k) for k in arms[arm][0]} for arm in arms},
        "bandwidth": {k: rounded(v) for k, v in bw.items()},
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    }
    small, sized = figures["median"]["small"], figures["median"]["sized"]
    for arm, m in figures["median"].items():
        print(f"{arm:6} maxmemory {m['maxmemory_bytes'] / 1e6:8.1f} MB: {m['tower_images_per_page']:.2f} "
              f"tower images a page, encode {m['encode_s']:.1f} s, "
              f"generate {m['generate_s']:.1f} s")  # fmt: skip
    print(f"one Redis over loopback, {bw['entry_mb']:.1f} MB entries: SET {bw['set_mb_s']:.0f} MB/s, "
          f"GET {bw['get_mb_s']:.0f} MB/s (load {load_before} -> {load_after})")  # fmt: skip
    checks = [
        Check("tower images a page, hot tier sized for the pages in flight", sized["tower_images_per_page"],
              "<=", 1.0),
        Check("tower images a page, hot tier of 4 entries (evicted before generate)",
              small["tower_images_per_page"], ">=", 1.5),
    ]  # fmt: skip
    write_result(
        "hot_tier",
        quick=args.quick,
        question="What does a hot tier smaller than the pages in flight cost, and what does one Redis move?",
        baseline="the same job with the cache Redis sized for every page in flight",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(
            ["sized", "small"],
            [sized["tower_images_per_page"], small["tower_images_per_page"]],
            "tower images per page",
            "Hot tier too small: pages encoded twice",
        ),  # fmt: skip
    )


if __name__ == "__main__":
    main()
