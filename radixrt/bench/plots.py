"""PNG plots of benchmark results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def _headless() -> None:
    """Select matplotlib's file-only backend (Agg); call it before importing pyplot."""
    import matplotlib

    matplotlib.use("Agg")


def plot_sweep(
    points: dict[str, list[tuple[float, float, float, float]]],
    slo_ttft: float,
    path: Path,
    title: str,
) -> Path:
    """points: system -> [(request rate, output tok/s, TTFT p50, TTFT p99)]."""
    _headless()
    import matplotlib.pyplot as plt

    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, rows in points.items():
        rates = [r[0] for r in rows]
        (line,) = tput.plot(rates, [r[1] for r in rows], marker="o", label=system)
        ttft.plot(
            rates, [r[2] for r in rows], marker="o", color=line.get_color(), label=f"{system} p50"
        )
        ttft.plot(
            rates,
            [r[3] for r in rows],
            marker="x",
            linestyle="--",
            color=line.get_color(),
            label=f"{system} p99",
        )
    ttft.axhline(slo_ttft, color="grey", linewidth=1, label="TTFT SLO")
    tput.set(xlabel="request rate (req/s)", ylabel="output throughput (tok/s)", title="throughput")
    ttft.set(
        xlabel="request rate (req/s)", ylabel="TTFT (s)", title="time to first token", yscale="log"
    )
    tput.legend()
    ttft.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cdf(samples: dict[str, list[float]], path: Path, xlabel: str, title: str) -> Path:
    _headless()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for system, values in samples.items():
        ordered = sorted(values)
        ax.step(
            ordered,
            [(i + 1) / len(ordered) for i in range(len(ordered))],
            where="post",
            label=system,
        )
    ax.set(xlabel=xlabel, ylabel="fraction", title=title, xscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(values: dict[str, float], path: Path, ylabel: str, title: str) -> Path:
    _headless()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(list(values), list(values.values()), color="tab:blue")
    ax.bar_label(bars, fmt="%.2f")
    ax.set(ylabel=ylabel, title=title, ylim=(0, max(1.0, max(values.values(), default=1) * 1.1)))
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rss(samples: list[tuple[float, int, float]], path: Path) -> None:
    """samples: (seconds since start, server instance, RSS in MiB), one line per instance."""
    _headless()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for instance in sorted({s[1] for s in samples}):
        points = [(t, mb) for t, i, mb in samples if i == instance]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=f"server {instance}")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("runtime RSS (MiB)")
    ax.set_title("RSS of the runtime process during the soak")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
