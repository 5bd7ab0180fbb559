"""`python -m sgl_dspark.training.trainer`: target + distillation data + shape preset -> a published-format drafter.

The target stays frozen; the drafter starts from the target's top layers (sgl_dspark.training.init), or with
--init-from from an exported drafter folder (a long run continued on another machine: its weights, and the steps,
minutes and curve its `training_state.json` and `curve.jsonl` record, so the curve goes on where it stopped), and
learns the paper's loss on random anchors. A time budget bounds the run; state is saved every few minutes and a
rerun with the same --out resumes. Held-out accepted length (tau) is measured along the way into OUT/curve.jsonl.
Owns the loop, checkpoints and the progress bar; the math lives in sgl_dspark.training.
"""

import os

# Threads wait passively: with other processes on these 2 cores, spinning OpenMP threads slow a step ~3x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KMP_BLOCKTIME", "0")

import argparse  # noqa: E402
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sgl_dspark import cli
from sgl_dspark.training.data import read_records
from sgl_dspark.training.export import STATE_FILE
from sgl_dspark.drafter.checkpoint import load_drafter, save_drafter
from sgl_dspark.drafter.config import TargetSpec
from sgl_dspark.drafter.model import DSparkDrafter, TargetWeights
from sgl_dspark.training.init import PRESETS, bigram_markov, copy_top_layers, frequent_tokens, new_drafter
from sgl_dspark.training.objective import (LossWeights, block_outputs, block_rows, draft_index, dspark_loss,
                                           sample_anchors, with_tokens)
from sgl_dspark.training.coverage import complement_scale, lookup_depths
from sgl_dspark.training.rollout import (MAX_LEN, TOP_K, Example, TargetCache, clip_record, eval_subset, rollouts,
                                         summarize)
from sgl_dspark.training.target import FrozenTarget

@dataclass(frozen=True)
class RunSpec:
    target: str
    data: str
    out: str
    preset: str
    minutes: float
    lr: float
    copied_lr_scale: float
    anchors: int
    max_len: int
    bf16: bool
    cache_features: bool
    eval_every_min: float
    eval_records: int
    seed: int
    init_from: str | None = None  # an exported drafter folder to continue from
    # a new drafter's Markov head: "bigram" (training-data PMI; benchmarks.learning: faster from the start) or "zero"
    # (paper)
    markov_init: str = "bigram"
    lr_schedule: str = "cosine"  # one of LR_SCHEDULES
    complement: float = 0.0  # CE/TV weight taken off draft positions the lookup branch covers (0: off)
    top_k: int = TOP_K  # target distribution entries kept per position


@dataclass(frozen=True)
class Offset:
    """Training an --init-from drafter already had: curve rows count from there."""

    steps: int = 0
    minutes: float = 0.0


def read_offset(drafter_path: Path) -> Offset:
    state = drafter_path / STATE_FILE
    if not state.is_file():
        return Offset()
    doc = json.loads(state.read_text())
    return Offset(int(doc["steps"]), float(doc["minutes"]))


def optimizer_for(drafter: DSparkDrafter, spec: RunSpec) -> torch.optim.Optimizer:
    copied = [p for n, p in drafter.named_parameters() if n.startswith("layers.") and p.requires_grad]
    ids = {id(p) for p in copied}
    rest = [p for p in drafter.parameters() if p.requires_grad and id(p) not in ids]
    groups = [{"params": copied, "lr": spec.lr * spec.copied_lr_scale}, {"params": rest, "lr": spec.lr}]
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0)


LR_SCHEDULES = ("cosine", "constant")


def lr_factor(elapsed_min: float, total_min: float, warmup_min: float = 1.0, schedule: str = "cosine") -> float:
    """Linear warm-up, then cosine decay to 10% over the time budget ("cosine") or the full rate ("constant": a run
    that another will continue, whose budget is not its end)."""
    if elapsed_min < warmup_min:
        return max(elapsed_min / warmup_min, 0.05)
    if schedule == "constant":
        return 1.0
    frac = min(1.0, (elapsed_min - warmup_min) / max(total_min - warmup_min, 1e-6))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


def build_drafter(spec: RunSpec, target: FrozenTarget, train: list[Example]) -> DSparkDrafter:
    target_config = json.loads((Path(spec.target) / "config.json").read_text())
    shape = PRESETS[spec.preset]
    weights = TargetWeights(target.embed.float(), target.lm_head.float())
    vocab = None
    if shape.draft_vocab_size:
        vocab = frequent_tokens([e.ids.tolist() for e in train], shape.draft_vocab_size, target_config["vocab_size"])
    drafter = new_drafter(target_config, shape, weights, vocab)
    copy_top_layers(drafter, target, train[0].ids.tolist())
    if spec.markov_init == "bigram":
        kept = bigram_markov(drafter, [e.ids.tolist() for e in train])
        tqdm.write(f"Markov head from the training data's bigram PMI (rank {shape.markov_rank}: {kept:.0%} of it)")
    return drafter


def save_state(out: Path, drafter: DSparkDrafter, opt, step: int, elapsed: float) -> None:
    save_drafter(drafter, out / "checkpoint")
    torch.save({"optimizer": opt.state_dict(), "step": step, "elapsed": elapsed}, out / "state.pt.tmp")
    (out / "state.pt.tmp").replace(out / "state.pt")


def train(spec: RunSpec) -> dict:
    torch.manual_seed(spec.seed)
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = FrozenTarget(spec.target, torch.bfloat16, device)
    train_ex = [clip_record(r, spec.max_len) for r in read_records(Path(spec.data) / "train.jsonl")]
    held = [clip_record(r, spec.max_len) for r in read_records(Path(spec.data) / "heldout.jsonl")]
    held = eval_subset(held, spec.eval_records)
    if not train_ex or not held:
        raise ValueError(f"training data {spec.data}: train.jsonl and heldout.jsonl must both hold records")
    resume = (out / "state.pt").is_file()
    offset = read_offset(Path(spec.init_from)) if spec.init_from else Offset()
    if resume or spec.init_from:
        spec_t = TargetSpec.from_hf_config(target.model.config.to_dict())
        drafter = load_drafter(out / "checkpoint" if resume else spec.init_from, spec_t,
                               TargetWeights(target.embed.float(), target.lm_head.float()))
        drafter.requires_grad_(True).train()
        if not resume and (Path(spec.init_from) / "curve.jsonl").is_file():  # the curve so far, then this run's
            (out / "curve.jsonl").write_text((Path(spec.init_from) / "curve.jsonl").read_text())
    else:
        drafter = build_drafter(spec, target, train_ex).train()
    drafter.to(device)
    (out / "run.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    opt = optimizer_for(drafter, spec)
    step, elapsed = 0, 0.0
    if resume:
        state = torch.load(out / "state.pt")
        opt.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state["elapsed"]
    to_draft = draft_index(drafter.draft_to_target, drafter.config.vocab_size).to(device)
    cache = TargetCache(target, drafter.config.target_layer_ids, spec.cache_features, spec.top_k)
    return loop(spec, drafter, opt, cache, train_ex, held, to_draft, step, elapsed, offset)


def evaluate(drafter, cache, held, to_draft, out: Path, step: int, minutes: float, offset: Offset) -> dict:
    drafter.eval()
    row = {"step": offset.steps + step, "minutes": round(offset.minutes + minutes, 2),
           **summarize(rollouts(drafter, cache, held, to_draft))}
    drafter.train()
    with (out / "curve.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def loop(spec, drafter, opt, cache, train_ex, held, to_draft, step, elapsed, offset: Offset) -> dict:
    out, rng = Path(spec.out), random.Random(spec.seed + step)
    gen = torch.Generator().manual_seed(spec.seed + step)
    weights, g = LossWeights(decay=float(drafter.config.gamma)), drafter.config.gamma
    budget_s, last_save, last_eval = spec.minutes * 60, elapsed, elapsed
    if step == 0:
        tqdm.write(f"eval @0: {evaluate(drafter, cache, held, to_draft, out, 0, 0.0, offset)}")
    bar = tqdm(total=int(budget_s), initial=int(elapsed), unit="s", desc="train", dynamic_ncols=True)
    running_acc = torch.zeros(g)
    by_source = [[i for i, e in enumerate(train_ex) if e.source == s] for s in sorted({e.source for e in train_ex})]
    covered: dict[int, torch.Tensor] = {}  # example -> lookup_depths (complementary training)
    while elapsed < budget_s:
        t0 = time.perf_counter()
        index = rng.choice(by_source[step % len(by_source)])  # sources take turns: chat answers are few
        ex = train_ex[index]
        features, target = cache.get(index, ex)
        ids = ex.ids.to(features.device)
        anchors = sample_anchors(ex.ids.shape[0], ex.first_anchor, spec.anchors, gen).to(features.device)
        if anchors.numel() == 0:
            step += 1
            continue
        blocks = with_tokens(block_rows(anchors, ids.shape[0], g), ids)
        with torch.autocast(features.device.type, dtype=torch.bfloat16, enabled=spec.bf16):
            logits, conf = block_outputs(drafter, features, ids, blocks)
        scale = None
        if spec.complement > 0:
            if index not in covered:
                covered[index] = lookup_depths(ex.ids.tolist(), g)
            scale = complement_scale(covered[index][anchors.cpu()], g, spec.complement).to(features.device)
        parts = dspark_loss(logits.float(), None if conf is None else conf.float(), target.take(blocks.rows),
                            blocks.valid, to_draft, weights, scale)
        for group, base in zip(opt.param_groups, (spec.lr * spec.copied_lr_scale, spec.lr)):
            group["lr"] = base * lr_factor(elapsed / 60, spec.minutes, schedule=spec.lr_schedule)
        opt.zero_grad(set_to_none=True)
        parts.total.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        dt = time.perf_counter() - t0
        elapsed += dt
        acc = (parts.accepted & parts.valid).float().sum(0) / parts.valid.float().sum(0).clamp(min=1)
        running_acc = 0.95 * running_acc + 0.05 * acc.cpu()
        bar.update(int(elapsed) - bar.n)
        bar.set_postfix_str(f"step {step} loss {float(parts.total):.3f} tv {parts.tv:.3f} "
                            f"acc@k {' '.join(f'{a:.2f}' for a in running_acc.tolist())}")
        if elapsed - last_save > 180:
            save_state(out, drafter, opt, step, elapsed)
            last_save = elapsed
        if elapsed - last_eval > spec.eval_every_min * 60:
            report = evaluate(drafter, cache, held, to_draft, out, step, elapsed / 60, offset)
            tqdm.write(f"eval @{elapsed / 60:.1f} min: {report}")
            last_eval = elapsed
    bar.close()
    save_state(out, drafter, opt, step, elapsed)
    final = evaluate(drafter, cache, held, to_draft, out, step, elapsed / 60, offset)
    tqdm.write(f"final eval: {final}")
    return final


def parse_args(argv: list[str] | None) -> RunSpec:
    p = argparse.ArgumentParser(prog="python -m sgl_dspark.training.trainer", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="target HF folder (default: the prepared default model)")
    p.add_argument("--data", required=True, help="folder from `python -m sgl_dspark.training.data build`")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, state.pt, curve.jsonl (rerun resumes)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--minutes", type=float, default=60.0, help="training time budget (wall clock)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--copied-lr-scale", type=float, default=0.5, help="lr multiplier of the copied target layers")
    p.add_argument("--anchors", type=int, default=128, help="random anchors per sequence")
    p.add_argument("--max-len", type=int, default=MAX_LEN, help="tokens kept per record (the last ones)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the drafter (the target runs in bf16)")
    p.add_argument("--cache-features", action="store_true", help="keep target features in RAM across passes")
    p.add_argument("--eval-every-min", type=float, default=5.0)
    p.add_argument("--eval-records", type=int, default=12, help="held-out records per source")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default=None,
                   help="an exported drafter folder to continue training (its shape, vocabulary and curve)")
    p.add_argument("--markov-init", choices=("zero", "bigram"), default="bigram",
                   help="a new drafter's Markov head: the training data's bigram PMI, low-rank (default: it learns "
                        "faster, benchmarks.learning) or zero (paper)")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="cosine",
                   help="cosine: decay to 10%% over --minutes; constant: full rate after warm-up "
                        "(runs continued later)")
    p.add_argument("--complement", type=float, default=0.0,
                   help="complementary training: CE/TV weight taken off positions the lookup branch covers (0-1)")
    p.add_argument("--top-k", type=int, default=TOP_K, help="target distribution entries kept per position")
    a = p.parse_args(argv)
    if not 0.0 <= a.complement <= 1.0 or a.top_k < 1:
        p.error(f"--complement must be in [0, 1] (got {a.complement}) and --top-k >= 1 (got {a.top_k})")
    if a.target is None:
        from sgl_dspark.tools.models import prepare

        a.target = str(prepare("float32").path)
    return RunSpec(a.target, a.data, a.out, a.preset, a.minutes, a.lr, a.copied_lr_scale, a.anchors, a.max_len,
                   a.bf16, a.cache_features, a.eval_every_min, a.eval_records, a.seed, a.init_from, a.markov_init,
                   a.lr_schedule, a.complement, a.top_k)


def main(argv: list[str] | None = None) -> int:
    spec = parse_args(argv)
    return cli.run("sgl_dspark.training.trainer", lambda: train(spec))


if __name__ == "__main__":
    sys.exit(main())
