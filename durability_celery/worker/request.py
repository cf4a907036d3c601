# The Request class of admitted tasks and the per-request release hooks. Rule:
# every ending path of an admitted request (success, exception, retry, hard
# time limit, revoke, worker lost) calls the gate's release for its task id;
# the gate makes repeated calls harmless, so hooks may overlap freely.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.worker.request import Request

Release = Callable[[str], object]


class AdmittedRequest(Request):  # type: ignore[misc]
    """A Celery request whose endings are reported to the gate that admitted it."""

    # Set per instance by `instrument` when the gate hands the request to the pool;
    # None for a request that was never admitted (nothing to release).
    _durability_release: Release | None = None

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
            release(self.id)


def instrument(request: Any, item: str, release: Release) -> None:
    """Make every ending of `request` call `release(item)`.

    `on_success` is wrapped on the instance because create_request_cls defines
    its own `on_success`, shadowing any subclass's (celery#4526);
    `execute_using_pool` because a request revoked between admission and the
    pool raises TaskRevokedError there and never reaches a pool callback.
    """
    request._durability_release = lambda _task_id: release(item)
    on_success = request.on_success
    execute_using_pool = request.execute_using_pool

    def on_success_then_release(result: Any, **kwargs: Any) -> Any:
        try:
            return on_success(result, **kwargs)
        finally:
            release(item)

    def execute_or_release(pool: Any, **kwargs: Any) -> Any:
        try:
            return execute_using_pool(pool, **kwargs)
        except BaseException:
            # TaskRevokedError (revoked after admission) or a pool that refused
            # the job: either way the task will not run on this permit.
            release(item)
            raise

    request.on_success = on_success_then_release
    request.execute_using_pool = execute_or_release
