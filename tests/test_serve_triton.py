"""`vocalis export-triton`: the repository it writes, and that repository served by a real Triton server.

The server test needs the tritonserver binary the `nvidia-pytriton` wheel bundles, in a venv made from Debian's
python3 with numpy<2 and vocalis installed (`scripts/triton_venv.sh DIR`), named by $VOCALIS_TRITON_VENV;
without it the test is skipped (building that venv takes minutes, too long for every test run).
"""

from __future__ import annotations

import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_support import free_port, make_quick_tiny_model_dir, quick_tts


def export(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vocalis", "export-triton", str(out), *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_export_writes_a_decoupled_python_repository(tmp_path: Path, tmp_path_factory) -> None:
    quick_tts(tmp_path_factory)
    from serve_support import _QUICK

    model = Path(str(_QUICK["dir"]))
    r = export(tmp_path / "repo", "--model", str(model), "--max-batch-size", "4", "--precision", "int8",
               "--flow-steps", "4", "--final-chunk", "causal", "--max-streams", "6")
    assert r.returncode == 0, r.stderr
    repo = tmp_path / "repo"
    config = (repo / "vocalis" / "config.pbtxt").read_text()
    for needle in ('backend: "python"', "decoupled: true", "dynamic_batching", "max_batch_size: 4",
                   f'string_value: "{model}"', 'name: "TEXT", data_type: TYPE_STRING', 'name: "AUDIO"', "KIND_CPU"):
        assert needle in config, needle
    # the model loads with what the flags said (the same options `vocalis serve` takes)
    from vocalis.model_options import ModelOptions

    params = dict(re.findall(r'key: "(\w+)", value: \{ string_value: "([^"]*)" \}', config))
    assert ModelOptions.from_params(params) == ModelOptions(precision="int8", flow_steps=4, final_chunk="causal",
                                                            max_streams=6)
    assert ModelOptions.from_params(ModelOptions().as_params()) == ModelOptions()
    py_compile.compile(str(repo / "vocalis" / "1" / "model.py"), doraise=True)
    assert "tritonserver" in (repo / "Dockerfile").read_text() and "generate_stream" in (repo / "README.md").read_text()
    again = export(tmp_path / "repo")
    assert again.returncode == 2 and "already exists" in again.stderr
    missing = export(tmp_path / "other", "--model", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "not found" in missing.stderr


def triton_venv() -> Path:
    venv = os.environ.get("VOCALIS_TRITON_VENV")
    if not venv:
        pytest.skip("set VOCALIS_TRITON_VENV to a venv made by scripts/triton_venv.sh to run Triton itself")
    found = sorted(Path(venv).glob("lib/python3*/site-packages/pytriton/tritonserver"))
    if not found:
        pytest.fail(f"{venv} has no nvidia-pytriton (run scripts/triton_venv.sh {venv})")
    return found[0]


def start_tritonserver(dist: Path, repo: Path, work: Path) -> tuple[subprocess.Popen, str]:
    """The bundled server, set up as pytriton does: a copy with the stub for this venv's Python version."""
    site = dist.parents[1]
    venv = site.parents[2]
    version = site.parent.name.removeprefix("python")
    server = work / "tritonserver"
    shutil.copytree(dist, server, ignore=shutil.ignore_patterns("python_backend_stubs"))
    shutil.copy(dist / "python_backend_stubs" / version / "triton_python_backend_stub",
                server / "backends" / "python" / "triton_python_backend_stub")
    env = {**os.environ, "LD_LIBRARY_PATH": str(site / "nvidia_pytriton.libs"),
           "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    http, grpc = free_port(), free_port()
    cmd = [str(server / "bin" / "tritonserver"), f"--model-repository={repo}",
           f"--backend-directory={server / 'backends'}", "--http-address=127.0.0.1", f"--http-port={http}",
           "--grpc-address=127.0.0.1", f"--grpc-port={grpc}", "--allow-metrics=false"]
    log = open(work / "triton.log", "w")  # noqa: SIM115  closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{http}"


def sse_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code in (200, 400, 500), r.status_code
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_triton_serves_the_exported_model(tmp_path: Path) -> None:
    dist = triton_venv()
    model = make_quick_tiny_model_dir(tmp_path / "model")
    flags = ["--flow-steps", "3", "--final-chunk", "causal"]  # the Triton model must load with them
    assert export(tmp_path / "repo", "--model", str(model), *flags).returncode == 0
    proc, url = start_tritonserver(dist, tmp_path / "repo", tmp_path)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "triton.log").read_text()
            try:
                if httpx.get(url + "/v2/models/vocalis/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "triton.log").read_text()
            time.sleep(0.3)
        text = "Hello there, this sentence is long enough that the stream sends several chunks back to the client."
        events = sse_events(url + "/v2/models/vocalis/generate_stream", {"TEXT": text, "SEED": 7})
        assert len(events) >= 2 and all("AUDIO" in e for e in events)  # several streamed responses
        assert {e["SAMPLE_RATE"][0] if isinstance(e["SAMPLE_RATE"], list) else e["SAMPLE_RATE"] for e in events} == {
            24000}
        got = np.concatenate([np.asarray(e["AUDIO"], dtype=np.float32).reshape(-1) for e in events])
        from vocalis.model_options import ModelOptions

        with ModelOptions(flow_steps=3, final_chunk="causal").load(str(model)) as tts:
            ref = np.concatenate([c.samples for c in tts.stream(text, seed=7)])
        np.testing.assert_allclose(got, ref, atol=1e-4)
        bad = sse_events(url + "/v2/models/vocalis/generate_stream", {"TEXT": "Hi.", "SPEED": 9.0})
        assert "speed" in json.dumps(bad)
    finally:
        proc.terminate()
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            proc.kill()
