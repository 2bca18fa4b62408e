"""The `vllm-fastload` command line: what a bare call prints, and `preload MODEL` taking the model positionally."""

import pytest

from vllm_fastload import cli


def test_bare_command_lists_every_subcommand(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    for sub, words in (("build-demo-model", "SmolLM2"), ("inspect", "fingerprint"), ("preload", "daemon"),
                       ("status", "socket dir")):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(sub))
        assert words in line, line


def test_preload_takes_the_model_positionally(monkeypatch):
    seen = []
    import vllm_fastload.ipc.daemon as daemon

    monkeypatch.setattr(daemon, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["preload", "/models/llama", "--tensor-parallel-size", "2"]) == 0
    assert cli.main(["preload", "--model", "/models/llama"]) == 0
    assert seen == [["--model", "/models/llama", "--tensor-parallel-size", "2"], ["--model", "/models/llama"]]


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve"])
    assert e.value.code == 2 and "invalid choice: 'serve'" in capsys.readouterr().err


def test_status_exit_codes_are_the_same_with_json(tmp_path, capsys):
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    assert cli.main(["status", "--weight-cache-socket-dir", str(d)]) == 1
    assert cli.main(["status", "--weight-cache-socket-dir", str(d), "--json"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "[]"


def test_preload_without_a_model_refuses_in_one_line(capsys, monkeypatch):
    """Without a model vLLM would take its default one and try the hub five times: refuse before that."""
    import vllm_fastload.ipc.daemon as daemon

    monkeypatch.setattr(daemon, "main", lambda argv: pytest.fail("the daemon must not start"))
    assert cli.main(["preload", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["vllm-fastload preload: error: no model: pass it first (`vllm-fastload preload /models/llama ...`) "
                   "or as --model, with the engine args the engine will use"]


def test_preload_help_leads_with_the_daemon_flags(capsys):
    assert cli.main(["preload", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vllm-fastload preload MODEL")
    for flag in ("--weight-cache-socket-dir", "--weight-cache-health-port", "--weight-cache-max-connections"):
        assert flag in out
    assert "--help=all" in out and len(out.splitlines()) < 60


def test_preload_unknown_flag_is_a_short_error(capsys):
    pytest.importorskip("vllm")
    with pytest.raises(SystemExit) as e:
        cli.main(["preload", "/models/m", "--bogus-flag"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert err[-2:] == ["vllm-fastload preload: error: unrecognized arguments: --bogus-flag",
                        "(`vllm-fastload preload --help` lists the daemon's flags, `--help=all` vLLM's engine args)"]
    assert not any(line.startswith("usage:") for line in err)
