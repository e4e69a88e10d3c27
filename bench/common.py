"""Output helpers shared by the bench/ scripts: spread statistics, the rich table, the JSON report.

    from common import spread, print_table, write_report, mpirun_argv, mpi_env
    write_report("wire_throughput", question="B5 ...", target="...", met=True, rows=[...], raw={...})

Every script writes bench/results/<name>.json with the same top-level keys (question, target, met,
verdict, rows, machine, raw) so `bench/run_all.py` can render BENCHMARKS.md from them. Not a
benchmark itself: running it prints nothing.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PYTHON = sys.executable


def spread(values: list[float]) -> dict:
    """Median, min, max and the relative spread (max-min)/median of repeated measurements."""
    values = [float(v) for v in values]
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values), "n": len(values),
            "rel_spread": (max(values) - min(values)) / med if med else 0.0, "values": values}


def fmt(s: dict, unit: str = "", digits: int = 3) -> str:
    """'1.234 [1.100-1.400] s (n=5)' for a spread() dict."""
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]{unit} (n={s['n']})"


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0, 0, 0)
    mem = 0
    if Path("/proc/meminfo").exists():
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    return {"host": platform.node(), "cpu": cpu_model(), "cpus": os.cpu_count(), "mem_mb": mem,
            "python": platform.python_version(), "load_avg_at_end": [round(x, 2) for x in load],
            "mpirun": shutil.which("mpirun")}


MATMUL_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what oneDNN and MKL pick their kernels by


def cpu_model() -> str:
    """The CPU's name as Linux reports it and its matrix-product features ("?" elsewhere): a product's speed
    differs by vendor and features (MKL against oneDNN, device/cpu_matmul.py)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "?"
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return f"{name} ({' '.join(f for f in MATMUL_FEATURES if f in flags) or 'none of ' + ' '.join(MATMUL_FEATURES)})"


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*[str(c) for c in row])
    Console().print(table)


def write_report(name: str, *, question: str, target: str, met: bool | None, verdict: str,
                 rows: list[dict], raw: dict, notes: str = "", tables: list[dict] | None = None) -> Path:
    """rows: [{"label", "value" (display string), "median", "min", "max", "n"}]; met=None: report only.
    tables: more tables for the page, each {"title", "columns", "rows" (lists of display strings)}."""
    path = RESULTS / f"{name}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"question": question, "target": target, "met": met, "verdict": verdict,
                                "notes": notes, "rows": rows, "tables": tables or [], "machine": machine(), "raw": raw,
                                "measured": datetime.now().strftime("%Y-%m-%d %H:%M")}, indent=2) + "\n")
    Console().print(f"{verdict}\nJSON: {path}", highlight=False)
    return path


def row(label: str, s: dict, unit: str = "", digits: int = 3) -> dict:
    return {"label": label, "value": fmt(s, unit, digits), **{k: s[k] for k in ("median", "min", "max", "n")}}


def mpi_env() -> dict[str, str]:
    """Environment for mpirun: Open MPI refuses root without both ALLOW flags; the repo on PYTHONPATH."""
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "bench"), env.get("PYTHONPATH", "")])
    return env


def mpirun_argv(np_: int, script: Path, *args: str) -> list[str]:
    mpirun = shutil.which("mpirun")
    if not mpirun:
        raise SystemExit("mpirun not found on PATH: `make system-deps` installs Open MPI")
    return [mpirun, "-np", str(np_), "--oversubscribe", "--bind-to", "none", PYTHON, str(script), *args]


def qwen05b_config(layers: int, **extra):
    """A transformers Qwen2Config of Qwen2.5-0.5B's shape (hidden 896, 14 heads over 2 KV heads, intermediate 4864,
    the 151,936-token vocabulary, tied embeddings) with `layers` layers: the real-size shape the CPU benches build
    with random weights (no model hub here)."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=layers, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                       tie_word_embeddings=True, **extra)
