"""The GPU run's figures in one report: `vocalis bench` for CosyVoice 2 and 3 at every precision, HiFT's precision
choice, peak GPU memory; a JSON file with the issue's figures under fixed keys and a markdown table.

    python benchmarks/gpu_report.py --out DIR                  # on a GPU: the 0.5B shapes, cuda
    python benchmarks/gpu_report.py --out DIR --rehearse       # on the CPU: the same steps at tiny shapes, bf16
                                                               # cast whole as on a GPU (VOCALIS_WHOLE_HALF=1)

Each bench runs in its own process (`python -m vocalis bench ...`, its log under DIR) with a time limit, all of
them within --budget-s, so one that fails or runs long costs only its own figures (CosyVoice 2 fp32 first: the
memory ratios need it); the report is written from whatever finished. Random weights
throughout (no download).

Writes under DIR: bench_cv2_<precision>.json and bench_cv3_<precision>.json (one `vocalis bench` each, with its
log), hift.json (`gpu_hift.py`), gpu_report.json and gpu_report.md.

gpu_report.json keys: "figures"[preset][precision] = {first_chunk_s_1, first_chunk_s_4, first_chunk_s_16,
audio_s_per_s_16, audio_s_per_s_64, decode_tok_s_b1, decode_tok_s_b16, peak_gpu_mib, peak_mem_vs_fp32}
(None where not measured; on the CPU peak_gpu_mib is the peak RSS); "targets" (the issue's wanted values);
"best" (each figure's best precision per preset); "hift" (HiFT decode time and error per precision); "runs"
(each bench's command, exit status and seconds). CosyVoice 2's first_chunk_s is the mean over the streams,
CosyVoice 3's the slowest stream's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TARGETS = {"first_chunk_s_1": ("<=", 0.080), "first_chunk_s_4": ("<=", 0.150), "first_chunk_s_16": ("<=", 0.400),
           "audio_s_per_s_16": (">=", 60.0), "audio_s_per_s_64": (">=", 150.0), "decode_tok_s_b1": (">=", 1000.0),
           "decode_tok_s_b16": (">=", 10000.0), "peak_mem_vs_fp32": ("<=", 0.55)}
KEYS = (*TARGETS, "peak_gpu_mib")


_DEADLINE = [float("inf")]  # perf_counter time by which every bench has ended (--budget-s)


def _run(cmd: list[str], log: Path, limit_s: float) -> dict[str, Any]:
    start = time.perf_counter()
    limit_s = min(limit_s, _DEADLINE[0] - start)
    if limit_s < 5:
        return {"cmd": " ".join(cmd), "rc": 124, "seconds": 0.0, "skipped": "out of --budget-s"}
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit_s, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return {"cmd": " ".join(cmd), "rc": rc, "seconds": round(time.perf_counter() - start, 1)}


def _cv2_figures(report: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    out = {}
    for precision, side in report.get("engine", {}).items():
        e2e, llm = side.get("e2e", {}), side.get("llm", {})
        out[precision] = {
            **{f"first_chunk_s_{c}": e2e.get(str(c), {}).get("first_chunk_s") for c in (1, 4, 16)},
            **{f"audio_s_per_s_{c}": e2e.get(str(c), {}).get("audio_s_per_s") for c in (16, 64)},
            **{f"decode_tok_s_b{b}": llm.get(str(b), {}).get("decode_tps") for b in (1, 16)},
            "peak_gpu_mib": side.get("peak_gpu_mib") or side.get("peak_rss_mib"),
        }
    return out


def _cv3_figures(report: dict[str, Any]) -> dict[str, float | None]:
    e2e, llm = report.get("e2e", {}), report.get("llm", {})
    return {**{f"first_chunk_s_{c}": e2e.get(f"c{c}", {}).get("first_chunk_s") for c in (1, 4, 16)},
            **{f"audio_s_per_s_{c}": e2e.get(f"c{c}", {}).get("audio_s_per_s") for c in (16, 64)},
            **{f"decode_tok_s_b{b}": llm.get(f"b{b}", {}).get("decode_tok_s") for b in (1, 16)},
            "peak_gpu_mib": report.get("peak_gpu_mib") or report.get("peak_rss_mib")}


def _memory_ratios(figures: dict[str, dict[str, Any]]) -> None:
    base = figures.get("fp32", {}).get("peak_gpu_mib")
    for f in figures.values():
        f["peak_mem_vs_fp32"] = f["peak_gpu_mib"] / base if base and f.get("peak_gpu_mib") else None


def _best(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    best: dict[str, Any] = {}
    for key, (op, wanted) in TARGETS.items():
        values = {p: f[key] for p, f in figures.items() if f.get(key) is not None and not (key == "peak_mem_vs_fp32"
                                                                                          and p == "fp32")}
        if values:
            p = (min if op == "<=" else max)(values, key=values.__getitem__)
            met = values[p] <= wanted if op == "<=" else values[p] >= wanted
            best[key] = {"precision": p, "value": values[p], "wanted": f"{op} {wanted}", "met": met}
    return best


def _table(report: dict[str, Any]) -> str:
    cols = [(preset, p) for preset, figs in report["figures"].items() for p in figs]
    lines = [f"GPU report ({report['device']}, {report['mode']}; random weights)", "",
             "| figure | target | " + " | ".join(f"{s} {p}" for s, p in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for key in KEYS:
        op, wanted = TARGETS.get(key, ("", ""))
        cells = [report["figures"][s][p].get(key) for s, p in cols]
        lines.append(f"| {key} | {op} {wanted} | " + " | ".join("-" if v is None else f"{v:.4g}" for v in cells)
                     + " |")
    hift = report.get("hift", {})
    if hift:
        lines += ["", "| HiFT body convs | rows x mel frames | ms per call | output rel RMS vs fp32 |",
                  "|---|---|---|---|"]
        lines += [f"| {p} | {h['rows']} x {h['frames']} | {h['ms']:.2f} | {h['rel_rms']:.2e} |"
                  for p, h in hift.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the logs, JSON and the table")
    ap.add_argument("--rehearse", action="store_true",
                    help="the same steps on the CPU at tiny shapes (CosyVoice 3: --cv3-shapes)")
    ap.add_argument("--cv3-shapes", default="../shared/reference/compat_cv3",
                    help="rehearsal: a CosyVoice 3 model directory whose shapes the CV3 bench takes")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: the report from the bench JSON files already under --out")
    ap.add_argument("--budget-s", type=float, help="seconds for every bench together (default 380; rehearsal: none)")
    ap.add_argument("--cv2-limit", type=float, help="seconds per CosyVoice 2 precision (default 100; rehearsal 900)")
    ap.add_argument("--cv3-limit", type=float, help="seconds per CosyVoice 3 precision (default 45; rehearsal 600)")
    ap.add_argument("--hift-limit", type=float, help="seconds for HiFT's precisions (default 20; rehearsal 300)")
    args = ap.parse_args()
    # a shared 2-core CPU runs the tiny shapes slower than a GPU the 0.5B ones: the rehearsal's limits are wider
    limits = (900, 600, 300) if args.rehearse else (100, 45, 20)
    budget = args.budget_s if args.budget_s is not None else (None if args.rehearse else 380)
    if budget is not None:
        _DEADLINE[0] = time.perf_counter() + budget
    args.cv2_limit, args.cv3_limit, args.hift_limit = (given or default for given, default in
                                                       zip((args.cv2_limit, args.cv3_limit, args.hift_limit), limits))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.rehearse else "cuda"
    precisions = ("fp32", "bf16") if args.rehearse else ("fp32", "fp16", "bf16")  # fp16 needs a GPU
    streams = "1,4" if args.rehearse else "1,4,16,64"
    if args.rehearse:  # bf16 on the CPU as on a GPU: the whole-model cast (backends.choice)
        os.environ["VOCALIS_WHOLE_HALF"] = "1"
    common = [sys.executable, "-m", "vocalis", "bench", "--device", device, "--batches", "1,16", "--concurrency",
              streams, "--e2e-repeats", "1", "--plot", "", "--threads", "2" if args.rehearse else "4"]
    if args.rehearse:
        common += ["--tokens", "30", "--prompt-tokens", "15"]
    runs: dict[str, Any] = {}
    if args.report_only:
        _write_report(args, out, precisions, device, json.loads((out / "gpu_report.json").read_text())["runs"]
                      if (out / "gpu_report.json").is_file() else {})
        return 0
    for p in precisions:  # one bench per precision: one that runs out of time loses only its own figures
        runs[f"cv2_{p}"] = _run([*common, "--preset", "tiny" if args.rehearse else "cosyvoice2-0.5b", "--precision",
                                 p, "--json", str(out / f"bench_cv2_{p}.json")], out / f"bench_cv2_{p}.log",
                                args.cv2_limit)
    for p in precisions:
        shapes = ["--shapes-from", args.cv3_shapes] if args.rehearse else []
        runs[f"cv3_{p}"] = _run([*common, "--preset", "cosyvoice3-0.5b", *shapes, "--precision", p, "--json",
                                 str(out / f"bench_cv3_{p}.json")], out / f"bench_cv3_{p}.log", args.cv3_limit)
    tiny_hift = ["--preset", "tiny", "--rows", "1", "--frames", "20"] if args.rehearse else []
    runs["hift"] = _run([sys.executable, str(Path(__file__).with_name("gpu_hift.py")), "--device", device, "--json",
                         str(out / "hift.json"), *tiny_hift], out / "hift.log", args.hift_limit)
    _write_report(args, out, precisions, device, runs)
    failed = [name for name, r in runs.items() if r["rc"] != 0]
    if failed:
        print(f"not measured (see their logs under {out}): {', '.join(failed)}")
    return 1 if failed else 0


def _write_report(args: argparse.Namespace, out: Path, precisions: tuple[str, ...], device: str,
                  runs: dict[str, Any]) -> None:
    def load(name: str) -> dict[str, Any]:
        path = out / name
        return json.loads(path.read_text()) if path.is_file() else {}

    figures: dict[str, dict[str, dict[str, Any]]] = {"cosyvoice2": {}, "cosyvoice3": {}}
    for p in precisions:
        figures["cosyvoice2"].update(_cv2_figures(load(f"bench_cv2_{p}.json")))
        cv3 = load(f"bench_cv3_{p}.json")
        if cv3:
            figures["cosyvoice3"][p] = _cv3_figures(cv3)
    for figs in figures.values():
        _memory_ratios(figs)
    machine = load(f"bench_cv2_{precisions[0]}.json").get("machine", {})
    report = {"device": machine.get("device_name") or machine.get("processor") or device,
              "mode": "rehearsal (CPU, tiny shapes)" if args.rehearse else "GPU, 0.5B shapes",
              "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()}, "figures": figures,
              "best": {preset: _best(figs) for preset, figs in figures.items()}, "hift": load("hift.json"),
              "runs": runs}
    (out / "gpu_report.json").write_text(json.dumps(report, indent=2))
    (out / "gpu_report.md").write_text(_table(report))
    print(_table(report))


if __name__ == "__main__":
    sys.exit(main())
