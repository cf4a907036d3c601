# Reads worker_config's environment variables into one validated, frozen
# WorkerConfig. Rule: every bad value fails here, once, with a message that
# names the variable; nothing is read lazily later.
from __future__ import annotations

import dataclasses
import importlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import NoneType
from typing import Any, get_args, get_type_hints

from pydantic import TypeAdapter, ValidationError

from durability_celery.core.config import Leases, Over, Strict, Under
from durability_celery.errors import ConfigurationError
from durability_celery.settings import DurabilitySettings
from durability_celery.wire.fields import MAX_ID_LENGTH

ENV_PREFIX = "DURABILITY_"
EMBEDDED_SCHEME = "durability-filesystem"
"""The embedded broker: kombu's filesystem transport with atomic writes."""
DEFAULT_HOME = ".durability"
DEFAULT_VISIBILITY_TIMEOUT = 3600.0
"""Redis redelivers a message unacked this long; held messages go back well before (VT/2)."""

# A semaphore name is an id on the wire and in the store: its limit is theirs.
_NAME = re.compile(rf"^[A-Za-z0-9_.:-]{{1,{MAX_ID_LENGTH}}}$")
_SEMAPHORE_FIELDS = {
    "limit", "keys", "group_limit", "groups", "grant_timeout", "round_wait", "round_period",
    "leases", "can_grant", "handoff_window",
}
_TIMING = ("grant_timeout", "round_wait", "round_period", "handoff_window")
_KINDS: dict[object, str] = {int: "an integer", float: "a number", bool: "true or false"}


class EnvError(ConfigurationError):
    """An environment variable of worker_config has a bad value."""

    def __init__(self, variable: str, problem: str) -> None:
        self.variable = variable
        self.problem = problem
        super().__init__(f"{variable}: {problem}")


@dataclass(frozen=True)
class SemaphoreSpec:
    """One semaphore as configured from DURABILITY_SEMAPHORES (not yet bound to a database)."""

    name: str
    limit: int | Callable[[str], int]
    group_limit: Callable[[str, str], int | None] | None = None
    can_grant: Callable[[str, str, str | None], bool] | None = None
    timing: tuple[tuple[str, float], ...] = ()
    leases: Leases | None = None


@dataclass(frozen=True)
class WorkerConfig:
    """Everything worker_config reads from the environment."""

    home: Path
    broker_url: str
    broker_transport_options: dict[str, Any]
    database_url: str
    semaphores: tuple[SemaphoreSpec, ...]
    settings: DurabilitySettings
    imports: tuple[str, ...]
    result_backend: str | None

    @property
    def embedded_broker(self) -> bool:
        return self.broker_url.startswith(f"{EMBEDDED_SCHEME}://")


def load_config(env: Mapping[str, str], *, cwd: Path | None = None) -> WorkerConfig:
    """Parse `env` (normally os.environ); raises EnvError naming the first bad variable."""
    home = Path(env.get("DURABILITY_HOME") or DEFAULT_HOME)
    if not home.is_absolute():
        home = (cwd or Path.cwd()) / home
    broker_url = env.get("DURABILITY_BROKER_URL") or f"{EMBEDDED_SCHEME}://"
    if broker_url.startswith("filesystem://"):
        # kombu's own filesystem transport loses messages under concurrent use
        # (see durability_celery/transport.py): the atomic variant serves it.
        broker_url = EMBEDDED_SCHEME + broker_url.removeprefix("filesystem")
    options = _transport_options(env, broker_url, home)
    database_url = env.get("DURABILITY_DATABASE_URL") or f"sqlite:///{home / 'durability.db'}"
    if "://" not in database_url:
        raise EnvError("DURABILITY_DATABASE_URL", f"not a database URL: {database_url!r}")
    return WorkerConfig(
        home=home,
        broker_url=broker_url,
        broker_transport_options=options,
        database_url=database_url,
        semaphores=parse_semaphores(env.get("DURABILITY_SEMAPHORES", "")),
        settings=_settings(env),
        imports=tuple(m.strip() for m in env.get("DURABILITY_IMPORTS", "").split(",") if m.strip()),
        result_backend=env.get("DURABILITY_RESULT_BACKEND") or None,
    )


def make_home(config: WorkerConfig) -> None:
    """Create DURABILITY_HOME and the embedded broker's folders."""
    try:
        config.home.mkdir(parents=True, exist_ok=True)
        if config.embedded_broker:
            for key in ("data_folder_in", "data_folder_out", "control_folder"):
                Path(config.broker_transport_options[key]).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EnvError("DURABILITY_HOME", f"cannot create {config.home}: {exc}") from None


def build_semaphore(spec: SemaphoreSpec, database: Any) -> Any:
    """The DurabilitySemaphore for `spec` on `database` (a URL or an Engine)."""
    from durability_celery.semaphore import DurabilitySemaphore

    timing: dict[str, Any] = dict(spec.timing)
    return DurabilitySemaphore(
        spec.name, database=database, limit=spec.limit, group_limit=spec.group_limit,
        can_grant=spec.can_grant, leases=spec.leases, **timing,
    )


# --------------------------------------------------------------------------
# broker


def _transport_options(env: Mapping[str, str], broker_url: str, home: Path) -> dict[str, Any]:
    if "://" not in broker_url:
        raise EnvError("DURABILITY_BROKER_URL", f"not a broker URL: {broker_url!r}")
    scheme = broker_url.split("://", 1)[0]
    if scheme in ("filesystem", EMBEDDED_SCHEME):
        data = str(home / "broker" / "data")
        return {
            "data_folder_in": data,
            "data_folder_out": data,  # producers and consumers share one folder
            "control_folder": str(home / "broker" / "control"),
            "polling_interval": _number(env, "DURABILITY_POLLING_INTERVAL", 0.1, 0.01, 10),
        }
    if scheme in ("redis", "rediss", "sentinel"):
        vt = _number(
            env, "DURABILITY_VISIBILITY_TIMEOUT", DEFAULT_VISIBILITY_TIMEOUT, 10, 7 * 86400
        )
        return {"visibility_timeout": vt}
    if scheme in ("amqp", "amqps", "pyamqp"):
        return {}
    raise EnvError(
        "DURABILITY_BROKER_URL",
        f"unsupported broker {scheme!r} (use filesystem://, redis://... or amqp://...)",
    )


def _number(env: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(name, f"must be a number, got {raw!r}") from None
    if not low <= value <= high:
        raise EnvError(name, f"must be between {low:g} and {high:g}, got {raw!r}")
    return value


# --------------------------------------------------------------------------
# DurabilitySettings: DURABILITY_<FIELD> for every field


def _settings(env: Mapping[str, str]) -> DurabilitySettings:
    types = get_type_hints(DurabilitySettings)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(DurabilitySettings):
        name = ENV_PREFIX + field.name.upper()
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        value: Any = _convert(name, raw, types[field.name])
        try:
            DurabilitySettings(**{field.name: value})
        except ConfigurationError as exc:
            raise EnvError(name, str(exc)) from None
        values[field.name] = value
    return DurabilitySettings(**values)


def _convert(name: str, raw: str, field_type: Any) -> object:
    # pydantic parses the text by the field's type; an optional field also takes
    # "none" or "null", which pydantic would refuse for a string.
    text = raw.strip()
    if NoneType in get_args(field_type):
        if text.lower() in ("none", "null"):
            return None
        field_type = next(t for t in get_args(field_type) if t is not NoneType)
    try:
        return TypeAdapter(field_type).validate_python(text)
    except ValidationError as exc:
        kind = _KINDS.get(field_type)
        problem = f"must be {kind}" if kind else exc.errors()[0]["msg"]
        raise EnvError(name, f"{problem}, got {raw!r}") from None


# --------------------------------------------------------------------------
# DURABILITY_SEMAPHORES


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object naming one field twice: json.loads would keep the last silently."""
    data: dict[str, Any] = {}
    for name, value in pairs:
        if name in data:
            raise EnvError("DURABILITY_SEMAPHORES", f"{name!r} is given twice")
        data[name] = value
    return data


def parse_semaphores(raw: str) -> tuple[SemaphoreSpec, ...]:
    """`accounts=10,exports=3` (a limit per key), or a JSON object (see docs/configuration.md)."""
    text = raw.strip()
    if not text:
        return ()
    if text.startswith("{"):
        try:
            data = json.loads(text, object_pairs_hook=_unique_names)
        except json.JSONDecodeError as exc:
            raise EnvError("DURABILITY_SEMAPHORES", f"invalid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise EnvError("DURABILITY_SEMAPHORES", "JSON must be an object")
        return tuple(_semaphore_from_json(name, spec) for name, spec in data.items())
    specs: list[SemaphoreSpec] = []
    for item in text.split(","):
        name, sep, limit = item.strip().partition("=")
        if not sep:
            raise EnvError("DURABILITY_SEMAPHORES", f"expected NAME=LIMIT, got {item.strip()!r}")
        specs.append(SemaphoreSpec(_name(name.strip()), _limit(name, limit.strip())))
    _no_duplicates(specs)
    return tuple(specs)


def _fail(semaphore: str, problem: str) -> EnvError:
    return EnvError("DURABILITY_SEMAPHORES", f"semaphore {semaphore!r}: {problem}")


def _name(name: str) -> str:
    if not _NAME.match(name):
        raise EnvError("DURABILITY_SEMAPHORES", f"bad semaphore name {name!r}")
    return name


def _limit(semaphore: str, raw: object) -> int:
    try:
        value = int(raw) if isinstance(raw, str) else raw
    except ValueError:
        value = None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(semaphore, f"a limit must be a non-negative integer, got {raw!r}")
    return value


def _no_duplicates(specs: list[SemaphoreSpec]) -> None:
    names = [s.name for s in specs]
    for name in names:
        if names.count(name) > 1:
            raise EnvError("DURABILITY_SEMAPHORES", f"semaphore {name!r} is configured twice")


def _semaphore_from_json(name: str, spec: object) -> SemaphoreSpec:
    _name(name)
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = {"limit": spec}
    if not isinstance(spec, dict):
        raise _fail(name, "must be a limit or an object")
    unknown = sorted(set(spec) - _SEMAPHORE_FIELDS)
    if unknown:
        raise _fail(name, f"unknown field(s) {', '.join(unknown)}; known: "
                    f"{', '.join(sorted(_SEMAPHORE_FIELDS))}")
    if "limit" not in spec:
        raise _fail(name, "needs a limit")
    timing = []
    for field in _TIMING:
        if field in spec:
            value = spec[field]
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise _fail(name, f"{field} must be a number of seconds, got {value!r}")
            timing.append((field, float(value)))
    return SemaphoreSpec(
        name=name,
        limit=_key_limit(name, spec["limit"], spec.get("keys")),
        group_limit=_group_limit(name, spec.get("group_limit"), spec.get("groups")),
        can_grant=_import_callable(name, "can_grant", spec["can_grant"])
        if spec.get("can_grant") is not None else None,
        timing=tuple(timing),
        leases=_leases(name, spec.get("leases")),
    )


def _key_limit(name: str, default: object, per_key: object) -> int | Callable[[str], int]:
    if isinstance(default, str) and ":" in default:
        if per_key is not None:
            raise _fail(name, "keys cannot be combined with a callable limit")
        limit: Callable[[str], int] = _import_callable(name, "limit", default)
        return limit
    base = _limit(name, default)
    if per_key is None:
        return base
    if not isinstance(per_key, dict):
        raise _fail(name, "keys must be an object of key -> limit")
    table = {str(k): _limit(name, v) for k, v in per_key.items()}
    return _TableLimit(table, base)


def _group_limit(
    name: str, default: object, per_group: object
) -> Callable[[str, str], int | None] | None:
    if isinstance(default, str) and ":" in default:
        if per_group is not None:
            raise _fail(name, "groups cannot be combined with a callable group_limit")
        group_limit: Callable[[str, str], int | None] = _import_callable(
            name, "group_limit", default
        )
        return group_limit
    base = None if default is None else _limit(name, default)
    if per_group is not None and not isinstance(per_group, dict):
        raise _fail(name, "groups must be an object of group -> limit")
    table = {str(k): _limit(name, v) for k, v in (per_group or {}).items()}
    if base is None and not table:
        return None
    return _TableGroupLimit(table, base)


class _TableLimit:
    """limit(key): the per-key entry, else the default."""

    def __init__(self, table: dict[str, int], default: int) -> None:
        self._table, self._default = table, default

    def __call__(self, key: str) -> int:
        return self._table.get(key, self._default)


class _TableGroupLimit:
    """group_limit(key, group): the per-group entry, else the default ceiling (or none)."""

    def __init__(self, table: dict[str, int], default: int | None) -> None:
        self._table, self._default = table, default

    def __call__(self, key: str, group: str) -> int | None:
        return self._table.get(group, self._default)


def _import_callable(name: str, field: str, path: object) -> Any:
    if not isinstance(path, str) or ":" not in path:
        raise _fail(name, f"{field} must be 'package.module:function', got {path!r}")
    module_name, _, attr = path.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise _fail(name, f"{field}: cannot import {path!r}: {exc}") from None
    if not callable(target):
        raise _fail(name, f"{field}: {path!r} is not callable")
    return target


def _leases(name: str, spec: object) -> Leases | None:
    if spec is None or spec is False:
        return None
    if spec is True:
        return Leases()
    if not isinstance(spec, dict):
        raise _fail(name, "leases must be true, false or an object")
    options = dict(spec)
    mode = options.pop("provisioning", "strict")
    try:
        provisioning: Strict | Under | Over
        if mode == "strict":
            provisioning = Strict()
        elif mode == "under":
            provisioning = Under(reserve=options.pop("reserve", 0))
        elif mode == "over":
            provisioning = Over(extra=options.pop("extra", None), ratio=options.pop("ratio", None))
        else:
            raise _fail(name, f"leases.provisioning must be strict, under or over, got {mode!r}")
        return Leases(provisioning=provisioning, **options)
    except (TypeError, ConfigurationError) as exc:
        if isinstance(exc, EnvError):
            raise
        raise _fail(name, f"leases: {exc}") from None
