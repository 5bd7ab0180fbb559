"""The launch record of a DSPARK run and the name DSPARK: everything the main process resolved, carried on the
ServerArgs record into every process (`_dspark_launch`, pickled with the record).

server_args.py reads the files (drafter config.json, calibration, cost table) and builds the record with
`DSparkLaunch.of`; the spec object (algorithm.py), the worker and its setup (runtime/) read it with `launch_of`
and derive nothing again. Imports nothing else of the seam (so no reader closes an import loop); reads no files.
"""

import dataclasses
from typing import Any

from sgl_dspark.config import DSparkKnobs
from sgl_dspark.cost import StepCostTable
from sgl_dspark.drafter.config import DrafterConfig
from sgl_dspark.drafter.knobs import DraftKnobs
from sgl_dspark.lookup import LookupKnobs

NAME = "DSPARK"  # the --speculative-algorithm name this plugin serves (any case)
LAUNCH_ATTR = "_dspark_launch"


@dataclasses.dataclass(frozen=True)
class DSparkLaunch:
    """What the main process resolved for a DSPARK run, once; rides on the ServerArgs record into every process."""

    config: DSparkKnobs
    drafter_path: str  # the drafter checkpoint folder (--speculative-draft-model-path)
    drafter: DrafterConfig = dataclasses.field(repr=False)  # its config.json, checked against the target
    draft_knobs: DraftKnobs = dataclasses.field(repr=False)  # the drafter's share of the knobs, with its calibration
    lookup: LookupKnobs | None = dataclasses.field(repr=False)  # the lookup branch's knobs; None: lookup off
    draft_nodes: int  # most draft nodes one request verifies per step, anchor excluded
    cost_table: StepCostTable | None = dataclasses.field(repr=False)  # the cost_table knob's; None: profile one
    attention_backend: str | None  # declared by the plugin; None: the user's explicit choice stands
    device: str = "cpu"  # where the target runs (cpu or cuda)

    @classmethod
    def of(cls, config: DSparkKnobs, drafter_path: str, drafter: DrafterConfig, attention_backend: str | None,
           calibration: tuple[tuple[float, ...], tuple[float, ...]] = ((), ()),
           cost_table: StepCostTable | None = None, device: str = "cpu") -> "DSparkLaunch":
        """The record from what was read; the verify width is computed here, once (DSparkKnobs.verify_nodes).
        ValueError if the knobs do not fit the drafter's gamma."""
        lookup = config.lookup_knobs() if config.lookup and config.drafts else None  # max_verify 0: none verified
        return cls(config, drafter_path, drafter, config.draft_knobs(*calibration), lookup,
                   config.verify_nodes(drafter.gamma), cost_table, attention_backend, device)

    @property
    def verify_tokens(self) -> int:
        """Tokens per request in one verify step: the anchor plus the draft nodes (SGLang's num_draft_tokens)."""
        return 1 + self.draft_nodes

    def server_fields(self) -> dict[str, Any]:
        """The ServerArgs fields DSPARK sets. steps=topk=1 keeps SGLang's per-decode KV reserve at
        max(steps * topk, num_draft_tokens) = verify_tokens (has_draft_kv is False: no draft KV in SGLang's pool).
        Off the CPU the decode phase runs without device graphs: SGLang's graph runner captures TARGET_VERIFY with
        its own spec info, which this step's verify batch (its width and tree mask change every step) is not."""
        fields = {"speculative_algorithm": NAME, "disable_overlap_schedule": True,
                  "speculative_num_draft_tokens": self.verify_tokens, "speculative_num_steps": 1,
                  "speculative_eagle_topk": 1, "enable_mixed_chunk": False}
        if self.attention_backend is not None:
            fields["attention_backend"] = self.attention_backend
        if self.device != "cpu":
            fields["cuda_graph_backend_decode"] = "disabled"
        return fields


def launch_of(server_args: Any) -> DSparkLaunch:
    """The record `prepare` attached (works on the record, a resolving view, or SGLang's plugin recorder)."""
    launch = getattr(server_args, LAUNCH_ATTR, None)
    if not isinstance(launch, DSparkLaunch):
        raise RuntimeError("sgl-dspark: these server args carry no DSpark launch plan (resolved without the "
                           "plugin's dspark.resolve patch?)")
    return launch
