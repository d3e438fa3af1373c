"""`python -m router.tools <command>`: operator tools. Commands: parse (router/tools/parse.py)."""

import sys

from router.tools import parse

COMMANDS = {"parse": parse.main}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m router.tools {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
