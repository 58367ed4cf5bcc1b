"""PyMuPDF, imported without its optional add-ons.

PyMuPDF 2 installs pymupdf_layout and pymupdf4llm with it, and `import pymupdf` imports both
when they are there: ONNX Runtime, tabulate and the rest, ~0.4 s of every start of a process
that renders pages (the CLI, each sandboxed splitter), for layout analysis and Markdown export
that visbatch never calls. PyMuPDF imports them in ``try: ... except ImportError``, so they
are blocked for the time of that import only: a later ``import pymupdf4llm`` elsewhere works.
"""

from __future__ import annotations

import sys

_ADD_ONS = ("pymupdf.layout", "pymupdf4llm")

_blocked = [name for name in _ADD_ONS if name not in sys.modules]
for _name in _blocked:
    sys.modules[_name] = None  # type: ignore[assignment]  # None in sys.modules: ImportError
try:
    import pymupdf
finally:
    for _name in _blocked:
        if sys.modules.get(_name, 0) is None:
            del sys.modules[_name]

__all__ = ["pymupdf"]
