"""bench/gpu.py's document: the ratios computed in the run (of the memory roofline, of
target-only, of one session), issue 32's targets checked against them, and the printed table."""

from __future__ import annotations

from typing import Any

from bench import report

# issue 32's targets: (key in a shape's "ratios", the least value that meets it, shapes it is set for)
TARGETS = (
    ("target_only_of_roofline", 0.70, ("7b",)),
    ("target_only_of_roofline", 0.50, ("1.5b",)),
    ("selfdraft_gamma4_x_target_only", 2.5, None),
    ("indep_auto_x_target_only", 0.95, None),
    ("auto_x_best_fixed_gamma", 0.9, None),
    ("sessions16_x_one", 12.0, None),
    ("sessions64_x_one", 30.0, None),
)


def roofline(weight_bytes: int, copy_gbps: float) -> dict:
    """One decode step reads every weight once: its least time at the measured bandwidth."""
    seconds = weight_bytes / (copy_gbps * 1e9)
    return {"weight_bytes": weight_bytes, "step_ms": 1e3 * seconds, "tokens_per_s": 1 / seconds}


def engine_ratios(engine: dict, roof: dict) -> None:
    """Adds to an engine's curve each size's fraction of the roofline step (in place)."""
    ms = engine["curve"]["ms"]
    engine["decode_ms"] = ms.get(1)
    engine["of_roofline"] = {k: roof["step_ms"] / v for k, v in ms.items()}


def _rate(section: dict | None, method: str) -> float | None:
    run = (section or {}).get("runs", {}).get(method)
    return run["decode_tps"] if run else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def shape_ratios(shape: dict) -> dict:
    """A shape's headline ratios, each from figures of this run (None where a part was skipped)."""
    roof = shape.get("roofline") or {}
    self_runs, indep = shape.get("selfdraft"), shape.get("indep")
    target_only = _rate(self_runs, report.TARGET_ONLY)
    fixed = {m: r["decode_tps"] for m, r in (self_runs or {}).get("runs", {}).items()
             if report.draft_gamma(m) is not None}
    levels = {row["sessions"]: row for row in shape.get("concurrency") or []}
    out = {
        "target_only_of_roofline": _ratio(target_only, roof.get("tokens_per_s")),
        "hf_generate_of_roofline": _ratio((shape.get("hf_generate") or {}).get("decode_tps"),
                                          roof.get("tokens_per_s")),
        "hf_generate_x_target_only": _ratio((shape.get("hf_generate") or {}).get("decode_tps"), target_only),
        "selfdraft_gamma4_x_target_only": _ratio(fixed.get(f"{report.DRAFT_PREFIX}4"), target_only),
        "auto_x_target_only": _ratio(_rate(self_runs, report.AUTO), target_only),
        "auto_x_best_fixed_gamma": _ratio(_rate(self_runs, report.AUTO), max(fixed.values(), default=None)),
        "indep_auto_x_target_only": _ratio(_rate(indep, report.AUTO), _rate(indep, report.TARGET_ONLY)),
        "sessions16_x_one": (levels.get(16) or {}).get("x_one_session"),
        "sessions64_x_one": (levels.get(64) or {}).get("x_one_session"),
    }
    for name, engine in (shape.get("engines") or {}).items():
        if "of_roofline" in engine:
            out[f"{name}_decode_of_roofline"] = engine["of_roofline"].get(1)
    return out


def targets(shapes: dict[str, dict]) -> list[dict]:
    """Issue 32's targets per shape: the value measured and whether it meets the goal (None: not measured)."""
    out = []
    for shape_name, shape in shapes.items():
        ratios = shape.get("ratios") or {}
        for key, goal, only in TARGETS:
            if only is not None and shape_name not in only:
                continue
            value = ratios.get(key)
            out.append({"shape": shape_name, "ratio": key, "goal": goal, "value": value,
                        "met": None if value is None else value >= goal})
    return out


def _f(value: Any, spec: str = ".2f", width: int = 8) -> str:
    return f"{'-':>{width}}" if value is None else f"{format(value, spec):>{width}}"


def shape_table(name: str, shape: dict, sizes: list[int]) -> list[str]:
    models = shape.get("models") or {}
    roof = shape.get("roofline") or {}
    lines = [f"== shape {name}: " + ", ".join(f"{role} {m['weight_bytes'] / 1e9:.3f} GB ({m['layers']} layers)"
                                            for role, m in models.items())]
    if roof:
        lines.append(f"roofline: {roof['step_ms']:.3f} ms a decode step = {roof['tokens_per_s']:.1f} tok/s")
    engines = shape.get("engines") or {}
    if engines:
        lines.append(f"{'engine':<8} {'decode ms':>9} {'of roof':>8}   verify ms by tokens "
                     + " ".join(f"{k:>7}" for k in sizes))
        for engine_name, e in engines.items():
            if "curve" not in e:
                lines.append(f"{engine_name:<8} {e.get('status', '')}: {e.get('reason', '')}")
                continue
            ms = e["curve"]["ms"]
            lines.append(f"{engine_name:<8} {_f(e['decode_ms'], '.3f', 9)} {_f(e.get('of_roofline', {}).get(1), '.1%')}   "
                         f"{'':<19}" + " ".join(_f(ms.get(k), '.2f', 7) for k in sizes))
    hf = shape.get("hf_generate")
    if hf:
        lines.append(f"{'hf generate (eager, in-process)':<40} {hf['decode_tps']:>9.1f} tok/s")
    for section, title in (("selfdraft", "specdec, self-draft"), ("indep", "specdec, independent draft")):
        runs = (shape.get(section) or {}).get("runs") or {}
        for method, run in runs.items():
            if not method.startswith("specdec "):
                continue  # the peer (HF generate) is its own line
            stats = run.get("stats") or {}
            lines.append(f"{title + ': ' + method.removeprefix('specdec '):<40} {run['decode_tps']:>9.1f} tok/s "
                         f"{_f(run.get('speedup'), '.2f', 6)}x target-only  α {_f(run.get('alpha'), '.2f', 5)}  "
                         f"tokens/round {_f(stats.get('tokens_per_round'), '.2f', 5)}")
    for row in shape.get("concurrency") or []:
        lines.append(f"{'target-only, ' + str(row['sessions']) + ' sessions':<40} "
                     f"{row['tokens_per_second']:>9.1f} tok/s {_f(row['x_one_session'], '.2f', 6)}x one session")
    ratios = {k: v for k, v in (shape.get("ratios") or {}).items() if v is not None}
    if ratios:
        lines.append("ratios: " + ", ".join(f"{k} {v:.3g}" for k, v in ratios.items()))
    return lines


def table(document: dict) -> str:
    bandwidth = document.get("bandwidth") or {}
    lines = [f"bench/gpu.py on {document['machine'].get('device_name', document['device'])}, "
             f"{document['dtype']}, {document['date']}"]
    if "copy_GBps" in bandwidth:
        lines.append(f"device copy bandwidth (read + write): {bandwidth['copy_GBps']:.1f} GB/s")
    for name, shape in document["shapes"].items():
        lines += shape_table(name, shape, document["sizes"])
    if document.get("targets"):
        lines.append("== issue 32's targets")
        for t in document["targets"]:
            verdict = "not measured" if t["met"] is None else "met" if t["met"] else "NOT met"
            lines.append(f"{t['shape']:<6} {t['ratio']:<32} goal >= {t['goal']:<5} "
                         f"value {_f(t['value'], '.3f', 7)}  {verdict}")
    lines.append("== steps")
    for step in document["steps"]:
        lines.append(f"{step['name']:<28} {step['status']:<8} {step['seconds']:>7.1f} s of {step['limit_s']:>6.1f}"
                     + (f"  {step['reason']}" if step.get("reason") else ""))
    return "\n".join(lines)
