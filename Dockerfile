# Vocalis HTTP server (OpenAI-compatible /v1/audio/speech, voices, web page, metrics). Two images:
#   docker build -t vocalis .                          # CPU (torch's CPU wheel)
#   docker build -t vocalis:cuda --target cuda .       # NVIDIA GPUs (torch's CUDA wheel; run with --gpus all)
#   docker run -p 8000:8000 -v vocalis-voices:/voices -e VOCALIS_API_KEY=change-me vocalis
#   docker run --gpus all -p 8000:8000 -v $PWD/CosyVoice2-0.5B:/models/cv2:ro vocalis:cuda --model /models/cv2
# Without --model the built-in model speaks (English; voices default, kal, ked). The native CPU kernels are compiled
# while the image is built (both instruction-set levels), so a container never compiles them.
FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TORCH_EXTENSIONS_DIR=/opt/vocalis/kernels
WORKDIR /opt/vocalis
COPY pyproject.toml README.md ./
COPY vocalis ./vocalis
# libgomp1: the kernels' OpenMP runtime; g++ only while they compile (below)
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/* \
    && printf '%s\n' 'set -e' 'apt-get update -qq' 'apt-get install -y -qq --no-install-recommends g++' \
        'python -m vocalis.kernels.build --isa all' 'apt-get purge -y -qq --auto-remove g++' \
        'rm -rf /var/lib/apt/lists/*' > /usr/local/bin/build-kernels \
    && useradd --create-home --uid 1000 vocalis && mkdir -p /voices && chown vocalis /voices
EXPOSE 8000
VOLUME ["/voices"]
HEALTHCHECK --interval=30s --timeout=5s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
ENTRYPOINT ["vocalis", "serve", "--host", "0.0.0.0", "--port", "8000", "--voices-dir", "/voices"]
CMD []

# torch from PyPI: the CUDA build with its CUDA libraries
FROM base AS cuda
RUN pip install ".[serve]" && sh /usr/local/bin/build-kernels
USER vocalis

# torch's CPU build (the PyPI default pulls CUDA libraries); the default target
FROM base AS cpu
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu ".[serve]" && sh /usr/local/bin/build-kernels
USER vocalis
