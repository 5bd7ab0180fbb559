"""Patches: the target's linear layers and LM head on oneDNN packed weights (CPU), inside SGLang's own layers.

`pack_target` keeps each plain float linear layer's weight (and the LM head's) packed on the layer (`_dspark_packed`,
sgl_dspark.packed_gemm); patch `dspark.packed_linear` runs SGLang's UnquantizedLinearMethod.apply of such a layer on
it, and `dspark.packed_lm_head` runs LogitsProcessor._compute_lm_head of such a head on it. The LM head's table,
which a tied embedding also looks rows up in, can be read from the packed copy instead (`_dspark_rows`,
sgl_dspark.packed_gemm.PackedRows: the same values, one copy of the table instead of two); patch
`dspark.packed_embedding` runs UnquantizedEmbeddingMethod.embedding of such a layer on it. A layer without packed
weights runs SGLang's code unchanged. The worker applies them at start-up, only for --speculative-dspark-cpu-gemm
onednn on CPU (all checked before any is applied: SGLang drift stops start-up naming the symbol). Must not change
which rows are computed (only the GEMM kernel).
"""

import pkgutil
from dataclasses import dataclass

from torch import nn

from sgl_dspark.packed_gemm import KernelTimes, is_float_cpu, pack, packed_linear, packed_rows, time_kernels

from scheduler_patch.patches import Patch, apply_all, source_lacks

UNQUANT = "sglang.srt.layers.quantization.unquant"
LINEAR = "sglang.srt.layers.linear"
LOGITS = "sglang.srt.layers.logits_processor.LogitsProcessor"
TIMED_BYTES = 256 * 2**20  # weights `pack_target` times the kernels on (then scaled to all)
PACKED = "_dspark_packed"  # the packed weight, a plain attribute of the layer (not a parameter or buffer)
ROWS = "_dspark_rows"  # the head's table read from its packed copy (PackedRows), where its own table was released
# Upstream source the patches rely on, whitespace-normalised: SGLang's linear layers compute through their quant
# method's apply, and the LM head's product is its quant method's apply (the call the packed head replaces).
LINEAR_ROUTES = {
    f"{LINEAR}.ReplicatedLinear.forward": ("output = self.quant_method.apply(self, x, bias)",),
    f"{LINEAR}.ColumnParallelLinear.forward": ("self.quant_method.apply(self, input_, bias)",),
    f"{LINEAR}.RowParallelLinear.forward": ("self.quant_method.apply( self, input_parallel, bias=bias_ )",),
}
LM_HEAD_ROUTE = ("logits = quant_method.apply(lm_head, hidden_states, embedding_bias)",)
EMBEDDING_ROUTE = ("return F.embedding(input_, layer.weight)",)


@dataclass(frozen=True)
class PackReport:
    layers: int  # modules now running on packed weights
    freed_bytes: int  # original weights released (linear layers; an embedding keeps its table)
    added_bytes: int  # packed copies kept beside an original that is still needed (the tied LM head)
    shared_bytes: int = 0  # the head's table, released and read from its packed copy instead (`rows_from_copy`)
    kernels: KernelTimes | None = None  # plain's kernel against the packed one on these weights (when timed)


def pack_target(model: nn.Module, lm_head: nn.Module | None, time_rows: tuple[int, ...] = (),
                rows_from_copy: bool = False) -> PackReport:
    """Apply the patches, then pack every plain float linear layer of `model` (and `lm_head`, when given). Linear
    layers drop their original weight; the LM head keeps its table (it may be the tied embedding, which looks
    rows up), or with `rows_from_copy` reads its rows from the packed copy where that reproduces the table, and
    releases the table. Only layers whose quant method is exactly SGLang's unquantized one are packed.
    With `time_rows`, plain's kernel and the packed one are timed at those row counts on the first TIMED_BYTES of
    weights (more than any CPU cache holds, so both stream from memory as a forward does; their originals are
    dropped once timed) and scaled to all of them."""
    apply_all(PATCHES)
    linear, embedding = (pkgutil.resolve_name(f"{UNQUANT}.{name}")
                         for name in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"))
    layers, freed, added, shared, timed, timed_bytes = 0, 0, 0, 0, [], 0
    for module in model.modules():
        method, weight = getattr(module, "quant_method", None), getattr(module, "weight", None)
        is_head = type(method) is embedding and module is lm_head  # another embedding only looks rows up
        if not (type(method) is linear or is_head) or not is_float_cpu(weight):
            continue
        vars(module)[PACKED] = pack(weight)
        layers += 1
        size = weight.numel() * weight.element_size()
        if is_head and rows_from_copy and (table := packed_rows(weight, vars(module)[PACKED])) is not None:
            vars(module)[ROWS] = table
            shared += size
        elif is_head:
            added += size
        else:
            freed += size
        if time_rows and timed_bytes < TIMED_BYTES:
            timed.append((module, is_head))
            timed_bytes += size
        else:
            drop_original(module, is_head)
    kernels = None
    if timed:
        kernels = time_kernels([(m.weight, vars(m)[PACKED]) for m, _ in timed], time_rows)
        kernels = kernels.scaled((freed + added + shared) / timed_bytes)
        for module, is_head in timed:
            drop_original(module, is_head)
    return PackReport(layers, freed, added, shared, kernels)


def drop_original(module: nn.Module, is_head: bool) -> None:
    """A packed linear layer's original weight is released; the LM head keeps its table (it may be the tied
    embedding, which looks rows up) unless its rows are read from the packed copy."""
    if not is_head or ROWS in vars(module):
        module.weight.data = module.weight.data.new_empty(0)


def _packed_linear(original, self, layer, x, bias=None):
    packed = vars(layer).get(PACKED)
    if packed is None:
        return original(self, layer, x, bias)
    return packed_linear(x, packed, bias)


def _packed_lm_head(original, self, hidden_states, lm_head, embedding_bias=None, **kwargs):
    packed = vars(lm_head).get(PACKED)
    if packed is None:
        return original(self, hidden_states, lm_head, embedding_bias, **kwargs)
    return packed_linear(hidden_states, packed, embedding_bias)


def _packed_embedding(original, self, layer, input_):
    table = vars(layer).get(ROWS)
    if table is None:
        return original(self, layer, input_)
    return table[input_]


def _linear_layers_route_through_apply() -> str | None:
    return next(filter(None, (source_lacks(target, snippets) for target, snippets in LINEAR_ROUTES.items())), None)


def _lm_head_routes_through_apply() -> str | None:
    return source_lacks(f"{LOGITS}._compute_lm_head", LM_HEAD_ROUTE)


def _embedding_looks_rows_up() -> str | None:
    return source_lacks(f"{UNQUANT}.UnquantizedEmbeddingMethod.embedding", EMBEDDING_ROUTE)


PACKED_LINEAR = Patch("dspark.packed_linear", f"{UNQUANT}.UnquantizedLinearMethod.apply", "method",
                      ("self", "layer", "x", "bias"), _packed_linear, requires=_linear_layers_route_through_apply)
PACKED_LM_HEAD = Patch("dspark.packed_lm_head", f"{LOGITS}._compute_lm_head", "method",
                       ("self", "hidden_states", "lm_head", "embedding_bias", "out"), _packed_lm_head,
                       requires=_lm_head_routes_through_apply)
PACKED_EMBEDDING = Patch("dspark.packed_embedding", f"{UNQUANT}.UnquantizedEmbeddingMethod.embedding", "method",
                         ("self", "layer", "input_"), _packed_embedding, requires=_embedding_looks_rows_up)
PATCHES = (PACKED_LINEAR, PACKED_LM_HEAD, PACKED_EMBEDDING)
