# collab volunteer/coordinator image: `docker run IMAGE join --coordinator http://HOST:8000`
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/collab

# Install torch first so its variant (CPU or CUDA) can be chosen at build time; the project then reuses it.
ARG TORCH_SPEC="torch>=2.1"
RUN pip install "${TORCH_SPEC}"

COPY pyproject.toml README.md ./
COPY collab ./collab
COPY peers ./peers
COPY monitor ./monitor
COPY configs ./configs
RUN pip install .

ENTRYPOINT ["collab"]
CMD ["--help"]
