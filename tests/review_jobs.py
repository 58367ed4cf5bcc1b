"""Real jobs for the review site and compare tests, run on the tiny random model.

``make_job`` is the ONE place these tests create a job: when the embedded driver moves, only it
changes. ``write_review_inputs`` makes a pile with every case the review site must show: PDF
pages, an image, video frames of which some are skipped as near-duplicates, and a broken file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image
from sqlalchemy import update

from ingest.spec import IngestOptions, JobSpec, Sampling
from storage.db import Database
from storage.review import RESULTS
from tests.media import write_pdf
from visbatch.settings import Settings

ROOT = Path(__file__).resolve().parents[1]

# Cut off at 10 tokens, the tiny model's JSON ({"ok":true} is 11 bytes, one token per byte) never
# closes: every answer is a real schema error, whatever the random weights choose.
OK_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
REVIEW_SPEC = JobSpec(
    prompts=["Is this page fine?", "Anything odd?"],
    json_schema=OK_SCHEMA,
    sampling=Sampling(max_new_tokens=10),
    ingest=IngestOptions(fps=1.0, longest_side=448),
)

# What the tests write into two answers through SQL (bound parameters): model output holding HTML.
HOSTILE_TEXT = '<script>window.__xss = "text"</script><img src=x onerror="window.__xss=\'img\'">'
HOSTILE_OUTPUT = {
    "note": '<script>window.__xss = "json"</script>',
    '<b onmouseover="window.__xss=1">key</b>': ["</td></tr></table><script>window.__xss=2</script>"],
}


def make_job(settings: Settings, paths: list[Path], spec: JobSpec) -> str:
    """Run a whole job in this process (the embedded shape) and return its id."""
    from worker.drivers.embedded import run_job
    from worker.runtime import Runtime

    rt = Runtime(settings)
    try:
        return run_job(rt, paths, spec)
    finally:
        rt.close()


def write_static_video(
    path: Path, seconds: int = 4, fps: int = 10, size: tuple[int, int] = (320, 240)
) -> Path:
    """A still scene for the first half, then a big red square: sampled at 1 fps, frames 1 and 3
    repeat frames 0 and 2 (skipped), frames 0 and 2 are kept."""
    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    still = np.stack([x * 255 // width, y * 255 // height, np.full_like(x, 90)], axis=-1).astype(np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            frame = still.copy()
            if i >= seconds * fps // 2:
                frame[40:200, 60:260] = (220, 20, 20)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_review_inputs(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    pdf = write_pdf(folder / "invoice.pdf", pages=3)
    image = folder / "photo.png"
    pixels = np.zeros((200, 300, 3), dtype=np.uint8)
    pixels[:, :150] = (30, 120, 200)
    Image.fromarray(pixels).save(image)
    broken = folder / "broken.pdf"
    broken.write_bytes(pdf.read_bytes()[:300])
    video = write_static_video(folder / "still.mp4")
    return {"pdf": pdf, "image": image, "broken": broken, "video": video}


def overwrite_answer(db: Database, result_id: int, *, text: str | None, output: Any = None) -> None:
    """Replace one stored answer, as a model that wrote HTML would have (bound parameters only)."""
    with db.session() as session:
        session.execute(
            update(RESULTS).where(RESULTS.c.id == result_id).values(text=text, output=output, error=None)
        )


def run_cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    """`visbatch ARGS` in a fresh interpreter on this tree, which then asserts that no model library
    was imported (view and compare only read the database and the store)."""
    code = (
        "import sys\nfrom worker.cli.main import app\ncode = 0\n"
        "try:\n    app(sys.argv[1:], prog_name='visbatch')\n"
        "except SystemExit as exc:\n    code = exc.code or 0\n"
        "heavy = sorted({'torch', 'transformers', 'vllm'} & set(sys.modules))\n"
        "assert not heavy, f'imported {heavy}'\nsys.exit(code)\n"
    )
    env = {"VISBATCH_HOME": str(home), "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
