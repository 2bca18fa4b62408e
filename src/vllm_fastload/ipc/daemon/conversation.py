"""One engine's conversation with a rank's socket server (:class:`.server.RankServer` accepts, one thread per
connection runs a :class:`Conversation`): the peer check, every request validated (:mod:`.messages`) and fitted to
the conversation (attach after the manifest; release after a copy-mode attach), and what an attach or release does
to the rank's state."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ...log import logger
from ..wire import messages, protocol

if TYPE_CHECKING:
    from .rank import Limits, RankState, Throttle


@dataclass
class Client:
    """One connection's place in the conversation: who it is (``SO_PEERCRED``), whether it got the manifest, in
    which mode it attached and whether it released the cache (copy mode, at most once)."""

    cid: int
    pid: int
    uid: int
    got_manifest: bool = False
    mode: Optional[messages.Mode] = None
    released: bool = False


class Conversation:
    """One connection ``conn`` (connection id ``cid``) to the rank whose state is ``state``: ``limits`` (the
    timeouts), ``budget`` (the request bytes all connections may buffer at once), ``manifest_body`` (the encoded
    manifest frame of a manifest, made once by the server) and ``log`` (the server's throttled log). :meth:`run`
    serves it to its end."""

    def __init__(self, conn: socket.socket, cid: int, state: RankState, limits: Limits, budget: protocol.ByteBudget,
                 manifest_body: Callable[[messages.Manifest], bytes], log: Throttle):
        self.conn, self.state, self.limits = conn, state, limits
        self.client = Client(cid, -1, -1)
        self._budget, self._manifest_body, self._log = budget, manifest_body, log

    def run(self) -> None:
        """Check the peer's user, then answer frames until the conversation ends; the client is counted as
        detached and the connection closed on every way out (errors of this connection are logged, never raised:
        a bug handling one client must not take the daemon down)."""
        conn, c, st = self.conn, self.client, self.state
        try:
            c.pid, c.uid, _ = protocol.peer_credentials(conn)
            if c.uid not in (os.getuid(), 0):
                self._log("peer", logging.WARNING, "fastload: refused a connection from pid %d running as uid %d (not "
                          "the daemon's uid %d, nor root)", c.pid, c.uid, os.getuid())
                conn.settimeout(1.0)
                reply(conn, messages.Error(reason=f"peer uid {c.uid} is not the daemon's uid "
                                    f"{os.getuid()} (or root); run the engine as the same user as "
                                    f"`vllm-fastload preload`"))
                return
            while self._serve_one():
                pass
        except OSError as e:  # the client went away while we were sending (killed mid-transfer): not our failure
            logger.info("fastload: client %d disconnected while the daemon was sending to it (%s: %s); still serving",
                        c.cid, type(e).__name__, e)
        except Exception as e:  # noqa: BLE001 - a bug handling one client must not take the daemon down
            logger.exception("fastload: internal error serving client %d (pid %d); closed its connection", c.cid, c.pid)
            try:
                reply(conn, messages.Error(reason=f"internal error in the daemon ({type(e).__name__}: "
                                    f"{e}); see its log"))
            except OSError:
                pass
        finally:
            with st.lock:
                was = st.clients.pop(c.cid, None)
                left = len(st.clients)
            if was is not None:
                logger.info("fastload: client %d (pid %d, %s mode) detached; %d engine(s) attached", c.cid, c.pid, was,
                            left)
            conn.close()

    def _timeout_for(self) -> Optional[float]:
        """How long the daemon waits for this connection's next frame."""
        c = self.client
        if c.mode == "zero_copy":
            return None  # the connection is the lease: open as long as the engine maps the memory
        if c.got_manifest and c.mode is None:
            return self.limits.attach_timeout_s
        return self.limits.idle_timeout_s

    def _serve_one(self) -> bool:
        """Receive and answer one frame of client ``c``. Returns False when the connection is done."""
        conn, c = self.conn, self.client
        raw = self._receive()
        if raw is None:
            return False
        try:
            msg = messages.parse_request(raw)
        except messages.MessageError as e:
            self._log("invalid", logging.WARNING, "fastload: client %d (pid %d) sent an invalid message: %s",
                      c.cid, c.pid, e)
            reply(conn, messages.Error(reason=str(e)))
            return True
        if isinstance(msg, messages.Status):
            reply(conn, self.state.status())
        elif isinstance(msg, messages.Hello):
            if self._hello(msg):
                c.got_manifest = True
        elif isinstance(msg, messages.Attach):
            self._attach(msg)
        elif isinstance(msg, messages.Release):
            self._answer_release()
        else:  # bye
            return False
        return True

    def _receive(self) -> Optional[dict[str, Any]]:
        """The next frame of client ``c`` (fds it carried closed), or None when the connection is done: the client
        closed it, or sent no complete frame in time or a bad one (answered with an error frame, logged)."""
        conn, c = self.conn, self.client
        timeout = self._timeout_for()
        conn.settimeout(timeout)
        try:
            raw, fds = protocol.recv(conn, frame_timeout_s=self.limits.idle_timeout_s,
                                     limit=protocol.MAX_REQUEST_BYTES, budget=self._budget)
        except TimeoutError:
            what = "between the manifest and the attach (--weight-cache-attach-timeout-s)" if timeout == \
                self.limits.attach_timeout_s and c.got_manifest else "(--weight-cache-idle-timeout-s)"
            self._log("idle", logging.INFO, "fastload: closed client %d (pid %d): no complete frame within %g s %s",
                      c.cid, c.pid, timeout or self.limits.idle_timeout_s, what)
            conn.settimeout(1.0)
            reply(conn, messages.Error(reason=f"no complete frame within {timeout or self.limits.idle_timeout_s:g}"
                                 f" s {what}; closing the connection"))
            return None
        except protocol.PeerClosed:
            return None
        except protocol.ProtocolError as e:
            self._log("frame", logging.WARNING, "fastload: closed client %d (pid %d): %s", c.cid, c.pid, e)
            conn.settimeout(1.0)
            reply(conn, messages.Error(reason=f"bad frame: {e}; closing the connection"))
            return None
        protocol.close_fds(fds)
        return raw

    def _attach(self, msg: messages.Attach) -> None:
        """Answer client ``c``'s attach: counted in ``msg.mode`` after the manifest, at most once; else refused."""
        conn, c = self.conn, self.client
        if not c.got_manifest or c.mode is not None:
            why = "attach before this connection received the manifest (send hello first)" if not c.got_manifest \
                else f"this connection is already attached ({'released' if c.released else c.mode})"
            reply(conn, messages.Error(reason=f"attach refused: {why}"))
            return
        st = self.state
        c.mode = msg.mode
        with st.lock:
            st.clients[c.cid] = msg.mode
            st.attaches += 1
            n = len(st.clients)
        logger.info("fastload: client %d (pid %d, uid %d) attached in %s mode; %d engine(s) attached", c.cid, c.pid,
                    c.uid, msg.mode, n)
        reply(conn, messages.Attached(clients=n))

    def _answer_release(self) -> None:
        """Answer client ``c``'s release: only once, after a copy-mode attach (:meth:`_release`); else refused."""
        conn, c = self.conn, self.client
        if c.mode != "copy" or c.released:
            self._log("release", logging.WARNING, "fastload: refused a release from client %d (pid %d, uid %d): "
                      "only a connection that received the manifest and attached in copy mode may release",
                      c.cid, c.pid, c.uid)
            reply(conn, messages.Error(reason="release refused: only a connection that received "
                                 "the manifest and attached in copy mode may release the daemon's memory"))
            return
        reply(conn, messages.Released(freed=self._release()))
        c.released = True

    def _hello(self, msg: messages.Hello) -> bool:
        """Answer a valid hello with the manifest (True) or an error (False)."""
        from ...fingerprint import Fingerprint

        conn, st = self.conn, self.state
        if not st.ready.is_set():
            # at once, so the engine tells "busy loading" (wait up to its state_timeout_s) from "not answering"
            # (a stopped or hung daemon: nothing within its connect_timeout_s)
            reply(conn, st.status())
        st.ready.wait()  # an engine that connects while the daemon loads waits (bounded by its state_timeout_s)
        theirs = msg.to_fingerprint()
        mine = Fingerprint.from_dict(st.fingerprint)
        diff = mine.mismatched_fields(theirs)
        if diff:
            with st.lock:
                st.mismatches += 1
            logger.warning("fastload: refused client pid %s (it falls back to disk): fingerprint mismatch: %s",
                           msg.pid, mine.explain(theirs))
            reply(conn, messages.Error(reason="fingerprint mismatch: " + mine.explain(theirs),
                                 mismatched=[[n, a, b] for n, a, b in diff]))
            return False
        # Take what to send under the lock, send outside it: a client that stops reading must not block the
        # status, attach and hello of every other client.
        with st.lock:
            seg = st.segment
            fd = -1 if st.released or seg is None else os.dup(seg.fd)
            manifest = st.manifest
        if fd < 0:
            reply(conn, messages.Error(reason="the daemon's cache was released by a copy-mode "
                                 "client; restart `vllm-fastload preload` to fill it again"))
            return False
        try:
            protocol.send_body(conn, self._manifest_body(manifest), fds=[fd])
        finally:
            os.close(fd)
        return True

    def _release(self) -> bool:
        """The copy-mode client is done: free the segment unless a zero_copy client still maps it; logged."""
        c = self.client
        st = self.state
        with st.lock:
            st.clients.pop(c.cid, None)
            mapped = sum(m == "zero_copy" for m in st.clients.values())
            if mapped or st.segment is None:
                freed = False
            else:
                st.segment.close()
                st.segment = None
                st.released = True
                freed = True
        if freed:
            logger.warning("fastload: client %d (pid %d, uid %d, copy mode) released the cache: %.2f GiB freed; later "
                           "engines load from disk until the daemon is restarted", c.cid, c.pid, c.uid,
                           st.nbytes / 2**30)
        else:
            logger.info("fastload: client %d (pid %d, uid %d, copy mode) is done; the cache stays (%d zero_copy "
                        "client(s) map it)", c.cid, c.pid, c.uid, mapped)
        return freed


def reply(conn: socket.socket, message: Any, fds: Optional[list[int]] = None) -> None:
    """Send one reply model of :mod:`.messages` (with ``fds``)."""
    protocol.send(conn, messages.to_frame(message), fds)
