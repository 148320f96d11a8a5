"""search/pareto.png: the predicted front (weight bytes against KLD, the worst domain and each one) and the chosen
mix as measured."""

from __future__ import annotations

from pathlib import Path


def pareto(body: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = body["pareto"]
    mb = [p["bytes"] / 1e6 for p in points]
    for d in body["domains"]:
        ax.plot(mb, [p["kld"][d] for p in points], lw=0.8, alpha=0.6, label=f"predicted {d}")
    ax.plot(mb, [p["worst"] for p in points], "k-o", ms=3, lw=1.6, label="predicted worst domain")
    p, m = body["predicted"], body["measured"]
    ax.plot([p["bytes"] / 1e6], [p["worst"]], "kx", ms=9, label="chosen mix, predicted worst")
    ax.plot([m["bytes"] / 1e6], [m["worst"]], "r*", ms=12, label="chosen mix, measured worst")
    ax.axvline(body["budget_bytes"] / 1e6, color="grey", ls=":", lw=1, label="budget")
    ax.set_xlabel("weight bytes (MB, safetensors)")
    ax.set_ylabel("KLD vs the original (nats / token)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("quantkit search: Pareto front")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
