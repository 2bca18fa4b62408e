"""The ``vllm-fastload`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vllm-fastload`` console script. Returns the process exit code."""
    p = argparse.ArgumentParser(prog="vllm-fastload", description="Fast vLLM start and restart (model-loader plugin).")
    p.add_argument("--version", action="version", version=f"vllm-fastload {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-demo-model", help="build the embedded SmolLM2-135M-Instruct bf16 safetensors (cached)")
    b.add_argument("out", nargs="?", help="output directory (default: ~/.cache/vllm-fastload/smollm2-135m-instruct)")
    h = sub.add_parser("headers", help="validate the safetensors headers of a directory or s3:// prefix")
    h.add_argument("source")
    sub.add_parser("preload", help="start the preload daemon(s): `vllm-fastload preload <vllm serve args>`",
                   add_help=False)
    st = sub.add_parser("status", help="list the preload daemons in a socket dir")
    st.add_argument("--weight-cache-socket-dir", default=None)
    st.add_argument("--json", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "preload":
        from .errors import FastloadError
        from .ipc.daemon import main as preload_main

        try:
            return preload_main(argv[1:])
        except FastloadError as e:
            print(f"vllm-fastload preload: error: {e}", file=sys.stderr)
            return 2
    args = p.parse_args(argv)
    if args.cmd == "status":
        from .errors import FastloadError

        try:
            return _status(args)
        except FastloadError as e:
            print(f"vllm-fastload status: error: {e}", file=sys.stderr)
            return 2
    if args.cmd == "build-demo-model":
        from .demo_model import build_model

        print(build_model(args.out))
        return 0
    if args.cmd == "headers":
        from .checkpoint import read_header, select_shards
        from .errors import FastloadError

        try:
            plan = select_shards(args.source)
            out = []
            for f in plan.files:
                hd = read_header(f)
                big = hd.largest
                out.append({"file": f, "tensors": len(hd.tensors), "bytes": hd.data_bytes,
                            "largest": big.name if big else None, "header_sha256": hd.header_sha256})
        except (FastloadError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(out, indent=2))
        return 0
    return 1



def _status(args: argparse.Namespace) -> int:
    from .ipc.client import status_of
    from .ipc.paths import ensure_socket_dir

    d = ensure_socket_dir(args.weight_cache_socket_dir, create=False)
    rows = []
    for sock in sorted(d.glob("*.sock")) if d.exists() else []:
        st = status_of(str(sock))
        rows.append(st or {"socket": str(sock), "state": "not answering (stale socket?)"})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no preload daemons in {d}")
        return 1
    for r in rows:
        if "device" not in r:
            print(f"{r['socket']}: {r['state']}")
            continue
        print(f"{r['device']}: {r['state']}, model {r['model']}, fingerprint {r['fingerprint_short']}, "
              f"{r['tensors']} tensors, {r['bytes'] / 2**30:.2f} GiB, {r['clients']} client(s) {r['client_modes']}, "
              f"uptime {r['uptime_s']:.0f} s, socket {r['socket']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
