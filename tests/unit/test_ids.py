"""Token syntax helpers: the one-regex fast path agrees with the field checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from octo_common.errors import InvalidToken
from octo_common.ids import all_tokens, is_token, validate_tokens


def test_a_newline_inside_a_value_never_passes_as_two_tokens() -> None:
    assert not all_tokens("session-1", "a\nb", "tool")
    with pytest.raises(InvalidToken) as caught:
        validate_tokens(("session id", "session-1"), ("request id", "a\nb"))
    assert caught.value.field == "request id"


def test_the_first_bad_field_is_reported() -> None:
    with pytest.raises(InvalidToken) as caught:
        validate_tokens(("session id", "S"), ("request id", "also bad"))
    assert (caught.value.field, caught.value.value) == ("session id", "S")


def test_non_strings_are_not_tokens() -> None:
    assert not all_tokens("ok", 5)  # type: ignore[arg-type]


@given(st.lists(st.text(alphabet="ab.\n_-Z ", max_size=6), min_size=1, max_size=5))
def test_all_tokens_agrees_with_is_token(values: list[str]) -> None:
    assert all_tokens(*values) == all(is_token(v) for v in values)
