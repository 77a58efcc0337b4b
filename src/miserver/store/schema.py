"""The tables of miServer (SQLAlchemy Core). Invariants live here as keys, CHECKs and partial indexes.

Times are integer Unix seconds, except claim deadlines (``claimed_until``) which are milliseconds.
Ids are time-ordered (``file-``/``batch_`` + 12 hex digits of milliseconds + random), so ``ORDER BY id`` is creation
order and list pagination needs no extra column.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)

from ..protocol.batches import BATCH_STATUSES, TERMINAL  # the one definition of the statuses (DESIGN §4)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(column_0_label)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

#: The terminal statuses as a sorted tuple (for ``IN (...)`` clauses).
TERMINAL_STATUSES: tuple[str, ...] = tuple(sorted(TERMINAL))

files = Table(
    "files",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("purpose", String(32), nullable=False),
    Column("filename", String(512), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=True),
    Column("status", String(16), nullable=False, server_default="processed"),
    Column("status_details", Text, nullable=True),
    Column("content_deleted_at", BigInteger, nullable=True),
    # the API key that uploaded the file (or whose batch wrote it); NULL when made with no keys in the database
    Column("owner_key_id", String(64), nullable=True),
    CheckConstraint("purpose IN ('batch', 'batch_output')", name="purpose"),
    CheckConstraint("bytes >= 0", name="bytes_nonnegative"),
)
Index("ix_files_owner_key_id", files.c.owner_key_id, files.c.id)

file_chunks = Table(
    "file_chunks",
    metadata,
    Column("file_id", String(64), ForeignKey("files.id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("data", LargeBinary, nullable=False),
    PrimaryKeyConstraint("file_id", "seq"),
)

batches = Table(
    "batches",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("endpoint", String(64), nullable=False),
    Column("model", String(512), nullable=True),
    Column("input_file_id", String(64), nullable=False),
    Column("completion_window", String(16), nullable=False),
    Column("status", String(16), nullable=False),
    Column("output_file_id", String(64), nullable=True),
    Column("error_file_id", String(64), nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("in_progress_at", BigInteger, nullable=True),
    Column("expires_at", BigInteger, nullable=False),
    Column("finalizing_at", BigInteger, nullable=True),
    Column("completed_at", BigInteger, nullable=True),
    Column("failed_at", BigInteger, nullable=True),
    Column("expired_at", BigInteger, nullable=True),
    Column("cancelling_at", BigInteger, nullable=True),
    Column("cancelled_at", BigInteger, nullable=True),
    Column("total", Integer, nullable=False, server_default="0"),
    Column("completed", Integer, nullable=False, server_default="0"),
    Column("failed", Integer, nullable=False, server_default="0"),
    Column("input_tokens", BigInteger, nullable=False, server_default="0"),
    Column("output_tokens", BigInteger, nullable=False, server_default="0"),
    Column("metadata_json", Text, nullable=True),
    Column("errors_json", Text, nullable=True),
    Column("pack", Boolean, nullable=False, server_default=text("false")),
    Column("output_expires_seconds", Integer, nullable=True),
    Column("lease_holder", String(256), nullable=True),
    Column("waiting_reason", String(32), nullable=True),
    # the lease a caller handed the batch (X-miLLM-Lease at create, or POST /v1/batches/{id}/lease)
    Column("caller_lease", String(128), nullable=True),
    # which process validates or finishes the batch now (several workers share PostgreSQL)
    Column("claimed_by", String(128), nullable=True),
    Column("claimed_until", BigInteger, nullable=True),
    # accounts: the owner key, the batch prices fixed at creation (JSON ``{model: [input, output]}`` in
    # micro-units per million tokens, batch discount applied), the input tokens counted at validation (the queue
    # quota's reservation while the batch is not terminal), and since when the batch waits for a top-up
    Column("owner_key_id", String(64), nullable=True),
    Column("prices_json", Text, nullable=True),
    Column("enqueued_tokens", BigInteger, nullable=False, server_default="0"),
    Column("balance_waiting_since", BigInteger, nullable=True),
    # model life: the weights revision the batch is pinned to (its rows wait ``weights_changed`` while
    # the resident revision differs); NULL runs on whatever is resident
    Column("weights_revision", String(64), nullable=True),
    # scheduling and operations: order before deadlines, pause, late acceptance, the ETA (Unix seconds)
    Column("priority", Integer, nullable=False, server_default="0"),
    Column("paused_at", BigInteger, nullable=True),
    Column("allow_late", Boolean, nullable=False, server_default=text("false")),
    Column("estimated_completion_at", BigInteger, nullable=True),
    CheckConstraint("status IN (" + ", ".join(f"'{s}'" for s in BATCH_STATUSES) + ")", name="status"),
    CheckConstraint("completed >= 0 AND failed >= 0 AND completed + failed <= total", name="counts"),
)
Index("ix_batches_active", batches.c.status, batches.c.id)
Index("ix_batches_owner_key_id", batches.c.owner_key_id, batches.c.id)

batch_rows = Table(
    "batch_rows",
    metadata,
    Column("batch_id", String(64), ForeignKey("batches.id", ondelete="CASCADE"), nullable=False),
    Column("line", Integer, nullable=False),
    Column("custom_id", String(512), nullable=True),
    Column("valid", Boolean, nullable=False),
    Column("body", Text, nullable=True),
    Column("state", String(16), nullable=False),
    Column("outcome", String(16), nullable=True),
    Column("result", Text, nullable=True),
    Column("claim_token", String(64), nullable=True),
    Column("claimed_by", String(128), nullable=True),
    Column("claimed_until", BigInteger, nullable=True),
    Column("input_tokens", Integer, nullable=False, server_default="0"),
    Column("output_tokens", Integer, nullable=False, server_default="0"),
    # The model a valid row names, as validation resolved it (gateway mode: the upstream pool that runs it); NULL for
    # an invalid row. A multi-pool batch claims the rows of its live pools only (``store.rows.claim``).
    Column("model", String(512), nullable=True),
    PrimaryKeyConstraint("batch_id", "line"),
    CheckConstraint("state IN ('pending', 'done')", name="state"),
    CheckConstraint("outcome IS NULL OR outcome IN ('ok', 'error')", name="outcome"),
    # A recorded row has its outcome and result; a pending row has neither.
    CheckConstraint(
        "(state = 'pending' AND outcome IS NULL AND result IS NULL) OR "
        "(state = 'done' AND outcome IS NOT NULL AND result IS NOT NULL)",
        name="recorded",
    ),
    # Only valid rows run, so only valid rows can be pending.
    CheckConstraint("valid OR state = 'done'", name="invalid_rows_recorded"),
)
# custom_id is unique among the valid rows of a batch (a duplicate line is itself recorded as an error row).
Index(
    "uq_batch_rows_custom_id",
    batch_rows.c.batch_id,
    batch_rows.c.custom_id,
    unique=True,
    sqlite_where=batch_rows.c.valid,
    postgresql_where=batch_rows.c.valid,
)
Index(
    "ix_batch_rows_pending",
    batch_rows.c.batch_id,
    batch_rows.c.line,
    sqlite_where=batch_rows.c.state == "pending",
    postgresql_where=batch_rows.c.state == "pending",
)
Index(
    "ix_batch_rows_pending_model",
    batch_rows.c.batch_id,
    batch_rows.c.model,
    batch_rows.c.line,
    sqlite_where=batch_rows.c.state == "pending",
    postgresql_where=batch_rows.c.state == "pending",
)

# The rows claimed now, by worker (the claims in flight: a record or a release clears ``claimed_until``), for the
# fair share's head start, which counts the workers running chunks (``store.fair_share.claiming_workers``).
Index(
    "ix_batch_rows_claimed",
    batch_rows.c.claimed_by,
    sqlite_where=batch_rows.c.claimed_until.is_not(None),
    postgresql_where=batch_rows.c.claimed_until.is_not(None),
)

# Idempotency-Key on POST /v1/files and POST /v1/batches: the first answer is replayed for a retry with the same key
# and the same body; the same key with another body is a 409.
idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("key", String(256), nullable=False),
    Column("route", String(64), nullable=False),
    Column("body_sha256", String(64), nullable=False),
    Column("status_code", Integer, nullable=False),
    Column("response", Text, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    PrimaryKeyConstraint("route", "key"),
)

# Facts about a model's resident weights that must survive a restart (the weights-torn flag of DESIGN §3.5).
model_state = Table(
    "model_state",
    metadata,
    Column("model_id", String(512), primary_key=True),
    Column("weights_torn", Boolean, nullable=False, server_default=text("false")),
    Column("updated_at", BigInteger, nullable=False),
)

# Linear probes on a model's hidden states (DESIGN §3.5, Probes). ``name`` is what requests use; the probe belongs to
# ``model_id`` (scoring it with another resident model is refused). Weights and bias are JSON arrays of floats in the
# shape the API takes them (binary: ``[hidden]`` and a number; K classes: ``[K][hidden]`` and ``[K]``).
probes = Table(
    "probes",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("model_id", String(512), nullable=False),
    Column("weights_revision", String(64), nullable=False),
    Column("layer", Integer, nullable=False),
    Column("pooling", String(8), nullable=False),
    Column("hidden_size", Integer, nullable=False),
    Column("classes_json", Text, nullable=False),
    Column("weights_json", Text, nullable=False),
    Column("bias_json", Text, nullable=False),
    Column("training_json", Text, nullable=True),
    Column("description", Text, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("owner_key_id", String(64), nullable=True),
    CheckConstraint("pooling IN ('mean', 'last')", name="pooling"),
    CheckConstraint("layer >= 0 AND hidden_size > 0", name="shape"),
)

# Stored Responses (``POST /v1/responses`` with ``store``): the Response object as returned, and the conversation
# turns that a later request's ``previous_response_id`` continues (``[{"role", "content"}]``, instructions excluded).
# Gone ``expires_at`` (30 days after creation, as files).
responses = Table(
    "responses",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("model", String(512), nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
    Column("body_json", Text, nullable=False),
    Column("turns_json", Text, nullable=False),
    Column("owner_key_id", String(64), nullable=True),
)
Index("ix_responses_expires_at", responses.c.expires_at)

# API keys. Only the SHA-256 digest of a key and a display prefix are kept; the key itself is shown once.
# ``balance`` is in integer micro-units of the price table's currency, NULL for an unlimited key; it always equals the
# sum of the key's credits minus the sum of its usage costs (both tables below), which is how it is audited.
# ``max_pending_batches`` and ``max_enqueued_tokens`` are the key's queue quotas (NULL: none).
api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(128), nullable=False),
    Column("digest", String(64), nullable=False, unique=True),
    Column("prefix", String(16), nullable=False),
    Column("admin", Boolean, nullable=False, server_default=text("false")),
    # the scopes the key may use, as a JSON list; NULL: the member default (everything but models:write and admin)
    Column("scopes", Text, nullable=True),
    Column("balance", BigInteger, nullable=True),
    Column("max_pending_batches", Integer, nullable=True),
    Column("max_enqueued_tokens", BigInteger, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("revoked_at", BigInteger, nullable=True),
    CheckConstraint(
        "(max_pending_batches IS NULL OR max_pending_batches >= 0) AND "
        "(max_enqueued_tokens IS NULL OR max_enqueued_tokens >= 0)",
        name="quotas",
    ),
)

# Money put on a key: the opening balance and every top-up, one line each (micro-units, > 0).
key_credits = Table(
    "key_credits",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key_id", String(64), ForeignKey("api_keys.id"), nullable=False),
    Column("amount", BigInteger, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    CheckConstraint("amount > 0", name="amount_positive"),
)
Index("ix_key_credits_key_id", key_credits.c.key_id)

# One line per successful synchronous request or batch row of a key: written in the transaction that records the
# result, unique per request id and per batch line, so a row recorded twice is never charged twice. ``cost`` is in
# micro-units; ``day`` (UTC, ``YYYY-MM-DD``) is the per-day rollup's key.
usage_records = Table(
    "usage_records",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key_id", String(64), ForeignKey("api_keys.id"), nullable=False),
    Column("model", String(512), nullable=False),
    Column("kind", String(8), nullable=False),
    Column("endpoint", String(64), nullable=False),
    Column("input_tokens", BigInteger, nullable=False),
    Column("output_tokens", BigInteger, nullable=False),
    Column("cost", BigInteger, nullable=False),
    Column("request_id", String(64), nullable=True, unique=True),
    Column("batch_id", String(64), nullable=True),
    Column("line", Integer, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("day", String(10), nullable=False),
    UniqueConstraint("batch_id", "line", name="uq_usage_records_batch_line"),
    CheckConstraint("kind IN ('realtime', 'batch')", name="kind"),
    CheckConstraint("input_tokens >= 0 AND output_tokens >= 0 AND cost >= 0", name="amounts"),
    CheckConstraint(
        "(kind = 'batch' AND batch_id IS NOT NULL AND line IS NOT NULL) OR "
        "(kind = 'realtime' AND batch_id IS NULL AND line IS NULL)",
        name="source",
    ),
)
Index("ix_usage_records_key_day", usage_records.c.key_id, usage_records.c.day)
Index("ix_usage_records_day", usage_records.c.day)

# Model life. A checkpoint is the resident weights saved under a new model id (``model_id``) as a
# transformers folder at ``path`` (safetensors, config, tokenizer); ``base_model`` is the catalogue id its weights
# came from, ``weights_revision`` the digest of its weight files, ``bytes`` its size on disk.
checkpoints = Table(
    "checkpoints",
    metadata,
    Column("model_id", String(512), primary_key=True),
    Column("path", Text, nullable=False),
    Column("base_model", String(512), nullable=False),
    Column("weights_revision", String(64), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    CheckConstraint("bytes >= 0", name="bytes_nonnegative"),
)

# Catalogue entries added with ``miserver models add`` (``POST /api/models``); the ``--catalogue`` file's entries
# are configuration and are not stored. ``source`` is a transformers folder, a .gguf file or the embedded id;
# ``aliases_json`` a JSON list of names that resolve to ``model_id`` (compared case-insensitively).
catalogue_models = Table(
    "catalogue_models",
    metadata,
    Column("model_id", String(512), primary_key=True),
    Column("source", Text, nullable=False),
    Column("aliases_json", Text, nullable=False),
    Column("created_at", BigInteger, nullable=False),
)

# Scheduling and operations. Measured throughput per model and endpoint (the ETA): moving averages over
# recent chunks of rows per second and tokens (prompt + completion) per second; ``samples`` counts the chunks.
throughput = Table(
    "throughput",
    metadata,
    Column("model", String(512), nullable=False),
    Column("endpoint", String(64), nullable=False),
    Column("rows_per_second", Float, nullable=False),
    Column("tokens_per_second", Float, nullable=False),
    Column("samples", Integer, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    PrimaryKeyConstraint("model", "endpoint"),
    CheckConstraint("rows_per_second > 0 AND tokens_per_second >= 0", name="rates"),
)

# Fair share (``scheduling.policy.FairShare``), kept here so that every process on the database sees the same shares:
# rows served per owner (``scope`` 'owner': the batch's API key, or the batch id without keys) and per batch (``scope``
# 'batch'). A claim adds its rows in the claim's transaction and a release takes back the rows it gives back
# unrecorded, so ``served`` counts rows recorded plus rows in flight. An entry lives while its owner (batch) has an
# ``in_progress`` batch.
fair_share = Table(
    "fair_share",
    metadata,
    Column("scope", String(8), nullable=False),
    Column("key", String(64), nullable=False),
    Column("served", BigInteger, nullable=False),
    PrimaryKeyConstraint("scope", "key"),
    CheckConstraint("scope IN ('owner', 'batch')", name="scope"),
    CheckConstraint("served >= 0", name="served_nonnegative"),
)

# Webhook endpoints (``POST /api/webhooks``): a URL, the events it receives (a JSON list), its signing secret
# (``whsec_...``, Standard Webhooks) and the key that registered it (NULL: every batch's events).
webhooks = Table(
    "webhooks",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("url", Text, nullable=False),
    Column("events_json", Text, nullable=False),
    Column("secret", String(128), nullable=False),
    Column("owner_key_id", String(64), nullable=True),
    Column("created_at", BigInteger, nullable=False),
)

# The outbox of webhook deliveries: one row per (event, endpoint), written in the transaction of the status change
# that raised the event and delivered at least once by a background task; ``id`` is the stable ``webhook-id`` and
# ``event_id`` the payload's ``id``. ``next_attempt_at`` (Unix ms) is when it is due; a delivering process pushes it
# forward first and names itself in ``claimed_by`` (its claim), so a process killed mid-delivery leaves it due again
# later (at once when that process restarts).
webhook_outbox = Table(
    "webhook_outbox",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("event_id", String(64), nullable=False),
    Column("webhook_id", String(64), ForeignKey("webhooks.id", ondelete="CASCADE"), nullable=False),
    Column("event_type", String(32), nullable=False),
    Column("batch_id", String(64), nullable=False),
    Column("payload", Text, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    Column("state", String(16), nullable=False),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("next_attempt_at", BigInteger, nullable=False),
    Column("delivered_at", BigInteger, nullable=True),
    Column("last_error", Text, nullable=True),
    Column("claimed_by", String(128), nullable=True),
    CheckConstraint("state IN ('pending', 'delivered', 'failed')", name="state"),
)
Index(
    "ix_webhook_outbox_due",
    webhook_outbox.c.next_attempt_at,
    sqlite_where=webhook_outbox.c.state == "pending",
    postgresql_where=webhook_outbox.c.state == "pending",
)

# Gateway discovery remembered across restarts (DESIGN §8, Upstream): per configured upstream name, the base URL it
# had and the models its last written ``GET /v1/models`` listed, each with its context length in tokens (NULL: the
# upstream did not say) and when it was last seen (Unix seconds). A gateway started while an upstream is down takes
# these as the upstream's models (kept down until a probe answers) when the name and the URL both still match.
upstreams = Table(
    "upstreams",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("base_url", Text, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
)
upstream_models = Table(
    "upstream_models",
    metadata,
    Column("upstream", String(128), ForeignKey("upstreams.name", ondelete="CASCADE"), nullable=False),
    Column("model", String(512), nullable=False),
    Column("context_length", Integer, nullable=True),
    Column("last_seen_at", BigInteger, nullable=False),
    PrimaryKeyConstraint("upstream", "model"),
    CheckConstraint("context_length IS NULL OR context_length > 0", name="context_length"),
)
