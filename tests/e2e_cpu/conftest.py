import pytest

from vllm_fastload.servers import VllmServer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def ids_of(srv):
    """Greedy ids (16 tokens) of every prompt in PROMPTS."""
    return [srv.greedy_ids(p) for p in PROMPTS]


def failed_startup_log(srv, exit_wait_s: float = 60) -> str:
    """The log of a server that must fail at start-up: it never becomes healthy and exits non-zero (its process
    waited for ``exit_wait_s`` once it stopped answering)."""
    assert srv.wait_ready() is False
    srv.proc.wait(exit_wait_s)
    assert srv.proc.returncode != 0
    return srv.log()


@pytest.fixture(scope="session")
def e2e_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e-logs")


def answer_of(srv) -> str:
    """The server's chat answer to the demo's question (``vllm_fastload.demo.QUESTION``), greedy, 32 tokens."""
    from vllm_fastload.demo import QUESTION

    return srv.chat(QUESTION)


@pytest.fixture(scope="session")
def reference(demo_model, e2e_logs):
    """vLLM's built-in default loader (load format auto), one server per session: ``{"ids": ids_of(...),
    "answer": answer_of(...)}``."""
    with VllmServer(str(demo_model), [], log_path=e2e_logs / "auto.log") as srv:
        assert srv.wait_ready(), srv.diagnosis()
        assert "fastload:" not in srv.log()
        return {"ids": ids_of(srv), "answer": answer_of(srv)}


@pytest.fixture(scope="session")
def reference_ids(reference):
    """Greedy ids from vLLM's built-in default loader (:func:`reference`)."""
    return reference["ids"]
