"""Drafters in other engines' formats: export (`specheads export --to`) and import (`--heads` reads them).

The formats are declared in `engines.py` (no torch); each drafter kind's module here registers its exporters
and importers (`builtin.py` imports them on first use of the registries). The names below load on first use
(PEP 562), so importing `specheads.formats.engines` imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specheads.lazy import lazy_attributes

if TYPE_CHECKING:
    from specheads.formats.base import (
        EXPORTERS,
        IMPORTERS,
        ExportContext,
        export_formats,
        exporter_for,
        import_folder,
    )

__all__ = ["EXPORTERS", "IMPORTERS", "ExportContext", "export_formats", "exporter_for", "import_folder"]

__getattr__, __dir__ = lazy_attributes(__name__, dict.fromkeys(__all__, "specheads.formats.base"))
