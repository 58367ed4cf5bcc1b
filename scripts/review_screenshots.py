"""Screenshots of the review site and the compare report for docs/review.md, from real runs.

    python scripts/review_screenshots.py docs/img [--model DIR]

Runs three small jobs on the tiny random model (built offline when --model is not given): one
over a PDF, an image, a video with still stretches and a broken file, with a JSON schema and
max_new_tokens=11 so that some JSON answers close ({"ok":true}) and some are cut off (schema
errors); then the same PDF and video at --detail high and low, compared. Serves the first job with
`visbatch view` and writes the comparison with `visbatch compare --html`, and photographs both in
headless Chromium (tests/browser.py). The answers of a random model are meaningless bytes; the
pages around them are what the pictures show.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ingest.budget import VisualBudget  # noqa: E402
from ingest.spec import IngestOptions, JobSpec, Sampling  # noqa: E402
from tests.browser import chromium, load_all_images  # noqa: E402
from tests.media import write_pdf, write_video  # noqa: E402
from tests.review_jobs import OK_SCHEMA, make_job, write_review_inputs  # noqa: E402
from visbatch.settings import Settings  # noqa: E402

CLI = [sys.executable, "-c", "from worker.cli.main import app; app(prog_name='visbatch')"]


def _full_page(driver, path: Path, width: int = 1400, max_height: int = 2000) -> None:
    driver.set_window_size(width, 900)
    load_all_images(driver)  # lazy images have no height until loaded
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, min(max(height + 140, 600), max_height))
    driver.save_screenshot(str(path))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", type=Path, help="a tiny model folder (default: build one)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="visbatch-shots-") as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            from worker.models.tiny import write_tiny_model

            model = write_tiny_model(root / "tiny")
        settings = Settings(home=root / "home", model=str(model))
        inputs = write_review_inputs(root / "in")
        review = JobSpec(
            prompts=["Is this page fine?", "Anything odd?"],
            json_schema=OK_SCHEMA,
            sampling=Sampling(max_new_tokens=11),
            ingest=IngestOptions(fps=1.0, longest_side=448),
        )
        job = make_job(settings, list(inputs.values()), review)
        (root / "cmp").mkdir()
        pages = [
            write_pdf(root / "cmp" / "invoice.pdf", pages=3),
            write_video(root / "cmp" / "clip.mp4", seconds=2),
        ]
        sampled = Sampling(max_new_tokens=8, temperature=1.0, seed=3)
        runs = [
            make_job(
                settings,
                pages,
                JobSpec(
                    prompts=["Describe the page.", "Is there a table? Answer yes or no."],
                    sampling=sampled,
                    ingest=IngestOptions(longest_side=896),
                    budget=VisualBudget(detail=detail),
                ),
            )
            for detail in ("high", "low")
        ]
        env = {"VISBATCH_HOME": str(settings.home), "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
        report = root / "report"
        subprocess.run([*CLI, "compare", *runs, "--html", str(report)], env=env, check=True)
        server = subprocess.Popen(
            [*CLI, "view", job, "--port", "0"], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            url = server.stdout.readline().split(" at ", 1)[1].split()[0]
            with chromium() as driver:
                driver.get(url)
                _full_page(driver, args.out / "review-index.png")
                [video] = [
                    a for a in driver.find_elements("css selector", "a.source") if a.text.endswith(".mp4")
                ]
                video.click()
                _full_page(driver, args.out / "review-video.png")
                driver.get(url)
                [pdf] = [
                    a
                    for a in driver.find_elements("css selector", "a.source")
                    if a.text.endswith("invoice.pdf")
                ]
                pdf.click()
                driver.find_element("css selector", '.tabs [data-view="schema"]').click()
                _full_page(driver, args.out / "review-schema-errors.png", max_height=1100)
                driver.get((report / "index.html").as_uri())
                _full_page(driver, args.out / "compare.png")
        finally:
            server.terminate()
            server.wait(timeout=10)


if __name__ == "__main__":
    main()
