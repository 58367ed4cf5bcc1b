"""render_pdf_pages / parse_page_ranges: sizes, rotation, text, ranges, broken documents."""

from __future__ import annotations

from pathlib import Path

import pymupdf
import pytest

from ingest.pdf import parse_page_ranges, render_pdf_pages
from ingest.units import RenderedImage, SourceError, UnitFailure


def _doc(path: Path, pages: int = 3, size: tuple[float, float] = (200, 400)) -> Path:
    doc = pymupdf.open()
    for number in range(pages):
        page = doc.new_page(width=size[0], height=size[1])
        page.insert_text((20, 40), f"hello page {number + 1}", fontsize=12)
    doc.save(path)
    doc.close()
    return path


def _images(units: list[RenderedImage | UnitFailure]) -> list[RenderedImage]:
    assert all(isinstance(u, RenderedImage) for u in units), units
    return [u for u in units if isinstance(u, RenderedImage)]


# -- page ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("1-3,7", [0, 1, 2, 6]),
        ("2", [1]),
        (" 1 - 2 , 4 ", [0, 1, 3]),
        ("9-", [8, 9]),
        ("3,1-3", [0, 1, 2]),
        ("10", [9]),
    ],
)
def test_parse_page_ranges(spec: str, expected: list[int]) -> None:
    assert parse_page_ranges(spec, 10) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty page range"),
        ("a", "bad page range"),
        ("1,,2", "bad page range"),
        ("-3", "bad page range"),
        ("1-2-3", "bad page range"),
        ("0", "numbered from 1"),
        ("3-1", "end is before the start"),
        ("1-11", r"page 11 is out of range \(the PDF has 10 pages\)"),
        ("12", "out of range"),
    ],
)
def test_parse_page_ranges_errors(spec: str, message: str) -> None:
    with pytest.raises(SourceError, match=message):
        parse_page_ranges(spec, 10)


def test_pages_option_selects_pages(tmp_path: Path) -> None:
    units = _images(list(render_pdf_pages(_doc(tmp_path / "d.pdf", pages=4), longest_side=100, pages="2,4")))
    assert [u.index for u in units] == [1, 3]
    assert "hello page 2" in (units[0].text or "")


def test_pages_out_of_range_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="out of range"):
        list(render_pdf_pages(_doc(tmp_path / "d.pdf", pages=2), pages="1-3"))


# -- rendering -----------------------------------------------------------------------------


def test_longest_side_text_and_rgb(tmp_path: Path) -> None:
    units = _images(list(render_pdf_pages(_doc(tmp_path / "d.pdf"), longest_side=500)))
    assert [u.index for u in units] == [0, 1, 2]
    for number, unit in enumerate(units):
        assert unit.image.mode == "RGB"
        assert unit.image.size == (250, 500)
        assert f"hello page {number + 1}" in (unit.text or "")
        assert unit.timestamp is None


@pytest.mark.parametrize("size", [(612, 792), (595.28, 841.89), (333.3, 100.7), (1000, 999), (72.5, 72.5)])
def test_longest_side_is_exact_for_odd_page_sizes(tmp_path: Path, size: tuple[float, float]) -> None:
    (unit,) = _images(list(render_pdf_pages(_doc(tmp_path / "d.pdf", pages=1, size=size), longest_side=1288)))
    assert max(unit.image.size) == 1288


def test_rotated_page_comes_out_landscape(tmp_path: Path) -> None:
    doc = pymupdf.open()
    page = doc.new_page(width=200, height=400)  # portrait
    page.draw_rect(pymupdf.Rect(0, 0, 50, 50), color=None, fill=(1, 0, 0))  # red, top-left
    page.insert_text((20, 100), "rotated text")
    page.set_rotation(90)  # shown turned 90 degrees clockwise
    path = tmp_path / "rot.pdf"
    doc.save(path)

    (unit,) = _images(list(render_pdf_pages(path, longest_side=600)))

    assert unit.image.size == (600, 300)
    # Clockwise turn: the top-left corner of the unrotated page is now the top-right.
    assert unit.image.getpixel((590, 10)) == (255, 0, 0)
    assert unit.image.getpixel((10, 10)) == (255, 255, 255)
    assert "rotated text" in (unit.text or "")


def test_dpi_mode(tmp_path: Path) -> None:
    path = _doc(tmp_path / "d.pdf", pages=1, size=(72, 144))  # 1 x 2 inches
    (unit,) = _images(list(render_pdf_pages(path, longest_side=None, dpi=150)))
    assert unit.image.size == (150, 300)
    (wins,) = _images(list(render_pdf_pages(path, longest_side=1288, dpi=100)))
    assert wins.image.size == (100, 200)  # dpi, when given, wins over longest_side


def test_render_is_capped_in_pixels(tmp_path: Path) -> None:
    doc = _doc(tmp_path / "d.pdf", pages=1)
    (unit,) = _images(list(render_pdf_pages(doc, longest_side=1000, max_render_pixels=20_000)))
    width, height = unit.image.size
    assert width * height <= 20_000 * 1.05
    assert abs(width / height - 0.5) < 0.02  # same shape, just smaller


def test_a_page_that_fails_is_a_unit_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = pymupdf.Page.get_pixmap

    def flaky(self: pymupdf.Page, *args: object, **kwargs: object) -> pymupdf.Pixmap:
        if self.number == 1:
            raise RuntimeError("broken content stream")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pymupdf.Page, "get_pixmap", flaky)
    units = list(render_pdf_pages(_doc(tmp_path / "d.pdf"), longest_side=100))
    assert [type(u).__name__ for u in units] == ["RenderedImage", "UnitFailure", "RenderedImage"]
    assert units[1].index == 1
    assert "broken content stream" in units[1].message


# -- documents that cannot be read ---------------------------------------------------------


def test_truncated_pdf_is_a_source_error(tmp_path: Path) -> None:
    data = _doc(tmp_path / "d.pdf").read_bytes()
    path = tmp_path / "cut.pdf"
    path.write_bytes(data[: len(data) // 5])
    with pytest.raises(SourceError, match="cannot open PDF"):
        list(render_pdf_pages(path))


@pytest.mark.parametrize("fraction", [0.4, 0.6, 0.8, 0.95])
def test_partly_truncated_pdf_never_raises_anything_else(tmp_path: Path, fraction: float) -> None:
    # MuPDF repairs what it can; whatever it makes of the rest is a SourceError or units.
    data = _doc(tmp_path / "d.pdf").read_bytes()
    path = tmp_path / "cut.pdf"
    path.write_bytes(data[: int(len(data) * fraction)])
    try:
        units = list(render_pdf_pages(path, longest_side=100))
    except SourceError:
        return
    assert all(isinstance(u, RenderedImage | UnitFailure) for u in units)


def test_not_a_pdf(tmp_path: Path) -> None:
    path = tmp_path / "x.pdf"
    path.write_text("just some text, no PDF here")
    with pytest.raises(SourceError, match="cannot open PDF"):
        list(render_pdf_pages(path))


def test_encrypted_with_user_password(tmp_path: Path) -> None:
    doc = pymupdf.open()
    doc.new_page().insert_text((50, 50), "secret")
    path = tmp_path / "locked.pdf"
    doc.save(path, encryption=pymupdf.PDF_ENCRYPT_AES_256, owner_pw="owner", user_pw="user")
    with pytest.raises(SourceError, match=r"encrypted PDF \(needs a password\)"):
        list(render_pdf_pages(path))


def test_encrypted_with_owner_password_only_opens(tmp_path: Path) -> None:
    doc = pymupdf.open()
    doc.new_page().insert_text((50, 50), "no printing please")
    path = tmp_path / "restricted.pdf"
    doc.save(
        path,
        encryption=pymupdf.PDF_ENCRYPT_AES_256,
        owner_pw="owner",
        user_pw="",
        permissions=pymupdf.PDF_PERM_ACCESSIBILITY,
    )
    (unit,) = _images(list(render_pdf_pages(path, longest_side=200)))
    assert "no printing please" in (unit.text or "")


def test_zero_pages(tmp_path: Path) -> None:
    # PyMuPDF refuses to save a document without pages, so write one by hand.
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [] /Count 0 >>",
    ]
    body = b"%PDF-1.4\n"
    offsets = []
    for number, obj in enumerate(objects, start=1):
        offsets.append(len(body))
        body += b"%d 0 obj\n" % number + obj + b"\nendobj\n"
    xref = len(body)
    body += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    body += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    body += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    path = tmp_path / "empty.pdf"
    path.write_bytes(body)
    with pytest.raises(SourceError, match="PDF has no pages"):
        list(render_pdf_pages(path))


def test_page_limit(tmp_path: Path) -> None:
    path = _doc(tmp_path / "d.pdf", pages=5)
    with pytest.raises(SourceError, match="over the limit of 3"):
        list(render_pdf_pages(path, max_pages=3))
    assert len(list(render_pdf_pages(path, pages="1-3", max_pages=3))) == 3
