"""Drafters in other engines' formats: export (`specheads export --to`) and import (`--heads` reads them).

Importing this package registers the built-in formats, one module per drafter kind.
"""

from specheads.formats import dflash, eagle, eagle3, medusa, peagle  # noqa: F401  (each module registers its exporters and importers)
from specheads.formats.base import (
    EXPORTERS,
    IMPORTERS,
    ExportContext,
    export_formats,
    exporter_for,
    import_folder,
)

__all__ = ["EXPORTERS", "IMPORTERS", "ExportContext", "export_formats", "exporter_for", "import_folder"]
