#!/usr/bin/env python3
"""The built-in model's recipe on a lent accelerator machine, against a deadline: corpus, features and every
trainer there, fp16 weights back. That machine cannot install packages and has no festival, so what the recipe
needs travels with the repository as a bundle made here:

    python scripts/device_recipe.py fetch                 # -> .device-recipe/ (debs + wheels, ~26 MB, git-ignored)

then, through the device tool with `carry: [".device-recipe"]` (the command runs in the repository root):

    python3 scripts/device_recipe.py run --out $OUT --minutes 9

`run` unpacks the Debian packages (festival, its libraries, lexicons and the three voices, WordNet and fortunes)
under /tmp/vocalis-root with `dpkg -x` (never over /: their libraries are older than the machine's), points
festival's own paths there and puts a wrapper first on PATH; installs the wheels the machine lacks into
/tmp/vocalis-site; builds the corpus, features and labels with every core (`scripts/train_builtin.py --only corpus
prep labels`); starts the stages' trainers side by side on the device (each from the committed ladder weights,
as on any machine without checkpoints); stops them at the deadline (a checkpoint every 100 steps, written
atomically, so at most the steps since the last one are lost); and writes each stage's newest weights as fp16 gates
to OUT/gates/<rung>/ with the logs and a summary.json (steps reached, seconds per phase). Measure and install the
gates here (docs/builtin-model.md, "The ladder"): the machine has no pocketsphinx.

Rehearse at tiny scale on the CPU: `python scripts/device_recipe.py run --out /tmp/dr --device cpu
--utterances 40 --minutes 4 --run /tmp/dr-run`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / ".device-recipe"
# Debian packages whose files the recipe reads (festival's binary, Scheme library and lexicons, the teachers, the
# text sources); festival's shared libraries are added by what `ldd` finds, except the C/C++ runtimes every
# machine has (newer there, and compatible)
DATA_PACKAGES = ("festival", "festlex-cmu", "festlex-poslex", "festvox-us-slt-hts", "festvox-kallpc16k",
                 "festvox-kdlpc16k", "wordnet-base", "fortunes", "fortunes-min", "libasound2-data")
BASE_PACKAGES = frozenset({"libc6", "libstdc++6", "libgcc-s1"})
# what the recipe imports beyond the accelerator image's packages (torch, numpy, pyarrow, safetensors, ... are
# there), at the versions installed here; the image's Python is 3.12
WHEELS = ("soundfile", "soxr", "librosa", "audioread", "decorator", "pooch", "platformdirs", "cffi", "pycparser")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any")
# trainers by stage: rung, and the settings a device run adds (the vocoder with the multi-period critic at the
# documented settings: the figures that moved L1 were trained with it)
STAGES = {"hift": "L1", "flow": "L2", "labeller": "L3", "llm": "L4", "hift-flow": "L2-hift"}
HIFT_GAN = ["hift.adversarial=lsgan", "hift.spec_resolutions=[]", "hift.discriminator_lr=2e-4", "optim.lr=1e-4",
            "hift.period_channels=[8, 16, 32, 64, 64]"]
GATE_MARGIN_S = 45  # stop the trainers this long before the deadline: the gates and copying take the rest


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- fetch (here) ---------------------------------------------------------------------------------------------
def festival_library_packages() -> list[str]:
    """The Debian packages of festival's shared libraries on this machine (`ldd` + `dpkg -S`)."""
    festival = shutil.which("festival")
    if festival is None:
        raise SystemExit("fetch: festival is not installed here (apt-get install festival)")
    out = subprocess.run(["ldd", festival], capture_output=True, text=True, check=True).stdout
    libs = [line.split("=>")[1].split()[0] for line in out.splitlines() if "=>" in line and "/" in line]
    packages = set()
    for lib in libs:
        for path in (os.path.realpath(lib), lib):
            found = subprocess.run(["dpkg", "-S", path], check=False, capture_output=True, text=True)
            if found.returncode == 0:
                packages.add(found.stdout.split(":")[0])
                break
    return sorted(packages - BASE_PACKAGES)


def fetch(dest: Path) -> None:
    debs, wheels = dest / "debs", dest / "wheels"
    for d in (debs, wheels):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    packages = [*DATA_PACKAGES, *festival_library_packages()]
    log(f"debs: {' '.join(packages)}")
    subprocess.run(["apt-get", "download", "-qq", *packages], cwd=debs, check=True)
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    log(f"wheels: {' '.join(pins)}")
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platform_args, "-d", str(wheels), *pins],
                   check=True)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    log(f"{dest}: {len(list(debs.iterdir()))} debs, {len(list(wheels.iterdir()))} wheels, {size / 1e6:.1f} MB")


# ---- run (there) ----------------------------------------------------------------------------------------------
def unpack(bundle: Path, root: Path) -> dict[str, str]:
    """The debs under `root`, festival's paths pointed there, a wrapper in root/bin. -> environment additions."""
    root.mkdir(parents=True, exist_ok=True)
    for deb in sorted((bundle / "debs").glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    share = root / "usr" / "share"
    lib = share / "festival"
    for scm in ("voices.scm", "lexicons.scm", "languages.scm"):  # Debian's absolute voice, lexicon, language paths
        path = lib / scm
        path.write_text(path.read_text(encoding="utf-8").replace('"/usr/share/festival/', f'"{lib}/'),
                        encoding="utf-8")
    libs = [root / "usr/lib/x86_64-linux-gnu", root / "lib/x86_64-linux-gnu", root / "usr/lib/x86_64-linux-gnu/pulseaudio"]
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "festival"
    wrapper.write_text("#!/bin/sh\n"
                       # Debian's festival reads init.scm under --datadir (--libdir alone leaves the built-in path)
                       f"LD_LIBRARY_PATH={':'.join(map(str, libs))} exec {root}/usr/bin/festival --libdir {lib} --datadir {lib} \"$@\"\n")
    wrapper.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "VOCALIS_SHARE_DIR": str(share)}


def install_wheels(bundle: Path, site: Path) -> str:
    """The bundle's wheels of packages this Python lacks into `site` (not over the image's own packages; each
    wheel's distribution name is its module's). -> site, for PYTHONPATH."""
    wheels = sorted(str(w) for w in (bundle / "wheels").glob("*.whl")
                    if importlib.util.find_spec(w.name.split("-")[0].lower()) is None)
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *wheels], check=True)
    return str(site)


def recipe(run: Path, *args: str) -> list[str]:
    return [sys.executable, str(REPO / "scripts" / "train_builtin.py"), str(run), *args]


def newest_step(run_dir: Path) -> int | None:
    steps = sorted(run_dir.glob("checkpoints/step_*.pt")) if run_dir.is_dir() else []
    return int(steps[-1].stem.split("_")[1]) if steps else None


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    deadline = start + args.minutes * 60
    out, run_dir = args.out.resolve(), args.run.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    summary: dict[str, object] = {"device": args.device, "utterances": args.utterances, "voices": args.voices,
                                  "minutes": args.minutes}
    env = dict(os.environ)
    env.update(unpack(args.bundle, Path("/tmp/vocalis-root")))
    env["PYTHONPATH"] = os.pathsep.join([install_wheels(args.bundle, Path("/tmp/vocalis-site")), str(REPO),
                                         env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    cores = os.cpu_count() or 1
    summary["setup_s"] = round(time.monotonic() - start, 1)
    log(f"set up in {summary['setup_s']} s; {cores} cores")

    t = time.monotonic()
    with open(out / "logs" / "data.log", "w") as f:
        done = subprocess.run(recipe(run_dir, "--only", "corpus", "prep", "labels", "--utterances",
                                     str(args.utterances), "--voices", *args.voices, "--workers", str(cores)),
                              env={**env, "OMP_NUM_THREADS": "1"}, stdout=f, stderr=subprocess.STDOUT, check=False)
    summary["data_s"] = round(time.monotonic() - t, 1)
    if done.returncode != 0:
        log(f"data stages failed (logs/data.log), {summary['data_s']} s")
        summary["failed"] = "data"
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        return 1
    log(f"corpus, features and labels in {summary['data_s']} s")

    threads = str(max(1, cores // len(args.stages)))
    procs = {}
    for stage in args.stages:
        option, sets = {"hift": ("--hift-set", HIFT_GAN + args.hift_set),
                        "flow": ("--flow-set", args.flow_set)}.get(stage, ("", []))
        extra = [a for s in sets for a in (option, s)]
        f = open(out / "logs" / f"{stage}.log", "w")  # noqa: SIM115 - open while the trainer runs
        procs[stage] = (subprocess.Popen(recipe(run_dir, "--only", stage, "--voices", *args.voices, "--device",
                                                args.device, "--save-every", str(args.save_every), *extra),
                                         env={**env, "OMP_NUM_THREADS": threads}, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True), f)
    log(f"trainers: {', '.join(args.stages)} on {args.device}, until {GATE_MARGIN_S} s before the deadline")
    t = time.monotonic()
    while time.monotonic() < deadline - GATE_MARGIN_S and any(p.poll() is None for p, _ in procs.values()):
        time.sleep(2)
    for stage, (p, f) in procs.items():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        f.close()
    summary["train_s"] = round(time.monotonic() - t, 1)

    gates = {}
    hift_dir = run_dir / "hift-c128" if (run_dir / "hift-c128").is_dir() else run_dir / "hift"
    for stage in args.stages:
        # more than one voice: the vocoder, flow and labeller are the three-voice parts (L6)
        rung = "L6" if len(args.voices) > 1 and stage in ("hift", "flow", "labeller") else STAGES[stage]
        step = newest_step(hift_dir if stage == "hift" else run_dir / stage)
        gates[stage] = {"rung": rung, "step": step}
    for rung in dict.fromkeys(g["rung"] for g in gates.values() if g["step"] is not None):  # L6 gates its parts once
        subprocess.run(recipe(run_dir, "--gate", rung), env=env, check=False, stdout=subprocess.DEVNULL)
    if (run_dir / "gates").is_dir():
        shutil.copytree(run_dir / "gates", out / "gates", dirs_exist_ok=True)
    summary["gates"] = gates
    summary["total_s"] = round(time.monotonic() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"done in {summary['total_s']} s: {json.dumps(gates)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fp = sub.add_parser("fetch", help="here: the debs and wheels the device run needs")
    fp.add_argument("--dest", type=Path, default=BUNDLE)
    rp = sub.add_parser("run", help="there: the recipe against a deadline")
    rp.add_argument("--out", type=Path, required=True, help="where the gates, logs and summary.json go ($OUT)")
    rp.add_argument("--minutes", type=float, required=True, help="wall-clock budget of the whole run")
    rp.add_argument("--bundle", type=Path, default=BUNDLE)
    rp.add_argument("--run", type=Path, default=Path("/tmp/vocalis-run"), help="the recipe's run folder")
    rp.add_argument("--device", default="cuda")
    rp.add_argument("--utterances", type=int, default=4000, help="corpus sentences per voice")
    rp.add_argument("--voices", nargs="+", default=["slt"], choices=("slt", "kal", "ked"))
    rp.add_argument("--save-every", type=int, default=100, help="trainer steps between checkpoints")
    rp.add_argument("--stages", nargs="+", choices=tuple(STAGES), default=["hift", "flow", "labeller", "llm"],
                    help="hift-flow: L2's vocoder, tuned on the committed flow's mels (made on the device first)")
    rp.add_argument("--hift-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra vocoder setting (after the critic settings)")
    rp.add_argument("--flow-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra flow setting (a GPU affords larger batches than the CPU recipe's)")
    args = ap.parse_args()
    if args.cmd == "fetch":
        fetch(args.dest)
        return 0
    if not (args.bundle / "debs").is_dir():
        raise SystemExit(f"run: no bundle at {args.bundle} (make it here with `fetch`, carry it there)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
