"""Serving: the OpenAI-compatible server, continuous batching, metrics, adaptive speculation, calibration and
the load generator that measures them."""
