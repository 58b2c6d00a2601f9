"""Do the `BATON_*` variables a deploy file sets name real settings fields?

A misspelt variable (`BATON_PREFILL_KV_CACHE_BYTE`) is silently ignored by pydantic-settings
(`extra="ignore"`); these checks catch it against the settings classes themselves.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic_settings import BaseSettings

from services.decode.settings import DecodeSettings
from services.encoder.settings import EncoderSettings
from services.kv_transfer.settings import KVTransferSettings
from services.prefill.settings import PrefillSettings
from services.router.settings import RouterSettings

SETTINGS_BY_PREFIX: dict[str, type[BaseSettings]] = {
    "BATON_ROUTER_": RouterSettings,
    "BATON_PREFILL_": PrefillSettings,
    "BATON_DECODE_": DecodeSettings,
    "BATON_KV_TRANSFER_": KVTransferSettings,
    "BATON_ENCODER_": EncoderSettings,
}
# the compose file's interpolation knobs are not service settings
KNOWN_NON_SETTINGS = {"BATON_IMAGE"}


def settings_for(name: str) -> type[BaseSettings] | None:
    return next((cls for prefix, cls in SETTINGS_BY_PREFIX.items() if name.startswith(prefix)), None)


def unknown_baton_variables(names: Iterable[str]) -> list[str]:
    """`BATON_*` names that no settings class reads."""
    unknown = []
    for name in names:
        if not name.startswith("BATON_") or name in KNOWN_NON_SETTINGS:
            continue
        cls = settings_for(name)
        prefix = next((p for p in SETTINGS_BY_PREFIX if name.startswith(p)), "")
        if cls is None or name[len(prefix):].lower() not in cls.model_fields:
            unknown.append(name)
    return unknown


def parse_for_service(prefix: str, env: dict[str, str]) -> BaseSettings:
    """The service's settings object as it would parse `env` (validation errors raise)."""
    cls = SETTINGS_BY_PREFIX[prefix]
    values = {k[len(prefix):].lower(): v for k, v in env.items() if k.startswith(prefix)}
    return cls.model_validate(values)  # validation only: no other source (os.environ) mixes in
