"""The review site written to a folder: the same pages as the server, images copied in as files.

Everything is relative (``index.html`` opened from disk works, the folder can be zipped or
published as is). Pages are rendered and written one at a time and images copied one at a time,
so a large job streams through in constant memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from storage.object_store import ObjectNotFound
from storage.review import VIEWS, get_source, source_ids, unit_page
from worker.review.images import copy_image
from worker.review.site import ReviewSite, index_href, source_href

log = logging.getLogger(__name__)


@dataclass
class ExportReport:
    pages: int = 0
    images: int = 0
    missing_images: list[str] = field(default_factory=list)


def _write(folder: Path, name: str, text: str | None) -> None:
    if text is None:  # cannot happen for a path the site itself listed; keep the export going
        raise RuntimeError(f"the site has no page {name}")
    (folder / name).write_text(text, encoding="utf-8")


def export_site(
    site: ReviewSite, folder: Path, progress: Callable[[str], None] | None = None
) -> ExportReport:
    folder.mkdir(parents=True, exist_ok=True)
    report = ExportReport()
    for n in range(1, site.index_pages() + 1):
        _write(folder, index_href(n), site.index_page(n))
        report.pages += 1
    for source_id in source_ids(site.db, site.job_id):
        source = get_source(site.db, site.job_id, source_id)
        if source is None:  # deleted while we export
            continue
        for view in VIEWS:
            for n in range(1, site.source_pages(source, view) + 1):
                _write(folder, source_href(source_id, view, n), site.source_page(source_id, view, n))
                report.pages += 1
        _copy_images(site, source_id, source.units, folder, report)
        if progress:
            progress(source.uri)
    return report


def _copy_images(site: ReviewSite, source_id: int, units: int, folder: Path, report: ExportReport) -> None:
    for offset in range(0, units, site.per_page):
        for unit in unit_page(site.db, site.job_id, source_id, "all", offset=offset, limit=site.per_page):
            if unit.image_key is None:
                continue
            try:
                copy_image(site.store, unit.image_key, folder, unit.id)
                report.images += 1
            except ObjectNotFound:
                log.warning("image %s of unit %d is missing from the store", unit.image_key, unit.id)
                report.missing_images.append(unit.image_key)
