"""The DSpark drafter: config, model (parallel backbone + Markov/RNN + confidence heads), checkpoint I/O, drafting.

Flow: target features -> `DSparkDrafter.context_kv` (cacheable rows) -> `pad_contexts` -> `Proposer.propose`
(one parallel pass, then the sequential stage) -> one `DraftTree` per request. Pure torch; no SGLang imports.
"""

from sgl_dspark.drafter.checkpoint import load_drafter, read_drafter_config, save_drafter
from sgl_dspark.drafter.config import DrafterConfig, TargetSpec, check_fits_target, parse_drafter_config
from sgl_dspark.drafter.context import ContextKV, PaddedContext, pad_contexts
from sgl_dspark.drafter.knobs import DraftKnobs
from sgl_dspark.drafter.model import DSparkDrafter, TargetWeights
from sgl_dspark.drafter.propose import ProposeInput, ProposeOutput, Proposer

__all__ = ["ContextKV", "DSparkDrafter", "DraftKnobs", "DrafterConfig", "PaddedContext", "ProposeInput",
           "ProposeOutput", "Proposer", "TargetSpec", "TargetWeights", "check_fits_target", "load_drafter",
           "pad_contexts", "parse_drafter_config", "read_drafter_config", "save_drafter"]
