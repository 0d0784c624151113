"""Regenerate the committed stubs from loraplex.proto: ``python -m loraplex.proto.generate``.

protoc writes ``import loraplex_pb2`` into the gRPC stub, which only works with proto/ on
sys.path; the stub is rewritten to a package-relative import so it loads as
``loraplex.proto.loraplex_pb2_grpc``. protoc also names the messages' module
``'loraplex_pb2'`` (their ``__module__``), which pickle cannot import (Ray Serve's gRPC proxy
pickles every request): the message stub is rewritten to declare its real module name,
``__name__`` (``loraplex.proto.loraplex_pb2``). tests/test_proto_stubs.py regenerates into a temp
dir and fails when the result differs from the committed files.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "loraplex.proto"
STUBS = ("loraplex_pb2.py", "loraplex_pb2.pyi", "loraplex_pb2_grpc.py")
_ABSOLUTE_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)
_MODULE_NAME = re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'\w+_pb2'")


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc (grpcio-tools) on loraplex.proto into ``out_dir``; the written stub paths."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", PROTO_FILE]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR / PROTO_FILE}")
    grpc_stub = out_dir / "loraplex_pb2_grpc.py"
    grpc_stub.write_text(_ABSOLUTE_IMPORT.sub(r"from . import \1 as \2", grpc_stub.read_text()))
    messages = out_dir / "loraplex_pb2.py"
    text, count = _MODULE_NAME.subn(r"\1__name__", messages.read_text())
    if count != 1:
        raise RuntimeError(f"{messages}: the module name to rewrite was not found once")
    messages.write_text(text)
    return [out_dir / name for name in STUBS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output dir (default: proto/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
