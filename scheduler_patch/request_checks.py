"""Prompts the model cannot run are refused with HTTP 400 before they reach the scheduler, DSPARK on or off.

On this CPU, SGLang 0.5.23 lets an empty prompt (0 tokens reach the rotary embedding) and a token id outside the
vocabulary (embedding lookup) end the scheduler, and with it the server. Patch `dspark.prompt_ids` extends the
tokenizer's per-request validation, whose ValueError SGLang answers with 400 and one line. Must not decide any
other refusal (SGLang's own checks and the worker's sampling refusals, runtime/worker.py, stay where they are).
"""

from collections.abc import Sequence

from scheduler_patch.patches import Patch, source_lacks

TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
# Upstream source the patch relies on, whitespace-normalised: both tokenizing paths (one request, a batch) validate
# each request's final input_ids here, and the tokenizer knows the model's vocabulary size.
VALIDATED = {f"{TOKENIZER}._tokenize_one_request": ("self._validate_one_request(obj, input_ids)",),
             f"{TOKENIZER}._batch_tokenize_and_process": ("self._validate_one_request(obj[i], input_ids_list[i])",),
             f"{TOKENIZER}._validate_token_ids_logprob": ("vocab_size = self.model_config.vocab_size",)}


def prompt_problem(input_ids: Sequence[int], vocab_size: int) -> str | None:
    """Why the model cannot run these prompt tokens (one line), or None.

    >>> prompt_problem([], 100)
    'the prompt is empty (0 tokens); send at least one token'
    >>> prompt_problem([1, 2, 100], 100)
    'input_ids[2] = 100 is not a token id of this model (vocabulary [0, 100))'
    >>> prompt_problem([0, 99], 100) is None
    True
    """
    if len(input_ids) == 0:
        return "the prompt is empty (0 tokens); send at least one token"
    for i, token in enumerate(input_ids):
        if not 0 <= token < vocab_size:
            return f"input_ids[{i}] = {token} is not a token id of this model (vocabulary [0, {vocab_size}))"
    return None


def _validate_one_request(original, self, obj, input_ids):
    # input_embeds replace the ids; a multimodal prompt carries placeholder ids that are not vocabulary tokens.
    if input_ids is not None and obj.input_embeds is None and not obj.contains_mm_input():
        problem = prompt_problem(input_ids, self.model_config.vocab_size)
        if problem:
            raise ValueError(problem)
    return original(self, obj, input_ids)


def _prompts_are_validated_here() -> str | None:
    return next(filter(None, (source_lacks(target, snippets) for target, snippets in VALIDATED.items())), None)


PROMPT_IDS = Patch("dspark.prompt_ids", f"{TOKENIZER}._validate_one_request", "method", ("self", "obj", "input_ids"),
                   _validate_one_request, requires=_prompts_are_validated_here)
PATCHES = (PROMPT_IDS,)
