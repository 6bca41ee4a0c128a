"""The kernel: what every guarded write is built from, whatever scheme it serves.

Data flows one way through it: a public call's keys and values are checked
(:mod:`.checks`), its statement is built once and memoised (:mod:`.statements`,
:mod:`.memo`) for the database's :class:`~.backend.Backend`, run on the
session's connection for the model (:mod:`.execute`), its driver errors
mapped to typed ones by code (:mod:`.errors`), and the loaded instance made to
agree with the row (:mod:`.instances`).  Dialect differences are named
``Backend`` fields; ``dialect.name`` is read nowhere else in stateguard.

The feature modules import this package (``from . import _kernel``) and use
the names re-exported here; each submodule says what it is for.
"""

from __future__ import annotations

from sqlalchemy import bindparam
from sqlalchemy.sql.elements import ClauseElement

from .backend import (
    POSTGRESQL_FAMILY,
    Backend,
    backend,
    exact_collation,
    integer_bounds,
    is_galera,
    numeric_digits,
    row_lock_minimums,
)
from .checks import (
    MAX_LIMIT,
    check_batch,
    check_exact,
    check_fence,
    check_integer,
    check_key_value,
    check_storable,
    check_string,
    check_text,
    duration_ms,
    integer_limits,
    key_bounds,
    required_seconds,
    resolve_target,
    seconds,
    split_values,
    value_integers,
)
from .clock import db_now_ms, now_ms
from .durability import DURABLE, CommitWatch, Durability, durable, set_durability
from .errors import (
    aborted_transaction,
    classify_db_error,
    conflict_error,
    is_duplicate_key,
    missing_own_table,
    out_of_range,
)
from .execute import (
    SIZE_CHECK_FROM,
    InsertOnce,
    check_statement_size,
    connection_for,
    connection_for_key,
    ensure_real_transaction,
    execute,
    insert_rows,
    needs_size_check,
    own_bind,
    own_connection,
    run_guarded,
    sqlite_write_lock,
    stored_key,
)
from .instances import DeferredSavepoint, abandon_savepoint, hook_engine, identity_instance, sync_loaded
from .json import check_json_shape, dumps_json, json_encoder, json_text
from .listeners import hooked, pending, schedule
from .memo import Memo, frozen, memo
from .models import (
    INFO_KEY,
    ModelInfo,
    canonical_key,
    decode_key,
    inexact_text_key,
    key_order,
    model_info,
    public_key,
)
from .purge import purge_rows, purge_statement
from .statements import (
    AnySelect,
    by_primary_key,
    fence_allows,
    fence_condition,
    insert_or_skip,
    read_back,
    read_statement,
    set_clause,
    value_params,
    variant_key,
    version_increment,
)

__all__ = [
    "DURABLE",
    "INFO_KEY",
    "MAX_LIMIT",
    "POSTGRESQL_FAMILY",
    "SIZE_CHECK_FROM",
    "AnySelect",
    "Backend",
    "ClauseElement",
    "CommitWatch",
    "DeferredSavepoint",
    "Durability",
    "InsertOnce",
    "Memo",
    "ModelInfo",
    "abandon_savepoint",
    "aborted_transaction",
    "backend",
    "bindparam",
    "by_primary_key",
    "canonical_key",
    "check_batch",
    "check_exact",
    "check_fence",
    "check_integer",
    "check_json_shape",
    "check_key_value",
    "check_statement_size",
    "check_storable",
    "check_string",
    "check_text",
    "classify_db_error",
    "conflict_error",
    "connection_for",
    "connection_for_key",
    "db_now_ms",
    "decode_key",
    "dumps_json",
    "durable",
    "duration_ms",
    "ensure_real_transaction",
    "exact_collation",
    "execute",
    "fence_allows",
    "fence_condition",
    "frozen",
    "hook_engine",
    "hooked",
    "identity_instance",
    "inexact_text_key",
    "insert_or_skip",
    "insert_rows",
    "integer_bounds",
    "integer_limits",
    "is_duplicate_key",
    "is_galera",
    "json_encoder",
    "json_text",
    "key_bounds",
    "key_order",
    "memo",
    "missing_own_table",
    "model_info",
    "needs_size_check",
    "now_ms",
    "numeric_digits",
    "out_of_range",
    "own_bind",
    "own_connection",
    "pending",
    "public_key",
    "purge_rows",
    "purge_statement",
    "read_back",
    "read_statement",
    "required_seconds",
    "resolve_target",
    "row_lock_minimums",
    "run_guarded",
    "schedule",
    "seconds",
    "set_clause",
    "set_durability",
    "split_values",
    "sqlite_write_lock",
    "stored_key",
    "sync_loaded",
    "value_integers",
    "value_params",
    "variant_key",
    "version_increment",
]
