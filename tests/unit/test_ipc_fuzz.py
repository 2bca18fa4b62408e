"""Property-based fuzzing (hypothesis) of the weight-cache wire: the frame parser, the schema of every message type,
and a real RankServer fed arbitrary frames and message sequences. The properties: the parser returns a message or
raises ProtocolError, nothing else; the schema returns a model or raises MessageError naming the message; the
daemon answers every frame it can parse with one valid reply frame (an error frame for anything invalid), never
raises in a connection thread, and keeps serving everyone else. Example counts are bounded (CI time)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.ipc_fake_daemon import fingerprint, make_state, weights
from vllm_fastload.ipc.daemon.rank import Limits
from vllm_fastload.ipc.daemon.server import RankServer, acquire
from vllm_fastload.ipc.wire import protocol
from vllm_fastload.ipc.wire.client import status_of
from vllm_fastload.ipc.wire.messages import REPLIES, REQUESTS, MessageError, parse_reply, parse_request, to_frame

FP = json.loads(json.dumps(fingerprint().to_dict()))
VALID = {
    "hello": {"type": "hello", "version": protocol.PROTOCOL_VERSION, "fingerprint": FP, "pid": 7},
    "attach": {"type": "attach", "mode": "copy"},
    "release": {"type": "release"},
    "status": {"type": "status"},
    "bye": {"type": "bye"},
}
assert set(VALID) == set(REQUESTS)  # a new message type must be added here too
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def mutations(base: dict) -> st.SearchStrategy:
    """``base`` with one field replaced by any JSON value, dropped, or an extra field added; for hello also one
    field of the fingerprint or of a shard replaced."""
    keys = sorted(base)
    out = [st.just(base),
           st.tuples(st.sampled_from(keys), json_values).map(lambda kv: {**base, kv[0]: kv[1]}),
           st.sampled_from(keys).map(lambda k: {x: v for x, v in base.items() if x != k}),
           st.tuples(st.text(max_size=8), json_values).map(lambda kv: {kv[0]: kv[1], **base})]
    if "fingerprint" in base:
        fp = base["fingerprint"]
        out.append(st.tuples(st.sampled_from(sorted(fp)), json_values).map(
            lambda kv: {**base, "fingerprint": {**fp, kv[0]: kv[1]}}))
        out.append(st.tuples(st.sampled_from(sorted(fp["shards"][0])), json_values).map(
            lambda kv: {**base, "fingerprint": {**fp, "shards": [{**fp["shards"][0], kv[0]: kv[1]}]}}))
    return st.one_of(out)


requests = st.one_of(
    st.sampled_from(sorted(VALID)).flatmap(lambda t: mutations(VALID[t])),
    st.tuples(st.sampled_from([*REQUESTS, "manifest", "error", ""]) | st.text(max_size=8),
              st.dictionaries(st.text(max_size=8), json_values, max_size=4)).map(lambda td: {**td[1], "type": td[0]}),
)


def framed(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


frames = st.one_of(
    requests.map(lambda m: framed(json.dumps(m).encode())),
    json_values.map(lambda v: framed(json.dumps(v).encode())),  # not an object, or no string type
    st.binary(max_size=64).map(framed),  # not JSON, not UTF-8
    st.integers(1, 30).map(lambda d: framed(b'{"type":"status","x":' + b"[" * (d * 1000) + b"]" * (d * 1000) + b"}")),
    st.binary(max_size=16),  # raw bytes: absurd lengths, half a length prefix
)


@SETTINGS
@given(st.lists(frames, max_size=4).map(b"".join))
def test_the_frame_parser_returns_messages_or_raises_protocol_error(data):
    a, b = socket.socketpair()
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(5)
        while True:
            try:
                msg, fds = protocol.recv(b)
            except protocol.ProtocolError:
                break
            assert isinstance(msg, dict) and isinstance(msg["type"], str) and fds == []
    finally:
        a.close()
        b.close()


replies = st.one_of(
    st.sampled_from(sorted(REPLIES)).flatmap(lambda t: st.dictionaries(st.text(max_size=8), json_values, max_size=5)
                                             .map(lambda d: {**d, "type": t})),
    st.just(to_frame(make_state(Path("/nonexistent"), fingerprint(), weights()).manifest)).flatmap(mutations),
)


@pytest.mark.parametrize("parse, unknown", [(parse_request, ("unknown message type ", "protocol version ")),
                                            (parse_reply, ("unknown reply type ",))], ids=["requests", "replies"])
@SETTINGS
@given(data=st.data())
def test_every_message_type_is_a_valid_model_or_a_message_error_naming_it(parse, unknown, data):
    msg = data.draw(requests if parse is parse_request else replies)
    try:
        model = parse(msg)
    except MessageError as e:
        assert str(e).startswith((f"invalid {msg.get('type')!r} message: field ", *unknown))
        return
    assert model.type == msg["type"]
    assert json.loads(model.model_dump_json())["type"] == msg["type"]  # what was accepted is plain JSON again


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "d.sock"
    lock = acquire(path)
    srv = RankServer(make_state(path, fingerprint(), weights()), path, limits=Limits(idle_timeout_s=5.0))
    srv.bind()
    errors: list[BaseException] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv, errors
    finally:
        threading.excepthook = old_hook
        srv.close()
        import os

        os.close(lock)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames, min_size=1, max_size=5))
def test_the_daemon_answers_every_frame_with_a_valid_reply_and_keeps_serving(daemon, sent):
    srv, errors = daemon
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(10)
    c.connect(str(srv.path))
    replies_got = []
    try:
        try:
            c.sendall(b"".join(sent))
            c.shutdown(socket.SHUT_WR)  # whatever is incomplete ends here (the daemon sees EOF mid-frame)
        except OSError:
            pass  # the daemon closed after a bad frame while we were still sending
        while True:
            try:
                reply, fds = protocol.recv(c)
            except (protocol.ProtocolError, ConnectionResetError):
                break  # the daemon closed the connection
            protocol.close_fds(fds)
            parse_reply(reply)  # every reply is a valid message of the schema
            replies_got.append(reply["type"])
    finally:
        c.close()
    assert len(replies_got) <= len(sent)
    assert set(replies_got) <= {"error", "status", "manifest", "attached", "released"}
    st_now = status_of(str(srv.path), timeout_s=5)
    assert st_now is not None and st_now.state in ("ready", "released")
    assert errors == []
