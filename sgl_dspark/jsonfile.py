"""Reading the project's small JSON files (cost tables, calibrations) with one-line errors naming the file.

Owns only file -> parsed JSON; each caller validates its own fields.
"""

import json
from pathlib import Path
from typing import Any


def read_json(path: str | Path, what: str, missing_hint: str) -> Any:
    """Parsed JSON of `path`; FileNotFoundError / ValueError say "<what> <path>: ..." in one line."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path}: no such file ({missing_hint})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path}: not valid JSON ({e})") from None
