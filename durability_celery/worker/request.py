# The Request class of admitted tasks and its release hooks. Rule: every ending
# path of an admitted request (success, exception, retry, hard time limit,
# revoke, worker lost) calls the gate's release for its item; the gate makes
# repeated calls harmless, so hooks may overlap freely.
from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from celery.worker.request import Request

Release = Callable[[str], object]


class AdmittedRequest(Request):  # type: ignore[misc]
    """A Celery request whose endings are reported to the gate that admitted it."""

    # Set per instance by `instrument` when the gate hands the request to the pool;
    # None for a request that was never admitted (nothing to release).
    _durability_release: Release | None = None
    _durability_item = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Celery's strategy builds a subclass per task (create_request_cls) whose own
        # on_success and execute_using_pool shadow any base class's (celery#4526).
        # Wrapped here, once per class, not per request: a closure per request would be
        # built for every task, on the worker's busiest path.
        super().__init_subclass__(**kwargs)
        if "on_success" in cls.__dict__:
            cls.on_success = _then_ended(cls.__dict__["on_success"])
        if "execute_using_pool" in cls.__dict__:
            cls.execute_using_pool = _ended_if_raises(cls.__dict__["execute_using_pool"])

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> Any:
        # Exceptions, Retry, Reject, Terminated (revoke during run) and
        # WorkerLostError all end here, in the main process.
        try:
            return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                      return_ok=return_ok)
        finally:
            self._durability_ended()

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        try:
            return super().on_timeout(soft, timeout)
        finally:
            if not soft:  # a soft limit only raises inside the task, which goes on
                self._durability_ended()

    def _durability_ended(self) -> None:
        release = self._durability_release
        if release is not None:
            release(self._durability_item)


def _then_ended(on_success: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(on_success)
    def on_success_then_release(self: AdmittedRequest, *args: Any, **kwargs: Any) -> Any:
        try:
            return on_success(self, *args, **kwargs)
        finally:
            self._durability_ended()

    return on_success_then_release


def _ended_if_raises(execute_using_pool: Callable[..., Any]) -> Callable[..., Any]:
    # A request revoked between admission and the pool raises TaskRevokedError here
    # and never reaches a pool callback.
    @wraps(execute_using_pool)
    def execute_or_release(self: AdmittedRequest, pool: Any, **kwargs: Any) -> Any:
        try:
            return execute_using_pool(self, pool, **kwargs)
        except BaseException:
            # TaskRevokedError (revoked after admission) or a pool that refused
            # the job: either way the task will not run on this permit.
            self._durability_ended()
            raise

    return execute_or_release


def instrument(request: Any, item: str, release: Release) -> None:
    """Make every ending of `request` (an AdmittedRequest) call `release(item)`."""
    request._durability_item = item
    request._durability_release = release
