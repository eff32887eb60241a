"""Entry point: ``python -m benchmarks`` lists the benchmarks, ``python -m benchmarks NAME ARGS...``
runs one (``ARGS`` are that benchmark's own; ``python -m benchmarks NAME --help`` lists them)."""

from __future__ import annotations

import sys

from benchmarks import BENCHMARKS, run


def main(argv: list[str] | None = None) -> int:
    """List the benchmarks (no arguments, ``list``, ``-h``/``--help``) or run the one named first."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("list", "-h", "--help"):
        print("usage: python -m benchmarks NAME [ARGS...]  (python -m benchmarks NAME --help)")
        for name, text in BENCHMARKS.items():
            print(f"  {name:8s} {text}")
        return 0
    if args[0] not in BENCHMARKS:
        print(f"python -m benchmarks: unknown benchmark {args[0]!r}; one of {', '.join(BENCHMARKS)}",
              file=sys.stderr)
        return 2
    return run(args[0], args[1:])


if __name__ == "__main__":
    sys.exit(main())
