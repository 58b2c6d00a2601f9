"""`baton router|prefill|decode|kv-transfer|encoder`: run one service (what deploy files call).

Each is configured only by its environment (`BATON_<SERVICE>_*`), parsed once
in the service's own `main`.
"""

from __future__ import annotations

import argparse


def _run(module: str) -> int:
    import importlib

    importlib.import_module(module).main()
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    for name, module, help_text in (
        ("router", "services.router.main", "the OpenAI-compatible HTTP router (BATON_ROUTER_*)"),
        ("prefill", "services.prefill.main", "a prefill engine service (BATON_PREFILL_*)"),
        ("decode", "services.decode.main", "a decode engine service (BATON_DECODE_*)"),
        ("kv-transfer", "services.kv_transfer.main", "the KV handoff store (BATON_KV_TRANSFER_*)"),
        ("encoder", "services.encoder.main", "a multimodal model's media towers (BATON_ENCODER_*)"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(func=lambda args, m=module: _run(m))
