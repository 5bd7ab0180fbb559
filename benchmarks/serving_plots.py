"""PNG plots of the serving benchmark's summaries (matplotlib, Agg): throughput vs per-user speed, the verify
budget per request vs concurrency, and DSPARK's per-step time split. Reads summaries; writes only the PNGs."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.serving_report import BASELINE, PHASES, REST, Summary  # noqa: E402


def median(s: Summary, key: str) -> float | None:
    st = s.stats.get(key)
    return None if st is None else st.median


def by_dataset(summaries: list[Summary]) -> dict[str, list[Summary]]:
    out: dict[str, list[Summary]] = {}
    for s in summaries:
        out.setdefault(s.dataset, []).append(s)
    return out


def configs_in_order(summaries: list[Summary]) -> list[str]:
    return list(dict.fromkeys(s.config for s in summaries))


def curve(summaries: list[Summary], config: str, x: str, y: str) -> list[tuple[float, float, int]]:
    points = [(median(s, x), median(s, y), s.concurrency) for s in summaries if s.config == config]
    return sorted((p for p in points if p[0] is not None and p[1] is not None), key=lambda p: p[2])


def panels(summaries: list[Summary], title: str):
    groups = by_dataset(summaries)
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    fig.suptitle(title)
    return fig, list(zip(axes[0], groups.items()))


def save(fig, path: Path) -> None:
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(summaries: list[Summary], path: Path) -> None:
    fig, pairs = panels(summaries, "Aggregate output throughput vs per-user speed (labels: concurrency)")
    for ax, (dataset, group) in pairs:
        for config in configs_in_order(group):
            pts = curve(group, config, "per_user_tps", "output_throughput")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=config)
            for px, py, c in pts:
                ax.annotate(str(c), (px, py), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ax.set(title=dataset, xlabel="per-user output tokens/s", ylabel="total output tokens/s")
        ax.grid(alpha=0.3)
    save(fig, path)


def plot_verify_budget(summaries: list[Summary], path: Path) -> None:
    fig, pairs = panels(summaries, "Draft tokens verified per request per step vs concurrency")
    for ax, (dataset, group) in pairs:
        for config in configs_in_order(group):
            pts = [(s.concurrency, v) for s in group if s.config == config
                   and (v := median(s, "verify_length")) is not None]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=config)
        ticks = sorted({s.concurrency for s in group})
        ax.set(title=dataset, xlabel="concurrency", ylabel="verify length (draft tokens)", xscale="log")
        ax.set_xticks(ticks, labels=[str(c) for c in ticks])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    save(fig, path)


def plot_step_breakdown(summaries: list[Summary], path: Path) -> None:
    """Stacked ms per decode step for each DSPARK (config, concurrency); draft includes IPC and planning. A dashed
    line over each bar marks plain decoding's step at that concurrency (its median TPOT), when it was measured."""
    fig, pairs = panels(summaries, "DSPARK ms per decode step against plain's\n(draft = drafter + IPC + plan; "
                                   "between: SGLang's work between steps; rest = accept_len x TPOT - phases)")
    for ax, (dataset, group) in pairs:
        rows = [s for s in group if any(f"step_ms.{p}" in s.stats for p in PHASES)]
        labels = [f"{s.config}\nc={s.concurrency}" for s in rows]
        bottom = [0.0] * len(rows)
        for phase in (*PHASES, REST):
            heights = [median(s, f"step_ms.{phase}") or 0.0 for s in rows]
            ax.bar(labels, heights, bottom=bottom, label=phase)
            bottom = [b + h for b, h in zip(bottom, heights)]
        plain = {s.concurrency: median(s, "tpot_p50_ms") for s in group if s.config == BASELINE}
        steps = [(i, plain.get(s.concurrency)) for i, s in enumerate(rows) if plain.get(s.concurrency)]
        for n, (i, ms) in enumerate(steps):
            ax.plot([i - 0.4, i + 0.4], [ms, ms], color="black", linestyle="--",
                    label=f"{BASELINE}: one step (TPOT)" if n == 0 else None)
        ax.set(title=dataset, ylabel="ms per step")
        ax.tick_params(axis="x", labelsize=7)
    save(fig, path)


def write_plots(summaries: list[Summary], out_dir: Path, prefix: str = "serving") -> list[Path]:
    paths = [out_dir / f"{prefix}_throughput.png", out_dir / f"{prefix}_verify_budget.png",
             out_dir / f"{prefix}_step_breakdown.png"]
    for plot, path in zip((plot_throughput, plot_verify_budget, plot_step_breakdown), paths):
        plot(summaries, path)
    return paths
