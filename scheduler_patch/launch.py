"""The launch plan of a DSPARK run and the name DSPARK: what the main process decided, carried on the ServerArgs
record into every process (`_dspark_launch`, pickled with the record).

server_args.py builds the plan; the spec object (algorithm.py) and the worker (runtime/worker.py) read it with
`launch_of`. Imports nothing else of the seam (so neither reader closes an import loop); must not resolve anything.
"""

import dataclasses
from typing import Any

from sgl_dspark.config import DSparkConfig

NAME = "DSPARK"  # the --speculative-algorithm name this plugin serves (any case)
LAUNCH_ATTR = "_dspark_launch"


@dataclasses.dataclass(frozen=True)
class DSparkLaunch:
    """What the main process decided for a DSPARK run; rides on the ServerArgs record into every process."""

    config: DSparkConfig
    draft_nodes: int  # most draft nodes one request verifies per step, anchor excluded
    attention_backend: str | None  # declared by the plugin; None: the user's explicit choice stands

    @property
    def verify_tokens(self) -> int:
        """Tokens per request in one verify step: the anchor plus the draft nodes (SGLang's num_draft_tokens)."""
        return 1 + self.draft_nodes

    def server_fields(self) -> dict[str, Any]:
        """The ServerArgs fields DSPARK sets. steps=topk=1 keeps SGLang's per-decode KV reserve at
        max(steps * topk, num_draft_tokens) = verify_tokens (has_draft_kv is False: no draft KV in SGLang's pool)."""
        fields = {"speculative_algorithm": NAME, "disable_overlap_schedule": True,
                  "speculative_num_draft_tokens": self.verify_tokens, "speculative_num_steps": 1,
                  "speculative_eagle_topk": 1, "enable_mixed_chunk": False}
        if self.attention_backend is not None:
            fields["attention_backend"] = self.attention_backend
        return fields


def launch_of(server_args: Any) -> DSparkLaunch:
    """The plan `prepare` attached (works on the record, a resolving view, or SGLang's plugin recorder)."""
    launch = getattr(server_args, LAUNCH_ATTR, None)
    if not isinstance(launch, DSparkLaunch):
        raise RuntimeError("sgl-dspark: these server args carry no DSpark launch plan (resolved without the "
                           "plugin's dspark.resolve patch?)")
    return launch
