# Pins the public names: removing or renaming one is a breaking change and
# must show up here first. Also checks every error shares the one root.
from __future__ import annotations

import durability_celery
from durability_celery import errors

PUBLIC = {
    "DurabilitySemaphore", "Leases", "Over", "Strict", "Under", "Usage", "GroupUsage",
    "Blocked", "metadata", "Durability", "DurabilitySettings", "AdmittedTask",
    "durability_for", "SemaphoreClient", "BlockingClient", "Permit", "DurabilityError",
    "CallerError", "InvalidMessage", "IllegalTransition", "AdmissionError",
    "ConfigurationError", "InfrastructureError", "RequestTimeout", "HolderError",
    "__version__",
}


def test_public_names_are_pinned() -> None:
    assert set(durability_celery.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(durability_celery, name) is not None


def test_every_error_has_one_root_and_a_docstring() -> None:
    classes = [getattr(durability_celery, n) for n in PUBLIC]
    error_classes = [c for c in classes if isinstance(c, type) and issubclass(c, Exception)]
    assert len(error_classes) == 9
    for cls in error_classes:
        assert issubclass(cls, errors.DurabilityError), cls
        assert cls.__doc__ and "\n" not in cls.__doc__.strip(), cls


def test_metadata_holds_the_three_tables_for_alembic() -> None:
    assert set(durability_celery.metadata.tables) >= {
        "durability_semaphore_grants", "durability_semaphore_leases", "durability_semaphore_keys",
    }
