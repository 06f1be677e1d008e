"""Benchmarking: methods side by side on the same questions (`runner.py`), the record and reports it writes,
where drafts were rejected (`diagnosis.py`) and where fp32 outputs part (`divergence.py`)."""
