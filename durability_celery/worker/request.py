# The Request class of admitted tasks and its release hooks. Rule: every ending
# path of an admitted request (success, exception, retry, hard time limit,
# revoke, worker lost) calls the gate's release for its item; the gate makes
# repeated calls harmless, so hooks may overlap freely.
from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from celery.worker.request import Request

from ..compat.worker import PER_TASK_REQUEST_METHODS

Release = Callable[[str], object]
RELEASE_ATTRIBUTE = "_durability_release"
"""The attribute an admitted request's release hook is kept in (None: never admitted)."""
_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {}


class AdmittedRequest(Request):  # type: ignore[misc]
    """A Celery request whose endings are reported to the gate that admitted it."""

    # Set per instance by `instrument` when the gate hands the request to the pool;
    # None for a request that was never admitted (nothing to release).
    _durability_release: Release | None = None
    _durability_item = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # The methods Celery's per-task subclass redefines (compat.worker
        # PER_TASK_REQUEST_METHODS) are wrapped here, once per class, not per request:
        # a closure per request would be built for every task, on the worker's busiest
        # path.
        super().__init_subclass__(**kwargs)
        for name in PER_TASK_REQUEST_METHODS:
            if name in cls.__dict__:
                setattr(cls, name, _WRAPPERS[name](cls.__dict__[name]))

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


_WRAPPERS.update(on_success=_then_ended, execute_using_pool=_ended_if_raises)


def instrument(request: Any, item: str, release: Release) -> None:
    """Make every ending of `request` (an AdmittedRequest) call `release(item)`."""
    request._durability_item = item
    request._durability_release = release
