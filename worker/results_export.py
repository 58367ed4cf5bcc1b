"""A job's results in the forms people use elsewhere: JSON lines, CSV, Parquet, one file per document.

Every record says where its answer comes from the way a person reads it and the way SQL joins
it: ``source`` (the file or object), ``kind``, ``page_number`` (PDF pages counted from 1, as a
reader counts them; empty for videos and images), ``timestamp`` (seconds into a video),
``unit_index`` and ``prompt_index`` (0-based, the tables' own keys, as in the ``result_rows``
view), the ``prompt`` text and the answer (``output``: the JSON of a schema job, ``text`` the raw
text). What the answer covers: ``scope`` (``unit``, or ``window`` for several units in one
prompt: ``--window``), ``unit_from``/``unit_to`` (0-based, inclusive), ``page_from``/``page_to``
(PDFs), ``time_from``/``time_to`` (videos: the first and last frame's time) and ``turn``.
``--by-document`` writes one file per source with its pages in order: Markdown for text answers,
JSON for schema answers (what olmOCR and docling users expect from a document job).
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from itertools import groupby
from pathlib import Path
from typing import IO, Any

from worker.errors import UserError

FORMATS = ("jsonl", "csv", "parquet")

# The extensions a file's format is read from (`visbatch results JOB -o answers.parquet`,
# `job.write("answers.csv")`): `.json` too, for JSON lines, as Spark and BigQuery name them.
EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}

# The columns of every export, in order (see the module doc for the bases).
EXPORT_FIELDS = [
    "source",
    "kind",
    "page_number",
    "timestamp",
    "unit_index",
    "scope",
    "unit_from",
    "unit_to",
    "page_from",
    "page_to",
    "time_from",
    "time_to",
    "turn",
    "prompt_index",
    "prompt",
    "output",
    "text",
    "error",
    "finish_reason",
    "prompt_tokens",
    "visual_tokens",
    "completion_tokens",
    "pruned_tokens",
    "merged_tokens",
    "model",
    "engine",
    "cache_hit",
    "latency_ms",
]


def page_number(kind: str | None, unit_index: int | None) -> int | None:
    """1-based page of a PDF; None for a video frame or an image (they have a timestamp or none)."""
    return unit_index + 1 if kind == "pdf" and unit_index is not None else None


def format_timestamp(seconds: float) -> str:
    """A frame's time as every output writes it, the review pages too: 0:03.000, 1:02:07.250
    (milliseconds, as video tools write them: frames a thirtieth of a second apart stay apart)."""
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}:{minutes:02d}:{secs:06.3f}" if hours else f"{minutes}:{secs:06.3f}"


def place(kind: str | None, unit_index: int | None, timestamp: float | None) -> str:
    """Where in a source, as a person says it: 'page 3', 'frame at 0:12.000', 'image'."""
    if unit_index is None:
        return ""
    if kind == "pdf":
        return f"page {unit_index + 1}"
    if kind == "video":
        return (
            f"frame at {format_timestamp(timestamp)}" if timestamp is not None else f"frame {unit_index + 1}"
        )
    return "image" if kind == "image" else f"unit {unit_index + 1}"


def span(kind: str | None, first: int, last: int, time_from: float | None, time_to: float | None) -> str:
    """A window's units as a person says them: 'pages 1-2', 'frames 0:00.000-0:04.000'."""
    if first == last:
        return place(kind, first, time_from)
    if kind == "pdf":
        return f"pages {first + 1}-{last + 1}"
    if kind == "video" and time_from is not None and time_to is not None:
        return f"frames {format_timestamp(time_from)}-{format_timestamp(time_to)}"
    return f"units {first + 1}-{last + 1}"


# What an export record takes from a result as it is (the rest is computed in export_record).
_AS_STORED = EXPORT_FIELDS[EXPORT_FIELDS.index("output") :]


def asked(spec: dict[str, Any]) -> list[str]:
    """A stored spec's questions by prompt index: its prompts, then its summary's (`--summarize`:
    a source's summary row has the index one past the prompts)."""
    prompts = list(spec.get("prompts") or [])
    return prompts + [spec["summarize"]] if spec.get("summarize") else prompts


def question(prompts: list[str], then: list[list[str]], prompt_index: int, turn: int) -> str | None:
    """The text a result answers: its prompt (turn 0) or that prompt's follow-up turn (`--then`)."""
    if not 0 <= prompt_index < len(prompts):
        return None
    turns = [prompts[prompt_index], *(then[prompt_index] if prompt_index < len(then) else [])]
    return turns[turn] if 0 <= turn < len(turns) else None


def export_record(
    result: dict[str, Any], prompts: list[str], then: list[list[str]] | None = None
) -> dict[str, Any]:
    """A row of storage.results.iter_results as an export record (EXPORT_FIELDS)."""
    index, kind, first = result["prompt_index"], result["kind"], result["unit"]
    last = first if result.get("unit_to") is None else result["unit_to"]
    video = kind == "video"
    return {
        "source": result["source"],
        "kind": kind,
        "page_number": page_number(kind, first),
        "timestamp": result["timestamp"],
        "unit_index": first,
        "scope": result.get("scope") or "unit",
        "unit_from": first,
        "unit_to": last,
        "page_from": page_number(kind, first),
        "page_to": page_number(kind, last),
        "time_from": result["timestamp"] if video else None,
        "time_to": result.get("timestamp_to", result["timestamp"]) if video else None,
        "turn": result.get("turn") or 0,
        "prompt_index": index,
        "prompt": question(prompts, then or [], index, result.get("turn") or 0),
        **{key: result.get(key) for key in _AS_STORED},
    }


def output_format(path: Path | None, given: str | None, *, option: str = "--format") -> str:
    """The format of a results file: `given` (the `option` a caller spelled: `--format`, or the
    API's `format=`), else the extension of `path`, else JSON lines (to stdout). Issue 31:
    `-o b.parquet` wrote JSON lines into b.parquet.

    A format that contradicts a known extension (`--format csv -o a.parquet`) is refused, not
    honoured: either the name or the option is a mistake, and a file whose name lies about its
    bytes fails later, in whatever reads it by its name (pandas, DuckDB, a spreadsheet). A refusal
    can be relaxed later without breaking a script; honouring it could not be taken back. An
    extension we do not know (`-o answers.txt`) takes the format given, and needs one."""

    def spelled(value: str) -> str:
        return f"{option}{value!r}" if option.endswith("=") else f"{option} {value}"

    if given is not None and given not in FORMATS:
        raise UserError(f"{spelled(given)}: not a format", f"use {', '.join(FORMATS)}")
    if path is None:
        return given or "jsonl"
    by_name = EXTENSIONS.get(path.suffix.lower())
    if given is not None and by_name is not None and given != by_name:
        raise UserError(
            f"{spelled(given)} contradicts the file name {path} ({path.suffix} is {by_name})",
            f"leave out {option} (the extension tells the format), or name the file *.{given}",
        )
    fmt = given or by_name
    if fmt is None:
        raise UserError(
            f"{path}: no format has the extension {path.suffix or '(none)'}",
            f"name the file {', '.join(EXTENSIONS)}, or give {spelled('csv')} (or jsonl, parquet)",
        )
    return fmt


def write_file(records: Iterable[dict[str, Any]], path: Path, fmt: str) -> int:
    """Write the records to `path` in `fmt`; how many. The file is opened here, for every format:
    an OSError then names the path (pyarrow's own open names none, and a missing folder was
    "unexpected FileNotFoundError ... report it", exit 5), and worker.errors says what is wrong."""
    if fmt == "parquet":
        with open(path, "wb") as handle:
            return write_parquet(records, handle)
    with open(path, "w", newline="") as handle:
        return (write_csv if fmt == "csv" else write_jsonl)(records, handle)


def write_jsonl(records: Iterable[dict[str, Any]], handle: IO[str]) -> int:
    count = 0
    for record in records:
        handle.write(json.dumps(record, default=str, ensure_ascii=False) + "\n")
        count += 1
    return count


def write_csv(records: Iterable[dict[str, Any]], handle: IO[str]) -> int:
    """One row per record; `output` as its JSON text (a cell holds one value)."""
    writer = csv.DictWriter(handle, EXPORT_FIELDS, extrasaction="ignore")
    writer.writeheader()
    count = 0
    for record in records:
        output = record["output"]
        writer.writerow(
            dict(record, output=None if output is None else json.dumps(output, ensure_ascii=False))
        )
        count += 1
    return count


def parquet_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("source", pa.string()),
            ("kind", pa.string()),
            ("page_number", pa.int32()),
            ("timestamp", pa.float64()),
            ("unit_index", pa.int32()),
            ("scope", pa.string()),
            ("unit_from", pa.int32()),
            ("unit_to", pa.int32()),
            ("page_from", pa.int32()),
            ("page_to", pa.int32()),
            ("time_from", pa.float64()),
            ("time_to", pa.float64()),
            ("turn", pa.int32()),
            ("prompt_index", pa.int32()),
            ("prompt", pa.string()),
            ("output", pa.string()),  # the JSON text: any shape a schema allows, in one column
            ("text", pa.string()),
            ("error", pa.string()),
            ("finish_reason", pa.string()),
            ("prompt_tokens", pa.int64()),
            ("visual_tokens", pa.int64()),
            ("completion_tokens", pa.int64()),
            ("pruned_tokens", pa.int64()),
            ("merged_tokens", pa.int64()),
            ("model", pa.string()),
            ("engine", pa.string()),
            ("cache_hit", pa.bool_()),
            ("latency_ms", pa.float64()),
        ]
    )


def write_parquet(records: Iterable[dict[str, Any]], path: Path | IO[bytes], batch_rows: int = 10_000) -> int:
    """Streamed in row groups of `batch_rows`: memory stays flat for a million results. `path`: a
    file name or a binary file open for writing (write_file's)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is a dependency
        raise RuntimeError("--format parquet needs pyarrow (pip install pyarrow)") from exc

    schema = parquet_schema()
    count = 0
    with pq.ParquetWriter(path, schema) as writer:
        batch: list[dict[str, Any]] = []
        for record in records:
            output = record["output"]
            batch.append(
                dict(record, output=None if output is None else json.dumps(output, ensure_ascii=False))
            )
            if len(batch) >= batch_rows:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                count += len(batch)
                batch = []
        if batch or count == 0:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            count += len(batch)
    return count


# --- one file per document ----------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def document_file_name(source: str, suffix: str) -> str:
    """A safe file name per source: its name, and a short hash of the whole uri (two `scan.pdf`
    from two folders must not overwrite each other)."""
    name = source.rstrip("/").rsplit("/", 1)[-1]
    safe = _UNSAFE.sub("_", name).strip("._")[:80] or "source"
    return f"{safe}-{hashlib.sha256(source.encode()).hexdigest()[:8]}{suffix}"


def _summaries_first(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A source's summary rows (`--summarize`), and its other answers in order."""
    return [r for r in records if r["scope"] == "source"], [r for r in records if r["scope"] != "source"]


def _markdown(source: str, records: list[dict[str, Any]], prompts: list[str]) -> str:
    lines = [f"# {source.rsplit('/', 1)[-1]}", "", f"Source: `{source}`", ""]
    several = len(prompts) > 1
    summaries, records = _summaries_first(records)
    for record in summaries:
        lines += ["## Summary", "", f"**{record['prompt']}**", ""]
        lines += [f"*error: {record['error']}*" if record["error"] else (record["text"] or "").strip(), ""]
    for unit_index, answers in groupby(records, key=lambda r: r["unit_index"]):
        answers = list(answers)
        first = answers[0]
        where = span(first["kind"], unit_index, first["unit_to"], first["time_from"], first["time_to"])
        lines += [f"## {where[:1].upper()}{where[1:]}", ""]
        for record in answers:
            if several:
                lines += [f"**{record['prompt']}**", ""]
            if record["error"]:
                lines += [f"*error: {record['error']}*", ""]
            else:
                lines += [(record["text"] or "").strip() or "*(empty answer)*", ""]
    return "\n".join(lines).rstrip() + "\n"


def _document_json(source: str, records: list[dict[str, Any]], prompts: list[str]) -> dict[str, Any]:
    summaries, records = _summaries_first(records)
    pages = []
    for unit_index, answers in groupby(records, key=lambda r: r["unit_index"]):
        answers = list(answers)
        first = answers[0]
        pages.append(
            {
                "unit_index": unit_index,
                "page_number": first["page_number"],
                "timestamp": first["timestamp"],
                # A window's answers cover its units up to these (the same as above for a page).
                **{key: first[key] for key in ("unit_to", "page_to", "time_to")},
                "answers": [
                    {
                        "prompt_index": r["prompt_index"],
                        "prompt": r["prompt"],
                        "output": r["output"],
                        "error": r["error"],
                    }
                    for r in answers
                ],
            }
        )
    kind = ([*records, *summaries] or [{"kind": None}])[0]["kind"]
    document: dict[str, Any] = {"source": source, "kind": kind, "prompts": prompts}
    if summaries:  # the source's summary (`--summarize`) before its pages
        fields = ("prompt", "output", "text", "error")
        document["summary"] = [{key: r[key] for key in fields} for r in summaries]
    return {**document, "pages": pages}


# Which job's answers a --by-document folder holds: a second job's files beside the first's
# would mix two runs' answers under names that do not say which is which.
JOB_MARKER = ".visbatch-job"


def claim_document_folder(out_dir: Path, job_id: str) -> None:
    """Make `out_dir` this job's: refused (UserError, nothing written) when it holds another
    job's answers; the same job's are written again in place."""
    marker = out_dir / JOB_MARKER
    try:
        holder = marker.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):  # a new folder; or a file: mkdir says so (exit 2)
        holder = None
    if holder and holder != job_id:
        raise UserError(
            f"{out_dir} holds the answers of job {holder}: job {job_id}'s would be mixed with them",
            "choose another folder (one per job), or remove that one first",
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(job_id + "\n")


def write_by_document(
    records: Iterable[dict[str, Any]], out_dir: Path, prompts: list[str], *, as_json: bool, job_id: str
) -> list[Path]:
    """One file per source under `out_dir`, pages in order (records come ordered by source,
    unit, prompt: storage.results.iter_results); returns the files written. The folder is the
    job's alone (claim_document_folder)."""
    claim_document_folder(out_dir, job_id)
    written = []
    for source, group in groupby(records, key=lambda r: r["source"]):
        items = list(group)
        if as_json:
            path = out_dir / document_file_name(source, ".json")
            document = _document_json(source, items, prompts)
            path.write_text(json.dumps(document, indent=2, ensure_ascii=False, default=str) + "\n")
        else:
            path = out_dir / document_file_name(source, ".md")
            path.write_text(_markdown(source, items, prompts))
        written.append(path)
    return written


def export_records(
    results: Iterable[dict[str, Any]], prompts: list[str], then: list[list[str]] | None = None
) -> Iterator[dict[str, Any]]:
    for result in results:
        yield export_record(result, prompts, then or [])
