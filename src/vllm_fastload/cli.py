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
    args = p.parse_args(argv)
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
        except FastloadError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(out, indent=2))
        return 0
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
