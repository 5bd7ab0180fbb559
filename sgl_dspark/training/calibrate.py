"""`python -m sgl_dspark.training.calibrate`: fit a drafter's confidence calibration on held-out rollouts.

Runs the drafter against the frozen target over held-out records (teacher-forced blocks at many anchors),
fits a temperature and a bias per draft position (sgl_dspark.calibration), prints ECE/AUC before and after, and
writes `calibration.json` into the drafter folder, where the server picks it up unless
--speculative-dspark-calibration names another file, with `reliability.png` beside it (the survival's reliability
diagram and ECE per position, before and after). Owns only this command.
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see sgl_dspark.training.trainer
os.environ.setdefault("KMP_BLOCKTIME", "0")

import torch  # noqa: E402

from sgl_dspark import cli  # noqa: E402
from sgl_dspark.calibration import (DEFAULT_BINS, Calibration, calibrate_confidence, fit_calibration,  # noqa: E402
                                    prefix_events, reliability_bins, save_calibration)
from sgl_dspark.training.data import read_records  # noqa: E402
from sgl_dspark.drafter.checkpoint import load_drafter  # noqa: E402
from sgl_dspark.drafter.config import TargetSpec  # noqa: E402
from sgl_dspark.drafter.model import TargetWeights  # noqa: E402
from sgl_dspark.training.objective import draft_index  # noqa: E402
from sgl_dspark.training.rollout import (MAX_LEN, TargetCache, clip_record, eval_subset, rollouts,  # noqa: E402
                                         summarize)
from sgl_dspark.training.target import FrozenTarget  # noqa: E402

CALIBRATION_FILE = "calibration.json"
PLOT_FILE = "reliability.png"


def report_table(report) -> str:
    rows = ["pos  samples  ECE before  ECE after  AUC before  AUC after"]
    for k in range(len(report.samples)):
        rows.append(f"{k + 1:>3}  {report.samples[k]:>7}  {report.ece_before[k]:>10.4f}  {report.ece_after[k]:>9.4f}"
                    f"  {report.auc_before[k]:>10.3f}  {report.auc_after[k]:>9.3f}")
    return "\n".join(rows)


def calibrate(drafter_path: str, target_path: str, data: str, records: int, out: Path, max_len: int = MAX_LEN) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = FrozenTarget(target_path, torch.bfloat16, device)
    spec = TargetSpec.from_hf_config(target.model.config.to_dict())
    drafter = load_drafter(drafter_path, spec, TargetWeights(target.embed.float(), target.lm_head.float())).to(device)
    held = eval_subset([clip_record(r, max_len) for r in read_records(Path(data) / "heldout.jsonl")], records)
    if not held:
        raise ValueError(f"{data}/heldout.jsonl holds no records to calibrate on")
    to_draft = draft_index(drafter.draft_to_target, drafter.config.vocab_size).to(device)
    roll = rollouts(drafter, TargetCache(target, drafter.config.target_layer_ids, False), held, to_draft)
    records = roll["confidence"].cpu(), roll["accepted"].cpu(), roll["valid"].cpu()
    fitted = fit_calibration(*records)
    save_calibration(fitted, out)
    plot_reliability(*records, fitted, out.with_name(PLOT_FILE))
    print(report_table(fitted.report))
    return {"temperatures": [round(t, 4) for t in fitted.temperatures.tolist()],
            "biases": [round(b, 4) for b in fitted.bias_values.tolist()], **summarize(roll),
            "ece_before": fitted.report.ece_before, "ece_after": fitted.report.ece_after}


def plot_reliability(conf: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor, fitted: Calibration,
                     path: Path) -> None:
    """Left: observed rate of "first k accepted" against the predicted survival prod_{i<=k} c_i, all positions
    pooled, raw and calibrated; right: ECE per position, raw and calibrated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    event, scored = prefix_events(accepted, valid)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    left.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    scores = {"raw": conf, "calibrated": calibrate_confidence(conf, fitted.temperatures, fitted.biases)}
    for name, c in scores.items():
        survival = torch.cumprod(c.double(), dim=-1)
        count, mean_prob, rate = reliability_bins(survival[scored], event[scored], DEFAULT_BINS)
        points = [(p, r) for n, p, r in zip(count, mean_prob, rate) if n]
        left.plot(*zip(*points), marker="o", label=name)
    left.set(xlabel="predicted survival", ylabel="observed: first k accepted", title="reliability (all positions)")
    left.legend()
    k = torch.arange(1, conf.shape[1] + 1)
    right.bar(k - 0.2, fitted.report.ece_before, width=0.4, label="raw")
    right.bar(k + 0.2, fitted.report.ece_after, width=0.4, label="calibrated")
    right.set(xlabel="draft position k", ylabel="ECE of the survival at k", title="ECE per position")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sgl_dspark.training.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="drafter checkpoint folder")
    p.add_argument("--data", required=True,
                   help="folder from `python -m sgl_dspark.training.data build` (uses heldout.jsonl)")
    p.add_argument("--target", default=None, help="target HF folder (default: the prepared default model)")
    p.add_argument("--records", type=int, default=24, help="held-out records per source")
    p.add_argument("--out", type=Path, default=None, help=f"output JSON (default: DRAFTER/{CALIBRATION_FILE})")
    p.add_argument("--max-len", type=int, default=MAX_LEN, help="tokens kept per record (as in training)")
    a = p.parse_args(argv)

    def body() -> None:
        if a.target is None:
            from sgl_dspark.tools.models import prepare

            a.target = str(prepare("float32").path)
        out = a.out or Path(a.drafter) / CALIBRATION_FILE
        print(json.dumps(calibrate(a.drafter, a.target, a.data, a.records, out, a.max_len)))
        print(f"wrote {out} and {out.with_name(PLOT_FILE)}")

    return cli.run("sgl_dspark.training.calibrate", body)


if __name__ == "__main__":
    sys.exit(main())
