"""PNG plots of a run, redrawn from its metrics records after every step.

- rewards.png: mean reward per step, its moving average, the share of answers in the format, and
  the held-out evaluations' mean reward with its standard error and the run's gain
  (tailrl.rl.heldout).
- lengths.png: every response's length per step (the long tail made visible) with the median,
  90th percentile and max, and a histogram of the latest step.
- times.png: the step time split into rollout, reward, train and the rest.
- regime.png: whether the run is in TLT's regime, per step: the rollout's share of the step and
  the tail's share of the rollout; the longest response over the median, and the target's own
  chain ceiling (accept_len_ceiling), each beside its target line.
- decoding.png: how the rollout decoded. The latest step's running batch size over time coloured
  by the arm that decoded each step (where speculation switched on, and with which shape); its
  accept_len per batch-size bucket and arm; and per step the share of tokens produced under
  speculative decoding and the decode time split into plain steps, drafting and verification.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend, no display).
Files are replaced atomically, so an image viewer never reads a half-written PNG.

Knows: the metrics record fields (step, reward_mean, format_rate, response_lens,
max_new_tokens, rollout_s, reward_s, train_s, step_s; tailrl.speculative.report's fields). Does not
know: how they were measured.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tailrl.rl.heldout import gain
from tailrl.rl.run_dir import atomic_file


def _save(fig: Any, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    # Fixed margins: tight_layout measures every text element, a cost paid again at every step.
    fig.subplots_adjust(left=0.09, right=0.97, bottom=0.13, top=0.91, wspace=0.25)
    return fig


def _integer_steps(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def log_counts(ax: Any) -> None:
    """A log y axis labelled with plain integers (1, 2, 5, 10, ...) rather than 10^x."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_rewards(records: Sequence[dict[str, Any]], path: Path, evals: Sequence[dict[str, Any]] = ()) -> None:
    steps = np.array([r["step"] for r in records])
    mean = np.array([r["reward_mean"] for r in records])
    fig = _figure(7, 4)
    ax = fig.add_subplot()
    ax.plot(steps, mean, marker="o", ms=3, alpha=0.6, label="mean reward")
    # One step's mean over a few prompts is noisy; a trailing average shows the trend.
    window = 5
    trend = [mean[max(0, i - window + 1) : i + 1].mean() for i in range(len(mean))]
    ax.plot(steps, trend, lw=2, label=f"average of the last {window} steps")
    if all("format_rate" in r for r in records):
        ax.plot(steps, [r["format_rate"] for r in records], ls="--", label="answer in format")
    if evals:
        g = gain(evals)
        label = f"held-out ({evals[-1]['heldout_problems']} fixed problems, +-1 s.e.)"
        if g is not None:
            label += f": {g.delta:+.3f} +- {g.se:.3f} from step {g.first_step}"
        ax.errorbar([e["step"] for e in evals], [e["heldout_reward"] for e in evals],
                    yerr=[e.get("heldout_reward_se", 0.0) for e in evals], fmt="s-", ms=5, capsize=3, color="C3",
                    label=label)
    ax.set(xlabel="step", ylabel="reward", title="Reward per step")
    ax.set_ylim(min(0.0, float(mean.min())) - 0.02, max(1.0, float(mean.max())) + 0.02)
    _integer_steps(ax)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    _save(fig, path)


def plot_lengths(records: Sequence[dict[str, Any]], path: Path) -> None:
    fig = _figure(11, 4)
    ax, hist = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    rng = np.random.default_rng(0)  # horizontal jitter only, so points do not hide each other
    for r in records:
        lens = np.asarray(r["response_lens"])
        jitter = rng.uniform(-0.25, 0.25, len(lens))
        ax.scatter(r["step"] + jitter, lens, s=6, alpha=0.5, color="tab:blue", lw=0, zorder=3)
    steps = [r["step"] for r in records]
    for q, style, label in ((50, "-", "median"), (90, "--", "p90"), (100, ":", "max")):
        ax.plot(steps, [np.percentile(r["response_lens"], q) for r in records], ls=style, color="k", label=label)
    limit = records[-1].get("max_new_tokens")
    if limit:
        ax.axhline(limit, color="tab:red", lw=0.8, label="max_new_tokens")
    # Log scale: the typical response and the tail differ by an order of magnitude or more.
    log_counts(ax)
    ax.set(xlabel="step", ylabel="response length (tokens)", title="Response lengths per step")
    _integer_steps(ax)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    last = records[-1]
    hist.hist(last["response_lens"], bins=30, color="tab:blue")
    hist.set(xlabel="response length (tokens)", ylabel="responses", title=f"Step {last['step']}")
    _save(fig, path)


def plot_times(records: Sequence[dict[str, Any]], path: Path) -> None:
    steps = np.array([r["step"] for r in records])
    parts = {name: np.array([r[f"{name}_s"] for r in records]) for name in ("rollout", "reward", "train")}
    parts["other"] = np.maximum(np.array([r["step_s"] for r in records]) - sum(parts.values()), 0.0)
    fig = _figure(7, 4)
    ax = fig.add_subplot()
    bottom = np.zeros(len(records))
    for name, values in parts.items():
        ax.bar(steps, values, bottom=bottom, label=name, width=0.8)
        bottom = bottom + values
    ax.set(xlabel="step", ylabel="seconds", title="Time per step")
    _integer_steps(ax)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="best", fontsize=8)
    _save(fig, path)


# The regime targets drawn as dashed lines (rollout share, tail share, max / median, ceiling).
REGIME_TARGETS = {"rollout_share": 0.7, "tail_share": 0.4, "max_over_median": 4.0, "accept_len_ceiling": 4.0}


def plot_regime(records: Sequence[dict[str, Any]], path: Path) -> None:
    fig = _figure(11, 4)
    shares, ratios = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    steps = [r["step"] for r in records]
    for i, (name, label) in enumerate((("rollout_share", "rollout / step"), ("tail_share", "tail / rollout"))):
        shares.plot(steps, [r[name] for r in records], "o-", ms=3, color=f"C{i}", label=label)
        shares.axhline(REGIME_TARGETS[name], color=f"C{i}", ls="--", lw=0.8)
    shares.set_ylim(0, 1.02)
    shares.set(xlabel="step", ylabel="share of time", title="Rollout share of the step, tail (<= 8 running) share")
    series = {
        "max_over_median": [r["response_len_max"] / max(r["response_len_p50"], 1.0) for r in records],
        "accept_len_ceiling": [r["accept_len_ceiling"] or 0.0 for r in records],
    }
    for i, (name, values) in enumerate(series.items()):
        ratios.plot(steps, values, "o-", ms=3, color=f"C{i + 2}", label=name.replace("_", " "))
    ratios.axhline(REGIME_TARGETS["max_over_median"], color="k", ls="--", lw=0.8, label="target 4.0")
    ratios.set(xlabel="step", ylabel="ratio / tokens per verify", title="Longest over median length; 6-chain ceiling")
    for ax in (shares, ratios):
        _integer_steps(ax)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    _save(fig, path)


def plot_decoding(records: Sequence[dict[str, Any]], path: Path) -> None:
    fig = _figure(15, 4)
    fig.subplots_adjust(right=0.95, wspace=0.3)  # room for the right panel's second axis
    timeline, accept, share = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    last = records[-1]
    arms = sorted({seg[3] for seg in last["batch_timeline"]}, key=lambda a: (a != "plain", a))
    colour = {arm: f"C{i}" for i, arm in enumerate(arms)}
    for arm in arms:
        segs = [s for s in last["batch_timeline"] if s[3] == arm]  # [start_s, end_s, batch, arm]
        timeline.hlines([s[2] for s in segs], [s[0] for s in segs], [s[1] for s in segs],
                        colors=colour[arm], lw=3, label=arm)
    # Log scale: the tail (1-8 running sequences) is where the arms differ.
    log_counts(timeline)
    timeline.set(xlabel="seconds into the rollout", ylabel="running sequences",
                 title=f"Step {last['step']}: arm per decode step")
    timeline.grid(alpha=0.3)
    timeline.legend(loc="best", fontsize=7)
    buckets = list(last["by_bucket"])
    for arm in arms:
        xs = [i for i, b in enumerate(buckets) if arm in last["by_bucket"][b]]
        accept_len = [last["by_bucket"][buckets[i]][arm]["accept_len"] for i in xs]
        accept.plot(xs, accept_len, "o-", color=colour[arm], label=arm)
    accept.set_xticks(range(len(buckets)), buckets)
    accept.set(xlabel="running batch size", ylabel="tokens per sequence-step", title="accept_len by batch size and arm")
    accept.grid(alpha=0.3)
    steps = np.array([r["step"] for r in records])
    bottom = np.zeros(len(records))
    for name in ("plain", "draft", "verify"):
        values = np.array([r[f"{name}_s"] for r in records])
        share.bar(steps, values, bottom=bottom, width=0.8, label=f"{name} seconds")
        bottom = bottom + values
    share.set(xlabel="step", ylabel="decode seconds", title="Decode time and share of tokens under SD")
    _integer_steps(share)
    fraction = share.twinx()
    fraction.plot(steps, [r["sd_fraction"] for r in records], "k.-", label="tokens under SD")
    fraction.set_ylim(0, 1.05)
    fraction.set_ylabel("share of tokens under SD")
    share.legend(loc="upper left", fontsize=7)
    fraction.legend(loc="upper right", fontsize=7)
    _save(fig, path)


def write_plots(records: Sequence[dict[str, Any]], out_dir: Path, evals: Sequence[dict[str, Any]] = ()) -> list[Path]:
    """Redraw every plot from all records so far (and the held-out evaluations, on the rewards
    plot); returns the files written."""
    if not records:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    plots = [("rewards", partial(plot_rewards, evals=evals)), ("lengths", plot_lengths), ("times", plot_times)]
    if all("batch_timeline" in r for r in records):  # runs from before tailrl.speculative.report lack it
        plots.append(("decoding", plot_decoding))
    if all("tail_share" in r and "rollout_share" in r for r in records):  # older runs lack them
        plots.append(("regime", plot_regime))
    for name, draw in plots:
        path = out_dir / f"{name}.png"
        draw(records, path)
        written.append(path)
    return written
