"""The ``vllm-fastload`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__


def console() -> int:
    """The ``vllm-fastload`` console script and ``python -m vllm_fastload.cli``: :func:`main` on ``sys.argv``, in a
    process that is this command. Returns the exit code. After ``preload`` the process is made to end within
    ``EXIT_GRACE_S`` of the daemon's return, with the daemon's status
    (:func:`vllm_fastload.ipc.daemon.main.exit_within`), whether it returned, raised or called ``sys.exit``. Only
    here: a caller of :func:`main` in its own process (a wrapper, a test) is never ended by a timer."""
    if sys.argv[1:2] != ["preload"]:
        return main()
    from .ipc.daemon.main import EXIT_GRACE_S, ending_within

    return ending_within(EXIT_GRACE_S, main)


def main(argv: list[str] | None = None) -> int:
    """The ``vllm-fastload`` command on ``argv`` (default ``sys.argv[1:]``). Returns the exit code."""
    p = _parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # a bare `vllm-fastload`: what it can do, not argparse's "arguments are required"
        p.print_help()
        return 2
    if argv[0] == "preload":  # the daemon parses its own flags and vLLM's engine args
        return _preload(argv[1:])
    args, rest = p.parse_known_args(argv)
    if rest and args.cmd != "inspect":
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest and args.no_fingerprint:  # inspect reads engine args only for the fingerprint: a typo would go unseen
        p.error(f"unrecognized arguments: {' '.join(rest)} (with --no-fingerprint no engine args are read)")
    if args.cmd == "inspect":
        return _inspect(args, rest)
    if args.cmd == "status":
        from .errors import FastloadError

        try:
            return _status(args)
        except FastloadError as e:
            print(f"vllm-fastload status: error: {e}", file=sys.stderr)
            return 2
    if args.cmd == "build-demo-model":
        from .demo_model import build_model
        from .errors import FastloadError

        try:
            print(build_model(args.out))
        except (FastloadError, OSError) as e:
            print(f"vllm-fastload build-demo-model: error: {e}", file=sys.stderr)
            return 2
        return 0
    return 1


def _parser() -> argparse.ArgumentParser:
    """The parser of every subcommand but ``preload``'s own arguments."""
    p = argparse.ArgumentParser(prog="vllm-fastload", description="Fast vLLM start and restart (model-loader plugin).")
    p.add_argument("--version", action="version", version=f"vllm-fastload {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-demo-model", help="build the embedded SmolLM2-135M-Instruct bf16 safetensors (cached)")
    b.add_argument("out", nargs="?", help="output directory (default: ~/.cache/vllm-fastload/smollm2-135m-instruct)")
    ins = sub.add_parser("inspect", help="shards, problems, tuning and fingerprint of a checkpoint (dir or s3://)",
                         epilog="Any further arguments are vLLM engine args (e.g. --dtype float32): the "
                                "fingerprint is computed as an engine with those args would compute it. Exit codes: "
                                "0 fine; 1 a problem (nothing to load at the source, a shard, or engine args vLLM "
                                "refuses); 2 cannot inspect (the source cannot be listed or read).")
    ins.add_argument("source", help="the model directory, or an s3:// / gs:// / az:// prefix")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.add_argument("--no-fingerprint", action="store_true",
                     help="skip the fingerprint: no vLLM import, no engine-arg parsing (well under a second)")
    ins.add_argument("--content-digest", action="store_true",
                     help="read every tensor and print the checkpoint's BLAKE3 content digest (local checkpoints), "
                          "the value \"expected_content_digest\" pins")
    sub.add_parser("preload", help="start the preload daemon(s): `vllm-fastload preload MODEL <vllm serve args>`",
                   add_help=False)
    st = sub.add_parser("status", help="list the preload daemons in a socket dir",
                        epilog="Exit codes: 0 daemons listed; 1 no daemon in the socket dir; 2 the socket dir cannot "
                               "be used (the message says why and how to fix it).")
    st.add_argument("--weight-cache-socket-dir", default=None,
                    help="the daemons' socket directory (default: the daemon's default, "
                         "$XDG_RUNTIME_DIR/vllm-fastload or /tmp/vllm-fastload-<uid>)")
    st.add_argument("--json", action="store_true")
    return p


def _preload(rest: list[str]) -> int:
    """``vllm-fastload preload [MODEL] <args>``: check the model argument, then run the daemon
    (:func:`vllm_fastload.ipc.daemon.main.main`). Returns the exit code (2 with one line for a missing model)."""
    from .errors import FastloadError
    from .ipc.daemon.main import main as preload_main

    if rest and not rest[0].startswith("-"):  # `preload MODEL ...`, as `vllm serve MODEL ...` takes it
        rest = ["--model", rest[0], *rest[1:]]
    if any(a in ("-h", "--help") for a in rest):  # the daemon's own flags first, without importing vLLM
        return _preload_help()
    asks_help = any(a.split("=", 1)[0] in ("-h", "--help") for a in rest)
    model = _model_arg(rest)
    if not asks_help and model is not None and (model.startswith(("/", "./", "../", "~")) and
                                                not os.path.isdir(os.path.expanduser(model))):
        print(f"vllm-fastload preload: error: model directory {model} does not exist (or is not a directory): "
              f"pass the directory holding config.json and the *.safetensors", file=sys.stderr)
        return 2
    if not asks_help and not model:
        # vLLM would pick its default model and try to download it from the hub
        print("vllm-fastload preload: error: no model: pass it first (`vllm-fastload preload /models/llama ...`) "
              "or as --model, with the engine args the engine will use", file=sys.stderr)
        return 2
    try:
        return preload_main(rest)
    except FastloadError as e:
        print(f"vllm-fastload preload: error: {e}", file=sys.stderr)
        return 2


def _inspect(args: argparse.Namespace, engine_args: list[str]) -> int:
    """``vllm-fastload inspect``: print the report; 0 fine, 1 a problem, 2 cannot inspect (the reason on stderr)."""
    if not args.source.strip():
        print("vllm-fastload inspect: error: the source is empty: pass a model directory or an s3:// / gs:// / "
              "az:// prefix", file=sys.stderr)
        return 2
    # vLLM's INFO lines (engine config) would land in the middle of the report on stdout; warnings still
    # reach stderr through logging's last-resort handler
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from .errors import FastloadError
    from .inspect import inspect, render

    try:
        rep = inspect(args.source, engine_args, with_fingerprint=not args.no_fingerprint,
                      content_digest=args.content_digest)
    except (FastloadError, OSError) as e:
        print(f"vllm-fastload inspect: error: {e}", file=sys.stderr)
        if args.json:  # a script reading stdout gets the reason too, not an empty document
            print(json.dumps({"source": args.source, "error": str(e)}, indent=2))
        return 2
    print(json.dumps(rep, indent=2) if args.json else render(rep))
    return 1 if rep["problems"] else 0


def _model_arg(argv: list[str]) -> str | None:
    """The value of ``--model`` in ``argv`` (``""`` when given empty), or None when absent."""
    for i, a in enumerate(argv):
        if a == "--model":
            return argv[i + 1] if i + 1 < len(argv) else ""
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    return None


def _preload_help() -> int:
    """``vllm-fastload preload --help``: the daemon's own flags, then where the engine args are listed."""
    from .ipc.daemon.main import add_daemon_flags

    p = argparse.ArgumentParser(
        prog="vllm-fastload preload", usage="vllm-fastload preload MODEL [vllm serve engine args] [daemon flags]",
        description="Keep post-processed weights resident for --load-format ipc_cache: one daemon per GPU rank, "
                    "loaded once, mapped by every engine started with the same weight-changing engine args "
                    "(model, --dtype, --tensor-parallel-size, --quantization, --revision, --kv-cache-dtype).",
        epilog="Every other flag is a vLLM engine arg, as `vllm serve` takes it: `vllm-fastload preload --help=all` "
               "lists them (vLLM's own help; --help=<group or flag> for one).")
    add_daemon_flags(p.add_argument_group("daemon flags"))
    p.print_help()
    return 0


def _status(args: argparse.Namespace) -> int:
    import os
    import stat

    from .ipc.wire.client import probe_status
    from .ipc.wire.paths import SocketDir, file_kind, socket_dir_spec

    spec = socket_dir_spec(args.weight_cache_socket_dir)
    try:
        with SocketDir.open(spec) as sd:
            names = sorted(n for n in os.listdir(sd.fd) if n.endswith(".sock"))
            # a file, folder or link named *.sock is nobody's socket: said so, not asked
            odd = {n: st for n in names if (st := sd.lstat(n)) is not None and not stat.S_ISSOCK(st.st_mode)}
    except FileNotFoundError:
        names, odd = [], {}
    d = spec.path
    # (socket, its status reply or None, why None)
    rows = [(str(d / n), None, f"not a socket (a {file_kind(odd[n].st_mode)})") if n in odd
            else (str(d / n), *probe_status(str(d / n))) for n in names]
    if args.json:
        print(json.dumps([st.model_dump() if st else {"socket": sock, "state": why} for sock, st, why in rows],
                         indent=2))
        return 0 if any(st for _, st, _ in rows) else 1  # the same exit codes as the text form
    if not rows:
        print(f"no preload daemons in {d}" + ("" if d.exists() else " (the directory does not exist)"))
        return 1
    for sock, st, why in rows:
        if st is None:
            print(f"{sock}: {why}")
            continue
        print(f"{st.device}: {st.state}, model {st.model}, fingerprint {st.fingerprint_short}, {st.tensors} tensors, "
              f"{st.bytes / 2**30:.2f} GiB, {st.clients} client(s) {st.client_modes}, uptime {st.uptime_s:.0f} s, "
              f"socket {st.socket}" + (f", content {st.content_digest}" if st.content_digest else ""))
    return 0 if any(st for _, st, _ in rows) else 1  # only stale sockets: no daemon found


if __name__ == "__main__":
    raise SystemExit(console())
