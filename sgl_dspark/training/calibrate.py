"""`python -m sgl_dspark.training.calibrate`: fit a drafter's sequential temperatures (STS) on held-out rollouts.

Runs the drafter against the frozen target over held-out records (teacher-forced blocks at many anchors),
fits one temperature per draft position (sgl_dspark.calibration), prints ECE/AUC before and after, and writes
`calibration.json` into the drafter folder, where the server picks it up unless
--speculative-dspark-calibration names another file. Owns only this command.
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
from sgl_dspark.calibration import fit_calibration, save_calibration  # noqa: E402
from sgl_dspark.training.data import read_records  # noqa: E402
from sgl_dspark.drafter.checkpoint import load_drafter  # noqa: E402
from sgl_dspark.drafter.config import TargetSpec  # noqa: E402
from sgl_dspark.drafter.model import TargetWeights  # noqa: E402
from sgl_dspark.training.objective import draft_index  # noqa: E402
from sgl_dspark.training.rollout import (MAX_LEN, TargetCache, clip_record, eval_subset, rollouts,  # noqa: E402
                                         summarize)
from sgl_dspark.training.target import FrozenTarget  # noqa: E402

CALIBRATION_FILE = "calibration.json"


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
    fitted = fit_calibration(roll["confidence"].cpu(), roll["accepted"].cpu(), roll["valid"].cpu())
    save_calibration(fitted, out)
    print(report_table(fitted.report))
    return {"temperatures": [round(t, 4) for t in fitted.temperatures.tolist()], **summarize(roll),
            "ece_before": fitted.report.ece_before, "ece_after": fitted.report.ece_after}


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
        print(f"wrote {out}")

    return cli.run("sgl_dspark.training.calibrate", body)


if __name__ == "__main__":
    sys.exit(main())
