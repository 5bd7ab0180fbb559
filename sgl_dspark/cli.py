"""How this package's commands fail: one line on stderr naming the cause, exit status 1 (never a traceback for a
bad input). Owns only that convention; each command keeps its own arguments and work."""

import sys
from collections.abc import Callable


def run(prog: str, body: Callable[[], object], errors: tuple[type[BaseException], ...] = (ValueError, OSError)) -> int:
    """Run `body`; 0 when it returns, 1 with `prog: error: <cause>` on stderr when it raises one of `errors`, 130
    with `prog: interrupted` on Ctrl-C."""
    try:
        body()
    except errors as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what was kept stays (the long commands resume from it)
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0
