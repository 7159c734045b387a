"""Analysis of an open-loop load test (bench/load.py): each request's outcome, summarised per
rate as serving benchmarks do (vLLM's `benchmark_serving`), the saturation rate, whether
refusals past it were clean, a text table and a PNG of latency against rate."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

SATURATION_FACTOR = 2.0  # p99 time per output token this many times the lowest rate's = saturated
MESSAGES_KEPT = 3  # distinct error messages a rate's summary keeps


class Outcome(str, enum.Enum):
    """How one request ended, as the client saw it."""

    COMPLETED = "completed"  # streamed to its finish reason, every token it asked for
    REFUSED = "refused"  # HTTP 429 before anything was generated
    ERROR = "error"  # any other HTTP error or failure
    TIMEOUT = "timeout"  # not finished within the client's --request-timeout
    INCOMPLETE = "incomplete"  # the stream ended without a finish reason, or short of its tokens: lost work


@dataclass
class RequestResult:
    """One request of the load."""

    arrival_s: float  # when it was sent, seconds after its rate's first arrival
    prompt: str  # the bench prompt's name
    max_tokens: int  # the output length it asked for (EOS ignored: it should get all of them)
    outcome: Outcome = Outcome.ERROR
    status: int | None = None  # the HTTP status of a refusal or an error (None: no HTTP answer)
    retry_after: str | None = None  # a refusal's Retry-After header, None when absent
    message: str = ""  # an error's message (first line)
    ttft_s: float | None = None  # time to the first streamed text
    latency_s: float | None = None  # time to the end of the stream (completed requests)
    output_tokens: int = 0  # tokens the server counted (usage), else streamed chunks with text

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as vLLM defines it: (latency − TTFT) / (n − 1)."""
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {"arrival_s": self.arrival_s, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "outcome": self.outcome.value, "status": self.status, "retry_after": self.retry_after,
                "message": self.message, "ttft_s": self.ttft_s, "latency_s": self.latency_s,
                "tpot_s": self.tpot_s, "output_tokens": self.output_tokens}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default); None
    for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def spread_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """p50 and p99 of seconds, in milliseconds."""
    return {f"p{q}": None if (v := percentile(values_s, q)) is None else 1000.0 * v for q in (50, 99)}


def max_in_flight(intervals: Sequence[tuple[float, float]]) -> int:
    """The most (start, end) intervals open at one moment (an end before a start at a tie)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def summarise_rate(rate: float, results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """One rate's figures. wall_s: from its first arrival to the end of its last request."""
    by = {kind: [r for r in results if r.outcome is kind] for kind in Outcome}
    done = by[Outcome.COMPLETED]
    refused = by[Outcome.REFUSED]
    messages = list(dict.fromkeys(f"{r.status or '-'}: {r.message}" for r in by[Outcome.ERROR]))
    tokens = sum(r.output_tokens for r in done)
    return {
        "rate": rate,
        "sent": len(results),
        "completed": len(done),
        "refused": len(refused),
        "refused_with_retry_after": sum(r.retry_after is not None for r in refused),
        "errors": len(by[Outcome.ERROR]),
        "error_messages": messages[:MESSAGES_KEPT],
        "timeouts": len(by[Outcome.TIMEOUT]),
        "incomplete": len(by[Outcome.INCOMPLETE]),
        "refused_share": len(refused) / len(results) if results else 0.0,
        "wall_s": wall_s,
        "achieved_arrival_rate": (len(results) - 1) / results[-1].arrival_s
        if len(results) > 1 and results[-1].arrival_s > 0 else None,
        "completed_per_s": len(done) / wall_s if wall_s > 0 else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": spread_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": spread_ms([t for r in done if (t := r.tpot_s) is not None]),
        "latency_ms": spread_ms([r.latency_s for r in done if r.latency_s is not None]),
        "max_in_flight": max_in_flight([(r.arrival_s, r.arrival_s + r.latency_s) for r in done
                                        if r.latency_s is not None]),
        # Little's law: the completed requests' time in the system over the wall time
        "mean_in_flight": sum(r.latency_s for r in done if r.latency_s is not None) / wall_s if wall_s > 0 else 0.0,
    }


def saturation_rate(rows: Sequence[dict[str, Any]], factor: float = SATURATION_FACTOR) -> float | None:
    """The lowest rate whose p99 time per output token is `factor` times the lowest rate's or
    more; None when no rate run reached it (or the lowest rate has no p99)."""
    ordered = sorted(rows, key=lambda row: row["rate"])
    if not ordered or ordered[0]["tpot_ms"]["p99"] is None:
        return None
    base = ordered[0]["tpot_ms"]["p99"]
    return next((row["rate"] for row in ordered[1:]
                 if row["tpot_ms"]["p99"] is not None and row["tpot_ms"]["p99"] >= factor * base), None)


def is_clean(row: dict[str, Any]) -> bool:
    """Whether a rate lost nothing: no error but 429, no timeout, no stream cut short, and every
    429 carried Retry-After."""
    return (row["errors"] == 0 and row["timeouts"] == 0 and row["incomplete"] == 0
            and row["refused_with_retry_after"] == row["refused"])


def verdict(rows: Sequence[dict[str, Any]], saturation: float | None) -> dict[str, Any]:
    """What the run shows about overload: whether every rate was clean, whether rates past
    saturation refused, and how far their admitted requests' p99 latencies rose over the
    saturation rate's (the bound an admission limit holds)."""
    past = [row for row in rows if saturation is not None and row["rate"] > saturation]
    at = next((row for row in rows if row["rate"] == saturation), None)

    def rise(key: str) -> float | None:
        values = [row[key]["p99"] for row in past if row[key]["p99"] is not None]
        if at is None or not values or not at[key]["p99"]:
            return None
        return max(values) / at[key]["p99"]

    return {"clean": all(is_clean(row) for row in rows),
            "unclean_rates": [row["rate"] for row in rows if not is_clean(row)],
            "rates_past_saturation": [row["rate"] for row in past],
            "refused_past_saturation": sum(row["refused"] for row in past),
            "p99_tpot_past_saturation_over_saturation": rise("tpot_ms"),
            "p99_ttft_past_saturation_over_saturation": rise("ttft_ms")}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def table(rows: Sequence[dict[str, Any]], saturation: float | None) -> str:
    """One line per rate: what was sent and what became of it, throughput, latencies."""
    head = (f"{'rate/s':>6} {'sent':>5} {'done':>5} {'429':>4} {'429 RA':>6} {'err':>4} {'t/o':>4} {'lost':>4} "
            f"{'req/s':>6} {'tok/s':>6} {'TTFT p50':>8} {'p99':>7} {'TPOT p50':>8} {'p99':>6} {'inflt':>5}")
    lines = [head]
    for row in rows:
        mark = "  <- saturation" if row["rate"] == saturation else ""
        lines.append(
            f"{row['rate']:>6g} {row['sent']:>5} {row['completed']:>5} {row['refused']:>4} "
            f"{row['refused_with_retry_after']:>6} {row['errors']:>4} {row['timeouts']:>4} {row['incomplete']:>4} "
            f"{row['completed_per_s']:>6.2f} {row['output_tokens_per_s']:>6.1f} "
            f"{_ms(row['ttft_ms']['p50']):>8} {_ms(row['ttft_ms']['p99']):>7} "
            f"{_ms(row['tpot_ms']['p50']):>8} {_ms(row['tpot_ms']['p99']):>6} {row['max_in_flight']:>5}{mark}")
    lines += ["columns: rate = offered Poisson arrivals per second; 429 RA = refusals with Retry-After;",
              "  err = other errors; t/o = client timeouts; lost = streams cut short; req/s, tok/s = completed",
              "  requests and output tokens per second of the rate's wall time; TTFT, TPOT = time to first token",
              "  and per output token after it (ms), of completed requests; inflt = most of them in flight at once"]
    lines.append(f"saturation (p99 TPOT ≥ {SATURATION_FACTOR:g}× the lowest rate's): "
                 + (f"{saturation:g} requests/s" if saturation is not None else "not reached at the rates run"))
    for row in rows:
        for message in row["error_messages"]:
            lines.append(f"  rate {row['rate']:g} error: {message}")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], saturation: float | None, path: Path, title: str) -> bool:
    """TTFT and TPOT (p50, p99) against rate, and completed requests/s with the refused share;
    False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator
    except ImportError:
        return False
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    rates = [row["rate"] for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, key, name in ((axes[0], "ttft_ms", "time to first token (ms)"),
                          (axes[1], "tpot_ms", "time per output token (ms)")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(rates, [row[key][q] if row[key][q] is not None else float("nan") for row in rows],
                    style, label=q)
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_locator(NullLocator())
    axes[2].plot(rates, [row["completed_per_s"] for row in rows], "o-", label="completed req/s")
    axes[2].plot(rates, rates, ":", color="grey", label="offered")
    axes[2].set_ylabel("requests per second")
    share = axes[2].twinx()
    share.bar(rates, [100 * row["refused_share"] for row in rows], width=[0.25 * r for r in rates],
              alpha=0.3, color="red", label="refused (429) %")
    share.set_ylabel("refused with 429 (%)")
    share.set_ylim(0, 100)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(rates)
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("offered rate (requests/s, Poisson)")
        if saturation is not None:
            ax.axvline(saturation, color="grey", linestyle="--", linewidth=1)
        ax.legend(fontsize=8, loc="upper left")
    share.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
