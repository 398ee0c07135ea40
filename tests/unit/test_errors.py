"""An error crosses a process or node boundary by name (`ember.errors.error_fields`, `error_named`) and comes back
as its own class, message and retry_after; a name that is not one of ours comes back as None."""

from __future__ import annotations

import pytest

import ember.errors as errors
from ember.errors import EmberError, JobStoreError, NodeUnreachable, Overloaded, RateLimited, error_fields, error_named

TREE = [cls for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, EmberError) and cls is not EmberError]


@pytest.mark.parametrize("cls", TREE, ids=lambda c: c.__name__)
def test_every_error_of_the_tree_comes_back_as_its_class(cls: type[EmberError]) -> None:
    fields = error_fields(cls("it broke"))
    back = error_named(fields["kind"], str(fields["message"]), fields["retry_after"])
    assert type(back) is cls and back.message == "it broke"


@pytest.mark.parametrize("cls", [Overloaded, RateLimited, JobStoreError])
def test_retry_after_crosses_with_the_errors_that_carry_it(cls: type[Overloaded | JobStoreError]) -> None:
    back = error_named(**error_fields(cls("full", 7.5)))  # type: ignore[arg-type]
    assert isinstance(back, cls) and back.retry_after == 7.5


@pytest.mark.parametrize("kind", ["EmberError", "ValueError", "error_named", "", None, 3, "__builtins__"])
def test_a_name_that_is_not_an_error_of_ours_is_none(kind: object) -> None:
    assert error_named(kind, "x") is None


def test_a_node_lost_comes_back_without_what_only_its_side_knew() -> None:
    back = error_named("NodeUnreachable", "gone")
    assert isinstance(back, NodeUnreachable) and not back.answered
