"""`vocalis export-triton OUT`: a Triton Inference Server model repository for Vocalis.

    OUT/<name>/config.pbtxt   Python backend, decoupled (one response per audio chunk), dynamic batching
    OUT/<name>/1/model.py     vocalis/serve/triton/model.py (loads `TTS` from the `model_dir` parameter)
    OUT/Dockerfile            Triton's container + vocalis, serving this repository
    OUT/README.md             how to run and call it

The Python environment Triton's Python-backend stub runs in must have `vocalis` installed (the Dockerfile does
that). Clients stream with gRPC (`tritonclient.grpc` `start_stream`/`async_stream_infer`) or over HTTP with
`POST /v2/models/<name>/generate_stream` (server-sent events).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from vocalis.errors import InputError
from vocalis.model_options import ModelOptions

TEMPLATE = Path(__file__).resolve().parent / "triton" / "model.py"

_CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
model_transaction_policy {{ decoupled: true }}
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
input [
  {{ name: "TEXT", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "VOICE", data_type: TYPE_STRING, dims: [ 1 ], optional: true }},
  {{ name: "INSTRUCT", data_type: TYPE_STRING, dims: [ 1 ], optional: true }},
  {{ name: "SPEED", data_type: TYPE_FP32, dims: [ 1 ], optional: true }},
  {{ name: "SEED", data_type: TYPE_INT64, dims: [ 1 ], optional: true }}
]
output [
  {{ name: "AUDIO", data_type: TYPE_FP32, dims: [ -1 ] }},
  {{ name: "SAMPLE_RATE", data_type: TYPE_INT32, dims: [ 1 ] }}
]
instance_group [ {{ count: 1, kind: {kind} }} ]
parameters {{ key: "model_dir", value: {{ string_value: "{model_dir}" }} }}
parameters {{ key: "torch_threads", value: {{ string_value: "{threads}" }} }}
{model_options}"""

_DOCKERFILE = """\
# Triton + Vocalis. Build from the folder `vocalis export-triton` wrote, with the Vocalis source (or a wheel)
# copied in as ./vocalis-src:   docker build -t vocalis-triton .
FROM nvcr.io/nvidia/tritonserver:25.01-py3
COPY vocalis-src /opt/vocalis-src
RUN pip install --no-cache-dir /opt/vocalis-src
COPY {name} /models/{name}
EXPOSE 8000 8001 8002
CMD ["tritonserver", "--model-repository=/models"]
"""

_README = """\
# Vocalis on Triton

Model `{name}`: Python backend, decoupled streaming (one response per audio chunk, the last one flagged final),
dynamic batching (max batch {max_batch_size}). Inputs: TEXT (string), optional VOICE, INSTRUCT (strings),
SPEED (fp32), SEED (int64). Outputs: AUDIO (fp32 samples), SAMPLE_RATE (int32).

Run: `tritonserver --model-repository=$PWD` in an environment where `pip install vocalis` was done (see
Dockerfile; on a GPU host export with `--gpu` or set `kind: KIND_GPU` in config.pbtxt). Model weights: the `model_dir` parameter
(`{model_dir}`; empty = the built-in model) must exist inside the container — mount it there. The `precision`,
`backend`, `flow_steps`, `final_chunk`, `token2wav_cache_mib` and `max_streams` parameters are `vocalis serve`'s
flags of the same names (empty = the default).

Stream over HTTP (server-sent events):

    curl -N -X POST localhost:8000/v2/models/{name}/generate_stream -d '{{"TEXT": "Hello there.", "SEED": 1}}'

or with gRPC: `tritonclient.grpc.InferenceServerClient(...).start_stream(callback)` then `async_stream_infer`.
"""


def export_triton(out: Path, model: str | None = None, *, name: str = "vocalis", max_batch_size: int = 8,
                  gpu: bool = False, threads: int = 0, options: ModelOptions | None = None) -> Path:
    """Write the repository; refuses to overwrite an existing model folder. `options` (precision, backend, flow
    steps, final chunk, cache budget) become parameters the Triton model loads with; the device is the instance's."""
    if not name.replace("_", "").replace("-", "").isalnum():
        raise InputError(f"invalid Triton model name {name!r}: use letters, digits, '_' and '-'")
    if max_batch_size < 1:
        raise InputError("--max-batch-size must be at least 1")
    model_dir = ""
    if model is not None:
        path = Path(model).expanduser().resolve()
        if not path.is_dir():
            raise InputError(f"model directory not found: {path}")
        model_dir = str(path)
    target = out / name
    if target.exists():
        raise InputError(f"{target} already exists; choose another OUT folder or --name")
    (target / "1").mkdir(parents=True)
    fields = {"name": name, "max_batch_size": max_batch_size, "model_dir": model_dir.replace('"', '\\"'),
              "kind": "KIND_GPU" if gpu else "KIND_CPU", "threads": threads,
              "model_options": "".join(f'parameters {{ key: "{k}", value: {{ string_value: "{v}" }} }}\n'
                                       for k, v in (options or ModelOptions()).as_params().items())}
    (target / "config.pbtxt").write_text(_CONFIG.format(**fields))
    shutil.copyfile(TEMPLATE, target / "1" / "model.py")
    (out / "Dockerfile").write_text(_DOCKERFILE.format(**fields))
    (out / "README.md").write_text(_README.format(**fields))
    return out
