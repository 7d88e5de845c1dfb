# Vocalis HTTP server (OpenAI-compatible /v1/audio/speech, voices, web page, metrics) on CPU.
#   docker build -t vocalis .
#   docker run -p 8000:8000 -v $PWD/CosyVoice2-0.5B:/models/cv2:ro -v vocalis-voices:/voices \
#       -e VOCALIS_API_KEY=change-me vocalis --model /models/cv2
# Without --model the built-in model is used (random tiny weights until a trained one ships: noise, not speech).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/vocalis
COPY pyproject.toml README.md ./
COPY vocalis ./vocalis
# The CPU build of torch (the default PyPI wheel pulls CUDA libraries).
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu ".[serve]" \
    && useradd --create-home --uid 1000 vocalis && mkdir -p /voices && chown vocalis /voices
USER vocalis
EXPOSE 8000
VOLUME ["/voices"]
HEALTHCHECK --interval=30s --timeout=5s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
ENTRYPOINT ["vocalis", "serve", "--host", "0.0.0.0", "--port", "8000", "--voices-dir", "/voices"]
CMD []
