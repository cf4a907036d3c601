# AdmittedTask without a worker: misconfiguration fails at decoration time,
# bad keys fail at publish time in the caller, and published messages carry the
# semaphore, key, group and enqueue time in their headers.
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals

from durability_celery.app import Durability
from durability_celery.errors import ConfigurationError
from durability_celery.semaphore import DurabilitySemaphore
from durability_celery.worker import AdmissionError, AdmittedTask
from durability_celery.worker.request import AdmittedRequest


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    app = Celery("task_test", broker="memory://", set_as_current=False)
    app.conf.task_serializer = "json"
    semaphore = DurabilitySemaphore("accounts", database=f"sqlite:///{tmp_path / 'd.db'}",
                                    limit=3)
    Durability(app, [semaphore])
    yield app
    semaphore.close()


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any] | None = None, **_: Any) -> None:
        seen.append(dict(headers or {}))

    signals.after_task_publish.connect(capture, weak=False, dispatch_uid="test_task.capture")
    try:
        yield seen
    finally:
        signals.after_task_publish.disconnect(dispatch_uid="test_task.capture")


def test_unknown_semaphore_fails_at_decoration(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="unknown semaphore 'nope'"):
        @app.task(base=AdmittedTask, semaphore="nope", key="account", shared=False)
        def work(account: str) -> None: ...
        work.name  # noqa: B018  (a lazy task is built on first use)


def test_key_argument_not_in_signature_fails_at_decoration(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="key argument 'acct'"):
        @app.task(base=AdmittedTask, semaphore="accounts", key="acct", shared=False)
        def work(account: str) -> None: ...
        work.name  # noqa: B018


def test_rate_limit_is_refused(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="rate_limit"):
        @app.task(base=AdmittedTask, semaphore="accounts", key="account", rate_limit="1/s",
                  shared=False)
        def work(account: str) -> None: ...
        work.name  # noqa: B018


def test_headers_from_kwargs_positions_and_defaults(app: Celery,
                                                    published: list[dict[str, Any]]) -> None:
    @app.task(bind=True, base=AdmittedTask, semaphore="accounts", key="account",
              group="workflow", shared=False)
    def work(self: Any, account: str, workflow: str | None = None) -> None: ...

    before = time.time()
    work.apply_async(("acct-1", "wf-1"))
    work.apply_async(kwargs={"account": "acct-2"})
    work.delay("acct-3", workflow="wf-3")
    rows = [(h["durability_semaphore"], h["durability_key"], h["durability_group"])
            for h in published]
    assert rows == [("accounts", "acct-1", "wf-1"), ("accounts", "acct-2", None),
                    ("accounts", "acct-3", "wf-3")]
    assert all(before <= h["durability_enqueued_at"] <= time.time() for h in published)


def test_callable_key_and_group(app: Celery, published: list[dict[str, Any]]) -> None:
    @app.task(base=AdmittedTask, semaphore="accounts", shared=False,
              key=lambda args, kwargs: f"acct-{kwargs['order']['account']}",
              group=lambda args, kwargs: kwargs["order"].get("tenant"))
    def work(order: dict[str, Any]) -> None: ...

    work.delay(order={"account": 7, "tenant": "t-1"})
    assert published[-1]["durability_key"] == "acct-7"
    assert published[-1]["durability_group"] == "t-1"


@pytest.mark.parametrize("call", [
    lambda t: t.apply_async(kwargs={}),             # key missing
    lambda t: t.apply_async(kwargs={"account": 42}),  # not a str
    lambda t: t.apply_async(kwargs={"account": ""}),  # empty
])
def test_bad_key_fails_in_the_caller(app: Celery, published: list[dict[str, Any]],
                                     call: Any) -> None:
    @app.task(base=AdmittedTask, semaphore="accounts", key="account", shared=False)
    def work(account: Any = None, **kwargs: Any) -> None: ...

    with pytest.raises(AdmissionError, match="key"):
        call(work)
    assert published == []  # nothing reached the broker


def test_send_task_by_name_gets_headers_from_the_publish_hook(
        app: Celery, published: list[dict[str, Any]]) -> None:
    @app.task(base=AdmittedTask, semaphore="accounts", key="account", name="by.name",
              shared=False)
    def work(account: str) -> None: ...

    app.send_task("by.name", kwargs={"account": "acct-9"})
    assert published[-1]["durability_key"] == "acct-9"
    assert published[-1]["durability_semaphore"] == "accounts"


def test_a_request_class_without_the_release_hooks_is_refused(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="AdmittedRequest"):
        @app.task(base=AdmittedTask, semaphore="accounts", key="account",
                  Request="celery.worker.request:Request", shared=False)
        def bare(account: str) -> None: ...
        bare.name  # noqa: B018


def test_a_subclass_of_admitted_request_is_accepted(app: Celery) -> None:
    @app.task(base=AdmittedTask, semaphore="accounts", key="account",
              Request=MyRequest, shared=False)
    def custom(account: str) -> None:
        pass

    assert custom.admission().semaphore == "accounts"


class MyRequest(AdmittedRequest):
    pass


def test_options_are_checked_when_the_decorator_runs(app: Celery) -> None:
    # Nothing touches the task: Celery would build it only when the app finalizes.
    with pytest.raises(ConfigurationError) as raised:
        @app.task(base=AdmittedTask, semaphore="acounts", key="account")
        def misspelt(account: str) -> None: ...
    assert str(raised.value) == (f"task {__name__}.misspelt: unknown semaphore 'acounts' "
                                 "(configured: accounts)")
    with pytest.raises(ConfigurationError, match=r"^task .*\.keyless: key argument 'acct' is "
                       r"not a parameter of the task \(parameters: account\)$"):
        @app.task(base=AdmittedTask, semaphore="accounts", key="acct")
        def keyless(account: str) -> None: ...
    with pytest.raises(ConfigurationError, match="unknown semaphore 'nope'"):
        app.task(lambda account: None, base=AdmittedTask, semaphore="nope", key="account")
    # Refused before Celery registered them (shared tasks join every app that finalizes
    # later): this app and a new one finalize cleanly, without them.
    app.finalize()
    assert not any(name.endswith(("misspelt", "keyless")) for name in app.tasks)
    Celery("after", broker="memory://", set_as_current=False).finalize()


def test_a_good_bound_task_passes_the_decoration_check(app: Celery) -> None:
    @app.task(base=AdmittedTask, semaphore="accounts", key="account", bind=True,
              shared=False)
    def bound(self: Any, account: str) -> str:
        return account

    assert bound.admission().key_of(("a1",), {}) == "a1"


def test_a_task_decorated_before_durability_is_checked_when_the_app_finalizes(
        tmp_path: Path) -> None:
    later = Celery("later", broker="memory://", set_as_current=False)

    @later.task(base=AdmittedTask, semaphore="nope", key="account", shared=False)
    def early(account: str) -> None: ...

    semaphore = DurabilitySemaphore("accounts", database=f"sqlite:///{tmp_path / 'd.db'}",
                                    limit=3)
    try:
        Durability(later, [semaphore])
        with pytest.raises(ConfigurationError, match=r"^task .*\.early: unknown semaphore "
                           r"'nope' \(configured: accounts\)$"):
            later.finalize()
    finally:
        semaphore.close()
