# `AdmittedTask`: the base class a task opts in with, and how its semaphore, key
# and group are found. Rule: misconfiguration fails at decoration time (unknown
# semaphore, key argument not in the signature, rate_limit set) or at publish
# time (key missing or not a non-empty string), never silently on a worker.
from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from celery import Task
from kombu.utils.imports import symbol_by_name

from ..errors import CallerError, ConfigurationError
from ..registry import configuration_for
from ..wire.fields import MAX_KEY_LENGTH
from .headers import HEADER_ENQUEUED_AT, HEADER_GROUP, HEADER_KEY, HEADER_SEMAPHORE
from .request import AdmittedRequest

Extractor = str | Callable[[tuple[Any, ...], dict[str, Any]], Any]
"""An argument name, or a callable over the task's (args, kwargs)."""


class AdmissionError(CallerError):
    """A task was published with arguments that give no valid key or group."""


@dataclass(frozen=True)
class Admission:
    """Where one admitted task finds its semaphore, key and group."""

    semaphore: str
    key: Extractor
    group: Extractor | None
    positions: Mapping[str, int]
    """Positional index of each named parameter of the task function."""
    defaults: Mapping[str, Any]
    """Default values of the task function's parameters that have one."""

    def key_of(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        value = self._extract("key", self.key, args, kwargs)
        return _check_text("key", value, self.semaphore)

    def group_of(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        if self.group is None:
            return None
        value = self._extract("group", self.group, args, kwargs)
        return None if value is None else _check_text("group", value, self.semaphore)

    def headers(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The message headers for one publish (raises AdmissionError on a bad key)."""
        return {
            HEADER_SEMAPHORE: self.semaphore,
            HEADER_KEY: self.key_of(args, kwargs),
            HEADER_GROUP: self.group_of(args, kwargs),
            HEADER_ENQUEUED_AT: time.time(),
        }

    def _extract(self, what: str, how: Extractor, args: Sequence[Any],
                 kwargs: Mapping[str, Any]) -> Any:
        if callable(how):
            return how(tuple(args), dict(kwargs))
        if how in kwargs:
            return kwargs[how]
        index = self.positions.get(how)
        if index is not None and index < len(args):
            return args[index]
        if how in self.defaults:
            return self.defaults[how]
        raise AdmissionError(
            f"{what} argument {how!r} was not passed (semaphore {self.semaphore!r})")


def _check_text(what: str, value: object, semaphore: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_LENGTH:
        raise AdmissionError(
            f"{what} for semaphore {semaphore!r} must be a non-empty str of at most "
            f"{MAX_KEY_LENGTH} chars, got {value!r}"
        )
    return value


def _task_function(task_cls: type[AdmittedTask]) -> tuple[Callable[..., Any], bool]:
    """The function the task runs, and whether its first parameter is `self`."""
    static = inspect.getattr_static(task_cls, "__wrapped__", None)
    if static is None:  # a class-based task: `run` is a method
        return task_cls.run, True
    return task_cls.__wrapped__, not isinstance(static, staticmethod)


def _parameters(fun: Callable[..., Any], *, bound: bool
                ) -> tuple[dict[str, int], dict[str, Any], set[str], bool]:
    """Positional index per parameter, defaults, every named parameter, and whether
    the function takes **kwargs."""
    params = list(inspect.signature(fun).parameters.values())
    if bound and params:
        params = params[1:]  # `self` of a bind=True task
    positions = {
        p.name: i for i, p in enumerate(params)
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    }
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    return positions, defaults, names, any(p.kind is p.VAR_KEYWORD for p in params)


def build_admission(task_cls: type[AdmittedTask], app: Any) -> Admission:
    """Validate an admitted task's options against `app`'s Durability configuration."""
    name = getattr(task_cls, "name", None) or task_cls.__name__
    if not isinstance(task_cls.semaphore, str):
        raise ConfigurationError(f"task {name}: AdmittedTask needs semaphore='<name>'")
    try:
        configuration_for(app).semaphore(task_cls.semaphore)
    except ConfigurationError as exc:
        raise ConfigurationError(f"task {name}: {exc}") from None
    if task_cls.rate_limit:
        raise ConfigurationError(
            f"task {name}: rate_limit cannot be combined with AdmittedTask (the rate "
            "limiter would hand requests to the pool around the gate); use the semaphore"
        )
    request_cls = symbol_by_name(task_cls.Request)  # type: ignore[no-untyped-call]
    if not (isinstance(request_cls, type) and issubclass(request_cls, AdmittedRequest)):
        raise ConfigurationError(
            f"task {name}: Request must subclass durability_celery.worker.request."
            f"AdmittedRequest (its ending hooks release the permit), got {task_cls.Request!r}"
        )
    fun, bound = _task_function(task_cls)
    positions, defaults, names, takes_kwargs = _parameters(fun, bound=bound)
    for what, how in (("key", task_cls.key), ("group", task_cls.group)):
        if how is None and what == "group":
            continue
        if callable(how):
            continue
        if not isinstance(how, str) or not how:
            raise ConfigurationError(
                f"task {name}: {what} must be an argument name or a callable(args, kwargs)"
            )
        if how not in names and not takes_kwargs:
            raise ConfigurationError(
                f"task {name}: {what} argument {how!r} is not a parameter of the task "
                f"(parameters: {', '.join(sorted(names)) or 'none'})"
            )
    return Admission(task_cls.semaphore, task_cls.key, task_cls.group,  # type: ignore[arg-type]
                     positions, defaults)


def check_at_decoration(app: Any) -> None:
    """Make `@app.task(base=AdmittedTask, ...)` check its options when it decorates.

    Celery builds the task class of a lazy app only when the app finalizes (worker
    start, first use), so a typo in `semaphore=` or `key=` passed import and surfaced
    deep in Celery's finalize. Wrapping this app's decorator checks them at once,
    without building the task: the app's configuration is not read before its time.
    Tasks decorated before Durability(app, ...) exists, or with @shared_task, are
    still checked when their class is built."""
    decorate = app.task

    def task(*args: Any, **opts: Any) -> Any:
        if len(args) == 1 and callable(args[0]):
            _check_options(app, args[0], opts)
            return decorate(*args, **opts)
        made = decorate(*args, **opts)

        def checked(fun: Any) -> Any:
            _check_options(app, fun, opts)
            return made(fun)

        return checked

    app.task = task


def _check_options(app: Any, fun: Any, opts: dict[str, Any]) -> None:
    base = opts.get("base")
    if not (isinstance(base, type) and issubclass(base, AdmittedTask)):
        return
    name = opts.get("name") or app.gen_task_name(fun.__name__, fun.__module__)
    namespace: dict[str, Any] = {
        k: opts[k] for k in ("semaphore", "key", "group", "rate_limit", "Request") if k in opts}
    run = fun if opts.get("bind") else staticmethod(fun)
    namespace.update(name=name, run=run, __wrapped__=run, __module__=fun.__module__)
    # A stand-in class with the task's options and function: built without `app`,
    # so nothing is registered or bound; build_admission checks it as it will the task.
    draft: type[AdmittedTask] = type(fun.__name__, (base,), namespace)
    if draft.semaphore is not None:
        build_admission(draft, app)


class AdmittedTask(Task):  # type: ignore[misc]
    """A task that runs only with a permit of its semaphore for its key.

    `semaphore` names a configured DurabilitySemaphore. `key` and `group` are each
    the name of an argument of the task (looked up in kwargs first, then by its
    position in the task function's signature) or a callable taking
    `(args: tuple, kwargs: dict)`; the key must give a non-empty str, the group a
    str or None (no group).
    """

    semaphore: ClassVar[str | None] = None
    key: ClassVar[Extractor | None] = None
    group: ClassVar[Extractor | None] = None
    Strategy = "durability_celery.worker.strategy:admitted_strategy"
    Request = "durability_celery.worker.request:AdmittedRequest"
    _admission: ClassVar[Admission | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # `@app.task(base=AdmittedTask, ...)` builds the class with the app in its
        # dict: validating here keeps a misconfigured task out of the registry.
        app = cls.__dict__.get("app")
        if app is not None and cls.semaphore is not None:
            cls._admission = build_admission(cls, app)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        if cls.semaphore is not None:
            cls._admission = build_admission(cls, app)

    @classmethod
    def admission(cls) -> Admission:
        """How this task finds its key (ConfigurationError if it is not bound yet)."""
        if cls._admission is None:
            cls._admission = build_admission(cls, cls._get_app())
        return cls._admission

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: Any = None,
                    producer: Any = None, link: Any = None, link_error: Any = None,
                    shadow: Any = None, **options: Any) -> Any:
        # Computed here, not only in before_task_publish: signal receivers'
        # errors are logged and swallowed, and a bad key must reach the caller.
        headers = dict(options.pop("headers", None) or {})
        headers.update(self.admission().headers(args or (), kwargs or {}))
        return super().apply_async(args, kwargs, task_id, producer, link, link_error,
                                   shadow, headers=headers, **options)
