"""The router: the OpenAI-compatible HTTP gateway (FastAPI), independent of how tokens are made.

Token generation sits behind `GenerationBackend` (backend.py): `EngineBackend` runs a
colocated engine in-process; the disaggregated path implements the same protocol over gRPC.
"""
