"""The gateway's HTTP status comes from the runtime's error code, never from its message."""

from __future__ import annotations

import pytest

from radixrt.client.transport import InvalidRequestError, RemoteError
from radixrt.protocol import ErrorCode
from radixrt.server.http.errors import HTTP_ERRORS, from_runtime_error


def test_every_code_has_a_status():
    assert set(HTTP_ERRORS) == set(ErrorCode)


@pytest.mark.parametrize(
    "code, status",
    [
        ("context_length_exceeded", 400),
        ("overloaded", 503),
        ("unauthorized", 401),
        ("internal_error", 500),
    ],
)
def test_status_follows_the_code_whatever_the_words(code, status):
    for message in ("the prompt has 9000 tokens", "overloaded", "something reworded"):
        error = from_runtime_error(RemoteError(code, message))
        assert (error.status, error.code, str(error)) == (status, code, message)


def test_unknown_codes_and_local_errors():
    assert from_runtime_error(RemoteError("some_future_code", "x")).status == 500
    assert from_runtime_error(ValueError("bad prompt")).status == 400
    assert from_runtime_error(ConnectionError("gone")).status == 503
    assert from_runtime_error(InvalidRequestError("invalid_constraint", "bad regex")).status == 400
