"""Seal and open a 1 KiB dispatch frame, beside the floor measured in the same run.

The floor is what any implementation must pay per frame: one keyed BLAKE3
hash of the tag input plus one msgspec encode and decode of the same message.
Goal: seal + open within 4x the floor.

Run: .venv/bin/python bench/frames.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import blake3
import msgspec

from octo_common.frames import AuthenticatorState, SessionAuthenticator, SessionKey, SessionRole
from octo_common.messages import DispatchOperation, OperationDispatchRequest
from octo_common.payload import ToolPayload

ROUNDS = 7
PER_ROUND = 5_000


class PlainRequest(msgspec.Struct):
    protocol_version: int
    session_id: str
    request_id: str
    tool: str
    operation_key: str
    payload: dict[str, object]


class PlainMessage(msgspec.Struct, tag_field="type", tag="dispatch_operation"):
    request: PlainRequest


def one_kib_request() -> OperationDispatchRequest:
    files = [
        {"name": f"release-{i:03d}.tar.gz", "sha256": "ab" * 16, "bytes": 1000 + i}
        for i in range(9)
    ]
    payload = ToolPayload.json({"channel": "stable", "version": "1.2.3", "files": files})
    return OperationDispatchRequest(
        "session-1", "dispatch-1", "release.publish", "op-release-42", payload
    )


def per_call_us(fn: Callable[[], object]) -> float:
    samples = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(PER_ROUND):
            fn()
        samples.append((time.perf_counter() - start) / PER_ROUND * 1e6)
    return statistics.median(samples)


def main() -> int:
    key = SessionKey.generate()
    message = DispatchOperation(one_kib_request())
    host = SessionAuthenticator("session-1", key, SessionRole.HOST)
    frame = host.seal(message)
    print(f"frame size: {len(frame)} bytes")

    # Floor: one keyed BLAKE3 of the tag input + one msgspec encode and decode
    # of the same message (as a plain msgspec struct tree).
    plain = msgspec.json.decode(frame, type=dict)["message"]
    plain_message = msgspec.convert(plain, PlainMessage)
    encoder = msgspec.json.Encoder()
    decoder = msgspec.json.Decoder(PlainMessage)
    raw_key = key.expose()
    tag_input = frame  # same length as the tag input, within a few bytes

    def floor() -> None:
        data = encoder.encode(plain_message)
        decoder.decode(data)
        blake3.blake3(tag_input, key=raw_key).digest()

    sealer = SessionAuthenticator.restore(
        "session-1", key, SessionRole.HOST, AuthenticatorState(1, 0, 0)
    )

    def seal() -> None:
        sealer.seal(message)

    frames = [sealer.seal(message) for _ in range(ROUNDS * PER_ROUND + 10)]
    opener = SessionAuthenticator("session-1", key, SessionRole.WORKER)
    it = iter(frames)

    def open_() -> None:
        opener.open(next(it))

    floor_us = per_call_us(floor)
    seal_us = per_call_us(seal)
    open_us = per_call_us(open_)
    total = seal_us + open_us
    print(f"floor (keyed BLAKE3 + msgspec encode+decode): {floor_us:7.2f} us")
    print(f"seal:                                         {seal_us:7.2f} us")
    print(f"open:                                         {open_us:7.2f} us")
    ratio = total / floor_us
    print(f"seal + open:                                  {total:7.2f} us = {ratio:.2f}x floor")
    print("goal: seal + open <= 4x floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
