"""Start-up refusals: `StartupError` and the one line the user sees when it ends the launcher.

SGLang lets an exception from server-argument resolution end `launch_server` / `sglang serve` with a traceback.
The `dspark.excepthook` patch prints `sgl-dspark: error: <cause>` instead (exit status 1) when the uncaught
exception is a StartupError; any other exception goes to the previous hook unchanged. In-process users (Engine)
still get the exception. Must not decide what is refused; server_args.py does.
"""

import sys

from scheduler_patch.patches import Patch

PREFIX = "sgl-dspark: error: "


class StartupError(ValueError):
    """A one-line, user-facing reason why a DSPARK launch is refused (the message names the flag or field)."""


def user_line(error: BaseException) -> str:
    return PREFIX + " ".join(str(error).split())


def _excepthook(original, exc_type, exc, tb):
    if isinstance(exc, StartupError):
        print(user_line(exc), file=sys.stderr, flush=True)
        return None
    return original(exc_type, exc, tb)


# params unchecked: other tools (apport, IPython) install hooks with their own parameter names.
EXCEPTHOOK = Patch("dspark.excepthook", "sys.excepthook", "function", None, _excepthook)
PATCHES = (EXCEPTHOOK,)
